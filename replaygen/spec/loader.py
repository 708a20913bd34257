"""Load a spec file, validate it once, and return a frozen `Spec`.

Every rule failure is a SpecError naming the file, the line and the YAML path.
Spec values are data: names must be identifiers, numbers are numbers, and the
recurrence is chosen from enumerated primitives (no formulas are evaluated).
"""

from __future__ import annotations

import enum
import hashlib
import keyword
import re
from pathlib import Path
from typing import TypeVar

from replaygen.errors import SpecError
from replaygen.spec.model import (
    ACTIVATION,
    CacheField,
    CachedField,
    Conv,
    ConvActivation,
    ConvChannels,
    Decay,
    DecayForm,
    DecayRate,
    DecayGranularity,
    Dims,
    DType,
    Gate,
    GateActivation,
    Inputs,
    QueryScale,
    Ranks,
    RateActivation,
    Readout,
    Rotary,
    RotaryPairing,
    Rounding,
    Sharing,
    Spec,
    StateLayout,
    StateSpec,
    TargetShape,
    Update,
    UpdateKind,
    UpdateWeight,
    VectorSpec,
    VectorTransform,
)
from replaygen.spec.nodes import Node, parse_yaml

SPEC_VERSION = 1
MAX_CAPACITY = 64
MAX_KEY_DIM = 256
MAX_VALUE_DIM = 512
MAX_WINDOW = 16
MAX_CONV_WIDTH = 8
MAX_RANK = 16
SPEC_NAME = re.compile(r"[a-z][a-z0-9_]*")  # matched whole (fullmatch), as SHAPE_NAME
SHAPE_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*")
# The parameters the generated API functions take beside the spec's inputs and weights (decode, baseline_decode,
# verify and baseline_verify take both as keywords), so no input or weight may be named like one. Every other
# identifier of the generated code spells a spec name with a prefix of its own (replaygen.plan.SPEC_NAME_PREFIX).
API_PARAMETERS = frozenset({"state", "slots", "out", "route", "flush_at", "snapshots", "current"})

E = TypeVar("E", bound=enum.Enum)


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(str(path), None, "", f"cannot read spec file: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(str(path), line, "", f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} ({exc.reason})") from None
    # universal newlines, as text mode reads a file
    return load_spec_text(text.replace("\r\n", "\n").replace("\r", "\n"), str(path))


def load_spec_text(text: str, file: str = "<spec>") -> Spec:
    """Validate spec YAML given as text; `file` names it in errors."""
    root = parse_yaml(text, file)
    return _SpecBuilder(root, hashlib.sha256(text.encode()).hexdigest()).build()


class _Map:
    """Reads one YAML mapping: rejects unknown keys, reports missing ones."""

    def __init__(self, node: Node, required: set[str], optional: set[str] = frozenset()):
        if not isinstance(node.value, dict):
            raise node.error(f"expected a mapping, got {_kind(node.value)}")
        self.node = node
        for key in node.value:
            if key not in required and key not in optional:
                allowed = ", ".join(sorted(required | set(optional)))
                raise node.error(f"unknown key '{key}' (allowed: {allowed})", key)
        for key in sorted(required):
            if key not in node.value:
                raise node.error(f"missing required key '{key}'")

    def get(self, key: str) -> Node | None:
        return self.node.value.get(key)

    def __getitem__(self, key: str) -> Node:
        return self.node.value[key]


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__ if value is not None else "nothing"
    )


def _string(node: Node) -> str:
    if not isinstance(node.value, str):
        raise node.error(f"expected a string, got {_kind(node.value)}")
    return node.value


def _int(node: Node, low: int, high: int) -> int:
    if isinstance(node.value, bool) or not isinstance(node.value, int):
        raise node.error(f"expected an integer, got {_kind(node.value)}")
    if not low <= node.value <= high:
        raise node.error(f"must be between {low} and {high}, got {node.value}")
    return node.value


def _float(node: Node, low: float, high: float) -> float:
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
        raise node.error(f"expected a number, got {_kind(node.value)}")
    if not low <= float(node.value) <= high:
        raise node.error(f"must be between {low} and {high}, got {node.value}")
    return float(node.value)


