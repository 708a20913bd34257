"""Planning: spec + target shape + configs -> everything a template needs, decided in Python.

Templates only read a `ModulePlan`; every choice (which inputs exist, which transforms run, buffer layout,
constexpr sizes, dispatch tables, how spec names are spelled in generated code) is made here.
"""

from __future__ import annotations

from dataclasses import dataclass

from replaygen.configs import MIN_DOT, BucketConfig, KernelKind, Route, shares_scores, spec_traits, validate_config
from replaygen.errors import UnsupportedShapeError
from replaygen.spec.model import (
    CacheField,
    ConvActivation,
    ConvChannels,
    DecayForm,
    DecayGranularity,
    DType,
    QueryScale,
    RotaryPairing,
    Rounding,
    Spec,
    StateLayout,
    TargetShape,
    UpdateKind,
    VectorTransform,
)

TORCH_DTYPES = {DType.FLOAT32: "torch.float32", DType.BFLOAT16: "torch.bfloat16", DType.FLOAT16: "torch.float16"}
# Generated code spells a spec's input or weight NAME as PREFIX + NAME everywhere but in the public functions'
# keyword parameters, so no spec name can collide with an identifier of the templates (which never start with it).
SPEC_NAME_PREFIX = "in_"


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

    name: str  # the spec's name: the public keyword parameter
    shape: tuple[str, ...]  # symbols, e.g. ("batch", "H", "P")
    sizes: tuple[int, ...]  # sizes of the non-batch dims
    optional: bool = False
    activation: bool = False  # in the activation dtype (value, key, query, gate); else any float dtype
    ranked: bool = False  # a step input [batch, R, heads, ...] (key and query at rank R > 1): the kernels take a rank stride

    @property
    def param(self) -> str:
        """How generated code other than the public signatures spells it."""
        return SPEC_NAME_PREFIX + self.name


@dataclass(frozen=True)
class Roles:
    """The kernel spelling (TensorArg.param) of the tensor in each role of the recurrence; None where the spec has none."""

    value: str
    key: str
    query: str
    decay_input: str
    decay_rate: str | None
    decay_bias: str | None
    direct_decay: str | None
    weight_input: str | None
    direct_weight: str | None
    skip: str | None
    gate: str | None
    rate_input: str | None = None  # the per-token decay rate (decay.token_rate)
    mix_input: str | None = None  # the trapezoid's mix
    angle_input: str | None = None  # the rotary angle input
    key_weight: str | None = None  # the key's normalisation weight and per-head bias
    key_bias: str | None = None
    query_weight: str | None = None
    query_bias: str | None = None
    value_scale: str | None = None  # the rank weights (shapes of rank > 1)
    gate_scale: str | None = None
    output_scale: str | None = None


@dataclass(frozen=True)
class OptionalInput:
    """A kernel constexpr switch set where an optional input is given."""

    flag: str  # e.g. USE_GATE
    input_index: int  # position of the input among the step inputs


@dataclass(frozen=True)
class ExclusivePair:
    """Two step inputs of which a call passes exactly one (a pre-activation and the value it gives, passed directly)."""

    first: int  # positions among the step inputs
    second: int
    message: str


@dataclass(frozen=True)
class StochasticGrid:
    """Where a 16-bit dtype's values lie, for rounding float32 onto them: `mantissa_bits` below the leading one, at
    float32 exponent fields from `min_exponent` up (below it, the grid of that exponent: the dtype's subnormals)."""

    mantissa_bits: int
    min_exponent: int


# float16: 10 mantissa bits, normal from 2^-14 (exponent field 113), subnormal steps of 2^-24 below. bfloat16: 7 bits,
# float32's exponent range; its grid is taken as 2^-126 below 2^-119 (field 8) so that every step is a float32 normal.
STOCHASTIC_GRIDS = {DType.FLOAT16: StochasticGrid(10, 113), DType.BFLOAT16: StochasticGrid(7, 8)}


