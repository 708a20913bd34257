"""Mamba-3 from its spec alone, SISO and MIMO: the spec's float64 reference against state-spaces/mamba's step
semantics, written here on their own terms (its `Mamba3.step`: the rotary of `apply_rotary_qk_inference_reference`,
the update of `selective_state_update_fused_ref_v2`); every generated kernel against the reference (flushes,
rollbacks, padded rows, poisoned slots, changing flush thresholds, odd sizes, a 16-bit state); the kernels against
state-spaces' semantics end to end; the language's features apart from Mamba-3; the API's checks."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replaygen.configs import BucketConfig, KernelConfig, KernelKind
from replaygen.harness import InputFactory, check_decode, check_speculative, check_speculative_through_flushes, load_reference, relative_error, state_errors
from replaygen.reference import Reference
from replaygen.runtime import import_source, load_kernels
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import DecayForm, DType, RotaryPairing, Rounding, StateLayout, TargetShape, UpdateKind, VectorTransform

from conftest import DEVICE, ROOT

MAMBA3 = load_spec(ROOT / "specs" / "mamba3.yaml")
SISO = TargetShape("siso", heads=4, key_heads=2, value_dim=8, key_dim=16, capacity=8, window=2, rotary_pairing=RotaryPairing.ADJACENT)
MIMO = replace(SISO, name="mimo", rank=2, rotary_pairing=RotaryPairing.HALVES)


def test_shipped_spec():
    assert MAMBA3.update.kind is UpdateKind.TRAPEZOID and MAMBA3.decay.form is DecayForm.NEG_RATE_SOFTPLUS
    assert MAMBA3.key.transform is VectorTransform.RMSNORM and MAMBA3.key.bias == "B_bias"
    siso, mimo = MAMBA3.shape("mamba3"), MAMBA3.shape("mamba3-mimo")
    assert (siso.heads, siso.key_heads, siso.value_dim, siso.key_dim, siso.rank) == (64, 1, 64, 128, 1)
    assert (mimo.rank, mimo.rotary_pairing, siso.rotary_pairing) == (4, RotaryPairing.HALVES, RotaryPairing.ADJACENT)
    assert MAMBA3.rotary.angles(128) == 32 and MAMBA3.rotary.angles(64) == 16
    assert {(s.window, s.capacity) for s in MAMBA3.shapes} == {(4, 16), (4, 28), (2, 30)}


# --- state-spaces/mamba's Mamba3.step, on its own terms -----------------------------------------------------------


def heavy_tail(x):
    return torch.where(x < 0, 1 / (1 - x.clamp(max=0)), 1 + x)


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary(t, cos, sin, pairwise):
    """state-spaces' inference rotary on t [b, R, H, N] with cos, sin [b, 1, H, A]: interleaved pairs (pairwise, SISO)
    or the two halves of N (MIMO), angles past A leaving their pairs as they are."""
    if pairwise:
        rot = t[..., : 2 * cos.shape[-1]].unflatten(-1, (-1, 2))
        even, odd = rot[..., 0], rot[..., 1]
        turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)
        return torch.cat([turned, t[..., 2 * cos.shape[-1]:]], -1)
    half = t.shape[-1] // 2
    pad = half - cos.shape[-1]
    cos = F.pad(cos, (0, pad), value=1.0)
    sin = F.pad(sin, (0, pad), value=0.0)
    low, high = t[..., :half], t[..., half:]
    return torch.cat([low * cos - high * sin, low * sin + high * cos], -1)


def state_spaces_step(raw, params, states, mimo):
    """One `Mamba3.step` after in_proj, float64: raw per-token inputs (z, x [b, H, P], B, C [b, R, G, N], dd_dt, dd_A,
    trap [b, H], angles [b, A]) and states (angle [b, H, A], ssm [b, H, P, N], k [b, R, H, N], v [b, H, P]) -> (out
    [b, H, P], next states)."""
    angle_state, ssm_state, k_state, v_state = states
    heads = raw["x"].shape[1]
    A = torch.clamp(-heavy_tail(raw["dd_A"]), max=-params["A_floor"])
    DT = F.softplus(raw["dd_dt"] + params["dt_bias"])
    trap = torch.sigmoid(raw["trap"])
    groups = raw["B"].shape[2]
    B = rms_norm(raw["B"], params["B_norm"]).repeat_interleave(heads // groups, dim=2)  # [b, R, H, N]
    C = rms_norm(raw["C"], params["C_norm"]).repeat_interleave(heads // groups, dim=2)
    # the rotary step: the angle advances by tanh(angle_proj) * dt * pi; biases added before the turn
    angle = angle_state + torch.tanh(raw["angles"])[:, None, :] * DT[:, :, None] * math.pi
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
    C = rotary(C + params["C_bias"].transpose(0, 1)[None], cos, sin, pairwise=not mimo)
    B = rotary(B + params["B_bias"].transpose(0, 1)[None], cos, sin, pairwise=not mimo)
    # the fused update: x scaled per rank, the previous entry weighted by (1 - trap) dt alpha, this one by trap dt
    xproj, zproj, outproj = (params[name].transpose(0, 1) for name in ("mimo_x", "mimo_z", "mimo_o"))  # [R, H, P]
    alpha = torch.exp(A * DT)
    beta = (1 - trap) * DT * alpha
    gamma = trap * DT
    x_r = raw["x"][:, None] * xproj[None]
    prev_r = v_state[:, None] * xproj[None]
    new = ssm_state * alpha[..., None, None]
    new = new + torch.einsum("brhp,brhn->bhpn", prev_r * beta[:, None, :, None], k_state)
    new = new + torch.einsum("brhp,brhn->bhpn", x_r * gamma[:, None, :, None], B)
    out_r = torch.einsum("bhpn,brhn->brhp", new, C) + x_r * params["D"][None, None, :, None]
    z_r = raw["z"][:, None] * zproj[None]
    out_r = out_r * z_r * torch.sigmoid(z_r)
    out = (out_r * outproj[None]).sum(1)
    return out, (angle, new, B, raw["x"])


def random_layer(shape, gen, steps, batch):
    """Weights and `steps` tokens of raw inputs for `batch` sequences, float64, as Mamba3's layer makes them (B, C
    always [b, R, G, N]; the rank-1 scales ones, as Mamba3.step passes them at SISO)."""
    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    H, G, P, N, R = shape.heads, shape.key_heads, shape.value_dim, shape.key_dim, shape.rank
    A = MAMBA3.rotary.angles(N)
    ones = torch.ones(H, R, P, dtype=torch.float64)
    params = {
        "dt_bias": -1 - 3 * torch.rand(H, generator=gen, dtype=torch.float64), "A_floor": 1e-4, "D": randn(H),
        "B_norm": 1 + 0.2 * randn(N), "C_norm": 1 + 0.2 * randn(N), "B_bias": 1 + 0.3 * randn(H, R, N), "C_bias": 1 + 0.3 * randn(H, R, N),
        "mimo_x": 1 + 0.3 * randn(H, R, P) if R > 1 else ones, "mimo_z": 1 + 0.3 * randn(H, R, P) if R > 1 else ones,
        "mimo_o": 1 + 0.3 * randn(H, R, P) if R > 1 else ones,
    }
    tokens = [
        {"z": randn(batch, H, P), "x": randn(batch, H, P), "B": randn(batch, R, G, N), "C": randn(batch, R, G, N), "dd_dt": 0.5 * randn(batch, H),
         "dd_A": randn(batch, H), "trap": randn(batch, H), "angles": 2 * randn(batch, A)}
        for _ in range(steps)
    ]
    return params, tokens


def ours_step(shape, raw, params):
    """The same step in the spec's names: the reference's inputs and weights (rank-1 keys [b, G, N], no scales)."""
    key = (lambda t: t) if shape.rank > 1 else (lambda t: t[:, 0])
    bias = (lambda t: t) if shape.rank > 1 else (lambda t: t[:, 0])
    inputs = {**{k: raw[k] for k in ("x", "dd_dt", "dd_A", "trap", "angles", "z")}, "B": key(raw["B"]), "C": key(raw["C"])}
    weights = {"dt_bias": params["dt_bias"], "D": params["D"], "B_norm": params["B_norm"], "C_norm": params["C_norm"],
               "B_bias": bias(params["B_bias"]), "C_bias": bias(params["C_bias"])}
    if shape.rank > 1:
        weights.update({k: params[k] for k in ("mimo_x", "mimo_z", "mimo_o")})
    return inputs, weights


@pytest.mark.parametrize("shape", [SISO, MIMO], ids=lambda s: s.name)
def test_reference_is_state_spaces_step(shape):
    """Twelve steps from random states: outputs, SSM state, angle (mod 2 pi), previous key and value after each."""
    gen = torch.Generator().manual_seed(3)
    batch, H, P, N, R = 3, shape.heads, shape.value_dim, shape.key_dim, shape.rank
    A = MAMBA3.rotary.angles(N)
    params, tokens = random_layer(shape, gen, 12, batch)
    states = (6 * torch.rand(batch, H, A, generator=gen, dtype=torch.float64), torch.randn(batch, H, P, N, generator=gen, dtype=torch.float64),
              torch.randn(batch, R, H, N, generator=gen, dtype=torch.float64), torch.randn(batch, H, P, generator=gen, dtype=torch.float64))
    reference = Reference(MAMBA3, shape, batch)
    reference.load(list(range(batch)), states[1], angle=states[0], last_key=states[2].transpose(1, 2), last_value=states[3])
    for raw in tokens:
        want, states = state_spaces_step(raw, params, states, mimo=R > 1)
        got = reference.decode(list(range(batch)), *ours_step(shape, raw, params))
        carried = reference.carried
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
        assert torch.allclose(carried.state, states[1], rtol=1e-10, atol=1e-10)
        assert torch.allclose(torch.remainder(carried.angle - states[0] + math.pi, 2 * math.pi) - math.pi, torch.zeros_like(states[0]), atol=1e-10)
        assert torch.allclose(carried.last_key, states[2].transpose(1, 2), rtol=1e-10, atol=1e-10)
        assert torch.equal(carried.last_value, states[3])


# --- the generated kernels -----------------------------------------------------------------------------------------


def assert_passes(report):
    assert report.ok, "\n".join(report.lines())


# The kernels' shapes: SISO with two heads per key head; MIMO smaller (its rank loops are slow under the interpreter).
KERNEL_SHAPES = [SISO, replace(MIMO, heads=2, key_heads=1, capacity=6)]


@pytest.fixture(scope="module", params=KERNEL_SHAPES, ids=lambda s: s.name)
def kernels(request):
    return request.param, load_kernels(MAMBA3, request.param)


@pytest.mark.parametrize("route", ["output_only", "state_and_output"])
def test_decode_against_the_reference(kernels, route):
    """Replay and baseline decode, materialize and load over two flush cycles: outputs, states, angles and the
    carried entry after every step, padded rows and poisoned unused slots included."""
    shape, module = kernels
    report = check_decode(module, MAMBA3, shape, device=DEVICE, route=route, batch=2, cycles=2, seed=1)
    assert_passes(report)
    assert {"replay_decode", "baseline_decode", "materialize", "materialize_carried", "baseline_state", "baseline_carried"} <= set(report.worst)


def test_verify_against_the_reference(kernels):
    """Replay verify + commit with random acceptance (the angle and the carried entry roll back with the cursor), then
    every draft accepted through two flushes; the per-draft-snapshot baseline beside it; verify mixed with decode."""
    shape, module = kernels
    for report in check_speculative_through_flushes(module, MAMBA3, shape, random_steps=5, device=DEVICE, batch=2, seed=3):
        assert_passes(report)
        assert {"replay_verify", "baseline_verify", "materialize_carried", "baseline_carried"} <= set(report.worst)
    assert_passes(check_speculative(module, MAMBA3, shape, device=DEVICE, accept="none", mixed=True, batch=2, steps=5, seed=4))


def test_half_activations(kernels):
    """bfloat16 decode without the gate, float16 verify windows: the ring caches the finished keys at 16 bits."""
    shape, module = kernels
    assert_passes(check_decode(module, MAMBA3, shape, device=DEVICE, act_dtype=torch.bfloat16, use_gate=False, batch=2, cycles=1, seed=5))
    assert_passes(check_speculative(module, MAMBA3, shape, device=DEVICE, act_dtype=torch.float16, batch=2, steps=4, seed=6))


@pytest.mark.parametrize("config", [
    pytest.param(dict(block_v=8), id="fused-flush"),
    pytest.param(dict(block_v=8, num_warps=2, fused_flush=False, fold_chunk=2), id="flush-launch-two-warps"),
    pytest.param(dict(block_v=16, fold_dot=True, prefetch_ring=False, fold_chunk=1), id="dot-fold-no-prefetch"),
])
def test_flush_threshold_changes_between_steps(config):
    """flush_at changing from step to step (1: the baseline's step on the checkpoint, after folding the entries a
    larger threshold left): the carried entry and angle follow each flush into the ring row before the buffer.
    Two value blocks per head where block_v is 8, so a head's carried key and angle are written by its first."""
    shape = replace(SISO, value_dim=16, capacity=6, window=1)
    module = load_kernels(MAMBA3, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, KernelConfig(**config)),)})
    factory = InputFactory(MAMBA3, shape, DEVICE, torch.float32, seed=5)
    weights = factory.weights()
    state = module.allocate(3, DEVICE, torch.float32)
    reference = Reference(MAMBA3, shape, 3)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    init = factory.full_states(module, 2)
    module.load(state, slots, init)
    load_reference(reference, [2, 0], init)
    for step, flush_at in enumerate([5, 5, 5, 1, 6, 6, 2, 3, 1, 1, 4, 4]):
        inputs = factory.step(2)
        y = module.decode(state, slots, **inputs, **weights, flush_at=flush_at)
        assert relative_error(y, reference.decode([2, 0], inputs, weights)) < 1e-4, f"step {step} (flush_at={flush_at})"
        errors = state_errors(reference, module.materialize(state, slots), [2, 0])
        assert max(errors) < 1e-4, f"state after step {step}"


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: s.name)
def test_kernels_follow_state_spaces(shape):
    """Twelve tokens from prefill-like states through replay decode, through verify windows of two with every draft
    accepted, and through the baseline decode, against state_spaces_step on the same raw inputs: outputs per token,
    and the final state, angle and previous key and value."""
    gen = torch.Generator().manual_seed(7)
    batch, H, P, N, R = 2, shape.heads, shape.value_dim, shape.key_dim, shape.rank
    A = MAMBA3.rotary.angles(N)
    params, tokens = random_layer(shape, gen, 12, batch)
    start = (6 * torch.rand(batch, H, A, generator=gen, dtype=torch.float64), torch.randn(batch, H, P, N, generator=gen, dtype=torch.float64),
             torch.randn(batch, R, H, N, generator=gen, dtype=torch.float64), torch.randn(batch, H, P, generator=gen, dtype=torch.float64))
    states, expected = start, []
    for raw in tokens:
        want, states = state_spaces_step(raw, params, states, mimo=R > 1)
        expected.append(want)
    expected = torch.stack(expected, 1)
    module = load_kernels(MAMBA3, shape)

    def ours(x):
        return x.to(DEVICE, torch.float32).contiguous()

    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    last_key = start[2].transpose(1, 2).reshape(batch, *dict(module.CARRIED)["last_key"])
    loaded = module.SlotStates(ours(start[1]), ours(start[0]), ours(start[3]), ours(last_key))
    weights = {name: ours(w) for name, w in ours_step(shape, tokens[0], params)[1].items()}
    for run in ("decode", "verify", "baseline"):
        state = module.allocate_baseline(2, DEVICE) if run == "baseline" else module.allocate(2, DEVICE, torch.float32)
        if run == "baseline":
            state[[1, 0]] = loaded
        else:
            module.load(state, slots, loaded)
        outputs = []
        for t in range(0, len(tokens), 2 if run == "verify" else 1):
            if run == "verify":
                window = [ours_step(shape, raw, params)[0] for raw in tokens[t : t + 2]]
                inputs = {name: ours(torch.stack([w[name] for w in window], 1)) for name in window[0]}
                outputs.append(module.verify(state, slots, **inputs, **weights))
                module.commit(state, slots, torch.full((2,), 2, dtype=torch.int32, device=DEVICE))
            else:
                inputs = {name: ours(x) for name, x in ours_step(shape, tokens[t], params)[0].items()}
                step = module.baseline_decode if run == "baseline" else module.decode
                outputs.append(step(state, slots, **inputs, **weights)[:, None])
        got = torch.cat(outputs, 1).double().cpu()
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4, f"{run}: outputs"
        final = state[[1, 0]] if run == "baseline" else module.materialize(state, slots, **({"mimo_x": weights["mimo_x"]} if R > 1 else {}))
        assert relative_error(final.state, states[1]) < 1e-4, f"{run}: state"
        turn = torch.remainder(final.angle.double().cpu() - states[0] + math.pi, 2 * math.pi) - math.pi
        assert turn.abs().max() < 1e-4, f"{run}: angle"
        assert relative_error(final.last_key.reshape(batch, H, R, N), states[2].transpose(1, 2)) < 1e-4, f"{run}: previous key"
        assert relative_error(final.last_value, states[3]) < 1e-5, f"{run}: previous value"


