"""From tuning records to the dispatch tables `replaygen build` bakes in.

Per tuned kernel and batch size, the winner is the fastest OK trial whose key still matches:

- hard mismatches are never applied: spec or shape changed since tuning, the code the trial
  ran differs from what its config renders to now (the template text of that kernel, its
  launch code or codegen changed; edits that leave that code as it was, such as comments or
  other kernels' templates, do not count), or the trial was made for another GPU name;
- soft mismatches (another Triton or replaygen version) are applied only when asked
  (`--accept-env-mismatch`), and said so.

Every trial left out is reported with its file and reason. A batch size that was tuned
becomes the upper edge of a bucket (the largest tuned one is open-ended); neighbouring buckets
with one winner merge. Kernels the file never tuned (materialize, load and commit always) keep
their documented defaults, and the build says so; a kernel whose trials all fail to apply
needs --allow-default, and so does one with winners at some tuned batch sizes and none at others
(those would run a neighbouring bucket's config; with it they run the documented default at their size, which was
chosen for that size), and one whose largest tuned batch size is below a size the
file tuned another kernel at (a tune cut short: its open-ended bucket would stretch a small batch's winner
over the large batches).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from replaygen import __version__
from replaygen.configs import DEFAULT_FLUSH_GROUPS, BucketConfig, KernelConfig, KernelKind, bucket_config, module_defaults
from replaygen.errors import ReplaygenError, TuningRecordError, UnsupportedShapeError
from replaygen.spec.model import Spec, TargetShape
from replaygen.tune.records import RecordFile, TrialRecord, TrialStatus, latest_trials, read_records, record_path, render_candidate, shape_sha256, spec_content_sha256, speed_rank
from replaygen.tune.space import TUNABLE_KINDS


class Mismatch(enum.Enum):
    SPEC = "spec changed since tuning"
    SHAPE = "shape changed since tuning"
    SOURCE = "the code it ran differs from what its config renders to now (its template, launch code or codegen changed)"
    INVALID = "config no longer valid (configs.validate_config)"
    GPU = "GPU differs"
    TRITON = "triton version differs"
    REPLAYGEN = "replaygen version differs"

    @property
    def soft(self) -> bool:
        return self in (Mismatch.TRITON, Mismatch.REPLAYGEN)


@dataclass(frozen=True, kw_only=True)
class BuildTarget:
    """What a build's records must match."""

    spec: Spec
    shape: TargetShape
    gpu: str
    triton: str
    spec_content_sha256: str
    replaygen: str = __version__


def build_target(spec: Spec, shape: TargetShape, gpu: str) -> BuildTarget:
    import triton

    return BuildTarget(spec=spec, shape=shape, gpu=gpu, triton=triton.__version__, spec_content_sha256=spec_content_sha256(spec))


def mismatches(trial: TrialRecord, target: BuildTarget) -> list[tuple[Mismatch, str]]:
    """Why `trial` does not match `target` (cheap checks; the source hash is checked for winners only)."""
    found = []
    env = trial.environment
    if trial.key.spec_file_sha256:
        if trial.key.spec_file_sha256 != target.spec.source_sha256:
            found.append((Mismatch.SPEC, f"spec file sha256 {trial.key.spec_file_sha256[:12]} then, {target.spec.source_sha256[:12]} now (a record of format 1)"))
    elif trial.key.spec_content_sha256 != target.spec_content_sha256:
        found.append((Mismatch.SPEC, f"spec content sha256 {trial.key.spec_content_sha256[:12]} then, {target.spec_content_sha256[:12]} now"))
    if trial.key.checks_in_source:
        found.append((Mismatch.SOURCE, "keyed with the module's argument checks (a record of format 1 or 2)"))
    if trial.key.shape_sha256 != shape_sha256(target.shape):
        found.append((Mismatch.SHAPE, f"shape '{target.shape.name}' has other sizes now"))
    if env.gpu != target.gpu:
        found.append((Mismatch.GPU, f"tuned for '{env.gpu}' ({env.device_name}), building for '{target.gpu}'"))
    if env.triton != target.triton:
        found.append((Mismatch.TRITON, f"tuned with triton {env.triton}, triton {target.triton} here"))
    if env.replaygen != target.replaygen:
        found.append((Mismatch.REPLAYGEN, f"tuned with replaygen {env.replaygen}, {target.replaygen} here"))
    return found


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """The configs of one module and where they came from."""

    configs: dict[KernelKind, tuple[BucketConfig, ...]]
    source: str  # the plan's config_source
    notes: tuple[str, ...]  # what was applied, what was not and why


