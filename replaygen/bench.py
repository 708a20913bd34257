"""`replaygen bench`: baseline vs replay decode side by side, on one GPU, in one process.

Every row is timed on the same inputs as its baseline, with cold state, whole
flush cycles and CUDA graphs (see `measure`), and carries the traffic model:
the fewest bytes the kernel must move, the time those bytes take at the copy
bandwidth (measured in the same run), and the fraction of that bandwidth the
kernel reaches on them. Optional parts: a sweep of the buffer capacity L for
replay decode, FLA's Gated DeltaNet decode as a peer column, PNG plots.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
import triton

from replaygen import __version__
from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, bucket_config, module_defaults
from replaygen.errors import ReplaygenError
from replaygen.harness import check_decode, check_speculative_through_flushes, relative_error
from replaygen.measure import ACCEPT, DecodeWorkload, Timing, VerifyWorkload, capture, copy_bandwidth, time_callable
from replaygen.runtime import load_kernels
from replaygen.spec.model import (
    DecayForm,
    DecayGranularity,
    DType,
    QueryScale,
    Spec,
    StateLayout,
    TargetShape,
    UpdateKind,
    UpdateWeight,
    VectorTransform,
)
from replaygen.traffic import (
    STATE_BUDGET_BYTES,
    baseline_decode_bytes,
    baseline_verify_bytes,
    best_verify_capacity,
    replay_decode_bytes,
    replay_verify_bytes,
    speculative_memory,
    verify_flush_period,
)

log = logging.getLogger(__name__)

TORCH_TO_DTYPE = {torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16, torch.float32: DType.FLOAT32}
FLA_ABSENT = "flash-linear-attention not installed: no FLA column"
# Relative error FLA's outputs and states may show against our baseline decode on the same step.
FLA_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-3}
FLA_STATE_ROWS = 8  # batch rows whose final states are compared (outputs: all rows)


@dataclass(frozen=True)
class DecodeRow:
    shape: str
    capacity: int
    batch: int
    kernel: str  # "baseline" | "replay/<route>" | "fla"
    flush_at: int
    config: dict[str, object]  # empty for FLA (its own launch choices)
    timing: dict[str, float]
    bytes_per_step: float  # traffic model, all batch rows
    model_ms: float  # bytes_per_step at the measured copy bandwidth
    bandwidth_fraction: float  # of the measured copy bandwidth
    speedup: float  # baseline time / this time (1.0 for the baseline)
    # tuned replay rows: the slowest step of the flush cycle, ms (the cycle's median per step scaled by the per-step
    # profile's slowest step over its mean; `DecodeWorkload.time_replay_steps`); None elsewhere
    peak_step_ms: float | None = None


@dataclass(frozen=True)
class CapacityRow:
    """Replay decode (output-only route, flush every L steps) at one buffer capacity L and batch size."""

    shape: str
    capacity: int
    window: int  # T of the rendered kernels: min(the shape's, L // 2)
    batch: int
    kernel: str
    config: dict[str, object]
    timing: dict[str, float]
    bytes_per_step: float
    model_ms: float
    bandwidth_fraction: float
    baseline_ms: float  # measured baseline decode step at this batch
    baseline_model_ms: float
    speedup: float  # baseline_ms / this time


@dataclass(frozen=True)
class VerifyRow:
    shape: str  # the shape the verify kernels ran on (`verify_shape`)
    decode_shape: str  # the benchmarked shape whose decode step is the unit of vs_decode
    capacity: int
    batch: int
    tokens: int
    accept: str  # "all" | "staggered" | "random" (measure.VerifyWorkload)
    kernel: str  # "baseline_verify" | "replay_verify"
    config: dict[str, object]
    timing: dict[str, float]
    bytes_per_step: float  # traffic model (random acceptance: at the mean accepted count)
    model_ms: float
    bandwidth_fraction: float
    vs_decode: float  # this step's time / one baseline decode step at the same batch
    vs_baseline_verify: float  # this time / the baseline verify's


@dataclass(frozen=True)
class MemoryRow:
    shape: str
    tokens: int
    capacity: int
    decode_bytes_per_slot: int  # standard decode, one recurrent state
    snapshot_bytes_per_slot: int
    replay_bytes_per_slot: int
    budget_bytes: int
    max_sequences_decode: int
    max_sequences_snapshot: int
    max_sequences_replay: int


@dataclass(frozen=True)
class FlaCheck:
    """FLA's decode against our baseline decode on one step of identical inputs."""

    shape: str
    batch: int
    output_rel_error: float  # all batch rows
    state_rel_error: float  # the first FLA_STATE_ROWS rows
    tolerance: float
    ok: bool
    error: str = ""  # the exception FLA raised, if it did


