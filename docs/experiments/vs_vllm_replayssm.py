"""Replay decode and speculative verify side by side with the public vLLM ReplaySSM PR kernels, on one GPU, in one
process, same inputs.

The PR's kernels (github.com/Johnny-Liou/ReplaySSM: `fused_recurrent_replayssm.py` for Gated DeltaNet decode,
`selective_state_update_replayssm_output_only.py` for Mamba-2 decode, `gdn_replayssm_spec_decode.py` and
`selective_state_update_replayssm_spec.py` for their speculative verify + commit, and `replayssm_config.py`) are
read from --public, a folder holding those files; they are not part of this project, and their vLLM imports are
stubbed here. Each kernel gets its own layer states (enough to exceed 4x L2, as `replaygen.measure` keeps them),
random inputs (the same for every kernel), one CUDA graph per timing over whole flush cycles, medians of 30 graph
replays. Every row flushing on the same step ("together") and rows staggered over the cycle ("staggered") are timed
for every kernel. --kinds picks decode, verify or both.

Decode (shapes qwen3.5, nemotron-h, L=16): graphs of L steps. The PR's ring position is a per-row input its engine
advances between steps: here step i of the cycle reads a tensor prepared for it, so the graph holds the PR's kernels
alone. replaygen's rows: the module shipped for --gpu, and each config of --configs (JSON: {spec: {name: {knob:
value}}}, run at every batch size; a name may map to a module file instead, relative to the project, e.g. an older
build of the same shape).

Verify (shapes qwen3.5-mtp, nemotron-h-mtp: windows of T=4, replaygen's L=28 in a ring of 32): every draft accepted,
so each step is a verify of T tokens, which writes all T into the ring, and a commit of all T. replaygen's rows (the
module shipped for --gpu, and this code on its verify and commit configs; --configs is decode's alone) are
`measure.VerifyWorkload`'s, verify + commit per layer; it flushes when h + 2T > L, at h = 24 buffered entries, one
verify in 6. The PR runs its own history (--public-history, default 16, the issue table's "vLLM ReplaySSM PR,
history 16"): max_cache_len = history + T logical entries in a power-of-two ring (32 at history 16 or 24); it flushes
on the same rule with L = history + T, one verify in 4 at history 16 (history 24 flushes as replaygen does). Its
cursors (write position, ring origin, flush flag) are block-keyed and shared by a step's layers, as in its engine:
the graph runs its verify on every layer and its commit (a single-program launch) once per step, spread over the
timed layers. One graph per kernel holds the least common multiple of both flush cycles (12 steps at history 16; a
replaygen verify config's flush_at shortens its cycle), so every row goes through whole cycles of either. The PR's
GDN verify reads the checkpoint in the activation dtype and its flush stores the new checkpoint rounded to it; its
Mamba-2 caches the raw dt in the activation dtype. Columns: us per verify + commit step per layer, the PR's time over
it, replaygen's baseline decode step (one token) over it, replaygen's per-draft-snapshot verify + rollback over it,
and the copy bandwidth fraction on replaygen's own fewest verify bytes (`traffic.replay_verify_bytes`, every token
accepted), for the PR's row too. Before timing, the PR's verify runs beside replaygen's and the float64 reference
from the same checkpoints with empty rings on the same windows, through flushes of both (`check_public_verify`);
replaygen's modules are checked by `harness.check_speculative_through_flushes`.

--out DIR writes DIR/vs_vllm_replayssm.json: the decode rows under "rows", the verify rows under "verify_rows".

    python docs/experiments/vs_vllm_replayssm.py --public DIR --gpu h200 --configs FILE --out DIR
    python docs/experiments/vs_vllm_replayssm.py --public DIR --gpu h100 --kinds verify --batch 8,128,512 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from replaygen.configs import BucketConfig, KernelConfig, KernelKind
from replaygen.harness import InputFactory, check_decode, check_speculative_through_flushes, load_reference, output_tolerance, relative_error
from replaygen.measure import DecodeWorkload, VerifyWorkload, capture, cold_layers, copy_bandwidth, time_callable
from replaygen.reference import Reference
from replaygen.runtime import import_file, import_path, load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import DType
from replaygen.traffic import replay_decode_bytes, replay_verify_bytes, verify_flush_period

ROOT = Path(__file__).resolve().parents[2]
# The PR's kernel file of each family and kind (beside replayssm_config.py in --public).
PUBLIC_FILES = {
    ("gdn", "decode"): "fused_recurrent_replayssm.py",
    ("mamba2", "decode"): "selective_state_update_replayssm_output_only.py",
    ("gdn", "verify"): "gdn_replayssm_spec_decode.py",
    ("mamba2", "verify"): "selective_state_update_replayssm_spec.py",
}
KINDS = ("decode", "verify")
# replaygen's reference rows of the verify table (no copy fraction): the snapshot verify, the one-token decode.
BASELINES = ("replaygen baseline verify", "replaygen baseline decode")


@triton.jit
def _softplus(x):
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


def _stub_vllm(folder: Path | None) -> None:
    """Stand-ins for the vLLM names the PR's files import, and its launch-config module from `folder` (where given)."""

    def module(name: str, **attrs: object) -> types.ModuleType:
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__dict__.update(attrs)
        return mod

    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba", "vllm.model_executor.layers.mamba.ops", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        module(name)
    module("vllm.triton_utils", tl=tl, triton=triton)
    module("vllm.platforms", current_platform=types.SimpleNamespace(is_device_capability_family=lambda family: False))
    module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0)
    module("vllm.model_executor.layers.mamba.ops.mamba_ssm", softplus=_softplus)
    if folder is not None:
        import_file("vllm.model_executor.layers.mamba.ops.replayssm_config", folder / "replayssm_config.py")


