"""Typed, frozen model of a spec. Built only by the loader, after validation.

Conventions (see ../MATH.md of the design docs): the state of one head is a
matrix with `value_dim` rows and `key_dim` columns (`S` with `y = S q`); the
decay multiplies the whole state (granularity `head`) or its key columns
(granularity `channel`); an update adds `w * u k^T` where `u` is the value
(additive rule) or the corrected value (delta rule), or, at rank R, the sum over
ranks r of `w * (u * s_r) k_r^T` with R keys per token and a value scale per rank.
The trapezoid update also carries the previous step's entry; a rotary transform
carries an angle per head.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from replaygen.errors import UnsupportedShapeError


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2


class Sharing(enum.Enum):
    """How a per-token vector is shared: one per value head, or one per key head (group)."""

    HEAD = "head"
    KEY_HEAD = "key_head"


class DecayGranularity(enum.Enum):
    HEAD = "head"  # one scalar per head and step (Mamba-2, GDN)
    CHANNEL = "channel"  # one scalar per head, key channel and step (KDA)


class DecayForm(enum.Enum):
    NEG_EXP_SOFTPLUS = "neg_exp_softplus"  # log a = -exp(rate) * softplus(input + bias)
    NEG_RATE_SOFTPLUS = "neg_rate_softplus"  # log a = -max(f(rate_input), rate_floor) * softplus(input + bias), f per RateActivation
    LOWER_BOUND_SIGMOID = "lower_bound_sigmoid"  # log a = bound * sigmoid(exp(rate) * (input + bias)), in (bound, 0)
    DIRECT = "direct"  # log a = input


class RateActivation(enum.Enum):
    """How a data-dependent decay rate comes from its per-token input x (DecayForm.NEG_RATE_SOFTPLUS)."""

    HEAVY_TAIL = "heavy_tail"  # 1 + x for x >= 0, 1 / (1 - x) below (Mamba-3's A)
    EXP = "exp"  # exp(x): A_log given per token


class UpdateKind(enum.Enum):
    ADDITIVE = "additive"  # S = a S + w u k^T (Mamba-2)
    DELTA = "delta"  # S = a S; u = w (v - S k); S += u k^T (Gated DeltaNet, KDA)
    TRAPEZOID = "trapezoid"  # S = a (S + (1 - l) w' u' k'^T) + l w u k^T, l = sigmoid(mix), (u', k', w') the previous step's (Mamba-3)


class UpdateWeight(enum.Enum):
    DECAY_DT = "decay_dt"  # w = softplus(decay input + bias), the Mamba-2 dt'
    SIGMOID = "sigmoid"  # w = sigmoid(weight input), the GDN beta
    ONE = "one"  # w = 1


class VectorTransform(enum.Enum):
    NONE = "none"
    L2NORM = "l2norm"  # x / sqrt(|x|^2 + eps)
    RMSNORM = "rmsnorm"  # x / sqrt(mean(x^2) + eps)


class RotaryPairing(enum.Enum):
    """Which key channels a rotary angle turns together."""

    ADJACENT = "adjacent"  # (2i, 2i + 1)
    HALVES = "halves"  # (i, i + key_dim / 2)


class QueryScale(enum.Enum):
    NONE = "none"
    INV_SQRT_KEY_DIM = "inv_sqrt_key_dim"


class StateLayout(enum.Enum):
    VALUE_KEY = "value_key"  # state stored [value_dim, key_dim] per head (Mamba-2, vLLM GDN)
    KEY_VALUE = "key_value"  # state stored [key_dim, value_dim] per head (FLA, HF GDN)


class Rounding(enum.Enum):
    """How a 16-bit state is rounded where a kernel writes it."""

    NEAREST = "nearest"  # round to nearest, ties to even (the hardware convert)
    STOCHASTIC = "stochastic"  # up with probability (x - down) / (up - down): unbiased, so per-write errors cancel


class GateActivation(enum.Enum):
    SILU = "silu"


class ConvActivation(enum.Enum):
    SILU = "silu"
    NONE = "none"


class ConvChannels(enum.Enum):
    """An input whose channels pass through the conv: value [heads, value_dim], key or query [key_heads, key_dim]."""

    VALUE = "value"
    KEY = "key"
    QUERY = "query"


class CacheField(enum.Enum):
    """What one replay-buffer entry holds, per field."""

    VALUE = "value"  # the raw value v_j (additive rule)             [heads, value_dim]
    CORRECTED_VALUE = "corrected_value"  # u_j = w (v - S k) (delta rule)  [heads, value_dim]
    KEY = "key"  # the transformed key                                [key_heads, key_dim]
    LOG_DECAY = "log_decay"  # log a_j                                 [heads] or [heads, key_dim]
    WEIGHT = "weight"  # w_j (additive rule), l_j w_j (trapezoid)     [heads]
    CARRY_WEIGHT = "carry_weight"  # (1 - l_j) w_j (trapezoid): what step j adds to entry j - 1   [heads]
    ANGLE = "angle"  # the rotary angle after step j                  [heads, angles]


ACTIVATION = "activation"  # a cached field stored in the activation dtype of the step inputs


@dataclass(frozen=True)
class Dims:
    """Symbols used for the four dimensions in generated docstrings."""

    heads: str = "H"
    key_heads: str = "G"
    value_dim: str = "P"
    key_dim: str = "N"


@dataclass(frozen=True)
class Inputs:
    value: str  # [batch, heads, value_dim]
    key: str  # [batch, key_heads, key_dim]
    query: str  # [batch, key_heads, key_dim]
    key_sharing: Sharing


@dataclass(frozen=True)
class DecayRate:
    """A decay rate given per token (form neg_rate_softplus): rate = max(activation(input), floor)."""

    input: str  # [batch, heads]
    activation: RateActivation
    floor: float  # >= 0


@dataclass(frozen=True)
class Decay:
    granularity: DecayGranularity
    form: DecayForm
    input: str  # [batch, heads] or [batch, heads, key_dim]
    rate: str | None  # weight [heads]
    bias: str | None  # weight [heads] or [heads, key_dim]
    direct_input: str | None  # optional: log decay passed directly, same shape as `input`
    bound: float | None = None  # form lower_bound_sigmoid: the log decay's lower bound (negative)
    token_rate: DecayRate | None = None  # form neg_rate_softplus: the rate per token

    @property
    def has_softplus(self) -> bool:
        """Whether the decay is -rate * softplus(input + bias), so a step has the softplus (dt') to weigh by."""
        return self.form in (DecayForm.NEG_EXP_SOFTPLUS, DecayForm.NEG_RATE_SOFTPLUS)


@dataclass(frozen=True)
class Update:
    kind: UpdateKind
    weight: UpdateWeight
    weight_input: str | None  # [batch, heads] pre-activation (weight sigmoid)
    weight_direct_input: str | None  # optional: the weight passed directly
    mix_input: str | None = None  # trapezoid: [batch, heads], l = sigmoid(mix_input) the share of w on this step's entry


@dataclass(frozen=True)
class VectorSpec:
    """A key or query transform: the normalisation, times `weight` [key_dim], plus `bias` [heads, key_dim] (which
    makes the transformed vector one per head), then the query scale."""

    transform: VectorTransform
    eps: float
    scale: QueryScale
    weight: str | None = None  # weight [key_dim], after the normalisation
    bias: str | None = None  # weight [heads, key_dim] ([heads, rank, key_dim] at rank > 1)


@dataclass(frozen=True)
class Rotary:
    """A rotary transform of the (transformed) key and query by an angle carried per head: each step adds
    pi * tanh(angle_input) * dt' (dt' the decay's softplus) to the angle of each rotary pair, modulo 2 pi."""

    angle_input: str  # [batch, angles], shared by the heads
    fraction: float  # the rotated share of key_dim: int(key_dim * fraction) rounded down to even, two channels per angle
    pairing: RotaryPairing  # the shapes' default

    def angles(self, key_dim: int) -> int:
        """Angles (rotary pairs) per head at `key_dim`."""
        return int(key_dim * self.fraction) // 2


@dataclass(frozen=True)
class Ranks:
    """Weights of a rank-R step (shapes of rank > 1): value, gate and output scales [heads, rank, value_dim]. Rank r
    updates with the value u * value_scale[:, r], reads y_r = S q_r + skip u * value_scale[:, r], gates it with
    silu(z * gate_scale[:, r]), and the output is the sum over r of output_scale[:, r] * y_r."""

    value_scale: str
    gate_scale: str | None
    output_scale: str


@dataclass(frozen=True)
class Gate:
    input: str  # [batch, heads, value_dim]
    activation: GateActivation
    optional: bool


@dataclass(frozen=True)
class Readout:
    skip: str | None  # weight [heads]: y += skip * value
    gate: Gate | None


@dataclass(frozen=True)
class Conv:
    """The short causal depthwise conv before the recurrence: out[t, c] = act(bias[c] + sum_w weight[c, w] *
    in[t - width + 1 + w, c]) over each channel c of the inputs `channels`, packed in that order."""

    width: int  # W: taps per channel; the conv state keeps the last W - 1 inputs
    activation: ConvActivation
    channels: tuple[ConvChannels, ...]


@dataclass(frozen=True)
class StateSpec:
    """The shapes' defaults for how a state is stored."""

    dtype: DType
    layout: StateLayout
    rounding: Rounding = Rounding.NEAREST


@dataclass(frozen=True)
class CachedField:
    field: CacheField
    dtype: DType | None  # None: the activation dtype


@dataclass(frozen=True)
class TargetShape:
    name: str
    heads: int
    key_heads: int
    value_dim: int
    key_dim: int
    capacity: int  # L, ring-buffer entries per slot
    window: int  # T, speculative window
    layout: StateLayout = StateLayout.VALUE_KEY  # how a state is stored (the spec's state.layout unless the shape says)
    state_dtype: DType = DType.FLOAT32  # the spec's state.dtype unless the shape says
    rounding: Rounding = Rounding.NEAREST  # of a 16-bit state (the spec's state.rounding unless the shape says)
    cache_dtypes: tuple[CachedField, ...] = ()  # the shape's own dtypes for some of the spec's cached fields
    rank: int = 1  # R: keys and queries per token and key head
    rotary_pairing: RotaryPairing | None = None  # the spec's rotary.pairing unless the shape says; None without rotary

    @property
    def heads_per_key_head(self) -> int:
        return self.heads // self.key_heads

    @property
    def ident(self) -> str:
        """The shape name as a python identifier fragment."""
        return self.name.replace("-", "_").replace(".", "_")


@dataclass(frozen=True)
class Spec:
    name: str
    description: str
    dims: Dims
    inputs: Inputs
    decay: Decay
    update: Update
    key: VectorSpec
    query: VectorSpec
    readout: Readout
    state: StateSpec
    activations: tuple[DType, ...]
    cache: tuple[CachedField, ...]
    shapes: tuple[TargetShape, ...]
    source_file: str
    source_sha256: str
    conv: Conv | None = None  # the conv before the recurrence, where the spec has one
    rotary: Rotary | None = None  # the rotary transform of key and query, where the spec has one
    ranks: Ranks | None = None  # the rank-R weights, where a shape has rank > 1

    def shape(self, name: str) -> TargetShape:
        for shape in self.shapes:
            if shape.name == name:
                return shape
        known = ", ".join(s.name for s in self.shapes)
        raise KeyError(f"spec '{self.name}' has no shape '{name}' (known: {known})")

    def resolve(self, shape: TargetShape) -> TargetShape:
        """`shape` as this spec runs it: what it leaves to the spec filled in (the rotary pairing). UnsupportedShapeError
        naming the shape where it does not fit the spec (a shape built in Python, which the loader never saw)."""
        problems = []
        if shape.heads < 1 or shape.key_heads < 1 or shape.value_dim < 1 or shape.key_dim < 1 or shape.rank < 1:
            problems.append("heads, key_heads, value_dim, key_dim and rank must be at least 1")
        elif shape.heads % shape.key_heads:
            problems.append(f"heads={shape.heads} is not a multiple of key_heads={shape.key_heads}")
        if self.inputs.key_sharing is Sharing.HEAD and shape.key_heads != shape.heads:
            problems.append(f"the spec's keys are per head (inputs.key_sharing 'head'): key_heads must equal heads ({shape.heads})")
        if shape.window < 1 or shape.capacity < 2 * shape.window:
            problems.append(f"capacity L={shape.capacity} and window T={shape.window}: the flush rule h + 2T > L needs T >= 1 and L >= 2T")
        if shape.rounding is Rounding.STOCHASTIC and shape.state_dtype is DType.FLOAT32:
            problems.append("stochastic rounding is for a 16-bit state (bfloat16 or float16)")
        if shape.rank > 1 and (self.ranks is None or self.conv is not None):
            problems.append(f"rank {shape.rank} needs the spec's 'ranks' weights and no conv")
        unknown = sorted(entry.field.value for entry in shape.cache_dtypes if self.cached(entry.field) is None)
        if unknown:
            problems.append(f"cache dtypes of fields the spec does not cache: {', '.join(unknown)}")
        pairing = shape.rotary_pairing
        if self.rotary is None and pairing is not None:
            problems.append("a rotary pairing needs the spec's 'rotary'")
        elif self.rotary is not None:
            pairing = pairing or self.rotary.pairing
            if self.rotary.angles(shape.key_dim) < 1:
                problems.append(f"rotary.fraction={self.rotary.fraction} of key_dim={shape.key_dim} leaves no pair of channels to rotate")
            if pairing is RotaryPairing.HALVES and shape.key_dim % 2:
                problems.append(f"pairing 'halves' turns channel i with i + key_dim / 2: key_dim={shape.key_dim} must be even")
        if problems:
            raise UnsupportedShapeError(f"shape {shape.name!r} does not fit spec {self.name!r}: " + "; ".join(problems))
        return replace(shape, rotary_pairing=pairing)

    def cached(self, field: CacheField) -> CachedField | None:
        for entry in self.cache:
            if entry.field is field:
                return entry
        return None

    @property
    def keys_per_head(self) -> bool:
        """Whether a step's transformed key differs per head although the input is per key head: a per-head bias, or a
        rotary angle (advanced by each head's dt')."""
        return self.key.bias is not None or self.rotary is not None

    @property
    def carries(self) -> bool:
        """Whether the recurrence carries more than its state from one step to the next: the rotary angle, the
        trapezoid's previous entry."""
        return self.rotary is not None or self.update.kind is UpdateKind.TRAPEZOID

    def cache_of(self, shape: TargetShape) -> tuple[CachedField, ...]:
        """The cached fields of `shape`'s replay buffer, in the spec's order: the spec's dtypes, or the shape's own."""
        own = {entry.field: entry for entry in shape.cache_dtypes}
        return tuple(own.get(entry.field, entry) for entry in self.cache)
