"""Replay decode and replay verify over key tiles (block_k) against the float64 reference, step by step: both routes,
the fold product in each operand precision, precomputed scores with aligned flushes, the separate flush launch,
several warps, odd sizes, a 16-bit state rounded stochastically, flush thresholds from the call; the verify's window
readouts per token or by one product, through random acceptance and every-draft-accepted flush cycles, with decode
steps between windows; what they refuse."""

from dataclasses import replace

import pytest
import torch

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, key_tiled_state_route, replay_decode_structures, replay_verify_structures, spec_traits
from replaygen.errors import UnsupportedShapeError
from replaygen.harness import check_decode, check_speculative, check_speculative_through_flushes
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import DType, Rounding, TargetShape
from replaygen.tune.space import derive_space

from conftest import DEVICE, ROOT

# key_dim 32 in two tiles of 16; value_dim 16 in one block of 16 rows (the fold product's smallest side)
SHAPE = TargetShape("tiles", heads=4, key_heads=2, value_dim=16, key_dim=32, capacity=4, window=1)
# key_dim 20 in two tiles of 16 (the second masked past 20), value_dim 12 in a block of 16 rows
ODD = TargetShape("tiles-odd", heads=6, key_heads=3, value_dim=12, key_dim=20, capacity=5, window=2)

STATE_FOLD = KernelConfig(block_v=16, block_k=16, num_warps=1, num_stages=2, route=Route.STATE_AND_OUTPUT, fold_dot=True)
OUTPUT_ONLY = KernelConfig(block_v=16, block_k=16, num_warps=1, num_stages=2)
CONFIGS = [
    pytest.param(OUTPUT_ONLY, torch.float32, id="output-only"),
    pytest.param(replace(OUTPUT_ONLY, precompute_scores=True, overlap_scores=True, align_flushes=True, flush_groups=2), torch.float32, id="scores-aligned"),
    pytest.param(replace(OUTPUT_ONLY, fused_flush=False, num_stages=1), torch.float32, id="flush-launch"),
    pytest.param(replace(OUTPUT_ONLY, num_warps=2), torch.float32, id="two-warps"),
    pytest.param(replace(STATE_FOLD, fold_dot=False), torch.float32, id="state-loop-fold"),
    pytest.param(STATE_FOLD, torch.float32, id="state-tf32x3-fold"),
    pytest.param(replace(STATE_FOLD, fold_precision="key_buffer"), torch.float32, id="state-key-buffer-fold-fp32-buffers"),
    pytest.param(replace(STATE_FOLD, fold_precision="key_buffer"), torch.float16, id="state-key-buffer-fold-fp16"),
]


@pytest.fixture(scope="module", params=["mamba2", "gdn"])
def spec(request):
    return load_spec(ROOT / "specs" / f"{request.param}.yaml")


def tiled(spec, shape, config):
    return load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),)})


def verify_tiled(spec, shape, config):
    return load_kernels(spec, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, config),)})


def assert_passes(report, kernel="replay_decode"):
    assert report.ok, "\n".join(report.lines())
    assert {kernel, "materialize"} <= set(report.worst)


@pytest.mark.parametrize("config, act", CONFIGS)
def test_key_tiles_match_the_reference(spec, config, act):
    """Every step's output, the materialized states and the load path, over two flush cycles with rows joining
    late, a padding row and poisoned unused slots (check_decode)."""
    assert_passes(check_decode(tiled(spec, SHAPE, config), spec, SHAPE, device=DEVICE, act_dtype=act, use_gate=False, cycles=2, seed=21))


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_key_tiles_at_odd_sizes(spec, route):
    config = replace(STATE_FOLD, route=Route(route), fold_dot=route == "state_and_output")
    assert_passes(check_decode(tiled(spec, ODD, config), spec, ODD, device=DEVICE, route=route, batch=3, cycles=1, seed=22))


@pytest.mark.parametrize("flush_at", [1, 3])
def test_key_tiles_take_the_calls_flush_threshold(spec, flush_at):
    """A call's flush_at below the config's: 1 flushes on every step through the fused flush (the key-tiled kernel
    has no flush-every-step path of its own), 3 every third step."""
    assert_passes(check_decode(tiled(spec, SHAPE, OUTPUT_ONLY), spec, SHAPE, device=DEVICE, flush_at=flush_at, cycles=2, seed=23))


