"""`replaygen bench`: baseline vs replay decode side by side, on one GPU, in one process.

Every row is timed on the same inputs as its baseline, with cold state, whole
flush cycles and CUDA graphs (see `measure`), and carries the traffic model:
the fewest bytes the kernel must move, and the fraction of the copy bandwidth
(measured in the same run) it reaches on them.
"""

from __future__ import annotations

import json
import logging
import platform
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton

from replaygen import __version__
from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, default_configs
from replaygen.harness import check_decode
from replaygen.measure import DecodeWorkload, Timing, VerifyWorkload, copy_bandwidth
from replaygen.runtime import load_kernels
from replaygen.spec.model import DType, Spec, TargetShape
from replaygen.harness import check_speculative
from replaygen.traffic import (
    baseline_decode_bytes,
    baseline_verify_bytes,
    best_verify_capacity,
    replay_decode_bytes,
    replay_verify_bytes,
    spec_slot_memory,
    verify_flush_period,
)

log = logging.getLogger(__name__)

TORCH_TO_DTYPE = {torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16, torch.float32: DType.FLOAT32}


@dataclass(frozen=True)
class DecodeRow:
    shape: str
    capacity: int
    batch: int
    kernel: str  # "baseline" | "replay/<route>"
    flush_at: int
    config: dict[str, object]
    timing: dict[str, float]
    bytes_per_step: float  # traffic model, all batch rows
    bandwidth_fraction: float  # of the measured copy bandwidth
    speedup: float  # baseline time / this time (1.0 for the baseline)


@dataclass(frozen=True)
class VerifyRow:
    shape: str
    capacity: int
    batch: int
    tokens: int
    accept: str  # "all" | "random"
    kernel: str  # "baseline_verify" | "replay_verify"
    config: dict[str, object]
    timing: dict[str, float]
    bytes_per_step: float  # traffic model (random acceptance: at the mean accepted count)
    bandwidth_fraction: float
    vs_decode: float  # this step's time / one baseline decode step at the same batch
    vs_baseline_verify: float  # this time / the baseline verify's


@dataclass(frozen=True)
class MemoryRow:
    shape: str
    tokens: int
    capacity: int
    snapshot_bytes_per_slot: int
    replay_bytes_per_slot: int
    budget_bytes: int
    max_sequences_snapshot: int
    max_sequences_replay: int


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


def candidate_configs(kind: KernelKind, shape: TargetShape, sweep: bool) -> list[KernelConfig]:
    """The configs to time: the defaults' open-ended bucket, or a small hand-picked grid."""
    if not sweep:
        return [default_configs(kind, shape)[-1].config]
    grid = [(8, 2), (16, 4), (32, 8)]
    return [KernelConfig(block_v=bv, num_warps=w) for bv, w in grid if bv <= max(8, shape.value_dim)]


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
    modules = {}
    for config in candidate_configs(KernelKind.REPLAY_DECODE, shape, sweep):
        table = (BucketConfig(None, config),)
        modules[config] = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: table, KernelKind.BASELINE_DECODE: table})
    first = next(iter(modules.values()))
    report = check_decode(first, spec, shape, device=device, act_dtype=act_dtype, batch=3, cycles=2)
    if not report.ok:
        raise RuntimeError("kernels disagree with the reference on this GPU:\n" + "\n".join(report.lines()))
    rows: list[DecodeRow] = []
    for batch in batches:
        best: dict[tuple[str, int], tuple[Timing, KernelConfig]] = {}
        for config, module in modules.items():
            work = DecodeWorkload(module, spec, shape, batch, act_dtype, device)
            variants = [("baseline", shape.capacity)]
            variants += [(f"replay/{route.value}", shape.capacity) for route in Route]
            variants.append((f"replay/{Route.OUTPUT_ONLY.value}", 1))
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
            if kernel == "baseline":
                nbytes = base_bytes * batch
                flush_at_report = 1
            else:
                nbytes = replay_decode_bytes(spec, shape, act, flush_at).total * batch
                flush_at_report = flush_at
            rows.append(
                DecodeRow(
                    shape=shape.name,
                    capacity=shape.capacity,
                    batch=batch,
                    kernel=kernel,
                    flush_at=flush_at_report,
                    config=config.as_dict(),
                    timing=timing.as_dict(),
                    bytes_per_step=nbytes,
                    bandwidth_fraction=nbytes / (timing.median_ms * 1e-3) / copy_bw,
                    speedup=base_time / timing.median_ms,
                )
            )
            log.info("%s b=%d %s flush_at=%d: %.4f ms", shape.name, batch, kernel, flush_at_report, timing.median_ms)
    return rows


