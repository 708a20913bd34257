"""Compiling generated modules for a GPU architecture on a machine without that GPU (or any GPU).

A worker process (`compile_modules`; Triton's JIT there, never its interpreter, whatever this process uses) imports
each module while a stand-in driver reports the target architecture, then calls the module's API on CPU tensors:
at one batch size per bucket of each dispatch table, the call a serving engine makes with the baked config; and
once per kernel kind the calls that switch the kernels' optional paths (the other replay route, the gate, directly
given decay and weight). Every kernel launch takes Triton's own path up to the launch: argument specialization,
constexprs, launch options, compilation to a cubin for the target, its checks of shared memory and threads per
block. The stand-in then records the launch (kernel; registers, local memory and SASS read from the cubin) instead of
running it. A kernel that the interpreter runs but the GPU compiler rejects, or that needs more shared memory than
the GPU has, is found without the GPU.

The module decides on the host whether its kernels launch as programmatic dependents, by the device's compute
capability (`_dependent_launch`), and whether they run compiled code such as inline PTX (`_on_gpu`); for CPU tensors
it would say no to both, so the worker answers for the target architecture instead.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from replaygen.configs import BucketConfig, KernelKind, Route, bucket_config
from replaygen.errors import ReplaygenError, one_line
from replaygen.plan import ModulePlan, plan_module
from replaygen.spec.model import Spec, TargetShape

if TYPE_CHECKING:
    import torch

DEVICE = "cpu"
# The module call that launches each kind's kernels: the labels of a report's "launched by".
CALLS = {
    KernelKind.BASELINE_DECODE: "baseline_decode",
    KernelKind.REPLAY_DECODE: "decode",
    KernelKind.MATERIALIZE: "materialize",
    KernelKind.LOAD: "load",
    KernelKind.REPLAY_VERIFY: "verify",
    KernelKind.COMMIT: "commit",
    KernelKind.BASELINE_VERIFY: "baseline_verify+commit",
}
# Kernel kinds whose calls take the step inputs, so the optional inputs switch their kernels' paths.
WITH_INPUTS = (KernelKind.BASELINE_DECODE, KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY, KernelKind.BASELINE_VERIFY)


@dataclass(frozen=True)
class Architecture:
    """What a compile target offers a kernel launch."""

    name: str  # e.g. "sm_90"
    capability: int  # e.g. 90
    max_shared_bytes: int  # shared memory per block, opt-in maximum
    registers_per_block: int = 65536
    max_threads: int = 1024

    @property
    def dependent_launch(self) -> bool:
        """Programmatic dependent launch (griddepcontrol), compute capability 9.0 and newer."""
        return self.capability >= 90

    def threads_for(self, registers: int) -> int:
        """Most threads per block of a kernel using `registers` per thread (allocated per warp in units of 256)."""
        per_warp = -(-max(registers, 1) * 32 // 256) * 256
        return min(self.max_threads, self.registers_per_block // per_warp * 32)


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("sm_80", 80, 166912),  # A100
        Architecture("sm_86", 86, 101376),  # A10, RTX 30
        Architecture("sm_89", 89, 101376),  # L4, L40S, RTX 40
        Architecture("sm_90", 90, 232448),  # H100, H200
        Architecture("sm_100", 100, 232448),  # B200
        Architecture("sm_120", 120, 101376),  # RTX 50
    )
}


def architecture(name: str) -> Architecture:
    """`sm_90`, `sm90` or `9.0`."""
    text = name.strip().lower()
    match = re.fullmatch(r"(\d+)\.(\d)", text)
    key = f"sm_{match.group(1)}{match.group(2)}" if match else re.sub(r"^sm_?", "sm_", text)
    if key not in ARCHITECTURES:
        raise ReplaygenError(f"unknown architecture '{name}': known are {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[key]


@dataclass(frozen=True)
class CompileJob:
    """One module to compile: its plan, the source rendered from it, the target and the activation dtype."""

    plan: ModulePlan
    source: str
    arch: Architecture
    act_dtype: str  # torch dtype name, e.g. "bfloat16"
    kinds: tuple[KernelKind, ...] = tuple(KernelKind)  # the kernel kinds whose calls run


def compile_job(
    spec: Spec,
    shape: TargetShape,
    tables: dict[KernelKind, tuple[BucketConfig, ...]],
    arch: Architecture,
    act_dtype: str,
    kinds: tuple[KernelKind, ...] = tuple(KernelKind),
) -> CompileJob:
    """The job of compiling the module of `shape` with dispatch `tables` for `arch` (the calls of `kinds`)."""
    from replaygen.codegen import render_module  # looked up here: tests render broken modules through it

    plan = plan_module(spec, shape, arch.name, tables, f"compiled offline for {arch.name}")
    return CompileJob(plan, render_module(plan), arch, act_dtype, kinds)


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel as compiled for the target, and the calls that launched it."""

    kernel: str
    num_warps: int
    num_stages: int
    registers: int  # per thread
    local_bytes: int  # local memory per thread (register spills, stack)
    shared_bytes: int
    instructions: int  # SASS instructions (static count)
    shuffles: int  # SHFL among them
    launched_by: tuple[str, ...]  # "decode b32", ...