def test_key_tiles_with_a_stochastically_rounded_bf16_state(spec):
    shape = replace(SHAPE, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    assert_passes(check_decode(tiled(spec, shape, STATE_FOLD), spec, shape, device=DEVICE, act_dtype=torch.bfloat16, use_gate=False, cycles=2, seed=24))


def test_key_tiles_refused_where_they_cannot_run(spec):
    with pytest.raises(UnsupportedShapeError, match="block_k=24 must be 0 .* or a power of two from 16 below key_dim=32"):
        tiled(spec, SHAPE, replace(OUTPUT_ONLY, block_k=24))
    with pytest.raises(UnsupportedShapeError, match="block_k=32 must be 0"):
        tiled(spec, SHAPE, replace(OUTPUT_ONLY, block_k=32))  # the whole key axis: block_k=0
    with pytest.raises(UnsupportedShapeError, match="flush_at=1 runs the baseline's step"):
        tiled(spec, SHAPE, replace(OUTPUT_ONLY, flush_at=1))
    with pytest.raises(UnsupportedShapeError, match="fold_precision=tf32 .* needs fold_dot"):
        tiled(spec, SHAPE, replace(OUTPUT_ONLY, fold_precision="tf32"))
    with pytest.raises(UnsupportedShapeError, match="fold_precision='fp8' must be one of tf32x3, tf32, key_buffer"):
        tiled(spec, SHAPE, replace(STATE_FOLD, fold_precision="fp8"))
    with pytest.raises(UnsupportedShapeError, match="block_k applies to replay_decode and replay_verify only"):
        load_kernels(spec, SHAPE, {KernelKind.BASELINE_DECODE: (BucketConfig(None, KernelConfig(block_v=16, block_k=16)),)})
    with pytest.raises(UnsupportedShapeError, match="key-tiled output-only verify reads the entries' scores precomputed or by the readout products"):
        verify_tiled(spec, SHAPE, KernelConfig(block_v=16, block_k=16))
    with pytest.raises(UnsupportedShapeError, match="window_block_v .* runs the whole key axis"):
        verify_tiled(spec, SHAPE, replace(VERIFY_OUTPUT_ONLY, window_block_v=16))
    with pytest.raises(UnsupportedShapeError, match="a separate flush launch .fused_flush off. runs the output-only route"):
        verify_tiled(spec, SHAPE, replace(VERIFY_STATE, fused_flush=False))
    with pytest.raises(UnsupportedShapeError, match="a separate flush launch .fused_flush off. runs the key-tiled verify: it needs block_k"):
        verify_tiled(spec, SHAPE, replace(VERIFY_OUTPUT_ONLY, block_k=0, fused_flush=False))


def test_key_tiles_need_what_a_slice_can_hold():
    """Keys per head, a carried entry and angle, rms-normed keys with a weight and bias (Mamba-3) are not a raw slice
    times one factor: refused by the plan, left out of the search space and of the structures a search starts from
    (a decay per key channel runs the decode's state route alone: tests/test_kda.py)."""
    spec = load_spec(ROOT / "specs" / "mamba3.yaml")
    shape = replace(spec.shapes[0], heads=4, key_heads=2, value_dim=16, key_dim=32, capacity=4, window=1)
    traits = spec_traits(spec, shape)
    assert not traits.key_tiles
    with pytest.raises(UnsupportedShapeError, match="block_k slices the state and the key along the key axis"):
        tiled(spec, shape, OUTPUT_ONLY)
    assert key_tiled_state_route(shape, traits) is None
    assert all(not c.block_k for c in replay_decode_structures(shape, traits))
    assert replay_verify_structures(shape, traits) == ()
    for kind in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY):
        assert derive_space(kind, shape, 32, traits).parameter("block_k").choices == (0,)


def test_the_default_above_batch_8_is_the_key_tiled_state_route_for_the_delta_rule(spec):
    """The delta rule folds in the 16-bit buffers' dtype (its state is no more exact than its cached corrected
    values); the additive rule keeps the whole-key output-only step (its fold must stay float32-exact)."""
    from replaygen.configs import default_configs

    delta = spec.update.kind.value == "delta"
    large = default_configs(KernelKind.REPLAY_DECODE, spec.shapes[0], spec_traits(spec, spec.shapes[0]))[-1].config
    if delta:
        assert (large.block_k, large.route, large.fold_dot, large.fold_precision) == (64, Route.STATE_AND_OUTPUT, True, "key_buffer")
    else:
        assert large.block_k == 0 and large.route is Route.OUTPUT_ONLY and large.precompute_scores
    assert key_tiled_state_route(replace(SHAPE, key_dim=16)) is None  # slices of at least 16 need a key axis of 32