@pytest.mark.parametrize("shape", [
    pytest.param(replace(SISO, heads=3, key_heads=1, value_dim=12, key_dim=20, capacity=5, layout=StateLayout.KEY_VALUE), id="siso-key-value"),
    pytest.param(replace(MIMO, heads=2, key_heads=2, value_dim=12, key_dim=20, capacity=5, rank=3), id="rank-3"),
])
def test_odd_sizes(shape):
    """Value rows and key channels past the block (12 of 16, 20 of 32; five or ten rotary pairs of 20 channels), rank 3
    of a 4-row tile, the [key, value] state layout: decode and verify against the reference."""
    module = load_kernels(MAMBA3, shape)
    assert_passes(check_decode(module, MAMBA3, shape, device=DEVICE, batch=2, cycles=2, seed=11))
    assert_passes(check_speculative(module, MAMBA3, shape, device=DEVICE, batch=2, steps=4, seed=12))


def test_a_bfloat16_state_rounded_stochastically():
    shape = replace(SISO, heads=2, key_heads=1, capacity=4, state_dtype=DType.BFLOAT16, rounding=Rounding.STOCHASTIC)
    module = load_kernels(MAMBA3, shape)
    assert_passes(check_decode(module, MAMBA3, shape, device=DEVICE, batch=2, cycles=2, seed=13))
    assert_passes(check_speculative(module, MAMBA3, shape, device=DEVICE, batch=2, steps=4, seed=14))


