"""Kimi Delta Attention from its spec alone: every kernel against the float64 reference (both state layouts, odd
sizes, the gate given directly or bounded), and against FLA's naive recurrence written here on its own terms."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route
from replaygen.harness import check_decode, check_speculative, check_speculative_through_flushes
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import DecayForm, DecayGranularity, StateLayout, UpdateKind
from replaygen.traffic import speedup_bound

from conftest import DEVICE, ODD, ROOT, SMALL

KDA_TEXT = (ROOT / "specs" / "kda.yaml").read_text()
KDA = load_spec(ROOT / "specs" / "kda.yaml")
SHAPE = replace(SMALL, heads=4, key_heads=4, capacity=8, window=2)  # no key sharing, as Kimi Linear


def assert_passes(report):
    assert report.ok, "\n".join(report.lines())


def test_shipped_spec():
    assert KDA.decay.granularity is DecayGranularity.CHANNEL and KDA.update.kind is UpdateKind.DELTA
    main = KDA.shape("kimi-linear")
    assert (main.heads, main.key_heads, main.value_dim, main.key_dim) == (32, 32, 128, 128)
    assert main.layout is StateLayout.VALUE_KEY and KDA.shape("kimi-linear-fla").layout is StateLayout.KEY_VALUE
    assert 1.6 < speedup_bound(KDA, main, KDA.activations[0]) < 1.7  # the per-channel log decay costs ring bytes


def test_the_default_above_batch_8_is_the_baseline_step():
    """A decay per key channel made both whole-key buffering routes slower than reading and writing the state every
    step at Kimi Linear's sizes (H100, perf.md 74): above batch 8 the default flushes every step; a search starts
    from the key-tiled and the whole-key state routes."""
    from replaygen.configs import default_configs, replay_decode_structures, spec_traits

    main = KDA.shape("kimi-linear")
    traits = spec_traits(KDA, main)
    small, large = default_configs(KernelKind.REPLAY_DECODE, main, traits)
    assert small.config.flush_at == 0 and large.config.flush_at == 1 and large.config.block_k == 0
    structures = replay_decode_structures(main, traits)
    assert [(c.route, c.block_k) for c in structures] == [(Route.STATE_AND_OUTPUT, 64), (Route.STATE_AND_OUTPUT, 0)]
    assert all(c.flush_at != 1 for c in structures)


def test_the_verify_default_above_batch_1_is_the_key_tiled_state_route():
    """The whole-key verify reads every entry through every key channel per program: 11.7-15.6x the key-tiled state
    route with readouts by product on the H100 (perf.md 78). Above batch 1 the default is that route; a shape whose key
    tiles cannot run keeps the whole-key default."""
    from replaygen.configs import default_configs, spec_traits

    main = KDA.shape("kimi-linear-mtp")
    single, large = default_configs(KernelKind.REPLAY_VERIFY, main, spec_traits(KDA, main))
    assert single.max_batch == 1 and single.config.block_k == 0
    assert large.max_batch is None and large.config.block_k == 64 and large.config.route is Route.STATE_AND_OUTPUT
    assert large.config.readout_dot and large.config.readout_precision == "key_buffer"
    narrow = replace(main, key_dim=16)
    assert all(b.config.block_k == 0 for b in default_configs(KernelKind.REPLAY_VERIFY, narrow, spec_traits(KDA, narrow)))
    additive = replace(spec_traits(KDA, main), delta_rule=False)
    large = default_configs(KernelKind.REPLAY_VERIFY, main, additive)[-1].config
    assert large.block_k == 64 and not large.readout_dot and large.fold_precision == "tf32x3"


TILED = replace(SHAPE, key_dim=32, value_dim=16)  # two key slices of 16, one block of 16 value rows
STATE_TILES = KernelConfig(block_v=16, block_k=16, num_warps=1, num_stages=2, route=Route.STATE_AND_OUTPUT, fold_dot=True)


def decode_tiled(shape, config):
    return load_kernels(KDA, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),)})


@pytest.mark.parametrize(
    "config, act, direct",
    [
        pytest.param(STATE_TILES, torch.float32, False, id="tf32x3-fold"),
        pytest.param(replace(STATE_TILES, fold_precision="key_buffer"), torch.float16, False, id="key-buffer-fold-fp16"),
        pytest.param(replace(STATE_TILES, fold_dot=False, num_stages=1), torch.float32, True, id="loop-fold-gate-given"),
    ],
)
def test_key_tiled_state_route(config, act, direct):
    """Replay decode over key slices: each slice of the state formed from the checkpoint slice and the entries' keys
    weighed by their own decays of the slice's channels, this step's decay of the slice on the readouts and the
    flush; two flush cycles, rows joining late, a padding row, poisoned unused slots."""
    assert_passes(check_decode(decode_tiled(TILED, config), KDA, TILED, device=DEVICE, act_dtype=act, use_direct=direct, cycles=2, seed=31))


def test_key_tiled_state_route_at_odd_sizes_and_the_calls_flush_threshold():
    """key_dim 20 in two slices of 16 (the second masked), 12 value rows in a block of 16, FLA's [K, V] layout; then
    a call's flush_at of 3 below the config's 7."""
    shape = replace(ODD, heads=3, key_heads=3, capacity=7, window=3, layout=StateLayout.KEY_VALUE)
    module = decode_tiled(shape, STATE_TILES)
    assert_passes(check_decode(module, KDA, shape, device=DEVICE, batch=3, cycles=2, seed=32))
    assert_passes(check_decode(module, KDA, shape, device=DEVICE, batch=3, flush_at=3, cycles=2, seed=33))


VERIFY_TILED = replace(TILED, capacity=8, window=2)


@pytest.mark.parametrize(
    "config, act",
    [
        pytest.param(STATE_TILES, torch.float32, id="tf32x3-fold"),
        pytest.param(replace(STATE_TILES, readout_dot=True), torch.float32, id="readout-product"),
        pytest.param(replace(STATE_TILES, readout_dot=True, readout_precision="key_buffer", fold_precision="key_buffer"), torch.float16, id="key-buffer-products-fp16"),
        pytest.param(replace(STATE_TILES, fold_dot=False, num_stages=1, flush_at=1), torch.float32, id="loop-fold-every-window"),
    ],
)
def test_key_tiled_verify_state_route(config, act):
    """Replay verify over key slices: each slice of the state formed from the checkpoint slice and the committed
    entries' keys weighed by their own decays of its channels, each window token's readouts of the slice weighed by
    the window's decays of its channels up to that token; random acceptance, then every draft accepted through two
    flushes and a wrapped ring."""
    module = load_kernels(KDA, VERIFY_TILED, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, config),)})
    for report in check_speculative_through_flushes(module, KDA, VERIFY_TILED, random_steps=6, device=DEVICE, act_dtype=act, seed=35):
        assert_passes(report)


def test_key_tiled_verify_at_odd_sizes_between_decode_steps():
    """key_dim 20 in two slices of 16, 12 value rows, FLA's [K, V] layout, T=3; decode steps (key-tiled too) between
    the windows."""
    shape = replace(ODD, heads=3, key_heads=3, capacity=9, window=3, layout=StateLayout.KEY_VALUE)
    module = load_kernels(KDA, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, STATE_TILES),), KernelKind.REPLAY_DECODE: (BucketConfig(None, STATE_TILES),)})
    assert_passes(check_speculative(module, KDA, shape, device=DEVICE, mixed=True, steps=9, seed=36))


def test_key_tiles_run_the_state_routes_only():
    """The output-only routes read the entries through their scores, which for a decay per key channel are sums over
    the whole key axis: key tiles there are refused by the plan, pruned from the search space and left out of the
    structures."""
    from replaygen.configs import key_tiled_state_route, replay_verify_structures, spec_traits
    from replaygen.errors import UnsupportedShapeError
    from replaygen.tune.space import PruneRule, derive_space

    with pytest.raises(UnsupportedShapeError, match="block_k with a decay per key channel runs the state_and_output route only"):
        decode_tiled(TILED, replace(STATE_TILES, route=Route.OUTPUT_ONLY, fold_dot=False))
    with pytest.raises(UnsupportedShapeError, match="replay_verify: the key-tiled output-only verify reads the entries' scores precomputed"):
        load_kernels(KDA, TILED, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, replace(STATE_TILES, route=Route.OUTPUT_ONLY)),)})
    traits = spec_traits(KDA, TILED)
    assert traits.key_tiles and not traits.output_only_key_tiles
    tiled = key_tiled_state_route(TILED, traits)
    assert tiled.block_k == 16 and {c.route for c in replay_verify_structures(TILED, traits)} == {Route.STATE_AND_OUTPUT}
    decode = derive_space(KernelKind.REPLAY_DECODE, TILED, 32, traits)
    assert decode.parameter("block_k").choices == (0, 16)
    assert decode.prune_reason(replace(STATE_TILES, route=Route.OUTPUT_ONLY, fold_dot=False, flush_at=8)) is PruneRule.CHANNEL_KEY_TILES
    assert decode.prune_reason(replace(STATE_TILES, flush_at=8)) is None
    verify = derive_space(KernelKind.REPLAY_VERIFY, TILED, 32, traits)
    assert verify.parameter("block_k").choices == (0, 16) and verify.parameter("readout_dot").choices == (False, True)
    assert verify.prune_reason(replace(STATE_TILES, route=Route.OUTPUT_ONLY, fold_dot=False)) is PruneRule.INVALID

    module = decode_tiled(TILED, STATE_TILES)
    state = module.allocate(2, DEVICE, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    heads, key_dim, value_dim = TILED.heads, TILED.key_dim, TILED.value_dim
    inputs = {name: torch.randn(2, heads, dim, device=DEVICE) for name, dim in (("v", value_dim), ("k", key_dim), ("q", key_dim), ("a", key_dim))}
    weights = {"A_log": torch.zeros(heads, device=DEVICE), "dt_bias": torch.zeros(heads, key_dim, device=DEVICE)}
    with pytest.raises(ValueError, match="route='output_only'.*key tiles .*state_and_output route alone"):
        module.decode(state, slots, **inputs, b=torch.randn(2, heads, device=DEVICE), **weights, route="output_only")


@pytest.fixture(scope="module", params=[StateLayout.VALUE_KEY, StateLayout.KEY_VALUE], ids=lambda layout: layout.value)
def kernels(request):
    shape = replace(SHAPE, layout=request.param)
    return shape, load_kernels(KDA, shape)


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_decode_against_the_reference(kernels, route):
    shape, module = kernels
    assert_passes(check_decode(module, KDA, shape, device=DEVICE, route=route, cycles=2, seed=1))


def test_decode_with_the_gate_given_directly(kernels):
    shape, module = kernels
    assert_passes(check_decode(module, KDA, shape, device=DEVICE, use_direct=True, cycles=2, seed=2))


def test_verify_against_the_reference(kernels):
    shape, module = kernels
    assert_passes(check_speculative(module, KDA, shape, device=DEVICE, steps=8, seed=3))
    assert_passes(check_speculative(module, KDA, shape, device=DEVICE, accept="all", mixed=True, steps=9, seed=4))


def test_odd_sizes_and_the_tensor_core_fold():
    shape = replace(ODD, heads=3, key_heads=3, capacity=7, window=3, layout=StateLayout.KEY_VALUE)
    config = KernelConfig(block_v=16, fold_dot=True, prefetch_ring=False)
    tables = {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),), KernelKind.REPLAY_VERIFY: (BucketConfig(None, replace(config, route=Route.STATE_AND_OUTPUT)),)}
    module = load_kernels(KDA, replace(shape, value_dim=16), tables)
    assert_passes(check_decode(module, KDA, replace(shape, value_dim=16), device=DEVICE, cycles=2, seed=5))
    assert_passes(check_speculative(module, KDA, replace(shape, value_dim=16), device=DEVICE, mixed=True, steps=8, seed=6))


def test_the_bounded_gate():
    """FLA's lower-bound form, log a = bound * sigmoid(exp(A_log) * (a + dt_bias)), from the spec's words alone."""
    text = KDA_TEXT.replace("  form: neg_exp_softplus\n", "  form: lower_bound_sigmoid\n  bound: -5.0\n")
    spec = load_spec_text(text, "kda_bounded.yaml")
    assert spec.decay.form is DecayForm.LOWER_BOUND_SIGMOID and spec.decay.bound == -5.0
    module = load_kernels(spec, SHAPE)
    assert "DECAY_BOUND = tl.constexpr(-5.0)" in open(module.__file__).read()
    assert_passes(check_decode(module, spec, SHAPE, device=DEVICE, cycles=2, seed=7))
    assert_passes(check_speculative(module, spec, SHAPE, device=DEVICE, steps=6, seed=8))


# --- FLA's semantics, written here from its description, apart from replaygen's reference --------------------


def fla_kda_gate(a, A_log, dt_bias, lower_bound=None):
    """FLA's gate: [B, T, H, K] raw -> log decay; A_log [H], dt_bias [H * K]."""
    x = a + dt_bias.view(a.shape[-2], a.shape[-1])
    rate = A_log.exp().view(-1, 1)
    return -rate * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(rate * x)