def _load_public(folder: Path, family: str, kind: str) -> types.ModuleType:
    """The PR's module of `family` ("gdn" | "mamba2") and `kind` ("decode" | "verify") from `folder`."""
    if "vllm.model_executor.layers.mamba.ops.replayssm_config" not in sys.modules:
        _stub_vllm(folder)
    return import_file(f"public_{family}_{kind}", folder / PUBLIC_FILES[(family, kind)])


class PublicGdnDecode:
    """The PR's GDN decode on its own layer states: checkpoint [slots, HV, V, K] fp32, rings d [slots, HV, L, V],
    k [slots, H, L, K] (activation dtype), g [slots, HV, L] fp32; slot 0 is the PR's null block, rows use 1..batch."""

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, shape, batch: int, act: torch.dtype, device):
        hv, h, v, k, cap = shape.heads, shape.key_heads, shape.value_dim, shape.key_dim, shape.capacity
        self.fn, self.cap, self.batch = public.fused_recurrent_gated_delta_rule_replayssm, cap, batch
        self.weights = weights
        self.inputs = [
            (torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], 1).contiguous(), x["a"].contiguous(), x["b"].contiguous()) for x in inputs
        ]
        self.layers = []
        for _ in inputs:
            state = torch.randn(batch + 1, hv, v, k, device=device) * 0.5
            d = (torch.randn(batch + 1, hv, cap, v, device=device) * 0.5).to(act)
            kc = (torch.randn(batch + 1, h, cap, k, device=device) * 0.5).to(act)
            g = -torch.rand(batch + 1, hv, cap, device=device) * 0.99 - 0.01
            self.layers.append((state, d, kc, g, torch.empty(batch, hv, v, device=device, dtype=act)))
        self.slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
        self.scale = k**-0.5

    def positions(self, together: bool) -> list[torch.Tensor]:
        """The ring position of every row at each of the cycle's L steps (the PR flushes at position L - 1)."""
        rows = torch.arange(self.batch, device=self.slots.device)
        start = rows * 0 if together else rows % self.cap
        return [((start + i) % self.cap).to(torch.int32) for i in range(self.cap)]

    def step(self, position: torch.Tensor) -> None:
        for (mixed, a, b), (state, d, kc, g, out) in zip(self.inputs, self.layers):
            self.fn(mixed, a, b, self.weights["A_log"], self.weights["dt_bias"], self.scale, state, d, kc, g, out, self.slots, position, use_qk_l2norm_in_kernel=True)


