"""Tuning records: what a kernel is (its key), where it ran (its environment), how fast (its trials).

One JSON file per spec and shape and GPU: `tune/<gpu>/<spec>_<shape>.json`, holding every
measured trial (winners and losers, failures as such) with raw timings. Each trial carries

- its kernel key: the sha256 of the code the trial ran (`TIMED_ENTRY_POINTS`: the part of the
  rendered candidate module that the timed functions reach, without comments, docstrings and argument
  checks; `codegen.reachable_source`), so edits to other kernels, comments, docstrings or the checks of
  bad input leave the record applicable, plus the template, spec and shape hashes it was rendered from
  (provenance; a changed spec or shape also stops it matching);
- its environment: GPU name (the records folder, e.g. h100), device name and compute
  capability, the Triton version string (`triton.__version__`; not a hash of Triton's files)
  and the replaygen version.

Writes are atomic (temp file + rename, under a lock on the folder) and merge with what the
file holds, so an interrupted tune loses nothing written and another file is never touched.
A file that does not parse is reported by name and never overwritten.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from replaygen import __version__
from replaygen.codegen import reachable_source, render_module, source_hash, template_hash, write_if_changed
from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, module_defaults
from replaygen.errors import TuningRecordError
from replaygen.plan import plan_module
from replaygen.spec.model import Spec, TargetShape

# Format 3 keys a trial's code without the module's argument checks (codegen.ARGUMENT_CHECK_PREFIX). Formats 1 and 2
# hashed them with the rest, so their trials (KernelKey.checks_in_source) match no code now and are kept to be timed
# again (`tune --recorded`). Format 2 keys a trial by the spec's content (spec_content_sha256); format 1 by the spec
# file's bytes.
RECORD_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
# The module functions a trial of each kind runs (replaygen.measure's workloads: allocation, then the timed step);
# a trial's key hashes the code they reach.
TIMED_ENTRY_POINTS: dict[KernelKind, tuple[str, ...]] = {
    KernelKind.BASELINE_DECODE: ("allocate_baseline", "baseline_decode"),
    KernelKind.REPLAY_DECODE: ("allocate", "decode"),
    KernelKind.REPLAY_VERIFY: ("allocate", "verify", "commit"),
    KernelKind.BASELINE_VERIFY: ("allocate_snapshots", "baseline_verify", "baseline_commit"),
    KernelKind.MATERIALIZE: ("allocate", "materialize"),
    KernelKind.LOAD: ("allocate", "load"),
    KernelKind.COMMIT: ("allocate", "commit"),
}
# Candidates are rendered for no particular GPU, so the GPU name stays out of the kernel key.
CANDIDATE_GPU = "any"
CANDIDATE_SOURCE = "tune candidate"


class TrialStatus(enum.Enum):
    OK = "ok"
    WRONG = "wrong"  # ran, but disagrees with the reference
    FAILED = "failed"  # raised (compile error, launch error)
    OUT_OF_RESOURCES = "out_of_resources"  # shared memory, registers or GPU memory
    CRASHED = "crashed"  # raised and left the device unusable (e.g. an illegal memory access)


def canonical_sha256(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=_enum_value).encode()).hexdigest()


def _enum_value(value: object) -> object:
    """The JSON form of a hashed value that is not a plain type."""
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{value!r} has no canonical form")


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where trials ran."""

    gpu: str  # the records folder name, e.g. "h100"
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: str  # e.g. "9.0"
    triton: str  # triton.__version__
    replaygen: str  # replaygen.__version__

    def fingerprint(self) -> str:
        return canonical_sha256(asdict(self))