@dataclass(frozen=True)
class FlaOp:
    """FLA's decode function for a delta rule with decay per `granularity`: where it lives, and whether it takes the
    gate's pre-activation and computes the decay and beta in the kernel (KDA's `use_gate_in_kernel`)."""

    module: str
    function: str
    gate_in_kernel: bool


FLA_OPS = {
    DecayGranularity.HEAD: FlaOp("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", gate_in_kernel=False),
    DecayGranularity.CHANNEL: FlaOp("fla.ops.kda", "fused_recurrent_kda", gate_in_kernel=True),
}


@dataclass(frozen=True)
class FlaPeer:
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # the FlaOp's function
    version: str
    op: FlaOp


def environment(device: torch.device) -> dict[str, object]:
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "replaygen": __version__,
    }


def model_ms(nbytes: float, copy_bw: float) -> float:
    """Time in ms that moving `nbytes` takes at the copy bandwidth `copy_bw` (bytes/s)."""
    return nbytes / copy_bw * 1e3


def bandwidth_fraction(nbytes: float, ms: float, copy_bw: float) -> float:
    """Fraction of the copy bandwidth reached when `nbytes` move in `ms`."""
    return nbytes / (ms * 1e-3) / copy_bw


def sweep_configs(shape: TargetShape) -> list[KernelConfig]:
    """The small hand-picked grid of `--sweep`."""
    grid = [(8, 2), (16, 4), (32, 8)]
    return [KernelConfig(block_v=bv, num_warps=w) for bv, w in grid if bv <= max(8, shape.value_dim)]


def decode_modules(spec: Spec, shape: TargetShape, sweep: bool) -> dict[KernelConfig | None, ModuleType]:
    """The module of the documented defaults (key None: each decode kernel its own default table), or with `sweep`
    one module per grid config, that config for both decode kernels at every batch."""
    if not sweep:
        return {None: load_kernels(spec, shape)}
    modules = {}
    for config in sweep_configs(shape):
        table = (BucketConfig(None, config),)
        modules[config] = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: table, KernelKind.BASELINE_DECODE: table})
    return modules


def timed_config(config: KernelConfig | None, table: tuple[BucketConfig, ...], batch: int) -> KernelConfig:
    """The config a timing ran: `config`, or for a module keyed None (its own dispatch table) the bucket of `batch`."""
    return config if config is not None else bucket_config(table, batch)