class PublicMamba2Decode:
    """The PR's Mamba-2 output-only decode on its own layer states: state [slots, H, P, N] fp32, rings x [slots, H,
    L, P], dt [slots, H, L], B [slots, G, L, N] (activation dtype), the scores scratch [batch, G, L] fp32; the flush
    flag per row is an input as the position is."""

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, shape, batch: int, act: torch.dtype, device):
        hh, g, p, n, cap = shape.heads, shape.key_heads, shape.value_dim, shape.key_dim, shape.capacity
        self.fn, self.cap, self.batch = public.selective_state_update_replayssm_output_only, cap, batch
        self.A = (-torch.exp(weights["A_log"]))[:, None, None].expand(hh, p, n)
        self.dt_bias = weights["dt_bias"][:, None].expand(hh, p)
        self.D = weights["D"][:, None].expand(hh, p)
        self.inputs = [(x["x"], x["dt"].to(act)[:, :, None].expand(batch, hh, p), x["B"], x["C"]) for x in inputs]
        self.layers = []
        for _ in inputs:
            state = torch.randn(batch + 1, hh, p, n, device=device) * 0.5
            xc = (torch.randn(batch + 1, hh, cap, p, device=device) * 0.5).to(act)
            dtc = (torch.rand(batch + 1, hh, cap, device=device) * 0.1 + 0.01).to(act)
            bc = (torch.randn(batch + 1, g, cap, n, device=device) * 0.5).to(act)
            scratch = torch.empty(batch, g, cap, device=device)
            self.layers.append((state, xc, dtc, bc, scratch, torch.empty(batch, hh, p, device=device, dtype=act)))
        self.slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)

    def positions(self, together: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = torch.arange(self.batch, device=self.slots.device)
        start = rows * 0 if together else rows % self.cap
        out = []
        for i in range(self.cap):
            position = ((start + i) % self.cap).to(torch.int32)
            out.append((position, (position == self.cap - 1).to(torch.int8)))
        return out

    def step(self, position: tuple[torch.Tensor, torch.Tensor]) -> None:
        write_pos, is_flush = position
        for (x, dt, b, c), (state, xc, dtc, bc, scratch, out) in zip(self.inputs, self.layers):
            self.fn(
                state, x, dt, self.A, b, c, D=self.D, dt_bias=self.dt_bias, dt_softplus=True, x_cache=xc, dt_cache=dtc, B_cache=bc,
                bc_pre=scratch, write_pos=write_pos, is_flush=is_flush, max_cache_len=self.cap, state_batch_indices=self.slots, out=out,
            )


def time_public(kernel, together: bool, layers: int) -> float:
    positions = kernel.positions(together)

    def cycle() -> None:
        for position in positions:
            kernel.step(position)

    graph = capture(cycle)
    return time_callable(graph.replay, repeats=30, per_call=len(positions) * layers).median_ms


class PublicVerify:
    """The PR's speculative verify + commit on its own layer states, every draft accepted.

    Rows use slots 1..batch (slot 0 is the PR's null block); row b's window is tokens b*T .. b*T+T-1 of the packed
    inputs (vLLM's varlen layout, query_start_loc [batch+1] int32). The cursors write_pos and origin [slots] int32 and
    is_flush [slots] int8 are block-keyed and shared by every layer, as in the PR's engine: `step` runs the verify on
    every layer, then the commit once. Its ring holds max_cache_len = history + T logical entries in `ring` =
    next_pow2(history + T) positions; a verify flushes where write_pos + 2T > history + T, so `cycle` (write
    positions over one steady-state flush cycle) is replaygen's `verify_flush_period` at capacity history + T.
    Subclasses pack the inputs (`pack`), allocate a layer (`allocate`: its tensors, the output [batch*T, H, V] last)
    and launch the verify (`verify`) and commit (`commit`).
    """

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, shape, batch: int, history: int, act: torch.dtype, device):
        self.public, self.shape, self.batch, self.tokens = public, shape, batch, shape.window
        self.max_cache_len = history + self.tokens
        self.ring = triton.next_power_of_2(self.max_cache_len)
        self.cycle = verify_flush_period(replace(shape, capacity=self.max_cache_len), self.tokens, self.tokens)
        self.weights = weights
        self.slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, batch * self.tokens + 1, self.tokens, dtype=torch.int32, device=device)
        self.accepted = torch.full((batch,), self.tokens, dtype=torch.int32, device=device)
        self.write_pos = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.origin = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.is_flush = torch.zeros(batch + 1, dtype=torch.int8, device=device)
        self.inputs = [self.pack(x) for x in inputs]
        self.layers = [self.allocate(act, device) for _ in inputs]

    def set_cursors(self, write_pos: torch.Tensor) -> None:
        """Rows at write positions `write_pos` [batch], ring origin 0, flush flags as the PR's commit sets them."""
        self.write_pos[1:] = write_pos
        self.origin.zero_()
        self.is_flush[1:] = (write_pos + 2 * self.tokens > self.max_cache_len).to(torch.int8)

    def start(self, together: bool) -> None:
        """Every row at the cycle's first step (`together`), or row i at its (i mod n)-th of n steps."""
        rows = torch.arange(self.batch, device=self.slots.device)
        phase = rows * 0 if together else rows % len(self.cycle)
        self.set_cursors(torch.tensor(self.cycle, dtype=torch.int32, device=rows.device)[phase])

    def load(self, states: torch.Tensor) -> None:
        """Every layer's rows from checkpoints `states` [batch, H, V, K] fp32 with empty rings."""
        for layer in self.layers:
            layer[0][1:] = states
        self.set_cursors(torch.zeros(self.batch, dtype=torch.int32, device=states.device))

    def step(self) -> None:
        for inputs, layer in zip(self.inputs, self.layers):
            self.verify(inputs, layer)
        self.commit()

    def outputs(self, layer: int) -> torch.Tensor:
        """The last verify's outputs of one layer: [batch, T, H, V]."""
        out = self.layers[layer][-1]
        return out.view(self.batch, self.tokens, *out.shape[1:])