def current_environment(gpu: str, device: object) -> Environment:
    """The environment of CUDA device `device`, recorded under the GPU name `gpu`."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(device)
    return Environment(gpu=gpu, device_name=props.name, compute_capability=f"{props.major}.{props.minor}", triton=triton.__version__, replaygen=__version__)


@dataclass(frozen=True, kw_only=True)
class KernelKey:
    """What was timed: one kernel kind in one rendered module."""

    kind: KernelKind
    source_sha256: str  # the code the trial ran: reachable_source of the candidate module from TIMED_ENTRY_POINTS[kind]
    template_sha256: str
    spec_content_sha256: str  # spec_content_sha256(spec): a shape added to the spec or an edited comment leaves it as it was
    shape_sha256: str
    spec_file_sha256: str = ""  # records of format 1 name the spec file's bytes instead (spec_content_sha256 empty)
    checks_in_source: bool = False  # keyed before format 3: source_sha256 also covers the argument checks


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One config of one kernel kind, rendered: the module a trial imports, checks and times."""

    key: KernelKey
    config: KernelConfig
    source: str

    @property
    def kind(self) -> KernelKind:
        return self.key.kind


def shape_sha256(shape: TargetShape) -> str:
    return canonical_sha256(asdict(shape))


def spec_content_sha256(spec: Spec) -> str:
    """What the spec says about the recurrence, its buffer and its dtypes: every field but the description, the
    target shapes and the file it was read from. Adding a shape or editing a comment or the description leaves it as
    it was, so tuning records (keyed by it, by the shape's own sizes and by the code a trial ran) stay applicable."""
    content = asdict(spec)
    for name in ("description", "shapes", "source_file", "source_sha256"):
        del content[name]
    return canonical_sha256(content)


def candidate_tables(spec: Spec, shape: TargetShape, kind: KernelKind, config: KernelConfig) -> dict[KernelKind, tuple[BucketConfig, ...]]:
    """The dispatch tables of a candidate: `config` for `kind` (every bucket), the defaults for every other kernel."""
    configs = module_defaults(spec, shape)
    configs[kind] = (BucketConfig(None, config),)
    return configs


def render_candidate(spec: Spec, shape: TargetShape, kind: KernelKind, config: KernelConfig) -> Candidate:
    """The module that runs `config` for `kind` (every bucket) and the defaults for every other kernel."""
    configs = candidate_tables(spec, shape, kind, config)
    source = render_module(plan_module(spec, shape, CANDIDATE_GPU, configs, CANDIDATE_SOURCE))
    key = KernelKey(
        kind=kind,
        source_sha256=source_hash(reachable_source(source, TIMED_ENTRY_POINTS[kind])),
        template_sha256=template_hash(),
        spec_content_sha256=spec_content_sha256(spec),
        shape_sha256=shape_sha256(shape),
    )
    return Candidate(key=key, config=config, source=source)


@dataclass(frozen=True)
class TrialTiming:
    """Per-step time of one trial (see measure.Timing)."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int

    @classmethod
    def of(cls, timing: object) -> TrialTiming:
        """From a measure.Timing (or anything with its fields)."""
        return cls(float(timing.median_ms), float(timing.p20_ms), float(timing.p80_ms), int(timing.samples))

    @classmethod
    def from_dict(cls, raw: dict) -> TrialTiming:
        """As a record file holds it: times finite and positive (ms), at least one sample."""
        if not isinstance(raw, dict) or set(raw) != {"median_ms", "p20_ms", "p80_ms", "samples"}:
            raise TypeError(f"expected a timing with median_ms, p20_ms, p80_ms and samples, got {raw!r}")
        times = [_number(raw[name]) for name in ("median_ms", "p20_ms", "p80_ms")]
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"times must be finite and positive, got {times}")
        samples = _int(raw["samples"])
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")
        return cls(*times, samples)


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One measured config at one batch size."""

    id: str  # unique (uuid4 hex); merging files keeps one trial per id
    study: str  # the Optuna study name, or "exhaustive"
    batch: int
    config: KernelConfig
    key: KernelKey
    environment: Environment
    activation_dtype: str  # e.g. "bfloat16"
    status: TrialStatus
    timing: TrialTiming | None  # None unless status is OK
    error: str = ""  # why it is not OK

    @property
    def value(self) -> float:
        """The objective: median ms per step, inf unless OK (so it never wins)."""
        return self.timing.median_ms if self.status is TrialStatus.OK and self.timing else math.inf

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "study": self.study,
            "batch": self.batch,
            "config": self.config.as_dict(),
            "key": self._key_dict(),
            "environment": asdict(self.environment),
            "activation_dtype": self.activation_dtype,
            "status": self.status.value,
            "timing": asdict(self.timing) if self.timing else None,
            "error": self.error,
        }

    def _key_dict(self) -> dict[str, object]:
        key = {**asdict(self.key), "kind": self.key.kind.value}
        if not key["checks_in_source"]:
            del key["checks_in_source"]
        legacy = key.pop("spec_file_sha256")
        if legacy:
            del key["spec_content_sha256"]
            key["spec_sha256"] = legacy
        return key

    @classmethod
    def from_dict(cls, raw: dict, record_format: int = RECORD_FORMAT) -> TrialRecord:
        """A trial as `as_dict` wrote it into a record file of `record_format`."""
        key = dict(raw["key"])
        timing = raw["timing"]
        status = TrialStatus(raw["status"])
        if status is TrialStatus.OK and timing is None:
            raise ValueError("a trial that ran (status ok) has no timing")
        return cls(
            id=_text(raw["id"]),
            study=_text(raw["study"]),
            batch=_int(raw["batch"]),
            config=config_from_dict(raw["config"]),
            key=KernelKey(
                kind=KernelKind(key["kind"]),
                source_sha256=_text(key["source_sha256"]),
                template_sha256=_text(key["template_sha256"]),
                spec_content_sha256=_text(key["spec_content_sha256"]) if "spec_content_sha256" in key else "",
                spec_file_sha256="" if "spec_content_sha256" in key else _text(key["spec_sha256"]),
                shape_sha256=_text(key["shape_sha256"]),
                checks_in_source=record_format < 3 or _bool(key.get("checks_in_source", False)),
            ),
            environment=Environment(**{k: _text(v) for k, v in dict(raw["environment"]).items()}),
            activation_dtype=_text(raw["activation_dtype"]),
            status=status,
            timing=None if timing is None else TrialTiming.from_dict(timing),
            error=_text(raw["error"]),
        )


