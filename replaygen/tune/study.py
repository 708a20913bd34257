"""The search driver: per shape, batch size and kernel, find the fastest config that is correct.

Optuna mode (the default) runs TPE over the space's free parameters (powers of two as log2
integers, flush_at and num_stages as integers, the route as a category) through ask-and-tell:

- storage: a journal file (`JournalStorage(JournalFileBackend(path))`, default
  `<out>/<gpu>/optuna.journal`) or any Optuna storage URL (`--storage sqlite:///tune.db`,
  PostgreSQL, ...), so several processes or hosts can work on one study;
- study name: `replaygen:<spec>:<shape>:<kind>:b<batch>:<gpu>:<hash>`, the hash over the search
  space, the templates, the spec, the environment and the activation dtype: a changed space or
  kernel starts a fresh study, an unchanged one resumes (the configs it tried count toward
  --trials);
- --trials counts distinct configs (resumed ones too): the documented default is enqueued
  first (replay decode then also flush_at=1 in the best recorded baseline's launch shape);
  pruned points are told PRUNED (never compiled); a repeated proposal is told the value it had;
  neither counts. A config whose trial is already in the records (same kernel key, environment,
  batch and dtype; OK, WRONG or CRASHED) is not measured again: its recorded value is told.

Exhaustive mode times every candidate of the space, in order, without Optuna.

Recorded mode searches nothing: it times again the fastest configs the records hold for each search, those of
earlier kernel code included, so a kernel change is re-validated by timing its winners instead of a search. Its
configs may come from another shape's records instead (`tune --recorded-from`): a new shape (a tensor-parallel
split, another buffer capacity) starts from a neighbour's winners at the same batch and at the batch of equal work,
timed at its own sizes. They may also come from another GPU's records (`tune --recorded-gpu`): a new GPU starts
from the winners of one tuned before, each timed on the new one.
"""

from __future__ import annotations

import enum
import logging
import math
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from replaygen.codegen import template_hash
from replaygen.configs import BATCH_BUCKETS, KernelConfig, KernelKind, replay_decode_structures, replay_verify_structures, spec_traits
from replaygen.errors import ReplaygenError
from replaygen.spec.model import Spec, TargetShape
from replaygen.traffic import state_bytes
from replaygen.tune.objective import Evaluator, TuneAborted
from replaygen.keys import render_candidate
from replaygen.tune.records import Environment, RecordStore, TrialRecord, TrialStatus, canonical_sha256, latest_trials, speed_rank
from replaygen.tune.space import Scale, SearchSpace, default_config, derive_space

log = logging.getLogger(__name__)

JOURNAL_NAME = "optuna.journal"
EXHAUSTIVE_STUDY = "exhaustive"
RECORDED_STUDY = "recorded"
MAX_IDLE_PROPOSALS = 200
# Recorded outcomes a later run takes as they are; other failures (compile errors, out of resources) are tried again.
REUSED_STATUSES = frozenset({TrialStatus.OK, TrialStatus.WRONG, TrialStatus.CRASHED})


class Mode(enum.Enum):
    OPTUNA = "optuna"
    EXHAUSTIVE = "exhaustive"
    RECORDED = "recorded"


@dataclass(frozen=True, kw_only=True)
class TuneSettings:
    trials: int = 30  # per search (shape, kernel, batch), Optuna mode
    mode: Mode = Mode.OPTUNA
    storage: str | None = None  # an Optuna storage URL; None: the journal file
    journal: Path | None = None  # the journal file when storage is None
    seed: int = 0
    activation_dtype: str = "bfloat16"
    retime: bool = False  # exhaustive and recorded modes: time every candidate again instead of reusing the records' trials
    recorded: int = 1  # recorded mode: the fastest recorded configs timed per search


