"""Decode kernels (replay, baseline, materialize, load) against the float64 reference, step by step."""

from dataclasses import replace

import pytest
import torch

from replaygen import plan
from replaygen.configs import BucketConfig, KernelConfig, KernelKind
from replaygen.harness import TOLERANCE, CheckReport, InputFactory, check_decode, output_tolerance, relative_error, state_tolerance
from replaygen.reference import Reference
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import CacheField, CachedField, DType

from conftest import DEVICE, ODD, ROOT, SMALL


@pytest.fixture(scope="module")
def small(mamba2):
    return load_kernels(mamba2, SMALL)


@pytest.fixture(scope="module")
def odd(mamba2):
    return load_kernels(mamba2, ODD)


def assert_passes(report):
    assert report.ok, "\n".join(report.lines())
    assert {"replay_decode", "baseline_decode", "materialize", "baseline_state"} <= set(report.worst)


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_replay_matches_reference_fp32(mamba2, small, route):
    report = check_decode(small, mamba2, SMALL, device=DEVICE, route=route, cycles=3)
    assert_passes(report)
    assert report.steps >= 3 * SMALL.capacity


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_odd_sizes(mamba2, odd, route):
    assert_passes(check_decode(odd, mamba2, ODD, device=DEVICE, route=route, batch=4, seed=3))


@pytest.mark.parametrize("flush_at", [1, 2, 3])
def test_flush_thresholds(mamba2, small, flush_at):
    assert_passes(check_decode(small, mamba2, SMALL, device=DEVICE, flush_at=flush_at, seed=flush_at))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_without_gate(mamba2, small, dtype):
    assert_passes(check_decode(small, mamba2, SMALL, device=DEVICE, act_dtype=dtype, use_gate=False, seed=7))


def test_larger_capacity_and_batch(mamba2):
    shape = replace(SMALL, capacity=8)
    module = load_kernels(mamba2, shape)
    assert_passes(check_decode(module, mamba2, shape, device=DEVICE, batch=6, cycles=3, seed=11))


def test_harness_catches_a_wrong_kernel(mamba2, small, monkeypatch):
    """The checks are not vacuous: outputs 1% off fail them."""

    class Broken:
        def __getattr__(self, name):
            return getattr(small, name)

        @staticmethod
        def decode(state, slots, **kwargs):
            out = small.decode(state, slots, **kwargs)
            return out * 1.01

    report = check_decode(Broken(), mamba2, SMALL, device=DEVICE, cycles=1)
    assert not report.ok


def test_harness_checks_states_at_their_own_tolerance(mamba2):
    """A state 1e-3 off fails a check whose 16-bit outputs pass at 1.5e-2: Mamba-2's buffer caches only raw inputs
    and float32 fields (kernel and reference fold the same rounded values), so its states are held to float32's
    1e-4. GDN caches its corrected values in the activation dtype, so its states get that dtype's tolerance; so does a
    derived field cached at 16 bits, or a 16-bit state."""
    gdn = load_spec(ROOT / "specs" / "gdn.yaml")
    shape = mamba2.shape("nemotron-h")
    assert state_tolerance(mamba2, shape, torch.bfloat16) == state_tolerance(mamba2, shape, torch.float16) == TOLERANCE[torch.float32]
    qwen = gdn.shape("qwen3.5")
    assert state_tolerance(gdn, qwen, torch.bfloat16) == TOLERANCE[torch.bfloat16] and state_tolerance(gdn, qwen, torch.float32) == TOLERANCE[torch.float32]
    half_weight = replace(mamba2, cache=tuple(replace(c, dtype=None) if c.field is CacheField.WEIGHT else c for c in mamba2.cache))
    assert state_tolerance(half_weight, shape, torch.float16) == TOLERANCE[torch.float16]
    own_half_weight = replace(shape, cache_dtypes=(CachedField(CacheField.WEIGHT, None),))
    assert state_tolerance(mamba2, own_half_weight, torch.float16) == TOLERANCE[torch.float16]
    half_state = replace(shape, state_dtype=DType.BFLOAT16)
    assert state_tolerance(mamba2, half_state, torch.float32) == TOLERANCE[torch.bfloat16]
    assert output_tolerance(half_state, torch.float32) == TOLERANCE[torch.bfloat16] and output_tolerance(shape, torch.float32) == TOLERANCE[torch.float32]
    report = CheckReport("drift", 1, TOLERANCE[torch.bfloat16], TOLERANCE[torch.float32], {"replay_decode": (1e-3, 0), "materialize": (1e-3, 0)}, ())
    failing = [line.split()[0] for line in report.lines()[1:] if line.endswith("FAIL")]
    assert not report.ok and failing == ["materialize"]


