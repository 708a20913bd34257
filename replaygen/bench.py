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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from replaygen import __version__
from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, default_configs
from replaygen.harness import check_decode
from replaygen.measure import DecodeWorkload, Timing, copy_bandwidth
from replaygen.runtime import load_kernels
from replaygen.spec.model import DType, Spec, TargetShape
from replaygen.traffic import baseline_decode_bytes, replay_decode_bytes

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
    grid = [(8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8)]
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


def run(spec: Spec, shapes: tuple[TargetShape, ...], batches: list[int], act_dtype: torch.dtype, out_dir: Path | None, sweep: bool) -> dict[str, object]:
    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device)
    print(f"measured copy bandwidth: {copy_bw / 1e12:.3f} TB/s (read + write)")
    rows = []
    for shape in shapes:
        shape_rows = bench_decode(spec, shape, batches, act_dtype, device, copy_bw, sweep)
        print(format_rows(shape_rows), flush=True)
        rows += shape_rows
    result = {
        "spec": spec.name,
        "spec_sha256": spec.source_sha256,
        "activation_dtype": str(act_dtype).replace("torch.", ""),
        "environment": environment(device),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "decode": [asdict(r) for r in rows],
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"bench_{spec.name}.json"
        path.write_text(json.dumps(result, indent=1, sort_keys=True))
        print(f"wrote {path}")
    return result