@dataclass(frozen=True, kw_only=True)
class SearchTask:
    spec: Spec
    shape: TargetShape
    kind: KernelKind
    batch: int
    space: SearchSpace

    @property
    def label(self) -> str:
        return f"{self.shape.name} {self.kind.value} b={self.batch}"


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    task: SearchTask
    mode: Mode
    study: str
    best: TrialRecord | None  # None when nothing passed
    default: TrialRecord | None  # the documented default's trial, when it ran
    trials: int  # distinct configs with a value (Optuna: the study's, resumed ones too)
    measured: int  # candidates timed by this run (the rest reused recorded trials)
    pruned: int  # points pruned before compiling (Optuna: proposals; exhaustive: the space's)


def plan_tasks(spec: Spec, shapes: tuple[TargetShape, ...], kinds: tuple[KernelKind, ...], batches: tuple[int, ...], fixed: tuple[tuple[str, str], ...] = ()) -> list[SearchTask]:
    """One search per shape, batch size and kernel (batch-major, so one workload serves a batch's kernels).

    `fixed` (from --fix NAME=VALUE) restricts a parameter in every space where it is free.
    """
    tasks = []
    used = set()
    for shape in shapes:
        for batch in batches:
            for kind in kinds:
                space = derive_space(kind, shape, batch, spec_traits(spec, shape))
                for name, value in fixed:
                    if name in {p.name for p in space.free}:
                        space = space.fix(name, value)
                        used.add(name)
                tasks.append(SearchTask(spec=spec, shape=shape, kind=kind, batch=batch, space=space))
    unused = [f"{n}={v}" for n, v in fixed if n not in used]
    if unused:
        raise ReplaygenError(f"--fix {', '.join(unused)}: no kernel among {', '.join(k.value for k in kinds)} searches that parameter")
    return tasks


def make_storage(settings: TuneSettings) -> optuna.storages.BaseStorage:
    if settings.storage:
        return optuna.storages.get_storage(settings.storage)
    if settings.journal is None:
        raise ValueError("TuneSettings needs a storage URL or a journal path")
    settings.journal.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(settings.journal)))


def distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    """Optuna's view of the free parameters: log2 and linear ones as integer ranges, so TPE sees their order."""
    out: dict[str, BaseDistribution] = {}
    for p in space.free:
        if p.scale is Scale.LOG2:
            out[f"log2_{p.name}"] = IntDistribution(p.choices[0].bit_length() - 1, p.choices[-1].bit_length() - 1)
        elif p.scale is Scale.LINEAR:
            out[p.name] = IntDistribution(p.choices[0], p.choices[-1])
        else:
            out[p.name] = CategoricalDistribution(p.choices)
    return out


def decode_params(space: SearchSpace, params: dict[str, object]) -> KernelConfig:
    values = {}
    for p in space.free:
        values[p.name] = 1 << params[f"log2_{p.name}"] if p.scale is Scale.LOG2 else params[p.name]
    return space.config(values)


def encode_params(space: SearchSpace, config: KernelConfig) -> dict[str, object]:
    params = {}
    for name, value in space.values(config).items():
        scale = space.parameter(name).scale
        params[f"log2_{name}" if scale is Scale.LOG2 else name] = value.bit_length() - 1 if scale is Scale.LOG2 else value
    return params


class Progress:
    """Hears where a tune is; does nothing (`replaygen.tune.report.LineProgress` prints)."""

    def search_started(self, index: int, total: int, task: SearchTask) -> None: ...

    def trial(self, task: SearchTask, number: int, record: TrialRecord, reused: bool, best: TrialRecord | None) -> None: ...

    def search_done(self, result: SearchResult) -> None: ...


