"""From tuning records to the dispatch tables `replaygen build` bakes in.

Per tuned kernel and batch size, the winner is the fastest OK trial that still applies:

- a trial timed again later (the same config at the same batch size, dtype and environment) is superseded: only the
  latest measurement of a config counts, whatever code the earlier one ran;
- hard mismatches are never applied: the code the trial ran differs from what its config renders to now (its
  kernel key, `replaygen.keys`; edits that leave that code as it was, such as comments, formatting, argument checks
  or other kernels, do not count), the config is no longer valid, or the trial was made for another GPU name;
- soft mismatches (another Triton or replaygen version) are applied only when asked (`--accept-env-mismatch`).

A batch size that was tuned becomes the upper edge of a bucket (the largest tuned one is open-ended); neighbouring
buckets with one winner merge. Kernels the file never tuned (materialize, load and commit always) keep their
documented defaults. A kernel whose trials all fail to apply needs --allow-default, and so does one with winners at
some tuned batch sizes and none at others (those would run a neighbouring bucket's config), and one whose largest
tuned batch size is below a size the file tuned another kernel at (a tune cut short: its open-ended bucket would
stretch a small batch's winner over the large batches); with it, those batch sizes run the documented default.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from replaygen import __version__
from replaygen.configs import DEFAULT_FLUSH_GROUPS, BucketConfig, KernelConfig, KernelKind, bucket_config, module_defaults
from replaygen.errors import ReplaygenError, TuningRecordError, UnsupportedShapeError
from replaygen.keys import KernelKey, render_candidate
from replaygen.paths import gpus_with_records
from replaygen.spec.model import Spec, TargetShape
from replaygen.tune.records import RecordFile, TrialRecord, TrialStatus, latest_trials, read_records, record_path, speed_rank
from replaygen.tune.space import TUNABLE_KINDS


class Mismatch(enum.Enum):
    CODE = "the code it ran has changed since"
    INVALID = "its config is no longer valid"
    GPU = "made for another GPU"
    TRITON = "made with another triton version"
    REPLAYGEN = "made with another replaygen version"

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
    replaygen: str = __version__


def build_target(spec: Spec, shape: TargetShape, gpu: str) -> BuildTarget:
    import triton

    return BuildTarget(spec=spec, shape=shape, gpu=gpu, triton=triton.__version__)


def environment_mismatches(trial: TrialRecord, target: BuildTarget) -> list[tuple[Mismatch, str]]:
    """Why `trial` was made elsewhere than `target` builds for (the cheap checks; its code is checked for
    candidate winners only)."""
    found = []
    env = trial.environment
    if env.gpu != target.gpu:
        found.append((Mismatch.GPU, f"'{env.gpu}' ({env.device_name}), building for '{target.gpu}'"))
    if env.triton != target.triton:
        found.append((Mismatch.TRITON, f"triton {env.triton} then, {target.triton} here"))
    if env.replaygen != target.replaygen:
        found.append((Mismatch.REPLAYGEN, f"replaygen {env.replaygen} then, {target.replaygen} here"))
    return found


def changed_definitions(then: KernelKey, now: KernelKey) -> str:
    """Which definitions of the module differ between two keys of one kind, e.g. `_replay_decode_kernel changed`."""
    before, after = dict(then.parts), dict(now.parts)
    changed = sorted(name for name in before.keys() & after.keys() if before[name] != after[name])
    gone = sorted(before.keys() - after.keys())
    new = sorted(after.keys() - before.keys())
    words = [f"{', '.join(changed)} changed"] if changed else []
    words += [f"{', '.join(new)} new"] if new else []
    words += [f"{', '.join(gone)} gone"] if gone else []
    return "; ".join(words) or "the same definitions, in another form"


@dataclass(frozen=True, kw_only=True)
class KindSource:
    """Where one kernel kind's configs came from: one line of the build's summary."""

    kind: KernelKind
    text: str  # e.g. "tuned at batch 1, 2, 4, 8, 32, 128, 256, 512 (tune/h200/x.json)"


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """The configs of one module and where they came from."""

    configs: dict[KernelKind, tuple[BucketConfig, ...]]
    source: str  # the plan's config_source
    kinds: tuple[KindSource, ...]  # per kernel kind, where its configs came from
    notes: tuple[str, ...]  # trials not applied, and why

    @property
    def lines(self) -> tuple[str, ...]:
        return tuple(f"{k.kind.value}: {k.text}" for k in self.kinds) + self.notes


@dataclass
class _KindPick:
    winners: dict[int, TrialRecord] = field(default_factory=dict)  # batch -> trial
    skipped: Counter = field(default_factory=Counter)  # (reason, detail) -> trials left out
    accepted: Counter = field(default_factory=Counter)  # soft (reason, detail) -> winners applied anyway
    superseded: int = 0  # trials timed again later
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
    one flushing step folds (its latency), not the average time per step."""
    if flush_groups < 1:
        raise ReplaygenError(f"flush_groups must be at least 1, got {flush_groups}")
    defaults = module_defaults(spec, shape)
    path = record_path(tune_dir, gpu, spec, shape)
    label = "/".join(path.parts[-3:])  # e.g. tune/h200/mamba2_nemotron_h.json
    if not path.exists():
        if not allow_default:
            raise TuningRecordError(
                f"no tuning records for {spec.name}/{shape.name} on {gpu} (expected {path}){_gpus_with_records(Path(tune_dir), spec, shape)}: run "
                f"`replaygen tune {spec.source_file} --shape {shape.name} --gpu {gpu}` on that GPU, or pass --allow-default to build with the "
                "documented defaults"
            )
        kinds = tuple(KindSource(kind=kind, text="documented defaults (no records, --allow-default)") for kind in KernelKind)
        return Resolved(configs=defaults, source="defaults", kinds=kinds, notes=())
    records = read_records(path)
    if (records.spec, records.shape) != (spec.name, shape.name):
        raise TuningRecordError(f"{path}: holds records of {records.spec}/{records.shape}, not {spec.name}/{shape.name}")
    target = build_target(spec, shape, gpu)
    configs = dict(defaults)
    sources: dict[KernelKind, str] = {kind: "documented defaults (never tuned)" for kind in KernelKind if kind not in TUNABLE_KINDS}
    notes = []
    stale = []
    partial: list[tuple[KernelKind, list[int]]] = []  # kinds tuned at some batch sizes whose other tuned sizes went stale
    short: list[tuple[KernelKind, int, list[int]]] = []  # kinds whose largest tuned batch size is below another kind's
    if spread_flushes:
        configs[KernelKind.REPLAY_DECODE] = tuple(replace(b, config=replace(b.config, align_flushes=False, flush_groups=1)) for b in configs[KernelKind.REPLAY_DECODE])
    picks = {kind: _pick(records, kind, target, accept_env_mismatch, spread_flushes, flush_groups) for kind in TUNABLE_KINDS}
    tuned_anywhere = set().union(*(pick.tuned for pick in picks.values()))
    for kind, pick in picks.items():
        notes += [f"{kind.value}: {line}" for line in skipped_lines(pick.skipped)]
        if pick.aligned_left_out:
            notes.append(f"{kind.value}: {pick.aligned_left_out} trial(s) with align_flushes left out (--spread-flushes)")
        for (reason, detail), count in sorted(pick.accepted.items(), key=lambda item: item[0][0].name):
            notes.append(f"{kind.value}: {count} winner(s) applied although {reason.value} ({detail}; --accept-env-mismatch)")
        superseded = f"; {pick.superseded} earlier trial(s) superseded by later ones" if pick.superseded else ""
        if pick.winners:
            beyond = sorted(b for b in tuned_anywhere if b > max(pick.tuned))
            fallback = {batch: bucket_config(defaults[kind], batch) for batch in (*pick.uncovered, *beyond)} if allow_default else {}
            configs[kind] = dispatch_table({batch: t.config for batch, t in pick.winners.items()} | fallback)
            buckets = ", ".join(f"b{batch} {t.value * 1000:.1f} us" for batch, t in sorted(pick.winners.items()))
            sources[kind] = f"tuned ({buckets}){superseded}"
            if pick.uncovered:
                partial.append((kind, sorted(pick.uncovered)))
            if beyond:
                short.append((kind, max(pick.tuned), beyond))
        elif pick.skipped:
            stale.append(kind)
        else:
            sources[kind] = "documented defaults (not tuned in this file)"
    fix = f"replaygen tune {spec.source_file} --shape {shape.name} --gpu {gpu} --kernels {{kernels}} --recorded 2"
    if stale:
        kernels = ",".join(kind.value for kind in stale)
        if not allow_default:
            raise TuningRecordError(
                f"{path}: no trial of {kernels} applies here:\n  " + "\n  ".join(notes)
                + f"\ntime the recorded winners again on that GPU with `{fix.format(kernels=kernels)}`, or pass --allow-default to build "
                "those kernels with the documented defaults"
            )
        for kind in stale:
            sources[kind] = "documented defaults (no trial applies, --allow-default)"
    if partial:
        lines = [f"{kind.value} at batch {', '.join(map(str, batches))}" for kind, batches in partial]
        kernels = ",".join(kind.value for kind, _ in partial)
        if not allow_default:
            raise TuningRecordError(
                f"{path}: tuned batch sizes where no trial applies any more: {'; '.join(lines)} (their buckets would silently run a "
                f"neighbouring bucket's config):\n  " + "\n  ".join(notes)
                + f"\ntime their recorded winners again on that GPU with `{fix.format(kernels=kernels)} --batch "
                f"{','.join(map(str, sorted({b for _, batches in partial for b in batches})))}`, or pass --allow-default to build them with the "
                "documented defaults at those sizes"
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
                "on that GPU, or pass --allow-default to build those batch sizes with the documented defaults"
            )
        notes += [f"{line}: the documented defaults there (--allow-default)" for line in lines]
    configs[KernelKind.REPLAY_DECODE], regrouped = _group_flushes(configs[KernelKind.REPLAY_DECODE], shape, flush_groups)
    defaulted = sorted(kind.value for kind, text in sources.items() if text.startswith("documented defaults"))
    source = label + (f"; defaults for {', '.join(defaulted)}" if defaulted else "") + ("; flushes spread (no align_flushes)" if spread_flushes else "")
    source += f"; aligned flushes in {flush_groups} groups" if regrouped and flush_groups > 1 else ""
    kinds = tuple(KindSource(kind=kind, text=sources[kind]) for kind in KernelKind)
    return Resolved(configs=configs, source=source, kinds=kinds, notes=tuple(notes))