# --- the features apart from Mamba-3 -------------------------------------------------------------------------------

MAMBA2_TEXT = (ROOT / "specs" / "mamba2.yaml").read_text()


def mamba2_with(extra: str, shape_fields: str) -> str:
    """Mamba-2's spec with `extra` top-level sections and `shape_fields` added to its first shape."""
    text = MAMBA2_TEXT.replace("state: {dtype: float32, layout: value_key}", extra + "\nstate: {dtype: float32, layout: value_key}", 1)
    return text.replace("nemotron-h:     {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128}", "nemotron-h: {heads: 128, key_heads: 8, value_dim: 64, key_dim: 128" + shape_fields + "}", 1)


def test_a_rotary_and_ranks_without_the_trapezoid():
    """Mamba-2 given a rotary (the angle the only carried entry, keys turned per head, no normalisation) and rank 2
    (additive): every kernel against the reference, from the spec's words alone."""
    text = mamba2_with("rotary: {angle_input: theta, fraction: 1.0, pairing: halves}\nranks: {value_scale: sx, output_scale: so}", ", rank: 2")
    text = text.replace("    weight: float32\n", "    weight: float32\n    angle: float32\n", 1)
    spec = load_spec_text(text, "mamba2_rotary_ranked.yaml")
    assert spec.carries and spec.keys_per_head and spec.update.kind is UpdateKind.ADDITIVE
    shape = replace(spec.shape("nemotron-h"), heads=2, key_heads=1, value_dim=8, key_dim=8, capacity=4, window=2)
    module = load_kernels(spec, shape)
    assert [name for name, _ in module.CARRIED] == ["angle"]
    assert_passes(check_decode(module, spec, shape, device=DEVICE, batch=2, cycles=2, seed=8))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, batch=2, steps=5, seed=9))