def require_decode_match(module: ModuleType, spec: Spec, shape: TargetShape, act_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse to time kernels that disagree with the float64 reference on this device."""
    report = check_decode(module, spec, shape, device=device, act_dtype=act_dtype, batch=3, cycles=2)
    if not report.ok:
        raise RuntimeError(f"kernels for {shape.name} (L={shape.capacity}) disagree with the reference on this GPU:\n" + "\n".join(report.lines()))


def decode_row(shape: TargetShape, batch: int, kernel: str, flush_at: int, config: dict[str, object], timing: Timing, nbytes: float, copy_bw: float, base_ms: float) -> DecodeRow:
    ms = timing.median_ms
    return DecodeRow(
        shape=shape.name,
        capacity=shape.capacity,
        batch=batch,
        kernel=kernel,
        flush_at=flush_at,
        config=config,
        timing=timing.as_dict(),
        bytes_per_step=nbytes,
        model_ms=model_ms(nbytes, copy_bw),
        bandwidth_fraction=bandwidth_fraction(nbytes, ms, copy_bw),
        speedup=base_ms / ms,
    )


def bench_decode(
    spec: Spec,
    shape: TargetShape,
    batches: list[int],
    act_dtype: torch.dtype,
    device: torch.device,
    copy_bw: float,
    sweep: bool = False,
) -> list[DecodeRow]:
    """Time baseline decode and replay decode (both routes, flush every L steps and every step) per batch size."""
    act = TORCH_TO_DTYPE[act_dtype]
    base_bytes = baseline_decode_bytes(spec, shape, act).total
    modules = decode_modules(spec, shape, sweep)
    require_decode_match(next(iter(modules.values())), spec, shape, act_dtype, device)
    variants = [("baseline", shape.capacity)]
    variants += [(f"replay/{route.value}", shape.capacity) for route in Route]
    variants.append((f"replay/{Route.OUTPUT_ONLY.value}", 1))
    defaults = module_defaults(spec, shape)
    rows: list[DecodeRow] = []
    for batch in batches:
        best: dict[tuple[str, int], tuple[Timing, KernelConfig | None]] = {}
        for config, module in modules.items():
            work = DecodeWorkload(module, spec, shape, batch, act_dtype, device)
            for kernel, flush_at in variants:
                if kernel == "baseline":
                    timing = work.time_baseline(shape.capacity, repeats=20)
                else:
                    timing = work.time_replay(kernel.split("/")[1], flush_at, repeats=20)
                key = (kernel, flush_at)
                if key not in best or timing.median_ms < best[key][0].median_ms:
                    best[key] = (timing, config)
            del work
            torch.cuda.empty_cache()
        base_time = best[("baseline", shape.capacity)][0].median_ms
        for (kernel, flush_at), (timing, config) in best.items():
            kind = KernelKind.BASELINE_DECODE if kernel == "baseline" else KernelKind.REPLAY_DECODE
            config = timed_config(config, defaults[kind], batch)
            if kernel == "baseline":
                nbytes, flush_at = base_bytes * batch, 1
            else:
                nbytes = replay_decode_bytes(spec, shape, act, flush_at).total * batch
            rows.append(decode_row(shape, batch, kernel, flush_at, config.as_dict(), timing, nbytes, copy_bw, base_time))
            log.info("%s b=%d %s flush_at=%d: %.4f ms", shape.name, batch, kernel, flush_at, timing.median_ms)
    return rows


def bench_tuned_decode(
    spec: Spec,
    shape: TargetShape,
    batches: list[int],
    act_dtype: torch.dtype,
    device: torch.device,
    copy_bw: float,
    configs: dict[KernelKind, tuple[BucketConfig, ...]],
) -> list[DecodeRow]:
    """Baseline and replay decode as `build` bakes them: each batch runs its bucket's tuned config (replay with the
    bucket's route and flush threshold), both timed on the same workload."""
    act = TORCH_TO_DTYPE[act_dtype]
    module = load_kernels(spec, shape, configs, config_source="tuning records")
    require_decode_match(module, spec, shape, act_dtype, device)
    rows: list[DecodeRow] = []
    for batch in batches:
        base_config = bucket_config(configs[KernelKind.BASELINE_DECODE], batch)
        replay_config = bucket_config(configs[KernelKind.REPLAY_DECODE], batch)
        flush_at = replay_config.flush_at or shape.capacity
        work = DecodeWorkload(module, spec, shape, batch, act_dtype, device)
        base = work.time_baseline(shape.capacity, repeats=20)
        replay = work.time_replay(replay_config.route.value, flush_at, repeats=20)
        steps = work.time_replay_steps(replay_config.route.value, flush_at)
        del work
        torch.cuda.empty_cache()
        base_bytes = baseline_decode_bytes(spec, shape, act).total * batch
        replay_bytes = replay_decode_bytes(spec, shape, act, flush_at).total * batch
        rows.append(decode_row(shape, batch, "baseline", 1, base_config.as_dict(), base, base_bytes, copy_bw, base.median_ms))
        row = decode_row(shape, batch, f"replay/{replay_config.route.value}", flush_at, replay_config.as_dict(), replay, replay_bytes, copy_bw, base.median_ms)
        rows.append(replace(row, peak_step_ms=replay.median_ms * max(steps) / statistics.mean(steps)))
        log.info("%s b=%d tuned: baseline %.4f ms, replay %.4f ms", shape.name, batch, base.median_ms, replay.median_ms)
    return rows


def _config_text(config: dict[str, object]) -> str:
    return f"bv={config['block_v']} w={config['num_warps']}" if config else "-"


def format_rows(rows: list[DecodeRow]) -> str:
    """The decode rows as a table; `peak` (tuned replay rows) is the slowest step of the flush cycle as a multiple of
    the baseline's step."""
    lines = [f"{'shape':<16}{'L':>3}{'batch':>6}  {'kernel':<24}{'flush':>6}{'ms/step':>10}{'p20-p80':>18}{'model ms':>10}{'GB/step':>9}{'%copy':>7}{'speedup':>9}{'peak':>7}  config"]
    for r in rows:
        t = r.timing
        peak = "-" if r.peak_step_ms is None else f"{r.peak_step_ms / (t['median_ms'] * r.speedup):.2f}x"
        lines.append(
            f"{r.shape:<16}{r.capacity:>3}{r.batch:>6}  {r.kernel:<24}{r.flush_at:>6}{t['median_ms']:>10.4f}"
            f"{t['p20_ms']:>9.4f}-{t['p80_ms']:<8.4f}{r.model_ms:>10.4f}{r.bytes_per_step / 1e9:>9.4f}{100 * r.bandwidth_fraction:>6.1f}%"
            f"{r.speedup:>8.3f}x{peak:>7}  {_config_text(r.config)}"
        )
    return "\n".join(lines)


def capacity_shape(shape: TargetShape, capacity: int) -> TargetShape:
    """`shape` with buffer capacity L and the spec's window where it fits (the kernels need L >= 2T)."""
    return replace(shape, capacity=capacity, window=min(shape.window, capacity // 2))


def bench_capacity(
    spec: Spec,
    shape: TargetShape,
    capacities: list[int],
    batches: list[int],
    act_dtype: torch.dtype,
    device: torch.device,
    copy_bw: float,
    baseline_ms: dict[int, float],
    sweep: bool = False,
) -> list[CapacityRow]:
    """Replay decode per buffer capacity L (output-only route, flush every L steps) and batch size.

    `baseline_ms` maps batch sizes to measured baseline decode steps; batches it lacks are timed here.
    """
    act = TORCH_TO_DTYPE[act_dtype]
    baseline_ms = dict(baseline_ms)
    base_bytes = baseline_decode_bytes(spec, shape, act).total
    rows: list[CapacityRow] = []
    for capacity in capacities:
        lshape = capacity_shape(shape, capacity)
        modules = decode_modules(spec, lshape, sweep)
        defaults = module_defaults(spec, lshape)[KernelKind.REPLAY_DECODE]
        if lshape != shape:
            require_decode_match(next(iter(modules.values())), spec, lshape, act_dtype, device)
        step_bytes = replay_decode_bytes(spec, lshape, act, capacity).total
        for batch in batches:
            best: tuple[Timing, KernelConfig | None] | None = None
            for config, module in modules.items():
                work = DecodeWorkload(module, spec, lshape, batch, act_dtype, device)
                timing = work.time_replay(Route.OUTPUT_ONLY.value, capacity, repeats=20)
                if batch not in baseline_ms:
                    baseline_ms[batch] = work.time_baseline(shape.capacity, repeats=20).median_ms
                if best is None or timing.median_ms < best[0].median_ms:
                    best = (timing, config)
                del work
                torch.cuda.empty_cache()
            timing, config = best
            config = timed_config(config, defaults, batch)
            nbytes = step_bytes * batch
            rows.append(
                CapacityRow(
                    shape=shape.name,
                    capacity=capacity,
                    window=lshape.window,
                    batch=batch,
                    kernel=f"replay/{Route.OUTPUT_ONLY.value}",
                    config=config.as_dict(),
                    timing=timing.as_dict(),
                    bytes_per_step=nbytes,
                    model_ms=model_ms(nbytes, copy_bw),
                    bandwidth_fraction=bandwidth_fraction(nbytes, timing.median_ms, copy_bw),
                    baseline_ms=baseline_ms[batch],
                    baseline_model_ms=model_ms(base_bytes * batch, copy_bw),
                    speedup=baseline_ms[batch] / timing.median_ms,
                )
            )
            log.info("%s L=%d b=%d: %.4f ms", shape.name, capacity, batch, timing.median_ms)
    return rows


def format_capacity_rows(rows: list[CapacityRow]) -> str:
    lines = [f"{'shape':<16}{'L':>4}{'T':>3}{'batch':>6}{'ms/step':>10}{'p20-p80':>18}{'model ms':>10}{'%copy':>7}{'base ms':>10}{'base model':>11}{'speedup':>9}  config"]
    for r in rows:
        t = r.timing
        lines.append(
            f"{r.shape:<16}{r.capacity:>4}{r.window:>3}{r.batch:>6}{t['median_ms']:>10.4f}{t['p20_ms']:>9.4f}-{t['p80_ms']:<8.4f}"
            f"{r.model_ms:>10.4f}{100 * r.bandwidth_fraction:>6.1f}%{r.baseline_ms:>10.4f}{r.baseline_model_ms:>11.4f}{r.speedup:>8.3f}x  {_config_text(r.config)}"
        )
    return "\n".join(lines)


def fla_not_applicable(spec: Spec) -> str | None:
    """Why no FLA decode (Gated DeltaNet's, or KDA's for a decay per key channel) can stand in for this spec's
    recurrence (None when one can)."""
    if spec.update.kind is not UpdateKind.DELTA:
        return f"update kind {spec.update.kind.value}"
    if spec.decay.form is not DecayForm.NEG_EXP_SOFTPLUS:
        return f"decay per {spec.decay.granularity.value} ({spec.decay.form.value})"
    if spec.update.weight is not UpdateWeight.SIGMOID:
        return f"update weight {spec.update.weight.value}"
    return None


def find_fla(spec: Spec) -> FlaPeer | str:
    """FLA's decode for this spec (FLA_OPS: `fused_recurrent_gated_delta_rule`, or `fused_recurrent_kda` for a decay
    per key channel), or why there is no FLA column: "absent", "not applicable: ..." or "import failed: ..." (a
    broken install must not stop the bench)."""
    reason = fla_not_applicable(spec)
    if reason is not None:
        return f"not applicable: {reason}"
    op = FLA_OPS[spec.decay.granularity]
    try:
        fla = importlib.import_module("fla")
        fn = getattr(importlib.import_module(op.module), op.function)
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "fla":
            return "absent"
        return f"import failed: {type(exc).__name__}: {exc}"
    return FlaPeer(fn, str(getattr(fla, "__version__", "unknown")), op)


def swap_state_layout(shape: TargetShape, states: torch.Tensor) -> torch.Tensor:
    """States [n, HV, V, K] (layout value_key) <-> FLA's [n, HV, K, V]; key_value already is FLA's (a view either way)."""
    return states.transpose(-1, -2) if shape.layout is StateLayout.VALUE_KEY else states


def fla_inputs(spec: Spec, op: FlaOp, inputs: dict[str, torch.Tensor | None], weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """One decode step's inputs for FLA's `op`: q, k [B, 1, H, K] and v [B, 1, HV, V] (views, activation dtype), and
    the decay and beta from the same pre-activations: g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b),
    [B, 1, HV] float32; or, where the op computes them in its kernel (`gate_in_kernel`), the raw a [B, 1, HV, K] and
    b [B, 1, HV] with A_log [HV] and dt_bias [HV, K]."""
    d, u, s = spec.decay, spec.update, spec.inputs
    qkv = {"q": inputs[s.query][:, None], "k": inputs[s.key][:, None], "v": inputs[s.value][:, None]}
    if op.gate_in_kernel:
        return qkv | {
            "g": inputs[d.input][:, None], "beta": inputs[u.weight_input][:, None], "A_log": weights[d.rate].float(),
            "dt_bias": weights[d.bias].float() if d.bias else None, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
        }
    pre = inputs[d.input].float() + (weights[d.bias] if d.bias else 0.0)
    g = -torch.exp(weights[d.rate].float()) * F.softplus(pre)
    beta = torch.sigmoid(inputs[u.weight_input].float())
    return qkv | {"g": g[:, None], "beta": beta[:, None]}


class FlaWorkload:
    """FLA's decode on a DecodeWorkload's inputs and baseline states (copies in FLA's layout [B, HV, K, V] float32).

    Each step reads a layer's state and writes a new one (output_final_state), the baseline's traffic.
    """

    def __init__(self, peer: FlaPeer, spec: Spec, work: DecodeWorkload):
        self.fn = peer.fn
        self.scale = work.shape.key_dim**-0.5 if spec.query.scale is QueryScale.INV_SQRT_KEY_DIM else 1.0
        self.l2norm = spec.key.transform is VectorTransform.L2NORM
        self.args = [fla_inputs(spec, peer.op, inputs, work.weights) for inputs in work.inputs]
        self.states = [swap_state_layout(work.shape, state).contiguous() for state in work.baseline]

    def step(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One token on layer `layer`: outputs [B, 1, HV, V] and the new states [B, HV, K, V]."""
        return self.fn(**self.args[layer], scale=self.scale, initial_state=self.states[layer], output_final_state=True, use_qk_l2norm_in_kernel=self.l2norm)

    def time(self, steps: int, repeats: int = 20) -> Timing:
        """Per-step time over `steps` steps of every layer, in one CUDA graph (as DecodeWorkload.time_baseline)."""

        def cycle() -> None:
            for _ in range(steps):
                for layer in range(len(self.states)):
                    self.step(layer)

        graph = capture(cycle)
        return time_callable(graph.replay, repeats=repeats, per_call=steps * len(self.states))


def check_fla(peer: FlaWorkload, module: ModuleType, spec: Spec, work: DecodeWorkload, tolerance: float) -> FlaCheck:
    """FLA vs our baseline decode on layer 0's step (outputs of every row, new states of the first rows)."""
    state = work.baseline[0].clone()
    ours = module.baseline_decode(state, work.slots, **work.inputs[0], **work.weights, **work.rounding[0])
    rows = slice(0, FLA_STATE_ROWS)
    try:
        out, final = peer.step(0)
        out_err = relative_error(out[:, 0], ours)
        state_err = relative_error(swap_state_layout(work.shape, final[rows]), state[rows])
    except Exception as exc:  # an FLA release with another API must not stop the bench
        return FlaCheck(work.shape.name, work.batch, math.inf, math.inf, tolerance, False, f"{type(exc).__name__}: {exc}")
    ok = out_err <= tolerance and state_err <= tolerance
    return FlaCheck(work.shape.name, work.batch, out_err, state_err, tolerance, ok)


def bench_fla(
    peer: FlaPeer,
    spec: Spec,
    shape: TargetShape,
    batches: list[int],
    act_dtype: torch.dtype,
    device: torch.device,
    copy_bw: float,
    baseline_ms: dict[int, float],
) -> tuple[list[DecodeRow], list[FlaCheck]]:
    """FLA's decode per batch size, timed only where it matches our baseline decode on identical inputs."""
    act = TORCH_TO_DTYPE[act_dtype]
    module = next(iter(decode_modules(spec, shape, sweep=False).values()))
    base_bytes = baseline_decode_bytes(spec, shape, act).total
    rows, checks = [], []
    for batch in batches:
        work = DecodeWorkload(module, spec, shape, batch, act_dtype, device)
        fla = FlaWorkload(peer, spec, work)
        check = check_fla(fla, module, spec, work, FLA_TOLERANCE[act_dtype])
        checks.append(check)
        if check.ok:
            timing = fla.time(shape.capacity)
            rows.append(decode_row(shape, batch, "fla", 1, {}, timing, base_bytes * batch, copy_bw, baseline_ms[batch]))
        elif check.error:
            print(f"FLA failed on our inputs at batch {batch} ({check.error}): not timed")
        else:
            print(f"FLA disagrees with our baseline decode at batch {batch} (rel err: outputs {check.output_rel_error:.2e}, "
                  f"states {check.state_rel_error:.2e}; tolerance {check.tolerance:.0e}): not timed")
        del work, fla
        torch.cuda.empty_cache()
    return rows, checks


def verify_shape(shape: TargetShape, spec: Spec, act: DType, tokens: int) -> TargetShape:
    """The shape benchmarked for window T: the spec's, with the buffer capacity the traffic model prefers; the spec's
    own shape of those sizes when it names one (e.g. nemotron-h-mtp), so that shape's tuning records apply."""
    wanted = replace(shape, capacity=best_verify_capacity(spec, shape, act, tokens), window=tokens)
    named = [s for s in spec.shapes if replace(s, name=shape.name) == wanted]
    return named[0] if named else wanted


def bench_verify(
    spec: Spec,
    shape: TargetShape,
    batches: list[int],
    windows: list[int],
    act_dtype: torch.dtype,
    device: torch.device,
    copy_bw: float,
    decode_ms: dict[int, float],
    sweep: bool = False,
    tuned: dict[str, dict[KernelKind, tuple[BucketConfig, ...]]] | None = None,
) -> list[VerifyRow]:
    """Replay verify + commit vs per-draft-snapshot verify + rollback, per window T and batch size. Each window runs
    on `verify_shape`; with `tuned` configs for that shape (by name), both verify kernels run as `build` bakes them."""
    act = TORCH_TO_DTYPE[act_dtype]
    rows: list[VerifyRow] = []
    for tokens in windows:
        vshape = verify_shape(shape, spec, act, tokens)
        tuned_tables = (tuned or {}).get(vshape.name)
        tables = tuned_tables or module_defaults(spec, vshape)  # what a module keyed None runs
        modules = {}
        if tuned_tables is None and sweep:
            for config in (KernelConfig(block_v=bv, num_warps=w) for bv, w in ((8, 4), (16, 8))):
                table = (BucketConfig(None, config),)
                modules[config] = load_kernels(spec, vshape, {KernelKind.REPLAY_VERIFY: table, KernelKind.BASELINE_VERIFY: table})
        else:
            modules[None] = load_kernels(spec, vshape, tables, config_source="tuning records" if tuned_tables else "defaults")
        first = next(iter(modules.values()))
        for report in check_speculative_through_flushes(first, spec, vshape, random_steps=6, tokens=tokens, device=device, act_dtype=act_dtype, batch=3):
            if not report.ok:
                raise RuntimeError("verify kernels disagree with the reference on this GPU:\n" + "\n".join(report.lines()))
        all_steps = len(verify_flush_period(vshape, tokens, tokens))
        for batch in batches:
            work = VerifyWorkload(first, spec, vshape, batch, tokens, act_dtype, device)
            best: dict[tuple[str, str], tuple[Timing, KernelConfig | None]] = {}
            for config, module in modules.items():
                work.module = module
                variants = [("replay_verify", accept) for accept in ACCEPT] + [("baseline_verify", "all")]
                for kernel, accept in variants:
                    steps = 8 if accept == "random" else all_steps
                    timing = work.time_replay(accept, steps) if kernel == "replay_verify" else work.time_baseline(accept, steps)
                    if (kernel, accept) not in best or timing.median_ms < best[(kernel, accept)][0].median_ms:
                        best[(kernel, accept)] = (timing, config)
            del work
            torch.cuda.empty_cache()
            base_verify = best[("baseline_verify", "all")][0].median_ms
            for (kernel, accept), (timing, config) in best.items():
                config = timed_config(config, tables[KernelKind(kernel)], batch)
                if kernel == "baseline_verify":
                    nbytes = baseline_verify_bytes(spec, vshape, act, tokens).total
                else:
                    mean_accepted = max(1, round((1 + tokens) / 2)) if accept == "random" else tokens
                    nbytes = replay_verify_bytes(spec, vshape, act, tokens, mean_accepted, config.flush_at).total
                nbytes *= batch
                rows.append(
                    VerifyRow(
                        shape=vshape.name,
                        decode_shape=shape.name,
                        capacity=vshape.capacity,
                        batch=batch,
                        tokens=tokens,
                        accept=accept,
                        kernel=kernel,
                        config=config.as_dict(),
                        timing=timing.as_dict(),
                        bytes_per_step=nbytes,
                        model_ms=model_ms(nbytes, copy_bw),
                        bandwidth_fraction=bandwidth_fraction(nbytes, timing.median_ms, copy_bw),
                        vs_decode=timing.median_ms / decode_ms[batch],
                        vs_baseline_verify=timing.median_ms / base_verify,
                    )
                )
    return rows


def format_verify_rows(rows: list[VerifyRow]) -> str:
    lines = [f"{'shape':<16}{'L':>3}{'T':>3}{'batch':>6}  {'kernel':<16}{'accept':<8}{'ms/step':>10}{'p20-p80':>18}{'model ms':>10}{'%copy':>7}{'x decode':>9}{'x base':>8}  config"]
    for r in rows:
        t = r.timing
        lines.append(
            f"{r.shape:<16}{r.capacity:>3}{r.tokens:>3}{r.batch:>6}  {r.kernel:<16}{r.accept:<8}{t['median_ms']:>10.4f}"
            f"{t['p20_ms']:>9.4f}-{t['p80_ms']:<8.4f}{r.model_ms:>10.4f}{100 * r.bandwidth_fraction:>6.1f}%{r.vs_decode:>9.3f}{r.vs_baseline_verify:>8.3f}"
            f"  {_config_text(r.config)}"
        )
    return "\n".join(lines)


def memory_rows(spec: Spec, shape: TargetShape, act: DType, windows: list[int], budget: int = STATE_BUDGET_BYTES) -> list[MemoryRow]:
    """Bytes per slot and the most sequences a fixed state budget holds: standard decode (one state), speculative
    decode with one snapshot per window token, and replay."""
    rows = []
    for tokens in windows:
        vshape = verify_shape(shape, spec, act, tokens)
        memory = speculative_memory(spec, vshape, act, tokens)
        rows.append(MemoryRow(shape.name, tokens, vshape.capacity, memory.decode, memory.snapshots, memory.replay, budget, *memory.sequences(budget)))
    return rows


def format_memory_rows(rows: list[MemoryRow]) -> str:
    lines = [
        f"{'shape':<16}{'T':>3}{'L':>4}{'decode B/slot':>15}{'snapshot B/slot':>17}{'replay B/slot':>15}"
        f"{'max seqs (decode)':>19}{'max seqs (snap)':>17}{'max seqs (replay)':>19}{'ratio':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.shape:<16}{r.tokens:>3}{r.capacity:>4}{r.decode_bytes_per_slot:>15,}{r.snapshot_bytes_per_slot:>17,}{r.replay_bytes_per_slot:>15,}"
            f"{r.max_sequences_decode:>19,}{r.max_sequences_snapshot:>17,}{r.max_sequences_replay:>19,}{r.max_sequences_replay / r.max_sequences_snapshot:>7.2f}"
        )
    return "\n".join(lines)


def fla_record(fla: FlaPeer | str, checks: list[FlaCheck], act_dtype: torch.dtype) -> str | dict[str, object]:
    """The JSON "fla" entry: why there is no column, or FLA's version and its match checks."""
    if isinstance(fla, str):
        return fla
    return {"version": fla.version, "tolerance": FLA_TOLERANCE[act_dtype], "checks": [asdict(c) for c in checks]}


def run(
    spec: Spec,
    shapes: tuple[TargetShape, ...],
    batches: list[int],
    act_dtype: torch.dtype,
    out_dir: Path | None,
    sweep: bool,
    windows: list[int],
    device: torch.device | None = None,
    capacities: list[int] | None = None,
    capacity_batches: list[int] | None = None,
    plots: bool = False,
    tuned: dict[str, dict[KernelKind, tuple[BucketConfig, ...]]] | None = None,
) -> dict[str, object]:
    """Every benchmark for `shapes`, printed as tables and returned (and written to OUT_DIR) as JSON.

    capacities: buffer capacities L for the replay-decode sweep at `capacity_batches` (default: `batches`);
    plots: also write PNGs next to the JSON (needs `out_dir` and matplotlib); tuned: per shape name, the configs
    `build` would bake from tuning records: decode is then timed as built instead of with defaults or a sweep. The
    JSON is rewritten after every section with "complete": false, so a run cut short keeps what it measured.
    """
    if plots and out_dir is None:
        raise ReplaygenError("--plots writes the PNGs next to the JSON: give --out DIR")
    device = device or torch.device("cuda")
    act = TORCH_TO_DTYPE[act_dtype]
    copy_bw = copy_bandwidth(device)
    print(f"measured copy bandwidth: {copy_bw / 1e12:.3f} TB/s (read + write)")
    fla = find_fla(spec)
    if fla == "absent":
        print(FLA_ABSENT)
    elif isinstance(fla, str):
        log.info("no FLA column: %s", fla)
    header = {
        "spec": spec.name,
        "spec_sha256": spec.source_sha256,
        "activation_dtype": str(act_dtype).replace("torch.", ""),
        "environment": environment(device),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "decode_configs": "tuning records" if tuned is not None else ("sweep" if sweep else "defaults"),
    }
    sections: dict[str, list] = {"decode": [], "capacity_sweep": [], "verify": [], "memory": []}
    fla_checks: list[FlaCheck] = []
    path = None if out_dir is None else out_dir / f"bench_{spec.name}_{'_'.join(s.name for s in shapes)}.json"

    def save(complete: bool) -> dict[str, object]:
        result = {**header, **{key: [asdict(r) for r in rows] for key, rows in sections.items()}}
        result.update(fla=fla_record(fla, fla_checks, act_dtype), complete=complete)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1, sort_keys=True))
        return result

    for shape in shapes:
        if tuned is not None:
            shape_rows = bench_tuned_decode(spec, shape, batches, act_dtype, device, copy_bw, tuned[shape.name])
        else:
            shape_rows = bench_decode(spec, shape, batches, act_dtype, device, copy_bw, sweep)
        decode_ms = {r.batch: r.timing["median_ms"] for r in shape_rows if r.kernel == "baseline"}
        if isinstance(fla, FlaPeer):
            fla_rows, checks = bench_fla(fla, spec, shape, batches, act_dtype, device, copy_bw, decode_ms)
            shape_rows += fla_rows
            fla_checks += checks
        print(format_rows(shape_rows), flush=True)
        sections["decode"] += shape_rows
        save(complete=False)
        if capacities:
            sweep_rows = bench_capacity(spec, shape, capacities, capacity_batches or batches, act_dtype, device, copy_bw, decode_ms, sweep)
            print(format_capacity_rows(sweep_rows), flush=True)
            sections["capacity_sweep"] += sweep_rows
            save(complete=False)
        if windows:
            verify_rows = bench_verify(spec, shape, batches, windows, act_dtype, device, copy_bw, decode_ms, sweep, tuned)
            print(format_verify_rows(verify_rows), flush=True)
            sections["verify"] += verify_rows
            mem = memory_rows(spec, shape, act, windows)
            print(format_memory_rows(mem), flush=True)
            sections["memory"] += mem
    result = save(complete=True)
    if path is not None:
        print(f"wrote {path}")
        if plots:
            write_plots(path)
    return result


def write_plots(json_path: Path) -> None:
    """PNGs next to the JSON; one clear line instead when matplotlib is missing."""
    from replaygen.plots import MatplotlibMissing, plot_bench

    try:
        paths = plot_bench(json_path)
    except MatplotlibMissing as exc:
        print(exc)
        return
    for path in paths:
        print(f"wrote {path}")
