"""Synthetic tuning records for tests: trials keyed by the current code's kernel digests, written in the record format."""

import uuid

import triton

from replaygen import __version__
from replaygen.keys import render_candidate
from replaygen.tune.records import Environment, TrialRecord, TrialStatus, TrialTiming, append_trials, record_path


def env(**changes) -> Environment:
    """An H100 environment matching this machine's triton and replaygen versions, with `changes` applied."""
    base = dict(gpu="h100", device_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", triton=triton.__version__, replaygen=__version__)
    return Environment(**{**base, **changes})


def trial(spec, shape, kind, config, batch, ms, environment=None, status=TrialStatus.OK) -> TrialRecord:
    """One trial of `config` for `kind` at `batch`, timed at `ms` (median) unless it failed."""
    candidate = render_candidate(spec, shape, kind, config)
    ok = status is TrialStatus.OK
    return TrialRecord(
        id=uuid.uuid4().hex,
        study="test",
        batch=batch,
        config=config,
        key=candidate.key,
        environment=environment or env(),
        activation_dtype="bfloat16",
        status=status,
        timing=TrialTiming(ms, ms * 0.99, ms * 1.01, 20) if ok else None,
        error="" if ok else "boom",
    )


def write(tune_dir, spec, shape, trials, gpu="h100"):
    """Append `trials` to the record file of (`spec`, `shape`) for `gpu` under `tune_dir`; returns its path."""
    path = record_path(tune_dir, gpu, spec, shape)
    append_trials(path, spec=spec.name, shape=shape.name, gpu=gpu, trials=trials)
    return path