@dataclass(frozen=True)
class ConvPlan:
    """The conv kernel of a spec with a conv: packed channels [CHANNELS], a ring of the last W - 1 + T pre-conv
    inputs per slot, and one cursor copy per block of BLOCK_C channels (each program owns its own)."""

    width: int
    silu: bool
    channels: int  # C: the packed channels (value H * P, key and query G * N each, in the spec's order)
    layout: str  # the packed order, e.g. "x (H*P), B (G*N), C (G*N)"
    ring: int  # W - 1 + T positions per channel
    block_c: int
    num_warps: int

    @property
    def cursor_blocks(self) -> int:
        return -(-self.channels // self.block_c)


@dataclass(frozen=True)
class RotaryPlan:
    """The rotary transform: ANGLES pairs of channels per head, (i, i + key_dim / 2) where `halves`, else (2i, 2i + 1)."""

    angles: int
    halves: bool


@dataclass(frozen=True)
class CarriedField:
    """A tensor a recurrence carries per slot beside its state (the module's SlotStates), float32."""

    name: str  # its attribute, e.g. "angle"
    shape: tuple[str, ...]  # symbols of its trailing dims
    sizes: tuple[int, ...]  # its trailing sizes per slot
    doc: str  # what it holds


# The conv kernel's launch: it moves a few bytes per channel and token (reads W - 1 + T, writes T), so wide blocks of
# channels and no tuning; a spec's conv kernels take these.
CONV_BLOCK_C = 256
CONV_NUM_WARPS = 4


@dataclass(frozen=True)
class ModulePlan:
    spec: Spec
    shape: TargetShape
    gpu: str
    configs: dict[KernelKind, tuple[BucketConfig, ...]]
    config_source: str  # where the configs came from: "defaults" or the tuning record
    # sizes
    block_k: int
    block_r: int  # ring tile rows: RING = capacity + window positions, at least MIN_DOT (fold_dot)
    block_l: int  # entry tile rows: the capacity's entries in buffer order, at least MIN_DOT (the fold product)
    score_tokens: int  # window tile rows of the largest window: max(2, next_pow2(window))
    state_stride_v: int
    state_stride_k: int
    # recurrence switches
    channel_decay: bool
    decay_from_preactivation: bool
    decay_bound: float | None  # form lower_bound_sigmoid: log a = bound * sigmoid(exp(rate) * (input + bias)); None: -exp(rate) * softplus(...)
    weight_kind: str  # "decay_dt" | "sigmoid" | "one"
    delta_rule: bool
    key_l2norm: bool
    query_l2norm: bool
    key_eps: float
    query_eps: float
    query_scale: float  # 1.0 when unscaled
    gate_optional: bool
    optional_inputs: tuple[OptionalInput, ...]
    exclusive_pairs: tuple[ExclusivePair, ...]
    fold_leftovers_in_memory: bool  # flush-every-step decode: see leftovers_in_memory
    # stochastic rounding of a 16-bit state: its mantissa bits and the lowest float32 exponent field rounded on the
    # state dtype's own grid (None: every state store rounds to nearest)
    stochastic_rounding: StochasticGrid | None
    rounding_row_stride: int  # the random streams' counters per state row: key_dim rounded up to a multiple of 8
    # API
    roles: Roles
    step_inputs: tuple[TensorArg, ...]
    weights: tuple[TensorArg, ...]
    buffers: tuple[BufferField, ...]
    state_identity: str  # what a replay state's buffers mean (see state_identity)
    conv: ConvPlan | None = None  # the conv kernel, where the spec has a conv
    key_rmsnorm: bool = False  # the key / query normalised by their root mean square (key_eps, query_eps)
    query_rmsnorm: bool = False
    token_rate: str | None = None  # the decay rate per token: "heavy_tail" or "exp" of its input, at least rate_floor
    rate_floor: float = 0.0
    trapezoid: bool = False  # the trapezoid update: each step also adds its carry weight times the previous entry
    rotary: RotaryPlan | None = None  # the rotary transform of key and query, the angle carried per head
    keys_per_head: bool = False  # transformed keys differ per head (a per-head bias or angle): the key ring has a row per head
    carried: tuple[CarriedField, ...] = ()  # what the recurrence carries beside the state (see carried_fields)
    shared_scores: bool = True  # the scores kernel is rendered: one key per key head and step (configs.shares_scores)
    key_tiles: bool = False  # the key-tiled replay decode and verify (block_k) are rendered (configs.SpecTraits.key_tiles)
    rank: int = 1  # R: keys and queries per token (above 1: rows of rank tiles, the rank weights)
    block_rank: int = 1  # the rank tiles' rows: next_pow2(R)

    @property
    def module_name(self) -> str:
        return f"{self.spec.name}_{self.shape.ident}"

    @property
    def ranked(self) -> bool:
        """Whether a step has R > 1 keys and queries: key and query tiles get a row per rank (and, in a window, per
        token and rank), updates and readouts sum over ranks with the rank weights."""
        return self.rank > 1

    @property
    def anchored(self) -> bool:
        """Whether the ring keeps, in the row before its oldest entry, the entry the checkpoint carries (the
        trapezoid's previous value and key, the angle): every flush then leaves its newest entry there, and a
        rollback of drafts rolls the carried entry back with the cursor."""
        return bool(self.carried)

    @property
    def keys_across_lanes(self) -> bool:
        """Whether a state tile's lanes run along the key (key-contiguous storage, [value, key]): a [BLOCK_K] vector
        then holds a few values per thread and a [BLOCK_V] vector every value in each thread, so scalar factors of a
        rank-1 term are cheapest on the key."""
        return self.state_stride_k == 1


def plan_module(
    spec: Spec,
    shape: TargetShape,
    gpu: str,
    configs: dict[KernelKind, tuple[BucketConfig, ...]],
    config_source: str,
) -> ModulePlan:
    """Derive the rendering plan of one generated module (all kernels of one shape; UnsupportedShapeError where the
    shape does not fit the spec, `Spec.resolve`)."""
    shape = spec.resolve(shape)
    for kind, table in configs.items():
        if not table or table[-1].max_batch is not None:
            raise UnsupportedShapeError(f"{kind.value}: a dispatch table must end with an open-ended bucket")
        for bucket in table:
            validate_config(kind, shape, bucket.config)
            if bucket.config.precompute_scores and spec.decay.granularity is DecayGranularity.CHANNEL:
                raise UnsupportedShapeError(f"{kind.value}: precompute_scores needs a per-head decay (per-channel decay weighs the keys' channels)")
            if bucket.config.block_k and not spec_traits(spec, shape).key_tiles:
                raise UnsupportedShapeError(
                    f"{kind.value}: block_k slices the state and the key along the key axis: it needs one key per key head and step with no"
                    " carried entry, and key and query transforms that scale the raw vector by one factor (none, or l2norm without a weight)"
                )
            if bucket.config.block_k and not spec_traits(spec, shape).output_only_key_tiles and bucket.config.route is Route.OUTPUT_ONLY:
                raise UnsupportedShapeError(
                    f"{kind.value}: block_k with a decay per key channel runs the state_and_output route only (the output-only route"
                    " reads the entries through their scores, sums over the whole key axis)"
                )
            if bucket.config.precompute_scores and not shares_scores(spec, shape):
                raise UnsupportedShapeError(
                    f"{kind.value}: precompute_scores scores one key per key head and step, but this spec's keys differ per head or rank,"
                    " or its steps carry an entry the scores leave out"
                )
            if bucket.config.fold_dot and shape.rank > 1:
                raise UnsupportedShapeError(f"{kind.value}: fold_dot folds one key per entry; a shape of rank {shape.rank} folds {shape.rank}")
            if kind in (KernelKind.BASELINE_DECODE, KernelKind.BASELINE_VERIFY) and spec.carries and bucket.config.block_v < shape.value_dim:
                raise UnsupportedShapeError(
                    f"{kind.value}: block_v={bucket.config.block_v} < value_dim={shape.value_dim}: the key and angle the recurrence carries are"
                    " one per head, read and rewritten by the one program of the head"
                )
    missing = set(KernelKind) - set(configs)
    if missing:
        raise UnsupportedShapeError(f"no configs for kernels: {', '.join(sorted(k.value for k in missing))}")
    step_inputs, weights = api_tensors(spec, shape)
    value_key = shape.layout is StateLayout.VALUE_KEY
    return ModulePlan(
        spec=spec,
        shape=shape,
        gpu=gpu,
        configs=dict(configs),
        config_source=config_source,
        block_k=_next_pow2(shape.key_dim),
        block_r=max(MIN_DOT, _next_pow2(shape.capacity + shape.window)),
        block_l=max(MIN_DOT, _next_pow2(shape.capacity)),
        score_tokens=max(2, _next_pow2(shape.window)),
        state_stride_v=shape.key_dim if value_key else 1,
        state_stride_k=1 if value_key else shape.value_dim,
        channel_decay=spec.decay.granularity is DecayGranularity.CHANNEL,
        decay_from_preactivation=spec.decay.form is not DecayForm.DIRECT,
        decay_bound=spec.decay.bound,
        weight_kind=spec.update.weight.value,
        delta_rule=spec.update.kind is UpdateKind.DELTA,
        key_l2norm=spec.key.transform is VectorTransform.L2NORM,
        query_l2norm=spec.query.transform is VectorTransform.L2NORM,
        key_eps=spec.key.eps,
        query_eps=spec.query.eps,
        query_scale=shape.key_dim**-0.5 if spec.query.scale is QueryScale.INV_SQRT_KEY_DIM else 1.0,
        gate_optional=spec.readout.gate is not None and spec.readout.gate.optional,
        optional_inputs=optional_inputs(spec, step_inputs),
        exclusive_pairs=exclusive_pairs(spec, step_inputs),
        fold_leftovers_in_memory=leftovers_in_memory(spec),
        stochastic_rounding=STOCHASTIC_GRIDS[shape.state_dtype] if shape.rounding is Rounding.STOCHASTIC else None,
        rounding_row_stride=-(-shape.key_dim // 8) * 8,
        roles=roles(spec, shape.rank > 1),
        step_inputs=step_inputs,
        weights=weights,
        buffers=buffers(spec, shape),
        state_identity=state_identity(spec, shape),
        conv=conv_plan(spec, shape),
        key_rmsnorm=spec.key.transform is VectorTransform.RMSNORM,
        query_rmsnorm=spec.query.transform is VectorTransform.RMSNORM,
        token_rate=spec.decay.token_rate.activation.value if spec.decay.token_rate else None,
        rate_floor=spec.decay.token_rate.floor if spec.decay.token_rate else 0.0,
        trapezoid=spec.update.kind is UpdateKind.TRAPEZOID,
        rotary=RotaryPlan(spec.rotary.angles(shape.key_dim), shape.rotary_pairing is RotaryPairing.HALVES) if spec.rotary else None,
        keys_per_head=spec.keys_per_head,
        carried=carried_fields(spec, shape),
        shared_scores=shares_scores(spec, shape),
        key_tiles=spec_traits(spec, shape).key_tiles,
        rank=shape.rank,
        block_rank=_next_pow2(shape.rank),
    )


def conv_plan(spec: Spec, shape: TargetShape) -> ConvPlan | None:
    """The conv kernel's sizes: the packed channels of the inputs that pass through the conv, in the spec's order."""
    conv = spec.conv
    if conv is None:
        return None
    d = spec.dims
    sizes = {
        ConvChannels.VALUE: (spec.inputs.value, f"{d.heads}*{d.value_dim}", shape.heads * shape.value_dim),
        ConvChannels.KEY: (spec.inputs.key, f"{d.key_heads}*{d.key_dim}", shape.key_heads * shape.key_dim),
        ConvChannels.QUERY: (spec.inputs.query, f"{d.key_heads}*{d.key_dim}", shape.key_heads * shape.key_dim),
    }
    channels = sum(sizes[c][2] for c in conv.channels)
    layout = ", ".join(f"{sizes[c][0]} ({sizes[c][1]})" for c in conv.channels)
    return ConvPlan(
        width=conv.width,
        silu=conv.activation is ConvActivation.SILU,
        channels=channels,
        layout=layout,
        ring=conv.width - 1 + shape.window,
        block_c=min(CONV_BLOCK_C, _next_pow2(channels)),
        num_warps=CONV_NUM_WARPS,
    )


def roles(spec: Spec, ranked: bool = False) -> Roles:
    """The kernel spellings of the spec's tensors; the rank weights where `ranked` (a shape of rank > 1 takes them)."""

    def param(name: str | None) -> str | None:
        return None if name is None else SPEC_NAME_PREFIX + name

    return Roles(
        value=param(spec.inputs.value),
        key=param(spec.inputs.key),
        query=param(spec.inputs.query),
        decay_input=param(spec.decay.input),
        decay_rate=param(spec.decay.rate),
        decay_bias=param(spec.decay.bias),
        direct_decay=param(spec.decay.direct_input),
        weight_input=param(spec.update.weight_input),
        direct_weight=param(spec.update.weight_direct_input),
        skip=param(spec.readout.skip),
        gate=param(spec.readout.gate.input if spec.readout.gate else None),
        rate_input=param(spec.decay.token_rate.input if spec.decay.token_rate else None),
        mix_input=param(spec.update.mix_input),
        angle_input=param(spec.rotary.angle_input if spec.rotary else None),
        key_weight=param(spec.key.weight),
        key_bias=param(spec.key.bias),
        query_weight=param(spec.query.weight),
        query_bias=param(spec.query.bias),
        value_scale=param(spec.ranks.value_scale if ranked else None),
        gate_scale=param(spec.ranks.gate_scale if ranked else None),
        output_scale=param(spec.ranks.output_scale if ranked else None),
    )


def carried_fields(spec: Spec, shape: TargetShape) -> tuple[CarriedField, ...]:
    """What the recurrence carries per slot beside the state: the rotary angles, and the trapezoid's previous entry
    (the value and the key as the update used it)."""
    d = spec.dims
    fields = []
    if spec.rotary:
        fields.append(CarriedField("angle", (d.heads, ANGLES_SYMBOL), (shape.heads, spec.rotary.angles(shape.key_dim)), "the rotary angle of each pair after the last step, in [0, 2 pi)"))
    if spec.update.kind is UpdateKind.TRAPEZOID:
        fields.append(CarriedField("last_value", (d.heads, d.value_dim), (shape.heads, shape.value_dim), "the last step's value"))
        key_shape = (d.heads, RANK_SYMBOL, d.key_dim) if shape.rank > 1 else (d.heads, d.key_dim)
        key_sizes = (shape.heads, shape.rank, shape.key_dim) if shape.rank > 1 else (shape.heads, shape.key_dim)
        fields.append(CarriedField("last_key", key_shape, key_sizes, "the last step's key as its update used it (transformed, per head)"))
    return tuple(fields)


def optional_inputs(spec: Spec, step_inputs: tuple[TensorArg, ...]) -> tuple[OptionalInput, ...]:
    """The kernels' constexpr switches for the optional inputs, each with the input whose presence sets it: kernel
    parameters and launch arguments are both rendered from this one list."""
    index = {t.name: i for i, t in enumerate(step_inputs)}
    switches = []
    if spec.decay.direct_input is not None:
        switches.append(OptionalInput("USE_DIRECT_DECAY", index[spec.decay.direct_input]))
    if spec.update.weight_direct_input is not None:
        switches.append(OptionalInput("USE_DIRECT_WEIGHT", index[spec.update.weight_direct_input]))
    if spec.readout.gate is not None and spec.readout.gate.optional:
        switches.append(OptionalInput("USE_GATE", index[spec.readout.gate.input]))
    return tuple(switches)


def exclusive_pairs(spec: Spec, step_inputs: tuple[TensorArg, ...]) -> tuple[ExclusivePair, ...]:
    """The inputs a spec offers two ways (a decay or weight as a pre-activation or directly): a call passes one."""
    index = {t.name: i for i, t in enumerate(step_inputs)}
    pairs = []
    if spec.decay.direct_input is not None:
        a, b = spec.decay.input, spec.decay.direct_input
        pairs.append(ExclusivePair(index[a], index[b], f"pass exactly one of {a} (pre-activation) and {b} (log decay)"))
    if spec.update.weight_direct_input is not None:
        a, b = spec.update.weight_input, spec.update.weight_direct_input
        pairs.append(ExclusivePair(index[a], index[b], f"pass exactly one of {a} (pre-activation) and {b} (weight)"))
    return tuple(pairs)


def leftovers_in_memory(spec: Spec) -> bool:
    """How flush-every-step decode (flush_at=1) handles entries that a larger flush_at left in a row's buffer. True:
    they are folded into the checkpoint in memory before the step, whose inputs load after that check. False: the
    step runs as if nothing were buffered and its state store skips such tiles; then an out-of-line function folds
    their entries into the checkpoint in memory, a few value rows per call, and the step is redone from it. Where
    the step normalizes its key or query, the normalization would otherwise wait for the check (docs/design.md,
    "Flush-every-step decode"); but where the step carries its previous entry or angle, which the newest buffered entry
    holds, it waits for the cursor anyway, and folds first."""
    normalised = spec.key.transform is VectorTransform.L2NORM or spec.query.transform is VectorTransform.L2NORM
    return spec.carries or not normalised


# Symbols of the rank and of the rotary angles in generated docstrings.
RANK_SYMBOL = "R"
ANGLES_SYMBOL = "A"


def api_tensors(spec: Spec, shape: TargetShape) -> tuple[tuple[TensorArg, ...], tuple[TensorArg, ...]]:
    """The per-token inputs and the weights of the generated API, in argument order."""
    d = spec.dims
    channel = spec.decay.granularity is DecayGranularity.CHANNEL
    decay_shape = ("batch", d.heads, d.key_dim) if channel else ("batch", d.heads)
    decay_sizes = (shape.heads, shape.key_dim) if channel else (shape.heads,)
    ranked = shape.rank > 1
    key_shape = ("batch", RANK_SYMBOL, d.key_heads, d.key_dim) if ranked else ("batch", d.key_heads, d.key_dim)
    key_sizes = (shape.rank, shape.key_heads, shape.key_dim) if ranked else (shape.key_heads, shape.key_dim)
    inputs = [
        TensorArg(spec.inputs.value, ("batch", d.heads, d.value_dim), (shape.heads, shape.value_dim), activation=True),
        TensorArg(spec.inputs.key, key_shape, key_sizes, activation=True, ranked=ranked),
        TensorArg(spec.inputs.query, key_shape, key_sizes, activation=True, ranked=ranked),
        TensorArg(spec.decay.input, decay_shape, decay_sizes, optional=spec.decay.direct_input is not None),
    ]
    if spec.decay.direct_input:
        inputs.append(TensorArg(spec.decay.direct_input, decay_shape, decay_sizes, optional=True))
    if spec.decay.token_rate:
        inputs.append(TensorArg(spec.decay.token_rate.input, ("batch", d.heads), (shape.heads,)))
    if spec.update.weight_input:
        optional = spec.update.weight_direct_input is not None
        inputs.append(TensorArg(spec.update.weight_input, ("batch", d.heads), (shape.heads,), optional=optional))
    if spec.update.weight_direct_input:
        inputs.append(TensorArg(spec.update.weight_direct_input, ("batch", d.heads), (shape.heads,), optional=True))
    if spec.update.mix_input:
        inputs.append(TensorArg(spec.update.mix_input, ("batch", d.heads), (shape.heads,)))
    if spec.rotary:
        inputs.append(TensorArg(spec.rotary.angle_input, ("batch", ANGLES_SYMBOL), (spec.rotary.angles(shape.key_dim),)))
    if spec.readout.gate:
        gate = spec.readout.gate
        inputs.append(TensorArg(gate.input, ("batch", d.heads, d.value_dim), (shape.heads, shape.value_dim), optional=gate.optional, activation=True))
    weights = []
    if spec.decay.rate:
        weights.append(TensorArg(spec.decay.rate, (d.heads,), (shape.heads,)))
    if spec.decay.bias:
        bias_shape = (d.heads, d.key_dim) if channel else (d.heads,)
        weights.append(TensorArg(spec.decay.bias, bias_shape, (shape.heads, shape.key_dim) if channel else (shape.heads,)))
    weights += transform_weights(spec, shape)
    if spec.readout.skip:
        weights.append(TensorArg(spec.readout.skip, (d.heads,), (shape.heads,)))
    weights += rank_weights(spec, shape)
    return tuple(inputs), tuple(weights)


def transform_weights(spec: Spec, shape: TargetShape) -> list[TensorArg]:
    """The key's and then the query's normalisation weight [key_dim] and per-head bias [heads, key_dim] (at rank R > 1
    [heads, R, key_dim]), where the spec has them."""
    d = spec.dims
    ranked = shape.rank > 1
    bias_shape = (d.heads, RANK_SYMBOL, d.key_dim) if ranked else (d.heads, d.key_dim)
    bias_sizes = (shape.heads, shape.rank, shape.key_dim) if ranked else (shape.heads, shape.key_dim)
    weights = []
    for vector in (spec.key, spec.query):
        if vector.weight:
            weights.append(TensorArg(vector.weight, (d.key_dim,), (shape.key_dim,)))
        if vector.bias:
            weights.append(TensorArg(vector.bias, bias_shape, bias_sizes))
    return weights


def rank_weights(spec: Spec, shape: TargetShape) -> list[TensorArg]:
    """The value, gate and output scales [heads, R, value_dim] of a shape of rank R > 1 (none at rank 1)."""
    if shape.rank == 1:
        return []
    d, ranks = spec.dims, spec.ranks
    names = [ranks.value_scale, ranks.gate_scale, ranks.output_scale]
    return [TensorArg(name, (d.heads, RANK_SYMBOL, d.value_dim), (shape.heads, shape.rank, shape.value_dim)) for name in names if name]


def buffers(spec: Spec, shape: TargetShape) -> tuple[BufferField, ...]:
    """The replay state's ring buffers, one per cached field, in the spec's order."""
    channel = spec.decay.granularity is DecayGranularity.CHANNEL
    fields = []
    for cached in spec.cache_of(shape):
        f = cached.field
        if f in (CacheField.VALUE, CacheField.CORRECTED_VALUE):
            fields.append(BufferField(f, "buf_value", False, shape.value_dim, cached.dtype))
        elif f is CacheField.KEY:
            fields.append(BufferField(f, "buf_key", not spec.keys_per_head, shape.rank * shape.key_dim, cached.dtype))
        elif f is CacheField.LOG_DECAY:
            fields.append(BufferField(f, "buf_log_decay", False, shape.key_dim if channel else 1, cached.dtype))
        elif f is CacheField.WEIGHT:
            fields.append(BufferField(f, "buf_weight", False, 1, cached.dtype))
        elif f is CacheField.CARRY_WEIGHT:
            fields.append(BufferField(f, "buf_carry_weight", False, 1, cached.dtype))
        elif f is CacheField.ANGLE:
            fields.append(BufferField(f, "buf_angle", False, spec.rotary.angles(shape.key_dim), cached.dtype))
    return tuple(fields)


def state_identity(spec: Spec, shape: TargetShape) -> str:
    """What a replay state's tensors mean, as one line: the spec and shape, the sizes, buffer capacity and window,
    the state's dtype and layout, and each cached field's dtype. Two modules whose states hold the same bytes with
    the same meaning give the same line (a module loaded twice, a vendored copy); any difference in what the
    buffers mean gives another, so a module refuses a state allocated by another (the activation dtype chosen at
    allocation is checked apart)."""
    cache = " ".join(f"{c.field.value}:{c.dtype.value if c.dtype else 'activation'}" for c in spec.cache_of(shape))
    rounding = " stochastic" if shape.rounding is Rounding.STOCHASTIC else ""
    rank = f" rank={shape.rank}" if shape.rank > 1 else ""
    rotary = f"; rotary {shape.rotary_pairing.value}" if shape.rotary_pairing else ""
    return (
        f"{spec.name}/{shape.name}: heads={shape.heads} key_heads={shape.key_heads} value_dim={shape.value_dim} key_dim={shape.key_dim}{rank}"
        f" L={shape.capacity} T={shape.window}; state {shape.state_dtype.value}{rounding} {shape.layout.value}; cache {cache}{rotary}"
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