@dataclass(frozen=True)
class CallFailure:
    call: str
    error: str


@dataclass(frozen=True)
class CompileReport:
    module: str  # spec/shape
    arch: Architecture
    kernels: tuple[CompiledKernel, ...]
    failures: tuple[CallFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        rows = [f"  {'kernel':<24}{'warps':>6}{'stages':>7}{'regs':>6}{'local B':>8}{'smem B':>8}{'SASS':>7}{'SHFL':>6}  launched by"]
        for k in self.kernels:
            rows.append(
                f"  {k.kernel:<24}{k.num_warps:>6}{k.num_stages:>7}{k.registers:>6}{k.local_bytes:>8}{k.shared_bytes:>8}"
                f"{k.instructions:>7}{k.shuffles:>6}  {', '.join(k.launched_by)}"
            )
        rows += [f"  FAILED {f.call}: {f.error}" for f in self.failures]
        rows.append(f"  {len(self.kernels)} kernels compiled for {self.arch.name}, {len(self.failures)} call(s) failed")
        return rows


class CompileRun:
    """Jobs compiled in worker processes started at once (default: one per CPU, at most one per job): wait for their
    reports, or cancel them. Triton keeps every cubin in its on-disk cache, so a later compile of the same kernel in
    any process on this machine is a cache hit."""

    def __init__(self, jobs: list[CompileJob], workers: int | None = None):
        self._count = len(jobs)
        self._workers = min(len(jobs), workers or os.cpu_count() or 1)  # none without jobs
        self._folder = tempfile.TemporaryDirectory(prefix="replaygen-compile-")
        env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
        self._running: list[subprocess.Popen] = []
        for index in range(self._workers):
            jobs_path = self._path("jobs", index)
            jobs_path.write_bytes(pickle.dumps(jobs[index :: self._workers]))
            command = [sys.executable, "-c", "import sys; from replaygen.offline import work; work(sys.argv[1], sys.argv[2])", str(jobs_path), str(self._path("reports", index))]
            with self._path("output", index).open("w") as output:  # a file, not a pipe: no worker waits for a reader
                self._running.append(subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT))

    def _path(self, what: str, index: int) -> Path:
        return Path(self._folder.name, f"{what}{index}")

    def reports(self) -> tuple[CompileReport, ...]:
        """Wait for the workers; the reports in job order (ReplaygenError where a worker failed)."""
        reports: dict[int, CompileReport] = {}
        try:
            for index, process in enumerate(self._running):
                process.wait()
                out_path = self._path("reports", index)
                if process.returncode != 0 or not out_path.exists():
                    output = self._path("output", index).read_text(errors="replace").strip()
                    raise ReplaygenError(f"offline compile worker exited with {process.returncode}: {output[-2000:]}")
                for position, report in enumerate(pickle.loads(out_path.read_bytes())):
                    reports[index + position * self._workers] = report
        finally:
            self.cancel()
        return tuple(reports[i] for i in range(self._count))

    def cancel(self) -> None:
        """Stop the workers that still run and remove their files."""
        for process in self._running:
            if process.poll() is None:
                process.kill()
            process.wait()
        self._folder.cleanup()

    @property
    def running(self) -> bool:
        return any(process.poll() is None for process in self._running)


def compile_modules(jobs: list[CompileJob], workers: int | None = None) -> tuple[CompileReport, ...]:
    """Compile every job in worker processes (see CompileRun); the reports in job order."""
    return CompileRun(jobs, workers).reports()


def work(jobs_path: str, out_path: str) -> None:
    """Worker process: compile the pickled jobs at `jobs_path`, pickle their reports to `out_path`."""
    jobs = pickle.loads(Path(jobs_path).read_bytes())
    try:
        reports = tuple(_compile(job) for job in jobs)
    except ReplaygenError as exc:
        sys.exit(str(exc))
    Path(out_path).write_bytes(pickle.dumps(reports))


