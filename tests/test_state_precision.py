"""16-bit states and float32 buffers, chosen per shape: every kernel kind against the float64 reference.

The interpreter's float32 -> bfloat16 convert truncates (the GPU's rounds to nearest), so round-to-nearest bfloat16
states are checked on the GPU; float16 converts round to nearest in both places.
"""

from dataclasses import replace

import pytest
import torch

from replaygen.harness import check_decode, check_speculative
from replaygen.plan import state_identity
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import CacheField, CachedField, DType
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
