"""Memory-traffic model: the fewest bytes each kernel must move per decode step, and memory per slot.

Per batch row. Weights (A_log, dt_bias, D, ...) are a few bytes per head shared by
the whole batch and are left out. Replay numbers are averages over one flush
cycle of `flush_at` steps: the buffer holds h = 0 .. flush_at-1 entries at the
start of the steps, and the state is written once per cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from replaygen.spec.model import CacheField, DecayGranularity, DType, Spec, TargetShape

CURSOR_BYTES = 8  # int32 start + count


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
    return shape.heads * shape.value_dim * shape.key_dim * spec.state.dtype.itemsize


def entry_bytes(spec: Spec, shape: TargetShape, act: DType) -> int:
    """Bytes of one ring-buffer entry (all cached fields, all heads)."""
    total = 0
    for cached in spec.cache:
        size = (cached.dtype or act).itemsize
        if cached.field in (CacheField.VALUE, CacheField.CORRECTED_VALUE):
            total += shape.heads * shape.value_dim * size
        elif cached.field is CacheField.KEY:
            total += shape.key_heads * shape.key_dim * size
        elif cached.field is CacheField.LOG_DECAY:
            width = shape.key_dim if spec.decay.granularity is DecayGranularity.CHANNEL else 1
            total += shape.heads * width * size
        else:
            total += shape.heads * size
    return total


def input_bytes(spec: Spec, shape: TargetShape, act: DType, with_gate: bool = False) -> int:
    """Per-token inputs one step reads (value, key, query, decay and weight inputs, optional gate)."""
    a = act.itemsize
    total = shape.heads * shape.value_dim * a + 2 * shape.key_heads * shape.key_dim * a
    decay_width = shape.key_dim if spec.decay.granularity is DecayGranularity.CHANNEL else 1
    total += shape.heads * decay_width * a
    if spec.update.weight_input:
        total += shape.heads * a
    if with_gate and spec.readout.gate is not None:
        total += shape.heads * shape.value_dim * a
    return total


def output_bytes(shape: TargetShape, act: DType) -> int:
    return shape.heads * shape.value_dim * act.itemsize


def baseline_decode_bytes(spec: Spec, shape: TargetShape, act: DType, with_gate: bool = False) -> StepBytes:
    s = state_bytes(spec, shape)
    return StepBytes(s, s, 0.0, 0.0, input_bytes(spec, shape, act, with_gate), output_bytes(shape, act))


def replay_decode_bytes(spec: Spec, shape: TargetShape, act: DType, flush_at: int | None = None, with_gate: bool = False) -> StepBytes:
    """Average bytes per step over a flush cycle of `flush_at` steps (default: the capacity L)."""
    period = flush_at or shape.capacity
    s = state_bytes(spec, shape)
    entry = entry_bytes(spec, shape, act)
    mean_entries = (period - 1) / 2
    return StepBytes(
        state_read=s,
        state_write=s / period,
        buffer_read=mean_entries * entry + CURSOR_BYTES,
        buffer_write=(period - 1) / period * entry + CURSOR_BYTES,
        inputs=input_bytes(spec, shape, act, with_gate),
        outputs=output_bytes(shape, act),
    )


def speedup_bound(spec: Spec, shape: TargetShape, act: DType, flush_at: int | None = None) -> float:
    """Baseline bytes over replay bytes: the speedup at equal bandwidth efficiency."""
    return baseline_decode_bytes(spec, shape, act).total / replay_decode_bytes(spec, shape, act, flush_at).total


def slot_memory(spec: Spec, shape: TargetShape, act: DType) -> SlotMemory:
    s = state_bytes(spec, shape)
    return SlotMemory(baseline=s, replay_checkpoint=s, replay_buffers=shape.capacity * entry_bytes(spec, shape, act), replay_cursor=CURSOR_BYTES + 4)