@dataclass(frozen=True)
class _Binary:
    """The function handle the stand-in driver gives Triton for a loaded cubin: what the launch records."""

    registers: int
    local_bytes: int
    instructions: int
    shuffles: int


@dataclass
class _Recorder:
    """Launches seen while a call runs, per compiled kernel."""

    call: str = ""
    # by the compiled binary's hash: name, Triton's metadata, the stand-in's binary, the calls that launched it
    kernels: dict[str, tuple[str, object, _Binary, list[str]]] = field(default_factory=dict)

    def launcher(self, name: str, metadata: object) -> Callable[..., None]:
        key = metadata.hash  # Triton may compile one binary twice (its in-memory cache key is finer); listed once

        def launch(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args) -> None:
            calls = self.kernels.setdefault(key, (name, metadata, function, []))[3]
            if self.call not in calls:
                calls.append(self.call)

        return launch


class _DeviceLimits:
    """Triton's driver utilities as far as loading a kernel needs them: device limits, and the cubin's resources."""

    def __init__(self, arch: Architecture):
        self.arch = arch

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.arch.max_shared_bytes}

    def load_binary(self, name: str, cubin: bytes, shared: int, device: int) -> tuple[None, _Binary, int, int, int]:
        binary = cubin_stats(cubin, name)
        return None, binary, binary.registers, binary.local_bytes, self.arch.threads_for(binary.registers)


class _StandInDriver:
    """Triton's active-driver interface for JIT compilation and launches, for `arch`, without a device."""

    def __init__(self, arch: Architecture, recorder: _Recorder):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch.capability, 32)
        self.utils = _DeviceLimits(arch)
        self.recorder = recorder

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def launcher_cls(self, src: object, metadata: object) -> Callable[..., None]:
        return self.recorder.launcher(src.fn.__name__, metadata)


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(path):
        raise ReplaygenError(f"offline compilation reads registers with Triton's cuobjdump, which is missing ({path})")
    return path


SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def cubin_stats(cubin: bytes, name: str) -> _Binary:
    """Registers and local memory per thread of the kernel in `cubin`, and its SASS: instructions (padding NOPs not
    counted) and warp shuffles among them (cross-lane reductions)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        out = subprocess.run([_cuobjdump(), "-sass", "-res-usage", handle.name], capture_output=True, text=True, check=False)
    match = re.search(r"REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)", out.stdout)
    if match is None:
        raise ReplaygenError(f"cuobjdump printed no resource usage for {name}: {(out.stderr or out.stdout)[-300:]}")
    ops = [m.group(1) for m in map(SASS_LINE.match, out.stdout.splitlines()) if m and m.group(1) != "NOP"]
    return _Binary(int(match.group(1)), int(match.group(2)), len(ops), sum(op == "SHFL" for op in ops))


def _use_stand_in(arch: Architecture, recorder: _Recorder) -> None:
    """Make the stand-in driver of `arch` Triton's active driver (in a worker process: for good)."""
    from triton import knobs
    from triton.compiler import compiler
    from triton.runtime.driver import driver

    if knobs.runtime.interpret:
        raise ReplaygenError("offline compilation needs Triton's JIT: this worker runs the interpreter (TRITON_INTERPRET)")
    driver.set_active(_StandInDriver(arch, recorder))
    compiler.max_shared_mem.cache_clear()


def bucket_batches(table: tuple[BucketConfig, ...]) -> tuple[int, ...]:
    """One batch size per bucket of a dispatch table: its largest, or the open-ended bucket's smallest."""
    edges = [b.max_batch for b in table if b.max_batch is not None]
    return (*edges, edges[-1] + 1 if edges else 1)