def test_a_token_rate_by_exp():
    """rate_activation exp (A_log given per token) with a floor, in Mamba-3's spec: decode against the reference."""
    spec = load_spec_text((ROOT / "specs" / "mamba3.yaml").read_text().replace("rate_activation: heavy_tail", "rate_activation: exp").replace("rate_floor: 1.0e-4", "rate_floor: 0.5"), "exp.yaml")
    shape = replace(SISO, heads=2, key_heads=1, capacity=4)
    module = load_kernels(spec, shape)
    assert "tl.exp(tl.load(in_dd_A_ptr" in open(module.__file__).read()
    assert_passes(check_decode(module, spec, shape, device=DEVICE, route="state_and_output", batch=2, cycles=2, seed=10))


# --- the API's checks ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def siso():
    return load_kernels(MAMBA3, SISO)


@pytest.fixture(scope="module")
def mimo():
    return load_kernels(MAMBA3, KERNEL_SHAPES[1])


class TestBadInput:
    def test_states_must_be_slot_states(self, siso):
        state = siso.allocate(2, DEVICE, torch.float32)
        slots = torch.tensor([0], dtype=torch.int32, device=DEVICE)
        with pytest.raises(TypeError, match=r"states must be SlotStates \(this recurrence carries angle, last_value, last_key beside its state\)"):
            siso.load(state, slots, torch.zeros((1, *siso.STATE_SHAPE), device=DEVICE))
        factory = InputFactory(MAMBA3, SISO, DEVICE, torch.float32, 0)
        weights = factory.weights()
        with pytest.raises(TypeError, match="state must be SlotStates from allocate_baseline"):
            siso.baseline_decode(torch.zeros((2, *siso.STATE_SHAPE), device=DEVICE), slots, **factory.step(1), **weights)
        current = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        with pytest.raises(TypeError, match=r"snapshots must be SlotStates \[slots, T\] from allocate_snapshots"):
            siso.baseline_verify(torch.zeros((2, 2, *siso.STATE_SHAPE), device=DEVICE), current, slots, **factory.window(1, 2), **weights)

    def test_a_copy_of_the_module_takes_its_slot_states(self, siso):
        """SlotStates are a class of each module: a copy of it (a reload, a vendored file; the tuner's candidates)
        takes the original's baseline states, snapshots and full states as its own, bit for bit the original's results."""
        copy = import_source(Path(siso.__file__).read_text() + "\n# a vendored copy\n", "copy")
        assert copy.SlotStates is not siso.SlotStates
        factory = InputFactory(MAMBA3, SISO, DEVICE, torch.float32, 0)
        weights, step, window = factory.weights(), factory.step(2), factory.window(2, 2)
        slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
        start = factory.full_states(siso, 2)
        outputs = []
        for module in (siso, copy):
            baseline = siso.allocate_baseline(2, DEVICE)
            baseline[[0, 1]] = start
            snapshots, current = siso.allocate_snapshots(2, DEVICE, 2)
            snapshots.state[:, 0] = start.state
            replay = siso.allocate(2, DEVICE, torch.float32)
            module.load(replay, slots, start)
            outputs.append((
                module.baseline_decode(baseline, slots, **step, **weights),
                module.baseline_verify(snapshots, current, slots, **window, **weights),
                module.materialize(replay, slots).state,
            ))
        for ours, theirs in zip(*outputs):
            assert torch.equal(ours, theirs)

    def test_carried_shapes_and_dtypes(self, siso):
        state = siso.allocate(2, DEVICE, torch.float32)
        slots = torch.tensor([0], dtype=torch.int32, device=DEVICE)
        good = siso.SlotStates.zeros((1,), DEVICE)
        with pytest.raises(ValueError, match=r"states.last_key has shape \(1, 4, 15\), expected \(1, 4, 16\)"):
            siso.load(state, slots, siso.SlotStates(good.state, good.angle, good.last_value, torch.zeros(1, 4, 15, device=DEVICE)))
        with pytest.raises(TypeError, match="states.angle has dtype torch.int32"):
            siso.load(state, slots, siso.SlotStates(good.state, good.angle.int(), good.last_value, good.last_key))
        with pytest.raises(ValueError, match="states.last_value must be contiguous"):
            siso.load(state, slots, siso.SlotStates(good.state, good.angle, torch.zeros(1, 8, 4, device=DEVICE).transpose(1, 2), good.last_key))
        with pytest.raises(TypeError, match="out.angle has dtype torch.float16"):
            siso.materialize(state, slots, out=siso.SlotStates(good.state, good.angle.half(), good.last_value, good.last_key))

    def test_ranked_inputs(self, mimo):
        shape = KERNEL_SHAPES[1]
        factory = InputFactory(MAMBA3, shape, DEVICE, torch.float32, 0)
        state = mimo.allocate(2, DEVICE, torch.float32)
        slots = torch.tensor([0], dtype=torch.int32, device=DEVICE)
        inputs, weights = factory.step(1), factory.weights()
        with pytest.raises(ValueError, match=r"B has shape \(1, 1, 16\), expected \(1, 2, 1, 16\)"):
            mimo.decode(state, slots, **{**inputs, "B": inputs["B"][:, 0]}, **weights)
        with pytest.raises(ValueError, match=r"angles has shape \(1, 3\), expected \(1, 4\)"):
            mimo.decode(state, slots, **{**inputs, "angles": inputs["angles"][:, :3]}, **weights)
        with pytest.raises(ValueError, match=r"mimo_x has shape \(2, 1, 8\), expected \(2, 2, 8\)"):
            mimo.materialize(state, slots, mimo_x=weights["mimo_x"][:, :1])
        with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'mimo_x'"):
            mimo.materialize(state, slots)


