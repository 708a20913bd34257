"""replaygen's Mamba-3 SISO decode beside state-spaces/mamba's Triton `mamba3_siso_step`, on one GPU, in one process,
same inputs (issue 54: "our baseline decode at least as fast as mamba3_siso_step").

Their kernel (state-spaces/mamba `mamba_ssm/ops/triton/mamba3/mamba3_siso_step.py`, with its `utils.py` of PTX-asm
cos/sin/tanh approximations) is read at run time from --public, a folder holding those two files; it is not part of
this project. Its import of `mamba_ssm.ops.triton.mamba3.utils` is satisfied here: their utils.py under that name
(with empty parent packages), or, with --exact-trig, exact stand-ins of our own (tl.cos, tl.sin, tanh by the
sigmoid, tl.sigmoid, x * sigmoid(x)) so that Triton's CPU interpreter can run it; it is then not their shipped
kernel (their approximate trig moves the angle by up to ~5e-4 relative per step on the GPU).

Mapping (`public_args`): their kernel takes what `Mamba3.step` computes before it, per token:
    Q, K     [b, G, N]  RMSNorm(C) * C_norm, RMSNorm(B) * B_norm (eps of the spec), float32
    V, Z     [b, H, P]  x, z (the activation dtype; Z None without the gate)
    DT       [b, H]     softplus(dd_dt + dt_bias)
    ADT      [b, H]     -max(heavy_tail(dd_A), A_floor) * DT   (the log decay)
    Trap     [b, H]     trap, raw (their kernel applies the sigmoid)
    Q_bias, K_bias [H, N]  C_bias, B_bias
    Angles   [b, H, A]  angles [b, A] broadcast over the heads (a stride-0 view where we launch their kernel;
                        their wrapper copies it)
    D        [H]        D
    Input_States        (angle [b, H, A], ssm [b, H, P, N], k [b, H, N], v [b, H, P]) = our SlotStates'
                        (angle, state, last_key, last_value): the same layouts (state value-major, [H, P, N]).
Their kernel pairs rotary channels (2i, 2i + 1), turns the first A pairs (A = Angles.shape[-1], even, <= N/2) and
needs N and P powers of two (tl.arange); replaygen's SISO shapes rotate adjacent pairs, int(N * 0.5) / 2 of them:
`expressible` says where a shape cannot be run by their kernel (MIMO, halves pairing, an odd angle count, N or P not
a power of two, grouped keys whose bias per head they also take per head: that one is fine).

Check (`check_mapping`): from the same random states, `steps` chained tokens through their wrapper
`mamba3_siso_step` (each step's output states fed to the next), our `baseline_decode`, and the float64
`replaygen.reference.Reference`: outputs, SSM state, angle (mod 2 pi), previous key and value after every step.
Their readout is a bfloat16 tl.dot (state and rotated query rounded to bfloat16, float32 accumulation), so their
outputs are held to bfloat16's tolerance whatever the activation dtype; their states to float32's with exact trig,
and with their approximate trig on the GPU to APPROX_STATE / APPROX_ANGLE per step.

Timing (GPU; as replaygen.measure does): each kernel on layer states of its own, enough of them to exceed 4x L2
(`cold_layers`), random inputs (the same for all: `DecodeWorkload`'s, mapped), one CUDA graph of L = capacity steps
over every layer, medians of 30 graph replays with the 20-80% spread, per layer step. Their kernel writes its states
to separate outputs and cannot run in place (it stores the new key state before it loads the previous one, so in
place it would read its own new key), and its wrapper allocates the outputs per call: rows "theirs, ping-pong"
launch their (autotuned) kernel directly, alternating two state sets per layer, with the V state (which their kernel
does not write: the wrapper returns the input V as the next V state) copied into the next set by a torch copy; the
row "theirs, kernel only" leaves that copy out (the V state read from a set that holds its last value). Their
inputs are already preprocessed (norms, softplus, log decay: not timed; replaygen's kernels do that inside), and
their states are per batch row without slot indirection: both favour them. Their autotune key holds no batch size,
so its cache is cleared at every batch (each batch gets their best config). replaygen rows: baseline decode (`slots`
indirection, in place) and replay decode of the module built for --gpu (its dispatch table's route and flush_at,
rows staggered). Copy fraction: bytes of `traffic.baseline_decode_bytes` (theirs: the same state, key, value, angle
read and written, plus its inputs) or `replay_decode_bytes` over the time, against `copy_bandwidth` measured in the
same run.

    python docs/experiments/vs_mamba3_step.py --public .gpu/public/mamba_ssm_mamba3 --gpu h200 --out /tmp/vs_mamba3_step.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from replaygen.harness import TOLERANCE, InputFactory, angle_error, load_reference, relative_error  # noqa: E402
from replaygen.reference import Reference  # noqa: E402
from replaygen.runtime import import_file, import_path, load_kernels  # noqa: E402
from replaygen.spec import load_spec  # noqa: E402
from replaygen.spec.model import DType, RotaryPairing  # noqa: E402
from replaygen.traffic import baseline_decode_bytes, replay_decode_bytes  # noqa: E402

UTILS_NAME = "mamba_ssm.ops.triton.mamba3.utils"
PUBLIC_FILE = "mamba3_siso_step.py"
# Their approximate trig on the GPU (tanh.approx.f32: ~2^-11 relative): per chained step, the SSM state's and
# previous key's relative error, and the angle's absolute error (radians), allowed against the float64 reference.
APPROX_STATE = 2e-3
APPROX_ANGLE = 2e-3
# Exact trig (--exact-trig): float32 states; outputs at bfloat16's tolerance (their readout is a bfloat16 dot).
EXACT_STATE = 1e-4
EXACT_ANGLE = 1e-5
OUTPUT_TOLERANCE = TOLERANCE[torch.bfloat16]


# --- loading their kernel -------------------------------------------------------------------------------------------


@triton.jit
def _exact_cos(x):
    return tl.cos(x)


@triton.jit
def _exact_sin(x):
    return tl.sin(x)


@triton.jit
def _exact_tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _exact_sigmoid(x):
    return tl.sigmoid(x)


@triton.jit
def _exact_silu(x):
    return x * tl.sigmoid(x)


def load_public(folder: Path, exact_trig: bool) -> types.ModuleType:
    """Their `mamba3_siso_step` module from `folder` (its utils import satisfied: their utils.py, or with `exact_trig`
    exact helpers of ours). Under Triton's interpreter its autotuner keeps one config (no benchmarking there)."""
    folder = Path(folder)
    if not (folder / PUBLIC_FILE).is_file():
        raise FileNotFoundError(f"{folder / PUBLIC_FILE} not found (--public names the folder holding it and utils.py)")
    parts = UTILS_NAME.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        package = sys.modules.get(name)
        if package is None or not hasattr(package, "__path__"):
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], package)
    if exact_trig:
        utils = types.ModuleType(UTILS_NAME)
        utils.__dict__.update(cos_approx=_exact_cos, sin_approx=_exact_sin, tanh_approx=_exact_tanh, sigmoid_approx=_exact_sigmoid, silu=_exact_silu)
        sys.modules[UTILS_NAME] = utils
    else:
        utils = import_file(UTILS_NAME, folder / "utils.py")
    setattr(sys.modules[".".join(parts[:-1])], parts[-1], utils)
    public = import_file("public_mamba3_siso_step" + ("_exact" if exact_trig else ""), folder / PUBLIC_FILE)
    kernel = public.mamba3_siso_step_kernel
    if _interpreted():
        _patch_interpreter_bf16_dot()
        if len(getattr(kernel, "configs", ())) > 1:
            kernel.configs = kernel.configs[:1]
    return public


