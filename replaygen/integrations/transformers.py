"""Hugging Face transformers models whose recurrent layers decode through generated replay modules.

    runtime = attach(model, capacity=16, window=4)      # one generated module per recurrent layer shape
    out = runtime.generate(input_ids, 32)               # greedy decoding through the replay kernels
    out = runtime.generate(input_ids, 32, draft_tokens=3)   # prompt-lookup speculation, windows of 4
    baseline = attach(model, capacity=16, window=4, kernels=Kernels.BASELINE)   # the same modules' baseline kernels

The prompt runs through HF's own path (its chunked scan) into an HF cache; each recurrent layer's final state then
seeds its replay state (`load`) and its last conv inputs its conv state (`load_conv`). Every later token keeps HF's
projections, gates, norms and output projections; the short causal conv1d and the recurrence run in the generated
module (its spec carries the mixer's conv): `conv` and `decode` per token, or `conv` and `verify` of a window and
`commit_conv` and `commit` of its accepted prefix. A rejected draft costs nothing to undo: the replay state's and the
conv state's cursors keep only the accepted tokens, and the attention layers' KV cache (HF's) is cropped by the
rejected ones. With `kernels=Kernels.BASELINE` the recurrence runs the modules' baseline kernels instead, on full
states as serving engines keep them today (`BaselineStates`): the comparison point of the same model and loop.

HF's Mamba-2 mixers (mamba2, nemotron_h, bamba, falcon_h1, granitemoehybrid, zamba2) call two functions of their
modeling module, `causal_conv1d_forward` and `mamba2_scan_forward` (HF's points for a runtime that keeps the state
itself): while a runtime decodes, those are its own. HF's delta-rule mixers (Gated DeltaNet of qwen3_next and
qwen3_5, Kimi Delta Attention of kimi_linear) have no such point for the recurrence, so their decode forward is the
runtime's (`DeltaRuleMixers`).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import MethodType, ModuleType

import torch
import yaml

from replaygen.errors import ReplaygenError
from replaygen.paths import gpu_name, records_dir, spec_file
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import Spec, StateLayout
from replaygen.tune.apply import resolve_configs


class Mode(enum.Enum):
    PREFILL = "prefill"  # HF's own path, into its cache
    DECODE = "decode"  # one token per sequence: `decode`
    VERIFY = "verify"  # a window of tokens per sequence: `verify`, then `commit`


@dataclass(frozen=True)
class ReplayStates:
    """One recurrent layer's replay state for a session's slots [b] (the module's `allocate`): a checkpoint and a
    ring of recent inputs per slot; `commit` moves the ring's cursor."""

    module: ModuleType
    slots: torch.Tensor
    state: object  # the module's ReplayState

    @classmethod
    def load(cls, module: ModuleType, slots: torch.Tensor, states: torch.Tensor, activation_dtype: torch.dtype, window: int) -> "ReplayStates":
        """The prompts' final states [b, *STATE_SHAPE] float32 as the checkpoints of `slots` [b], rings empty."""
        state = module.allocate(slots.shape[0], slots.device, activation_dtype)
        module.load(state, slots, states)
        return cls(module, slots, state)

    def decode(self, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token per slot, inputs [b, ...] -> [b, heads, value_dim]."""
        return self.module.decode(self.state, self.slots, **inputs, **weights)

    def verify(self, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """A window per slot, inputs [b, t, ...] (t <= T) -> [b, t, heads, value_dim]; kept by `commit`."""
        return self.module.verify(self.state, self.slots, **inputs, **weights)

    def commit(self, accepted: torch.Tensor, num_tokens: int) -> None:
        """Keep accepted [b] (1..num_tokens) tokens of the last window of `num_tokens`."""
        self.module.commit(self.state, self.slots, accepted, num_tokens=num_tokens)

    def materialize(self) -> torch.Tensor:
        """The slots' current states [b, *STATE_SHAPE]."""
        return self.module.materialize(self.state, self.slots)


@dataclass(frozen=True)
class BaselineStates:
    """One recurrent layer's baseline state for a session's slots [b], as the module's `baseline_verify` keeps it
    (`allocate_snapshots`): T full-state snapshots per slot, snapshots [slots, T, *STATE_SHAPE], and the committed
    one's index, current [slots] int32. Decode advances the committed snapshots in place: `baseline_decode` on the
    snapshots viewed as [slots * T, *STATE_SHAPE] at rows [b] = slot * T + current (kept beside, changed by `commit`
    only, so a decode step launches nothing else). Verify writes one snapshot per window token, commit points
    `current` at the last accepted one (`baseline_commit`)."""

    module: ModuleType
    slots: torch.Tensor
    snapshots: torch.Tensor
    current: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def load(cls, module: ModuleType, slots: torch.Tensor, states: torch.Tensor, activation_dtype: torch.dtype, window: int) -> "BaselineStates":
        """The prompts' final states [b, *STATE_SHAPE] as the committed snapshots (index 0) of `slots` [b]."""
        snapshots, current = module.allocate_snapshots(slots.shape[0], slots.device, window)
        snapshots[slots.long(), 0] = states.to(snapshots.dtype)
        return cls(module, slots, snapshots, current, (slots * window).to(torch.int32))

    def decode(self, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token per slot on its committed snapshot, inputs [b, ...] -> [b, heads, value_dim]."""
        return self.module.baseline_decode(self.snapshots.flatten(0, 1), self.rows, **inputs, **weights)

    def verify(self, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """A window per slot, inputs [b, t, ...] -> [b, t, heads, value_dim]. The snapshots hold T tokens per slot,
        so a shorter window (t < T) runs padded to T with zero inputs after its tokens (outputs and snapshots past t
        are dropped: `commit` keeps at most t)."""
        tokens = next(iter(inputs.values())).shape[1]
        padded = _padded_tokens(inputs, self.snapshots.shape[1])
        return self.module.baseline_verify(self.snapshots, self.current, self.slots, **padded, **weights)[:, :tokens]

    def commit(self, accepted: torch.Tensor, num_tokens: int) -> None:
        """Keep accepted [b] (1..num_tokens) tokens of the last window: the committed snapshot becomes the last kept one's."""
        self.module.baseline_commit(self.current, self.slots, accepted, num_tokens=num_tokens)
        slots = self.slots.long()
        self.rows.copy_(slots * self.snapshots.shape[1] + self.current[slots])

    def materialize(self) -> torch.Tensor:
        """The slots' committed snapshots [b, *STATE_SHAPE] (a copy)."""
        return self.snapshots.flatten(0, 1)[self.rows.long()]


def _padded_tokens(inputs: dict[str, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    """Inputs [b, t, ...] with zeros after their t tokens up to `tokens` (as they are where t = tokens)."""
    return {
        name: t if t.shape[1] == tokens else torch.cat([t, t.new_zeros((t.shape[0], tokens - t.shape[1], *t.shape[2:]))], dim=1)
        for name, t in inputs.items()
    }


RecurrentStates = ReplayStates | BaselineStates


class Kernels(enum.Enum):
    """Which of a generated module's kernels a runtime's recurrent layers run."""

    REPLAY = "replay"  # checkpoint and ring (`decode`, `verify`, `commit`): `ReplayStates`
    BASELINE = "baseline"  # full states, a snapshot per window token (`baseline_decode`, ...): `BaselineStates`

    @classmethod
    def named(cls, value: "Kernels | str") -> "Kernels":
        """`value` as a Kernels (a member or its value); anything else is refused naming the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"kernels={value!r}: one of {', '.join(repr(k.value) for k in cls)}") from None

    @property
    def states(self) -> type[ReplayStates] | type[BaselineStates]:
        """The per-layer session state these kernels run on."""
        return {Kernels.REPLAY: ReplayStates, Kernels.BASELINE: BaselineStates}[self]


@dataclass(frozen=True)
class RecurrentLayer:
    """One recurrent mixer of a model and the generated module of its shape."""

    index: int  # the mixer's layer_idx (its place in HF's cache)
    mixer: torch.nn.Module
    family: "Mamba2Mixers | DeltaRuleMixers"
    module: ModuleType
    transposed: bool = False  # the module stores each head's state transposed to HF's layout (a shipped shape's)

    def module_states(self, states: torch.Tensor) -> torch.Tensor:
        """HF's states [b, heads, *state] -> the module's [b, *STATE_SHAPE] float32."""
        states = states.to(torch.float32)
        return (states.transpose(-1, -2) if self.transposed else states).contiguous()

    def hf_states(self, states: torch.Tensor) -> torch.Tensor:
        """The module's states [b, *STATE_SHAPE] -> HF's layout [b, heads, *state]."""
        return states.transpose(-1, -2) if self.transposed else states


@dataclass(frozen=True)
class Mamba2Mixers:
    """HF's Mamba-2 mixers, onto the mamba2 spec: x [b, H, P], B and C [b, G, N], dt [b, H]; A_log, dt_bias, D."""

    spec_name: str = "mamba2"

    def accepts(self, mixer: torch.nn.Module) -> bool:
        modeling = sys.modules.get(type(mixer).__module__)
        return (
            all(hasattr(modeling, name) for name in ("mamba2_scan_forward", "causal_conv1d_forward"))
            and all(hasattr(mixer, name) for name in ("A_log", "dt_bias", "D", "conv1d", "n_groups", "head_dim", "num_heads", "ssm_state_size"))
        )

    def shape_entry(self, mixer: torch.nn.Module) -> dict:
        return {"heads": mixer.num_heads, "key_heads": mixer.n_groups, "value_dim": mixer.head_dim, "key_dim": mixer.ssm_state_size}

    def conv_channels(self) -> tuple[str, ...]:
        """How the mixer packs its conv's channels: x, then B, then C."""
        return ("value", "key", "query")

    @contextlib.contextmanager
    def decoding(self, runtime: "ReplayRuntime", layers: tuple[RecurrentLayer, ...]) -> Iterator[None]:
        """The mixers' modeling modules' conv and scan functions replaced by the runtime's while it decodes."""
        by_module = {}
        for layer in layers:
            by_module.setdefault(sys.modules[type(layer.mixer).__module__], {})[id(layer.mixer)] = layer
        saved = []
        try:
            for modeling, mine in by_module.items():
                conv, scan = modeling.causal_conv1d_forward, modeling.mamba2_scan_forward
                saved.append((modeling, conv, scan))
                convs = {id(layer.mixer.conv1d): layer for layer in mine.values()}
                modeling.causal_conv1d_forward = _intercept_conv(runtime, convs, conv)
                modeling.mamba2_scan_forward = _intercept_scan(runtime, mine, scan)
            yield
        finally:
            for modeling, conv, scan in saved:
                modeling.causal_conv1d_forward, modeling.mamba2_scan_forward = conv, scan

    def recurrence(self, runtime: "ReplayRuntime", layer: RecurrentLayer, hidden_states, B, C, dt) -> torch.Tensor:
        """The scan of HF's mamba2_scan_forward: hidden_states [b, s, H*P], B and C [b, s, G*N], dt [b, s, H] ->
        [b, s, H*P], the D skip included."""
        mixer = layer.mixer
        batch, tokens, _ = hidden_states.shape
        shaped = {
            "x": hidden_states.reshape(batch, tokens, mixer.num_heads, mixer.head_dim),
            "B": B.reshape(batch, tokens, mixer.n_groups, mixer.ssm_state_size),
            "C": C.reshape(batch, tokens, mixer.n_groups, mixer.ssm_state_size),
            "dt": dt.reshape(batch, tokens, mixer.num_heads),
        }
        weights = {"A_log": mixer.A_log, "dt_bias": mixer.dt_bias, "D": mixer.D}
        return runtime.run_recurrence(layer, shaped, weights).reshape(batch, tokens, -1)


def _intercept_conv(runtime: "ReplayRuntime", convs: dict, original: Callable) -> Callable:
    def causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs):
        layer = convs.get(id(conv1d))
        if layer is None:
            return original(conv1d, hidden_states, cache, layer_idx, activation=activation, **kwargs)
        return runtime.run_conv(layer, hidden_states.transpose(1, 2)).transpose(1, 2)

    return causal_conv1d_forward


def _intercept_scan(runtime: "ReplayRuntime", mixers: dict, original: Callable) -> Callable:
    def mamba2_scan_forward(module, hidden_states, B, C, dt, cache, **kwargs):
        layer = mixers.get(id(module))
        if layer is None:
            return original(module, hidden_states, B, C, dt, cache, **kwargs)
        return layer.family.recurrence(runtime, layer, hidden_states, B, C, dt)

    return mamba2_scan_forward


@dataclass(frozen=True)
class MixerProjections:
    """One decode step's HF projections of a delta-rule mixer: the conv inputs [b, s, channels] (query, key and
    value channels in that order), and the recurrence's other inputs [b, s, heads(, ...)] by spec name."""

    conv_inputs: torch.Tensor
    step_inputs: dict[str, torch.Tensor]
    gate: torch.Tensor  # the output norm's gate


class DeltaRuleMixers:
    """HF's delta-rule mixers (Gated DeltaNet, Kimi Delta Attention), whose recurrence call has no point to replace:
    while a runtime decodes, each mixer's forward is `_delta_rule_forward`: the family's projections (HF's modules),
    the generated module's conv and recurrence, HF's gated norm and output projection. States are HF's
    [heads, key_dim, value_dim] (the specs' key_value layout)."""

    spec_name: str
    required: tuple[str, ...]

    def accepts(self, mixer: torch.nn.Module) -> bool:
        return all(hasattr(mixer, name) for name in self.required)

    def conv_channels(self) -> tuple[str, ...]:
        """How the mixer packs its conv's channels: q, then k, then v."""
        return ("query", "key", "value")

    @contextlib.contextmanager
    def decoding(self, runtime: "ReplayRuntime", layers: tuple[RecurrentLayer, ...]) -> Iterator[None]:
        try:
            for layer in layers:
                layer.mixer.forward = MethodType(_delta_rule_forward(runtime, layer), layer.mixer)
            yield
        finally:
            for layer in layers:
                layer.mixer.__dict__.pop("forward", None)


def _delta_rule_forward(runtime: "ReplayRuntime", layer: RecurrentLayer) -> Callable:
    family = layer.family

    def forward(mixer, hidden_states, cache=None, attention_mask=None, **kwargs):
        batch, tokens, _ = hidden_states.shape
        projected = family.project(mixer, hidden_states)
        mixed = runtime.run_conv(layer, projected.conv_inputs)
        heads, key_heads, value_dim, key_dim = (family.shape_entry(mixer)[k] for k in ("heads", "key_heads", "value_dim", "key_dim"))
        query, key, value = torch.split(mixed, [key_heads * key_dim, key_heads * key_dim, heads * value_dim], dim=-1)
        inputs = {
            "v": value.reshape(batch, tokens, heads, value_dim),
            "k": key.reshape(batch, tokens, key_heads, key_dim),
            "q": query.reshape(batch, tokens, key_heads, key_dim),
            **projected.step_inputs,
        }
        core = runtime.run_recurrence(layer, inputs, family.weights(mixer))
        return family.finish(mixer, core, projected.gate)

    return forward


@dataclass(frozen=True)
class GatedDeltaNetMixers(DeltaRuleMixers):
    """HF's Gated DeltaNet mixers onto the gdn spec: v [b, HV, V], k and q [b, H, K] (l2-normed in the kernel), a
    and b [b, HV]; A_log, dt_bias. Projections: qwen3_next's fused qkvz and ba, or qwen3_5's four."""

    spec_name: str = "gdn"
    required: tuple[str, ...] = ("A_log", "dt_bias", "conv1d", "norm", "out_proj", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim")

    def accepts(self, mixer: torch.nn.Module) -> bool:
        return super().accepts(mixer) and (_fused_projections(mixer) or _split_projections(mixer))

    def shape_entry(self, mixer: torch.nn.Module) -> dict:
        return {"heads": mixer.num_v_heads, "key_heads": mixer.num_k_heads, "value_dim": mixer.head_v_dim, "key_dim": mixer.head_k_dim, "layout": "key_value"}

    def project(self, mixer: torch.nn.Module, hidden_states: torch.Tensor) -> MixerProjections:
        batch, tokens, _ = hidden_states.shape
        if _fused_projections(mixer):
            query, key, value, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden_states), mixer.in_proj_ba(hidden_states))
            mixed = torch.cat([t.reshape(batch, tokens, -1) for t in (query, key, value)], dim=-1)
        else:
            z = mixer.in_proj_z(hidden_states).reshape(batch, tokens, -1, mixer.head_v_dim)
            mixed, b, a = mixer.in_proj_qkv(hidden_states), mixer.in_proj_b(hidden_states), mixer.in_proj_a(hidden_states)
        heads = mixer.num_v_heads
        return MixerProjections(mixed, {"a": a.reshape(batch, tokens, heads), "b": b.reshape(batch, tokens, heads)}, z)

    def weights(self, mixer: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {"A_log": mixer.A_log, "dt_bias": mixer.dt_bias}

    def finish(self, mixer: torch.nn.Module, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """core [b, s, HV, V] -> [b, s, hidden]: HF's gated RMSNorm and output projection."""
        batch, tokens = core.shape[:2]
        core = mixer.norm(core.reshape(-1, mixer.head_v_dim), gate.reshape(-1, mixer.head_v_dim))
        return mixer.out_proj(core.reshape(batch, tokens, -1))


def _fused_projections(mixer) -> bool:
    return all(hasattr(mixer, name) for name in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"))


def _split_projections(mixer) -> bool:
    return all(hasattr(mixer, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


@dataclass(frozen=True)
class KimiDeltaAttentionMixers(DeltaRuleMixers):
    """HF's Kimi Delta Attention (kimi_linear) onto the kda spec: v [b, H, V], k and q [b, H, K], the log decay g
    [b, H, K] and beta [b, H] passed directly (HF's forget gate and b projection compute them)."""

    spec_name: str = "kda"
    required: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj", "num_heads", "head_dim")

    def shape_entry(self, mixer: torch.nn.Module) -> dict:
        return {"heads": mixer.num_heads, "key_heads": mixer.num_heads, "value_dim": mixer.head_dim, "key_dim": mixer.head_dim, "layout": "key_value"}

    def project(self, mixer: torch.nn.Module, hidden_states: torch.Tensor) -> MixerProjections:
        batch, tokens, _ = hidden_states.shape
        mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], dim=-1)
        log_decay = mixer.forget_gate(hidden_states).reshape(batch, tokens, mixer.num_heads, mixer.head_dim)
        beta = torch.sigmoid(mixer.b_proj(hidden_states)).reshape(batch, tokens, mixer.num_heads)
        gate = mixer.g_b_proj(mixer.g_a_proj(hidden_states)).reshape(batch, tokens, mixer.num_heads, mixer.head_dim)
        return MixerProjections(mixed, {"g": log_decay, "beta": beta}, gate)

    def weights(self, mixer: torch.nn.Module) -> dict[str, torch.Tensor]:
        gate = mixer.forget_gate
        return {"A_log": gate.A_log.reshape(mixer.num_heads), "dt_bias": gate.dt_bias.reshape(mixer.num_heads, mixer.head_dim)}

    def finish(self, mixer: torch.nn.Module, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """core [b, s, H, V] -> [b, s, hidden]: HF's gated RMSNorm and output projection."""
        batch, tokens = core.shape[:2]
        return mixer.o_proj(mixer.o_norm(core, gate).reshape(batch, tokens, -1))


FAMILIES = (Mamba2Mixers(), GatedDeltaNetMixers(), KimiDeltaAttentionMixers())


def spec_text_with_shapes(spec_name: str, conv: dict, shapes: dict[str, dict], header: str) -> str:
    """The shipped spec `spec_name`'s text with a model's `conv` section and `shapes` (name -> shape entry) as its
    shapes (the last top-level key of every shipped spec), `header` as a comment above them."""
    text = spec_file(spec_name).read_text()
    cut = text.find("\nshapes:")
    if cut < 0 or any(line and not line[0].isspace() and not line.startswith("#") for line in text[cut + 1 :].splitlines()[1:]):
        raise ReplaygenError(f"{spec_file(spec_name)}: shapes is not its last top-level key, so its shapes cannot be replaced")
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    sections = yaml.safe_dump({"conv": conv}, default_flow_style=None) + "\n" + yaml.safe_dump({"shapes": shapes}, sort_keys=False, default_flow_style=None)
    return text[: cut + 1] + comment + sections


def model_spec(spec_name: str, conv: dict, shapes: dict[str, dict], where: str) -> Spec:
    """The shipped spec `spec_name` with a model's conv and `shapes` as its only shapes, validated as a spec file
    is; `where` names the shapes' origin in errors."""
    return load_spec_text(spec_text_with_shapes(spec_name, conv, shapes, where), f"{spec_file(spec_name)} with the shapes of {where}")


def mixer_conv(family, mixer: torch.nn.Module) -> dict:
    """The spec's conv section for a mixer's conv1d: its width, activation and how it packs its channels."""
    activations = {"silu": "silu", "swish": "silu", None: "none"}
    if mixer.activation not in activations:
        raise ReplaygenError(f"layer {mixer.layer_idx}: its conv's activation {mixer.activation!r} is not one a spec's conv has (silu or none)")
    return {"width": mixer.conv1d.kernel_size[0], "activation": activations[mixer.activation], "channels": list(family.conv_channels())}


def spec_from_config(config, capacity: int = 16, window: int = 4) -> str:
    """The spec file text for the recurrent layers of an HF config's causal LM: the shipped spec of their family
    with one shape per distinct layer shape, at ring capacity L and window T (a model of meta tensors is built from
    the config to find its mixers; nothing is downloaded or allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    mixers = recurrent_mixers(model)
    if not mixers:
        raise ReplaygenError(f"{type(model).__name__} ({config.model_type}) has no recurrent mixer replaygen takes")
    families = {family.spec_name for _, family in mixers}
    if len(families) > 1:
        raise ReplaygenError(f"{config.model_type} mixes recurrent families ({', '.join(sorted(families))}): one spec file holds one")
    family = mixers[0][1]
    convs = {str(mixer_conv(family, mixer)) for mixer, _ in mixers}
    if len(convs) > 1:
        raise ReplaygenError(f"{config.model_type}'s recurrent layers have different convs ({'; '.join(sorted(convs))}): one spec file holds one")
    entries = []
    for mixer, _ in mixers:
        entry = dict(family.shape_entry(mixer), capacity=capacity, window=window)
        if entry not in entries:
            entries.append(entry)
    base = config.model_type.replace("_", "-")
    shapes = {base if len(entries) == 1 else f"{base}-{i}": entry for i, entry in enumerate(entries)}
    layers = ", ".join(str(mixer.layer_idx) for mixer, _ in mixers)
    header = f"{type(model).__name__} ({config.model_type}): recurrent layers {layers}; written by replaygen spec-from-config"
    return spec_text_with_shapes(family.spec_name, mixer_conv(family, mixers[0][0]), shapes, header)


# The oldest transformers whose modeling modules this integration knows (the Mamba-2 models' conv and scan
# replacement points, causal_conv1d_forward and mamba2_scan_forward, and the delta-rule mixers' attributes).
OLDEST_TRANSFORMERS = (5, 25)


def check_transformers_version() -> None:
    """Raise where the transformers this Python imports is older than OLDEST_TRANSFORMERS: its models' mixers would
    otherwise be reported as not recurrent."""
    import transformers

    found = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if found < OLDEST_TRANSFORMERS:
        raise ReplaygenError(
            f"replaygen.integrations.transformers needs transformers >= {'.'.join(map(str, OLDEST_TRANSFORMERS))} (its modeling modules'"
            f" causal_conv1d_forward and mamba2_scan_forward, which replaygen replaces while it decodes); this Python has {transformers.__version__}"
        )


def recurrent_mixers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, "Mamba2Mixers | DeltaRuleMixers"]]:
    """Every recurrent mixer of `model` that a family here takes, in module order."""
    check_transformers_version()
    found = []
    for module in model.modules():
        for family in FAMILIES:
            if family.accepts(module):
                found.append((module, family))
                break
    return found


def shape_name(family, mixer: torch.nn.Module, capacity: int, window: int) -> str:
    entry = family.shape_entry(mixer)
    return f"h{entry['heads']}-g{entry['key_heads']}-v{entry['value_dim']}-k{entry['key_dim']}-l{capacity}-t{window}-w{mixer.conv1d.kernel_size[0]}"


def attach(
    model: torch.nn.Module, capacity: int = 16, window: int = 4, gpu: str | None = None, kernels: Kernels | str = Kernels.REPLAY
) -> "ReplayRuntime":
    """A runtime for `model`'s recurrent layers: one module per distinct layer shape, at ring capacity L and
    speculative window T. With `gpu`, a layer shape that a shipped spec ships (the same sizes, L, T and dtypes, in
    HF's state layout or transposed: the shipped GDN shapes store [value, key]) runs that shape's tuned configs of
    tune/<gpu>/ (the shipped module's kernels, the mixer's conv beside them); every other kernel runs its documented
    defaults. `kernels` picks the modules' replay kernels or their
    baseline kernels (`Kernels`, or its value "replay" / "baseline")."""
    kernels = Kernels.named(kernels)
    mixers = recurrent_mixers(model)
    if not mixers:
        raise ReplaygenError(
            f"{type(model).__name__} has no recurrent mixer replaygen takes (the Mamba-2 mixers of HF's Mamba-2 models and hybrids, "
            "the Gated DeltaNet of qwen3_next and qwen3_5, the Kimi Delta Attention of kimi_linear)"
        )
    modules: dict[tuple[str, str], tuple[ModuleType, bool]] = {}
    layers = []
    for mixer, family in mixers:
        name = shape_name(family, mixer, capacity, window)
        if (family.spec_name, name) not in modules:
            modules[(family.spec_name, name)] = _layer_module(family, mixer, name, capacity, window, gpu, f"{type(model).__name__} layer {mixer.layer_idx}")
        layers.append(RecurrentLayer(mixer.layer_idx, mixer, family, *modules[(family.spec_name, name)]))
    return ReplayRuntime(model, tuple(layers), capacity, window, kernels)


def _layer_module(family, mixer: torch.nn.Module, name: str, capacity: int, window: int, gpu: str | None, where: str) -> tuple[ModuleType, bool]:
    """The module of one layer shape with the mixer's conv, and whether it stores the state transposed to HF's
    layout: where `gpu` is given and a shipped spec ships a shape of the same meaning, in HF's state layout or the
    other one (vLLM's [value, key] where HF keeps [key, value]: the states are transposed at load and `states`),
    that shape with its tuned configs (the conv adds functions only, so the records' kernels are the module's);
    else the documented defaults in HF's layout."""
    entry = dict(family.shape_entry(mixer), capacity=capacity, window=window)
    conv = mixer_conv(family, mixer)
    spec = model_spec(family.spec_name, conv, {name: entry}, where)
    if gpu is not None:
        wanted = spec.shapes[0]
        shipped = load_spec(spec_file(family.spec_name)).shapes
        for transposed in (False, True):
            for candidate in shipped:
                if replace(candidate, name=name) != replace(wanted, layout=_other_layout(wanted.layout) if transposed else wanted.layout):
                    continue
                entry = dict(entry, layout=candidate.layout.value)
                spec = model_spec(family.spec_name, conv, {candidate.name: entry}, where)
                chosen = resolve_configs(spec, spec.shapes[0], gpu_name(gpu), records_dir(spec_file(family.spec_name)), allow_default=True)
                return load_kernels(spec, spec.shapes[0], chosen.configs, gpu_name(gpu), chosen.source), transposed
    return load_kernels(spec, spec.shapes[0]), False


def _other_layout(layout: StateLayout) -> StateLayout:
    return StateLayout.KEY_VALUE if layout is StateLayout.VALUE_KEY else StateLayout.VALUE_KEY


# Draft tokens for speculative decoding: (each sequence's tokens so far, prompt included; how many) -> per sequence
# that many draft tokens.
Drafter = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True)
class Generation:
    """What `ReplayRuntime.generate` produced: tokens [b, n], the logits [b, n, vocab] each was the argmax of, and
    the decode or verify steps after the prompt that produced them."""

    tokens: torch.Tensor
    logits: torch.Tensor
    steps: int


class ReplayRuntime:
    """An HF causal LM with its recurrent layers on generated kernels (replay, or `kernels` BASELINE): `start` a
    batch of prompts, then step it (`DecodeSession`), or `generate` greedily."""

    def __init__(self, model: torch.nn.Module, layers: tuple[RecurrentLayer, ...], capacity: int, window: int, kernels: Kernels = Kernels.REPLAY):
        self.model = model
        self.layers = layers
        self.capacity = capacity
        self.window = window
        self.kernels = kernels
        self.mode = Mode.PREFILL
        self.session: DecodeSession | None = None  # the session whose step runs now
        self._takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    # --- what the intercepted functions call ------------------------------------------------------------------
    def run_conv(self, layer: RecurrentLayer, inputs: torch.Tensor) -> torch.Tensor:
        """The conv of `layer` on pre-conv inputs [b, s, channels] after the session's committed ones (kept at once
        in decode, by `commit` in verify) -> [b, s, channels]."""
        conv1d, state, slots = layer.mixer.conv1d, self.session.conv[layer.index], self.session.slots
        weight = conv1d.weight[:, 0]
        if self.mode is Mode.DECODE:
            return layer.module.conv(state, slots, inputs[:, 0].contiguous(), weight, conv1d.bias)[:, None]
        return layer.module.conv(state, slots, inputs.contiguous(), weight, conv1d.bias)

    def run_recurrence(self, layer: RecurrentLayer, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """The recurrence of `layer` on inputs [b, s, ...] -> [b, s, heads, value_dim]: decode (s = 1) or verify. The
        inputs are HF's projections split and reshaped, views whose last dimension is contiguous: the kernels read
        their strides, so nothing is copied."""
        states = self.session.recurrent[layer.index]
        if self.mode is Mode.DECODE:
            return states.decode({k: v[:, 0] for k, v in inputs.items()}, weights)[:, None]
        return states.verify(inputs, weights)

    # --- decoding -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stepping(self, session: "DecodeSession", mode: Mode) -> Iterator[None]:
        """The model's recurrent layers on `session`'s states for one forward."""
        self.session, self.mode = session, mode
        try:
            with contextlib.ExitStack() as stack:
                for family in {layer.family for layer in self.layers}:
                    stack.enter_context(family.decoding(self, tuple(layer for layer in self.layers if layer.family is family)))
                yield
        finally:
            self.session, self.mode = None, Mode.PREFILL

    def forward(self, tokens: torch.Tensor, cache, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] of tokens [b, s] with HF's `cache` (for attention layers): `mask` [b, cached + s]
        (0 at left padding), `positions` [b, s] the tokens' positions."""
        kwargs = {"position_ids": positions} if self._takes_positions else {}
        return self.model(input_ids=tokens, attention_mask=mask, cache=cache, use_cache=True, **kwargs).logits

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "DecodeSession":
        """Prefill prompts input_ids [b, n] through HF's own path; attention_mask [b, n] marks left padding with 0
        (prompts of different lengths, as HF's generate takes them). The session's `logits` [b, vocab] are the last
        prompt token's."""
        from transformers import DynamicCache

        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device, torch.long)
        if mask.shape != input_ids.shape or bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"attention_mask must be 0/1 of the prompts' shape {tuple(input_ids.shape)}, got {tuple(mask.shape)}")
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("attention_mask: padding must be on the left (zeros before every prompt token, none after)")
        cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = self.forward(input_ids, cache, mask, positions)[:, -1]
        return DecodeSession(self, cache, mask, positions[:, -1] + 1, logits)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, draft_tokens: int = 0, drafter: Drafter | None = None, attention_mask: torch.Tensor | None = None
    ) -> Generation:
        """Greedy continuation of prompts input_ids [b, n] (left padding 0 in attention_mask) by max_new_tokens tokens. With draft_tokens >= 1, each step
        verifies the last token and draft_tokens drafts per sequence (`drafter`, default `prompt_lookup_drafts`) in
        one window and keeps the longest prefix that greedy decoding would have produced (the shortest of the batch's
        rows): the tokens are greedy decoding's, in fewer steps where drafts are right. Every row runs all
        max_new_tokens (no stop at an end-of-sequence token)."""
        if not 0 <= draft_tokens < self.window:
            raise ValueError(f"draft_tokens={draft_tokens}: a window holds the last token and at most {self.window - 1} drafts (window {self.window})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: generate at least one token")
        session = self.start(input_ids, attention_mask)
        scores = [session.logits[:, None]]
        prompts = [[t for t, keep in zip(row, kept) if keep] for row, kept in zip(input_ids.tolist(), session.mask.tolist())]
        history = [row + [token] for row, token in zip(prompts, session.logits.argmax(-1).tolist())]
        count, steps = 1, 0
        while count < max_new_tokens:
            last = scores[-1][:, -1].argmax(-1)
            if draft_tokens == 0:
                logits = session.decode(last)[:, None]
            else:
                drafts = torch.tensor((drafter or prompt_lookup_drafts)(history, draft_tokens), device=input_ids.device)
                logits = session.verify(torch.cat([last[:, None], drafts], dim=1))
                matches = (drafts == logits[:, :-1].argmax(-1)).long().cumprod(dim=1).sum(dim=1)
                kept = int(matches.min())  # the drafts every row accepts: one length for the batch's attention KV
                session.commit(kept + 1)
                logits = logits[:, : kept + 1]
            scores.append(logits)
            for row, tokens in zip(history, logits.argmax(-1).tolist()):
                row.extend(tokens)
            count += logits.shape[1]
            steps += 1
        logits = torch.cat(scores, dim=1)[:, :max_new_tokens]
        return Generation(logits.argmax(-1), logits, steps)


class DecodeSession:
    """A batch of sequences after their prompts: per recurrent layer its states (`RecurrentStates` of the runtime's
    kernels) and a conv state, HF's cache for the attention layers. `decode` one token per sequence, or `verify` a
    window and `commit` its prefix."""

    def __init__(self, runtime: ReplayRuntime, cache, mask: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor):
        self.runtime = runtime
        self.cache = cache
        self.mask = mask  # [b, cached tokens]: 0 at left padding
        self.positions = positions  # [b]: the next token's position per sequence
        self.logits = logits
        self.pending = 0  # tokens of a verified window that wait for `commit`
        batch, device = mask.shape[0], mask.device
        dtype = next(runtime.model.parameters()).dtype
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        self.recurrent: dict[int, RecurrentStates] = {}
        self.conv = {}
        for layer in runtime.layers:
            recurrent, conv_state = cache.get_recurrent_state(layer.index), cache.get_conv_state(layer.index)
            if recurrent is None or conv_state is None:
                raise ReplaygenError(f"layer {layer.index}: the prompt left no recurrent or conv state in HF's cache")
            states = layer.module_states(recurrent)
            self.recurrent[layer.index] = runtime.kernels.states.load(layer.module, self.slots, states, dtype, runtime.window)
            conv = layer.module.allocate_conv(batch, device, dtype)
            layer.module.load_conv(conv, self.slots, conv_state[..., -(layer.mixer.conv1d.kernel_size[0] - 1) :].to(dtype))
            self.conv[layer.index] = conv

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, vocab] after one more token per sequence, tokens [b]."""
        self._check_no_pending("decode")
        with self.runtime.stepping(self, Mode.DECODE):
            logits = self.runtime.forward(tokens[:, None], self.cache, *self._extended(1))[:, 0]
        self._keep(1)
        return logits

    @torch.no_grad()
    def verify(self, window: torch.Tensor) -> torch.Tensor:
        """Logits [b, T, vocab] of a window of tokens [b, T] (T <= the runtime's window) after each sequence's
        committed ones; nothing is kept until `commit`."""
        self._check_no_pending("verify")
        if not 1 <= window.shape[1] <= self.runtime.window:
            raise ValueError(f"a window of {window.shape[1]} tokens: verify takes 1..{self.runtime.window}")
        with self.runtime.stepping(self, Mode.VERIFY):
            logits = self.runtime.forward(window, self.cache, *self._extended(window.shape[1]))
        self.pending = window.shape[1]
        return logits

    def commit(self, accepted: int) -> None:
        """Keep the first `accepted` tokens (1..T, the same for every sequence) of the last verified window: the
        recurrent states keep those tokens (replay: the cursor moves; baseline: the committed snapshot), the conv
        cursor moves past them, the attention layers drop the others' KV."""
        if not self.pending:
            raise ReplaygenError("commit without a verify before it")
        if not 1 <= accepted <= self.pending:
            raise ValueError(f"accepted={accepted}: the last window had {self.pending} tokens (keep 1..{self.pending})")
        for layer in self.runtime.layers:
            counts = torch.full_like(self.slots, accepted)
            self.recurrent[layer.index].commit(counts, self.pending)
            layer.module.commit_conv(self.conv[layer.index], self.slots, counts, num_tokens=self.pending)
        _crop_attention(self.cache, self.pending - accepted)
        self._keep(accepted)
        self.pending = 0

    def states(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per recurrent layer index: its states [b, heads, *state] in HF's layout (materialized) and conv inputs
        [b, channels, W - 1]."""
        self._check_no_pending("states")
        return {
            layer.index: (layer.hf_states(self.recurrent[layer.index].materialize()), layer.module.materialize_conv(self.conv[layer.index], self.slots))
            for layer in self.runtime.layers
        }

    def _extended(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention mask [b, cached + tokens] and positions [b, tokens] of `tokens` more tokens per sequence."""
        ones = torch.ones((self.mask.shape[0], tokens), dtype=self.mask.dtype, device=self.mask.device)
        return torch.cat([self.mask, ones], dim=1), self.positions[:, None] + torch.arange(tokens, device=self.mask.device)

    def _keep(self, tokens: int) -> None:
        self.mask = self._extended(tokens)[0]
        self.positions = self.positions + tokens

    def _check_no_pending(self, what: str) -> None:
        if self.pending:
            raise ReplaygenError(f"{what} with a verified window of {self.pending} tokens not committed: commit it first")


def _crop_attention(cache, tokens: int) -> None:
    """Drop the last `tokens` keys and values of every attention layer of HF's `cache`, the attention part of a
    layer that holds a recurrent state beside it (falcon_h1, zamba2) included; recurrent states stay (replaygen's)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            attention = next(c for c in type(layer).__mro__ if issubclass(c, DynamicLayer) and not issubclass(c, LinearAttentionCacheLayerMixin))
            attention.crop(layer, -tokens)


def prompt_lookup_drafts(sequences: list[list[int]], count: int) -> list[list[int]]:
    """A `Drafter`: `prompt_lookup` of each sequence, trigrams down to single tokens."""
    return [prompt_lookup(tokens, count) for tokens in sequences]


def prompt_lookup(tokens: list[int], count: int, max_ngram: int = 3) -> list[int]:
    """`count` draft tokens for a sequence (prompt lookup): the tokens that followed the latest earlier occurrence of
    its last n tokens, for the largest n <= max_ngram that occurs; the last token repeated where none does."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + count]
                return follow + [follow[-1]] * (count - len(follow))
    return [tokens[-1]] * count