class PublicGdnVerify(PublicVerify):
    """The PR's GDN spec decode: checkpoint [slots, HV, V, K] fp32, rings d [slots, HV, ring, V], k [slots, H, ring, K]
    (activation dtype), g [slots, HV, ring] fp32; inputs q|k|v packed [batch*T, 2*H*K + HV*V], a and b [batch*T, HV]."""

    def pack(self, window: dict) -> tuple[torch.Tensor, ...]:
        rows = self.batch * self.tokens
        qkv = torch.cat([window["q"].flatten(2), window["k"].flatten(2), window["v"].flatten(2)], 2).reshape(rows, -1)
        return qkv, window["a"].reshape(rows, -1), window["b"].reshape(rows, -1)

    def allocate(self, act: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        s, slots = self.shape, self.batch + 1
        return (
            torch.randn(slots, s.heads, s.value_dim, s.key_dim, device=device) * 0.5,
            (torch.randn(slots, s.heads, self.ring, s.value_dim, device=device) * 0.5).to(act),
            (torch.randn(slots, s.key_heads, self.ring, s.key_dim, device=device) * 0.5).to(act),
            -torch.rand(slots, s.heads, self.ring, device=device) * 0.99 - 0.01,
            torch.empty(self.batch * self.tokens, s.heads, s.value_dim, device=device, dtype=act),
        )

    def verify(self, inputs: tuple, layer: tuple) -> None:
        qkv, a, b = inputs
        state, d, k, g, out = layer
        self.public.gdn_replayssm_spec_decode(
            qkv, a, b, self.weights["A_log"], self.weights["dt_bias"], state, d, k, g, out, self.query_start_loc, self.slots,
            self.write_pos, self.origin, self.is_flush, self.max_cache_len, self.tokens, scale=self.shape.key_dim**-0.5,
        )

    def commit(self) -> None:
        self.public.commit_gdn_replayssm_spec(self.write_pos, self.origin, self.is_flush, self.accepted, self.slots, self.max_cache_len, self.tokens)


class PublicMamba2Verify(PublicVerify):
    """The PR's Mamba-2 spec verify: state [slots, H, P, N] fp32, ring of post-conv x|B [slots, ring, H*P + G*N] and dt
    [slots, H, ring] (activation dtype), the bc scratch [batch, G, ring, next_pow2(T)] shared by the layers; inputs x|B|C
    packed [batch*T, H*P + 2*G*N] and raw dt [batch*T, H] (activation dtype)."""

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, shape, batch: int, history: int, act: torch.dtype, device):
        hh, p, n = shape.heads, shape.value_dim, shape.key_dim
        self.A = (-torch.exp(weights["A_log"]))[:, None, None].expand(hh, p, n)
        self.D = weights["D"][:, None].expand(hh, p)
        super().__init__(public, inputs, weights, shape, batch, history, act, device)
        self.scratch = torch.empty(batch, shape.key_heads, self.ring, triton.next_power_of_2(self.tokens), device=device, dtype=act)

    def pack(self, window: dict) -> tuple[torch.Tensor, ...]:
        rows = self.batch * self.tokens
        conv = torch.cat([window["x"].flatten(2), window["B"].flatten(2), window["C"].flatten(2)], 2).reshape(rows, -1)
        return conv, window["dt"].reshape(rows, -1).to(conv.dtype)

    def allocate(self, act: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        s, slots = self.shape, self.batch + 1
        return (
            torch.randn(slots, s.heads, s.value_dim, s.key_dim, device=device) * 0.5,
            (torch.randn(slots, self.ring, s.heads * s.value_dim + s.key_heads * s.key_dim, device=device) * 0.5).to(act),
            (torch.randn(slots, s.heads, self.ring, device=device) * 0.5).to(act),
            torch.empty(self.batch * self.tokens, s.heads, s.value_dim, device=device, dtype=act),
        )

    def verify(self, inputs: tuple, layer: tuple) -> None:
        conv, dt = inputs
        state, post_conv, dt_cache, out = layer
        s = self.shape
        self.public.selective_state_update_replayssm_spec(
            state, post_conv, dt_cache, conv, dt, self.A, self.write_pos, self.origin, self.is_flush, self.query_start_loc, self.slots,
            self.max_cache_len, self.tokens, s.heads * s.value_dim, s.key_heads, s.key_dim,
            D=self.D, dt_bias=self.weights["dt_bias"], dt_softplus=True, out=out, bc_pre=self.scratch,
        )

    def commit(self) -> None:
        self.public.commit_replayssm_spec(self.write_pos, self.origin, self.is_flush, self.accepted, self.slots, self.max_cache_len, self.tokens)


def time_public_verify(kernel: PublicVerify, together: bool, steps: int, layers: int) -> float:
    """ms per verify + commit step per layer over a graph of `steps` steps."""
    kernel.start(together)

    def cycle() -> None:
        for _ in range(steps):
            kernel.step()

    graph = capture(cycle)
    return time_callable(graph.replay, repeats=30, per_call=steps * layers).median_ms


def check_public_verify(kernel_cls, public: types.ModuleType, module: types.ModuleType, spec, shape, history: int, act: torch.dtype, device, batch: int = 4) -> str:
    """The PR's verify beside replaygen's `module` and the float64 reference on the same windows, every draft accepted,
    all three from the same checkpoints with empty rings, for two whole flush cycles of both plus a step (each flushes
    at least twice): "ok" where the PR's outputs [batch, T, H, V] stay within twice the output tolerance of
    replaygen's (each may sit that far from the reference), else "FAIL"; with the largest relative error of a step's
    outputs against replaygen's and against the reference's (inf when not finite)."""
    factory = InputFactory(spec, shape, device, act, seed=5)
    weights = factory.weights()
    tokens, rows = shape.window, list(range(batch))
    kernel = kernel_cls(public, [factory.window(batch, tokens, use_gate=False)], weights, shape, batch, history, act, device)
    steps = 2 * math.lcm(len(kernel.cycle), len(verify_flush_period(shape, tokens, tokens))) + 1
    states = factory.states(batch, tuple(module.STATE_SHAPE), module.STATE_DTYPE)
    slots = torch.tensor(rows, dtype=torch.int32, device=device)
    replay = module.allocate(batch, device, act)
    module.load(replay, slots, states)
    reference = Reference(spec, shape, batch)
    load_reference(reference, rows, states)
    kernel.load(states)
    worst = {"replaygen": 0.0, "reference": 0.0}
    for _ in range(steps):
        window = factory.window(batch, tokens, use_gate=False)
        want = {"replaygen": module.verify(replay, slots, **window, **weights), "reference": reference.verify(rows, window, weights)}
        module.commit(replay, slots, kernel.accepted, tokens)
        reference.commit(rows, [tokens] * batch)
        kernel.inputs = [kernel.pack(window)]
        kernel.step()
        for name, y in want.items():
            worst[name] = max(worst[name], relative_error(kernel.outputs(0), y))
    verdict = "ok" if worst["replaygen"] <= 2 * output_tolerance(shape, act) else "FAIL"
    return f"{verdict} (rel err {worst['replaygen']:.1e} of replaygen's outputs, {worst['reference']:.1e} of the reference's, {steps} windows)"


def run_family(args, spec_name: str, shape_name: str, public_cls, public_module, configs: dict[str, dict], device, bandwidth: float) -> list[dict]:
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    act = torch.bfloat16
    shipped = _shipped(args, spec, shape)
    modules = {
        f"built for {args.gpu}": shipped,
        f"its {args.gpu} configs, this code": load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: _table(shipped, KernelKind.REPLAY_DECODE)}),
    }
    for name, knobs in configs.items():
        if isinstance(knobs, str):
            modules[name] = import_path(ROOT / knobs)
        else:
            config = KernelConfig.from_fields(knobs)
            modules[name] = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),)})
    checks = {}
    for name, module in modules.items():
        report = check_decode(module, spec, shape, device=device, act_dtype=act, batch=4, cycles=2, use_gate=False, seed=3)
        checks[name] = "ok" if report.ok else "FAIL " + "; ".join(report.lines()[1:])
        print(f"check {spec_name}/{shape_name} {name}: {checks[name]}", flush=True)
    bytes_per_row = replay_decode_bytes(spec, shape, DType.BFLOAT16).total
    rows = []
    for batch in args.batch:
        layers = cold_layers(spec, shape, batch, device)
        work = {name: DecodeWorkload(module, spec, shape, batch, act, device, layers=layers) for name, module in modules.items()}
        first = next(iter(work.values()))
        public = public_cls(public_module, first.inputs, first.weights, shape, batch, act, device)
        for together in (True, False):
            timings = {"vLLM PR": time_public(public, together, layers)}
            for name, w in work.items():
                config = _bucket(w.module, batch)
                route, flush_at = config["route"], config["flush_at"] or shape.capacity
                timings[name] = w.time_replay(route, flush_at, together=together).median_ms
            baseline = first.time_baseline(shape.capacity).median_ms
            for name, ms in timings.items():
                rows.append({
                    "spec": spec_name, "shape": shape_name, "batch": batch, "flushes": "together" if together else "staggered",
                    "kernel": name, "us": ms * 1e3, "vs_public": timings["vLLM PR"] / ms, "vs_baseline": baseline / ms,
                    "copy_fraction": batch * bytes_per_row / (ms * 1e-3) / bandwidth, "check": checks.get(name, "theirs"),
                })
            rows.append({"spec": spec_name, "shape": shape_name, "batch": batch, "flushes": "together" if together else "staggered", "kernel": "replaygen baseline", "us": baseline * 1e3, "vs_public": timings["vLLM PR"] / baseline, "vs_baseline": 1.0, "copy_fraction": float("nan"), "check": "-"})
            for row in rows[-len(timings) - 1:]:
                print(f"{row['spec']:7s} b{row['batch']:<4d} {row['flushes']:9s} {row['kernel']:34s} {row['us']:9.2f} us  x{row['vs_public']:.3f} of PR  x{row['vs_baseline']:.3f} of baseline  {row['copy_fraction']:.1%} copy", flush=True)
        del work, public
        torch.cuda.empty_cache()
    return rows