def _patch_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter multiplies bfloat16 dot operands as their raw uint16 bits (outputs ~1e10): widen them
    to float32 first (their readout is a bfloat16 tl.dot). Idempotent; only under TRITON_INTERPRET."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_bf16_widened", False):
        return
    original = builder.create_dot

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        data = interpreter._convert_float(t.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._bf16_widened = True
    builder.create_dot = create_dot


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --- shapes and the mapping -----------------------------------------------------------------------------------------


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def expressible(spec, shape) -> str | None:
    """None where their kernel can run `shape`, else why not."""
    shape = spec.resolve(shape)
    angles = spec.rotary.angles(shape.key_dim) if spec.rotary else 0
    if shape.rank != 1:
        return f"rank {shape.rank} (MIMO): mamba3_siso_step is SISO only"
    if shape.rotary_pairing is not RotaryPairing.ADJACENT:
        return f"rotary pairing {shape.rotary_pairing.value}: their SISO kernel pairs channels (2i, 2i + 1)"
    if angles % 2 or angles > shape.key_dim // 2 or angles == 0:
        return f"{angles} rotary angles: their wrapper asserts an even count of at most N/2 = {shape.key_dim // 2}"
    if not (_power_of_two(shape.key_dim) and _power_of_two(shape.value_dim)):
        return f"N={shape.key_dim}, P={shape.value_dim}: their tl.arange blocks need powers of two"
    if shape.heads % shape.key_heads:
        return "heads not a multiple of key heads"
    return None


def _rms(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t = t.float()
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def public_args(spec, inputs: dict, weights: dict) -> dict:
    """Their kernel's arguments from replaygen's step inputs and weights (module API names; see the module docstring)."""
    heads = inputs["x"].shape[1]
    dt = F.softplus(inputs["dd_dt"].float() + weights["dt_bias"].float())
    rate = inputs["dd_A"].float()
    heavy = torch.where(rate >= 0, 1 + rate, 1 / (1 - rate.clamp(max=0)))
    log_decay = -torch.clamp(heavy, min=spec.decay.token_rate.floor) * dt
    angles = inputs["angles"].float()
    return {
        "Q": _rms(inputs["C"], weights["C_norm"], spec.query.eps).contiguous(),
        "K": _rms(inputs["B"], weights["B_norm"], spec.key.eps).contiguous(),
        "V": inputs["x"],
        "ADT": log_decay.contiguous(),
        "DT": dt.contiguous(),
        "Trap": inputs["trap"].float().contiguous(),
        "Q_bias": weights["C_bias"].float().contiguous(),
        "K_bias": weights["B_bias"].float().contiguous(),
        "Angles": angles[:, None, :].expand(angles.shape[0], heads, angles.shape[1]),
        "D": weights["D"].float().contiguous(),
        "Z": inputs.get("z"),
    }


def public_states(states) -> tuple[torch.Tensor, ...]:
    """Their Input_States (angle, ssm, k, v) from a module's SlotStates (copies)."""
    return tuple(t.clone().contiguous() for t in (states.angle, states.state, states.last_key, states.last_value))


def check_mapping(public, module, spec, shape, device, act: torch.dtype = torch.float32, steps: int = 3, batch: int = 2, seed: int = 1, exact_trig: bool = True) -> dict:
    """Chain `steps` tokens from the same random states through their wrapper, our baseline_decode and the float64
    reference. Returns the worst errors ("theirs/ours vs reference", "theirs vs ours": outputs, state, angle, key,
    value), the tolerances used, and ok."""
    factory = InputFactory(spec, shape, device, act, seed)
    weights = factory.weights()
    init = factory.full_states(module, batch)
    rows = list(range(batch))
    slots = torch.tensor(rows, dtype=torch.int32, device=device)
    reference = Reference(spec, shape, batch)
    load_reference(reference, rows, init)
    ours = module.allocate_baseline(batch, device)
    ours[slots] = init
    theirs = public_states(init)
    worst: dict[str, float] = {}

    def record(name: str, error: float) -> None:
        worst[name] = max(worst.get(name, 0.0), error if math.isfinite(error) else float("inf"))

    for _ in range(steps):
        inputs = factory.step(batch)
        want = reference.decode(rows, inputs, weights)
        got = module.baseline_decode(ours, slots, **inputs, **weights)
        y, out_states = public.mamba3_siso_step(**public_args(spec, inputs, weights), Input_States=theirs)
        theirs = tuple(t.contiguous() for t in out_states)
        carried = reference.carried
        ref_state = reference.to_layout(carried.state)
        ref_key = carried.last_key.reshape(batch, shape.heads, shape.key_dim)
        for who, (angle, state, key, value), out in (("theirs", theirs, y), ("ours", (ours.angle, ours.state, ours.last_key, ours.last_value), got)):
            record(f"{who} output", relative_error(out, want))
            record(f"{who} state", relative_error(state, ref_state))
            record(f"{who} angle", angle_error(angle, carried.angle) * math.pi)
            record(f"{who} key", relative_error(key, ref_key))
            record(f"{who} value", relative_error(value, carried.last_value))
        record("theirs vs ours output", relative_error(y, got))
        record("theirs vs ours state", relative_error(theirs[1], ours.state))
    state_tol = EXACT_STATE if exact_trig else APPROX_STATE * steps
    angle_tol = EXACT_ANGLE if exact_trig else APPROX_ANGLE * steps
    ours_out_tol = TOLERANCE[act]
    limits = {}
    for name in worst:
        if "output" in name:
            limits[name] = ours_out_tol if name == "ours output" else 2 * OUTPUT_TOLERANCE if "vs" in name else OUTPUT_TOLERANCE
        elif name.endswith("angle"):
            limits[name] = angle_tol if name.startswith("theirs") else EXACT_ANGLE
        elif name.endswith("value"):
            limits[name] = TOLERANCE[act] if name.startswith("theirs") else EXACT_STATE  # theirs returns the input V
        else:
            limits[name] = state_tol if name.startswith("theirs") else EXACT_STATE
    ok = all(worst[n] <= limits[n] for n in worst)
    return {"ok": ok, "worst": worst, "limits": limits, "steps": steps, "batch": batch, "exact_trig": exact_trig}


def describe_check(result: dict) -> str:
    parts = [f"{name} {err:.1e}" + ("" if err <= result["limits"][name] else f" > {result['limits'][name]:.0e}") for name, err in result["worst"].items()]
    return ("ok" if result["ok"] else "FAIL") + f" ({result['steps']} steps, batch {result['batch']}): " + ", ".join(parts)


# --- timing ---------------------------------------------------------------------------------------------------------


def launch_public(public, args: dict, source: tuple, target: tuple, out: torch.Tensor) -> None:
    """Their kernel from the `source` states (angle, ssm, k, v) into `target` (angle, ssm, k written; v not), output
    into `out`: the launch their wrapper makes, with our buffers (and the angles' stride-0 head view)."""
    q, k, v, adt, dt, trap, qb, kb, ang, d, z = (args[n] for n in ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z"))
    batch, heads_qk, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    strides = [*q.stride(), *k.stride(), *v.stride(), *adt.stride(), *dt.stride(), *trap.stride(), *qb.stride(), *kb.stride(), *ang.stride(), d.stride(0)]
    strides += list(z.stride()) if z is not None else [0, 0, 0]
    for t in (*source, out, *target[:3]):
        strides += list(t.stride())
    public.mamba3_siso_step_kernel[(heads, batch)](
        q, k, v, adt, dt, trap, qb, kb, ang, d, z, *source, out, *target[:3], *strides,
        heads_qk, key_dim, value_dim, ang.shape[-1], HAS_D=True, HAS_Z=z is not None,
    )


class PublicDecode:
    """Their kernel on layer states of its own: two state sets per layer (angle, ssm, k, v; float32, v in the
    activation dtype as Mamba3's cache keeps it), alternating each step."""

    def __init__(self, public, spec, inputs: list[dict], weights: dict, batch: int, device):
        self.public = public
        self.args = [public_args(spec, x, weights) for x in inputs]
        self.out = [torch.empty_like(a["V"]) for a in self.args]
        self.sets = []
        for a in self.args:
            b, h, p = a["V"].shape
            n, angles = a["Q"].shape[-1], a["Angles"].shape[-1]
            pair = []
            for _ in range(2):
                pair.append((
                    torch.rand(b, h, angles, device=device) * 2 * math.pi, torch.randn(b, h, p, n, device=device) * 0.5,
                    torch.randn(b, h, n, device=device) * 0.5, (torch.randn(b, h, p, device=device) * 0.5).to(a["V"].dtype),
                ))
            self.sets.append(pair)
        self.phase = 0

    def step(self, copy_value: bool) -> None:
        for args, out, pair in zip(self.args, self.out, self.sets):
            source, target = pair[self.phase], pair[1 - self.phase]
            launch_public(self.public, args, source, target, out)
            if copy_value:
                target[3].copy_(args["V"])
        self.phase = 1 - self.phase


def time_public(kernel: PublicDecode, steps: int, copy_value: bool):
    from replaygen.measure import capture, time_callable

    kernel.public.mamba3_siso_step_kernel.cache.clear()
    kernel.step(copy_value)  # autotune outside the graph, at this batch
    kernel.step(copy_value)
    torch.cuda.synchronize()

    def cycle() -> None:
        for _ in range(steps):
            kernel.step(copy_value)

    graph = capture(cycle)
    return time_callable(graph.replay, repeats=30, per_call=steps * len(kernel.args))


REPLAY_ROW = "replaygen replay decode"


def run_timing(args, spec, shape, public, module, device, bandwidth: float) -> list[dict]:
    from replaygen.measure import DecodeWorkload, cold_layers

    act = torch.bfloat16
    base_bytes = baseline_decode_bytes(spec, shape, DType.BFLOAT16).total
    steps = shape.capacity + shape.capacity % 2  # even: the ping-pong comes back to its first set
    rows = []
    for batch in args.batch:
        layers = cold_layers(spec, shape, batch, device)
        work = DecodeWorkload(module, spec, shape, batch, act, device, layers=layers)
        theirs = PublicDecode(public, spec, work.inputs, work.weights, batch, device)
        config = module._pick(module._REPLAY_DECODE_CONFIGS, batch)
        route, flush_at = config["route"], config["flush_at"] or shape.capacity
        timings = {
            "theirs, ping-pong + V copy": time_public(theirs, steps, True),
            "theirs, kernel only": time_public(theirs, steps, False),
            "replaygen baseline decode": work.time_baseline(steps),
            REPLAY_ROW: work.time_replay(route, flush_at),
        }
        strict, engine = timings["theirs, kernel only"].median_ms, timings["theirs, ping-pong + V copy"].median_ms
        for name, t in timings.items():
            moved = batch * (replay_decode_bytes(spec, shape, DType.BFLOAT16, flush_at).total if name == REPLAY_ROW else base_bytes)
            rows.append({
                "batch": batch, "kernel": name, "config": f"{route}, flush_at {flush_at}" if name == REPLAY_ROW else "", "layers": layers, "us": t.median_ms * 1e3, "p20_us": t.p20_ms * 1e3, "p80_us": t.p80_ms * 1e3,
                "vs_theirs": strict / t.median_ms, "vs_theirs_with_copy": engine / t.median_ms,
                "copy_fraction": moved / (t.median_ms * 1e-3) / bandwidth,
            })
            r = rows[-1]
            label = f"{name} ({r['config']})" if r["config"] else name
            print(f"b{batch:<4d} {label:48s} {r['us']:9.2f} us ({r['p20_us']:.2f}-{r['p80_us']:.2f})  x{r['vs_theirs']:.3f} of their kernel"
                  f"  x{r['vs_theirs_with_copy']:.3f} of theirs + V copy  {r['copy_fraction']:.1%} copy", flush=True)
        del work, theirs
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    lines = ["| kernel | " + " | ".join(f"b{b}" for b in batches) + " |", "|---|" + "---:|" * len(batches)]
    for k in kernels:
        cells = []
        for b in batches:
            r = next(r for r in rows if r["kernel"] == k and r["batch"] == b)
            config = f", {r['config']}" if r["config"] else ""
            cells.append(f"{r['us']:.1f} ({r['vs_theirs']:.2f}x, {r['vs_theirs_with_copy']:.2f}x, {r['copy_fraction']:.0%}{config})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nus per layer step (median); in brackets: their kernel-only time over the row's (>1: faster than their"
                               " kernel), their ping-pong + V copy time over the row's, the copy bandwidth fraction, and the replay's route and"
                               " flush threshold at that batch (its module's dispatch table)")


# --- main -------------------------------------------------------------------------------------------------------------


def _module(args, spec, shape):
    """The module built for --gpu (in --generated, default the project's generated/), else rendered from the spec."""
    path = (args.generated or ROOT / "generated") / args.gpu / f"{spec.name}_{shape.ident}.py"
    if path.is_file():
        return import_path(path), str(path)
    return load_kernels(spec, shape), "rendered from the spec (defaults)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public", type=Path, required=True, help="folder with state-spaces/mamba's mamba3_siso_step.py and utils.py")
    parser.add_argument("--gpu", default="h200", help="the shipped modules' GPU (GENERATED/GPU)")
    parser.add_argument("--generated", type=Path, default=None, help="folder of built modules (default: the project's generated/)")
    parser.add_argument("--spec", type=Path, default=ROOT / "specs" / "mamba3.yaml")
    parser.add_argument("--shape", default="mamba3", help="a shape of --spec (default mamba3: SISO, N=128, P=64, 64 heads, adjacent pairs)")
    parser.add_argument("--batch", default="1,8,32,128,256,512")
    parser.add_argument("--check-steps", type=int, default=4)
    parser.add_argument("--check-only", action="store_true", help="the mapping check alone, no timing")
    parser.add_argument("--exact-trig", action="store_true", help="their approximate trig/activation helpers swapped for exact tl ones (runs under the interpreter; not their shipped kernel)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    spec = load_spec(args.spec)
    shape = spec.shape(args.shape)
    reason = expressible(spec, shape)
    if reason:
        print(f"shape {shape.name} cannot be expressed for mamba3_siso_step: {reason}")
        sys.exit(2)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not _interpreted():
        parser.error("no CUDA device: set TRITON_INTERPRET=1 (with --exact-trig) to run the check on the CPU")
    if not cuda and not args.exact_trig:
        parser.error("their utils use PTX inline asm, which Triton's interpreter cannot run: pass --exact-trig")
    public = load_public(args.public, args.exact_trig)
    module, source = _module(args, spec, shape)
    note = "exact trig stand-ins (NOT their shipped kernel)" if args.exact_trig else "their shipped utils (PTX approximations)"
    print(f"shape {shape.name}: H={shape.heads} G={shape.key_heads} P={shape.value_dim} N={shape.key_dim}, {spec.rotary.angles(shape.key_dim)} angles, adjacent pairs; theirs: {note}; ours: {source}")
    record: dict = {"shape": shape.name, "exact_trig": args.exact_trig, "module": source, "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)"}
    checks = {}
    for act in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        result = check_mapping(public, module, spec, shape, device, act, steps=args.check_steps, batch=4 if cuda else 2, exact_trig=args.exact_trig)
        checks[str(act).removeprefix("torch.")] = result
        print(f"check {str(act).removeprefix('torch.')}: {describe_check(result)}", flush=True)
    record["checks"] = checks
    if cuda and not args.check_only:
        from replaygen.measure import copy_bandwidth

        bandwidth = copy_bandwidth(device)
        print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
        rows = run_timing(args, spec, shape, public, module, device, bandwidth)
        record.update(copy_bandwidth=bandwidth, rows=rows)
        print(markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
