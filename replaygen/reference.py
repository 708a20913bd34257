"""Float64 reference of a spec's recurrence, step by step, driven by the spec.

The reference keeps one full state per slot in the logical orientation
`[heads, value_dim, key_dim]` (y = S q), whatever the kernels' storage layout,
and advances it exactly as MATH.md writes the recurrence. Where the spec carries
more than the state from one step to the next (a rotary angle per head, the
trapezoid's previous entry), the reference keeps that too. Tests and
`replaygen check` compare every generated kernel against it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replaygen.spec.model import (
    Conv,
    ConvActivation,
    DecayForm,
    DecayGranularity,
    QueryScale,
    RateActivation,
    RotaryPairing,
    Spec,
    StateLayout,
    TargetShape,
    UpdateKind,
    UpdateWeight,
    VectorSpec,
    VectorTransform,
)

F64 = torch.float64


@dataclass(frozen=True)
class Carried:
    """What a recurrence carries from one step to the next, for n sequences: the state [n, H, V, K] and, where the
    spec has them, the rotary angles [n, H, A] and the trapezoid's previous entry (value [n, H, V], keys [n, H, R, K],
    as the update used them: transformed and rotated)."""

    state: torch.Tensor
    angle: torch.Tensor | None = None
    last_value: torch.Tensor | None = None
    last_key: torch.Tensor | None = None

    def rows(self, index: torch.Tensor | int) -> Carried:
        """The sequences at `index`."""
        return Carried(*(None if t is None else t[index] for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.state, self.angle, self.last_value, self.last_key)

    def set_rows(self, index: torch.Tensor | int, other: Carried) -> None:
        """Overwrite the sequences at `index` with `other`'s."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            if mine is not None:
                mine[index] = theirs