@dataclass
class _KindPick:
    winners: dict[int, TrialRecord] = field(default_factory=dict)  # batch -> trial
    skipped: Counter = field(default_factory=Counter)  # (reason, detail) -> trials left out
    accepted: Counter = field(default_factory=Counter)  # soft (reason, detail) -> winners applied anyway
    uncovered: set[int] = field(default_factory=set)  # batch sizes with passing trials, none of which applies
    tuned: set[int] = field(default_factory=set)  # batch sizes with passing trials
    aligned_left_out: int = 0  # trials with align_flushes not considered (spread_flushes)


def resolve_configs(
    spec: Spec,
    shape: TargetShape,
    gpu: str,
    tune_dir: Path,
    *,
    allow_default: bool = False,
    accept_env_mismatch: bool = False,
    spread_flushes: bool = False,
    flush_groups: int = DEFAULT_FLUSH_GROUPS,
) -> Resolved:
    """The configs to build `shape` with: winners from tune/<gpu>/<spec>_<shape>.json, defaults where allowed.
    `spread_flushes`: leave out the replay-decode trials with align_flushes (and the default's), so that no step
    gathers every row's flush. `flush_groups`: every replay-decode config with align_flushes flushes its rows in
    that many groups (at most its flush period), whatever group count its trial ran: the count sets how many rows
    one flushing step folds (its latency), not the average time per step (docs/perf.md entry 29)."""
    if flush_groups < 1:
        raise ReplaygenError(f"flush_groups must be at least 1, got {flush_groups}")
    defaults = module_defaults(spec, shape)
    path = record_path(tune_dir, gpu, spec, shape)
    label = "/".join(path.parts[-3:])  # e.g. tune/h100/mamba2_nemotron_h.json
    if not path.exists():
        if not allow_default:
            raise TuningRecordError(
                f"no tuning records for {spec.name}/{shape.name} on {gpu} (expected {path}): run `replaygen tune {spec.source_file} "
                f"--shape {shape.name} --gpu {gpu}` on that GPU, or pass --allow-default to build with the documented defaults"
            )
        return Resolved(configs=defaults, source="defaults", notes=(f"no tuning records at {path}: documented defaults (--allow-default)",))
    records = read_records(path)
    if (records.spec, records.shape) != (spec.name, shape.name):
        raise TuningRecordError(f"{path}: holds records of {records.spec}/{records.shape}, not {spec.name}/{shape.name}")
    target = build_target(spec, shape, gpu)
    configs = dict(defaults)
    notes = []
    defaulted = sorted(k.value for k in KernelKind if k not in TUNABLE_KINDS)
    stale = []
    partial: list[tuple[KernelKind, list[int]]] = []  # kinds tuned at some batch sizes whose other tuned sizes went stale
    short: list[tuple[KernelKind, int, list[int]]] = []  # kinds whose largest tuned batch size is below another kind's
    if spread_flushes:
        configs[KernelKind.REPLAY_DECODE] = tuple(replace(b, config=replace(b.config, align_flushes=False)) for b in configs[KernelKind.REPLAY_DECODE])
    picks = {kind: _pick(records, kind, target, accept_env_mismatch, spread_flushes, flush_groups) for kind in TUNABLE_KINDS}
    tuned_anywhere = set().union(*(pick.tuned for pick in picks.values()))
    for kind, pick in picks.items():
        notes += [f"{kind.value}: {line}" for line in skipped_lines(pick.skipped, path)]
        if pick.aligned_left_out:
            notes.append(f"{kind.value}: {pick.aligned_left_out} trial(s) with align_flushes left out (--spread-flushes)")
        for (reason, detail), count in sorted(pick.accepted.items(), key=lambda item: item[0][0].name):
            notes.append(f"{kind.value}: {count} winner(s) applied although {reason.value} ({detail}; --accept-env-mismatch)")
        if pick.winners:
            fallback = {batch: bucket_config(defaults[kind], batch) for batch in pick.uncovered} if allow_default else {}
            configs[kind] = dispatch_table({batch: t.config for batch, t in pick.winners.items()} | fallback)
            buckets = ", ".join(f"b{batch}: {t.value:.4f} ms" for batch, t in sorted(pick.winners.items()))
            notes.append(f"{kind.value}: tuned ({buckets})")
            if pick.uncovered:
                partial.append((kind, sorted(pick.uncovered)))
            beyond = sorted(b for b in tuned_anywhere if b > max(pick.tuned))
            if beyond:
                short.append((kind, max(pick.tuned), beyond))
        elif pick.skipped:
            stale.append(kind.value)
        else:
            defaulted.append(kind.value)
            notes.append(f"{kind.value}: not tuned in {path}: documented defaults")
    if stale:
        if not allow_default:
            raise TuningRecordError(
                f"{path}: no trial of {', '.join(stale)} applies here:\n  " + "\n  ".join(notes)
                + f"\nre-run `replaygen tune` on that GPU (after a kernel change, `replaygen tune {spec.source_file} --shape {shape.name} --kernels "
                f"{','.join(stale)} --recorded 3` times the recorded winners again), or pass --allow-default to build those kernels with the "
                "documented defaults"
            )
        defaulted += stale
        notes += [f"{kind}: documented defaults (--allow-default)" for kind in stale]
    if partial:
        lines = [f"{kind.value} at batch {', '.join(map(str, batches))}" for kind, batches in partial]
        if not allow_default:
            raise TuningRecordError(
                f"{path}: tuned batch sizes where no trial applies any more: {'; '.join(lines)} (their buckets would silently run a "
                f"neighbouring bucket's config):\n  " + "\n  ".join(notes)
                + f"\ntime their recorded winners again with `replaygen tune {spec.source_file} --shape {shape.name} --kernels "
                f"{','.join(kind.value for kind, _ in partial)} --batch {','.join(map(str, sorted({b for _, batches in partial for b in batches})))} "
                "--recorded 3` on that GPU, or pass --allow-default to build them with the documented defaults at those sizes"
            )
        notes += [f"{line}: the documented default at that size (--allow-default)" for line in lines]
    if short:
        lines = [f"{kind.value} up to batch {largest}, not at {', '.join(map(str, beyond))}" for kind, largest, beyond in short]
        if not allow_default:
            raise TuningRecordError(
                f"{path}: kernels tuned at fewer batch sizes than the file's others (a tune cut short?): {'; '.join(lines)} (the larger "
                f"batches would silently run the largest tuned one's config):\n  " + "\n  ".join(notes)
                + f"\ntune them there with `replaygen tune {spec.source_file} --shape {shape.name} --kernels "
                f"{','.join(kind.value for kind, _, _ in short)} --batch {','.join(map(str, sorted({b for _, _, beyond in short for b in beyond})))}` "
                "on that GPU, or pass --allow-default to build them with their largest tuned batch's config"
            )
        notes += [f"{line}: batch {largest}'s config above it (--allow-default)" for line, (_, largest, _) in zip(lines, short)]
    configs[KernelKind.REPLAY_DECODE], regrouped = _group_flushes(configs[KernelKind.REPLAY_DECODE], shape, flush_groups)
    source = label + (f"; defaults for {', '.join(sorted(defaulted))}" if defaulted else "") + ("; flushes spread (no align_flushes)" if spread_flushes else "")
    source += f"; aligned flushes in {flush_groups} groups" if regrouped and flush_groups > 1 else ""
    return Resolved(configs=configs, source=source, notes=tuple(notes))