def fla_naive_recurrent_kda(q, k, v, g, beta, scale, initial_state):
    """FLA's naive_recurrent_kda: time-major [B, T, H, K] inputs, state [B, H, K, V]; per token the state decays by
    exp(g) along K, then the delta correction against the decayed state, then o = (scale q)^T S."""
    S = initial_state.clone()
    q = q * scale
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        prediction = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - prediction)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), S


@pytest.mark.parametrize(
    "lower_bound, key_tiles",
    [(None, False), (-5.0, False), (None, True)],
    ids=["softplus gate", "bounded gate", "softplus gate, key-tiled decode and verify"],
)
@pytest.mark.parametrize("layout", [StateLayout.VALUE_KEY, StateLayout.KEY_VALUE], ids=lambda layout: layout.value)
def test_against_fla_naive_recurrence(layout, lower_bound, key_tiles):
    """Twenty tokens (two flushes of the L=8 buffer) through replay decode (the default kernels, or the key-tiled
    state route), and through verify windows of 2 with every draft accepted, against FLA's recurrence on the same raw
    inputs: outputs per token and the final state."""
    text = KDA_TEXT if lower_bound is None else KDA_TEXT.replace("  form: neg_exp_softplus\n", f"  form: lower_bound_sigmoid\n  bound: {lower_bound}\n")
    spec = load_spec_text(text, "kda.yaml")
    shape = replace(TILED if key_tiles else SHAPE, layout=layout)
    tiled = (BucketConfig(None, STATE_TILES),)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: tiled, KernelKind.REPLAY_VERIFY: tiled} if key_tiles else None)
    gen = torch.Generator().manual_seed(11)
    batch, tokens, heads, key_dim, value_dim = 2, 20, shape.heads, shape.key_dim, shape.value_dim
    q, k = (torch.randn(batch, tokens, heads, key_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, tokens, heads, value_dim, generator=gen, dtype=torch.float64)
    a = 0.5 * torch.randn(batch, tokens, heads, key_dim, generator=gen, dtype=torch.float64)
    b = torch.randn(batch, tokens, heads, generator=gen, dtype=torch.float64)
    A_log = torch.log(1 + 7 * torch.rand(heads, generator=gen, dtype=torch.float64))
    dt_bias = -1 - 3 * torch.rand(heads * key_dim, generator=gen, dtype=torch.float64)
    state0 = 0.5 * torch.randn(batch, heads, key_dim, value_dim, generator=gen, dtype=torch.float64)
    def l2norm(x):  # FLA's use_qk_l2norm_in_kernel
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    expected, final = fla_naive_recurrent_kda(l2norm(q), l2norm(k), v, fla_kda_gate(a, A_log, dt_bias, lower_bound), torch.sigmoid(b), key_dim**-0.5, state0)

    def ours(x):
        return x.to(DEVICE, torch.float32)

    stored = state0.transpose(-1, -2) if layout is StateLayout.VALUE_KEY else state0  # FLA holds [K, V]
    weights = {"A_log": ours(A_log), "dt_bias": ours(dt_bias.view(heads, key_dim))}
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    for windowed in (False, True):
        state = module.allocate(2, DEVICE, torch.float32)
        module.load(state, slots, ours(stored).contiguous())
        outputs = []
        for t in range(0, tokens, 2 if windowed else 1):
            step = slice(t, t + 2) if windowed else t
            inputs = {"v": ours(v[:, step]), "k": ours(k[:, step]), "q": ours(q[:, step]), "a": ours(a[:, step]), "b": ours(b[:, step])}
            if windowed:
                outputs.append(module.verify(state, slots, **inputs, **weights))
                module.commit(state, slots, torch.full((2,), 2, dtype=torch.int32, device=DEVICE))
            else:
                outputs.append(module.decode(state, slots, **inputs, **weights)[:, None])
        got = torch.cat(outputs, 1).double().cpu()
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4, "outputs"
        materialized = module.materialize(state, slots).double().cpu()
        materialized = materialized.transpose(-1, -2) if layout is StateLayout.VALUE_KEY else materialized
        assert (materialized - final).abs().max() / final.abs().max() < 1e-4, "final state"
