"""Gated DeltaNet through the same machinery: delta rule, l2norm/scale, gates from pre-activations or direct."""

import shutil
from dataclasses import replace

import pytest
import torch
import triton

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, SpecTraits, bucket_config, module_defaults
from replaygen.harness import check_decode, check_speculative
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import CacheField, UpdateKind
from replaygen.errors import SpecError, UnsupportedShapeError
from replaygen.tune.space import derive_space

from conftest import DEVICE, ODD, ROOT, SMALL

GDN_TEXT = (ROOT / "specs" / "gdn.yaml").read_text()
SHAPE = replace(SMALL, capacity=8, window=2)


def gdn(layout="value_key"):
    return load_spec_text(GDN_TEXT.replace("layout: value_key", f"layout: {layout}"), f"gdn_{layout}.yaml")


@pytest.fixture(scope="module", params=["value_key", "key_value"])
def layout_kernels(request):
    """The spec in either state layout, its module and the test shape stored in that layout."""
    spec = gdn(request.param)
    shape = replace(SHAPE, layout=spec.state.layout)
    return spec, load_kernels(spec, shape), shape


def assert_passes(report):
    assert report.ok, "\n".join(report.lines())


def test_shipped_spec():
    spec = load_spec(ROOT / "specs" / "gdn.yaml")
    assert spec.update.kind is UpdateKind.DELTA
    assert spec.cached(CacheField.CORRECTED_VALUE) is not None and spec.cached(CacheField.VALUE) is None
    main = spec.shape("qwen3.5")
    assert (main.key_heads, main.heads, main.key_dim, main.value_dim) == (16, 32, 128, 128)
    assert [s.heads for s in spec.shapes[:4]] == [32, 16, 8, 4]


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_decode_both_routes_both_layouts(layout_kernels, route):
    spec, module, shape = layout_kernels
    assert_passes(check_decode(module, spec, shape, device=DEVICE, route=route, cycles=3, seed=1))


@pytest.mark.parametrize("config", [
    pytest.param(KernelConfig(block_v=16, precompute_scores=True, fused_flush=False), id="scores-flush-launch"),
    pytest.param(KernelConfig(block_v=16, precompute_scores=True, fold_dot=True), id="scores-dot-fold"),
])
def test_decode_options(config):
    """Precomputed (k_j . k, k_j . q) scores, the separate flush launch and the tensor-core fold on the delta rule."""
    spec = gdn("key_value")
    shape = replace(SHAPE, value_dim=16, layout=spec.state.layout)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),)})
    for flush_at in (None, 3):
        assert_passes(check_decode(module, spec, shape, device=DEVICE, flush_at=flush_at, cycles=2, seed=9))


def test_direct_gates(layout_kernels):
    spec, module, shape = layout_kernels
    assert_passes(check_decode(module, spec, shape, device=DEVICE, use_direct=True, cycles=2, seed=2))


def test_verify_random_acceptance(layout_kernels):
    spec, module, shape = layout_kernels
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, steps=10, seed=3))


@pytest.mark.parametrize("layout,readout_dot,route", [
    ("value_key", False, "output_only"), ("key_value", False, "output_only"), ("value_key", True, "output_only"),
    ("key_value", True, "output_only"), ("key_value", False, "state_and_output"),
])
def test_verify_precomputed_scores(layout, readout_dot, route):
    """Ring and window scores (k_j . q, k_j . k, both against ring and window keys) from `_scores_kernel`; with
    readout_dot the state and ring are read at every token's q and k by tensor-core products; the state-and-output
    route folds the buffer on every verify."""
    spec = gdn(layout)
    shape = replace(SMALL, capacity=9, window=4, layout=spec.state.layout)
    config = KernelConfig(block_v=16 if readout_dot else 8, num_warps=1, precompute_scores=True, route=Route(route))
    verify = (BucketConfig(None, replace(config, readout_dot=readout_dot)),)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_VERIFY: verify, KernelKind.REPLAY_DECODE: (BucketConfig(None, config),)})
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, mixed=True, steps=12, seed=11))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=3, accept="all", steps=8, seed=12))