def test_configs_the_features_refuse():
    """Knobs a carrying or ranked shape cannot run are refused before anything renders, each with its reason; the
    defaults avoid them, and no scores kernel is rendered."""
    from replaygen.configs import module_defaults
    from replaygen.errors import UnsupportedShapeError
    from replaygen.codegen import render_module
    from replaygen.plan import plan_module

    mimo = KERNEL_SHAPES[1]
    refused = [
        (SISO, KernelKind.REPLAY_DECODE, KernelConfig(block_v=8, precompute_scores=True), "precompute_scores scores one key per key head and step"),
        (SISO, KernelKind.BASELINE_DECODE, KernelConfig(block_v=8, num_warps=1), None),  # a block of the whole head
        (replace(SISO, value_dim=16), KernelKind.BASELINE_VERIFY, KernelConfig(block_v=8, num_warps=1), r"block_v=8 < value_dim=16: the key and angle the recurrence carries are one per head"),
        (mimo, KernelKind.REPLAY_VERIFY, KernelConfig(block_v=16, num_warps=1, fold_dot=True), "fold_dot folds one key per entry; a shape of rank 2 folds 2"),
    ]
    for shape, kind, config, message in refused:
        tables = module_defaults(MAMBA3, shape)
        tables[kind] = (BucketConfig(None, config),)
        if message is None:
            plan_module(MAMBA3, shape, "any", tables, "defaults")
            continue
        with pytest.raises(UnsupportedShapeError, match=message):
            plan_module(MAMBA3, shape, "any", tables, "defaults")
    source = render_module(plan_module(MAMBA3, mimo, "any", module_defaults(MAMBA3, mimo), "defaults"))
    assert "def _scores_kernel" not in source and "def _launch_scores" not in source


