"""Tuning records: every measured trial of one spec and shape on one GPU, stored; nothing here renders code.

One JSON file per spec, shape and GPU: `tune/<gpu>/<spec>_<shape>.json` (format 4). Its header names the spec,
shape and GPU, the environments the trials ran in (device name, compute capability, Triton and replaygen versions),
the config knobs in column order, the digests of the module definitions the trials' code covers, and for each
kernel key which of them it covers (`replaygen.keys`); each trial is then one compact row: id, study, kernel kind, batch size, activation dtype,
environment (its index), kernel key, config values, status, timings, error.

Writes are atomic (temp file + rename, under a lock on the folder) and merge with what the file holds, so an
interrupted tune loses nothing written and another file is never touched. A file that does not parse is reported
by name and never overwritten.
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
from replaygen.files import write_if_changed
from replaygen.configs import KNOB_KINDS, KernelConfig, KernelKind
from replaygen.errors import TuningRecordError
from replaygen.keys import KernelKey
from replaygen.spec.model import Spec, TargetShape

RECORD_FORMAT = 4
COLUMNS = ("id", "study", "kind", "batch", "dtype", "environment", "key", "config", "status", "median_ms", "p20_ms", "p80_ms", "samples", "error")


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

    gpu: str  # the records folder name, e.g. "h200"
    device_name: str  # e.g. "NVIDIA H200"
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


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One measured config at one batch size."""

    id: str  # unique (uuid4 hex); merging files keeps one trial per id
    study: str  # the Optuna study name, "exhaustive" or "recorded"
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


def latest_trials(trials: tuple[TrialRecord, ...] | list[TrialRecord]) -> list[TrialRecord]:
    """`trials` less those a later trial supersedes: per kernel kind, config, batch size, environment and activation
    dtype, the last trial in record order counts (`tune --retime`, or `tune --recorded` after a kernel change,
    measures a config again), whatever code the earlier ones ran."""
    last: dict[tuple[object, ...], TrialRecord] = {}
    for trial in trials:
        key = (trial.key.kind, trial.config, trial.batch, trial.environment, trial.activation_dtype)
        last.pop(key, None)
        last[key] = trial
    return list(last.values())


def speed_rank(trial: TrialRecord) -> tuple[float, list[tuple[str, object]]]:
    """Sort key of trials: faster first, ties in a fixed order (by config)."""
    return trial.value, sorted(trial.config.fields().items())


@dataclass(frozen=True, kw_only=True)
class RecordFile:
    """The trials of one spec and shape on one GPU."""

    spec: str
    shape: str
    gpu: str
    trials: tuple[TrialRecord, ...]

    def render(self) -> str:
        """The file's text: the header fields, then one line per definition digest, kernel key and trial."""
        environments = list(dict.fromkeys(t.environment for t in self.trials))
        definitions = sorted({part for t in self.trials for part in t.key.parts})
        index = {part: i for i, part in enumerate(definitions)}
        codes = {t.key.code: [index[part] for part in t.key.parts] for t in self.trials}
        knobs = list(KNOB_KINDS)
        fields = {
            "format": RECORD_FORMAT,
            "spec": self.spec,
            "shape": self.shape,
            "gpu": self.gpu,
            "environments": [asdict(e) for e in environments],
            "knobs": knobs,
            "columns": list(COLUMNS),
        }
        lines = [f" {json.dumps(name)}: {json.dumps(value)}," for name, value in fields.items()]
        lines += _block("definitions", [json.dumps(list(part)) for part in definitions], "[]")
        lines += _block("codes", [f"{json.dumps(code)}: {json.dumps(parts)}" for code, parts in sorted(codes.items())], "{}")
        lines += _block("trials", [json.dumps(_row(t, environments.index(t.environment), knobs)) for t in self.trials], "[]", last=True)
        return "{\n" + "\n".join(lines) + "\n}\n"


def _block(name: str, items: list[str], brackets: str, last: bool = False) -> list[str]:
    """A JSON member holding `items` (already JSON) one per line."""
    end = brackets[1] + ("" if last else ",")
    if not items:
        return [f" {json.dumps(name)}: {brackets}{'' if last else ','}"]
    return [f" {json.dumps(name)}: {brackets[0]}", *(f"  {item}," for item in items[:-1]), f"  {items[-1]}", f" {end}"]


def _row(trial: TrialRecord, environment: int, knobs: list[str]) -> list[object]:
    fields = trial.config.fields()
    timing = trial.timing
    return [
        trial.id, trial.study, trial.key.kind.value, trial.batch, trial.activation_dtype, environment, trial.key.code,
        [fields[name] for name in knobs], trial.status.value,
        *((timing.median_ms, timing.p20_ms, timing.p80_ms, timing.samples) if timing else (None, None, None, None)),
        trial.error,
    ]


def record_path(tune_dir: Path, gpu: str, spec: Spec, shape: TargetShape) -> Path:
    return Path(tune_dir) / gpu / f"{spec.name}_{shape.ident}.json"


def read_records(path: Path) -> RecordFile:
    """Parse a record file; TuningRecordError naming it (and the trial) if it is truncated or malformed."""
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
    if not isinstance(raw, dict) or raw.get("format") != RECORD_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise TuningRecordError(
            f"{path}: not a tuning record of format {RECORD_FORMAT} (format {found!r}); records of earlier formats are in git history only: "
            "time their configs again with `replaygen tune --recorded` from a checkout that reads them, or delete the file"
        )
    try:
        return _parse(raw)
    except _Malformed as exc:
        raise TuningRecordError(f"{path}: malformed tuning record: {exc}") from None