# verify: capacity 8 and windows of 2, so a flush comes every few windows
VERIFY_SHAPE = replace(SHAPE, capacity=8, window=2)
VERIFY_OUTPUT_ONLY = KernelConfig(block_v=16, block_k=16, num_warps=1, num_stages=2, precompute_scores=True, overlap_scores=True)
VERIFY_STATE = KernelConfig(block_v=16, block_k=16, num_warps=1, num_stages=3, route=Route.STATE_AND_OUTPUT, fold_dot=True)
VERIFY_CONFIGS = [
    pytest.param(VERIFY_OUTPUT_ONLY, id="output-only"),
    pytest.param(replace(VERIFY_OUTPUT_ONLY, readout_dot=True, num_warps=2), id="output-only-readout-product-two-warps"),
    pytest.param(replace(VERIFY_OUTPUT_ONLY, flush_at=1, fold_dot=True), id="output-only-fold-every-window"),
    pytest.param(replace(VERIFY_OUTPUT_ONLY, precompute_scores=False, overlap_scores=False, readout_dot=True, fold_dot=True), id="output-only-entries-scored-in-the-key-loop"),
    pytest.param(replace(VERIFY_OUTPUT_ONLY, readout_dot=True, fused_flush=False, num_warps=2), id="output-only-flush-launch-two-warps"),
    pytest.param(replace(VERIFY_STATE, readout_dot=True), id="state-tf32x3-fold-readout-product"),
    pytest.param(replace(VERIFY_STATE, fold_dot=False, precompute_scores=True, readout_dot=True), id="state-loop-fold-scores-readout-product"),
]


@pytest.mark.parametrize("config", VERIFY_CONFIGS)
def test_key_tiled_verify_matches_the_reference(spec, config):
    """Every window's outputs, the committed states and the baseline beside them: random acceptance, then every draft
    accepted until each row has flushed twice and wrapped its ring."""
    for report in check_speculative_through_flushes(verify_tiled(spec, VERIFY_SHAPE, config), spec, VERIFY_SHAPE, random_steps=6, device=DEVICE, seed=31):
        assert_passes(report, "replay_verify")


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_key_tiled_verify_at_odd_sizes_between_decode_steps(spec, route):
    """key_dim 20 (the second slice masked), 12 value rows, a window of 2 in a capacity of 5, every third step a
    key-tiled decode on the same state."""
    config = VERIFY_STATE if route == "state_and_output" else VERIFY_OUTPUT_ONLY
    module = load_kernels(spec, ODD, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, config),), KernelKind.REPLAY_DECODE: (BucketConfig(None, STATE_FOLD),)})
    assert_passes(check_speculative(module, spec, ODD, device=DEVICE, mixed=True, steps=9, seed=32), "replay_verify")


@pytest.mark.parametrize("config", [
    pytest.param(replace(VERIFY_STATE, readout_dot=True, readout_precision="key_buffer"), id="key-tiled-state-route"),
    pytest.param(KernelConfig(block_v=16, num_warps=1, precompute_scores=True, readout_dot=True, readout_precision="key_buffer"), id="whole-key-output-only"),
    pytest.param(replace(VERIFY_OUTPUT_ONLY, precompute_scores=False, overlap_scores=False, readout_dot=True, readout_precision="key_buffer"), id="key-tiled-output-only-entries-scored-in-the-key-loop"),
])
@pytest.mark.parametrize("act_dtype", [torch.float16, torch.float32], ids=["fp16-buffers", "fp32-buffers"])
def test_verify_readouts_in_the_buffers_dtype(spec, config, act_dtype):
    """readout_precision key_buffer: the readout products' operands rounded to 16-bit buffers' dtype (tf32x3 on float32
    buffers); the outputs stay within the activation dtype's tolerance and the committed state is untouched by it.
    (bf16 is left to the GPU: the interpreter's tl.dot on bf16 operands is wrong.)"""
    for report in check_speculative_through_flushes(verify_tiled(spec, VERIFY_SHAPE, config), spec, VERIFY_SHAPE, random_steps=4, device=DEVICE, act_dtype=act_dtype, seed=34):
        assert_passes(report, "replay_verify")


def test_key_tiled_verify_with_a_stochastically_rounded_bf16_state(spec):
    shape = replace(VERIFY_SHAPE, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    for report in check_speculative_through_flushes(verify_tiled(spec, shape, VERIFY_STATE), spec, shape, random_steps=4, device=DEVICE, act_dtype=torch.bfloat16, use_gate=False, seed=33):
        assert_passes(report, "replay_verify")


def test_verify_searches_start_from_the_key_tiled_structures(spec):
    """The structures are valid points of the verify space at the shipped shapes, never pruned."""
    shape = spec.shapes[0]
    traits = spec_traits(spec, shape)
    structures = replay_verify_structures(shape, traits)
    assert [(c.route, c.block_k, c.precompute_scores, c.readout_dot) for c in structures] == [
        (Route.STATE_AND_OUTPUT, 64, False, False), (Route.STATE_AND_OUTPUT, 64, False, True), (Route.OUTPUT_ONLY, 64, True, False),
        (Route.OUTPUT_ONLY, 64, False, True), (Route.OUTPUT_ONLY, 64, False, True),
    ]
    assert structures[1].readout_precision == structures[3].readout_precision == structures[4].readout_precision == "key_buffer"
    assert [c.fused_flush for c in structures] == [True, True, True, True, False]
    space = derive_space(KernelKind.REPLAY_VERIFY, shape, 256, traits)
    assert all(space.contains(c) and space.prune_reason(c) is None for c in structures)
