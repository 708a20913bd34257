"""16-bit states and float32 buffers, chosen per shape: every kernel kind against the float64 reference.

The interpreter's float32 -> bfloat16 convert truncates (the GPU's rounds to nearest), so round-to-nearest bfloat16
states are checked on the GPU; float16 converts round to nearest in both places.
"""

import re
from dataclasses import replace
from functools import partial

import pytest
import torch

from replaygen.configs import BucketConfig, KernelConfig, KernelKind
from replaygen.drift import DriftVariant, measure_drift
from replaygen.harness import InputFactory, check_decode, check_speculative
from replaygen.plan import state_identity
from replaygen.precision import precision_variant
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import CacheField, CachedField, DType, Rounding
from replaygen.traffic import entry_bytes, state_bytes

from conftest import DEVICE, ROOT, SMALL

SHAPE = replace(SMALL, capacity=8, window=2)


def spec_named(name):
    return load_spec(ROOT / "specs" / f"{name}.yaml")


def assert_passes(report):
    assert report.ok, "\n".join(report.lines())


@pytest.fixture(scope="module", params=["mamba2", "gdn"])
def half_state(request):
    spec = spec_named(request.param)
    shape = replace(SHAPE, state_dtype=DType.FLOAT16)
    return spec, shape, load_kernels(spec, shape)


@pytest.mark.parametrize("route,act", [("output_only", torch.float32), ("state_and_output", torch.bfloat16)])
def test_float16_state_decode(half_state, route, act):
    spec, shape, module = half_state
    assert module.STATE_DTYPE is torch.float16
    assert_passes(check_decode(module, spec, shape, device=DEVICE, act_dtype=act, route=route, cycles=3, seed=2))


@pytest.mark.parametrize("accept", ["random", "all"])
def test_float16_state_verify(half_state, accept):
    spec, shape, module = half_state
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, act_dtype=torch.bfloat16, steps=10, accept=accept, seed=4))


def test_load_rounds_a_float32_state_to_the_state_dtype(half_state):
    """load takes float32 states into a float16 checkpoint rounded to nearest; materialize of a slot with an empty
    buffer gives that checkpoint back exactly."""
    _, _, module = half_state
    state = module.allocate(3, DEVICE)
    given = torch.randn((2, *module.STATE_SHAPE), generator=torch.Generator().manual_seed(1)).to(DEVICE) / 3
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    module.load(state, slots, given)
    assert torch.equal(state.checkpoint[[2, 0]], given.to(torch.float16))
    assert torch.equal(module.materialize(state, slots), given.to(torch.float16))
    with pytest.raises(TypeError, match="float16"):
        module.materialize(state, slots, out=torch.zeros((2, *module.STATE_SHAPE), device=DEVICE))


def test_float32_buffers_per_shape():
    """A shape caching GDN's corrected values and keys in float32: its buffers, traffic and identity say so, and its
    states are held to float32's tolerance with bfloat16 activations (the kernels fold what the reference folds)."""
    spec = spec_named("gdn")
    wide = replace(SHAPE, cache_dtypes=(CachedField(CacheField.CORRECTED_VALUE, DType.FLOAT32), CachedField(CacheField.KEY, DType.FLOAT32)))
    module = load_kernels(spec, wide)
    state = module.allocate(2, DEVICE, torch.bfloat16)
    assert state.buf_value.dtype is torch.float32 and state.buf_key.dtype is torch.float32
    assert entry_bytes(spec, wide, DType.BFLOAT16) > entry_bytes(spec, SHAPE, DType.BFLOAT16)
    assert "corrected_value:float32" in state_identity(spec, wide) and state_identity(spec, wide) != state_identity(spec, SHAPE)
    report = check_decode(module, spec, wide, device=DEVICE, act_dtype=torch.bfloat16, cycles=3, seed=6)
    assert_passes(report)
    assert report.state_tolerance == 1e-4


