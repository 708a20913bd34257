"""vLLM's Mamba-2 `selective_state_update` beside replaygen's baseline and replay decode at the same state dtype
(float32, bfloat16, float16), on one GPU, in one process, same inputs (issue 59, item 5).

Their kernel is vLLM's `vllm/model_executor/layers/mamba/ops/mamba_ssm.py` (as in github.com/Johnny-Liou/ReplaySSM),
read at run time from --public, a folder holding it with `triton_helpers.py` beside it and its tuned launch configs
under `configs/selective_state_update/` (`headdim=64,dstate=128,device_name=NVIDIA_H200,cache_dtype=float32.json`
and `...float16.json`, which its bfloat16 state shares; NVIDIA_H100_80GB_HBM3's on an H100); they are not part of
this project. Their vLLM imports are stubbed (`vs_vllm_replayssm._stub_vllm`, and here vllm.envs, vllm.logger,
vllm._custom_ops, the platform's device name); the device name picks their JSON config as vLLM's engine does, else
their default heuristic (vLLM's row says which). Their state is rounded to nearest where it is 16-bit: their stochastic rounding (float16 state only) uses
`cvt.rs.f16x2.f32`, a Blackwell-only PTX convert, and is not timed on Hopper (H100, H200).

replaygen's rows, from specs/mamba2.yaml: float32 state `nemotron-h`; bfloat16 state `nemotron-h-bf16` (stochastic
rounding) and `nemotron-h-bf16-nearest` (round to nearest), both shipped; float16 state `nemotron-h-float16` (round to
nearest), a `replaygen.precision.precision_variant` of nemotron-h (as `replaygen drift --variants` builds it); a
shape's module is the one built for --gpu in --generated where it exists, else rendered from the spec with the
documented default configs (`runtime.load_kernels`, as `replaygen drift` does).

Mapping (`vllm_args`): H heads of P values, G key groups of N keys; vLLM's Nemotron-H decode call:
    state  [slots, H, P, N]  the layer's states at the state dtype (replaygen's value_key layout, [H, P, N] a slot);
                             slot 0 is vLLM's null block, so rows use slots 1..batch (`state_batch_indices`)
    x      [b, H, P]         x                            B, C [b, G, N]  B, C (G = key_heads)
    dt     [b, H, P]         dt [b, H], stride 0 over P   dt_bias [H, P]  dt_bias [H], stride 0 over P
    A      [H, P, N]         -exp(A_log) [H], stride 0 over P and N (with dt and dt_bias: their tie_hdim path, one
                             dt and A per head, as vLLM's mixer passes them)
    D      [H, P]            D [H], stride 0 over P       z [b, H, P]     z, or None (Nemotron-H gates in its RMSNorm)
    dt_softplus=True; out [b, H, P] preallocated in the activation dtype; the state updated in place.
All rows get the same tensors: `DecodeWorkload`'s random inputs (bfloat16 activations, dt float32 as replaygen
takes it) and weights.

Check (`check_state_dtype`, before timing): from the same random states (exact at the state dtype), `--check-steps`
chained tokens (default L + 2: replay flushes once; a gate z on every other token) through vLLM's kernel, each
replaygen module's baseline_decode and replay decode (its state read with materialize), and the float64
`replaygen.reference.Reference`: the largest relative error of every step's outputs and new states against the
reference, within replaygen's tolerances at that state dtype (`harness.output_tolerance`, `state_tolerance`), and
of vLLM's against each baseline (twice those). Under Triton's interpreter (`--device cpu`, TRITON_INTERPRET=1; the
shapes reduced as `replaygen drift` reduces them on the CPU) a float32 -> bfloat16 convert truncates, so there vLLM's
and our round-to-nearest bfloat16 states both truncate and are held to each other, not to the reference (their
errors are printed "(truncated)"); a GPU rounds them to nearest and holds them to the reference.

Timing (GPU; as `replaygen.measure` does): per batch and state dtype, every kernel on layer states of its own,
enough of them to exceed 4x L2 (`cold_layers` at that state dtype), one CUDA graph of L = 16 steps over every layer
(replay: whole flush cycles, `DecodeWorkload.time_replay` with the route and flush_at of the module's dispatch table
at that batch, rows flushing together and staggered), medians of 30 graph replays with the 20-80% spread, per layer
step. Columns: us per step; bytes per step (the batch's); % of the device-to-device copy bandwidth measured in the
same run (`copy_bandwidth`); vLLM's time at the same state dtype over the row's (> 1: faster than vLLM).
Bytes per sequence and step: replaygen's from `replaygen.traffic` (`baseline_decode_bytes`, `replay_decode_bytes`
at the flush_at timed); vLLM's (`vllm_bytes`) counted from what its kernel moves: the state read and written whole
(2 H P N at the state dtype's size), x [H, P] and the output [H, P] at the activation dtype, B and C [G, N] at the
activation dtype, dt one value per head at the tensor's dtype (float32 here: the tie_hdim kernel loads one per head);
the weights (A, dt_bias, D: a value per head shared by the batch) and the slot index are left out, as
`replaygen.traffic` leaves them out. So vLLM's bytes are replaygen's baseline bytes plus 2 H (traffic counts dt at
the activation dtype).

    TRITON_INTERPRET=1 python docs/experiments/vs_vllm_ssu.py --public .gpu/public --device cpu --check-only
    python docs/experiments/vs_vllm_ssu.py --public .gpu/public --gpu h200 --out /tmp/vs_vllm_ssu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from replaygen.cli import _reduced
from replaygen.harness import InputFactory, baseline_rounding, load_reference, output_tolerance, relative_error, state_tolerance
from replaygen.precision import precision_variant
from replaygen.reference import Reference
from replaygen.runtime import import_file, import_path, load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import DType, Rounding, Spec, TargetShape
from replaygen.traffic import StepBytes, baseline_decode_bytes, replay_decode_bytes

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OPS = "vllm.model_executor.layers.mamba.ops"
PUBLIC_FILES = ("mamba_ssm.py", "triton_helpers.py")
VLLM = "vLLM selective_state_update"
STATES = ("float32", "bfloat16", "float16")
# replaygen's shapes at each state dtype: (a shape of specs/mamba2.yaml, its precision variant or None for the shape
# as the spec gives it).
OURS = {
    "float32": (("nemotron-h", None),),
    "bfloat16": (("nemotron-h-bf16", None), ("nemotron-h-bf16-nearest", None)),
    "float16": (("nemotron-h", "float16"),),
}
ACT, ACT_DTYPE = torch.bfloat16, DType.BFLOAT16  # the activations timed and checked


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _sibling(name: str) -> types.ModuleType:
    """The experiment script `name`.py beside this one (imported once)."""
    return sys.modules.get(name) or import_file(name, HERE / f"{name}.py")


# --- loading vLLM's file --------------------------------------------------------------------------------------------


class _Logger:
    """vLLM's logger as mamba_ssm.py uses it (info_once, warning_once), over the standard logging module."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    def info_once(self, msg: str, *args: object, **_: object) -> None:
        self._log.info(msg, *args)

    def warning_once(self, msg: str, *args: object, **_: object) -> None:
        self._log.warning(msg, *args)


