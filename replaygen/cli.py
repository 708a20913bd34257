"""Command line: build, check, compile, show, list, bench, plot, tune."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from replaygen import __version__
from replaygen.configs import BATCH_BUCKETS, DEFAULT_FLUSH_GROUPS, KernelKind
from replaygen.errors import ReplaygenError
from replaygen.offline import ARCHITECTURES
from replaygen.precision import VARIANT_NAMES, WIDE_BUFFERS
from replaygen.tune.space import TUNABLE_KINDS as TUNABLE

if TYPE_CHECKING:
    from replaygen.spec.model import Spec

DEFAULT_BATCHES = ",".join(map(str, BATCH_BUCKETS))

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_FLAGS = {name: flag for flag, name in DTYPES.items()}
DTYPE_HELP = "activation dtype, one of the spec's activations (default: bf16, else the spec's first)"

# Options that name a GPU folder of tuning records or modules (dest: flag), held to build.GPU_NAME.
GPU_OPTIONS = {"gpu": "--gpu", "recorded_gpu": "--recorded-gpu"}


class _Commands:
    """The subcommand parsers, each with the options every command takes (`common`)."""

    def __init__(self, subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser):
        self.subparsers = subparsers
        self.common = common

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.subparsers.add_parser(name, parents=[self.common], **kwargs)


def _add_spec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="spec file, or the name of a shipped spec (mamba2, gdn)")
    parser.add_argument("--shape", action="append", metavar="NAME", help="target shape of the spec (repeatable; default: all)")


def _add_int(parser: argparse.ArgumentParser, flag: str, minimum: int, **kwargs) -> None:
    """Add an integer option; `_check_minimums` refuses a value below `minimum`, naming `flag`."""
    action = parser.add_argument(flag, type=int, **kwargs)
    parser.set_defaults(minimums={**(parser.get_default("minimums") or {}), action.dest: (flag, minimum)})


def _check_minimums(args: argparse.Namespace) -> None:
    """ReplaygenError naming the first integer option (`_add_int`) below its minimum (each value of a repeated one)."""
    for dest, (flag, minimum) in getattr(args, "minimums", {}).items():
        value = getattr(args, dest)
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item < minimum:
                raise ReplaygenError(f"{flag} must be at least {minimum}, got {item}")


def _normalize_gpu_options(args: argparse.Namespace) -> None:
    """Every GPU name given (GPU_OPTIONS) as records and module folders are named (lowercase), or ReplaygenError."""
    from replaygen.paths import gpu_name

    for dest, flag in GPU_OPTIONS.items():
        if getattr(args, dest, None) is not None:
            setattr(args, dest, gpu_name(getattr(args, dest), flag))


def _resolve_paths(args: argparse.Namespace) -> None:
    """The spec file a command names (a path or a shipped spec's name), and the default folders that go with it
    (replaygen.paths): its records for --tune-dir (tune: --out), its modules for build's --out."""
    from replaygen.paths import RECORDS, SPECS, modules_dir, project_of_folder, records_dir, shipped, spec_file

    if getattr(args, "spec", None) is not None:
        args.spec = spec_file(args.spec)
        if hasattr(args, "tune_dir") and args.tune_dir is None:
            args.tune_dir = records_dir(args.spec)
        if args.command == "build" and args.out is None:
            args.out = modules_dir(args.spec)
        if args.command == "tune" and args.out is None:
            args.out = records_dir(args.spec)
    if args.command == "list":
        if args.specs_dir is None:
            args.specs_dir = shipped(SPECS)
        if args.tune_dir is None:
            args.tune_dir = shipped(RECORDS) if args.specs_dir == shipped(SPECS) else project_of_folder(args.specs_dir) / RECORDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replaygen", description="Generate, check and inspect ReplaySSM decode kernels from a spec.")
    parser.add_argument("--version", action="version", version=f"replaygen {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    common = argparse.ArgumentParser(add_help=False)  # -v also after the command
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress")
    sub = _Commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), common)

    p = sub.add_parser("build", help="generate kernel modules for a spec's shapes", description="Render the kernels of each target shape into importable modules under OUT/GPU/.")
    _add_spec(p)
    p.add_argument("--gpu", default="h200", help="GPU the configs are for; names the output folder (default: h200)")
    p.add_argument("--out", default=None, type=Path, help=(
        "output folder (default: generated/ beside the spec's specs/ folder; for a spec of an installed replaygen, generated/ here)"))
    p.add_argument("--tune-dir", default=None, type=Path, help="tuning records, read from TUNE_DIR/GPU/SPEC_SHAPE.json (default: tune/ beside the spec's specs/ folder)")
    p.add_argument("--allow-default", action="store_true", help="build with the documented default configs where no tuning record applies (and say so)")
    p.add_argument("--accept-env-mismatch", action="store_true", help="apply records tuned under another triton or replaygen version (listed); never those of another GPU or of changed kernels")
    p.add_argument("--spread-flushes", action="store_true", help=(
        "leave out the replay-decode configs that gather the rows' flushes on a few steps of a shared clock "
        "(align_flushes): every step then costs about the same, 1-12%% more on average on the H100"))
    _add_int(p, "--flush-groups", 1, default=DEFAULT_FLUSH_GROUPS, metavar="N", help=(
        "aligned flushes: the slots form N groups (slot %% N) that flush on N evenly spaced steps of the clock "
        "(default: %(default)s; each flushing step then costs about one baseline step on the H100, the same average "
        "as 1, where one step flushes every row at about 1.4x a baseline step)"))

    p = sub.add_parser("check", help="run the generated kernels against the float64 reference", description=(
        "Generate the kernels and compare them step by step with the float64 reference over several flush cycles, "
        "both replay routes, with padding rows and sequences that flush on different steps. Uses the GPU when there "
        "is one, else the Triton interpreter on the CPU (there, shapes are reduced unless --full)."))
    _add_spec(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=(
        "activation dtype, one of the spec's activations (default: fp32 on CPU, bf16 on GPU, else the spec's first)"))
    _add_int(p, "--batch", 1, default=3, help="batch rows (default: 3)")
    _add_int(p, "--cycles", 1, default=3, help="flush cycles per sequence (default: 3)")
    p.add_argument("--full", action="store_true", help="check the full shapes on the CPU too (slow under the interpreter)")
    _add_int(p, "--jobs", 1, default=None, metavar="N", help="on the CPU, shapes checked at once in worker processes (default: the CPUs)")
    p.add_argument("--gpu", default=None, help=(
        "check every config `build --gpu GPU` bakes from TUNE_DIR instead of the defaults: one module per bucket position "
        "of the dispatch tables, each config run at --batch rows (needs a CUDA GPU; kernels without records keep their defaults)"))
    _add_int(p, "--bucket", 1, action="append", metavar="K", help=(
        "with --gpu: check only bucket position K (1-based, repeatable; default: every position), so that one shape's "
        "positions can run in separate processes"))
    p.add_argument("--tune-dir", default=None, type=Path, help="tuning records folder for --gpu (default: tune/ beside the spec's specs/ folder)")

    p = sub.add_parser("compile", help="compile every kernel for a GPU architecture, without that GPU", description=(
        "Compile every kernel a shape's module launches for a GPU architecture on this machine (no GPU needed): the "
        "module's own calls at one batch size per dispatch bucket, and the calls that switch the kernels' optional paths "
        "(the other replay route, the gate, directly given decay and weight). Reports registers, local memory (spills), "
        "shared memory, SASS instructions and shuffles per kernel; fails on a compile error or a kernel beyond the "
        "architecture's shared memory or threads per block."))
    _add_spec(p)
    p.add_argument("--arch", default=None, help=(
        f"architecture ({', '.join(ARCHITECTURES)}; default: the compute capability the --gpu records were tuned on, else sm_90)"))
    p.add_argument("--gpu", default=None, help="compile the configs `build --gpu GPU` bakes from TUNE_DIR (default: the documented defaults)")
    p.add_argument("--tune-dir", default=None, type=Path, help="tuning records folder for --gpu (default: tune/ beside the spec's specs/ folder)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=DTYPE_HELP)

    p = sub.add_parser("show", help="buffer layout, bytes per step, memory per slot, speedup bound", description="Print what the spec derives for each shape: the replay-buffer layout, the traffic model and memory per slot.")
    _add_spec(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=DTYPE_HELP)
    p.add_argument("--state-dtype", choices=sorted(DTYPES), default=None, help=(
        "show every shape with this state dtype instead of its own (round-to-nearest where the shape rounds "
        "stochastically and this is fp32): what a 16-bit state would save"))

    p = sub.add_parser("bench", help="time baseline vs replay decode on the GPU", description=(
        "Time baseline and replay decode side by side in one process on the same inputs: cold state (layer states "
        "cycled past L2), whole flush cycles, CUDA graphs, medians with the 20-80% spread; report the traffic model "
        "and the fraction of the measured copy bandwidth."))
    _add_spec(p)
    p.add_argument("--batch", default=DEFAULT_BATCHES, help=f"comma-separated batch sizes (default: {DEFAULT_BATCHES})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=DTYPE_HELP)
    p.add_argument("--sweep", action="store_true", help="also time a small grid of launch configs and keep the best")
    p.add_argument("--T", dest="windows", default="2,4,6,8", help="speculative windows to time verify at (default: 2,4,6,8; '' to skip)")
    p.add_argument("--L", dest="capacities", default="", help="buffer capacities L to sweep replay decode over, e.g. 4,8,16,32 (default: none)")
    p.add_argument("--L-batch", dest="capacity_batches", default=None, help="batch sizes of the --L sweep (default: those of --batch)")
    p.add_argument("--out", type=Path, default=None, help="write bench_<spec>_<shapes>.json here")
    p.add_argument("--plots", action="store_true", help="also write PNG plots next to the JSON (needs --out and matplotlib)")
    p.add_argument("--gpu", default=None, help="time decode with the configs `build --gpu GPU` bakes from TUNE_DIR (default: defaults)")
    p.add_argument("--tune-dir", default=None, type=Path, help="tuning records folder for --gpu (default: tune/ beside the spec's specs/ folder)")
    p.add_argument("--allow-default", action="store_true", help="with --gpu, time the documented default configs where no tuning record applies (as build does, and say so)")

    p = sub.add_parser("drift", help="how far each precision choice's state drifts from the exact recurrence", description=(
        "Per precision choice (state dtype, rounding, float32 buffers), run replay and baseline decode of one shape from "
        "the same random states over many steps of the same random inputs, beside the float64 recurrence, and report "
        "the state's relative error and the worst output row-head at given step counts. Runs on the GPU when there is "
        "one, else under Triton's interpreter at reduced sizes (as check does; its float32 -> bfloat16 convert "
        "truncates, so bfloat16 round-to-nearest is then not what the GPU does)."))
    _add_spec(p)
    p.add_argument("--variants", default=",".join(VARIANT_NAMES), help=f"comma-separated precision choices (default: all of {','.join(VARIANT_NAMES)}); a state choice joined with +{WIDE_BUFFERS} runs both, e.g. bfloat16+{WIDE_BUFFERS}")
    p.add_argument("--steps", default="1000,10000", help="comma-separated step counts to report at; the last is the run's length (default: 1000,10000)")
    p.add_argument("--batch", type=int, default=32, help="sequences (default: 32)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=DTYPE_HELP)
    p.add_argument("--seed", type=int, default=0, help="inputs' and rounding's seed (default: 0)")

    p = sub.add_parser("plot", help="PNG plots from a saved bench JSON", description="Plot speedup vs batch, time vs L, verify cost vs T and bandwidth fraction from a `bench --out` JSON (needs matplotlib).")
    p.add_argument("json", type=Path, help="bench_<spec>_<shapes>.json written by bench --out")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: the JSON's folder)")

    p = sub.add_parser("tune", help="search the kernels' launch configs on this GPU and record every trial", description=(
        "Per shape, batch size and kernel, search the launch configs (block_v, warps, register cap; for replay decode the "
        "route, flush threshold and a fused or separate flush; for the replay kernels precomputed scores, the ring prefetch "
        "and how the fold runs) with Optuna, or every candidate with --exhaustive. Each candidate is checked against the float64 "
        "reference, then timed as bench does (cold state, whole flush cycles, CUDA graphs). Every trial is written to "
        "OUT/GPU/SPEC_SHAPE.json as it ends; `replaygen build --gpu GPU` bakes the winners in."))
    _add_spec(p)
    p.add_argument("--batch", default=DEFAULT_BATCHES, help=f"comma-separated batch sizes, the upper edges of the dispatch buckets (default: {DEFAULT_BATCHES})")
    p.add_argument("--kernels", default=",".join(k.value for k in TUNABLE), help=f"comma-separated kernels to tune (default: {','.join(k.value for k in TUNABLE)})")
    _add_int(p, "--trials", 1, default=30, help="Optuna trials per shape, kernel and batch size (default: 30)")
    p.add_argument("--exhaustive", action="store_true", help="time every candidate of the space instead (for small spaces and for checking the search)")
    p.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE", help="restrict a parameter to one value, e.g. flush_at=16 (repeatable); the structures a search starts from take it too")
    p.add_argument("--storage", default=None, metavar="URL", help="Optuna storage URL shared by several processes or hosts (default: the journal file OUT/GPU/optuna.journal)")
    p.add_argument("--gpu", default=None, help="GPU name the records are filed under (default: from the device name, e.g. h100)")
    p.add_argument("--out", default=None, type=Path, help="records folder (default: tune/ beside the spec's specs/ folder)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop starting trials after this long; each search gets an equal share of the time left")
    _add_int(p, "--seed", 0, default=0, help="sampler seed (default: 0)")
    _add_int(p, "--recorded", 0, default=0, metavar="K", help=(
        "search nothing: time again the K fastest configs the records in OUT hold for each search, each config ranked by "
        "its latest trial, of earlier kernel code too (re-validates the winners after a kernel change); --fix NAME=VALUE "
        "sets that parameter in them"))
    p.add_argument("--recorded-from", default=None, metavar="SHAPE", help=(
        "with --recorded, take the K fastest configs of another shape's records of the spec on this GPU instead, at the "
        "same batch and at the batch of equal work (as many state values per step: a TP8 split's batch 256 also takes "
        "the unsplit shape's batch 32); a new shape, e.g. a tensor-parallel split, starts from a tuned neighbour's "
        "winners, each timed at its own sizes"))
    p.add_argument("--recorded-gpu", default=None, metavar="GPU", help=(
        "with --recorded, take the K fastest configs of another GPU's records under OUT instead (made with this Triton "
        "and replaygen version), each shape's own or --recorded-from's: a new GPU starts from the winners of one tuned "
        "before, each timed on this one"))
    p.add_argument("--retime", action="store_true", help=(
        "with --exhaustive or --recorded, time every candidate again even where OUT holds its trial (crashed ones excepted); "
        "the new trial supersedes the old one in the records"))
    _add_int(p, "--compile-workers", 0, default=None, metavar="N", help=(
        "with --exhaustive or --recorded, processes that compile each search's candidates ahead of the GPU (default: the CPUs "
        "less two; 0: off)"))

    p = sub.add_parser("spec-from-config", help="a spec file for the recurrent layers of an HF transformers model", description=(
        "Write the spec file of an HF transformers causal LM's recurrent layers: the shipped spec of their family "
        "(mamba2, gdn or kda) with one shape per distinct layer shape read from the model's config (nothing downloaded); "
        "then `replaygen build FILE` builds its modules."))
    p.add_argument("model", type=Path, help="the model's folder, or its config.json")
    p.add_argument("--out", required=True, type=Path, help="spec file to write")
    _add_int(p, "--capacity", 2, default=16, metavar="L", help="ring-buffer entries per sequence (default: %(default)s)")
    _add_int(p, "--window", 1, default=4, metavar="T", help="speculative window (default: %(default)s)")

    p = sub.add_parser("list", help="specs, their shapes, and GPUs with tuning records", description="List the specs in SPECS_DIR with their shapes, the GPUs that have tuning records in TUNE_DIR and, per GPU, which shapes' records hold trials of which kernels (and which shapes have none, so build runs their documented defaults).")
    p.add_argument("--specs-dir", default=None, type=Path, help="folder of spec files (default: the shipped specs)")
    p.add_argument("--tune-dir", default=None, type=Path, help="tuning records folder (default: the shipped records, or tune/ beside --specs-dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_minimums(args)
        _normalize_gpu_options(args)
        _resolve_paths(args)
        return COMMANDS[args.command](args)
    except ReplaygenError as exc:
        print(f"replaygen {args.command}: error: {exc}", file=sys.stderr)
        return 2


def cmd_build(args: argparse.Namespace) -> int:
    from replaygen.build import build_spec, select_shapes
    from replaygen.spec import load_spec

    spec = load_spec(args.spec)
    shapes = select_shapes(spec, args.shape)
    built = build_spec(spec, shapes, args.gpu, args.out, tune_dir=args.tune_dir, allow_default=args.allow_default, accept_env_mismatch=args.accept_env_mismatch,
                        spread_flushes=args.spread_flushes, flush_groups=args.flush_groups)
    for module in built:
        print(f"{spec.name}/{module.plan.shape.name} for {args.gpu}: {'wrote' if module.written else 'unchanged'} {module.path}")
        for line in module.resolved.lines:
            print(f"  {line}")
    written = sum(module.written for module in built)
    folder = args.out / args.gpu
    print(f"{len(built)} module(s) in {folder}: {written} written, {len(built) - written} unchanged. From {args.out.resolve().parent}, "
          f"`from {args.out.name}.{args.gpu} import {built[0].plan.module_name}`; or build with --out into a package of yours")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    has_gpu = torch.cuda.is_available()
    if args.bucket and not args.gpu:
        raise ReplaygenError("check --bucket selects bucket positions of the tables `build --gpu GPU` bakes: pass --gpu")
    if args.gpu and not has_gpu:
        raise ReplaygenError(f"check --gpu {args.gpu} needs a CUDA GPU (none found): tuned configs run at the full shapes, on the GPU they were tuned for")
    device = _kernel_device(has_gpu)
    from replaygen.build import select_shapes
    from replaygen.spec import load_spec

    spec = load_spec(args.spec)
    dtype = getattr(torch, DTYPES[_activation_dtype(spec, args.dtype, "bf16" if has_gpu else "fp32")])
    groups = _check_groups(select_shapes(spec, args.shape), reduce=not has_gpu and not args.full)
    started = time.monotonic()
    jobs = min(args.jobs or os.cpu_count() or 1, len(groups)) if not has_gpu else 1
    pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs > 1 else None
    try:
        work = [(run_shape, shapes, pool.submit(_check_group, args.spec, run_shape, shapes[0].name, str(dtype), args) if pool else None) for run_shape, shapes in groups.items()]
        failed = 0
        for index, (run_shape, shapes, future) in enumerate(work):
            names = ", ".join(shape.name for shape in shapes)
            reduced = "" if run_shape in shapes else f" (reduced for the interpreter: {_describe(run_shape)}; --full for the real shapes)"
            print(f"[{index + 1}/{len(groups)}] {spec.name}/{names} on {device}{reduced}", flush=True)
            lines, failures, seconds = future.result() if future else _check_group(args.spec, run_shape, shapes[0].name, str(dtype), args)
            print("\n".join(lines))
            print(f"  {seconds:.0f} s ({time.monotonic() - started:.0f} s in all, {jobs} process(es))", flush=True)
            failed += failures
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


def _check_group(spec_file: Path, run_shape, shape_name: str, dtype_name: str, args: argparse.Namespace) -> tuple[list[str], int, float]:
    """`check` of one (reduced) shape: its report lines, the number of failed scenarios, its seconds. Runs in a
    worker process of its own where `check` runs several at once."""
    import torch

    from replaygen.harness import check_module
    from replaygen.runtime import load_kernels
    from replaygen.spec import load_spec

    began = time.monotonic()
    spec = load_spec(spec_file)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    lines, failed = [], 0
    for label, configs in _check_variants(spec, spec.shape(shape_name), args) if args.gpu else [("", None)]:
        if label:
            lines.append(f"  {label}")
        module = load_kernels(spec, run_shape, configs)
        for report in check_module(module, spec, run_shape, device=device, act_dtype=dtype, batch=args.batch, cycles=args.cycles):
            lines += report.lines()
            failed += not report.ok
    return lines, failed, time.monotonic() - began


def _activation_dtype(spec: Spec, requested: str | None, usual: str) -> str:
    """The --dtype a verb runs `spec` at: `requested`, refused unless among the spec's activations; by default `usual`
    where the spec supports it, else the spec's first activation."""
    supported = [DTYPE_FLAGS[act.value] for act in spec.activations]
    if requested is None:
        return usual if usual in supported else supported[0]
    if requested not in supported:
        listed = ", ".join(act.value for act in spec.activations)
        raise ReplaygenError(f"--dtype {requested} ({DTYPES[requested]}): {spec.source_file} supports activations {listed} only")
    return requested


def _kernel_device(has_gpu: bool) -> str:
    """Where the kernels run: "cuda", or "cpu" under Triton's interpreter (switched on here, before triton loads)."""
    if has_gpu:
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    from replaygen.runtime import require_interpreter_support

    require_interpreter_support()
    return "cpu"


def _check_groups(shapes, reduce: bool) -> dict:
    """The shapes `check` runs, each once: the shape itself, or with `reduce` (the interpreter) its reduced sizes,
    with the spec's shapes that reduce to it (a model's tensor-parallel splits often reduce to the same sizes; a
    shape of another layout, state dtype, rounding or cache dtypes runs apart)."""
    groups: dict = {}
    for shape in shapes:
        run_shape = _reduced(shape) if reduce else shape
        key = next((known for known in groups if _unnamed(known) == _unnamed(run_shape)), run_shape)
        groups.setdefault(key, []).append(shape)
    return groups


def _unnamed(shape):
    """Everything a shape says but its name."""
    from dataclasses import replace

    return replace(shape, name="")


def _check_variants(spec, shape, args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    """What `check --gpu` runs for `shape`: one config set per bucket position of the tables `build --gpu` would
    bake (labelled with the batch sizes each tuned kernel's config serves), only the positions --bucket names if it
    names any."""
    from replaygen.configs import bucket_range, bucket_variants
    from replaygen.tune.apply import resolve_configs
    from replaygen.tune.space import TUNABLE_KINDS

    resolved = resolve_configs(spec, shape, args.gpu, args.tune_dir, allow_default=True)
    for line in resolved.lines:
        print(f"  {line}")
    tables = resolved.configs
    positions = bucket_variants(tables)
    wanted = set(args.bucket or range(1, len(positions) + 1))
    beyond = sorted(k for k in wanted if not 1 <= k <= len(positions))
    if beyond:
        raise ReplaygenError(f"check --bucket {beyond[0]}: {spec.name}/{shape.name} has bucket positions 1-{len(positions)} for {args.gpu}")
    variants = []
    for i, configs in enumerate(positions):
        if i + 1 not in wanted:
            continue
        served = "; ".join(
            f"{kind.value} {bucket_range(tables[kind], i)}" for kind in TUNABLE_KINDS if i < len(tables[kind])
        )
        variants.append((f"configs of {args.gpu} bucket {i + 1}: {served}", configs))
    return variants


def cmd_compile(args: argparse.Namespace) -> int:
    from replaygen.build import select_shapes
    from replaygen.configs import module_defaults
    from replaygen.offline import architecture, compile_job, compile_modules
    from replaygen.spec import load_spec
    from replaygen.tune.apply import resolve_configs

    spec = load_spec(args.spec)
    dtype = _activation_dtype(spec, args.dtype, "bf16")
    headers, jobs = [], []
    for shape in select_shapes(spec, args.shape):
        source, notes, arch = "the documented defaults", (), architecture(args.arch or "sm_90")
        tables = module_defaults(spec, shape)
        if args.gpu:
            resolved = resolve_configs(spec, shape, args.gpu, args.tune_dir, allow_default=True)
            source, notes, tables = f"the configs of {args.gpu} ({resolved.source})", resolved.lines, resolved.configs
            if args.arch is None:
                arch = _records_architecture(spec, shape, args.gpu, args.tune_dir) or arch
        headers.append([f"{spec.name}/{shape.name} for {arch.name}, {dtype} activations, {source}", *(f"  {note}" for note in notes)])
        jobs.append(compile_job(spec, shape, tables, arch, DTYPES[dtype]))
    reports = compile_modules(jobs)
    for header, report in zip(headers, reports):
        print("\n".join(header + report.lines()))
    failed = sum(not report.ok for report in reports)
    print("every kernel compiled" if not failed else f"{failed} shape(s) with FAILED calls")
    return 1 if failed else 0


def _records_architecture(spec, shape, gpu: str, tune_dir: Path):
    """The architecture of the compute capability `gpu`'s records of `shape` were tuned on (None without records)."""
    from replaygen.offline import architecture
    from replaygen.tune.records import read_records, record_path

    path = record_path(tune_dir, gpu, spec, shape)
    if not path.exists():
        return None
    found = {t.environment.compute_capability for t in read_records(path).trials}
    if len(found) > 1:
        raise ReplaygenError(f"{path}: trials of several compute capabilities ({', '.join(sorted(found))}): pass --arch")
    return architecture(found.pop()) if found else None


def _reduced(shape):
    from dataclasses import replace

    key_heads = min(shape.key_heads, 2)
    ratio = min(shape.heads_per_key_head, 2)
    return replace(shape, heads=key_heads * ratio, key_heads=key_heads, value_dim=min(shape.value_dim, 16), key_dim=min(shape.key_dim, 32))


def _describe(shape) -> str:
    rank = f" rank={shape.rank}" if shape.rank > 1 else ""
    return f"heads={shape.heads} key_heads={shape.key_heads} value_dim={shape.value_dim} key_dim={shape.key_dim}{rank} L={shape.capacity} T={shape.window}"


def cmd_show(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from replaygen.build import select_shapes
    from replaygen.plan import buffers
    from replaygen.spec import load_spec
    from replaygen.spec.model import DType, Rounding
    from replaygen.traffic import STATE_BUDGET_BYTES, baseline_decode_bytes, entry_bytes, replay_decode_bytes, slot_memory, speculative_memory, speedup_bound

    spec = load_spec(args.spec)
    act = DType(DTYPES[_activation_dtype(spec, args.dtype, "bf16")])
    print(f"spec {spec.name} ({spec.source_file}, sha256 {spec.source_sha256[:12]}): {spec.description}")
    print(f"  update {spec.update.kind.value}, decay per {spec.decay.granularity.value}, activations {act.value}")
    for shape in select_shapes(spec, args.shape):
        if args.state_dtype is not None:
            state_dtype = DType(DTYPES[args.state_dtype])
            shape = replace(shape, state_dtype=state_dtype, rounding=shape.rounding if state_dtype.itemsize < 4 else Rounding.NEAREST)
        rounding = f", {shape.rounding.value} rounding" if shape.state_dtype.itemsize < 4 else ""
        print(f"\nshape {shape.name}: {_describe(shape)}, state {shape.state_dtype.value} {shape.layout.value}{rounding}")
        print(f"  replay buffer per slot (ring of L + T = {shape.capacity + shape.window} entries, at most L committed):")
        for buf in buffers(spec, shape):
            rows = "key_heads" if buf.per_key_head else "heads"
            n_rows = shape.key_heads if buf.per_key_head else shape.heads
            width = f", {buf.width}" if buf.width > 1 else ""
            print(f"    {buf.attr:<14} [{rows}={n_rows}, L+T={shape.capacity + shape.window}{width}] {(buf.dtype or act).value:<9} ({buf.field.value})")
        print(f"    one entry: {entry_bytes(spec, shape, act):,} bytes")
        base = baseline_decode_bytes(spec, shape, act)
        rep = replay_decode_bytes(spec, shape, act)
        print("  bytes per step and sequence      baseline      replay (avg over a flush cycle of L steps)")
        for field in ("state_read", "state_write", "buffer_read", "buffer_write", "inputs", "outputs", "total"):
            print(f"    {field:<28} {getattr(base, field):>12,.0f} {getattr(rep, field):>12,.0f}")
        print(f"  speedup bound (equal bandwidth efficiency): {speedup_bound(spec, shape, act):.3f}x; at other capacities: " + ", ".join(
            f"L={capacity} {speedup_bound(spec, replace(shape, capacity=capacity), act):.3f}x" for capacity in (4, 8, 16, 32, 64) if capacity != shape.capacity))
        mem = slot_memory(spec, shape, act)
        print(f"  memory per slot: baseline {mem.baseline:,} B; replay {mem.replay:,} B (checkpoint {mem.replay_checkpoint:,} + buffers {mem.replay_buffers:,} + cursors {mem.replay_cursor:,})")
        spec_mem = speculative_memory(spec, shape, act, shape.window)
        most = spec_mem.sequences()
        print(f"  speculative decoding, T={shape.window}: snapshot verify {spec_mem.snapshots:,} B per slot (a state per window token); "
              f"sequences in {STATE_BUDGET_BYTES >> 30} GiB of one layer's state: plain decode {most[0]:,}, snapshot verify {most[1]:,}, "
              f"replay {most[2]:,} ({most[2] / most[1]:.2f}x snapshot verify)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from replaygen.errors import SpecError
    from replaygen.spec import load_spec

    specs = sorted(args.specs_dir.glob("*.yaml"))
    if not specs:
        raise ReplaygenError(f"no spec files (*.yaml) in {args.specs_dir}: pass --specs-dir")
    loaded = []
    for path in specs:
        try:
            spec = load_spec(path)
        except SpecError as exc:
            print(f"{path}: INVALID: {exc}")
            continue
        loaded.append(spec)
        print(f"{spec.name} ({path}): {spec.description}")
        for shape in spec.shapes:
            print(f"  {shape.name:<18} {_describe(shape)}")
    from replaygen.paths import gpus_with_records

    gpus = gpus_with_records(args.tune_dir)
    print(f"GPUs with tuning records in {args.tune_dir}: {', '.join(gpus) if gpus else 'none'}")
    for gpu in gpus:
        for spec in loaded:
            print(f"  {gpu} {spec.name}:")
            for kernels, shapes in _record_coverage(args.tune_dir, gpu, spec).items():
                print(f"    {kernels}: {', '.join(shapes)}")
    return 0


def _record_coverage(tune_dir: Path, gpu: str, spec: Spec) -> dict[str, list[str]]:
    """The spec's shapes grouped by the kernels their record file on `gpu` holds passing trials of (whether those
    trials still apply is `build`'s to say); shapes without a file under "no records", an unreadable file named."""
    from replaygen.errors import TuningRecordError
    from replaygen.tune.records import TrialStatus, read_records, record_path

    groups: dict[str, list[str]] = {}
    for shape in spec.shapes:
        path = record_path(tune_dir, gpu, spec, shape)
        if not path.exists():
            label = "no records (build needs --allow-default: documented defaults)"
        else:
            try:
                trials = read_records(path).trials
            except TuningRecordError as exc:
                label = f"UNREADABLE ({exc})"
            else:
                kinds = {t.key.kind for t in trials if t.status is TrialStatus.OK}
                label = "trials of " + (", ".join(k.value for k in KernelKind if k in kinds) or "no kernel that passed")
        groups.setdefault(label, []).append(shape.name)
    return groups


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ReplaygenError(f"{flag} must be comma-separated integers, got '{text}'") from None
    if any(v < 1 for v in values):
        raise ReplaygenError(f"{flag} values must be positive, got '{text}'")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ReplaygenError("bench needs a CUDA GPU (none found)")
    from replaygen.bench import run
    from replaygen.build import select_shapes
    from replaygen.spec import load_spec

    spec = load_spec(args.spec)
    batches = _int_list("--batch", args.batch)
    windows = _int_list("--T", args.windows)
    capacities = _int_list("--L", args.capacities)
    if any(c < 2 for c in capacities):
        raise ReplaygenError(f"--L values must be at least 2 (the kernels need L >= 2T), got '{args.capacities}'")
    capacity_batches = _int_list("--L-batch", args.capacity_batches) if args.capacity_batches else None
    shapes = select_shapes(spec, args.shape)
    act_dtype = getattr(torch, DTYPES[_activation_dtype(spec, args.dtype, "bf16")])
    tuned = None
    if args.gpu:
        from replaygen.bench import TORCH_TO_DTYPE, verify_shape
        from replaygen.tune.apply import resolve_configs

        tuned = {}

        def resolve(shape, allow_default: bool = False) -> None:
            resolved = resolve_configs(spec, shape, args.gpu, args.tune_dir, allow_default=allow_default)
            for line in resolved.lines:
                print(f"{shape.name}: {line}")
            tuned[shape.name] = resolved.configs

        for shape in shapes:
            resolve(shape, allow_default=args.allow_default)
        # Verify runs on the shape with the buffer capacity the traffic model prefers; a spec shape of its own
        # (e.g. nemotron-h-mtp) brings its tuning records, or the documented defaults when it has none.
        act = TORCH_TO_DTYPE[act_dtype]
        for vshape in dict.fromkeys(verify_shape(shape, spec, act, tokens) for shape in shapes for tokens in windows):
            if vshape.name not in tuned and vshape in spec.shapes:
                resolve(vshape, allow_default=True)
    run(spec, shapes, batches, act_dtype, args.out, args.sweep, windows,
        capacities=capacities, capacity_batches=capacity_batches, plots=args.plots, tuned=tuned)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from replaygen.plots import plot_bench

    for path in plot_bench(args.json, args.out):
        print(f"wrote {path}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    import torch

    if args.timeout is not None and not args.timeout > 0:
        raise ReplaygenError(f"--timeout must be positive, got {args.timeout}")
    if not torch.cuda.is_available():
        raise ReplaygenError("tune needs a CUDA GPU (none found): it times every candidate on the GPU it tunes for")
    from replaygen.build import select_shapes
    from replaygen.spec import load_spec
    from replaygen.tune.run import run_tune

    spec = load_spec(args.spec)
    try:
        kinds = tuple(KernelKind(name.strip()) for name in args.kernels.split(",") if name.strip())
    except ValueError:
        raise ReplaygenError(f"--kernels takes {','.join(k.value for k in TUNABLE)}, got '{args.kernels}'") from None
    if not kinds or not set(kinds) <= set(TUNABLE):
        raise ReplaygenError(f"--kernels takes {','.join(k.value for k in TUNABLE)}, got '{args.kernels}'")
    if args.recorded and args.exhaustive:
        raise ReplaygenError("--recorded and --exhaustive exclude each other (the first times recorded configs, the second every candidate)")
    if args.recorded_from and not args.recorded:
        raise ReplaygenError("--recorded-from needs --recorded K (the number of its fastest configs to time)")
    if args.recorded_gpu and not args.recorded:
        raise ReplaygenError("--recorded-gpu needs --recorded K (the number of its fastest configs to time)")
    if args.retime and not (args.exhaustive or args.recorded):
        raise ReplaygenError("--retime needs --exhaustive or --recorded (an Optuna search steers by the values its journal already holds)")
    fixed = []
    for item in args.fix:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ReplaygenError(f"--fix takes NAME=VALUE, got '{item}'")
        fixed.append((name.strip(), value.strip()))
    run_tune(
        spec,
        select_shapes(spec, args.shape),
        kinds=kinds,
        batches=tuple(_int_list("--batch", args.batch)),
        trials=args.trials,
        exhaustive=args.exhaustive,
        fixed=tuple(fixed),
        storage=args.storage,
        gpu=args.gpu,
        out_dir=args.out,
        timeout_s=args.timeout,
        seed=args.seed,
        compile_workers=args.compile_workers,
        retime=args.retime,
        recorded=args.recorded,
        recorded_from=args.recorded_from,
        recorded_gpu=args.recorded_gpu,
    )
    return 0


def cmd_drift(args: argparse.Namespace) -> int:
    import torch

    from replaygen.build import select_shapes
    from replaygen.drift import DriftVariant, measure_drift
    from replaygen.precision import precision_variant
    from replaygen.runtime import load_kernels
    from replaygen.spec import load_spec

    spec = load_spec(args.spec)
    act = getattr(torch, DTYPES[_activation_dtype(spec, args.dtype, "bf16")])
    report_at = tuple(_int_list("--steps", args.steps))
    if args.batch < 1:
        raise ReplaygenError(f"--batch must be at least 1, got {args.batch}")
    device = _kernel_device(torch.cuda.is_available())
    names = [name for name in args.variants.split(",") if name]
    for spec_shape in select_shapes(spec, args.shape):
        shape = spec_shape if device == "cuda" else _reduced(spec_shape)
        variants = []
        for name in names:
            try:
                variant = precision_variant(spec, shape, name)
            except ValueError as err:
                raise ReplaygenError(f"--variants: {err}") from None
            variants.append(DriftVariant(name, variant, load_kernels(spec, variant)))
        print(f"{spec.name}/{shape.name} ({_describe(shape)}): batch {args.batch}, {act}, {device}; relative errors against the float64 recurrence")
        print(f"  {'variant':<22} {'steps':>7} {'state replay':>13} {'state baseline':>15} {'output replay':>14} {'output baseline':>16}")
        points = measure_drift(spec, variants, steps=max(report_at), report_at=report_at, batch=args.batch, device=device, act_dtype=act, seed=args.seed)
        for name, p in points:
            print(f"  {name:<22} {p.steps:>7} {p.replay_state:>13.2e} {p.baseline_state:>15.2e} {p.replay_output:>14.2e} {p.baseline_output:>16.2e}", flush=True)
    return 0


def cmd_spec_from_config(args: argparse.Namespace) -> int:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ReplaygenError("spec-from-config reads the model's config with HF transformers: pip install 'replaygen[transformers]'") from None
    from replaygen.integrations.transformers import spec_from_config
    from replaygen.spec import load_spec_text

    folder = args.model.parent if args.model.name == "config.json" else args.model
    if not (folder / "config.json").is_file():
        raise ReplaygenError(f"no config.json in {folder}")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ReplaygenError(f"{folder / 'config.json'}: {exc}") from None
    text = spec_from_config(config, capacity=args.capacity, window=args.window)
    spec = load_spec_text(text, str(args.out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    shapes = ", ".join(f"{s.name} ({_describe(s)})" for s in spec.shapes)
    print(f"wrote {args.out}: spec {spec.name}, shapes {shapes}; next: replaygen build {args.out} --gpu GPU")
    return 0


COMMANDS = {
    "bench": cmd_bench,
    "build": cmd_build,
    "check": cmd_check,
    "compile": cmd_compile,
    "drift": cmd_drift,
    "show": cmd_show,
    "list": cmd_list,
    "plot": cmd_plot,
    "spec-from-config": cmd_spec_from_config,
    "tune": cmd_tune,
}

if __name__ == "__main__":
    sys.exit(main())