@pytest.mark.parametrize("block_v,fold_dot,prefetch", [(8, False, True), (16, True, False)])
def test_split_verify(block_v, fold_dot, prefetch):
    """The split verify (window_block_v): the checkpoint half folds on a flush (by the entry loop or by the product)
    and writes the checkpoint read at every token's q and k; the window half (the whole head per program) adds the
    ring (every position prefetched, or only the live ones), solves for the corrections and appends them."""
    spec = gdn("key_value")
    shape = replace(ODD, capacity=9, window=4, layout=spec.state.layout)
    verify = KernelConfig(block_v=block_v, num_warps=1, precompute_scores=True, fold_dot=fold_dot, prefetch_ring=prefetch, window_block_v=16)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)})
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, mixed=True, steps=12, seed=13))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=3, accept="all", steps=8, seed=14))


def test_verify_all_accepted_and_mixed():
    spec = gdn()
    module = load_kernels(spec, SHAPE)
    assert_passes(check_speculative(module, spec, SHAPE, device=DEVICE, accept="all", steps=8, seed=4))
    assert_passes(check_speculative(module, spec, SHAPE, device=DEVICE, mixed=True, steps=20, seed=3))


@pytest.mark.parametrize("tokens", [1, 4])
def test_verify_windows(tokens):
    spec = gdn()
    shape = replace(SMALL, capacity=8, window=4)
    module = load_kernels(spec, shape)
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=tokens, steps=8, seed=5 + tokens))


def test_odd_sizes_bf16():
    spec = gdn()
    module = load_kernels(spec, ODD)
    assert_passes(check_decode(module, spec, ODD, device=DEVICE, act_dtype=torch.bfloat16, batch=4, seed=6))
    assert_passes(check_speculative(module, spec, ODD, device=DEVICE, act_dtype=torch.bfloat16, batch=4, steps=6, seed=7))


CORRECTION = "    b_u = b_w * (b_v - tl.sum(b_s * b_k[None, :], 1))"
# The correction read from S_{t-1} = e^{-g_t} (e^{g_t} S_{t-1}): the current step's decay dropped.
CORRECTION_WITHOUT_DECAY = "    b_u = b_w * (b_v - tl.sum(b_s * tl.exp(-b_lg) * b_k[None, :], 1))"


def test_catches_the_correction_without_the_current_decay(tmp_path, monkeypatch):
    """The classic bug: correcting against S_{t-1} instead of the decayed e^{g_t} S_{t-1}. Kernels rendered
    with that bug must fail the reference checks (the correct ones pass above)."""
    mutated = tmp_path / "templates"
    shutil.copytree(ROOT / "replaygen" / "templates", mutated)
    macros = (mutated / "macros.j2").read_text()
    assert macros.count(CORRECTION) == 1
    (mutated / "macros.j2").write_text(macros.replace(CORRECTION, CORRECTION_WITHOUT_DECAY))
    monkeypatch.setenv("REPLAYGEN_TEMPLATES", str(mutated))
    spec = gdn()
    module = load_kernels(spec, SHAPE)
    report = check_decode(module, spec, SHAPE, device=DEVICE, route="state_and_output", cycles=1, seed=8)
    assert not report.ok
    assert report.worst["baseline_decode"][0] > 1e-3 and report.worst["replay_decode"][0] > 1e-3


def test_delta_rule_needs_the_corrected_value_cached():
    text = GDN_TEXT.replace("    corrected_value: activation", "    value: activation")
    with pytest.raises(SpecError, match="not replayed by the delta update"):
        load_spec_text(text, "bad.yaml")


def test_weight_input_required_for_sigmoid():
    text = GDN_TEXT.replace("  weight_input: b          # [batch, HV] pre-activation of beta\n", "")
    with pytest.raises(SpecError, match="needs 'weight_input'"):
        load_spec_text(text, "bad.yaml")


def test_exactly_one_of_preactivation_and_direct_gate():
    spec = gdn()
    module = load_kernels(spec, SHAPE)
    state = module.allocate(1, DEVICE, torch.float32)
    h, g, v, k = SHAPE.heads, SHAPE.key_heads, SHAPE.value_dim, SHAPE.key_dim
    args = dict(v=torch.randn(1, h, v), k=torch.randn(1, g, k), q=torch.randn(1, g, k), b=torch.randn(1, h), A_log=torch.zeros(h), dt_bias=torch.zeros(h),
                a=torch.randn(1, h), g=-torch.rand(1, h))
    args = {name: t.to(DEVICE) for name, t in args.items()}
    with pytest.raises(ValueError, match="pass exactly one of a .pre-activation. and g"):
        module.decode(state, torch.zeros(1, dtype=torch.int32, device=DEVICE), **args)


