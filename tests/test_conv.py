"""The spec's conv before the recurrence (`conv:`), generated: decode steps and verified windows against the
float64 conv, rollback by the commit's cursor move, padded rows and other slots untouched, load and materialize."""

import pytest
import torch

from replaygen.errors import SpecError
from replaygen.harness import check_conv
from replaygen.reference import conv_reference
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec_text

from conftest import DEVICE, ROOT

TINY = (ROOT / "examples" / "tiny.yaml").read_text()


def _module(conv: str):
    spec = load_spec_text(TINY + f"\nconv: {conv}\n")
    return spec, load_kernels(spec, spec.shapes[0])


@pytest.mark.parametrize(
    "conv, dtype",
    [
        ("{width: 4, activation: silu, channels: [value, key, query]}", torch.float32),
        ("{width: 3, channels: [query, value]}", torch.bfloat16),  # no activation, no bias, another packing
    ],
    ids=["mamba2-like", "partial-linear-bf16"],
)
def test_conv_steps_and_windows_match_the_float64_conv(conv, dtype):
    """Decode steps and windows (accepting 0..T of them per row) over several ring wraps: outputs and the committed
    inputs as the float64 conv gives them; a padded row and a slot outside the batch keep what they held."""
    spec, m = _module(conv)
    channels, width, window = m._CONV_CHANNELS, spec.conv.width, spec.shapes[0].window
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    weight = torch.randn(channels, width, generator=generator).to(DEVICE)
    bias = torch.randn(channels, generator=generator).to(DEVICE) if "silu" in conv else None
    state = m.allocate_conv(5, DEVICE, dtype)
    slots = torch.tensor([3, -1, 0, 4], dtype=torch.int32, device=DEVICE)
    live = [0, 2, 3]
    history = rand(4, channels, width - 1)
    m.load_conv(state, slots, history)
    m.load_conv(state, torch.tensor([1], dtype=torch.int32, device=DEVICE), rand(1, channels, width - 1))
    untouched = state.ring[1].clone()
    expected = history.double().cpu()
    tolerance = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for step in range(6):
        inputs = rand(4, channels)
        out = m.conv(state, slots, inputs, weight, bias)
        want, after = conv_reference(expected, inputs[:, None].cpu(), weight.cpu(), None if bias is None else bias.cpu(), spec.conv)
        torch.testing.assert_close(out[live].double().cpu(), want[live, 0], **tolerance)
        expected[live] = after[live]
        windows = rand(4, window, channels)
        out = m.conv(state, slots, windows, weight, bias)
        want, _ = conv_reference(expected, windows.cpu(), weight.cpu(), None if bias is None else bias.cpu(), spec.conv)
        torch.testing.assert_close(out[live].double().cpu(), want[live], **tolerance)
        accepted = torch.tensor([(step + r) % (window + 1) for r in range(4)], dtype=torch.int32, device=DEVICE)
        m.commit_conv(state, slots, accepted)
        for r in live:
            kept = int(accepted[r])
            expected[r] = torch.cat([expected[r], windows[r, :kept].double().cpu().T], dim=-1)[:, -(width - 1) :]
        torch.testing.assert_close(m.materialize_conv(state, slots)[live].double().cpu(), expected[live], atol=0, rtol=0)
    assert torch.equal(state.ring[1], untouched)
    assert torch.equal(m.materialize_conv(state, slots)[1], torch.zeros(channels, width - 1, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_conv_passes_rows_joining_late_padding_and_poisoned_slots(dtype):
    """`replaygen check`'s conv scenario: rows join at different steps, one sits steps out, unused slots poisoned."""
    spec, m = _module("{width: 4, activation: silu, channels: [value, key, query]}")
    report = check_conv(m, spec, spec.shapes[0], device=DEVICE, act_dtype=dtype, batch=3, steps=16)
    assert report.ok, "\n".join(report.lines())
    assert set(report.worst) == {"conv", "conv window", "materialize_conv"}


def test_conv_refuses_bad_input_clearly():
    spec, m = _module("{width: 4, activation: silu, channels: [value, key, query]}")
    channels = m._CONV_CHANNELS
    state = m.allocate_conv(2, DEVICE, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    weight = torch.zeros(channels, 4, device=DEVICE)
    with pytest.raises(ValueError, match=rf"inputs has shape \(2, {channels - 1}\), expected \(2, {channels}\)"):
        m.conv(state, slots, torch.zeros(2, channels - 1, device=DEVICE), weight)
    with pytest.raises(TypeError, match="inputs has dtype torch.float16"):
        m.conv(state, slots, torch.zeros(2, channels, dtype=torch.float16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="weight has shape"):
        m.conv(state, slots, torch.zeros(2, channels, device=DEVICE), torch.zeros(channels, 1, 4, device=DEVICE))
    with pytest.raises(ValueError, match="a window holds 1..2 tokens"):
        m.conv(state, slots, torch.zeros(2, 3, channels, device=DEVICE), weight)
    _, other = _module("{width: 3, activation: silu, channels: [value, key, query]}")
    with pytest.raises(TypeError, match="cannot use a conv state of"):
        other.conv(state, slots, torch.zeros(2, channels, device=DEVICE), torch.zeros(channels, 3, device=DEVICE))
    with pytest.raises(TypeError, match="accepted must be an int32 tensor"):
        m.commit_conv(state, slots, torch.ones(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize(
    "conv, message",
    [
        ("{width: 1, channels: [value]}", "at 'conv.width'"),
        ("{width: 4, channels: []}", "non-empty list"),
        ("{width: 4, channels: [value, value]}", "once"),
        ("{width: 4, channels: [gate]}", "'gate'"),
        ("{width: 4, activation: relu, channels: [key]}", "'relu'"),
        ("{channels: [key]}", "missing required key 'width'"),
    ],
)
def test_a_malformed_conv_section_is_refused_where_it_is(conv, message):
    with pytest.raises(SpecError, match=message):
        load_spec_text(TINY + f"\nconv: {conv}\n")