def test_the_verify_default_is_the_state_route_at_every_batch():
    """Keys per head (a carried entry, ranks) leave no scores kernel: the output-only verify scores every window token
    against every entry in each program, 4.0x the state route at b128 on the H100 (perf.md 83)."""
    from replaygen.configs import Route, default_configs, spec_traits

    for shape in (MAMBA3.shape("mamba3-mtp"), MAMBA3.shape("mamba3-mimo-mtp")):
        (bucket,) = default_configs(KernelKind.REPLAY_VERIFY, shape, spec_traits(MAMBA3, shape))
        assert bucket.max_batch is None and bucket.config.route is Route.STATE_AND_OUTPUT and not bucket.config.precompute_scores


def test_search_spaces_hold_only_what_renders():
    """The tuner's spaces for Mamba-3: no scores kernel, no fold_dot at rank > 1, baselines over whole heads; every
    default renders."""
    from replaygen.keys import render_candidate
    from replaygen.tune.study import plan_tasks

    shapes = (MAMBA3.shape("mamba3"), MAMBA3.shape("mamba3-mimo-mtp"))
    for task in plan_tasks(MAMBA3, shapes, tuple(KernelKind), (1, 256)):
        choices = {p.name: p.choices for p in task.space.parameters}
        assert choices["precompute_scores"] == (False,) and choices["window_block_v"] == (0,)
        assert choices["fold_dot"] == ((False,) if task.shape.rank > 1 or task.kind not in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY) else (False, True))
        if task.kind in (KernelKind.BASELINE_DECODE, KernelKind.BASELINE_VERIFY):
            assert choices["block_v"] == (64,)
        render_candidate(MAMBA3, task.shape, task.kind, task.space.default)


