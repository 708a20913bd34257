"""Compiling an exhaustive search's candidates on the CPUs while the GPU times them.

A search compiles each candidate on first launch, one at a time, between two timings. `CacheWarmer` compiles the
candidates of the search about to run in worker processes for the tuning GPU's architecture (`replaygen.offline`):
Triton keeps each cubin in its on-disk cache, so the tuning process finds the candidate's kernels compiled. A
warmer's failures are not reported: the tuning process meets the same error and records it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from replaygen.configs import KernelConfig
from replaygen.errors import ReplaygenError
from replaygen.offline import Architecture, CompileRun, compile_job
from replaygen.keys import candidate_tables

if TYPE_CHECKING:
    from replaygen.tune.study import SearchTask

log = logging.getLogger(__name__)


class CacheWarmer:
    """Per search, the compile run of its candidates (the previous search's run is cancelled)."""

    def __init__(self, arch: Architecture, act_dtype: str, workers: int | None = None):
        """`workers` defaults to the CPUs less two (the tuning process and the GPU's feeding keep theirs)."""
        self.arch = arch
        self.act_dtype = act_dtype
        self.workers = workers or max(1, (os.cpu_count() or 1) - 2)
        self.run: CompileRun | None = None

    def __call__(self, task: SearchTask, configs: tuple[KernelConfig, ...]) -> None:
        """Start compiling `configs` of `task`, in the order the search measures them. A config that does not render
        is left to the search (which records why); a warm-up that cannot start is skipped, said so in the log."""
        self.close()
        jobs = []
        for config in configs:
            try:
                jobs.append(compile_job(task.spec, task.shape, candidate_tables(task.spec, task.shape, task.kind, config), self.arch, self.act_dtype, (task.kind,)))
            except ReplaygenError:
                continue
        try:
            self.run = CompileRun(jobs, self.workers)
        except OSError as exc:
            log.warning("%s: candidates compile one at a time (no worker processes: %s)", task.label, exc)
            return
        log.info("%s: compiling %d candidates ahead in %d worker processes", task.label, len(jobs), min(self.workers, len(jobs)))

    def close(self) -> None:
        if self.run is not None:
            self.run.cancel()
            self.run = None
