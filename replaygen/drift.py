"""How far a shape's stored state drifts from the exact recurrence over many decode steps, per precision choice.

Replay decode writes the state only when it flushes (every L steps or so), the baseline after every token: at the same
state dtype and rounding, replay rounds the state L times less often. `measure_drift` runs both on the same inputs
beside the float64 reference and reports their errors at given step counts (the precision choices to compare:
replaygen.precision).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from replaygen.harness import InputFactory, baseline_rounding, load_reference, materialize_weights, state_errors
from replaygen.reference import Reference
from replaygen.spec.model import Spec, TargetShape


@dataclass(frozen=True)
class DriftPoint:
    """Errors after `steps` decode steps: states (relative, all rows) and the worst output row-head (relative) seen
    in the steps since the previous point."""

    steps: int
    replay_state: float
    baseline_state: float
    replay_output: float
    baseline_output: float


@dataclass(frozen=True)
class DriftVariant:
    """One precision choice to run: its name, its shape (replaygen.precision) and the module built for it."""

    name: str
    shape: TargetShape
    module: ModuleType


def measure_drift(
    spec: Spec,
    variants: Sequence[DriftVariant],
    *,
    steps: int,
    report_at: tuple[int, ...],
    batch: int,
    device: str | torch.device,
    act_dtype: torch.dtype,
    seed: int = 0,
) -> Iterator[tuple[str, DriftPoint]]:
    """Replay and baseline decode of every variant (shapes of the same sizes) in lockstep over `steps` steps of the same
    random inputs (no gate, drawn on `device`), against the float64 recurrence on those inputs (on the same device);
    yields (variant name, DriftPoint) for every variant as each step count in `report_at` is reached.

    All start from one random state, rounded to nearest into each variant's state dtype; variants of one state dtype
    share one reference, so a run costs one float64 recurrence per state dtype, not per variant."""
    if not variants:
        raise ValueError("measure_drift needs at least one variant")
    factory = InputFactory(spec, variants[0].shape, device, act_dtype, seed, draw_on_device=True)
    weights = factory.weights()
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    rows = list(range(batch))
    start = factory.full_states(variants[0].module, batch)
    references: dict[torch.dtype, Reference] = {}
    runs = []
    for variant in variants:
        module = variant.module
        own_start = _in_state_dtype(module, start)
        if module.STATE_DTYPE not in references:
            references[module.STATE_DTYPE] = Reference(spec, variant.shape, batch, device)
            load_reference(references[module.STATE_DTYPE], rows, own_start)
        replay = module.allocate(batch, device, act_dtype)
        module.load(replay, slots, own_start)
        baseline = module.allocate_baseline(batch, device)
        baseline[rows] = own_start
        runs.append(_DriftRun(variant, references[module.STATE_DTYPE], replay, baseline, baseline_rounding(module, batch, device, seed)))
    for step in range(1, steps + 1):
        inputs = factory.step(batch, use_gate=False)
        y_ref = {dtype: reference.decode(rows, inputs, weights) for dtype, reference in references.items()}
        for run in runs:
            module, ref = run.variant.module, y_ref[run.variant.module.STATE_DTYPE]
            run.worst_replay = torch.maximum(run.worst_replay, _worst_row_head(module.decode(run.replay, slots, **inputs, **weights), ref))
            y_base = module.baseline_decode(run.baseline, slots, **inputs, **weights, **run.rounding)
            run.worst_baseline = torch.maximum(run.worst_baseline, _worst_row_head(y_base, ref))
        if step in report_at:
            for run in runs:
                module = run.variant.module
                replayed = module.materialize(run.replay, slots, **materialize_weights(spec, run.variant.shape, weights))
                point = DriftPoint(
                    step,
                    state_errors(run.reference, replayed, rows)[0],
                    state_errors(run.reference, run.baseline, rows)[0],
                    float(run.worst_replay),
                    float(run.worst_baseline),
                )
                run.worst_replay = run.worst_baseline = torch.zeros_like(run.worst_replay)
                yield run.variant.name, point


@dataclass
class _DriftRun:
    """One variant's states during a drift run, and the worst outputs since the last report."""

    variant: DriftVariant
    reference: Reference
    replay: object
    baseline: object
    rounding: dict
    worst_replay: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    worst_baseline: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))


def _in_state_dtype(module: ModuleType, states: object) -> object:
    """Full states (a tensor, or a module's SlotStates) with the state rounded to nearest into `module`'s STATE_DTYPE."""
    if isinstance(states, torch.Tensor):
        return states.to(module.STATE_DTYPE)
    return module.SlotStates(states.state.to(module.STATE_DTYPE), *(getattr(states, name) for name, _ in module.CARRIED))


def _worst_row_head(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The largest relative error (a 0-d float64 tensor on ref's device, no host sync) of one (row, head) output
    vector [V] of `out` [batch, H, V] against `ref`; NaN where an output is."""
    out = out.detach().to(ref.device, torch.float64)
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max()
