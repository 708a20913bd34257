"""Float64 reference of a spec's recurrence, step by step, driven by the spec.

The reference keeps one full state per slot in the logical orientation
`[heads, value_dim, key_dim]` (y = S q), whatever the kernels' storage layout,
and advances it exactly as MATH.md writes the recurrence. Tests and
`replaygen check` compare every generated kernel against it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from replaygen.spec.model import (
    Conv,
    ConvActivation,
    DecayForm,
    DecayGranularity,
    QueryScale,
    Spec,
    StateLayout,
    TargetShape,
    UpdateKind,
    UpdateWeight,
    VectorTransform,
)

F64 = torch.float64


class Reference:
    """The recurrence of `spec` at `shape` over `num_slots` slots, in float64 on the CPU."""

    def __init__(self, spec: Spec, shape: TargetShape, num_slots: int):
        self.spec = spec
        self.shape = shape
        self.states = torch.zeros((num_slots, shape.heads, shape.value_dim, shape.key_dim), dtype=F64)

    # --- state access -------------------------------------------------------------------------
    def to_layout(self, states: torch.Tensor) -> torch.Tensor:
        """[n, H, V, K] logical states -> the spec's storage layout."""
        return states if self.shape.layout is StateLayout.VALUE_KEY else states.transpose(-1, -2)

    def from_layout(self, states: torch.Tensor) -> torch.Tensor:
        """States in the spec's storage layout -> [n, H, V, K] float64."""
        states = states.detach().to("cpu", F64)
        return states if self.shape.layout is StateLayout.VALUE_KEY else states.transpose(-1, -2)

    def load(self, slots: list[int], states: torch.Tensor) -> None:
        """Set the states of `slots` from `states` [n, *state layout]."""
        logical = self.from_layout(states)
        for row, slot in enumerate(slots):
            if slot >= 0:
                self.states[slot] = logical[row]

    # --- one step -----------------------------------------------------------------------------
    def decode(self, slots: list[int], inputs: Mapping[str, torch.Tensor | None], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Advance each non-padding slot by one token; returns outputs [batch, H, V] (NaN rows for padding)."""
        rows = [r for r, s in enumerate(slots) if s >= 0]
        out = torch.full((len(slots), self.shape.heads, self.shape.value_dim), float("nan"), dtype=F64)
        if not rows:
            return out
        index = torch.tensor([slots[r] for r in rows])
        picked = {name: (None if t is None else t.detach().to("cpu", F64)[rows]) for name, t in inputs.items()}
        w64 = {name: t.detach().to("cpu", F64) for name, t in weights.items()}
        new_states, y = self.step(self.states[index], picked, w64)
        self.states[index] = new_states
        out[rows] = y
        return out

    def verify(self, slots: list[int], inputs: Mapping[str, torch.Tensor | None], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run a window [batch, T, ...] token by token from each slot's committed state, without committing.

        Returns outputs [batch, T, H, V] (NaN rows for padding); `commit` then keeps a prefix.
        """
        value = inputs[self.spec.inputs.value]
        batch, tokens = value.shape[:2]
        out = torch.full((batch, tokens, self.shape.heads, self.shape.value_dim), float("nan"), dtype=F64)
        rows = [r for r, s in enumerate(slots) if s >= 0]
        self._window = {}
        if not rows:
            return out
        index = torch.tensor([slots[r] for r in rows])
        w64 = {name: t.detach().to("cpu", F64) for name, t in weights.items()}
        S = self.states[index]
        states = []
        for t in range(tokens):
            picked = {name: (None if x is None else x.detach().to("cpu", F64)[rows, t]) for name, x in inputs.items()}
            S, y = self.step(S, picked, w64)
            out[rows, t] = y
            states.append(S)
        self._window = {slots[r]: [st[i] for st in states] for i, r in enumerate(rows)}
        return out

    def commit(self, slots: list[int], accepted: list[int]) -> None:
        """Keep the first accepted[b] tokens of the last verified window of each slot."""
        for slot, keep in zip(slots, accepted):
            if slot >= 0 and keep > 0:
                self.states[slot] = self._window[slot][keep - 1]

    def step(self, S: torch.Tensor, x: Mapping[str, torch.Tensor | None], w: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence step. S: [n, H, V, K]; inputs as the API names them, batch-first. Returns (S', y [n, H, V])."""
        spec, shape = self.spec, self.shape
        ratio = shape.heads_per_key_head
        v = x[spec.inputs.value]
        k = _transform(x[spec.inputs.key], spec.key.transform, spec.key.eps).repeat_interleave(ratio, dim=1)
        q = _transform(x[spec.inputs.query], spec.query.transform, spec.query.eps).repeat_interleave(ratio, dim=1)
        if spec.query.scale is QueryScale.INV_SQRT_KEY_DIM:
            q = q * shape.key_dim**-0.5
        log_decay, dt = self._log_decay(x, w)
        weight = self._weight(x, dt)
        if spec.decay.granularity is DecayGranularity.HEAD:
            S = S * torch.exp(log_decay)[:, :, None, None]
        else:
            S = S * torch.exp(log_decay)[:, :, None, :]
        if spec.update.kind is UpdateKind.DELTA:
            u = weight[:, :, None] * (v - torch.einsum("nhvk,nhk->nhv", S, k))
        else:
            u = weight[:, :, None] * v
        S = S + u[:, :, :, None] * k[:, :, None, :]
        y = torch.einsum("nhvk,nhk->nhv", S, q)
        if spec.readout.skip:
            y = y + w[spec.readout.skip][None, :, None] * v
        gate = spec.readout.gate
        if gate is not None and x.get(gate.input) is not None:
            y = y * F.silu(x[gate.input])
        return S, y

    def _log_decay(self, x: Mapping[str, torch.Tensor | None], w: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = self.spec.decay
        if d.form is DecayForm.DIRECT:
            return x[d.input], None
        if d.direct_input is not None and x.get(d.direct_input) is not None:
            return x[d.direct_input], None
        pre = x[d.input]
        if d.bias:
            pre = pre + w[d.bias][None]
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
        return torch.ones((n, self.shape.heads), dtype=F64)


def _transform(t: torch.Tensor, transform: VectorTransform, eps: float) -> torch.Tensor:
    if transform is VectorTransform.L2NORM:
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + eps)
    return t


def conv_reference(history: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: Conv) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's causal depthwise conv in float64: history [n, C, W - 1] (oldest first) and inputs [n, s, C] ->
    (outputs [n, s, C], the last W - 1 inputs [n, C, W - 1] after them)."""
    full = torch.cat([history.to(F64), inputs.to(F64).transpose(1, 2)], dim=-1)
    out = F.conv1d(full, weight.to(F64)[:, None], None if bias is None else bias.to(F64), groups=weight.shape[0])
    if conv.activation is ConvActivation.SILU:
        out = F.silu(out)
    return out.transpose(1, 2), full[..., -(conv.width - 1) :]
