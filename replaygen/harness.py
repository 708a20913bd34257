"""Correctness harness: drive generated kernels and the float64 reference side by side.

Used by `replaygen check` and the test suite. A scenario runs several sequences
that join a batch at different steps (so they flush on different steps), skips
some of them on some steps (padding rows), poisons every slot memory nothing
may touch, and compares outputs and full states against the reference at
every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from replaygen.plan import api_tensors
from replaygen.reference import Reference
from replaygen.spec.model import DecayGranularity, Spec, TargetShape

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
POISON_CURSOR = -777


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has NaN/inf."""
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class InputFactory:
    """Random, never-zero weights, per-token inputs and states of realistic scale for one spec and shape."""

    def __init__(self, spec: Spec, shape: TargetShape, device: str | torch.device, act_dtype: torch.dtype, seed: int):
        self.spec = spec
        self.shape = shape
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.inputs, self.weight_args = api_tensors(spec, shape)

    def _randn(self, *size: int) -> torch.Tensor:
        return torch.randn(size, generator=self.gen, dtype=torch.float64)

    def _uniform(self, low: float, high: float, *size: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(size, generator=self.gen, dtype=torch.float64)

    def weights(self) -> dict[str, torch.Tensor]:
        d, r = self.spec.decay, self.spec.readout
        out = {}
        for arg in self.weight_args:
            if arg.name == d.rate:
                values = torch.log(self._uniform(1.0, 8.0, *arg.sizes))  # A in [1, 8]
            elif arg.name == d.bias:
                values = self._uniform(-4.0, -1.0, *arg.sizes)  # softplus(bias) ~ 0.02 .. 0.3
            elif arg.name == r.skip:
                values = self._randn(*arg.sizes)
            else:
                raise AssertionError(f"no generator for weight {arg.name}")
            out[arg.name] = values.to(self.device, torch.float32)
        return out

    def step(self, batch: int, *, use_gate: bool = True, use_direct: bool = False) -> dict[str, torch.Tensor | None]:
        """Inputs of one token for `batch` rows ([batch, T, ...] is the verify form, not this)."""
        s = self.spec
        act_names = {s.inputs.value, s.inputs.key, s.inputs.query}
        out: dict[str, torch.Tensor | None] = {}
        for arg in self.inputs:
            size = (batch, *arg.sizes)
            name = arg.name
            if name == s.decay.input:
                values = None if use_direct and s.decay.direct_input else self._randn(*size) * 0.5
            elif name == s.decay.direct_input:
                values = -self._uniform(0.01, 1.0, *size) if use_direct else None
            elif name == s.update.weight_input:
                values = None if use_direct and s.update.weight_direct_input else self._randn(*size)
            elif name == s.update.weight_direct_input:
                values = self._uniform(0.0, 1.0, *size) if use_direct else None
            elif s.readout.gate is not None and name == s.readout.gate.input:
                values = self._randn(*size) if use_gate or not arg.optional else None
            else:
                values = self._randn(*size)
            if values is None:
                out[name] = None
            else:
                dtype = self.act_dtype if name in act_names or name == (s.readout.gate.input if s.readout.gate else None) else torch.float32
                out[name] = values.to(self.device, dtype)
        return out

    def states(self, n: int, layout_shape: tuple[int, ...]) -> torch.Tensor:
        return (0.5 * self._randn(n, *layout_shape)).to(self.device, torch.float32)


@dataclass
class KernelErrors:
    """Worst relative error seen per kernel, and where."""

    worst: dict[str, tuple[float, int]] = field(default_factory=dict)

    def record(self, kernel: str, error: float, step: int) -> None:
        if kernel not in self.worst or not error <= self.worst[kernel][0]:
            self.worst[kernel] = (error, step)


@dataclass(frozen=True)
class CheckReport:
    scenario: str
    steps: int
    tolerance: float
    worst: dict[str, tuple[float, int]]
    untouched: tuple[str, ...]  # memory that must not change but did (empty when fine)

    @property
    def ok(self) -> bool:
        return not self.untouched and all(err <= self.tolerance for err, _ in self.worst.values())

    def lines(self) -> list[str]:
        rows = [f"{self.scenario}: {self.steps} steps, tolerance {self.tolerance:.1e}: {'PASS' if self.ok else 'FAIL'}"]
        for kernel, (err, step) in sorted(self.worst.items()):
            flag = "ok" if err <= self.tolerance else "FAIL"
            rows.append(f"  {kernel:<18} max rel err {err:.2e} (step {step}) {flag}")
        rows += [f"  touched memory it must not: {name}" for name in self.untouched]
        return rows


def _poison(tensor: torch.Tensor, slots: list[int]) -> None:
    for slot in slots:
        if tensor.dtype.is_floating_point:
            tensor[slot] = float("nan")
        else:
            tensor[slot] = POISON_CURSOR


def _still_poisoned(tensor: torch.Tensor, slots: list[int]) -> bool:
    part = tensor[slots]
    if tensor.dtype.is_floating_point:
        return bool(torch.isnan(part).all())
    return bool((part == POISON_CURSOR).all())


def check_decode(
    module: ModuleType,
    spec: Spec,
    shape: TargetShape,
    *,
    device: str | torch.device = "cpu",
    act_dtype: torch.dtype = torch.float32,
    batch: int = 3,
    cycles: int = 3,
    route: str | None = None,
    flush_at: int | None = None,
    use_gate: bool = True,
    use_direct: bool = False,
    seed: int = 0,
) -> CheckReport:
    """Standard decode (replay, baseline, materialize, load) against the reference over `cycles` flush cycles."""
    factory = InputFactory(spec, shape, device, act_dtype, seed)
    weights = factory.weights()
    num_slots = batch + 2
    perm = torch.randperm(num_slots, generator=factory.gen).tolist()
    row_slot = perm[:batch]
    unused = perm[batch:]
    period = flush_at or shape.capacity
    offsets = [0] + [1 + (3 * r) % period for r in range(1, batch)]  # different flush phases
    steps = cycles * period + max(offsets)

    replay = module.allocate(num_slots, device, act_dtype)
    baseline = module.allocate_baseline(num_slots, device)
    reference = Reference(spec, shape, num_slots)
    for tensor in (replay.checkpoint, *replay.buffers(), replay.cursor, baseline):
        _poison(tensor, [s for s in range(num_slots)])
    errors = KernelErrors()
    for step in range(steps):
        joining = [r for r in range(batch) if offsets[r] == step]
        if joining:
            slots = torch.tensor([row_slot[r] for r in joining], dtype=torch.int32, device=device)
            init = factory.states(len(joining), tuple(module.STATE_SHAPE))
            module.load(replay, slots, init)
            baseline[slots.long()] = init
            reference.load([row_slot[r] for r in joining], init.cpu())
        active = [step >= offsets[r] and not (r == 1 and step % 7 == 3) for r in range(batch)]
        row_slots = [row_slot[r] if active[r] else -1 for r in range(batch)]
        slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        inputs = factory.step(batch, use_gate=use_gate, use_direct=use_direct)
        rows = [r for r in range(batch) if active[r]]
        sentinel = torch.full((batch, shape.heads, shape.value_dim), float("nan"), dtype=act_dtype, device=device)
        y_ref = reference.decode(row_slots, inputs, weights)
        y_rep = module.decode(replay, slots, **inputs, **weights, out=sentinel.clone(), route=route, flush_at=flush_at)
        y_base = module.baseline_decode(baseline, slots, **inputs, **weights, out=sentinel.clone())
        for name, y in (("replay_decode", y_rep), ("baseline_decode", y_base)):
            if rows:
                errors.record(name, relative_error(y[rows], y_ref[rows]), step)
            if len(rows) < batch and not torch.isnan(y[[r for r in range(batch) if not active[r]]]).all():
                errors.record(name + " (padding row written)", float("inf"), step)
        mat = module.materialize(replay, slots, out=torch.full((batch, *module.STATE_SHAPE), float("nan"), device=device))
        if rows:
            ref_states = reference.to_layout(reference.states[[row_slot[r] for r in rows]])
            errors.record("materialize", relative_error(mat[rows], ref_states), step)
            errors.record("baseline_state", relative_error(baseline[[row_slot[r] for r in rows]], ref_states), step)
    untouched = []
    for name, tensor in (("checkpoint", replay.checkpoint), ("cursor", replay.cursor), ("baseline state", baseline)):
        if not _still_poisoned(tensor, unused):
            untouched.append(f"{name} of unused slots {unused}")
    for index, tensor in enumerate(replay.buffers()):
        if not _still_poisoned(tensor, unused):
            untouched.append(f"buffer {index} of unused slots {unused}")
    label = f"decode route={route or 'default'} flush_at={flush_at or 'default'} {str(act_dtype).replace('torch.', '')} batch={batch}"
    return CheckReport(label, steps, TOLERANCE[act_dtype], dict(errors.worst), tuple(untouched))


def decay_is_per_channel(spec: Spec) -> bool:
    return spec.decay.granularity is DecayGranularity.CHANNEL