def test_per_channel_decay_kda_style():
    """Gated DeltaNet with the decay per key channel (KDA): ring tiles with per-channel prefix sums, the loop and the
    tensor-core fold, verify on both routes; precomputed scores are refused (the decay weighs each key channel)."""
    spec = load_spec_text(GDN_TEXT.replace("granularity: head", "granularity: channel"), "kda.yaml")
    shape = replace(SHAPE, value_dim=16)
    configs = (
        KernelConfig(block_v=8, fold_chunk=2),
        KernelConfig(block_v=16, fold_dot=True, fused_flush=False, prefetch_ring=False),
        KernelConfig(block_v=8, route=Route.STATE_AND_OUTPUT),
    )
    for config in configs:
        verify = replace(config, fused_flush=True)  # the separate flush launch is decode's
        module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),), KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)})
        assert_passes(check_decode(module, spec, shape, device=DEVICE, cycles=2, seed=12))
        assert_passes(check_speculative(module, spec, shape, device=DEVICE, steps=6, seed=13))
    with pytest.raises(UnsupportedShapeError, match="per-head decay"):
        load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, KernelConfig(block_v=8, precompute_scores=True)),)})


def test_default_configs_precompute_scores_only_for_a_per_head_decay():
    per_head = module_defaults(load_spec_text(GDN_TEXT, "gdn.yaml"), SHAPE)
    per_channel = module_defaults(load_spec_text(GDN_TEXT.replace("granularity: head", "granularity: channel"), "kda.yaml"), SHAPE)
    for kind in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY):
        assert per_head[kind][-1].config.precompute_scores and per_head[kind][-1].config.overlap_scores
        assert not any(b.config.precompute_scores or b.config.overlap_scores for b in per_channel[kind])
    assert per_head[KernelKind.REPLAY_VERIFY][0].config.route is Route.STATE_AND_OUTPUT  # batch 1: no scores launch


def test_default_verify_above_batch_8_splits_for_the_delta_rule_and_caps_registers_otherwise():
    """From batch 9 the default verify folds two entries at a time; the delta rule's runs split (window half over
    64 value rows or the whole head, one warp, the ring read where live), the additive update's keeps one launch with
    a 128-register cap where key_dim <= 128; a per-channel decay where key tiles cannot run, with no scores kernel,
    takes the batch-1 state route at every batch. Every default is a point of its search space, and the delta rule's
    runs against the reference."""
    mamba2 = load_spec(ROOT / "specs" / "mamba2.yaml")
    kda = load_spec_text(GDN_TEXT.replace("granularity: head", "granularity: channel"), "kda.yaml")
    wide = replace(SMALL, key_dim=192)
    cases = [(gdn(), SMALL), (gdn(), mamba2.shape("nemotron-h")), (mamba2, SMALL), (mamba2, wide), (kda, SMALL)]
    for spec, shape in cases:
        table = module_defaults(spec, shape)[KernelKind.REPLAY_VERIFY]
        small, large = bucket_config(table, 8), bucket_config(table, 9)
        delta = spec.update.kind is UpdateKind.DELTA
        if spec is kda:
            assert len(table) == 1 and large == small and large.route is Route.STATE_AND_OUTPUT and not large.window_block_v
            continue
        assert (large.fold_chunk, small.fold_chunk) == (2, 4)
        assert large.window_block_v == (min(64, max(16, triton.next_power_of_2(shape.value_dim))) if delta else 0)
        assert large.prefetch_ring is not delta
        assert large.max_registers == (128 if not delta and shape.key_dim <= 128 else 0)
        for batch in (8, 9):
            space = derive_space(KernelKind.REPLAY_VERIFY, shape, batch, SpecTraits(delta_rule=delta))
            assert space.default == bucket_config(table, batch) and space.contains(space.default)
    spec, shape = gdn(), replace(SMALL, capacity=6, window=3)
    verify = bucket_config(module_defaults(spec, shape)[KernelKind.REPLAY_VERIFY], 9)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)})
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, steps=5, seed=21))
