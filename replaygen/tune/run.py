"""`replaygen tune` on a CUDA device: wire the device, the record files, the driver and the report."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from replaygen.configs import KernelKind
from replaygen.errors import ReplaygenError
from replaygen.offline import architecture
from replaygen.paths import gpu_name
from replaygen.spec.model import Spec, TargetShape
from replaygen.tune.objective import gpu_evaluator
from replaygen.tune.records import RecordStore, current_environment, record_path
from replaygen.tune.report import LineProgress, format_summary, summary_rows
from replaygen.tune.study import JOURNAL_NAME, Mode, SearchResult, TuneSettings, plan_tasks, tune
from replaygen.tune.warm import CacheWarmer

# A GPU model in a device name: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA A100-SXM4-80GB" -> a100.
GPU_MODEL = re.compile(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b")
ACTIVATION_PREFERENCE = ("bfloat16", "float16", "float32")


def gpu_name_of(device_name: str) -> str:
    match = GPU_MODEL.search(device_name)
    if match is None:
        raise ReplaygenError(f"cannot name the GPU '{device_name}' for its records folder: pass --gpu NAME")
    return match.group(1).lower()


def cache_warmer(compute_capability: str, dtype_name: str, workers: int | None = None) -> CacheWarmer | None:
    """A warmer compiling for the tuning GPU's architecture in `workers` processes (None: CacheWarmer's default), or
    None where `workers` is 0 or (said so) where offline compilation does not know the architecture."""
    if workers == 0:
        return None
    try:
        return CacheWarmer(architecture(compute_capability), dtype_name, workers)
    except ReplaygenError as exc:
        print(f"candidates compile one at a time: {exc}", file=sys.stderr)
        return None


def run_tune(
    spec: Spec,
    shapes: tuple[TargetShape, ...],
    *,
    kinds: tuple[KernelKind, ...],
    batches: tuple[int, ...],
    trials: int,
    exhaustive: bool,
    fixed: tuple[tuple[str, str], ...],
    storage: str | None,
    gpu: str | None,
    out_dir: Path,
    timeout_s: float | None,
    seed: int,
    compile_workers: int | None = None,
    retime: bool = False,
    recorded: int = 0,
    recorded_from: str | None = None,
    recorded_gpu: str | None = None,
) -> list[SearchResult]:
    """Tune on the current CUDA device; records go to out_dir/<gpu>/, the summary to stdout. `recorded` > 0 times
    that many recorded configs per search again instead of searching (study.Mode.RECORDED), taken from the records of
    shape `recorded_from` (each shape's own by default) on GPU `recorded_gpu` (this one by default) under out_dir."""
    import torch

    device = torch.device("cuda")
    gpu = gpu_name(gpu) if gpu else gpu_name_of(torch.cuda.get_device_name(device))
    if recorded_gpu is not None:
        recorded_gpu = gpu_name(recorded_gpu, "--recorded-gpu")
    dtype_name = next(d for d in ACTIVATION_PREFERENCE if d in {a.value for a in spec.activations})
    act_dtype = getattr(torch, dtype_name)
    environment = current_environment(gpu, device)
    settings = TuneSettings(
        trials=trials,
        mode=Mode.RECORDED if recorded else Mode.EXHAUSTIVE if exhaustive else Mode.OPTUNA,
        storage=storage,
        journal=Path(out_dir) / gpu / JOURNAL_NAME,
        seed=seed,
        activation_dtype=dtype_name,
        retime=retime,
        recorded=recorded or 1,
    )
    tasks = plan_tasks(spec, shapes, kinds, batches, fixed)
    sources = record_sources(spec, shapes, out_dir, recorded_from, recorded_gpu, gpu) if recorded_from or recorded_gpu else None
    stores = {shape.name: RecordStore(record_path(out_dir, gpu, spec, shape), spec=spec.name, shape=shape.name, gpu=gpu) for shape in shapes}
    print(
        f"tuning {spec.name} on {environment.device_name} (sm {environment.compute_capability}, triton {environment.triton}) as '{gpu}', "
        f"{dtype_name}: {len(tasks)} searches, {_mode_text(settings, recorded_from, recorded_gpu)}",
        flush=True,
    )
    warmer = cache_warmer(environment.compute_capability, dtype_name, compile_workers) if settings.mode is not Mode.OPTUNA else None
    try:
        results = tune(
            tasks,
            evaluator_for=lambda shape: gpu_evaluator(spec, shape, device, act_dtype, kinds),
            store_for=lambda shape: stores[shape.name],
            environment=environment,
            settings=settings,
            progress=LineProgress(sys.stderr, trials if settings.mode is Mode.OPTUNA else None),
            timeout_s=timeout_s,
            warm=warmer,
            source_for=(lambda shape: sources[shape.name]) if sources else None,
        )
    finally:
        if warmer is not None:
            warmer.close()
    print(format_summary(summary_rows(results)))
    for store in stores.values():
        print(f"records: {store.path} ({len(store.trials)} trials)")
    print(f"next: replaygen build {spec.source_file} --gpu {gpu} --tune-dir {out_dir}")
    return results


def record_sources(
    spec: Spec, shapes: tuple[TargetShape, ...], out_dir: Path, shape_name: str | None, source_gpu: str | None, gpu: str
) -> dict[str, RecordStore]:
    """Per tuned shape, the records recorded mode takes its configs from (`tune --recorded-from`, `--recorded-gpu`):
    those of `spec`'s shape `shape_name` (each tuned shape's own where None) on `source_gpu` (this `gpu` where None)
    under out_dir. Every one must exist before a trial runs."""
    flags = " ".join(f for f in (f"--recorded-from {shape_name}" if shape_name else "", f"--recorded-gpu {source_gpu}" if source_gpu else "") if f)
    folder = source_gpu or gpu
    try:
        source_shape = spec.shape(shape_name) if shape_name else None
    except KeyError as exc:
        raise ReplaygenError(f"--recorded-from {shape_name}: {exc.args[0]}") from None
    sources = {}
    for shape in shapes:
        source = source_shape or shape
        path = record_path(out_dir, folder, spec, source)
        if not path.exists():
            raise ReplaygenError(f"{flags}: no records of {source.name} at {path} (tune that shape on {folder} first, or pass --out)")
        sources[shape.name] = RecordStore(path, spec=spec.name, shape=source.name, gpu=folder)
    return sources


def _mode_text(settings: TuneSettings, recorded_from: str | None = None, recorded_gpu: str | None = None) -> str:
    if settings.mode is Mode.RECORDED:
        where = (f" of {recorded_from}" if recorded_from else "") + (f" on {recorded_gpu}" if recorded_gpu else "")
        equal = " and the batch of equal work" if recorded_from else ""
        return f"the {settings.recorded} fastest recorded configs each" + (f"{where} at the same batch{equal}, timed at each shape" if where else ", timed again")
    return "exhaustive" if settings.mode is Mode.EXHAUSTIVE else f"{settings.trials} Optuna trials each"