class Tuner:
    """Runs searches for one spec and shape, writing every trial to the record store as it ends."""

    def __init__(
        self,
        *,
        shape: TargetShape,
        evaluator: Evaluator | None,
        store: RecordStore,
        environment: Environment,
        settings: TuneSettings,
        progress: Progress,
        storage: optuna.storages.BaseStorage | None = None,
        source: RecordStore | None = None,
    ):
        """`evaluator`: None for a Tuner that only says what its searches will time (`pending`). `storage`: the Optuna
        storage (see make_storage; None: in memory); unused in exhaustive mode. `source`: the records recorded mode
        takes its configs from (None: this shape's own, `store`): another shape's on this GPU, or any shape's on
        another GPU (`tune --recorded-gpu`)."""
        self.shape = shape
        self.source = source
        self.evaluator = evaluator
        self.store = store
        self.environment = environment
        self.settings = settings
        self.progress = progress
        self.storage = storage
        # One module serves every kernel kind (a candidate renders the others with their defaults), so a trial is
        # known by its kind too: with default configs, two kinds' candidates render the same source.
        # With retime only the crashed trials are reused: a config that made the GPU unusable is not run again.
        reused = {TrialStatus.CRASHED} if settings.retime else REUSED_STATUSES
        self._known = {
            (t.key.kind, t.key.code, t.batch): t
            for t in self._comparable_trials()
            if t.status in reused
        }

    def _comparable_trials(self, store: RecordStore | None = None) -> list[TrialRecord]:
        """The latest trials (records.latest_trials) of `store` (default: this shape's records) with this activation dtype,
        made in this environment; for another GPU's records, made there with this Triton and replaygen version (the same
        kernel code, on that GPU's device)."""
        store = store or self.store
        here = self.environment
        gpu = store.header["gpu"]

        def comparable(made: Environment) -> bool:
            if gpu == here.gpu:
                return made == here
            return made.gpu == gpu and (made.triton, made.replaygen) == (here.triton, here.replaygen)

        return [t for t in latest_trials(store.trials) if comparable(t.environment) and t.activation_dtype == self.settings.activation_dtype]

    def study_name(self, task: SearchTask) -> str:
        digest = canonical_sha256({
            "space": task.space.key(),
            "template_sha256": template_hash(),
            "spec_sha256": task.spec.source_sha256,
            "environment": self.environment.fingerprint(),
            "activation_dtype": self.settings.activation_dtype,
        })
        return f"replaygen:{task.spec.name}:{task.shape.name}:{task.kind.value}:b{task.batch}:{self.environment.gpu}:{digest[:16]}"

    def search(self, task: SearchTask, deadline: float | None = None) -> SearchResult:
        if self.settings.mode is Mode.OPTUNA:
            return self._optuna(task, deadline)
        study = EXHAUSTIVE_STUDY if self.settings.mode is Mode.EXHAUSTIVE else RECORDED_STUDY
        return self._exhaustive(task, deadline, self._candidates(task), study)

    def pending(self, task: SearchTask) -> tuple[KernelConfig, ...]:
        """The configs an exhaustive or recorded search of `task` will time, in order: its candidates whose trials
        the records do not hold (Optuna proposes one config at a time: none are known ahead)."""
        if self.settings.mode is Mode.OPTUNA:
            return ()
        return tuple(
            config for config in self._candidates(task)
            if (task.kind, render_candidate(task.spec, task.shape, task.kind, config).key.code, task.batch) not in self._known
        )

    def _candidates(self, task: SearchTask) -> tuple[KernelConfig, ...]:
        return task.space.candidates() if self.settings.mode is Mode.EXHAUSTIVE else self._recorded(task)

    def _recorded(self, task: SearchTask) -> tuple[KernelConfig, ...]:
        """The `settings.recorded` fastest distinct configs of the task's kernel among the passing trials (of any kernel
        code) of the source records (this shape's own by default) at each of the source batches (_source_batches),
        fitted to the space (SearchSpace.fit); those it prunes or does not hold (e.g. a block_v beyond this shape's
        value_dim) are left out. Each config is ranked by its last trial in record order, its most recent measurement:
        a config timed fast on code that has changed since and slower after must not push out one that is the faster
        now. Configs are ranked per source batch (times at two batches do not compare), those of the task's own batch
        first."""
        last: dict[int, dict[KernelConfig, TrialRecord]] = {batch: {} for batch in self._source_batches(task)}
        for trial in self._comparable_trials(self.source):
            if trial.key.kind is task.kind and trial.batch in last and math.isfinite(trial.value):
                last[trial.batch][task.space.fit(trial.config)] = trial
        chosen: dict[KernelConfig, None] = {}
        for trials in last.values():
            kept = [(config, trial) for config, trial in trials.items() if task.space.contains(config) and task.space.prune_reason(config) is None]
            chosen.update((config, None) for config, _ in sorted(kept, key=lambda item: speed_rank(item[1]))[: self.settings.recorded])
        if not chosen:
            source = f" of {self.source.header['shape']} on {self.source.header['gpu']}" if self.source else ""
            log.warning("%s: the records%s hold no passing trial to time again", task.label, source)
        return tuple(chosen)

    def _source_batches(self, task: SearchTask) -> tuple[int, ...]:
        """The batches whose trials recorded mode takes: the task's own, and from another shape's records also the batch
        of equal work, where it is a whole number: the one whose rows hold as many state bytes as the task's batch
        (a TP8 split's batch 256 takes the unsplit shape's batch 32 too, whose launch grid is the same size)."""
        if self.source is None:
            return (task.batch,)
        source_shape = task.spec.shape(self.source.header["shape"])
        equal, rest = divmod(task.batch * state_bytes(task.spec, task.shape), state_bytes(task.spec, source_shape))
        return (task.batch,) if rest or equal in (0, task.batch) else (task.batch, equal)

    def _measure(self, task: SearchTask, config: KernelConfig, study: str) -> tuple[TrialRecord, bool]:
        """The trial of `config` at the task's batch: from the records if known, else timed and saved."""
        candidate = render_candidate(task.spec, task.shape, task.kind, config)
        known = self._known.get((task.kind, candidate.key.code, task.batch))
        if known is not None:
            return known, True
        outcome = self.evaluator.evaluate(candidate, task.batch)
        record = TrialRecord(
            id=uuid.uuid4().hex,
            study=study,
            batch=task.batch,
            config=config,
            key=candidate.key,
            environment=self.environment,
            activation_dtype=self.settings.activation_dtype,
            status=outcome.status,
            timing=outcome.timing,
            error=outcome.error,
        )
        self.store.add(record)
        self._known[(task.kind, candidate.key.code, task.batch)] = record
        if outcome.device_lost:
            raise TuneAborted(
                f"{task.label}: the GPU is unusable after {config.as_dict()} ({outcome.error}); it is recorded as crashed in {self.store.path} "
                "and will not be tried again: run tune again (new process) to resume"
            )
        return record, False

    def _seeds(self, task: SearchTask) -> tuple[KernelConfig, ...]:
        """Where a search starts after its own bucket's default. Replay decode: each kernel structure
        (configs.replay_decode_structures), then the baseline's step on the checkpoint (flush_at=1) in the launch shape
        of the best baseline decode recorded at this batch, or of the baseline's documented default where none is (a
        search of replay decode alone, from no records): a bucket where buffering does not pay keeps close to the
        baseline. Every kind: then the other buckets' documented defaults (a structure that wins at one batch size is
        tried at every other). Replay verify: its key-tiled structures (configs.replay_verify_structures) first.
        The search sets what --fix restricts in each (`SearchSpace.fit`), as --recorded does, and skips those then pruned.
        The flush_at=1 seeds fold one entry per loop step (fold_chunk=1): that loop runs only for entries a larger
        threshold left, and unrolled chunks would cost registers, so programs per multiprocessor, on every step.
        Two of them: the baseline's state eviction policy, then the other (evict-first saved the replay its cursor's
        round trip at batch 1-8 where the baseline did not need it)."""
        traits = spec_traits(task.spec, task.shape)
        defaults = tuple(default_config(task.kind, task.shape, batch, traits) for batch in BATCH_BUCKETS)
        if task.kind is KernelKind.REPLAY_VERIFY:
            return tuple(dict.fromkeys((*replay_verify_structures(task.shape, traits), *defaults)))
        if task.kind is not KernelKind.REPLAY_DECODE:
            return tuple(dict.fromkeys(defaults))
        structures = tuple(replace(config, flush_at=config.flush_at or task.shape.capacity) for config in replay_decode_structures(task.shape, traits))
        baselines = [
            t for t in self._comparable_trials()
            if t.key.kind is KernelKind.BASELINE_DECODE and t.batch == task.batch and t.status is TrialStatus.OK
        ]
        best = min(baselines, key=lambda t: t.value).config if baselines else default_config(KernelKind.BASELINE_DECODE, task.shape, task.batch, traits)
        step = KernelConfig(block_v=best.block_v, num_warps=best.num_warps, flush_at=1, fold_chunk=1)
        steps = tuple(replace(step, evict_state=evict) for evict in (best.evict_state, not best.evict_state))
        return tuple(dict.fromkeys((*structures, *steps, *defaults)))

    def _exhaustive(self, task: SearchTask, deadline: float | None, candidates: tuple[KernelConfig, ...], study: str) -> SearchResult:
        """Time `candidates` in order (every candidate of the space, or the recorded ones)."""
        results: dict[KernelConfig, TrialRecord] = {}
        measured = 0
        for config in candidates:
            if deadline is not None and results and time.monotonic() > deadline:
                log.warning("%s: time is up after %d of %d candidates", task.label, len(results), len(candidates))
                break
            record, reused = self._measure(task, config, study)
            results[config] = record
            measured += not reused
            self.progress.trial(task, len(results), record, reused, _best(results))
        pruned = task.space.size - len(candidates) if study == EXHAUSTIVE_STUDY else 0  # every point is a candidate or pruned
        return self._result(task, self.settings.mode, study, results, len(results), measured, pruned)

    def _optuna(self, task: SearchTask, deadline: float | None) -> SearchResult:
        space = task.space
        name = self.study_name(task)
        study = optuna.create_study(study_name=name, storage=self.storage, direction="minimize", load_if_exists=True)
        study.sampler = _sampler(self.settings, len(study.trials))
        dists = distributions(space)
        for seed in dict.fromkeys((space.default, *map(space.fit, self._seeds(task)))):
            if space.contains(seed) and (seed == space.default or space.prune_reason(seed) is None):
                _enqueue_unless_done(study, encode_params(space, seed))
        values: dict[KernelConfig, float] = {}  # every config the study has a value for
        results: dict[KernelConfig, TrialRecord] = {}  # those whose trial is in the records
        for previous in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            config = decode_params(space, previous.params)
            if space.prune_reason(config) is not None:  # a rule or validate_config changed since
                continue
            values[config] = previous.value
            known = self._known.get((task.kind, render_candidate(task.spec, task.shape, task.kind, config).key.code, task.batch))
            if known is not None:
                results[config] = known
        target = space.count_candidates(self.settings.trials)
        measured = pruned = idle = 0
        while len(values) < target:
            if deadline is not None and values and time.monotonic() > deadline:
                log.warning("%s: time is up after %d trials", task.label, len(values))
                break
            if idle >= MAX_IDLE_PROPOSALS:
                log.warning("%s: the sampler proposed %d pruned or repeated points in a row; stopping", task.label, idle)
                break
            trial = study.ask(dists)
            config = decode_params(space, trial.params)
            if space.prune_reason(config) is not None:
                study.tell(trial, state=TrialState.PRUNED)
                pruned += 1
                idle += 1
                continue
            if config in values:
                study.tell(trial, values[config])
                idle += 1
                continue
            idle = 0
            record, reused = self._measure(task, config, name)
            study.tell(trial, record.value)
            values[config] = record.value
            results[config] = record
            measured += not reused
            self.progress.trial(task, len(values), record, reused, _best(results))
        return self._result(task, Mode.OPTUNA, name, results, len(values), measured, pruned)

    def _result(self, task: SearchTask, mode: Mode, study: str, results: dict[KernelConfig, TrialRecord], trials: int, measured: int, pruned: int) -> SearchResult:
        result = SearchResult(
            task=task,
            mode=mode,
            study=study,
            best=_best(results),
            default=results.get(task.space.default),
            trials=trials,
            measured=measured,
            pruned=pruned,
        )
        self.progress.search_done(result)
        return result