def test_a_16_bit_state_halves_the_state_bytes():
    spec = spec_named("mamba2")
    shape = spec.shape("nemotron-h")
    assert state_bytes(spec, replace(shape, state_dtype=DType.BFLOAT16)) * 2 == state_bytes(spec, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("spec_name", ["mamba2", "gdn", "kda"])
def test_bfloat16_state_every_kernel_on_the_gpu(spec_name):
    spec = spec_named(spec_name)
    shape = replace(SHAPE, state_dtype=DType.BFLOAT16, layout=spec.state.layout)
    module = load_kernels(spec, shape)
    for route in ("output_only", "state_and_output"):
        assert_passes(check_decode(module, spec, shape, device="cuda", act_dtype=torch.bfloat16, route=route, cycles=3, seed=8))
    assert_passes(check_speculative(module, spec, shape, device="cuda", act_dtype=torch.bfloat16, steps=10, seed=9))


# --- stochastic rounding ----------------------------------------------------------------------------------------

GRID_STEP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # the spacing of the dtype's values in [1, 2)


@pytest.fixture(scope="module", params=[DType.BFLOAT16, DType.FLOAT16], ids=["bf16", "fp16"])
def stochastic(request):
    spec = spec_named("mamba2")
    shape = replace(SHAPE, state_dtype=request.param, rounding=Rounding.STOCHASTIC)
    return spec, shape, load_kernels(spec, shape)


def loaded(module, values, seed=0, slots=(0,)):
    """The checkpoints `load` writes for float32 `values` [n, *STATE_SHAPE] into a fresh state seeded `seed`."""
    state = module.allocate(max(slots) + 1, DEVICE, rounding_seed=seed)
    module.load(state, torch.tensor(slots, dtype=torch.int32, device=DEVICE), values.to(DEVICE))
    return state, state.checkpoint[list(slots)].float().cpu()


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(stochastic):
    """Every value goes to one of its two neighbours on the dtype's grid, up with probability (x - down) / step: over
    a state's elements the fraction rounded up is that probability and the mean error is near zero. Values on the
    grid stay; negative values, float16 subnormals, inf and NaN are handled."""
    _, _, module = stochastic
    dtype = module.STATE_DTYPE
    n = 1
    for size in module.STATE_SHAPE:
        n *= size
    for base, step in ((1.0, GRID_STEP[dtype]), (-3.0, -2 * GRID_STEP[dtype]), (2.0**-20, 2.0**-24 if dtype is torch.float16 else 2.0**-27)):
        for fraction in (0.3, 0.75):
            x = base + fraction * step
            _, out = loaded(module, torch.full((1, *module.STATE_SHAPE), x))
            down, up = base, base + step
            assert set(out.unique().tolist()) <= {down, up}, (x, out.unique())
            share_up = float((out == up).float().mean())
            bound = 4 * (fraction * (1 - fraction) / n) ** 0.5
            assert abs(share_up - fraction) < bound, (x, share_up)
            assert abs(float((out.double() - x).mean())) < bound * abs(step)
    on_grid = torch.tensor([0.0, 1.0, -1.5, 2.0**-14, float("inf"), float("-inf")])
    values = on_grid.repeat(n // len(on_grid) + 1)[:n].reshape(1, *module.STATE_SHAPE)
    assert torch.equal(loaded(module, values)[1], values)
    nan = torch.full((1, *module.STATE_SHAPE), float("nan"))
    assert torch.isnan(loaded(module, nan)[1]).all()


def test_stochastic_rounding_is_reproducible_and_fresh(stochastic):
    """The same seed gives the same checkpoints; another seed, or another slot, other ones. load restarts a slot's
    count; each state-writing launch advances the count of the rows it serves, and only theirs."""
    _, _, module = stochastic
    x = torch.full((2, *module.STATE_SHAPE), 1.0 + 0.5 * GRID_STEP[module.STATE_DTYPE])
    state, first = loaded(module, x, seed=7, slots=(0, 1))
    assert torch.equal(first, loaded(module, x, seed=7, slots=(0, 1))[1])
    assert not torch.equal(first, loaded(module, x, seed=8, slots=(0, 1))[1])
    assert not torch.equal(first[0], first[1])
    assert state.rounding.steps.eq(1).all()
    module.load(state, torch.tensor([1], dtype=torch.int32, device=DEVICE), x[:1].to(DEVICE))
    assert torch.equal(state.checkpoint[1].float().cpu(), first[1]) and state.rounding.steps.eq(1).all()


@pytest.mark.parametrize("key_dim", [16, 20], ids=["key-dim-16", "key-dim-20-padded"])
def test_stochastic_bits_do_not_depend_on_the_programs_block_of_rows(key_dim):
    """One Philox call serves eight consecutive key positions of a row: the bits of every value are the same whatever
    block of value rows and warps a program runs, also where key_dim is not a multiple of the tile (a row's counters
    are key_dim rounded up to a multiple of 8; the tile's padded columns are never stored), and the rounding still
    goes up and down across the state."""
    spec = spec_named("mamba2")
    shape = replace(SHAPE, value_dim=16, key_dim=key_dim, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    modules = [load_kernels(spec, shape, {KernelKind.LOAD: (BucketConfig(None, KernelConfig(block_v=block_v, num_warps=warps)),)}) for block_v, warps in ((8, 1), (16, 4))]
    x = torch.full((1, *modules[0].STATE_SHAPE), 1.0 + 0.5 * GRID_STEP[torch.bfloat16])
    first, second = (loaded(module, x, seed=3)[1] for module in modules)
    assert torch.equal(first, second)
    assert set(first.unique().tolist()) == {1.0, 1.0 + GRID_STEP[torch.bfloat16]}


def test_every_state_writing_kernel_counts_its_rows(stochastic):
    spec, shape, module = stochastic
    factory = InputFactory(spec, shape, DEVICE, torch.bfloat16, 3)
    weights = factory.weights()
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEVICE)
    baseline = module.allocate_baseline(3, DEVICE)
    rounding = module.allocate_rounding(3, DEVICE, seed=5)
    module.baseline_decode(baseline, slots, **factory.step(3), **weights, rounding=rounding)
    assert rounding.steps[[0, 2]].eq(1).all() and rounding.steps[1].eq(0).all()
    snapshots, current = module.allocate_snapshots(3, DEVICE, 2)
    module.baseline_verify(snapshots, current, slots, **factory.window(3, 2), **weights, rounding=rounding)
    assert rounding.steps[[0, 2]].eq(3).all() and rounding.steps[1].eq(0).all()
    replay = module.allocate(3, DEVICE, torch.bfloat16)
    for _ in range(2):
        module.decode(replay, slots, **factory.step(3), **weights)
    module.verify(replay, slots, **factory.window(3, 2), **weights)
    assert replay.rounding.steps[[0, 2]].eq(3).all() and replay.rounding.steps[1].eq(0).all()
    before = replay.rounding.steps.clone()
    first = module.materialize(replay, slots)
    assert torch.equal(module.materialize(replay, slots), first) and torch.equal(replay.rounding.steps, before)


def test_a_stochastic_baseline_needs_its_streams(stochastic):
    spec, shape, module = stochastic
    factory = InputFactory(spec, shape, DEVICE, torch.bfloat16, 3)
    baseline = module.allocate_baseline(2, DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="pass rounding=allocate_rounding"):
        module.baseline_decode(baseline, slots, **factory.step(2), **factory.weights())
    with pytest.raises(ValueError, match="rounding has 3 slots"):
        module.baseline_decode(baseline, slots, **factory.step(2), **factory.weights(), rounding=module.allocate_rounding(3, DEVICE))
    for seed in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match="rounding seed must be an int"):
            module.allocate_rounding(2, DEVICE, seed)


def test_stochastic_streams_serve_every_build_of_their_shape(stochastic):
    """The tuner times candidate builds of one shape (other launch configs) on one workload's streams: they take them;
    streams of another shape (other heads) are refused by name."""
    spec, shape, module = stochastic
    factory = InputFactory(spec, shape, DEVICE, torch.bfloat16, 3)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    step, weights = factory.step(2), factory.weights()
    rounding = module.allocate_rounding(2, DEVICE, seed=4)
    candidate = load_kernels(spec, shape, {KernelKind.BASELINE_DECODE: (BucketConfig(None, KernelConfig(block_v=8, num_warps=2)),)})
    states = [m.allocate_baseline(2, DEVICE) for m in (module, candidate)]
    for m, state in zip((module, candidate), states):
        m.baseline_decode(state, slots, **step, **weights, rounding=rounding)
    assert rounding.steps.eq(2).all()
    wider = load_kernels(spec, replace(shape, name="wider", heads=2 * shape.heads))
    with pytest.raises(ValueError, match=r"rounding streams .* are another module's"):
        module.baseline_decode(states[0], slots, **step, **weights, rounding=wider.allocate_rounding(2, DEVICE))


@pytest.mark.parametrize("spec_name", ["mamba2", "gdn"])
def test_stochastic_state_every_kernel(spec_name):
    spec = spec_named(spec_name)
    shape = replace(SHAPE, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    module = load_kernels(spec, shape)
    assert_passes(check_decode(module, spec, shape, device=DEVICE, act_dtype=torch.bfloat16, cycles=3, seed=10))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, act_dtype=torch.bfloat16, steps=10, seed=11))