def _compile(job: CompileJob) -> CompileReport:
    """Import the job's module with the stand-in driver of its architecture and launch every kernel (in a worker)."""
    import torch

    from replaygen.runtime import import_source

    plan, arch = job.plan, job.arch
    recorder = _Recorder()
    _use_stand_in(arch, recorder)
    module = import_source(job.source, plan.module_name)
    if not hasattr(module, "_dependent_launch") or not hasattr(module, "_on_gpu"):
        raise ReplaygenError(f"{plan.module_name} has no _dependent_launch or _on_gpu: offline compilation does not know this module's launch code")
    module._dependent_launch = lambda device: arch.dependent_launch
    module._on_gpu = lambda device: True
    failures = []
    for label, call in _calls(module, plan, getattr(torch, job.act_dtype), job.kinds):
        recorder.call = label
        try:
            call()
        except Exception as exc:  # a compile error, out of resources, or a host-side error of the module
            failures.append(CallFailure(label, one_line(exc, limit=600)))
    kernels = tuple(
        CompiledKernel(
            kernel=name,
            num_warps=metadata.num_warps,
            num_stages=metadata.num_stages,
            registers=binary.registers,
            local_bytes=binary.local_bytes,
            shared_bytes=metadata.shared,
            instructions=binary.instructions,
            shuffles=binary.shuffles,
            launched_by=tuple(calls),
        )
        for name, metadata, binary, calls in recorder.kernels.values()
    )
    return CompileReport(module=f"{plan.spec.name}/{plan.shape.name}", arch=arch, kernels=kernels, failures=tuple(failures))


def _calls(module: ModuleType, plan: ModulePlan, act_dtype: torch.dtype, kinds: tuple[KernelKind, ...]) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call) of the module's API for `kinds`: per kind, the baked call at each bucket, then the option
    variants once."""
    import torch

    from replaygen.harness import InputFactory, baseline_rounding, materialize_weights

    spec, shape, tables = plan.spec, plan.shape, plan.configs
    factory = InputFactory(spec, shape, DEVICE, act_dtype, seed=0)
    weights = factory.weights()
    state = module.allocate(1, DEVICE, act_dtype)
    baseline = module.allocate_baseline(1, DEVICE)
    snapshots, current = module.allocate_snapshots(1, DEVICE)
    rounding = baseline_rounding(module, 1, DEVICE)
    tokens = shape.window
    options = []  # calls that switch the optional paths, beside the plain one
    if plan.gate_optional:
        options.append(("gate", {"use_gate": True}))
    if plan.roles.direct_decay or plan.roles.direct_weight:
        options.append(("direct inputs", {"use_direct": True}))

    def slots(batch: int) -> torch.Tensor:
        return torch.zeros(batch, dtype=torch.int32)

    def step(batch: int, use_gate: bool = False, use_direct: bool = False) -> dict:
        return {**factory.step(batch, use_gate=use_gate, use_direct=use_direct), **weights}

    def window(batch: int, use_gate: bool = False, use_direct: bool = False) -> dict:
        return {**factory.window(batch, tokens, use_gate=use_gate, use_direct=use_direct), **weights}

    def accepted(batch: int) -> torch.Tensor:
        return torch.full((batch,), tokens, dtype=torch.int32)

    calls: dict[KernelKind, Callable[..., object]] = {
        KernelKind.BASELINE_DECODE: lambda b, **kw: module.baseline_decode(baseline, slots(b), **step(b, **kw), **rounding),
        KernelKind.REPLAY_DECODE: lambda b, route=None, **kw: module.decode(state, slots(b), **step(b, **kw), route=route),
        KernelKind.MATERIALIZE: lambda b: module.materialize(state, slots(b), **materialize_weights(spec, shape, weights)),
        KernelKind.LOAD: lambda b: module.load(state, slots(b), module.allocate_baseline(b, DEVICE)),
        KernelKind.REPLAY_VERIFY: lambda b, **kw: module.verify(state, slots(b), **window(b, **kw)),
        KernelKind.COMMIT: lambda b: module.commit(state, slots(b), accepted(b)),
        KernelKind.BASELINE_VERIFY: lambda b, **kw: (module.baseline_verify(snapshots, current, slots(b), **window(b, **kw), **rounding), module.baseline_commit(current, slots(b), accepted(b))),
    }
    for kind in kinds:
        name, call = CALLS[kind], calls[kind]
        batches = bucket_batches(tables[kind])
        for batch in batches:
            yield f"{name} b{batch}", lambda call=call, batch=batch: call(batch)
        first = batches[0]
        for label, kw in options if kind in WITH_INPUTS else ():
            yield f"{name} b{first} ({label})", lambda call=call, kw=kw: call(first, **kw)
        if kind is KernelKind.REPLAY_DECODE:
            tiled_state_route_only = bucket_config(tables[kind], first).block_k and plan.channel_decay
            for route in Route if not tiled_state_route_only else (Route.STATE_AND_OUTPUT,):
                yield f"{name} b{first} ({route.value})", lambda call=call, route=route: call(first, route=route.value)
