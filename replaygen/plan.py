"""Planning: spec + target shape + configs -> everything a template needs, decided in Python.

Templates only read a `ModulePlan`; every choice (which inputs exist, which
transforms run, buffer layout, constexpr sizes, dispatch tables) is made here.
"""

from __future__ import annotations

from dataclasses import dataclass

from replaygen.configs import FLUSH_NUM_WARPS, MIN_DOT, BucketConfig, KernelConfig, KernelKind, validate_config
from replaygen.errors import UnsupportedShapeError
from replaygen.spec.model import (
    CacheField,
    DecayForm,
    DecayGranularity,
    DType,
    QueryScale,
    Spec,
    StateLayout,
    TargetShape,
    UpdateKind,
    VectorTransform,
)

TORCH_DTYPES = {DType.FLOAT32: "torch.float32", DType.BFLOAT16: "torch.bfloat16", DType.FLOAT16: "torch.float16"}


@dataclass(frozen=True)
class BufferField:
    """One ring-buffer tensor of the replay state: `[slots, rows, capacity, width]`."""

    field: CacheField
    attr: str  # attribute name on the generated ReplayState
    per_key_head: bool  # rows = key heads (else heads)
    width: int  # entries' trailing size (1 for per-head scalars)
    dtype: DType | None  # None: the activation dtype chosen at allocation


@dataclass(frozen=True)
class TensorArg:
    """A per-token input or weight of the generated API, with its logical shape."""

    name: str
    shape: tuple[str, ...]  # symbols, e.g. ("batch", "H", "P")
    sizes: tuple[int, ...]  # sizes of the non-batch dims
    optional: bool = False


@dataclass(frozen=True)
class ModulePlan:
    spec: Spec
    shape: TargetShape
    gpu: str
    configs: dict[KernelKind, tuple[BucketConfig, ...]]
    config_source: str  # "defaults" or the tuning record it came from
    # sizes
    block_k: int
    block_r: int  # ring tile rows: RING = capacity + window positions, at least MIN_DOT (fold_dot)
    score_tokens: int  # window tile rows of the largest window: max(2, next_pow2(window))
    state_stride_v: int
    state_stride_k: int
    # recurrence switches
    channel_decay: bool
    decay_from_preactivation: bool
    has_direct_decay: bool
    weight_kind: str  # "decay_dt" | "sigmoid" | "one"
    has_direct_weight: bool
    delta_rule: bool
    key_l2norm: bool
    query_l2norm: bool
    key_eps: float
    query_eps: float
    query_scale: float  # 1.0 when unscaled
    has_skip: bool
    has_gate: bool
    gate_optional: bool
    flags: tuple[tuple[str, str], ...]  # constexpr switches of the optional inputs: (switch, the input that sets it)
    fold_leftovers_in_memory: bool  # flush-every-step decode: see leftovers_in_memory
    # some replay decode bucket runs several warps per program: a flush-every-step step that meets leftover entries
    # then folds them with the cursor it read and moves the cursor after a barrier (no warp reads it after another
    # warp wrote it); one-warp programs keep the fold's own cursor read and write, so their records stay valid
    decode_multi_warp: bool
    # a barrier before the stores of a program that read its cursor with several warps (no warp that falls behind
    # reads a cursor another warp of its program moved): some replay decode bucket buffers (flush_at != 1) with
    # several warps; some decode bucket flushes in its own launch (FLUSH_NUM_WARPS warps); some replay verify bucket
    # runs several warps (num_warps, or window_warps in the split's window half). Flags, not per-config code, so the
    # one-warp configs' records keep their source hashes
    decode_buffers_multi_warp: bool
    separate_flush: bool
    verify_multi_warp: bool
    early_launch: bool  # some replay decode or verify bucket launches early: the kernels take EARLY_WAIT (KernelConfig.early_launch)
    # some bucket of the kind prefetches its fold's keys: that kind's kernel takes PREFETCH_FOLD_KEYS (KernelConfig.prefetch_fold_keys);
    # per kind, so one kind's buckets never change the other kind's kernel text (and its records' source hashes)
    decode_prefetches_fold_keys: bool
    verify_prefetches_fold_keys: bool
    verify_flush_at: bool  # some replay verify bucket also folds at h >= flush_at: the verify kernel takes FLUSH_AT
    verify_early_commit: bool  # some replay verify bucket launches its commit early: the commit kernel takes EARLY_WAIT
    # API
    step_inputs: tuple[TensorArg, ...]
    weights: tuple[TensorArg, ...]
    buffers: tuple[BufferField, ...]

    @property
    def module_name(self) -> str:
        return f"{self.spec.name}_{self.shape.ident}"

    @property
    def keys_across_lanes(self) -> bool:
        """Whether a state tile's lanes run along the key (key-contiguous storage, [value, key]): a [BLOCK_K] vector
        then holds a few values per thread and a [BLOCK_V] vector every value in each thread, so scalar factors of a
        rank-1 term are cheapest on the key."""
        return self.state_stride_k == 1

    def config_table(self, kind: KernelKind) -> tuple[BucketConfig, ...]:
        return self.configs[kind]