def format_rows(rows: list[DecodeRow]) -> str:
    lines = [f"{'shape':<16}{'L':>3}{'batch':>6}  {'kernel':<24}{'flush':>6}{'ms/step':>10}{'p20-p80':>18}{'GB/step':>9}{'%copy':>7}{'speedup':>9}  config"]
    for r in rows:
        t = r.timing
        cfg = f"bv={r.config['block_v']} w={r.config['num_warps']}"
        lines.append(
            f"{r.shape:<16}{r.capacity:>3}{r.batch:>6}  {r.kernel:<24}{r.flush_at:>6}{t['median_ms']:>10.4f}"
            f"{t['p20_ms']:>9.4f}-{t['p80_ms']:<8.4f}{r.bytes_per_step / 1e9:>9.4f}{100 * r.bandwidth_fraction:>6.1f}%{r.speedup:>8.3f}x  {cfg}"
        )
    return "\n".join(lines)


def verify_shape(shape: TargetShape, spec: Spec, act: DType, tokens: int) -> TargetShape:
    """The shape benchmarked for window T: the spec's, with the buffer capacity the traffic model prefers."""
    return replace(shape, capacity=best_verify_capacity(spec, shape, act, tokens), window=tokens)


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
) -> list[VerifyRow]:
    """Replay verify + commit vs per-draft-snapshot verify + rollback, per window T and batch size."""
    act = TORCH_TO_DTYPE[act_dtype]
    rows: list[VerifyRow] = []
    for tokens in windows:
        vshape = verify_shape(shape, spec, act, tokens)
        configs = [KernelConfig(block_v=bv, num_warps=w) for bv, w in ((8, 4), (16, 8))] if sweep else [default_configs(KernelKind.REPLAY_VERIFY, vshape)[-1].config]
        modules = {}
        for config in configs:
            table = (BucketConfig(None, config),)
            modules[config] = load_kernels(spec, vshape, {KernelKind.REPLAY_VERIFY: table, KernelKind.BASELINE_VERIFY: table})
        first = next(iter(modules.values()))
        report = check_speculative(first, spec, vshape, device=device, act_dtype=act_dtype, batch=3, steps=6, tokens=tokens)
        if not report.ok:
            raise RuntimeError("verify kernels disagree with the reference on this GPU:\n" + "\n".join(report.lines()))
        all_steps = len(verify_flush_period(vshape, tokens, tokens))
        for batch in batches:
            work = VerifyWorkload(first, spec, vshape, batch, tokens, act_dtype, device)
            best: dict[tuple[str, str], tuple[Timing, KernelConfig]] = {}
            for config, module in modules.items():
                work.module = module
                variants = [("replay_verify", "all"), ("replay_verify", "random")] + [("baseline_verify", "all")]
                for kernel, accept in variants:
                    steps = all_steps if accept == "all" else 8
                    timing = work.time_replay(accept, steps) if kernel == "replay_verify" else work.time_baseline(accept, steps)
                    if (kernel, accept) not in best or timing.median_ms < best[(kernel, accept)][0].median_ms:
                        best[(kernel, accept)] = (timing, config)
            del work
            torch.cuda.empty_cache()
            base_verify = best[("baseline_verify", "all")][0].median_ms
            for (kernel, accept), (timing, config) in best.items():
                if kernel == "baseline_verify":
                    nbytes = baseline_verify_bytes(spec, vshape, act, tokens).total
                else:
                    mean_accepted = tokens if accept == "all" else max(1, round((1 + tokens) / 2))
                    nbytes = replay_verify_bytes(spec, vshape, act, tokens, mean_accepted).total
                nbytes *= batch
                rows.append(
                    VerifyRow(
                        shape=vshape.name,
                        capacity=vshape.capacity,
                        batch=batch,
                        tokens=tokens,
                        accept=accept,
                        kernel=kernel,
                        config=config.as_dict(),
                        timing=timing.as_dict(),
                        bytes_per_step=nbytes,
                        bandwidth_fraction=nbytes / (timing.median_ms * 1e-3) / copy_bw,
                        vs_decode=timing.median_ms / decode_ms[batch],
                        vs_baseline_verify=timing.median_ms / base_verify,
                    )
                )
    return rows


