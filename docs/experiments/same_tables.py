"""A kernel change timed against the build before it: the same dispatch tables, the shipped module against the code.

For each --shape (SPEC/SHAPE) the committed module in GENERATED/GPU and a module rendered from the current templates
with that module's own tables for every kernel kind (so only the kernel text differs), plus any --variant module
files of the same shape (edited copies, e.g. a knob the templates do not have). Every module passes `check_decode`
(and `check_speculative` where the shape has a window) on the GPU first. Then, in one process on the same inputs: replay
decode over whole flush cycles (every row flushing on the same step, and staggered), replay verify + commit with
every draft accepted, and the baseline decode step, medians over CUDA-graph replays on cold layer states.

    python docs/experiments/same_tables.py --shape mamba2/nemotron-h --shape gdn/qwen3.5-mtp --batch 1,8,128,512 \
        --variant mamba2/nemotron-h=path/to/edited.py --gpu h200 --out DIR
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch

from replaygen.configs import BucketConfig, KernelConfig, KernelKind
from replaygen.harness import check_decode, check_speculative
from replaygen.measure import DecodeWorkload, VerifyWorkload, cold_layers, copy_bandwidth
from replaygen.runtime import import_path, load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import DType
from replaygen.traffic import replay_decode_bytes

ROOT = Path(__file__).resolve().parents[2]


def shipped_tables(module: types.ModuleType) -> dict[KernelKind, tuple[BucketConfig, ...]]:
    """Every kernel kind's dispatch table as the module bakes it."""
    return {
        kind: tuple(BucketConfig(max_batch, KernelConfig.from_fields(knobs)) for max_batch, knobs in getattr(module, f"_{kind.name}_CONFIGS"))
        for kind in KernelKind
    }


def modules_for(args, spec, shape, variants: list[str]) -> dict[str, types.ModuleType]:
    shipped = import_path((args.generated or ROOT / "generated") / args.gpu / f"{spec.name}_{shape.ident}.py")
    modules = {f"built for {args.gpu}": shipped, "this code, same tables": load_kernels(spec, shape, shipped_tables(shipped))}
    for path in variants:
        modules[Path(path).stem] = import_path(ROOT / path)
    return modules


def check(modules: dict[str, types.ModuleType], spec, shape, device) -> None:
    for name, module in modules.items():
        reports = [check_decode(module, spec, shape, device=device, act_dtype=torch.bfloat16, batch=4, cycles=2, use_gate=False, seed=3)]
        if shape.window > 1:
            reports.append(check_speculative(module, spec, shape, device=device, act_dtype=torch.bfloat16, batch=4, steps=8, use_gate=False, seed=3))
        failed = [line for report in reports if not report.ok for line in report.lines()[1:]]
        print(f"check {spec.name}/{shape.name} {name}: {'ok' if not failed else 'FAIL ' + '; '.join(failed)}", flush=True)


def time_shape(args, spec, shape, modules, device, bandwidth: float) -> list[dict]:
    act = torch.bfloat16
    bytes_per_row = replay_decode_bytes(spec, shape, DType.BFLOAT16).total
    rows = []
    for batch in args.batch:
        layers = cold_layers(spec, shape, batch, device)
        decode = {name: DecodeWorkload(module, spec, shape, batch, act, device, layers=layers) for name, module in modules.items()}
        baseline = next(iter(decode.values())).time_baseline(shape.capacity)
        for name, work in decode.items():
            config = work.module._pick(work.module._REPLAY_DECODE_CONFIGS, batch)
            for together in (True, False):
                t = work.time_replay(config["route"], config["flush_at"] or shape.capacity, together=together)
                rows.append({"shape": f"{spec.name}/{shape.name}", "batch": batch, "kernel": name, "what": "decode " + ("together" if together else "staggered"),
                             "us": t.median_ms * 1e3, "spread_us": (t.p80_ms - t.p20_ms) * 1e3, "vs_baseline_decode": baseline.median_ms / t.median_ms,
                             "copy_fraction": batch * bytes_per_row / (t.median_ms * 1e-3) / bandwidth})
        rows.append({"shape": f"{spec.name}/{shape.name}", "batch": batch, "kernel": "baseline", "what": "decode", "us": baseline.median_ms * 1e3,
                     "spread_us": (baseline.p80_ms - baseline.p20_ms) * 1e3, "vs_baseline_decode": 1.0, "copy_fraction": float("nan")})
        del decode
        if shape.window > 1:
            for name, module in modules.items():
                work = VerifyWorkload(module, spec, shape, batch, shape.window, act, device, layers=layers, with_baseline=False)
                t = work.time_replay("all", len(work.cycle))
                rows.append({"shape": f"{spec.name}/{shape.name}", "batch": batch, "kernel": name, "what": f"verify T={shape.window} all accepted",
                             "us": t.median_ms * 1e3, "spread_us": (t.p80_ms - t.p20_ms) * 1e3, "vs_baseline_decode": t.median_ms / baseline.median_ms,
                             "copy_fraction": float("nan")})
                del work
        for row in rows:
            if row["batch"] == batch:
                print(f"{row['shape']:22s} b{batch:<4d} {row['what']:26s} {row['kernel']:28s} {row['us']:9.2f} us (p20-p80 {row['spread_us']:.2f})"
                      f"  x{row['vs_baseline_decode']:.3f}  {row['copy_fraction']:.1%} copy", flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", required=True, metavar="SPEC/SHAPE")
    parser.add_argument("--variant", action="append", default=[], metavar="SPEC/SHAPE=FILE", help="an edited module of that shape, relative to the project")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--generated", type=Path, default=None, help="folder of built modules (default: the project's generated/)")
    parser.add_argument("--batch", default="1,8,32,128,512")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    for target in args.shape:
        spec_name, shape_name = target.split("/")
        spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
        shape = spec.shape(shape_name)
        modules = modules_for(args, spec, shape, [v.split("=", 1)[1] for v in args.variant if v.split("=", 1)[0] == target])
        check(modules, spec, shape, device)
        rows += time_shape(args, spec, shape, modules, device, bandwidth)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "same_tables.json").write_text(json.dumps({"copy_bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