def _stub(name: str, **attrs: object) -> None:
    sys.modules.setdefault(name, types.ModuleType(name)).__dict__.update(attrs)


def _device_name(device_id: int = 0) -> str:
    """The device name vLLM's platform gives (its config files are named by it), "cpu" without CUDA."""
    return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def load_vllm(folder: Path) -> types.ModuleType:
    """vLLM's mamba_ssm module from `folder` (with triton_helpers.py beside it), its vLLM imports stubbed:
    `_stub_vllm`'s stand-ins plus vllm.envs (no user config folder), vllm.logger, vllm._custom_ops (which
    selective_state_update does not use), the platform's is_xpu and device name, and triton_helpers from `folder`."""
    folder = Path(folder)
    missing = [name for name in PUBLIC_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not found in {folder} (--public names the folder holding vLLM's {' and '.join(PUBLIC_FILES)})")
    _sibling("vs_vllm_replayssm")._stub_vllm(None)
    platform = sys.modules["vllm.platforms"].current_platform
    platform.is_xpu = lambda: False
    platform.get_device_name = _device_name
    _stub("vllm.triton_utils", HAS_TRITON=True)
    _stub("vllm.envs", VLLM_TUNED_CONFIG_FOLDER=None)
    _stub("vllm.logger", init_logger=_Logger)
    _stub("vllm._custom_ops")
    import_file(f"{OPS}.triton_helpers", folder / "triton_helpers.py")
    return import_file("public_vllm_mamba_ssm", folder / "mamba_ssm.py")


def _is_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def vllm_launch_config(public: types.ModuleType, shape: TargetShape, batch: int, state_dtype: torch.dtype) -> dict:
    """vLLM's (BLOCK_SIZE_M, num_warps) at `batch` and where it came from: its JSON for this device, or its heuristic."""
    cache_dtype = str(state_dtype).removeprefix("torch.")
    block_m, warps = public.try_get_optimal_ssm_config(shape.value_dim, shape.key_dim, batch, shape.heads, cache_dtype, _is_blackwell())
    tuned = public.get_ssm_configs(shape.value_dim, shape.key_dim, cache_dtype) is not None
    source = f"tuned for {public.get_ssm_device_name()}" if tuned else "default heuristic"
    return {"BLOCK_SIZE_M": block_m, "num_warps": warps, "source": source}


# --- replaygen's shapes and modules -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ours:
    """One replaygen row set: its shape, its module, and where the module came from."""

    shape: TargetShape
    module: types.ModuleType
    source: str

    @property
    def label(self) -> str:
        return self.shape.name + (" (stochastic)" if self.shape.rounding is Rounding.STOCHASTIC else "")


def our_shapes(spec: Spec, state: str, reduce: bool) -> list[TargetShape]:
    """replaygen's shapes at state dtype `state` (OURS), reduced as `replaygen drift` reduces them on the CPU."""
    shapes = []
    for name, variant in OURS[state]:
        shape = spec.shape(name)
        shape = _reduced(shape) if reduce else shape
        shapes.append(precision_variant(spec, shape, variant) if variant else shape)
    return shapes


def our_module(spec: Spec, shape: TargetShape, folder: Path | None) -> tuple[types.ModuleType, str]:
    """The module of `shape` built in `folder` (GENERATED/GPU) where it exists, else rendered from the spec with the
    documented default configs; and where it came from."""
    path = folder / f"{spec.name}_{shape.ident}.py" if folder else None
    if path and path.is_file():
        return import_path(path), str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return load_kernels(spec, shape), "rendered from the spec (documented defaults)"


def ours_at(spec: Spec, state: str, reduce: bool, folder: Path | None) -> list[Ours]:
    return [Ours(shape, *our_module(spec, shape, folder)) for shape in our_shapes(spec, state, reduce)]


# --- the mapping ------------------------------------------------------------------------------------------------------


def vllm_args(inputs: dict, weights: dict) -> dict:
    """selective_state_update's keyword arguments (less the state, slots and output) from replaygen's Mamba-2 step
    inputs (x [b, H, P], B, C [b, G, N], dt [b, H], z [b, H, P] or None) and weights (A_log, dt_bias, D [H]): the
    per-head values as stride-0 views over P (and N for A), see the module docstring."""
    x = inputs["x"]
    batch, heads, value_dim = x.shape
    key_dim = inputs["B"].shape[-1]
    return {
        "x": x,
        "dt": inputs["dt"][:, :, None].expand(batch, heads, value_dim),
        "A": (-torch.exp(weights["A_log"].float()))[:, None, None].expand(heads, value_dim, key_dim),
        "B": inputs["B"],
        "C": inputs["C"],
        "D": weights["D"][:, None].expand(heads, value_dim),
        "dt_bias": weights["dt_bias"][:, None].expand(heads, value_dim),
        "z": inputs.get("z"),
        "dt_softplus": True,
    }


def vllm_slots(batch: int, device) -> torch.Tensor:
    """vLLM's state_batch_indices [batch] int32: slots 1..batch (slot 0 is its null block)."""
    return torch.arange(1, batch + 1, dtype=torch.int32, device=device)


def vllm_bytes(shape: TargetShape, state_dtype: torch.dtype, act: torch.dtype, dt_dtype: torch.dtype) -> StepBytes:
    """Bytes vLLM's kernel moves per sequence and step (see the module docstring): the state read and written whole,
    x, B, C and dt (one per head) read, the output written; weights and the slot index left out."""
    h, g, p, n = shape.heads, shape.key_heads, shape.value_dim, shape.key_dim
    state = h * p * n * state_dtype.itemsize
    a = act.itemsize
    return StepBytes(state, state, 0.0, 0.0, h * p * a + 2 * g * n * a + h * dt_dtype.itemsize, h * p * a)


# --- the check --------------------------------------------------------------------------------------------------------


def check_state_dtype(public: types.ModuleType, spec: Spec, ours: list[Ours], device, steps: int, batch: int = 2, seed: int = 1) -> dict:
    """Chain `steps` tokens from the same random states through vLLM's kernel (at the state dtype of `ours`), each
    module's baseline_decode and replay decode, and the float64 reference (see the module docstring). Returns the
    worst relative errors by name ("vLLM output", "vLLM state", "<label> baseline output", "<label> replay state",
    "vLLM vs <label> baseline state", ...), their limits, `unheld` (the entries no limit holds: under the
    interpreter, a bfloat16 state rounded to nearest truncates, so vLLM's and our round-to-nearest kernels are held to
    each other there, not to the reference or to a stochastic state), and ok."""
    shape = ours[0].shape
    state_dtype = getattr(torch, shape.state_dtype.value)
    truncates = _interpreted() and state_dtype is torch.bfloat16
    factory = InputFactory(spec, shape, device, ACT, seed)
    weights = factory.weights()
    init = factory.states(batch, (shape.heads, shape.value_dim, shape.key_dim), state_dtype)
    rows = list(range(batch))
    slots = torch.tensor(rows, dtype=torch.int32, device=device)
    reference = Reference(spec, shape, batch)
    load_reference(reference, rows, init)
    theirs = torch.zeros(batch + 1, *init.shape[1:], dtype=state_dtype, device=device)
    theirs[1:] = init
    their_slots = vllm_slots(batch, device)
    their_out = torch.empty(batch, shape.heads, shape.value_dim, dtype=ACT, device=device)
    runs = []
    for o in ours:
        replay = o.module.allocate(batch, device, ACT)
        o.module.load(replay, slots, init)
        runs.append((o, init.clone(), replay, baseline_rounding(o.module, batch, device, seed)))
    worst: dict[str, float] = {}
    unheld: set[str] = set()

    def record(name: str, got: torch.Tensor, want: torch.Tensor, held: bool) -> None:
        error = relative_error(got, want)
        worst[name] = max(worst.get(name, 0.0), error if math.isfinite(error) else float("inf"))
        if not held:
            unheld.add(name)

    for step in range(steps):
        inputs = factory.step(batch, use_gate=step % 2 == 1)
        want = reference.decode(rows, inputs, weights)
        want_state = reference.to_layout(reference.states)
        public.selective_state_update(theirs, **vllm_args(inputs, weights), state_batch_indices=their_slots, out=their_out)
        record("vLLM output", their_out, want, not truncates)
        record("vLLM state", theirs[1:], want_state, not truncates)
        for o, base, replay, rounding in runs:
            nearest = truncates and o.shape.rounding is Rounding.NEAREST
            y = o.module.baseline_decode(base, slots, **inputs, **weights, **rounding)
            record(f"{o.label} baseline output", y, want, not nearest)
            record(f"{o.label} baseline state", base, want_state, not nearest)
            record(f"{o.label} replay output", o.module.decode(replay, slots, **inputs, **weights), want, not nearest)
            record(f"{o.label} replay state", o.module.materialize(replay, slots), want_state, not nearest)
            record(f"vLLM vs {o.label} baseline output", their_out, y, nearest or not truncates)
            record(f"vLLM vs {o.label} baseline state", theirs[1:], base, nearest or not truncates)
    limits = {name: _limit(spec, shape, name) for name in worst}
    ok = all(worst[name] <= limits[name] for name in worst if name not in unheld)
    return {"ok": ok, "worst": worst, "limits": limits, "unheld": sorted(unheld), "steps": steps, "batch": batch, "state": shape.state_dtype.value}


def _limit(spec: Spec, shape: TargetShape, name: str) -> float:
    """The tolerance of a check entry: replaygen's output or state tolerance at the state dtype (the same for every
    shape of one state dtype), twice that between vLLM and a baseline (each may sit that far from the reference)."""
    tolerance = output_tolerance(shape, ACT) if name.endswith("output") else state_tolerance(spec, shape, ACT)
    return 2 * tolerance if name.startswith("vLLM vs") else tolerance


def describe_check(result: dict) -> str:
    """One line: the verdict, then every entry's worst error, "> limit" where over it, "(truncated)" where unheld."""

    def entry(name: str, err: float) -> str:
        if name in result["unheld"]:
            return f"{name} {err:.1e} (truncated)"
        return f"{name} {err:.1e}" + ("" if err <= result["limits"][name] else f" > {result['limits'][name]:.0e}")

    parts = [entry(name, err) for name, err in result["worst"].items()]
    return ("ok" if result["ok"] else "FAIL") + f" ({result['steps']} steps, batch {result['batch']}): " + ", ".join(parts)


# --- timing -----------------------------------------------------------------------------------------------------------


class VllmDecode:
    """vLLM's kernel on layer states of its own: per layer a state [batch + 1, H, P, N] at `state_dtype` (slot 0 its
    null block; random, as the baseline's), the layer's mapped inputs, an output [batch, H, P] preallocated."""

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, batch: int, state_dtype: torch.dtype, device):
        self.fn = public.selective_state_update
        self.args = [vllm_args(x, weights) for x in inputs]
        self.slots = vllm_slots(batch, device)
        self.is_blackwell = _is_blackwell()
        self.states, self.outs = [], []
        for args in self.args:
            _, heads, value_dim = args["x"].shape
            self.states.append((torch.randn(batch + 1, heads, value_dim, args["A"].shape[-1], device=device) * 0.5).to(state_dtype))
            self.outs.append(torch.empty_like(args["x"]))

    def step(self) -> None:
        """One decode step over every layer."""
        for state, args, out in zip(self.states, self.args, self.outs):
            self.fn(state, **args, state_batch_indices=self.slots, out=out, is_blackwell=self.is_blackwell)


def time_vllm(kernel: VllmDecode, steps: int):
    """`replaygen.measure.Timing` per layer step of `kernel` over a graph of `steps` steps."""
    from replaygen.measure import capture, time_callable

    def cycle() -> None:
        for _ in range(steps):
            kernel.step()

    graph = capture(cycle)
    return time_callable(graph.replay, repeats=30, per_call=steps * len(kernel.states))


def _row(state: str, batch: int, kernel: str, shape: str, timing, per_row: float, bandwidth: float, **extra: object) -> dict:
    return {
        "state": state, "batch": batch, "kernel": kernel, "shape": shape, **extra,
        "us": timing.median_ms * 1e3, "p20_us": timing.p20_ms * 1e3, "p80_us": timing.p80_ms * 1e3,
        "bytes_per_step": batch * per_row, "copy_fraction": batch * per_row / (timing.median_ms * 1e-3) / bandwidth,
    }


def time_state_dtype(public: types.ModuleType, spec: Spec, ours: list[Ours], batch: int, device, bandwidth: float) -> list[dict]:
    """Rows of one state dtype at one batch: vLLM's kernel, then each module's baseline decode and replay decode
    (flushes together and staggered), all on the same inputs; `vs_vllm` is vLLM's time over the row's."""
    from replaygen.measure import DecodeWorkload, cold_layers

    bucket = _sibling("vs_vllm_replayssm")._bucket
    shape = ours[0].shape
    state, state_dtype = shape.state_dtype.value, getattr(torch, shape.state_dtype.value)
    layers = cold_layers(spec, shape, batch, device)
    works = [DecodeWorkload(o.module, spec, o.shape, batch, ACT, device, layers=layers) for o in ours]
    theirs = VllmDecode(public, works[0].inputs, works[0].weights, batch, state_dtype, device)
    dt_dtype = works[0].inputs[0]["dt"].dtype
    rows = [_row(state, batch, VLLM, "-", time_vllm(theirs, shape.capacity), vllm_bytes(shape, state_dtype, ACT, dt_dtype).total, bandwidth,
                 rounding="nearest", flushes="-", layers=layers, config=vllm_launch_config(public, shape, batch, state_dtype))]
    for o, work in zip(ours, works):
        common = {"rounding": o.shape.rounding.value, "layers": layers, "module": o.source}
        base = baseline_decode_bytes(spec, o.shape, ACT_DTYPE).total
        rows.append(_row(state, batch, "replaygen baseline", o.label, work.time_baseline(o.shape.capacity), base, bandwidth, flushes="-", **common))
        config = bucket(o.module, batch)
        route, flush_at = config["route"], config["flush_at"] or o.shape.capacity
        replay = replay_decode_bytes(spec, o.shape, ACT_DTYPE, flush_at).total
        for together in (True, False):
            timing = work.time_replay(route, flush_at, together=together)
            rows.append(_row(state, batch, "replaygen replay", o.label, timing, replay, bandwidth, flushes="together" if together else "staggered",
                             route=route, flush_at=flush_at, **common))
    for row in rows:
        row["vs_vllm"] = rows[0]["us"] / row["us"]
        print(_line(row), flush=True)
    del works, theirs
    torch.cuda.empty_cache()
    return rows


def _what(row: dict) -> str:
    """A row's replaygen shape, or for vLLM's row its launch config and where it came from."""
    if row["kernel"] != VLLM:
        return row["shape"]
    config = row["config"]
    return f"BLOCK_SIZE_M {config['BLOCK_SIZE_M']}, {config['num_warps']} warps ({config['source']})"


def _line(row: dict) -> str:
    kernel = f"{row['kernel']} {_what(row)}" + (f" {row['flushes']}" if row["flushes"] != "-" else "")
    return (f"{row['state']:8s} b{row['batch']:<4d} {kernel:60s} {row['us']:9.2f} us ({row['p20_us']:.2f}-{row['p80_us']:.2f})"
            f"  {row['bytes_per_step'] / 1e6:9.2f} MB  {row['copy_fraction']:6.1%} copy  x{row['vs_vllm']:.3f} of vLLM")


def markdown(rows: list[dict]) -> str:
    lines = [
        "| state | kernel | replaygen shape (vLLM: launch) | flushes | batch | us per step (p20-p80) | MB per step | copy | vs vLLM |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (STATES.index(r["state"]), r["batch"])):
        lines.append(
            f"| {r['state']} | {r['kernel']} | {_what(r)} | {r['flushes']} | {r['batch']} | {r['us']:.2f} ({r['p20_us']:.2f}-{r['p80_us']:.2f})"
            f" | {r['bytes_per_step'] / 1e6:.2f} | {r['copy_fraction']:.1%} | {r['vs_vllm']:.2f}x |"
        )
    return "\n".join(lines) + ("\n\nper layer step (median of 30 graph replays); copy: bytes per step over the time against the copy bandwidth"
                               " measured in the same run; vs vLLM: vLLM's time at the same state dtype over the row's (> 1: faster than vLLM)")


# --- main -------------------------------------------------------------------------------------------------------------


def _positive_ints(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        parser.error(f"{flag} takes comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag} takes integers of at least 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public", type=Path, required=True, help="folder with vLLM's mamba_ssm.py, triton_helpers.py and configs/selective_state_update/")
    parser.add_argument("--gpu", default="h200", help="the shipped modules' GPU (GENERATED/GPU)")
    parser.add_argument("--generated", type=Path, default=None, help="folder of built modules (default: the project's generated/)")
    parser.add_argument("--batch", default="1,8,32,128,256,512")
    parser.add_argument("--states", default=",".join(STATES), help=f"comma-separated state dtypes (of {', '.join(STATES)})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: the check alone under Triton's interpreter (TRITON_INTERPRET=1, --check-only), at reduced shapes")
    parser.add_argument("--check-steps", type=int, default=None, help="chained tokens of the check (default L + 2: replay flushes once)")
    parser.add_argument("--check-only", action="store_true", help="the mapping check alone, no timing")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    args.batch = _positive_ints(parser, "--batch", args.batch)
    args.states = [s for s in args.states.split(",") if s]
    if not args.states or set(args.states) - set(STATES):
        parser.error(f"--states takes {', '.join(STATES)}, got {','.join(args.states)!r}")
    if args.check_steps is not None and args.check_steps < 1:
        parser.error(f"--check-steps must be at least 1, got {args.check_steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (run the check on the CPU with TRITON_INTERPRET=1 --device cpu --check-only)")
    if args.device == "cpu" and not (_interpreted() and args.check_only):
        parser.error("--device cpu runs the check alone under Triton's interpreter: set TRITON_INTERPRET=1 and pass --check-only")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    spec = load_spec(ROOT / "specs" / "mamba2.yaml")
    public = load_vllm(args.public)
    folder = None if cpu else (args.generated or ROOT / "generated") / args.gpu
    groups = {state: ours_at(spec, state, cpu, folder) for state in args.states}
    name = "cpu (interpreter)" if cpu else torch.cuda.get_device_name()
    note = f"vLLM's stochastic rounding (float16 state, Blackwell-only cvt.rs PTX) is not timed on {name}"
    print(f"{VLLM} beside replaygen, activations {ACT_DTYPE.value}; {note}", flush=True)
    record: dict = {"device": name, "activations": ACT_DTYPE.value, "vllm_stochastic_rounding": note, "modules": {}, "checks": {}}
    for state, ours in groups.items():
        for o in ours:
            s = o.shape
            record["modules"][o.label] = o.source
            print(f"  {state}: {o.label}: H={s.heads} G={s.key_heads} P={s.value_dim} N={s.key_dim} L={s.capacity}, {o.source}", flush=True)
    for state, ours in groups.items():
        steps = args.check_steps or ours[0].shape.capacity + 2
        result = check_state_dtype(public, spec, ours, device, steps, batch=2 if cpu else 4)
        record["checks"][state] = result
        print(f"check {state} state: {describe_check(result)}", flush=True)
    if not args.check_only:
        from replaygen.measure import copy_bandwidth

        bandwidth = copy_bandwidth(device)
        print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
        rows = []
        for batch in args.batch:
            for ours in groups.values():
                rows += time_state_dtype(public, spec, ours, batch, device, bandwidth)
        record.update(copy_bandwidth=bandwidth, rows=rows)
        print(markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