def config_from_dict(raw: dict) -> KernelConfig:
    """A config as `KernelConfig.as_dict` wrote it; fields added since a record was written take their defaults
    (where the kernel's code changed with them, the record's kernel key no longer matches, so it is never applied)."""
    default = KernelConfig(block_v=raw["block_v"])
    return KernelConfig(
        block_v=_int(raw["block_v"]),
        num_warps=_int(raw["num_warps"]),
        num_stages=_int(raw["num_stages"]),
        route=Route(raw["route"]),
        flush_at=_int(raw["flush_at"]),
        prefetch_ring=_bool(raw.get("prefetch_ring", default.prefetch_ring)),
        fold_chunk=_int(raw.get("fold_chunk", default.fold_chunk)),
        fold_dot=_bool(raw.get("fold_dot", default.fold_dot)),
        precompute_scores=_bool(raw.get("precompute_scores", default.precompute_scores)),
        fused_flush=_bool(raw.get("fused_flush", default.fused_flush)),
        readout_dot=_bool(raw.get("readout_dot", default.readout_dot)),
        max_registers=_int(raw.get("max_registers", default.max_registers)),
        evict_state=_bool(raw.get("evict_state", default.evict_state)),
        overlap_scores=_bool(raw.get("overlap_scores", default.overlap_scores)),
        align_flushes=_bool(raw.get("align_flushes", default.align_flushes)),
        flush_groups=_int(raw.get("flush_groups", default.flush_groups)),
        window_block_v=_int(raw.get("window_block_v", default.window_block_v)),
        window_warps=_int(raw.get("window_warps", default.window_warps)),
        early_launch=_bool(raw.get("early_launch", default.early_launch)),
        prefetch_fold_keys=_bool(raw.get("prefetch_fold_keys", default.prefetch_fold_keys)),
        early_commit=_bool(raw.get("early_commit", default.early_commit)),
    )


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _number(value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def latest_trials(trials: tuple[TrialRecord, ...] | list[TrialRecord]) -> list[TrialRecord]:
    """`trials` less those timed again later: per kernel kind, source, batch size, environment and activation dtype
    the last trial in record order counts (`tune --retime` measures known code again; its trial supersedes)."""
    last: dict[tuple[object, ...], TrialRecord] = {}
    for trial in trials:
        key = (trial.key.kind, trial.key.source_sha256, trial.batch, trial.environment, trial.activation_dtype)
        last.pop(key, None)
        last[key] = trial
    return list(last.values())


def speed_rank(trial: TrialRecord) -> tuple[float, list[tuple[str, object]]]:
    """Sort key of trials: faster first, ties in a fixed order (by config)."""
    return trial.value, sorted(trial.config.as_dict().items())


@dataclass(frozen=True, kw_only=True)
class RecordFile:
    """The trials of one spec and shape on one GPU."""

    spec: str
    shape: str
    gpu: str
    trials: tuple[TrialRecord, ...]

    def render(self) -> str:
        payload = {
            "format": RECORD_FORMAT,
            "spec": self.spec,
            "shape": self.shape,
            "gpu": self.gpu,
            "trials": [t.as_dict() for t in self.trials],
        }
        return json.dumps(payload, indent=1, sort_keys=True) + "\n"


def record_path(tune_dir: Path, gpu: str, spec: Spec, shape: TargetShape) -> Path:
    return Path(tune_dir) / gpu / f"{spec.name}_{shape.ident}.json"


def read_records(path: Path) -> RecordFile:
    """Parse a record file; TuningRecordError naming it if it is truncated or malformed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TuningRecordError(f"{path}: cannot read tuning record: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TuningRecordError(f"{path}: not a tuning record (not UTF-8 text at byte {exc.start}); restore it from git or delete it") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TuningRecordError(f"{path}: corrupt or truncated tuning record (line {exc.lineno}, column {exc.colno}: {exc.msg}); restore it from git or delete it") from None
    if not isinstance(raw, dict) or raw.get("format") not in READABLE_FORMATS:
        formats = ", ".join(map(str, READABLE_FORMATS[:-1]))
        raise TuningRecordError(f"{path}: not a tuning record of format {formats} or {READABLE_FORMATS[-1]}")
    if not isinstance(raw.get("trials"), list):
        raise TuningRecordError(f"{path}: malformed tuning record (its 'trials' must be a list, got {raw.get('trials')!r})")
    trials = []
    for index, trial in enumerate(raw["trials"]):
        try:
            trials.append(TrialRecord.from_dict(trial, raw["format"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TuningRecordError(f"{path}: trial {index} is malformed ({type(exc).__name__}: {exc})") from None
    try:
        return RecordFile(spec=_text(raw["spec"]), shape=_text(raw["shape"]), gpu=_text(raw["gpu"]), trials=tuple(trials))
    except (KeyError, TypeError) as exc:
        raise TuningRecordError(f"{path}: malformed header ({type(exc).__name__}: {exc})") from None


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` (flock on its descriptor): writers to its record files take turns."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def append_trials(path: Path, *, spec: str, shape: str, gpu: str, trials: Iterable[TrialRecord]) -> RecordFile:
    """Add `trials` to the record file at `path` (created if missing), atomically; returns the merged file."""
    path = Path(path)
    with _locked(path.parent):
        current = read_records(path) if path.exists() else RecordFile(spec=spec, shape=shape, gpu=gpu, trials=())
        if (current.spec, current.shape, current.gpu) != (spec, shape, gpu):
            raise TuningRecordError(f"{path}: holds {current.spec}/{current.shape} on {current.gpu}, not {spec}/{shape} on {gpu}")
        known = {t.id for t in current.trials}
        merged = RecordFile(spec=spec, shape=shape, gpu=gpu, trials=current.trials + tuple(t for t in trials if t.id not in known))
        write_if_changed(path, merged.render())
    return merged


class RecordStore:
    """The record file of one spec and shape on one GPU, as a tune writes it: every trial saved as it ends."""

    def __init__(self, path: Path, *, spec: str, shape: str, gpu: str):
        self.path = Path(path)
        self.header = {"spec": spec, "shape": shape, "gpu": gpu}
        self.file = read_records(self.path) if self.path.exists() else RecordFile(**self.header, trials=())

    @property
    def trials(self) -> tuple[TrialRecord, ...]:
        return self.file.trials

    def add(self, trial: TrialRecord) -> None:
        self.file = append_trials(self.path, **self.header, trials=[trial])
