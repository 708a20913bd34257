"""How far a shape's stored state drifts from the exact recurrence over many decode steps, per precision choice.

Replay decode writes the state only when it flushes (every L steps or so), the baseline after every token: at the same
state dtype and rounding, replay rounds the state L times less often. `measure_drift` runs both on the same inputs
beside the float64 reference and reports their errors at given step counts (the precision choices to compare:
replaygen.precision).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
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


def measure_drift(
    module: ModuleType,
    spec: Spec,
    shape: TargetShape,
    *,
    steps: int,
    report_at: tuple[int, ...],
    batch: int,
    device: str | torch.device,
    act_dtype: torch.dtype,
    seed: int = 0,
) -> Iterator[DriftPoint]:
    """Replay and baseline decode of `module` from the same random states over `steps` steps of the same random
    inputs (no gate, drawn on `device`), against the float64 recurrence on those inputs (on the same device); yields
    a DriftPoint as each step count in `report_at` is reached."""
    factory = InputFactory(spec, shape, device, act_dtype, seed, draw_on_device=True)
    weights = factory.weights()
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    rows = list(range(batch))
    replay = module.allocate(batch, device, act_dtype)
    baseline = module.allocate_baseline(batch, device)
    rounding = baseline_rounding(module, batch, device, seed)
    reference = Reference(spec, shape, batch, device)
    start = factory.full_states(module, batch)
    module.load(replay, slots, start)
    baseline[rows] = start
    load_reference(reference, rows, start)
    worst_replay = worst_baseline = torch.zeros((), dtype=torch.float64, device=device)
    for step in range(1, steps + 1):
        inputs = factory.step(batch, use_gate=False)
        y_ref = reference.decode(rows, inputs, weights)
        y_rep = module.decode(replay, slots, **inputs, **weights)
        y_base = module.baseline_decode(baseline, slots, **inputs, **weights, **rounding)
        worst_replay = torch.maximum(worst_replay, _worst_row_head(y_rep, y_ref))
        worst_baseline = torch.maximum(worst_baseline, _worst_row_head(y_base, y_ref))
        if step in report_at:
            replayed = module.materialize(replay, slots, **materialize_weights(spec, shape, weights))
            state_error = state_errors(reference, replayed, rows)[0]
            yield DriftPoint(step, state_error, state_errors(reference, baseline, rows)[0], float(worst_replay), float(worst_baseline))
            worst_replay = worst_baseline = torch.zeros_like(worst_replay)


def _worst_row_head(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The largest relative error (a 0-d float64 tensor on ref's device, no host sync) of one (row, head) output
    vector [V] of `out` [batch, H, V] against `ref`; NaN where an output is."""
    out = out.detach().to(ref.device, torch.float64)
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max()
