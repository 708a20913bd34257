"""Measuring one candidate: import it, check it against the reference, then time it.

The check is cheap (batch 2 on the tuning GPU: decode over one flush cycle; verify over a few windows
of random acceptance, then with every draft accepted until each sequence has flushed twice and wrapped its
ring) and runs once per rendered module; only a module that passes is timed. Timing is the project's: steady-state time per
decode (or verify) step over whole flush cycles, cold state, CUDA graphs (`measure`), one
workload per batch size whose module is swapped between candidates.

A candidate that raises is recorded as FAILED (OUT_OF_RESOURCES for Triton's OutOfResources
and CUDA out-of-memory) and the search goes on, unless the CUDA context no longer works
afterwards: then it is recorded as CRASHED (never tried again) and the tune stops
(`TuneAborted`), keeping the records written so far.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from replaygen.configs import KernelKind
from replaygen.errors import ReplaygenError, one_line
from replaygen.runtime import import_source
from replaygen.spec.model import Spec, TargetShape
from replaygen.traffic import verify_flush_period
from replaygen.keys import Candidate
from replaygen.tune.records import TrialStatus, TrialTiming

log = logging.getLogger(__name__)

CHECK_BATCH = 2
CHECK_CYCLES = 1
CHECK_VERIFY_STEPS = 4
TIMING_REPEATS = 20


class TuneAborted(ReplaygenError):
    """The GPU is unusable after a candidate (e.g. an illegal memory access poisons the CUDA context); raised by the driver."""


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str  # what disagreed, when not ok


@dataclass(frozen=True, kw_only=True)
class Outcome:
    status: TrialStatus
    timing: TrialTiming | None
    error: str = ""

    @property
    def device_lost(self) -> bool:
        return self.status is TrialStatus.CRASHED


Loader = Callable[[Candidate], ModuleType]
Checker = Callable[[ModuleType, Candidate], CheckResult]
Timer = Callable[[ModuleType, Candidate, int], TrialTiming]


def load_candidate(candidate: Candidate) -> ModuleType:
    return import_source(candidate.source, f"tune_{candidate.kind.value}")


class Evaluator:
    """Runs candidates: load, check (once per module), time; failures become outcomes, not exceptions."""

    def __init__(self, *, checker: Checker, timer: Timer, loader: Loader = load_candidate, health: Callable[[], None] = lambda: None):
        """`health` raises when the device is unusable (on CUDA: torch.cuda.synchronize)."""
        self.checker = checker
        self.timer = timer
        self.loader = loader
        self.health = health
        self._checked: dict[str, CheckResult] = {}

    def evaluate(self, candidate: Candidate, batch: int) -> Outcome:
        try:
            module = self.loader(candidate)
            check = self._checked.get(candidate.key.code)
            if check is None:
                check = self._checked[candidate.key.code] = self.checker(module, candidate)
            if not check.ok:
                return Outcome(status=TrialStatus.WRONG, timing=None, error=check.detail)
            return Outcome(status=TrialStatus.OK, timing=self.timer(module, candidate, batch))
        except Exception as exc:  # a candidate may fail in any way; it is recorded, never fatal by itself
            status = TrialStatus.OUT_OF_RESOURCES if _out_of_resources(exc) else TrialStatus.FAILED
            message = one_line(exc)
            log.info("%s %s failed: %s", candidate.kind.value, candidate.config, message)
            try:
                self.health()
            except Exception as lost:
                return Outcome(status=TrialStatus.CRASHED, timing=None, error=f"{message}; then the device was unusable: {one_line(lost)}")
            return Outcome(status=status, timing=None, error=message)


def _out_of_resources(exc: BaseException) -> bool:
    import torch

    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return isinstance(exc, torch.OutOfMemoryError)
    return isinstance(exc, (OutOfResources, torch.OutOfMemoryError))


class ReferenceChecker:
    """The candidate's module against the float64 reference, with the harness's scenarios cut short."""

    def __init__(self, spec: Spec, shape: TargetShape, device: object, act_dtype: object):
        self.spec = spec
        self.shape = shape
        self.device = device
        self.act_dtype = act_dtype

    def __call__(self, module: ModuleType, candidate: Candidate) -> CheckResult:
        from replaygen.harness import check_decode, check_speculative_through_flushes

        config = candidate.config
        common = {"device": self.device, "act_dtype": self.act_dtype, "batch": CHECK_BATCH}
        if candidate.kind is KernelKind.REPLAY_DECODE:
            reports = [check_decode(module, self.spec, self.shape, cycles=CHECK_CYCLES, route=config.route.value, flush_at=config.flush_at or None, **common)]
        elif candidate.kind is KernelKind.BASELINE_DECODE:
            reports = [check_decode(module, self.spec, self.shape, cycles=CHECK_CYCLES, **common)]
        else:
            compare_baseline = candidate.kind is KernelKind.BASELINE_VERIFY
            reports = check_speculative_through_flushes(module, self.spec, self.shape, random_steps=CHECK_VERIFY_STEPS, compare_baseline=compare_baseline, **common)
        failures = [f"{report.scenario}: {line.strip()}" for report in reports for line in report.lines()[1:] if "FAIL" in line or "touched" in line]
        return CheckResult(all(report.ok for report in reports), "; ".join(failures))


class WorkloadTimer:
    """Per-step time of a candidate at a batch size, on workloads kept for one batch size at a time."""

    def __init__(self, spec: Spec, shape: TargetShape, device: object, act_dtype: object, repeats: int = TIMING_REPEATS, with_verify_baseline: bool = True):
        self.spec = spec
        self.shape = shape
        self.device = device
        self.act_dtype = act_dtype
        self.repeats = repeats
        self.with_verify_baseline = with_verify_baseline
        self._workloads: dict[tuple[str, int], object] = {}

    def __call__(self, module: ModuleType, candidate: Candidate, batch: int) -> TrialTiming:
        kind = candidate.kind
        shape = self.shape
        if kind in (KernelKind.BASELINE_DECODE, KernelKind.REPLAY_DECODE):
            work = self._workload("decode", batch, module)
            if kind is KernelKind.BASELINE_DECODE:
                return TrialTiming.of(work.time_baseline(shape.capacity, repeats=self.repeats))
            config = candidate.config
            return TrialTiming.of(work.time_replay(config.route.value, config.flush_at or shape.capacity, repeats=self.repeats))
        work = self._workload("verify", batch, module)
        steps = len(verify_flush_period(shape, shape.window, shape.window))
        if kind is KernelKind.REPLAY_VERIFY:
            return TrialTiming.of(work.time_replay("all", steps, repeats=self.repeats))
        if kind is KernelKind.BASELINE_VERIFY:
            return TrialTiming.of(work.time_baseline("all", steps, repeats=self.repeats))
        raise ValueError(f"{kind.value} is not a tunable kernel")

    def _workload(self, family: str, batch: int, module: ModuleType) -> object:
        """The workload of `family` at `batch` with `module` swapped in; workloads of other batch sizes are freed."""
        from replaygen.measure import DecodeWorkload, VerifyWorkload

        stale = [key for key in self._workloads if key[1] != batch]
        for key in stale:
            del self._workloads[key]
        if stale:
            _empty_cache()
        work = self._workloads.get((family, batch))
        if work is None:
            if family == "decode":
                work = DecodeWorkload(module, self.spec, self.shape, batch, self.act_dtype, self.device)
            else:
                work = VerifyWorkload(module, self.spec, self.shape, batch, self.shape.window, self.act_dtype, self.device, with_baseline=self.with_verify_baseline)
            self._workloads[(family, batch)] = work
        work.module = module
        return work


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_evaluator(spec: Spec, shape: TargetShape, device: object, act_dtype: object, kinds: tuple[KernelKind, ...]) -> Evaluator:
    """The evaluator `replaygen tune` uses on a CUDA device (the previous shape's workloads are freed first)."""
    import torch

    _empty_cache()
    return Evaluator(
        checker=ReferenceChecker(spec, shape, device, act_dtype),
        timer=WorkloadTimer(spec, shape, device, act_dtype, with_verify_baseline=KernelKind.BASELINE_VERIFY in kinds),
        health=torch.cuda.synchronize,
    )