def verify_modules(args, spec, shape) -> dict[str, types.ModuleType]:
    """replaygen's verify rows: the module shipped for --gpu, and this code on its verify and commit configs."""
    shipped = _shipped(args, spec, shape)
    tables = {kind: _table(shipped, kind) for kind in (KernelKind.REPLAY_VERIFY, KernelKind.COMMIT)}
    return {f"built for {args.gpu}": shipped, f"its {args.gpu} configs, this code": load_kernels(spec, shape, tables)}


def verify_steps(public: PublicVerify, modules: dict[str, types.ModuleType], shape, batch: int) -> int:
    """Steps of one verify graph: the least common multiple of the flush cycles of the PR and of every module's verify
    config at `batch` (its flush_at, where set, shortens replaygen's cycle)."""
    tokens = shape.window
    cycles = [len(verify_flush_period(shape, tokens, tokens, _bucket(m, batch, KernelKind.REPLAY_VERIFY)["flush_at"])) for m in modules.values()]
    return math.lcm(len(public.cycle), *cycles)


def verify_baselines(work: VerifyWorkload, spec, shape, act: torch.dtype, steps: int) -> tuple[float, float]:
    """ms per layer step of replaygen's baseline decode (one token, over L steps, on layer states of its own) and of its
    per-draft-snapshot verify + rollback (over `steps` windows), both with `work`'s module and layer count."""
    decode = DecodeWorkload(work.module, spec, shape, work.batch, act, work.slots.device, layers=work.layers)
    decode_ms = decode.time_baseline(shape.capacity).median_ms
    del decode
    return decode_ms, work.time_baseline("all", steps, repeats=30).median_ms