class Reference:
    """The recurrence of `spec` at `shape` over `num_slots` slots, in float64 on `device` (the CPU unless given: a
    GPU runs long drift runs at full layer sizes)."""

    def __init__(self, spec: Spec, shape: TargetShape, num_slots: int, device: str | torch.device = "cpu"):
        shape = spec.resolve(shape)
        self.spec = spec
        self.shape = shape
        self.device = torch.device(device)
        n, h = num_slots, shape.heads
        trapezoid = spec.update.kind is UpdateKind.TRAPEZOID
        self.carried = Carried(
            state=torch.zeros((n, h, shape.value_dim, shape.key_dim), dtype=F64, device=self.device),
            angle=torch.zeros((n, h, spec.rotary.angles(shape.key_dim)), dtype=F64, device=self.device) if spec.rotary else None,
            last_value=torch.zeros((n, h, shape.value_dim), dtype=F64, device=self.device) if trapezoid else None,
            last_key=torch.zeros((n, h, shape.rank, shape.key_dim), dtype=F64, device=self.device) if trapezoid else None,
        )

    @property
    def states(self) -> torch.Tensor:
        """The slots' states [slots, H, V, K]."""
        return self.carried.state

    # --- state access -------------------------------------------------------------------------
    def to_layout(self, states: torch.Tensor) -> torch.Tensor:
        """[n, H, V, K] logical states -> the spec's storage layout."""
        return states if self.shape.layout is StateLayout.VALUE_KEY else states.transpose(-1, -2)

    def from_layout(self, states: torch.Tensor) -> torch.Tensor:
        """States in the spec's storage layout -> [n, H, V, K] float64."""
        states = states.detach().to(self.device, F64)
        return states if self.shape.layout is StateLayout.VALUE_KEY else states.transpose(-1, -2)

    def load(self, slots: list[int], states: torch.Tensor, **carried: torch.Tensor) -> None:
        """Set the states of `slots` from `states` [n, *state layout] and, for a spec that carries more, from
        `carried` (angle [n, H, A], last_value [n, H, V], last_key [n, H, R, K])."""
        given = Carried(self.from_layout(states), **{name: t.detach().to(self.device, F64) for name, t in carried.items()})
        missing = [name for name, mine, theirs in zip(("angle", "last_value", "last_key"), self.carried.tensors()[1:], given.tensors()[1:]) if (mine is None) != (theirs is None)]
        if missing:
            raise ValueError(f"the carried {', '.join(missing)} must be given exactly where the spec carries them")
        for row, slot in enumerate(slots):
            if slot >= 0:
                self.carried.set_rows(slot, given.rows(row))

    # --- one step -----------------------------------------------------------------------------
    def decode(self, slots: list[int], inputs: Mapping[str, torch.Tensor | None], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Advance each non-padding slot by one token; returns outputs [batch, H, V] (NaN rows for padding)."""
        rows = [r for r, s in enumerate(slots) if s >= 0]
        out = torch.full((len(slots), self.shape.heads, self.shape.value_dim), float("nan"), dtype=F64, device=self.device)
        if not rows:
            return out
        index = torch.tensor([slots[r] for r in rows], device=self.device)
        picked = {name: (None if t is None else t.detach().to(self.device, F64)[rows]) for name, t in inputs.items()}
        w64 = {name: t.detach().to(self.device, F64) for name, t in weights.items()}
        after, y = self.step(self.carried.rows(index), picked, w64)
        self.carried.set_rows(index, after)
        out[rows] = y
        return out

    def verify(self, slots: list[int], inputs: Mapping[str, torch.Tensor | None], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run a window [batch, T, ...] token by token from each slot's committed state, without committing.

        Returns outputs [batch, T, H, V] (NaN rows for padding); `commit` then keeps a prefix.
        """
        value = inputs[self.spec.inputs.value]
        batch, tokens = value.shape[:2]
        out = torch.full((batch, tokens, self.shape.heads, self.shape.value_dim), float("nan"), dtype=F64, device=self.device)
        rows = [r for r, s in enumerate(slots) if s >= 0]
        self._window = {}
        if not rows:
            return out
        index = torch.tensor([slots[r] for r in rows], device=self.device)
        w64 = {name: t.detach().to(self.device, F64) for name, t in weights.items()}
        carried = self.carried.rows(index)
        after = []
        for t in range(tokens):
            picked = {name: (None if x is None else x.detach().to(self.device, F64)[rows, t]) for name, x in inputs.items()}
            carried, y = self.step(carried, picked, w64)
            out[rows, t] = y
            after.append(carried)
        self._window = {slots[r]: [c.rows(i) for c in after] for i, r in enumerate(rows)}
        return out

    def commit(self, slots: list[int], accepted: list[int]) -> None:
        """Keep the first accepted[b] tokens of the last verified window of each slot."""
        for slot, keep in zip(slots, accepted):
            if slot >= 0 and keep > 0:
                self.carried.set_rows(slot, self._window[slot][keep - 1])

    def step(self, carried: Carried, x: Mapping[str, torch.Tensor | None], w: Mapping[str, torch.Tensor]) -> tuple[Carried, torch.Tensor]:
        """One recurrence step. carried: [n, ...]; inputs as the API names them, batch-first. Returns (carried after
        the step, y [n, H, V])."""
        spec, shape = self.spec, self.shape
        S = carried.state
        v = x[spec.inputs.value]
        log_decay, dt = self._log_decay(x, w)
        angle = self._advance_angle(carried.angle, x, dt)
        k = self._key_or_query(x[spec.inputs.key], spec.key, w, angle)
        q = self._key_or_query(x[spec.inputs.query], spec.query, w, angle)
        if spec.query.scale is QueryScale.INV_SQRT_KEY_DIM:
            q = q * shape.key_dim**-0.5
        weight = self._weight(x, dt)
        decay = torch.exp(log_decay)
        scaled = self._rank_values(v, w)  # [n, H, R, V]
        if spec.update.kind is UpdateKind.TRAPEZOID:
            mix = torch.sigmoid(x[spec.update.mix_input])
            carry = (1 - mix) * weight
            S = S + carry[:, :, None, None] * _outer(self._rank_values(carried.last_value, w), carried.last_key)
            weight = mix * weight
        if spec.decay.granularity is DecayGranularity.HEAD:
            S = S * decay[:, :, None, None]
        else:
            S = S * decay[:, :, None, :]
        if spec.update.kind is UpdateKind.DELTA:
            u = weight[:, :, None] * (v - torch.einsum("nhvk,nhk->nhv", S, k[:, :, 0]))
            S = S + u[:, :, :, None] * k[:, :, 0, None, :]
        else:
            S = S + weight[:, :, None, None] * _outer(scaled, k)
        y = torch.einsum("nhvk,nhrk->nhrv", S, q)  # [n, H, R, V]
        if spec.readout.skip:
            y = y + w[spec.readout.skip][None, :, None, None] * scaled
        gate = spec.readout.gate
        if gate is not None and x.get(gate.input) is not None:
            y = y * F.silu(self._rank_values(x[gate.input], w, gate=True))
        y = (y * self._output_scale(w)).sum(2)
        trapezoid = spec.update.kind is UpdateKind.TRAPEZOID
        after = Carried(S, angle, v if trapezoid else None, k if trapezoid else None)
        return after, y

    # --- parts of a step ----------------------------------------------------------------------
    def _log_decay(self, x: Mapping[str, torch.Tensor | None], w: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = self.spec.decay
        if d.form is DecayForm.DIRECT:
            return x[d.input], None
        if d.direct_input is not None and x.get(d.direct_input) is not None:
            return x[d.direct_input], None
        pre = x[d.input]
        if d.bias:
            pre = pre + w[d.bias][None]
        if d.form is DecayForm.NEG_RATE_SOFTPLUS:
            dt = F.softplus(pre)
            return -_token_rate(x[d.token_rate.input], d.token_rate.activation).clamp_min(d.token_rate.floor) * dt, dt
        rate = torch.exp(w[d.rate])
        rate = rate[None, :, None] if d.granularity is DecayGranularity.CHANNEL else rate[None, :]
        if d.form is DecayForm.LOWER_BOUND_SIGMOID:
            return d.bound * torch.sigmoid(rate * pre), None
        dt = F.softplus(pre)  # threshold 20, as the kernels
        return -rate * dt, dt

    def _weight(self, x: Mapping[str, torch.Tensor | None], dt: torch.Tensor | None) -> torch.Tensor:
        u = self.spec.update
        if u.weight is UpdateWeight.DECAY_DT:
            return dt
        if u.weight is UpdateWeight.SIGMOID:
            if u.weight_direct_input is not None and x.get(u.weight_direct_input) is not None:
                return x[u.weight_direct_input]
            return torch.sigmoid(x[u.weight_input])
        n = x[self.spec.inputs.value].shape[0]
        return torch.ones((n, self.shape.heads), dtype=F64, device=self.device)

    def _advance_angle(self, angle: torch.Tensor | None, x: Mapping[str, torch.Tensor | None], dt: torch.Tensor | None) -> torch.Tensor | None:
        """The rotary angles [n, H, A] after this step: the previous ones plus pi * tanh(angle input) * dt', mod 2 pi."""
        rotary = self.spec.rotary
        if rotary is None:
            return None
        theta = angle + math.pi * torch.tanh(x[rotary.angle_input])[:, None, :] * dt[:, :, None]
        return theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))

    def _key_or_query(self, raw: torch.Tensor, vector: VectorSpec, w: Mapping[str, torch.Tensor], angle: torch.Tensor | None) -> torch.Tensor:
        """The transformed key or query [n, H, R, K] of this step from the raw input [n, G, K] ([n, R, G, K] at rank
        R > 1): normalised, weighted, repeated over each key head's heads, biased per head, rotated."""
        shape = self.shape
        ranked = raw if shape.rank > 1 else raw[:, None]  # [n, R, G, K]
        t = _normalise(ranked, vector.transform, vector.eps)
        if vector.weight:
            t = t * w[vector.weight]
        t = t.repeat_interleave(shape.heads_per_key_head, dim=2).transpose(1, 2)  # [n, H, R, K]
        if vector.bias:
            bias = w[vector.bias]
            t = t + (bias if shape.rank > 1 else bias[:, None])[None]
        return t if angle is None else _rotate(t, angle, shape.rotary_pairing)

    def _rank_values(self, v: torch.Tensor, w: Mapping[str, torch.Tensor], gate: bool = False) -> torch.Tensor:
        """[n, H, V] -> [n, H, R, V]: the value (or, with `gate`, the gate input) scaled per rank."""
        ranks = self.spec.ranks
        if self.shape.rank == 1:
            return v[:, :, None]
        name = ranks.gate_scale if gate else ranks.value_scale
        return v[:, :, None] * (w[name][None] if name else 1.0)

    def _output_scale(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor | float:
        """[1, H, R, V] the output scale of each rank (1 at rank 1)."""
        return w[self.spec.ranks.output_scale][None] if self.shape.rank > 1 else 1.0


def _outer(values: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_r values[:, :, r] keys[:, :, r]^T: [n, H, R, V] x [n, H, R, K] -> [n, H, V, K]."""
    return torch.einsum("nhrv,nhrk->nhvk", values, keys)


def _token_rate(x: torch.Tensor, activation: RateActivation) -> torch.Tensor:
    if activation is RateActivation.HEAVY_TAIL:
        return torch.where(x >= 0, 1 + x, 1 / (1 - x.clamp_max(0)))
    return torch.exp(x)


def _normalise(t: torch.Tensor, transform: VectorTransform, eps: float) -> torch.Tensor:
    if transform is VectorTransform.L2NORM:
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + eps)
    if transform is VectorTransform.RMSNORM:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps)
    return t


def _rotate(t: torch.Tensor, angle: torch.Tensor, pairing: RotaryPairing) -> torch.Tensor:
    """t [n, H, R, K] with each rotary pair (i, j) turned by its angle [n, H, A]: (t_i, t_j) -> (t_i cos - t_j sin,
    t_i sin + t_j cos). Pairs (2a, 2a + 1) or (a, a + K/2) for a < A; the other channels pass."""
    pairs = angle.shape[-1]
    key_dim = t.shape[-1]
    first = torch.arange(pairs) * 2 if pairing is RotaryPairing.ADJACENT else torch.arange(pairs)
    second = first + 1 if pairing is RotaryPairing.ADJACENT else first + key_dim // 2
    cos, sin = torch.cos(angle)[:, :, None], torch.sin(angle)[:, :, None]
    out = t.clone()
    out[..., first] = t[..., first] * cos - t[..., second] * sin
    out[..., second] = t[..., first] * sin + t[..., second] * cos
    return out


def conv_reference(history: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: Conv) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's causal depthwise conv in float64: history [n, C, W - 1] (oldest first) and inputs [n, s, C] ->
    (outputs [n, s, C], the last W - 1 inputs [n, C, W - 1] after them)."""
    full = torch.cat([history.to(F64), inputs.to(F64).transpose(1, 2)], dim=-1)
    out = F.conv1d(full, weight.to(F64)[:, None], None if bias is None else bias.to(F64), groups=weight.shape[0])
    if conv.activation is ConvActivation.SILU:
        out = F.silu(out)
    return out.transpose(1, 2), full[..., -(conv.width - 1) :]