def skipped_lines(skipped: Counter, path: Path) -> list[str]:
    """One line per reason for the trials left out ((reason, detail) -> trials): the count, and the detail, or how
    many distinct ones there are and the first (a record keeps every trial of earlier code as history)."""
    lines = []
    for reason in sorted({reason for reason, _ in skipped}, key=lambda r: r.name):
        details = sorted(detail for r, detail in skipped if r is reason)
        count = sum(n for (r, _), n in skipped.items() if r is reason)
        detail = details[0] if len(details) == 1 else f"{len(details)} distinct, e.g. {details[0]}"
        lines.append(f"{count} trial(s) in {path} not applied: {reason.value} ({detail})")
    return lines


def _group_flushes(table: tuple[BucketConfig, ...], shape: TargetShape, groups: int) -> tuple[tuple[BucketConfig, ...], bool]:
    """`table` with every align_flushes config set to `groups` flush groups (at most its flush period), and whether
    any config is aligned."""
    grouped = tuple(replace(b, config=_regrouped(b.config, shape, groups)) for b in table)
    return grouped, any(b.config.align_flushes for b in table)


def _regrouped(config: KernelConfig, shape: TargetShape, groups: int) -> KernelConfig:
    """`config` as the build ships it: with align_flushes, in `groups` flush groups (at most its flush period)."""
    if not config.align_flushes:
        return config
    return replace(config, flush_groups=min(groups, config.flush_at or shape.capacity))