def plan_module(
    spec: Spec,
    shape: TargetShape,
    gpu: str,
    configs: dict[KernelKind, tuple[BucketConfig, ...]],
    config_source: str,
) -> ModulePlan:
    """Derive the rendering plan of one generated module (all kernels of one shape)."""
    for kind, table in configs.items():
        if not table or table[-1].max_batch is not None:
            raise UnsupportedShapeError(f"{kind.value}: a dispatch table must end with an open-ended bucket")
        for bucket in table:
            validate_config(kind, shape, bucket.config)
            if bucket.config.precompute_scores and spec.decay.granularity is DecayGranularity.CHANNEL:
                raise UnsupportedShapeError(f"{kind.value}: precompute_scores needs a per-head decay (per-channel decay weighs the keys' channels)")
    missing = set(KernelKind) - set(configs)
    if missing:
        raise UnsupportedShapeError(f"no configs for kernels: {', '.join(sorted(k.value for k in missing))}")
    step_inputs, weights = api_tensors(spec, shape)
    channel = spec.decay.granularity is DecayGranularity.CHANNEL
    value_key = spec.state.layout is StateLayout.VALUE_KEY
    return ModulePlan(
        spec=spec,
        shape=shape,
        gpu=gpu,
        configs=dict(configs),
        config_source=config_source,
        block_k=_next_pow2(shape.key_dim),
        block_r=max(MIN_DOT, _next_pow2(shape.capacity + shape.window)),
        score_tokens=max(2, _next_pow2(shape.window)),
        state_stride_v=shape.key_dim if value_key else 1,
        state_stride_k=1 if value_key else shape.value_dim,
        channel_decay=channel,
        decay_from_preactivation=spec.decay.form is DecayForm.NEG_EXP_SOFTPLUS,
        has_direct_decay=spec.decay.direct_input is not None,
        weight_kind=spec.update.weight.value,
        has_direct_weight=spec.update.weight_direct_input is not None,
        delta_rule=spec.update.kind is UpdateKind.DELTA,
        key_l2norm=spec.key.transform is VectorTransform.L2NORM,
        query_l2norm=spec.query.transform is VectorTransform.L2NORM,
        key_eps=spec.key.eps,
        query_eps=spec.query.eps,
        query_scale=shape.key_dim**-0.5 if spec.query.scale is QueryScale.INV_SQRT_KEY_DIM else 1.0,
        has_skip=spec.readout.skip is not None,
        has_gate=spec.readout.gate is not None,
        gate_optional=spec.readout.gate is not None and spec.readout.gate.optional,
        flags=optional_input_flags(spec),
        fold_leftovers_in_memory=leftovers_in_memory(spec),
        decode_multi_warp=any(b.config.num_warps > 1 for b in configs[KernelKind.REPLAY_DECODE]),
        decode_buffers_multi_warp=any(b.config.num_warps > 1 and b.config.flush_at != 1 for b in configs[KernelKind.REPLAY_DECODE]),
        separate_flush=FLUSH_NUM_WARPS > 1 and any(not b.config.fused_flush for b in configs[KernelKind.REPLAY_DECODE]),
        verify_multi_warp=any(max(b.config.num_warps, b.config.window_warps) > 1 for b in configs[KernelKind.REPLAY_VERIFY]),
        early_launch=any(b.config.early_launch for kind in (KernelKind.REPLAY_DECODE, KernelKind.REPLAY_VERIFY) for b in configs[kind]),
        decode_prefetches_fold_keys=any(b.config.prefetch_fold_keys for b in configs[KernelKind.REPLAY_DECODE]),
        verify_prefetches_fold_keys=any(b.config.prefetch_fold_keys for b in configs[KernelKind.REPLAY_VERIFY]),
        verify_flush_at=any(b.config.flush_at for b in configs[KernelKind.REPLAY_VERIFY]),
        verify_early_commit=any(b.config.early_commit for b in configs[KernelKind.REPLAY_VERIFY]),
        step_inputs=step_inputs,
        weights=weights,
        buffers=_buffers(spec, shape),
    )