def test_the_decode_default_above_batch_8_is_the_output_only_step_over_the_whole_head():
    """Keys per head leave no scores kernel: above b8 the output-only step with one program per head, two warps,
    buffering up to L, beat the flush-every-step step over the whole head and the output-only step over 32 rows at
    b128 and b512 on the H100 (perf.md 84); the searches start from it too. At rank > 1, whose readouts score each
    entry's R keys against R queries (the output-only step ran 4.9x the baseline at b8), the baseline's step over
    the whole head. Up to b8 the default keeps buffering."""
    from replaygen.configs import Route, default_configs, replay_decode_structures, spec_traits

    for name in ("mamba3", "mamba3-mtp", "mamba3-mimo", "mamba3-mimo-mtp"):
        shape = MAMBA3.shape(name)
        traits = spec_traits(MAMBA3, shape)
        small, large = default_configs(KernelKind.REPLAY_DECODE, shape, traits)
        assert small.max_batch == 8 and small.config.flush_at == 0
        config = large.config
        assert config.block_v == shape.value_dim and config.num_warps == 2 and not config.precompute_scores
        if shape.rank > 1:
            assert config.flush_at == 1
        else:
            assert config.route is Route.OUTPUT_ONLY and config.flush_at == 0 and config.fused_flush and config.prefetch_ring
            assert config in replay_decode_structures(shape, traits)