def _pick(
    records: RecordFile, kind: KernelKind, target: BuildTarget, accept_env_mismatch: bool, spread_flushes: bool, flush_groups: int
) -> _KindPick:
    """Every OK trial of `kind` checked (cheap fields); per batch size the fastest eligible one whose source re-renders the same.
    A trial timed again later (`tune --retime`) counts with its latest timing only. `spread_flushes`: trials with
    align_flushes are left out. An aligned trial of another group count than the build's `flush_groups` stands for
    its regrouped config (what the build ships) only where no applicable trial timed that config itself."""
    pick = _KindPick()
    eligible: dict[int, list[tuple[TrialRecord, list[tuple[Mismatch, str]]]]] = {}
    for trial in latest_trials(records.trials):
        if trial.key.kind is not kind or trial.status is not TrialStatus.OK or trial.timing is None:
            continue
        if spread_flushes and trial.config.align_flushes:
            pick.aligned_left_out += 1
            continue
        found = mismatches(trial, target)
        if any(not reason.soft for reason, _ in found) or (found and not accept_env_mismatch):
            pick.skipped.update(found)
        else:
            eligible.setdefault(trial.batch, []).append((trial, found))
    current: dict[KernelConfig, tuple[str | None, str]] = {}

    def applies(trial: TrialRecord) -> bool:
        if trial.config not in current:
            current[trial.config] = _source_now(target, kind, trial.config)
        return current[trial.config][0] == trial.key.source_sha256

    for batch, entries in sorted(eligible.items()):
        for trial, found in sorted(entries, key=lambda entry: speed_rank(entry[0])):
            if not applies(trial):
                sha, why = current[trial.config]
                if sha is None:
                    pick.skipped[(Mismatch.INVALID, why)] += 1
                else:
                    pick.skipped[(Mismatch.SOURCE, f"source sha256 {trial.key.source_sha256[:12]} then, {sha[:12]} now")] += 1
                continue
            shipped = _regrouped(trial.config, target.shape, flush_groups)
            if shipped != trial.config and any(other.config == shipped and applies(other) for other, _ in entries):
                continue
            pick.accepted.update(found)
            pick.winners[batch] = trial
            break
    pick.tuned = {t.batch for t in records.trials if t.key.kind is kind and t.status is TrialStatus.OK and t.timing is not None}
    pick.uncovered = pick.tuned - set(pick.winners)
    return pick


def _source_now(target: BuildTarget, kind: KernelKind, config: KernelConfig) -> tuple[str | None, str]:
    """The source sha256 `config` renders to now, or None and why it no longer renders."""
    try:
        return render_candidate(target.spec, target.shape, kind, config).key.source_sha256, ""
    except UnsupportedShapeError as exc:
        return None, str(exc)


def dispatch_table(winners: dict[int, KernelConfig]) -> tuple[BucketConfig, ...]:
    """Buckets up to each tuned batch size, the largest open-ended; equal neighbours merged."""
    batches = sorted(winners)
    table: list[BucketConfig] = []
    for index, batch in enumerate(batches):
        config = winners[batch]
        if table and table[-1].config == config:
            table.pop()
        table.append(BucketConfig(None if index == len(batches) - 1 else batch, config))
    return tuple(table)