def optional_input_flags(spec: Spec) -> tuple[tuple[str, str], ...]:
    """The kernels' constexpr switches for the optional inputs, each with the input whose presence sets it: kernel
    parameters and launch arguments are both rendered from this one list."""
    flags = []
    if spec.decay.direct_input is not None:
        flags.append(("USE_DIRECT_DECAY", spec.decay.direct_input))
    if spec.update.weight_direct_input is not None:
        flags.append(("USE_DIRECT_WEIGHT", spec.update.weight_direct_input))
    if spec.readout.gate is not None and spec.readout.gate.optional:
        flags.append(("USE_GATE", spec.readout.gate.input))
    return tuple(flags)


def leftovers_in_memory(spec: Spec) -> bool:
    """How flush-every-step decode (flush_at=1) handles entries that a larger flush_at left in a row's buffer. True:
    they are folded into the checkpoint in memory before the step, whose inputs load after that check (the fold's
    registers end at its store). False: the step runs as if nothing were buffered and its state store skips such
    tiles; then an out-of-line function folds their entries into the checkpoint in memory, a few value rows per
    call, and the step is redone from it. Measured (docs/perf.md entries 24, 26 and 27): in memory brings Mamba-2 at
    batch 1-8 from 0.91-0.98x of the baseline to 0.96-1.07x (H100); folding after the step is 2-7% slower there.
    Where the step normalizes its key and query (GDN), the normalization would wait for the check (0.85-0.92x,
    H200); folding after the step keeps it ahead of the check, and the out-of-line fold keeps the kernel's registers
    near the baseline's (H100)."""
    return not (spec.key.transform is VectorTransform.L2NORM or spec.query.transform is VectorTransform.L2NORM)


def api_tensors(spec: Spec, shape: TargetShape) -> tuple[tuple[TensorArg, ...], tuple[TensorArg, ...]]:
    """The per-token inputs and the weights of the generated API, in argument order."""
    d = spec.dims
    channel = spec.decay.granularity is DecayGranularity.CHANNEL
    decay_shape = ("batch", d.heads, d.key_dim) if channel else ("batch", d.heads)
    decay_sizes = (shape.heads, shape.key_dim) if channel else (shape.heads,)
    inputs = [
        TensorArg(spec.inputs.value, ("batch", d.heads, d.value_dim), (shape.heads, shape.value_dim)),
        TensorArg(spec.inputs.key, ("batch", d.key_heads, d.key_dim), (shape.key_heads, shape.key_dim)),
        TensorArg(spec.inputs.query, ("batch", d.key_heads, d.key_dim), (shape.key_heads, shape.key_dim)),
        TensorArg(spec.decay.input, decay_shape, decay_sizes, optional=spec.decay.direct_input is not None),
    ]
    if spec.decay.direct_input:
        inputs.append(TensorArg(spec.decay.direct_input, decay_shape, decay_sizes, optional=True))
    if spec.update.weight_input:
        optional = spec.update.weight_direct_input is not None
        inputs.append(TensorArg(spec.update.weight_input, ("batch", d.heads), (shape.heads,), optional=optional))
    if spec.update.weight_direct_input:
        inputs.append(TensorArg(spec.update.weight_direct_input, ("batch", d.heads), (shape.heads,), optional=True))
    if spec.readout.gate:
        inputs.append(TensorArg(spec.readout.gate.input, ("batch", d.heads, d.value_dim), (shape.heads, shape.value_dim), optional=spec.readout.gate.optional))
    weights = []
    if spec.decay.rate:
        weights.append(TensorArg(spec.decay.rate, (d.heads,), (shape.heads,)))
    if spec.decay.bias:
        bias_shape = (d.heads, d.key_dim) if channel else (d.heads,)
        weights.append(TensorArg(spec.decay.bias, bias_shape, (shape.heads, shape.key_dim) if channel else (shape.heads,)))
    if spec.readout.skip:
        weights.append(TensorArg(spec.readout.skip, (d.heads,), (shape.heads,)))
    return tuple(inputs), tuple(weights)


def _buffers(spec: Spec, shape: TargetShape) -> tuple[BufferField, ...]:
    channel = spec.decay.granularity is DecayGranularity.CHANNEL
    fields = []
    for cached in spec.cache:
        f = cached.field
        if f in (CacheField.VALUE, CacheField.CORRECTED_VALUE):
            fields.append(BufferField(f, "buf_value", False, shape.value_dim, cached.dtype))
        elif f is CacheField.KEY:
            fields.append(BufferField(f, "buf_key", True, shape.key_dim, cached.dtype))
        elif f is CacheField.LOG_DECAY:
            fields.append(BufferField(f, "buf_log_decay", False, shape.key_dim if channel else 1, cached.dtype))
        elif f is CacheField.WEIGHT:
            fields.append(BufferField(f, "buf_weight", False, 1, cached.dtype))
    return tuple(fields)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