@pytest.mark.gpu
def test_cuda_graph_replays_draw_fresh_bits():
    """A captured baseline step replayed twice from the same state rounds differently (the counts live on the
    device); restarting the counts repeats the first replay exactly."""
    spec = spec_named("mamba2")
    shape = replace(SHAPE, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    module = load_kernels(spec, shape)
    factory = InputFactory(spec, shape, "cuda", torch.bfloat16, 12)
    inputs, weights = factory.step(4), factory.weights()
    slots = torch.arange(4, dtype=torch.int32, device="cuda")
    start = factory.states(4, tuple(module.STATE_SHAPE), module.STATE_DTYPE)
    state, rounding = start.clone(), module.allocate_rounding(4, "cuda", seed=3)
    module.baseline_decode(state, slots, **inputs, **weights, rounding=rounding)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.baseline_decode(state, slots, **inputs, **weights, rounding=rounding)
    results = []
    for steps in (0, 1, 0):
        state.copy_(start)
        rounding.steps.fill_(steps)
        graph.replay()
        results.append(state.clone())
    assert torch.equal(results[0], results[2]) and not torch.equal(results[0], results[1])


# --- replaygen drift ---------------------------------------------------------------------------------------------


def test_precision_variants():
    spec = spec_named("gdn")
    shape = spec.shape("qwen3.5")
    stochastic = precision_variant(spec, shape, "bfloat16-stochastic")
    assert (stochastic.state_dtype, stochastic.rounding, stochastic.name) == (DType.BFLOAT16, Rounding.STOCHASTIC, "qwen3.5-bfloat16-stochastic")
    assert precision_variant(spec, shape, "float16").rounding is Rounding.NEAREST
    wide = precision_variant(spec, shape, "float32-buffers")
    assert {c.field: c.dtype for c in spec.cache_of(wide)} == {CacheField.CORRECTED_VALUE: DType.FLOAT32, CacheField.KEY: DType.FLOAT32, CacheField.LOG_DECAY: DType.FLOAT32}
    both = precision_variant(spec, shape, "bfloat16+float32-buffers")
    assert (both.state_dtype, both.rounding, both.name) == (DType.BFLOAT16, Rounding.NEAREST, "qwen3.5-f32buf-bfloat16")
    assert {c.field: c.dtype for c in spec.cache_of(both)} == {c.field: c.dtype for c in spec.cache_of(wide)}
    for name in ("float8", "float32-buffers+float32-buffers", "bfloat16+float16", "bfloat16+"):
        with pytest.raises(ValueError, match=f"unknown precision variant '{re.escape(name)}'"):
            precision_variant(spec, shape, name)


def test_drift_replay_rounds_less_often_than_the_baseline():
    """A float16 state rounded to nearest: replay (one state write per flush) stays closer to the exact recurrence than
    the baseline that writes it every step; float32 buffers make GDN's replay state as exact as its float32 baseline."""
    spec = spec_named("mamba2")
    shape = precision_variant(spec, SHAPE, "float16")
    ((_, point),) = measure_drift(spec, [DriftVariant("float16", shape, load_kernels(spec, shape))], steps=24, report_at=(24,), batch=2, device=DEVICE, act_dtype=torch.bfloat16)
    assert point.steps == 24 and 0 < point.replay_state < point.baseline_state < 3e-3
    gdn = spec_named("gdn")
    wide = precision_variant(gdn, SHAPE, "float32-buffers")
    ((_, point),) = measure_drift(gdn, [DriftVariant("float32-buffers", wide, load_kernels(gdn, wide))], steps=8, report_at=(8,), batch=2, device=DEVICE, act_dtype=torch.bfloat16)
    assert point.replay_state < 1e-5 and point.baseline_state < 1e-5


def test_drift_variants_in_lockstep_measure_what_each_measures_alone():
    """Variants run together (sharing inputs, and a reference per state dtype) report what each reports run alone."""
    spec = spec_named("mamba2")
    names = ("float32", "bfloat16", "bfloat16-stochastic")
    variants = [DriftVariant(name, shape, load_kernels(spec, shape)) for name in names for shape in [precision_variant(spec, SHAPE, name)]]
    run = partial(measure_drift, spec, steps=6, report_at=(3, 6), batch=2, device=DEVICE, act_dtype=torch.bfloat16)
    together = list(run(variants))
    assert [name for name, _ in together] == [*names, *names] and [p.steps for _, p in together] == [3] * 3 + [6] * 3
    assert [p for name, p in together if name == "float32"] == [p for _, p in run(variants[:1])]
    assert all(0 < p.replay_state < 1e-2 for _, p in together)


def test_drift_command(capsys):
    from replaygen.cli import main

    spec = str(ROOT / "specs" / "mamba2.yaml")
    assert main(["drift", spec, "--shape", "nemotron-h-tp8", "--steps", "2,3", "--batch", "1", "--variants", "float32,bfloat16-stochastic"]) == 0
    out = capsys.readouterr().out
    assert "mamba2/nemotron-h-tp8 (heads=2 key_heads=1 value_dim=16 key_dim=32" in out
    assert len([line for line in out.splitlines() if line.split()[:1] in (["float32"], ["bfloat16-stochastic"])]) == 4
    assert main(["drift", spec, "--variants", "float8"]) == 2 and "unknown precision variant 'float8'" in capsys.readouterr().err
    assert main(["drift", spec, "--steps", "0"]) == 2


@pytest.mark.parametrize("decode,verify", [
    pytest.param(KernelConfig(block_v=16, num_warps=2, precompute_scores=True, fused_flush=False), KernelConfig(block_v=16, num_warps=2), id="flush-launch-multi-warp"),
    pytest.param(KernelConfig(block_v=8, precompute_scores=True, overlap_scores=True, align_flushes=True, flush_groups=2), KernelConfig(block_v=8, precompute_scores=True, window_block_v=8), id="aligned-split-verify"),
])
def test_stochastic_state_through_every_flush_path(decode, verify):
    """The flush launch, flush-every-step decode (leftover entries folded, then the step stored: two stores of one
    program), several warps per program, aligned flushes and the split verify, on a stochastically rounded state."""
    spec = spec_named("mamba2")
    shape = replace(SHAPE, value_dim=16, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, decode),), KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)})
    for flush_at in (None, 1, 3):
        assert_passes(check_decode(module, spec, shape, device=DEVICE, act_dtype=torch.bfloat16, flush_at=flush_at, cycles=2, seed=13))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, act_dtype=torch.bfloat16, steps=8, mixed=True, seed=14))
