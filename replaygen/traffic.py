"""Memory-traffic model: the fewest bytes each kernel must move per decode step, and memory per slot.

Per batch row. Weights (A_log, dt_bias, D, ...) are a few bytes per head shared by
the whole batch and are left out. Replay numbers are averages over one flush
cycle of `flush_at` steps: the buffer holds h = 0 .. flush_at-1 entries at the
start of the steps, and the state is written once per cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from replaygen.configs import CURSOR_GRAIN
from replaygen.spec.model import CacheField, DecayGranularity, DType, Spec, TargetShape, UpdateKind

CURSOR_BYTES = 8  # int32 start + count
# The device memory `SpeculativeMemory.sequences` counts sequences in (one layer's states; the counts of a
# model's layers all scale by the same factor, so the ratios hold for the model).
STATE_BUDGET_BYTES = 40 << 30


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step moves for one sequence, by kind."""

    state_read: float
    state_write: float
    buffer_read: float
    buffer_write: float
    inputs: float
    outputs: float

    @property
    def total(self) -> float:
        return self.state_read + self.state_write + self.buffer_read + self.buffer_write + self.inputs + self.outputs


@dataclass(frozen=True)
class SlotMemory:
    """Bytes of device memory one sequence slot needs."""

    baseline: int  # one recurrent state
    replay_checkpoint: int
    replay_buffers: int
    replay_cursor: int

    @property
    def replay(self) -> int:
        return self.replay_checkpoint + self.replay_buffers + self.replay_cursor


def state_bytes(spec: Spec, shape: TargetShape) -> int:
    return shape.heads * shape.value_dim * shape.key_dim * shape.state_dtype.itemsize


def carried_bytes(spec: Spec, shape: TargetShape) -> int:
    """Bytes of what a recurrence carries per sequence beside its state (float32 in the baseline's SlotStates): the
    rotary angles, the trapezoid's previous value and keys."""
    total = 0
    if spec.rotary:
        total += shape.heads * spec.rotary.angles(shape.key_dim) * 4
    if spec.update.kind is UpdateKind.TRAPEZOID:
        total += shape.heads * (shape.value_dim + shape.rank * shape.key_dim) * 4
    return total


def entry_bytes(spec: Spec, shape: TargetShape, act: DType) -> int:
    """Bytes of one ring-buffer entry (all cached fields, all heads)."""
    total = 0
    for cached in spec.cache_of(shape):
        size = (cached.dtype or act).itemsize
        if cached.field in (CacheField.VALUE, CacheField.CORRECTED_VALUE):
            total += shape.heads * shape.value_dim * size
        elif cached.field is CacheField.KEY:
            total += (shape.heads if spec.keys_per_head else shape.key_heads) * shape.rank * shape.key_dim * size
        elif cached.field is CacheField.LOG_DECAY:
            width = shape.key_dim if spec.decay.granularity is DecayGranularity.CHANNEL else 1
            total += shape.heads * width * size
        elif cached.field is CacheField.ANGLE:
            total += shape.heads * spec.rotary.angles(shape.key_dim) * size
        else:
            total += shape.heads * size
    return total


def input_bytes(spec: Spec, shape: TargetShape, act: DType, with_gate: bool = False) -> int:
    """Per-token inputs one step reads (value, key, query, decay, rate, weight and mix inputs, rotary angles, optional
    gate)."""
    a = act.itemsize
    total = shape.heads * shape.value_dim * a + 2 * shape.key_heads * shape.rank * shape.key_dim * a
    decay_width = shape.key_dim if spec.decay.granularity is DecayGranularity.CHANNEL else 1
    total += shape.heads * decay_width * a
    per_head = (spec.update.weight_input, spec.decay.token_rate, spec.update.mix_input)
    total += sum(shape.heads * a for present in per_head if present)
    if spec.rotary:
        total += spec.rotary.angles(shape.key_dim) * a
    if with_gate and spec.readout.gate is not None:
        total += shape.heads * shape.value_dim * a
    return total


def output_bytes(shape: TargetShape, act: DType) -> int:
    return shape.heads * shape.value_dim * act.itemsize


def baseline_decode_bytes(spec: Spec, shape: TargetShape, act: DType, with_gate: bool = False) -> StepBytes:
    s = state_bytes(spec, shape) + carried_bytes(spec, shape)
    return StepBytes(s, s, 0.0, 0.0, input_bytes(spec, shape, act, with_gate), output_bytes(shape, act))


def replay_decode_bytes(spec: Spec, shape: TargetShape, act: DType, flush_at: int | None = None, with_gate: bool = False) -> StepBytes:
    """Average bytes per step over a flush cycle of `flush_at` steps (default: the capacity L)."""
    period = flush_at or shape.capacity
    s = state_bytes(spec, shape)
    entry = entry_bytes(spec, shape, act)
    mean_entries = (period - 1) / 2 + (1 if spec.carries else 0)  # and the entry the checkpoint carries
    return StepBytes(
        state_read=s,
        state_write=s / period,
        buffer_read=mean_entries * entry + CURSOR_BYTES,
        buffer_write=(1 if spec.carries else (period - 1) / period) * entry + CURSOR_BYTES,  # a carrying flush appends too
        inputs=input_bytes(spec, shape, act, with_gate),
        outputs=output_bytes(shape, act),
    )