def random_states(module, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *module.STATE_SHAPE), generator=gen).to(DEVICE)


def step_inputs(batch, seed, act=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h, g, p, n = SMALL.heads, SMALL.key_heads, SMALL.value_dim, SMALL.key_dim
    return {
        "x": torch.randn(batch, h, p, generator=gen).to(DEVICE, act),
        "B": torch.randn(batch, g, n, generator=gen).to(DEVICE, act),
        "C": torch.randn(batch, g, n, generator=gen).to(DEVICE, act),
        "dt": torch.randn(batch, h, generator=gen).to(DEVICE),
    }


WEIGHTS = {
    "A_log": torch.zeros(SMALL.heads, device=DEVICE),
    "dt_bias": torch.full((SMALL.heads,), -2.0, device=DEVICE),
    "D": torch.ones(SMALL.heads, device=DEVICE),
}


def test_load_then_materialize_round_trip(small):
    state = small.allocate(5, DEVICE, torch.float32)
    init = random_states(small, 3)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    small.load(state, slots, init)
    assert torch.equal(small.materialize(state, slots), init)
    assert state.cursor[[4, 0, 2]].eq(0).all()
    assert state.cursor.shape == (5, SMALL.heads, 1, 2)


def test_load_empties_the_buffer(small):
    state = small.allocate(2, DEVICE, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    small.load(state, slots, random_states(small, 2, seed=1))
    for step in range(2):
        small.decode(state, slots, **step_inputs(2, step), **WEIGHTS)
    assert state.cursor[..., 1].unique().tolist() == [2]
    fresh = random_states(small, 2, seed=2)
    small.load(state, slots, fresh)
    assert state.cursor[..., 1].unique().tolist() == [0]
    assert torch.equal(small.materialize(state, slots), fresh)


def test_materialize_leaves_the_buffer_alone(small):
    state = small.allocate(2, DEVICE, torch.float32)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    small.load(state, slots, random_states(small, 2, seed=3))
    small.decode(state, slots, **step_inputs(2, 9), **WEIGHTS)
    before = [t.clone() for t in (state.checkpoint, *state.buffers(), state.cursor)]
    first = small.materialize(state, slots)
    second = small.materialize(state, slots)
    assert torch.equal(first, second)
    for old, new in zip(before, (state.checkpoint, *state.buffers(), state.cursor)):
        assert torch.equal(old, new)


def test_materialized_state_continues_the_sequence(small):
    """A state taken out with materialize and loaded into another slot decodes identically (preemption)."""
    state = small.allocate(2, DEVICE, torch.float32)
    small.load(state, torch.tensor([0], dtype=torch.int32, device=DEVICE), random_states(small, 1, seed=4))
    one = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    for step in range(2):
        small.decode(state, one, **step_inputs(1, step), **WEIGHTS)
    moved = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    small.load(state, moved, small.materialize(state, one))
    a = small.decode(state, one, **step_inputs(1, 5), **WEIGHTS)
    b = small.decode(state, moved, **step_inputs(1, 5), **WEIGHTS)
    assert relative_error(b, a) < 1e-5


class TestApiErrors:
    def test_wrong_input_shape(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        inputs = step_inputs(2, 0)
        inputs["x"] = inputs["x"][:, :, :4]
        with pytest.raises(ValueError, match=r"x has shape \(2, 4, 4\), expected \(2, 4, 8\)"):
            small.decode(state, torch.zeros(2, dtype=torch.int32, device=DEVICE), **inputs, **WEIGHTS)

    def test_activation_dtype_must_match_the_state(self, small):
        state = small.allocate(2, DEVICE, torch.bfloat16)
        with pytest.raises(TypeError, match="allocated for torch.bfloat16"):
            small.decode(state, torch.zeros(2, dtype=torch.int32, device=DEVICE), **step_inputs(2, 0), **WEIGHTS)

    def test_slots_must_be_int32(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        with pytest.raises(TypeError, match="slots must be an int32 tensor"):
            small.decode(state, torch.zeros(2, dtype=torch.int64, device=DEVICE), **step_inputs(2, 0), **WEIGHTS)

    def test_strided_slots_are_refused(self, small):
        """A column of a [batch, k] index table (vLLM's speculative layout) is a strided view: the kernels read row b
        at offset b, so it would hand a padding row another row's slot. Refused before any launch, state untouched."""
        state = small.allocate(4, DEVICE, torch.float32)
        before = state.checkpoint.clone()
        table = torch.tensor([[1, 3], [-1, 2]], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match=r"slots must be contiguous \(stride 1, got 2\): pass slots.contiguous\(\)"):
            small.decode(state, table[:, 0], **step_inputs(2, 0), **WEIGHTS)
        with pytest.raises(ValueError, match="slots must be contiguous"):
            small.materialize(state, table[:, 0])
        assert torch.equal(state.checkpoint, before)
        small.decode(state, table[:, 0].contiguous(), **step_inputs(2, 0), **WEIGHTS)

    def test_validate_slots(self, small):
        """`validate_slots` names slots past the allocation and slots given to two rows; padding may repeat."""
        small.validate_slots(torch.tensor([2, -1, 0, -1], dtype=torch.int32, device=DEVICE), 3)
        with pytest.raises(ValueError, match=r"slots past the 3 allocated \(row, slot\): \[\(1, 3\), \(2, 7\)\]"):
            small.validate_slots(torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE), 3)
        with pytest.raises(ValueError, match=r"more than one row \(first row, row, slot\): \[\(0, 2, 1\), \(0, 3, 1\)\]"):
            small.validate_slots(torch.tensor([1, 0, 1, 1, -1], dtype=torch.int32, device=DEVICE), 3)
        with pytest.raises(TypeError, match="slots must be an int32 tensor"):
            small.validate_slots(torch.zeros(2, dtype=torch.int64, device=DEVICE), 3)

    def test_weight_shape(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        weights = dict(WEIGHTS, D=torch.ones(3, device=DEVICE))
        with pytest.raises(ValueError, match="D has shape"):
            small.decode(state, torch.zeros(2, dtype=torch.int32, device=DEVICE), **step_inputs(2, 0), **weights)

    def test_last_dim_contiguous(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        inputs = step_inputs(2, 0)
        inputs["B"] = torch.randn(2, SMALL.key_dim, SMALL.key_heads, device=DEVICE).transpose(1, 2)
        with pytest.raises(ValueError, match="contiguous in its last dimension"):
            small.decode(state, torch.zeros(2, dtype=torch.int32, device=DEVICE), **inputs, **WEIGHTS)

    def test_route_and_flush_at(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        slots = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match="route must be one of"):
            small.decode(state, slots, **step_inputs(2, 0), **WEIGHTS, route="fast")
        with pytest.raises(ValueError, match="flush_at must be in 1..4"):
            small.decode(state, slots, **step_inputs(2, 0), **WEIGHTS, flush_at=5)

    def test_missing_input(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        inputs = step_inputs(2, 0)
        del inputs["C"]
        with pytest.raises(TypeError, match="C"):
            small.decode(state, torch.zeros(2, dtype=torch.int32, device=DEVICE), **inputs, **WEIGHTS)

    def test_load_shape(self, small):
        state = small.allocate(2, DEVICE, torch.float32)
        with pytest.raises(ValueError, match="states has shape"):
            small.load(state, torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(1, 4, 8, 8, device=DEVICE))

    def test_allocation_dtype(self, small):
        with pytest.raises(ValueError, match="activation_dtype"):
            small.allocate(2, DEVICE, torch.int8)


@pytest.mark.parametrize("config", [
    pytest.param(dict(block_v=8), id="fused-flush"),
    pytest.param(dict(block_v=16, fused_flush=False, precompute_scores=True, fold_chunk=2, evict_state=True), id="flush-launch-scores-evict"),
    pytest.param(dict(block_v=16, fold_dot=True, prefetch_ring=False, fold_chunk=1), id="dot-fold-no-prefetch"),
])
@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_flush_threshold_changes_between_steps(spec_file, config):
    """Batch buckets pick their own flush_at (1 = the baseline's step on the checkpoint), so one sequence sees
    thresholds change from step to step: entries left by a larger threshold must still be folded (the delta rule's
    corrected values too)."""
    run_threshold_schedule(load_spec(ROOT / "specs" / spec_file), config)


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_leftovers_folded_the_other_way(spec_file, monkeypatch):
    """The plan folds a flush-every-step row's leftover entries into the checkpoint in memory before the step, or
    after it (out of line) and then redoes the step, one way per spec (plan.leftovers_in_memory); the way each spec
    does not ship is kept correct too."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shipped = plan.leftovers_in_memory(spec)
    monkeypatch.setattr(plan, "leftovers_in_memory", lambda spec: not shipped)
    run_threshold_schedule(spec, dict(block_v=8))


def run_threshold_schedule(spec, config):
    """Decode with flush_at changing from step to step, against the reference (outputs and states after every step)."""
    shape = replace(SMALL, value_dim=16, capacity=6, window=1)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, KernelConfig(**config)),)})
    factory = InputFactory(spec, shape, DEVICE, torch.float32, seed=5)
    weights = factory.weights()
    state = module.allocate(3, DEVICE, torch.float32)
    reference = Reference(spec, shape, 3)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    init = factory.states(2, tuple(module.STATE_SHAPE))
    module.load(state, slots, init)
    reference.load([2, 0], init.cpu())
    for step, flush_at in enumerate([5, 5, 5, 1, 6, 6, 2, 3, 1, 1, 4, 4, 4]):
        inputs = factory.step(2)
        y = module.decode(state, slots, **inputs, **weights, flush_at=flush_at)
        y_ref = reference.decode([2, 0], inputs, weights)
        assert relative_error(y, y_ref) < 1e-4, f"step {step} (flush_at={flush_at})"
        full = module.materialize(state, slots)
        assert relative_error(full, reference.to_layout(reference.states[[2, 0]])) < 1e-4, f"state after step {step}"
        counts = state.cursor[[2, 0], :, :, 1]
        assert counts.eq(counts.flatten()[0]).all()


ALIGNED = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, align_flushes=True)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_aligned_flushes_match_the_reference(spec_file, groups):
    """align_flushes (every row on one step of the clock, or two groups of slots half a period apart) with rows that
    join at different steps, padding and odd sizes: outputs and states against the reference after every step,
    unused slots untouched."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(ODD, capacity=4, window=1)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, replace(ALIGNED, flush_groups=groups)),)})
    assert_passes(check_decode(module, spec, shape, device=DEVICE, batch=4, cycles=3, seed=13))


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_aligned_flushes_gather_every_row_on_the_clock(spec_file, groups):
    """Rows loaded at different steps flush by their own count until the layer's step clock comes to their group's
    phase (slot % G of G = min(groups, flush_at) groups, phase group * flush_at // G), then on the same steps as
    their group; each aligned decode call advances the clock by one modulo flush_at, decode steps that do not align
    (flush_at=1, the state route) leave it, and no buffer ever overflows."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=6, window=1)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, replace(ALIGNED, flush_groups=groups)),)})
    factory = InputFactory(spec, shape, DEVICE, torch.float32, seed=9)
    weights = factory.weights()
    state = module.allocate(4, DEVICE, torch.float32)
    reference = Reference(spec, shape, 4)
    joins = {0: [3], 2: [1], 3: [0]}
    active: list[int] = []
    clock = 0
    for step, flush_at in enumerate([4, 4, 4, 4, 4, 4, 4, 4, 1, 4, 4, 4, 3, 3, 3, 3, 3, 3]):
        if step in joins:
            init = factory.states(len(joins[step]), tuple(module.STATE_SHAPE))
            module.load(state, torch.tensor(joins[step], dtype=torch.int32, device=DEVICE), init)
            reference.load(joins[step], init.cpu())
            active += joins[step]
        slots = torch.tensor(active, dtype=torch.int32, device=DEVICE)
        before = state.cursor[active, :, :, 1].clone()
        inputs = factory.step(len(active))
        route = "state_and_output" if step == 5 else None
        y = module.decode(state, slots, **inputs, **weights, flush_at=flush_at, route=route)
        y_ref = reference.decode(active, inputs, weights)
        assert relative_error(y, y_ref) < 1e-4, f"step {step}"
        assert relative_error(module.materialize(state, slots), reference.to_layout(reference.states[active])) < 1e-4, f"state after step {step}"
        if flush_at > 1 and route is None:
            clock = (clock + 1) % flush_at
        assert int(state.clock) == clock, f"step {step}"
        counts = state.cursor[active, :, :, 1]
        group_count = min(groups, flush_at)
        phase = torch.tensor([slot % group_count * flush_at // group_count for slot in active], dtype=torch.int32, device=DEVICE)
        on_clock = (phase == clock)[:, None, None] & (flush_at > 1 and route is None)
        flushed = (before + 1 >= flush_at) | on_clock
        assert torch.equal(counts, torch.where(flushed, 0, before + 1)), f"step {step}: counts {counts.flatten().tolist()}"
    group_count = min(groups, flush_at)
    for group in {slot % group_count for slot in active}:
        members = [i for i, slot in enumerate(active) if slot % group_count == group]
        assert counts[members].eq(counts[members].flatten()[0]).all(), f"the rows of group {group} did not align"