def run_verify_family(args, spec_name: str, shape_name: str, public_cls, public_module, device, bandwidth: float) -> list[dict]:
    """Verify + commit rows of one family at every batch size (see the module docstring)."""
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    act, tokens = torch.bfloat16, shape.window
    modules = verify_modules(args, spec, shape)
    shipped = next(iter(modules.values()))
    public_name = f"vLLM PR, history {args.public_history}"
    checks = {public_name: check_public_verify(public_cls, public_module, shipped, spec, shape, args.public_history, act, device)}
    for name, module in modules.items():
        reports = check_speculative_through_flushes(module, spec, shape, random_steps=6, tokens=tokens, device=device, act_dtype=act, batch=3)
        checks[name] = "ok" if all(r.ok for r in reports) else "FAIL " + "; ".join(line for r in reports for line in r.lines()[1:])
    for name, check in checks.items():
        print(f"check {spec_name}/{shape_name} verify {name}: {check}", flush=True)
    bytes_per_row = replay_verify_bytes(spec, shape, DType.BFLOAT16, tokens).total
    rows = []
    for batch in args.batch:
        layers = cold_layers(spec, shape, batch, device)
        work = VerifyWorkload(shipped, spec, shape, batch, tokens, act, device, layers=layers)
        public = public_cls(public_module, work.inputs, work.weights, shape, batch, args.public_history, act, device)
        steps = verify_steps(public, modules, shape, batch)
        decode_ms, verify_ms = verify_baselines(work, spec, shape, act, steps)
        for together in (True, False):
            timings = {public_name: time_public_verify(public, together, steps, layers)}
            for name, module in modules.items():
                work.module = module
                timings[name] = work.time_replay("all" if together else "staggered", steps, repeats=30).median_ms
            timings.update(zip(BASELINES, (verify_ms, decode_ms)))
            for name, ms in timings.items():
                copy_bytes = batch * bytes_per_row if name not in BASELINES else float("nan")
                rows.append({
                    "spec": spec_name, "shape": shape_name, "batch": batch, "flushes": "together" if together else "staggered",
                    "kernel": name, "tokens": tokens, "steps": steps, "us": ms * 1e3, "vs_public": timings[public_name] / ms,
                    "vs_baseline": decode_ms / ms, "vs_baseline_verify": verify_ms / ms,
                    "copy_fraction": copy_bytes / (ms * 1e-3) / bandwidth, "check": checks.get(name, "-"),
                })
                _print_verify(rows[-1])
        del work, public
        torch.cuda.empty_cache()
    return rows