class _Malformed(Exception):
    pass


def _parse(raw: dict) -> RecordFile:
    expected = {"format", "spec", "shape", "gpu", "environments", "knobs", "columns", "definitions", "codes", "trials"}
    if set(raw) != expected:
        raise _Malformed(f"its keys must be {', '.join(sorted(expected))}, got {', '.join(sorted(map(str, raw)))}")
    if raw["columns"] != list(COLUMNS):
        raise _Malformed(f"its columns must be {list(COLUMNS)}, got {raw['columns']!r}")
    knobs = _list(raw["knobs"], "knobs")
    unknown = [name for name in knobs if name not in KNOB_KINDS]
    if unknown:
        raise _Malformed(f"unknown knob(s) {', '.join(map(str, unknown))} (this replaygen knows {', '.join(KNOB_KINDS)})")
    environments = []
    for index, env in enumerate(_list(raw["environments"], "environments")):
        if not isinstance(env, dict) or set(env) != {"gpu", "device_name", "compute_capability", "triton", "replaygen"}:
            raise _Malformed(f"environment {index} must hold gpu, device_name, compute_capability, triton and replaygen, got {env!r}")
        environments.append(Environment(**{name: _text(value, f"environment {index} {name}") for name, value in env.items()}))
    definitions = _list(raw["definitions"], "definitions")
    if not all(isinstance(d, list) and len(d) == 2 and all(isinstance(x, str) for x in d) for d in definitions):
        raise _Malformed("'definitions' must be a list of [definition name, digest] pairs")
    raw_codes = raw["codes"]
    if not isinstance(raw_codes, dict):
        raise _Malformed(f"'codes' must be a mapping of kernel key -> indices into 'definitions', got {str(raw_codes)[:80]}")
    codes = {}
    for code, indices in raw_codes.items():
        if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(definitions) for i in indices):
            raise _Malformed(f"kernel key {code[:12]}: its definitions must be indices into 'definitions' (0..{len(definitions) - 1})")
        codes[code] = tuple(tuple(definitions[i]) for i in indices)
    trials = []
    for index, row in enumerate(_list(raw["trials"], "trials")):
        try:
            trials.append(_trial(row, knobs, environments, codes))
        except (_Malformed, TypeError, ValueError, KeyError, IndexError) as exc:
            raise _Malformed(f"trial {index} ({str(row)[:80]}): {exc}") from None
    return RecordFile(spec=_text(raw["spec"], "spec"), shape=_text(raw["shape"], "shape"), gpu=_text(raw["gpu"], "gpu"), trials=tuple(trials))


def _trial(row: object, knobs: list[str], environments: list[Environment], codes: dict) -> TrialRecord:
    if not isinstance(row, list) or len(row) != len(COLUMNS):
        raise _Malformed(f"a trial is a list of {len(COLUMNS)} values ({', '.join(COLUMNS)})")
    values = dict(zip(COLUMNS, row))
    config_values = _list(values["config"], "config")
    if len(config_values) != len(knobs):
        raise _Malformed(f"its config holds {len(config_values)} values for {len(knobs)} knobs")
    config = KernelConfig.from_fields(dict(zip(knobs, config_values)))
    _check_types(config)
    code = _text(values["key"], "key")
    if code not in codes:
        raise _Malformed(f"kernel key {code[:12]} is not listed under 'codes'")
    status = TrialStatus(values["status"])
    timing = None
    if values["median_ms"] is not None:
        times = [_number(values[name], name) for name in ("median_ms", "p20_ms", "p80_ms")]
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise _Malformed(f"times must be finite and positive, got {times}")
        samples = _integer(values["samples"], "samples")
        if samples < 1:
            raise _Malformed(f"samples must be at least 1, got {samples}")
        timing = TrialTiming(*times, samples)
    if status is TrialStatus.OK and timing is None:
        raise _Malformed("a trial that ran (status ok) has no timing")
    environment = _integer(values["environment"], "environment")
    if not 0 <= environment < len(environments):
        raise _Malformed(f"environment {environment} is not one of the {len(environments)} listed")
    return TrialRecord(
        id=_text(values["id"], "id"),
        study=_text(values["study"], "study"),
        batch=_integer(values["batch"], "batch"),
        config=config,
        key=KernelKey(kind=KernelKind(values["kind"]), code=code, parts=codes[code]),
        environment=environments[environment],
        activation_dtype=_text(values["dtype"], "dtype"),
        status=status,
        timing=timing,
        error=_text(values["error"], "error"),
    )


def _check_types(config: KernelConfig) -> None:
    defaults = KernelConfig(block_v=1)
    for name, value in config.fields().items():
        expected = type(defaults.fields()[name])
        if type(value) is not expected:
            raise _Malformed(f"knob {name} must be {expected.__name__}, got {value!r}")


def _list(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise _Malformed(f"'{what}' must be a list, got {value!r}"[:200])
    return value


def _integer(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Malformed(f"{what} must be an integer, got {value!r}")
    return value


def _number(value: object, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _Malformed(f"{what} must be a number, got {value!r}")
    return float(value)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"{what} must be a string, got {value!r}")
    return value


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
