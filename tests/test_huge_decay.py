"""A step with a huge decay (|log a| up to 1e5, a reset) anywhere in the buffer or the window: the replay stays as
accurate as the fp32 sequential recurrence (the baseline kernels), in decode, verify, flush and materialize.

Each batch row takes its huge step at another step, so one run puts it at every buffer position: oldest, newest,
mid-buffer, on the flushing step, and at every token of a verify window. Its value is scaled down by the size of the
step (where the update weight is dt' itself), so later outputs stay of ordinary size. Every family: Mamba-2, GDN,
KDA (the decay per key channel), Mamba-3 (the trapezoid carries the huge step's entry into the next step)."""

from dataclasses import replace

import pytest
import torch

from replaygen.harness import InputFactory, load_reference, state_errors
from replaygen.reference import Reference
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import UpdateWeight

from conftest import DEVICE, ROOT, SMALL

DECODE_SHAPE = replace(SMALL, name="huge-decay", heads=2, key_heads=1)
VERIFY_SHAPE = replace(DECODE_SHAPE, capacity=6, window=3)
# Decay pre-activations of the huge steps: |log a| = A * softplus(d + bias), A in [1, 8], so up to about 1e5.
HUGE = (1e2, 1e3, 1.25e4)
# The replay's worst per-row error may be this many times the fp32 recurrence's, or this floor (CPU fp32 noise).
FACTOR, FLOOR = 4.0, 2e-6


def row_error(y: torch.Tensor, y_ref: torch.Tensor) -> torch.Tensor:
    """[batch]: ||y_b - y_ref_b|| / ||y_ref_b|| over every dimension but the first."""
    diff = (y.cpu().double() - y_ref).flatten(1).norm(dim=1)
    return diff / y_ref.flatten(1).norm(dim=1).clamp_min(1e-30)


def make_huge(spec, inputs, rows, sizes):
    """Give rows[i] the decay pre-activation sizes[i] (tokens: the trailing index of a window, or None). Where the
    step's dt' also weighs its value (Mamba-2, Mamba-3), the value is scaled down by the size; where it turns a rotary
    angle (pi tanh(angle input) dt', Mamba-3), the step's angle input is 0: a turn of 1e4 rad leaves a float32 angle
    about 1e-3 rad off in any float32 recurrence, which is not what this tests."""
    decay, value = inputs[spec.decay.input], inputs[spec.inputs.value]
    for row, (size, token) in zip(rows, sizes):
        at = (row,) if token is None else (row, token)
        decay[at] = size
        if spec.update.weight is UpdateWeight.DECAY_DT:
            value[at] = value[at] / size
        if spec.rotary is not None:
            angle = inputs[spec.rotary.angle_input]
            angle[at] = 0.0


def assert_states_close(reference, states, slots):
    """Materialized full states against the reference, row by row; what a spec carries beside its state too."""
    state = states if isinstance(states, torch.Tensor) else states.state
    state_error = row_error(reference.from_layout(state.cpu()), reference.states)
    assert (state_error <= FLOOR).all(), f"materialized states {state_error.tolist()}"
    carried = state_errors(reference, states, slots)[1]
    assert carried is None or carried <= FLOOR, f"materialized carried entries {carried}"


@pytest.fixture(scope="module", params=["mamba2", "gdn", "kda", "mamba3"])
def family(request):
    spec = load_spec(ROOT / "specs" / f"{request.param}.yaml")
    return spec, load_kernels(spec, DECODE_SHAPE), load_kernels(spec, VERIFY_SHAPE)


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_decode_after_a_huge_decay(family, route):
    """Row (i, p) takes a step of HUGE[i] at step p + 1 (p = 0..L): it lands at every buffer position, the flushing
    step included; outputs of every later step and the materialized states are checked."""
    spec, module, _ = family
    shape = DECODE_SHAPE
    positions = shape.capacity + 1
    batch = len(HUGE) * positions
    factory = InputFactory(spec, shape, DEVICE, torch.float32, seed=5)
    weights = factory.weights()
    replay = module.allocate(batch, DEVICE, torch.float32)
    baseline = module.allocate_baseline(batch, DEVICE)
    reference = Reference(spec, shape, batch)
    slots = list(range(batch))
    index = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    init = factory.full_states(module, batch)
    module.load(replay, index, init)
    baseline[slots] = init
    load_reference(reference, slots, init)
    worst_replay = torch.zeros(batch, dtype=torch.float64)
    worst_base = torch.zeros(batch, dtype=torch.float64)
    for step in range(3 * shape.capacity + 2):
        inputs = factory.step(batch)
        hit = [r for r in slots if r % positions + 1 == step]
        make_huge(spec, inputs, hit, [(HUGE[r // positions], None) for r in hit])
        y_ref = reference.decode(slots, inputs, weights)
        y_rep = module.decode(replay, index, **inputs, **weights, route=route)
        y_base = module.baseline_decode(baseline, index, **inputs, **weights)
        after = torch.tensor([step > r % positions + 1 for r in slots])
        worst_replay = torch.where(after, torch.maximum(worst_replay, row_error(y_rep, y_ref)), worst_replay)
        worst_base = torch.where(after, torch.maximum(worst_base, row_error(y_base, y_ref)), worst_base)
    bound = torch.clamp(FACTOR * worst_base, min=FLOOR)
    assert (worst_replay <= bound).all(), f"replay {worst_replay.tolist()} against the fp32 recurrence {worst_base.tolist()}"
    assert_states_close(reference, module.materialize(replay, index), slots)


@pytest.mark.parametrize("accept", ["all", "random"])
def test_verify_after_a_huge_decay(family, accept):
    """Row (i, w, t) takes a step of HUGE[i] at token t of verify w + 1: inside the window at every token, then in
    the buffer at every position as later windows commit and flush; every later window is checked."""
    spec, _, module = family
    shape = VERIFY_SHAPE
    tokens = shape.window
    windows = 3
    places = [(w, t) for w in range(windows) for t in range(tokens)]
    batch = len(HUGE) * len(places)
    factory = InputFactory(spec, shape, DEVICE, torch.float32, seed=9)
    weights = factory.weights()
    replay = module.allocate(batch, DEVICE, torch.float32)
    reference = Reference(spec, shape, batch)
    slots = list(range(batch))
    index = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    init = factory.full_states(module, batch)
    module.load(replay, index, init)
    load_reference(reference, slots, init)
    worst = torch.zeros(batch, dtype=torch.float64)
    for step in range(3 * windows + 2):
        inputs = factory.window(batch, tokens)
        hit = [r for r in slots if places[r % len(places)][0] + 1 == step]
        make_huge(spec, inputs, hit, [(HUGE[r // len(places)], places[r % len(places)][1]) for r in hit])
        y_ref = reference.verify(slots, inputs, weights)
        y_rep = module.verify(replay, index, **inputs, **weights)
        after = torch.tensor([step >= places[r % len(places)][0] + 1 for r in slots])
        worst = torch.where(after, torch.maximum(worst, row_error(y_rep, y_ref)), worst)
        counts = [tokens] * batch if accept == "all" else torch.randint(0, tokens + 1, (batch,), generator=factory.gen).tolist()
        module.commit(replay, index, torch.tensor(counts, dtype=torch.int32, device=DEVICE), tokens)
        reference.commit(slots, counts)
    assert (worst <= FLOOR).all(), f"verify {worst.tolist()}"
    assert_states_close(reference, module.materialize(replay, index), slots)
