"""What a tune shows: one progress line per trial (stderr) and a summary table at the end."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TextIO

from replaygen.configs import REPLAY_KINDS, KernelConfig, KernelKind, Route
from replaygen.tune.records import TrialRecord, TrialStatus
from replaygen.tune.study import Progress, SearchResult, SearchTask

# The kernel each kind's speedup is taken against.
BASELINE_OF = {KernelKind.REPLAY_DECODE: KernelKind.BASELINE_DECODE, KernelKind.REPLAY_VERIFY: KernelKind.BASELINE_VERIFY}


def describe(config: KernelConfig, kind: KernelKind) -> str:
    text = f"bv={config.block_v}" + (f" bk={config.block_k}" if config.block_k else "") + f" w={config.num_warps}"
    text += f" stages={config.num_stages}" if config.num_stages > 1 else ""
    if config.max_registers:
        text += f" maxreg={config.max_registers}"
    if config.evict_state:
        text += " evict-state"
    if kind is KernelKind.REPLAY_DECODE:
        text += f" {config.route.value} flush={config.flush_at}"
        text += "" if config.fused_flush else " flush-launch"
        text += " aligned" if config.align_flushes else ""
        text += f" in {config.flush_groups} groups" if config.flush_groups > 1 else ""
    if kind is KernelKind.REPLAY_VERIFY and config.route is not Route.OUTPUT_ONLY:
        text += f" {config.route.value}"
    if kind is KernelKind.REPLAY_VERIFY and not config.fused_flush:
        text += " flush-launch"
    if config.window_block_v:
        text += f" split window bv={config.window_block_v} w={config.window_warps}"
    if kind in REPLAY_KINDS:
        text += " scores" if config.precompute_scores else ""
        text += " overlap" if config.overlap_scores else ""
        text += f" readout-dot {config.readout_precision}" if config.readout_dot else ""
        text += f" chunk={config.fold_chunk}" + (f" dot {config.fold_precision}" if config.fold_dot else "") + ("" if config.prefetch_ring else " no-prefetch")
    return text


def _ms(record: TrialRecord | None) -> str:
    return f"{record.value:.4f}" if record is not None and math.isfinite(record.value) else "-"


class LineProgress(Progress):
    """One line per trial: `[search/total] shape kind b=N #trial config: result (best ...)`."""

    def __init__(self, stream: TextIO = sys.stderr, trials: int | None = None):
        self.stream = stream
        self.trials = trials
        self._prefix = ""

    def search_started(self, index: int, total: int, task: SearchTask) -> None:
        self._prefix = f"[{index + 1}/{total}] {task.label}"
        free = ", ".join(p.name for p in task.space.free) or "none"
        print(f"{self._prefix}: {task.space.size} points (free: {free})", file=self.stream, flush=True)

    def trial(self, task: SearchTask, number: int, record: TrialRecord, reused: bool, best: TrialRecord | None) -> None:
        result = f"{record.value:.4f} ms" if record.status is TrialStatus.OK else f"{record.status.value.upper()} {record.error[:120]}"
        count = f"#{number}" + (f"/{self.trials}" if self.trials else "")
        note = " (recorded)" if reused else ""
        print(f"{self._prefix} {count} {describe(record.config, task.kind)}: {result}{note} (best {_ms(best)})", file=self.stream, flush=True)

    def search_done(self, result: SearchResult) -> None:
        print(f"{self._prefix}: best {_ms(result.best)} ms after {result.trials} trials ({result.measured} timed now, {result.pruned} pruned)", file=self.stream, flush=True)


@dataclass(frozen=True, kw_only=True)
class SummaryRow:
    shape: str
    kind: KernelKind
    batch: int
    mode: str
    best_ms: float  # inf when nothing passed
    config: str
    vs_default: float | None  # default time / best time
    vs_baseline: float | None  # the baseline kernel's best time / best time
    trials: int
    measured: int


def summary_rows(results: list[SearchResult]) -> list[SummaryRow]:
    best = {(r.task.shape.name, r.task.kind, r.task.batch): r.best for r in results}
    rows = []
    for r in results:
        t = r.task
        value = r.best.value if r.best else math.inf
        base = best.get((t.shape.name, BASELINE_OF.get(t.kind), t.batch))
        rows.append(
            SummaryRow(
                shape=t.shape.name,
                kind=t.kind,
                batch=t.batch,
                mode=r.mode.value,
                best_ms=value,
                config=describe(r.best.config, t.kind) if r.best else "none passed",
                vs_default=_ratio(r.default.value if r.default else math.inf, value),
                vs_baseline=_ratio(base.value if base else math.inf, value),
                trials=r.trials,
                measured=r.measured,
            )
        )
    return rows


def _ratio(other: float, value: float) -> float | None:
    return other / value if math.isfinite(other) and math.isfinite(value) else None


def format_summary(rows: list[SummaryRow]) -> str:
    def x(v: float | None) -> str:
        return f"{v:.3f}x" if v is not None else "-"

    lines = [f"{'shape':<18}{'kernel':<17}{'batch':>6}  {'mode':<11}{'best ms':>10}{'vs default':>11}{'vs baseline':>12}{'trials':>7}{'timed':>6}  config"]
    for r in rows:
        best = f"{r.best_ms:.4f}" if math.isfinite(r.best_ms) else "-"
        lines.append(
            f"{r.shape:<18}{r.kind.value:<17}{r.batch:>6}  {r.mode:<11}{best:>10}{x(r.vs_default):>11}{x(r.vs_baseline):>12}{r.trials:>7}{r.measured:>6}  {r.config}"
        )
    return "\n".join(lines)