def _print_verify(row: dict) -> None:
    print(
        f"verify {row['spec']:7s} b{row['batch']:<4d} {row['flushes']:9s} {row['kernel']:34s} {row['us']:9.2f} us  x{row['vs_public']:.3f} of PR"
        f"  x{row['vs_baseline']:.3f} of baseline decode  x{row['vs_baseline_verify']:.3f} of baseline verify  {row['copy_fraction']:.1%} copy",
        flush=True,
    )


def _shipped(args, spec, shape) -> types.ModuleType:
    """The module built for --gpu (in --generated, default the project's generated/)."""
    return import_path((args.generated or ROOT / "generated") / args.gpu / f"{spec.name}_{shape.ident}.py")


def _table(module: types.ModuleType, kind: KernelKind) -> tuple[BucketConfig, ...]:
    """A module's dispatch table of one kernel kind, as load_kernels takes it."""
    return tuple(BucketConfig(max_batch, KernelConfig.from_fields(knobs)) for max_batch, knobs in getattr(module, f"_{kind.name}_CONFIGS"))


def _bucket(module: types.ModuleType, batch: int, kind: KernelKind = KernelKind.REPLAY_DECODE) -> dict:
    return module._pick(getattr(module, f"_{kind.name}_CONFIGS"), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public", type=Path, required=True, help="folder with the PR's kernel files")
    parser.add_argument("--gpu", default="h200", help="the shipped modules' GPU (GENERATED/GPU)")
    parser.add_argument("--generated", type=Path, default=None, help="folder of built modules (default: the project's generated/)")
    parser.add_argument("--batch", default="1,8,32,128,256,512")
    parser.add_argument("--configs", type=Path, default=None, help="JSON {spec: {name: {knob: value}}} of replay decode configs to time too")
    parser.add_argument("--families", default="gdn,mamba2")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: decode, verify (default both)")
    parser.add_argument("--public-history", type=int, default=16, help="committed entries the PR's verify keeps before it flushes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        parser.error(f"--kinds takes {', '.join(KINDS)}")
    device = torch.device("cuda")
    configs = json.loads(args.configs.read_text()) if args.configs else {}
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    decode = {"gdn": ("qwen3.5", PublicGdnDecode), "mamba2": ("nemotron-h", PublicMamba2Decode)}
    verify = {"gdn": ("qwen3.5-mtp", PublicGdnVerify), "mamba2": ("nemotron-h-mtp", PublicMamba2Verify)}
    for family in args.families.split(","):
        if "decode" in kinds:
            shape_name, cls = decode[family]
            rows["decode"] += run_family(args, family, shape_name, cls, _load_public(args.public, family, "decode"), configs.get(family, {}), device, bandwidth)
        if "verify" in kinds:
            shape_name, cls = verify[family]
            rows["verify"] += run_verify_family(args, family, shape_name, cls, _load_public(args.public, family, "verify"), device, bandwidth)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            record = {"copy_bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "rows": rows["decode"], "verify_rows": rows["verify"]}
            (args.out / "vs_vllm_replayssm.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