def _enqueue_unless_done(study: optuna.Study, params: dict[str, object]) -> None:
    """Enqueue `params` unless a complete or waiting trial has them (a trial left RUNNING by a killed run does not count)."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.WAITING)):
        if trial.system_attrs.get("fixed_params", trial.params) == params:
            return
    study.enqueue_trial(params)


def _sampler(settings: TuneSettings, previous_trials: int) -> optuna.samplers.BaseSampler:
    """TPE, multivariate (block_v, warps and stages interact); reseeded on resume so it does not replay its first proposals."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=settings.seed + previous_trials,
            n_startup_trials=min(10, max(3, settings.trials // 3)),
            multivariate=True,
        )


def _best(results: dict[KernelConfig, TrialRecord]) -> TrialRecord | None:
    passing = [r for r in results.values() if math.isfinite(r.value)]
    return min(passing, key=speed_rank) if passing else None


def tune(
    tasks: list[SearchTask],
    *,
    evaluator_for: Callable[[TargetShape], Evaluator],
    store_for: Callable[[TargetShape], RecordStore],
    environment: Environment,
    settings: TuneSettings,
    progress: Progress,
    timeout_s: float | None = None,
    warm: Callable[[list[tuple[SearchTask, tuple[KernelConfig, ...]]]], None] | None = None,
    source_for: Callable[[TargetShape], RecordStore] | None = None,
) -> list[SearchResult]:
    """Run every task; with `timeout_s`, each search gets an equal share of the time left. `warm` is told, before the
    first search of an exhaustive or recorded run, every search's configs to time in the order they will be timed
    (tune.warm.CacheWarmer compiles them ahead on the CPUs while the GPU times the searches before). `source_for(shape)`:
    the Tuner's `source` for that shape (None: each shape's own records)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = make_storage(settings) if settings.mode is Mode.OPTUNA else None
    end = None if timeout_s is None else time.monotonic() + timeout_s

    def tuner_for(shape: TargetShape, evaluator: Evaluator | None) -> Tuner:
        return Tuner(
            shape=shape,
            evaluator=evaluator,
            store=store_for(shape),
            environment=environment,
            settings=settings,
            progress=progress,
            storage=storage,
            source=source_for(shape) if source_for else None,
        )

    if warm is not None and settings.mode is not Mode.OPTUNA:
        planners: dict[str, Tuner] = {}
        searches = []
        for task in tasks:
            planner = planners.get(task.shape.name) or planners.setdefault(task.shape.name, tuner_for(task.shape, None))
            searches.append((task, planner.pending(task)))
        if any(configs for _, configs in searches):
            warm(searches)
    tuner: Tuner | None = None
    results = []
    for index, task in enumerate(tasks):
        if tuner is None or tuner.shape != task.shape:
            tuner = None  # its evaluator's workloads go before the next shape's are allocated
            tuner = tuner_for(task.shape, evaluator_for(task.shape))
        deadline = None if end is None else time.monotonic() + (end - time.monotonic()) / (len(tasks) - index)
        progress.search_started(index, len(tasks), task)
        results.append(tuner.search(task, deadline))
    return results
