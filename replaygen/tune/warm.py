"""Compiling the candidates of exhaustive and recorded searches on the CPUs while the GPU times them.

A search compiles each candidate on first launch, one at a time, between two timings. `CacheWarmer` compiles the
candidates of every search of a run, in the order they will be timed, in worker processes for the tuning GPU's
architecture (`replaygen.offline`): Triton keeps each cubin in its on-disk cache, so the tuning process finds the
candidate's kernels compiled, and a later search's candidates compile while the GPU times an earlier one's (a
recorded run has one or two candidates per search: compiled one search at a time, the GPU would wait for each). A
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
    """The compile run of a tune's candidates, all searches together (a second call cancels the first's run)."""

    def __init__(self, arch: Architecture, act_dtype: str, workers: int | None = None):
        """`workers` defaults to the CPUs less two (the tuning process and the GPU's feeding keep theirs)."""
        self.arch = arch
        self.act_dtype = act_dtype
        self.workers = workers or max(1, (os.cpu_count() or 1) - 2)
        self.run: CompileRun | None = None

    def __call__(self, searches: list[tuple[SearchTask, tuple[KernelConfig, ...]]]) -> None:
        """Start compiling each search's configs, searches and configs in the order they are measured. A config that
        does not render is left to its search (which records why); a warm-up that cannot start is skipped, said so in
        the log."""
        self.close()
        jobs = []
        for task, configs in searches:
            for config in configs:
                try:
                    jobs.append(compile_job(task.spec, task.shape, candidate_tables(task.spec, task.shape, task.kind, config), self.arch, self.act_dtype, (task.kind,)))
                except ReplaygenError:
                    continue
        if not jobs:
            return
        try:
            self.run = CompileRun(jobs, self.workers)
        except OSError as exc:
            log.warning("candidates compile one at a time (no worker processes: %s)", exc)
            return
        log.info("compiling %d candidates of %d searches ahead in %d worker processes", len(jobs), len(searches), min(self.workers, len(jobs)))

    def close(self) -> None:
        if self.run is not None:
            self.run.cancel()
            self.run = None