def format_verify_rows(rows: list[VerifyRow]) -> str:
    lines = [f"{'shape':<16}{'L':>3}{'T':>3}{'batch':>6}  {'kernel':<16}{'accept':<8}{'ms/step':>10}{'p20-p80':>18}{'%copy':>7}{'x decode':>9}{'x base':>8}  config"]
    for r in rows:
        t = r.timing
        lines.append(
            f"{r.shape:<16}{r.capacity:>3}{r.tokens:>3}{r.batch:>6}  {r.kernel:<16}{r.accept:<8}{t['median_ms']:>10.4f}"
            f"{t['p20_ms']:>9.4f}-{t['p80_ms']:<8.4f}{100 * r.bandwidth_fraction:>6.1f}%{r.vs_decode:>9.3f}{r.vs_baseline_verify:>8.3f}"
            f"  bv={r.config['block_v']} w={r.config['num_warps']}"
        )
    return "\n".join(lines)


def memory_rows(spec: Spec, shape: TargetShape, act: DType, windows: list[int], budget: int = 40 << 30) -> list[MemoryRow]:
    """Bytes per slot and the most sequences a fixed state budget holds: one snapshot per window token vs replay."""
    rows = []
    for tokens in windows:
        vshape = verify_shape(shape, spec, act, tokens)
        snap, rep = spec_slot_memory(spec, vshape, act, tokens)
        rows.append(MemoryRow(shape.name, tokens, vshape.capacity, snap, rep, budget, budget // snap, budget // rep))
    return rows


def format_memory_rows(rows: list[MemoryRow]) -> str:
    lines = [f"{'shape':<16}{'T':>3}{'L':>4}{'snapshot B/slot':>17}{'replay B/slot':>15}{'max seqs (snap)':>17}{'max seqs (replay)':>19}{'ratio':>7}"]
    for r in rows:
        lines.append(
            f"{r.shape:<16}{r.tokens:>3}{r.capacity:>4}{r.snapshot_bytes_per_slot:>17,}{r.replay_bytes_per_slot:>15,}"
            f"{r.max_sequences_snapshot:>17,}{r.max_sequences_replay:>19,}{r.max_sequences_replay / r.max_sequences_snapshot:>7.2f}"
        )
    return "\n".join(lines)


def run(
    spec: Spec,
    shapes: tuple[TargetShape, ...],
    batches: list[int],
    act_dtype: torch.dtype,
    out_dir: Path | None,
    sweep: bool,
    windows: list[int],
    device: torch.device | None = None,
) -> dict[str, object]:
    device = device or torch.device("cuda")
    act = TORCH_TO_DTYPE[act_dtype]
    copy_bw = copy_bandwidth(device)
    print(f"measured copy bandwidth: {copy_bw / 1e12:.3f} TB/s (read + write)")
    rows, verify, memory = [], [], []
    for shape in shapes:
        shape_rows = bench_decode(spec, shape, batches, act_dtype, device, copy_bw, sweep)
        print(format_rows(shape_rows), flush=True)
        rows += shape_rows
        if windows:
            decode_ms = {r.batch: r.timing["median_ms"] for r in shape_rows if r.kernel == "baseline"}
            verify_rows = bench_verify(spec, shape, batches, windows, act_dtype, device, copy_bw, decode_ms, sweep)
            print(format_verify_rows(verify_rows), flush=True)
            verify += verify_rows
            mem = memory_rows(spec, shape, act, windows)
            print(format_memory_rows(mem), flush=True)
            memory += mem
    result = {
        "spec": spec.name,
        "spec_sha256": spec.source_sha256,
        "activation_dtype": str(act_dtype).replace("torch.", ""),
        "environment": environment(device),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "decode": [asdict(r) for r in rows],
        "verify": [asdict(r) for r in verify],
        "memory": [asdict(r) for r in memory],
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"bench_{spec.name}_{'_'.join(s.name for s in shapes)}.json"
        path.write_text(json.dumps(result, indent=1, sort_keys=True))
        print(f"wrote {path}")
    return result
