"""Traffic model and memory arithmetic against hand-computed values."""

from dataclasses import replace

import pytest

from replaygen.spec.model import DType
from replaygen.traffic import (
    baseline_decode_bytes,
    best_verify_capacity,
    entry_bytes,
    replay_decode_bytes,
    replay_verify_bytes,
    slot_memory,
    speedup_bound,
    verify_flush_period,
)

from conftest import SMALL

# SMALL: H=4, G=2, P=8, N=16, L=4; state fp32; bf16 activations.
STATE = 4 * 8 * 16 * 4  # 2048
ENTRY = 4 * 8 * 2 + 2 * 16 * 2 + 4 * 4 + 4 * 4  # value + key + log decay + weight = 64 + 64 + 16 + 16 = 160
INPUTS = 4 * 8 * 2 + 2 * (2 * 16 * 2) + 4 * 2  # x + B + C + dt = 64 + 128 + 8 = 200
OUTPUTS = 4 * 8 * 2  # 64


def test_entry_bytes(mamba2):
    assert entry_bytes(mamba2, SMALL, DType.BFLOAT16) == ENTRY


def test_baseline_bytes(mamba2):
    b = baseline_decode_bytes(mamba2, SMALL, DType.BFLOAT16)
    assert (b.state_read, b.state_write, b.inputs, b.outputs) == (STATE, STATE, INPUTS, OUTPUTS)
    assert b.total == 2 * STATE + INPUTS + OUTPUTS


def test_replay_bytes_over_a_cycle(mamba2):
    r = replay_decode_bytes(mamba2, SMALL, DType.BFLOAT16)
    # L=4: the steps start with h = 0, 1, 2, 3 entries; three of four append; one writes the state.
    assert r.state_read == STATE
    assert r.state_write == STATE / 4
    assert r.buffer_read == pytest.approx(1.5 * ENTRY + 8)
    assert r.buffer_write == pytest.approx(0.75 * ENTRY + 8)
    assert r.total == pytest.approx(STATE * 1.25 + 2.25 * ENTRY + 16 + INPUTS + OUTPUTS)


def test_flush_every_step_is_the_baseline_traffic(mamba2):
    r = replay_decode_bytes(mamba2, SMALL, DType.BFLOAT16, flush_at=1)
    assert r.total == baseline_decode_bytes(mamba2, SMALL, DType.BFLOAT16).total + 16


def test_nemotron_h_bound_matches_the_write_up(mamba2):
    # MATH.md: about 1.81x fewer bytes at L=16 for d=64, n=128, 128 heads, 8 groups.
    assert speedup_bound(mamba2, mamba2.shape("nemotron-h"), DType.BFLOAT16) == pytest.approx(1.81, abs=0.005)


def test_slot_memory(mamba2):
    m = slot_memory(mamba2, SMALL, DType.BFLOAT16)
    assert m.baseline == STATE
    # ring of L + T = 5 entries; one cursor copy (8 bytes) per head and 8 value rows
    assert m.replay == STATE + 5 * ENTRY + 4 * 1 * 8


def test_verify_capacity_fills_a_power_of_two_ring(mamba2):
    """L >= 2T with L + T a power of two, at most 32 positions, unless the window needs more (L = 2T fits then)."""
    shape = mamba2.shape("nemotron-h")
    chosen = {t: best_verify_capacity(mamba2, shape, DType.BFLOAT16, t) for t in (1, 2, 4, 8, 11, 16)}
    assert chosen == {1: 15, 2: 30, 4: 28, 8: 24, 11: 53, 16: 48}
    assert mamba2.shape("nemotron-h-mtp").capacity == chosen[4]


def test_verify_flush_at_folds_every_step(mamba2):
    """The flush rule (h + 2T > L) alone, against a verify config's flush_at = 1: every step that finds committed
    entries folds them, so each step starts with one window's entries and writes the state."""
    shape = replace(SMALL, capacity=8, window=2)
    assert verify_flush_period(shape, 2, 2) == (2, 4, 6)
    assert verify_flush_period(shape, 2, 2, flush_at=1) == (2,)
    assert verify_flush_period(shape, 2, 1, flush_at=3) == (1, 2, 3)
    rule, every = (replay_verify_bytes(mamba2, shape, DType.BFLOAT16, 2, flush_at=f) for f in (0, 1))
    assert rule.state_write == STATE / 3 and every.state_write == STATE
    assert every.buffer_read == pytest.approx(2 * ENTRY + 16) and rule.buffer_read == pytest.approx(4 * ENTRY + 16)