def speedup_bound(spec: Spec, shape: TargetShape, act: DType, flush_at: int | None = None) -> float:
    """Baseline bytes over replay bytes: the speedup at equal bandwidth efficiency."""
    return baseline_decode_bytes(spec, shape, act).total / replay_decode_bytes(spec, shape, act, flush_at).total


def slot_memory(spec: Spec, shape: TargetShape, act: DType) -> SlotMemory:
    s = state_bytes(spec, shape)
    cursors = shape.heads * -(-shape.value_dim // CURSOR_GRAIN) * CURSOR_BYTES
    ring = shape.capacity + shape.window  # L + T positions (see the kernels' RING)
    return SlotMemory(baseline=s + carried_bytes(spec, shape), replay_checkpoint=s, replay_buffers=ring * entry_bytes(spec, shape, act), replay_cursor=cursors)


def verify_flushes(shape: TargetShape, tokens: int, committed: int, flush_at: int = 0) -> bool:
    """Whether a verify step of `tokens` tokens that finds `committed` entries buffered folds them into the checkpoint
    first: when h + 2T > L (the flush rule), or when h >= flush_at (a replay verify config's flush_at; 0 means L,
    which the rule always reaches first)."""
    return committed + 2 * tokens > shape.capacity or committed >= (flush_at or shape.capacity)


def verify_flush_period(shape: TargetShape, tokens: int, accepted: int, flush_at: int = 0) -> tuple[int, ...]:
    """Buffered entries h at the start of each verify step over one steady-state cycle, when every
    step accepts `accepted` tokens (see `verify_flushes`)."""
    h, seen, history = 0, {}, []
    while h not in seen:
        seen[h] = len(history)
        history.append(h)
        if verify_flushes(shape, tokens, h, flush_at):
            h = 0
        h += accepted
    return tuple(history[seen[h]:])


def replay_verify_bytes(spec: Spec, shape: TargetShape, act: DType, tokens: int, accepted: int | None = None, flush_at: int = 0) -> StepBytes:
    """Average bytes per verify (+ commit) step over a steady-state cycle; `accepted` defaults to all T tokens;
    `flush_at` is the verify config's (see `verify_flushes`)."""
    accepted = tokens if accepted is None else accepted
    cycle = verify_flush_period(shape, tokens, accepted, flush_at)
    s = state_bytes(spec, shape)
    entry = entry_bytes(spec, shape, act)
    flushes = sum(verify_flushes(shape, tokens, h, flush_at) for h in cycle)
    return StepBytes(
        state_read=s,
        state_write=s * flushes / len(cycle),
        buffer_read=entry * sum(cycle) / len(cycle) + 2 * CURSOR_BYTES,
        buffer_write=entry * tokens + 2 * CURSOR_BYTES,
        inputs=tokens * input_bytes(spec, shape, act),
        outputs=tokens * output_bytes(shape, act),
    )


def baseline_verify_bytes(spec: Spec, shape: TargetShape, act: DType, tokens: int) -> StepBytes:
    """Per-draft-snapshot verify: read the committed snapshot, write one snapshot per token."""
    s = state_bytes(spec, shape) + carried_bytes(spec, shape)
    return StepBytes(s, tokens * s, 0.0, 0.0, tokens * input_bytes(spec, shape, act), tokens * output_bytes(shape, act))


def best_verify_capacity(spec: Spec, shape: TargetShape, act: DType, tokens: int, max_ring: int = 32, slack: float = 0.02) -> int:
    """Buffer capacity for windows of T tokens: the smallest L >= 2T with a ring of L + T positions a power of two
    (the kernels pad the ring tile to one) whose bytes per verify step (every token accepted) are within `slack` of
    the fewest; rings of at most `max_ring` positions (or the smallest ring that holds L = 2T, for long windows),
    because the verify kernel's register tiles grow with the ring while the bytes barely move."""
    from dataclasses import replace

    largest = max(max_ring, 1 << (3 * tokens - 1).bit_length())
    candidates = [(1 << b) - tokens for b in range(1, largest.bit_length()) if 2 * tokens <= (1 << b) - tokens]
    cost = {L: replay_verify_bytes(spec, replace(shape, capacity=L), act, tokens).total for L in candidates}
    fewest = min(cost.values())
    return min(L for L in candidates if cost[L] <= (1 + slack) * fewest)


@dataclass(frozen=True)
class SpeculativeMemory:
    """Bytes per sequence slot of one layer's state for windows of `tokens` draft tokens."""

    tokens: int
    decode: int  # one state and its carried entries: plain decode
    snapshots: int  # one of those per window token: the per-draft-snapshot verify
    replay: int  # checkpoint, buffers of the shape's ring of L + T entries, cursors

    def sequences(self, budget: int = STATE_BUDGET_BYTES) -> tuple[int, int, int]:
        """The most sequences `budget` bytes hold: (plain decode, snapshot verify, replay)."""
        return budget // self.decode, budget // self.snapshots, budget // self.replay


def speculative_memory(spec: Spec, shape: TargetShape, act: DType, tokens: int) -> SpeculativeMemory:
    """`SpeculativeMemory` of the shape (its state dtype, its ring) for windows of `tokens`."""
    decode = state_bytes(spec, shape) + carried_bytes(spec, shape)
    return SpeculativeMemory(tokens, decode, tokens * decode, slot_memory(spec, shape, act).replay)