def _bool(node: Node) -> bool:
    if not isinstance(node.value, bool):
        raise node.error(f"expected true or false, got {_kind(node.value)}")
    return node.value


def _enum(node: Node, cls: type[E]) -> E:
    value = _string(node)
    for member in cls:
        if member.value == value:
            return member
    raise node.error(f"unknown value '{value}' (allowed: {', '.join(m.value for m in cls)})")


def _identifier(node: Node) -> str:
    value = _string(node)
    if not value.isidentifier() or not value.isascii() or keyword.iskeyword(value) or value.startswith("_"):
        raise node.error(f"'{value}' is not a valid name (ASCII identifier, not a python keyword, no leading underscore)")
    if value in API_PARAMETERS:
        raise node.error(f"'{value}' cannot name an input or weight: the generated functions take a parameter '{value}' of their own ({', '.join(sorted(API_PARAMETERS))}); choose another name")
    return value


def _optional_identifier(node: Node | None) -> str | None:
    return None if node is None or node.value is None else _identifier(node)


class _SpecBuilder:
    def __init__(self, root: Node, sha256: str):
        self.root = root
        self.sha256 = sha256
        self.names: dict[str, Node] = {}

    def _claim(self, node: Node | None) -> None:
        """Record a tensor name; two roles may not share one."""
        if node is None or node.value is None:
            return
        if node.value in self.names:
            first = self.names[node.value]
            raise node.error(f"name '{node.value}' is already used at {first.path} (line {first.line})")
        self.names[node.value] = node

    def build(self) -> Spec:
        top = _Map(
            self.root,
            required={"spec_version", "name", "inputs", "decay", "update", "readout", "state", "activations", "replay", "shapes"},
            optional={"description", "dims", "key", "query", "conv", "rotary", "ranks"},
        )
        version = _int(top["spec_version"], 1, 10**6)
        if version != SPEC_VERSION:
            raise top["spec_version"].error(f"unsupported spec_version {version}; this replaygen reads version {SPEC_VERSION}")
        name_node = top["name"]
        name = _string(name_node)
        if not SPEC_NAME.fullmatch(name):
            raise name_node.error(f"spec name '{name}' must be lowercase letters, digits and '_', starting with a letter")
        description = _string(top["description"]) if top.get("description") else ""
        dims = self._dims(top.get("dims"))
        inputs = self._inputs(top["inputs"])
        decay = self._decay(top["decay"])
        update = self._update(top["update"], decay)
        key = self._vector(top.get("key"), allow_scale=False)
        query = self._vector(top.get("query"), allow_scale=True)
        readout = self._readout(top["readout"])
        rotary = self._rotary(top.get("rotary"), decay)
        ranks = self._ranks(top.get("ranks"), update, decay, readout)
        state = self._state(top["state"])
        activations = self._activations(top["activations"])
        cache, capacity, window = self._replay(top["replay"], update, decay, rotary)
        conv = self._conv(top.get("conv"))
        shapes = self._shapes(top["shapes"], inputs, capacity, window, state, cache, rotary, ranks, conv)
        return Spec(
            name=name,
            description=description,
            dims=dims,
            inputs=inputs,
            decay=decay,
            update=update,
            key=key,
            query=query,
            readout=readout,
            state=state,
            activations=activations,
            cache=cache,
            shapes=shapes,
            source_file=self.root.file,
            source_sha256=self.sha256,
            conv=conv,
            rotary=rotary,
            ranks=ranks,
        )

    def _conv(self, node: Node | None) -> Conv | None:
        if node is None:
            return None
        m = _Map(node, required={"width", "channels"}, optional={"activation"})
        width = _int(m["width"], 2, MAX_CONV_WIDTH)
        activation = _enum(m["activation"], ConvActivation) if m.get("activation") else ConvActivation.NONE
        channels_node = m["channels"]
        if not isinstance(channels_node.value, list) or not channels_node.value:
            raise channels_node.error(f"expected a non-empty list of value, key, query (the packed order), got {_kind(channels_node.value)}")
        channels = tuple(_enum(item, ConvChannels) for item in channels_node.value)
        if len(set(channels)) != len(channels):
            raise channels_node.error("each of value, key, query may pass through the conv once")
        return Conv(width, activation, channels)

    def _dims(self, node: Node | None) -> Dims:
        if node is None:
            return Dims()
        fields = {"heads", "key_heads", "value_dim", "key_dim"}
        m = _Map(node, required=set(), optional=fields)
        values = {}
        for field in fields:
            if m.get(field) is not None:
                symbol = _string(m[field])
                if not symbol.isidentifier() or not symbol.isascii():
                    raise node.error(f"dimension symbol '{symbol}' must be an identifier", field)
                values[field] = symbol
        return Dims(**values)

    def _inputs(self, node: Node) -> Inputs:
        m = _Map(node, required={"value", "key", "query"}, optional={"key_sharing"})
        for role in ("value", "key", "query"):
            _identifier(m[role])
            self._claim(m[role])
        sharing = _enum(m["key_sharing"], Sharing) if m.get("key_sharing") else Sharing.KEY_HEAD
        return Inputs(value=m["value"].value, key=m["key"].value, query=m["query"].value, key_sharing=sharing)

    def _decay(self, node: Node) -> Decay:
        rate_keys = {"rate_input", "rate_activation", "rate_floor"}
        m = _Map(node, required={"granularity", "form", "input"}, optional={"rate", "bias", "direct_input", "bound"} | rate_keys)
        granularity = _enum(m["granularity"], DecayGranularity)
        form = _enum(m["form"], DecayForm)
        input_name = _identifier(m["input"])
        self._claim(m["input"])
        rate = _optional_identifier(m.get("rate"))
        bias = _optional_identifier(m.get("bias"))
        if form is DecayForm.NEG_EXP_SOFTPLUS and rate is None:
            raise node.error("form 'neg_exp_softplus' needs 'rate' (the weight A_log in log a = -exp(A_log) * softplus(input + bias))")
        token_rate = self._token_rate(node, m, form, granularity, rate)
        if form is DecayForm.LOWER_BOUND_SIGMOID and (rate is None or m.get("bound") is None):
            raise node.error("form 'lower_bound_sigmoid' needs 'rate' and 'bound' (log a = bound * sigmoid(exp(rate) * (input + bias)), bound < 0)")
        if form is not DecayForm.LOWER_BOUND_SIGMOID and m.get("bound") is not None:
            raise node.error("'bound' belongs to form 'lower_bound_sigmoid'", "bound")
        bound = _float(m["bound"], -1e4, -1e-6) if m.get("bound") is not None else None
        if form is DecayForm.DIRECT and (rate is not None or bias is not None):
            raise node.error("form 'direct' takes the log decay as is: remove 'rate' and 'bias'", "rate" if rate else "bias")
        self._claim(m.get("rate"))
        self._claim(m.get("bias"))
        direct = _optional_identifier(m.get("direct_input"))
        if direct is not None and form is DecayForm.DIRECT:
            raise node.error("'direct_input' only makes sense when the form computes the decay from a pre-activation", "direct_input")
        self._claim(m.get("direct_input"))
        return Decay(granularity, form, input_name, rate, bias, direct, bound, token_rate)

    def _token_rate(self, node: Node, m: _Map, form: DecayForm, granularity: DecayGranularity, rate: str | None) -> DecayRate | None:
        """The per-token rate of form neg_rate_softplus (rate_input, rate_activation, rate_floor); refused elsewhere."""
        if form is not DecayForm.NEG_RATE_SOFTPLUS:
            for key in ("rate_input", "rate_activation", "rate_floor"):
                if m.get(key) is not None:
                    raise node.error(f"'{key}' belongs to form 'neg_rate_softplus' (a decay rate given per token)", key)
            return None
        if m.get("rate_input") is None or m.get("rate_activation") is None:
            raise node.error(
                "form 'neg_rate_softplus' needs 'rate_input' and 'rate_activation'"
                " (log a = -max(activation(rate_input), rate_floor) * softplus(input + bias))"
            )
        if rate is not None:
            raise node.error("form 'neg_rate_softplus' takes its rate per token from 'rate_input': remove the weight 'rate'", "rate")
        if granularity is not DecayGranularity.HEAD:
            raise m["granularity"].error("form 'neg_rate_softplus' decays per head (one rate per head and token)")
        rate_input = _identifier(m["rate_input"])
        self._claim(m["rate_input"])
        floor = _float(m["rate_floor"], 0.0, 1e4) if m.get("rate_floor") is not None else 0.0
        return DecayRate(rate_input, _enum(m["rate_activation"], RateActivation), floor)

    def _update(self, node: Node, decay: Decay) -> Update:
        m = _Map(node, required={"kind", "weight"}, optional={"weight_input", "weight_direct_input", "mix_input"})
        kind = _enum(m["kind"], UpdateKind)
        weight = _enum(m["weight"], UpdateWeight)
        weight_input = _optional_identifier(m.get("weight_input"))
        weight_direct = _optional_identifier(m.get("weight_direct_input"))
        if weight is UpdateWeight.DECAY_DT and not decay.has_softplus:
            raise m["weight"].error("weight 'decay_dt' reuses softplus(input + bias) of the decay, so decay.form must be 'neg_exp_softplus' or 'neg_rate_softplus'")
        if weight is UpdateWeight.DECAY_DT and decay.granularity is DecayGranularity.CHANNEL:
            raise m["weight"].error("weight 'decay_dt' is one scalar per head, so decay.granularity must be 'head'")
        if weight is UpdateWeight.DECAY_DT and decay.direct_input is not None:
            raise m["weight"].error("weight 'decay_dt' needs the decay pre-activation, so decay.direct_input cannot be offered")
        if weight is UpdateWeight.SIGMOID and weight_input is None:
            raise node.error("weight 'sigmoid' needs 'weight_input' (the pre-activation, e.g. b)")
        if weight is not UpdateWeight.SIGMOID and (weight_input is not None or weight_direct is not None):
            key = "weight_input" if weight_input is not None else "weight_direct_input"
            raise node.error(f"'{key}' is only used with weight 'sigmoid'", key)
        self._claim(m.get("weight_input"))
        self._claim(m.get("weight_direct_input"))
        mix_input = self._mix_input(node, m, kind, decay)
        return Update(kind, weight, weight_input, weight_direct, mix_input)

    def _mix_input(self, node: Node, m: _Map, kind: UpdateKind, decay: Decay) -> str | None:
        """The trapezoid's mix input: required by that update, refused by the others."""
        if kind is not UpdateKind.TRAPEZOID:
            if m.get("mix_input") is not None:
                raise node.error("'mix_input' belongs to the trapezoid update (its share of the weight on this step's entry)", "mix_input")
            return None
        if m.get("mix_input") is None:
            raise node.error("the trapezoid update needs 'mix_input' ([batch, heads]; l = sigmoid(mix_input) of the weight goes to this step's entry, the rest to the previous one)")
        if decay.granularity is not DecayGranularity.HEAD:
            raise m["kind"].error("the trapezoid update decays per head (decay.granularity 'head')")
        mix_input = _identifier(m["mix_input"])
        self._claim(m["mix_input"])
        return mix_input

    def _vector(self, node: Node | None, allow_scale: bool) -> VectorSpec:
        if node is None:
            return VectorSpec(VectorTransform.NONE, 0.0, QueryScale.NONE)
        optional = {"eps", "weight", "bias"} | ({"scale"} if allow_scale else set())
        m = _Map(node, required={"transform"}, optional=optional)
        transform = _enum(m["transform"], VectorTransform)
        eps = _float(m["eps"], 0.0, 1.0) if m.get("eps") is not None else 1e-6
        if transform is VectorTransform.NONE:
            for key in ("eps", "weight"):
                if m.get(key) is not None:
                    raise node.error(f"'{key}' only applies to a normalising transform ('l2norm' or 'rmsnorm')", key)
        scale = _enum(m["scale"], QueryScale) if m.get("scale") is not None else QueryScale.NONE
        weight = _optional_identifier(m.get("weight"))
        bias = _optional_identifier(m.get("bias"))
        self._claim(m.get("weight"))
        self._claim(m.get("bias"))
        return VectorSpec(transform, eps if transform is not VectorTransform.NONE else 0.0, scale, weight, bias)

    def _rotary(self, node: Node | None, decay: Decay) -> Rotary | None:
        if node is None:
            return None
        m = _Map(node, required={"angle_input", "fraction"}, optional={"pairing"})
        if not decay.has_softplus or decay.direct_input is not None or decay.granularity is not DecayGranularity.HEAD:
            raise node.error(
                "a rotary angle advances by pi * tanh(angle_input) * dt' each step, dt' the decay's softplus per head: decay.form must be"
                " 'neg_exp_softplus' or 'neg_rate_softplus' at granularity 'head', without 'direct_input'"
            )
        angle_input = _identifier(m["angle_input"])
        self._claim(m["angle_input"])
        fraction = _float(m["fraction"], 1e-6, 1.0)
        pairing = _enum(m["pairing"], RotaryPairing) if m.get("pairing") is not None else RotaryPairing.ADJACENT
        return Rotary(angle_input, fraction, pairing)

    def _ranks(self, node: Node | None, update: Update, decay: Decay, readout: Readout) -> Ranks | None:
        if node is None:
            return None
        m = _Map(node, required={"value_scale", "output_scale"}, optional={"gate_scale"})
        if update.kind is UpdateKind.DELTA:
            raise node.error("rank-R steps update additively ('additive' or 'trapezoid'), not by the delta rule")
        if decay.granularity is not DecayGranularity.HEAD:
            raise node.error("rank-R steps decay per head (decay.granularity 'head')")
        if m.get("gate_scale") is not None and readout.gate is None:
            raise node.error("'gate_scale' scales the gate per rank, but readout has no gate", "gate_scale")
        names = {}
        for key in ("value_scale", "gate_scale", "output_scale"):
            names[key] = _optional_identifier(m.get(key))
            self._claim(m.get(key))
        return Ranks(names["value_scale"], names["gate_scale"], names["output_scale"])

    def _readout(self, node: Node) -> Readout:
        m = _Map(node, required=set(), optional={"skip", "gate"})
        skip = _optional_identifier(m.get("skip"))
        self._claim(m.get("skip"))
        gate = None
        gate_node = m.get("gate")
        if gate_node is not None and gate_node.value is not None:
            g = _Map(gate_node, required={"input", "activation"}, optional={"optional"})
            _identifier(g["input"])
            self._claim(g["input"])
            gate = Gate(
                input=g["input"].value,
                activation=_enum(g["activation"], GateActivation),
                optional=_bool(g["optional"]) if g.get("optional") is not None else False,
            )
        return Readout(skip, gate)

    def _state(self, node: Node) -> StateSpec:
        m = _Map(node, required={"dtype"}, optional={"layout", "rounding"})
        dtype = _enum(m["dtype"], DType)
        layout = _enum(m["layout"], StateLayout) if m.get("layout") is not None else StateLayout.VALUE_KEY
        rounding = _enum(m["rounding"], Rounding) if m.get("rounding") is not None else Rounding.NEAREST
        self._check_rounding(m.get("rounding") or m["dtype"], dtype, rounding)
        return StateSpec(dtype, layout, rounding)

    @staticmethod
    def _check_rounding(node: Node, dtype: DType, rounding: Rounding) -> None:
        if rounding is Rounding.STOCHASTIC and dtype is DType.FLOAT32:
            raise node.error("stochastic rounding is for a 16-bit state (bfloat16 or float16); a float32 state is written as computed")

    def _activations(self, node: Node) -> tuple[DType, ...]:
        if not isinstance(node.value, list) or not node.value:
            raise node.error("expected a non-empty list of dtypes")
        dtypes = []
        for item in node.value:
            dtype = _enum(item, DType)
            if dtype in dtypes:
                raise item.error(f"dtype '{dtype.value}' listed twice")
            dtypes.append(dtype)
        return tuple(dtypes)

    def _replay(self, node: Node, update: Update, decay: Decay, rotary: Rotary | None) -> tuple[tuple[CachedField, ...], int, int]:
        m = _Map(node, required={"cache", "capacity", "window"})
        cache_node = m["cache"]
        needed = {CacheField.KEY, CacheField.LOG_DECAY}
        if update.kind is UpdateKind.ADDITIVE:
            needed |= {CacheField.VALUE, CacheField.WEIGHT}
        elif update.kind is UpdateKind.TRAPEZOID:
            needed |= {CacheField.VALUE, CacheField.WEIGHT, CacheField.CARRY_WEIGHT}
        else:
            needed |= {CacheField.CORRECTED_VALUE}
        what = f"the {update.kind.value} update" + (" with a rotary transform" if rotary else "")
        if rotary is not None:
            needed |= {CacheField.ANGLE}
        fields = self._cached_fields(cache_node, needed, f"is not replayed by {what}; it needs exactly {_names(needed)}")
        missing = needed - {f.field for f in fields}
        if missing:
            raise cache_node.error(f"{what} needs cached fields {_names(missing)}")
        capacity = _int(m["capacity"], 2, MAX_CAPACITY)
        window = _int(m["window"], 1, MAX_WINDOW)
        self._check_flush_rule(m["capacity"], capacity, window)
        return tuple(fields), capacity, window

    @staticmethod
    def _cached_fields(node: Node, allowed: set[CacheField], refusal: str) -> list[CachedField]:
        """Each `field: dtype` of the mapping `node` (dtype `activation` or a DType); a field outside `allowed` is
        refused with `refusal`."""
        if not isinstance(node.value, dict):
            raise node.error(f"expected a mapping of field -> dtype, got {_kind(node.value)}")
        fields = []
        for key, value_node in node.value.items():
            try:
                field = CacheField(key)
            except ValueError:
                raise node.error(f"unknown cached field '{key}' (allowed: {', '.join(f.value for f in CacheField)})", key) from None
            if field not in allowed:
                raise node.error(f"field '{key}' {refusal}", key)
            dtype = None if value_node.value == ACTIVATION else _enum(value_node, DType)
            if field in (CacheField.LOG_DECAY, CacheField.WEIGHT, CacheField.CARRY_WEIGHT, CacheField.ANGLE) and dtype is not DType.FLOAT32:
                raise value_node.error(f"'{key}' enters an exponent or a product of many terms and must be cached as float32")
            fields.append(CachedField(field, dtype))
        return fields

    @staticmethod
    def _check_shape_ident(node: Node, shapes: list[TargetShape], shape: TargetShape) -> None:
        """`shape` may not share its identifier with an earlier shape: module files and tuning records are named by it."""
        for other in shapes:
            if other.ident == shape.ident:
                raise node.error(
                    f"shapes '{other.name}' (line {node.key_lines[other.name]}) and '{shape.name}' both become '{shape.ident}'"
                    " in module and tuning-record names; rename one",
                    shape.name,
                )

    @staticmethod
    def _check_flush_rule(node: Node, capacity: int, window: int) -> None:
        if capacity < 2 * window:
            raise node.error(
                f"capacity L={capacity} is too small for window T={window}: the flush rule h + 2T > L needs L >= 2T={2 * window},"
                " or every verify step would flush"
            )

    def _shapes(
        self, node: Node, inputs: Inputs, capacity: int, window: int, state: StateSpec, cache: tuple[CachedField, ...],
        rotary: Rotary | None, ranks: Ranks | None, conv: Conv | None,
    ) -> tuple[TargetShape, ...]:
        if not isinstance(node.value, dict) or not node.value:
            raise node.error("expected a non-empty mapping of shape name -> sizes")
        shapes = []
        for shape_name, shape_node in node.value.items():
            if not SHAPE_NAME.fullmatch(shape_name):
                raise node.error(f"shape name {shape_name!r} must be lowercase letters, digits, '-' and '.'", shape_name)
            m = _Map(
                shape_node,
                required={"heads", "value_dim", "key_dim"},
                optional={"key_heads", "capacity", "window", "layout", "state_dtype", "rounding", "cache", "rank", "rotary_pairing"},
            )
            heads = _int(m["heads"], 1, 4096)
            key_heads = _int(m["key_heads"], 1, 4096) if m.get("key_heads") is not None else heads
            if inputs.key_sharing is Sharing.HEAD and key_heads != heads:
                raise shape_node.error(f"inputs.key_sharing is 'head', so key_heads must equal heads ({heads})", "key_heads")
            if heads % key_heads:
                raise shape_node.error(f"heads={heads} is not a multiple of key_heads={key_heads}", "key_heads")
            value_dim = _int(m["value_dim"], 1, MAX_VALUE_DIM)
            key_dim = _int(m["key_dim"], 1, MAX_KEY_DIM)
            shape_capacity = _int(m["capacity"], 2, MAX_CAPACITY) if m.get("capacity") is not None else capacity
            shape_window = _int(m["window"], 1, MAX_WINDOW) if m.get("window") is not None else window
            self._check_flush_rule(m.get("capacity") or m.get("window") or shape_node, shape_capacity, shape_window)
            shape_layout = _enum(m["layout"], StateLayout) if m.get("layout") is not None else state.layout
            state_dtype = _enum(m["state_dtype"], DType) if m.get("state_dtype") is not None else state.dtype
            if m.get("rounding") is not None:
                rounding = _enum(m["rounding"], Rounding)
            else:
                rounding = Rounding.NEAREST if state_dtype is DType.FLOAT32 else state.rounding
            self._check_rounding(m.get("rounding") or m.get("state_dtype") or shape_node, state_dtype, rounding)
            own_cache = ()
            if m.get("cache") is not None:
                cached = {entry.field for entry in cache}
                own_cache = tuple(self._cached_fields(m["cache"], cached, f"is not in replay.cache ({_names(cached)}); a shape sets only the dtypes of the spec's fields"))
            rank = self._shape_rank(m, ranks, conv)
            pairing = self._shape_pairing(m, rotary, key_dim)
            shape = TargetShape(
                shape_name, heads, key_heads, value_dim, key_dim, shape_capacity, shape_window, shape_layout, state_dtype, rounding, own_cache,
                rank, pairing,
            )
            self._check_shape_ident(node, shapes, shape)
            shapes.append(shape)
        return tuple(shapes)


    @staticmethod
    def _shape_rank(m: _Map, ranks: Ranks | None, conv: Conv | None) -> int:
        """The shape's rank R (1 unless it says): above 1 it needs the spec's `ranks` weights, and no conv (which packs
        one key and query per key head)."""
        if m.get("rank") is None:
            return 1
        rank = _int(m["rank"], 1, MAX_RANK)
        if rank > 1 and ranks is None:
            raise m["rank"].error("a shape of rank > 1 needs the spec's 'ranks' (value_scale, output_scale and, with a gate, gate_scale)")
        if rank > 1 and conv is not None:
            raise m["rank"].error("the conv packs one key and one query per key head: a spec with a conv has shapes of rank 1 only")
        return rank

    @staticmethod
    def _shape_pairing(m: _Map, rotary: Rotary | None, key_dim: int) -> RotaryPairing | None:
        """The shape's rotary pairing (the spec's unless it says; None without rotary), checked against key_dim."""
        if rotary is None:
            if m.get("rotary_pairing") is not None:
                raise m.node.error("'rotary_pairing' needs the spec's 'rotary'", "rotary_pairing")
            return None
        pairing = _enum(m["rotary_pairing"], RotaryPairing) if m.get("rotary_pairing") is not None else rotary.pairing
        where = m["rotary_pairing"] if m.get("rotary_pairing") is not None else m["key_dim"]
        if rotary.angles(key_dim) < 1:
            raise where.error(f"rotary.fraction={rotary.fraction} of key_dim={key_dim} leaves no pair of channels to rotate")
        if pairing is RotaryPairing.HALVES and key_dim % 2:
            raise where.error(f"pairing 'halves' turns channel i with i + key_dim / 2: key_dim={key_dim} must be even")
        return pairing


def _names(fields: set[CacheField]) -> str:
    return ", ".join(sorted(f.value for f in fields))