def _gpus_with_records(tune_dir: Path, spec: Spec, shape: TargetShape) -> str:
    """'; records of it exist for h100, h200' (or that none has any), for the error of a GPU that has none."""
    gpus = [gpu for gpu in gpus_with_records(tune_dir) if record_path(tune_dir, gpu, spec, shape).is_file()]
    return f"; records of it exist for {', '.join(gpus)}" if gpus else f"; no GPU in {tune_dir} has records of it"


def skipped_lines(skipped: Counter) -> list[str]:
    """One line per reason for the trials left out ((reason, detail) -> trials): the count, and the detail, or how
    many distinct ones there are and the first."""
    lines = []
    for reason in sorted({reason for reason, _ in skipped}, key=lambda r: r.name):
        details = sorted(detail for r, detail in skipped if r is reason)
        count = sum(n for (r, _), n in skipped.items() if r is reason)
        detail = details[0] if len(details) == 1 else f"{len(details)} distinct, e.g. {details[0]}"
        lines.append(f"{count} trial(s) not applied: {reason.value} ({detail})")
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
    """Every current OK trial of `kind` checked; per batch size the fastest eligible one whose code renders the same
    now. An aligned trial of another group count than the build's `flush_groups` stands for its regrouped config
    (what the build ships) only where no applicable trial timed that config itself."""
    pick = _KindPick()
    mine = [t for t in records.trials if t.key.kind is kind]
    current = latest_trials(mine)
    pick.superseded = len(mine) - len(current)
    eligible: dict[int, list[tuple[TrialRecord, list[tuple[Mismatch, str]]]]] = {}
    for trial in current:
        if trial.status is not TrialStatus.OK or trial.timing is None:
            continue
        if spread_flushes and trial.config.align_flushes:
            pick.aligned_left_out += 1
            continue
        found = environment_mismatches(trial, target)
        if any(not reason.soft for reason, _ in found) or (found and not accept_env_mismatch):
            pick.skipped.update(found)
        else:
            eligible.setdefault(trial.batch, []).append((trial, found))
    now: dict[KernelConfig, KernelKey | str] = {}

    def key_now(config: KernelConfig) -> KernelKey | str:
        """The key `config` renders to now, or why it no longer renders."""
        if config not in now:
            try:
                now[config] = render_candidate(target.spec, target.shape, kind, config).key
            except UnsupportedShapeError as exc:
                now[config] = str(exc)
        return now[config]

    def applies(trial: TrialRecord) -> bool:
        key = key_now(trial.config)
        return isinstance(key, KernelKey) and key.code == trial.key.code

    for batch, entries in sorted(eligible.items()):
        for trial, found in sorted(entries, key=lambda entry: speed_rank(entry[0])):
            if not applies(trial):
                key = key_now(trial.config)
                if isinstance(key, str):
                    pick.skipped[(Mismatch.INVALID, key)] += 1
                else:
                    pick.skipped[(Mismatch.CODE, changed_definitions(trial.key, key))] += 1
                continue
            shipped = _regrouped(trial.config, target.shape, flush_groups)
            if shipped != trial.config and any(other.config == shipped and applies(other) for other, _ in entries):
                continue
            pick.accepted.update(found)
            pick.winners[batch] = trial
            break
    pick.tuned = {t.batch for t in mine if t.status is TrialStatus.OK and t.timing is not None}
    pick.uncovered = pick.tuned - set(pick.winners)
    return pick


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
