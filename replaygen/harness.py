"""Correctness harness: drive generated kernels and the float64 reference side by side.

Used by `replaygen check` and the test suite. A scenario runs several sequences
that join a batch at different steps (so they flush on different steps), skips
some of them on some steps (padding rows), poisons every slot memory nothing
may touch, and compares outputs and full states against the reference at
every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType

import torch

from replaygen.plan import api_tensors
from replaygen.reference import Reference, conv_reference
from replaygen.spec.model import CacheField, DType, Spec, TargetShape, VectorTransform
from replaygen.traffic import verify_flush_period

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
# compared as full states, at state_tolerance (the _carried ones: what a recurrence carries beside its state)
STATE_KERNELS = ("materialize", "baseline_state", "materialize_carried", "baseline_carried")
POISON_CURSOR = -777


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has NaN/inf."""
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def angle_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference of two sets of angles modulo 2 pi, over pi; inf when out has NaN/inf."""
    out = out.detach().to("cpu", torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    turn = torch.remainder(out - ref.detach().to("cpu", torch.float64) + math.pi, 2 * math.pi) - math.pi
    return float(turn.abs().max() / math.pi) if turn.numel() else 0.0


class InputFactory:
    """Random, never-zero weights, per-token inputs and states of realistic scale for one spec and shape.

    The numbers are drawn on the host, the same on every device for a seed; with `draw_on_device` they are drawn on
    `device` itself (other numbers, and no host time per step: for long runs such as drift's)."""

    def __init__(self, spec: Spec, shape: TargetShape, device: str | torch.device, act_dtype: torch.dtype, seed: int, *, draw_on_device: bool = False):
        self.spec = spec
        self.shape = shape
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.gen = torch.Generator(self.device if draw_on_device else "cpu").manual_seed(seed)
        self.inputs, self.weight_args = api_tensors(spec, shape)

    def _randn(self, *size: int) -> torch.Tensor:
        return torch.randn(size, generator=self.gen, dtype=torch.float64, device=self.gen.device)

    def _uniform(self, low: float, high: float, *size: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(size, generator=self.gen, dtype=torch.float64, device=self.gen.device)

    def weights(self) -> dict[str, torch.Tensor]:
        s = self.spec
        d, r = s.decay, s.readout
        scales = (s.key.weight, s.query.weight, *((s.ranks.value_scale, s.ranks.gate_scale, s.ranks.output_scale) if s.ranks else ()))
        out = {}
        for arg in self.weight_args:
            if arg.name == d.rate:
                values = torch.log(self._uniform(1.0, 8.0, *arg.sizes))  # A in [1, 8]
            elif arg.name == d.bias:
                values = self._uniform(-4.0, -1.0, *arg.sizes)  # softplus(bias) ~ 0.02 .. 0.3
            elif arg.name == r.skip:
                values = self._randn(*arg.sizes)
            elif arg.name in scales:
                values = self._uniform(0.5, 1.5, *arg.sizes)  # normalisation weights, rank scales
            elif arg.name in (s.key.bias, s.query.bias):
                values = 0.5 * self._randn(*arg.sizes)
            else:
                raise AssertionError(f"no generator for weight {arg.name}")
            out[arg.name] = values.to(self.device, torch.float32)
        return out

    def step(self, batch: int, *, use_gate: bool = True, use_direct: bool = False) -> dict[str, torch.Tensor | None]:
        """Inputs of one token for `batch` rows: [batch, ...]."""
        return self._inputs((batch,), use_gate, use_direct)

    def window(self, batch: int, tokens: int, *, use_gate: bool = True, use_direct: bool = False) -> dict[str, torch.Tensor | None]:
        """Inputs of a window of `tokens` tokens for `batch` rows: [batch, T, ...]."""
        return self._inputs((batch, tokens), use_gate, use_direct)

    def _inputs(self, lead: tuple[int, ...], use_gate: bool, use_direct: bool) -> dict[str, torch.Tensor | None]:
        s = self.spec
        act_names = {s.inputs.value, s.inputs.key, s.inputs.query}
        out: dict[str, torch.Tensor | None] = {}
        for arg in self.inputs:
            size = (*lead, *arg.sizes)
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
            elif s.rotary is not None and name == s.rotary.angle_input:
                values = 2 * self._randn(*size)  # turns of up to pi dt' per step
            else:
                values = self._randn(*size)
            if values is None:
                out[name] = None
            else:
                dtype = self.act_dtype if name in act_names or name == (s.readout.gate.input if s.readout.gate else None) else torch.float32
                out[name] = values.to(self.device, dtype)
        return out

    def states(self, n: int, layout_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`n` random states [n, *layout_shape] in `dtype` (a module's STATE_DTYPE: loaded exactly)."""
        return (0.5 * self._randn(n, *layout_shape)).to(self.device, dtype)

    def full_states(self, module: ModuleType, n: int) -> object:
        """`n` random full states for `module`: states [n, *STATE_SHAPE], or, where the spec carries more than its state,
        the module's SlotStates (angles in [0, 2 pi), previous values and keys of the scale of the step inputs)."""
        state = self.states(n, tuple(module.STATE_SHAPE), module.STATE_DTYPE)
        if not self.spec.carries:
            return state
        carried = [
            (self._uniform(0.0, 2 * math.pi, n, *sizes) if name == "angle" else self._randn(n, *sizes)).to(self.device, torch.float32)
            for name, sizes in module.CARRIED
        ]
        return module.SlotStates(state, *carried)


def load_reference(reference: Reference, slots: list[int], states: object) -> None:
    """Set the reference's `slots` from full states (a tensor, or a module's SlotStates)."""
    if isinstance(states, torch.Tensor):
        reference.load(slots, states.cpu())
        return
    carried = {name: getattr(states, name).cpu() for name in ("angle", "last_value", "last_key") if hasattr(states, name)}
    if "last_key" in carried:
        carried["last_key"] = carried["last_key"].reshape(len(slots), *reference.carried.last_key.shape[1:])
    reference.load(slots, states.state.cpu(), **carried)


def state_errors(reference: Reference, got: object, slots: list[int]) -> tuple[float, float | None]:
    """Errors of full states `got` (a tensor, or a module's SlotStates) against the reference's `slots`: the state's
    relative error, and the largest error of what it carries (angles by angle_error; None where it carries nothing)."""
    want = reference.carried.rows(torch.tensor(slots))
    if isinstance(got, torch.Tensor):
        return relative_error(got, reference.to_layout(want.state)), None
    errors = []
    if want.angle is not None:
        errors.append(angle_error(got.angle, want.angle))
    if want.last_value is not None:
        errors.append(relative_error(got.last_value, want.last_value))
        errors.append(relative_error(got.last_key.reshape(want.last_key.shape), want.last_key))
    return relative_error(got.state, reference.to_layout(want.state)), max(errors)


def baseline_rounding(module: ModuleType, num_slots: int, device: str | torch.device, seed: int = 0) -> dict[str, object]:
    """The keyword a module's baseline kernels take where its state rounds stochastically (`rounding`: the slots'
    streams from `seed`), else nothing."""
    allocate = getattr(module, "allocate_rounding", None)
    return {"rounding": allocate(num_slots, device, seed)} if allocate else {}


@dataclass
class KernelErrors:
    """Worst relative error seen per kernel, and where."""

    worst: dict[str, tuple[float, int]] = field(default_factory=dict)

    def record(self, kernel: str, error: float, step: int) -> None:
        if kernel not in self.worst or not error <= self.worst[kernel][0]:
            self.worst[kernel] = (error, step)


def state_tolerance(spec: Spec, shape: TargetShape, act_dtype: torch.dtype) -> float:
    """Tolerance of the full states (STATE_KERNELS). A state is built from the step inputs, which kernel and reference
    share already rounded, and from what the replay buffer caches. Where a cached field is derived from the inputs
    (the corrected value, a transformed key, a log decay or weight) and stored at a 16-bit dtype, or the state itself
    is 16-bit, the kernels fold rounded values the reference does not, so the states get that dtype's tolerance;
    otherwise the float32 one, so a state that drifts shows at 1e-4 and not only once the 16-bit outputs drift past
    their own tolerance."""
    dtypes = [shape.state_dtype]
    for cached in spec.cache_of(shape):
        raw = cached.field is CacheField.VALUE or (cached.field is CacheField.KEY and spec.key.transform is VectorTransform.NONE)
        if not raw:
            dtypes.append(cached.dtype)
    return max(_tolerance_of(dtype, act_dtype) for dtype in dtypes)


def output_tolerance(shape: TargetShape, act_dtype: torch.dtype) -> float:
    """Tolerance of the outputs: the activation dtype's, or a 16-bit state's where that is coarser (outputs are read
    from the rounded state)."""
    return max(TOLERANCE[act_dtype], _tolerance_of(shape.state_dtype, act_dtype))


def _tolerance_of(dtype: DType | None, act_dtype: torch.dtype) -> float:
    return TOLERANCE[act_dtype if dtype is None else getattr(torch, dtype.value)]  # DType values name torch dtypes


@dataclass(frozen=True)
class CheckReport:
    scenario: str
    steps: int
    tolerance: float  # outputs
    state_tolerance: float  # STATE_KERNELS
    worst: dict[str, tuple[float, int]]
    untouched: tuple[str, ...]  # memory that must not change but did (empty when fine)

    def tolerance_of(self, kernel: str) -> float:
        return self.state_tolerance if kernel in STATE_KERNELS else self.tolerance

    @property
    def ok(self) -> bool:
        return not self.untouched and all(err <= self.tolerance_of(kernel) for kernel, (err, _) in self.worst.items())

    def lines(self) -> list[str]:
        rows = [f"{self.scenario}: {self.steps} steps, tolerance {self.tolerance:.1e} (states {self.state_tolerance:.1e}): {'PASS' if self.ok else 'FAIL'}"]
        for kernel, (err, step) in sorted(self.worst.items()):
            flag = "ok" if err <= self.tolerance_of(kernel) else "FAIL"
            rows.append(f"  {kernel:<18} max rel err {err:.2e} (step {step}) {flag}")
        rows += [f"  touched memory it must not: {name}" for name in self.untouched]
        return rows


def _poison(tensor: torch.Tensor, slots: list[int]) -> None:
    for slot in slots:
        if tensor.dtype.is_floating_point:
            tensor[slot] = float("nan")
        else:
            tensor[slot] = POISON_CURSOR


def _named_tensors(name: str, states: object) -> tuple[tuple[str, torch.Tensor], ...]:
    """The tensors of full states (a tensor, or a module's SlotStates), named."""
    if isinstance(states, torch.Tensor):
        return ((name, states),)
    return tuple((f"{name} ({index})", tensor) for index, tensor in enumerate(states.tensors()))


def _still_poisoned(tensor: torch.Tensor, slots: list[int]) -> bool:
    part = tensor[slots]
    if tensor.dtype.is_floating_point:
        return bool(torch.isnan(part).all())
    return bool((part == POISON_CURSOR).all())


class Schedule:
    """Which slot each batch row uses and when: rows join at different steps (different flush phases),
    row 1 sits out some steps (a padding row), and the slots no row uses stay poisoned."""

    def __init__(self, batch: int, period: int, gen: torch.Generator):
        self.batch = batch
        self.num_slots = batch + 2
        perm = torch.randperm(self.num_slots, generator=gen).tolist()
        self.row_slot = perm[:batch]
        self.unused = perm[batch:]
        self.offsets = [0] + [1 + (3 * r) % period for r in range(1, batch)]

    def joining(self, step: int) -> list[int]:
        return [self.row_slot[r] for r in range(self.batch) if self.offsets[r] == step]

    def active(self, step: int) -> list[bool]:
        return [step >= self.offsets[r] and not (r == 1 and step % 7 == 3) for r in range(self.batch)]

    def slots(self, step: int) -> list[int]:
        return [self.row_slot[r] if a else -1 for r, a in enumerate(self.active(step))]


def _slot_memory(replay: object) -> tuple[tuple[str, torch.Tensor], ...]:
    """Every per-slot tensor of a replay state, named: state, rings, cursors and the per-step workspaces."""
    rings = tuple((f"buffer {index}", tensor) for index, tensor in enumerate(replay.buffers()))
    return (("checkpoint", replay.checkpoint), *rings, ("cursor", replay.cursor), ("scores", replay.scores), ("pending", replay.pending))


def _untouched(replay: object, extra: tuple[tuple[str, torch.Tensor], ...], unused: list[int]) -> list[str]:
    return [f"{name} of unused slots {unused}" for name, tensor in (*_slot_memory(replay), *extra) if not _still_poisoned(tensor, unused)]


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
    period = flush_at or shape.capacity
    plan = Schedule(batch, period, factory.gen)
    steps = cycles * period + max(plan.offsets)
    replay = module.allocate(plan.num_slots, device, act_dtype)
    baseline = module.allocate_baseline(plan.num_slots, device)
    rounding = baseline_rounding(module, plan.num_slots, device, seed)
    reference = Reference(spec, shape, plan.num_slots)
    all_slots = list(range(plan.num_slots))
    for _, tensor in (*_slot_memory(replay), *_named_tensors("baseline state", baseline)):
        _poison(tensor, all_slots)
    errors = KernelErrors()
    for step in range(steps):
        joining = plan.joining(step)
        if joining:
            init = factory.full_states(module, len(joining))
            module.load(replay, torch.tensor(joining, dtype=torch.int32, device=device), init)
            baseline[joining] = init
            load_reference(reference, joining, init)
        row_slots = plan.slots(step)
        slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        rows = [r for r, s in enumerate(row_slots) if s >= 0]
        padded = [r for r, s in enumerate(row_slots) if s < 0]
        inputs = factory.step(batch, use_gate=use_gate, use_direct=use_direct)
        sentinel = torch.full((batch, shape.heads, shape.value_dim), float("nan"), dtype=act_dtype, device=device)
        y_ref = reference.decode(row_slots, inputs, weights)
        y_rep = module.decode(replay, slots, **inputs, **weights, out=sentinel.clone(), route=route, flush_at=flush_at)
        y_base = module.baseline_decode(baseline, slots, **inputs, **weights, out=sentinel.clone(), **rounding)
        for name, y in (("replay_decode", y_rep), ("baseline_decode", y_base)):
            _compare(errors, name, y, y_ref, rows, padded, step)
        _compare_states(errors, module, replay, reference, slots, rows, [row_slots[r] for r in rows], step, materialize_weights(spec, shape, weights))
        if rows:
            active = [row_slots[r] for r in rows]
            _record_states(errors, "baseline", state_errors(reference, baseline[active], active), step)
    untouched = _untouched(replay, _named_tensors("baseline state", baseline), plan.unused)
    label = f"decode route={route or 'default'} flush_at={flush_at or 'default'} {str(act_dtype).replace('torch.', '')} batch={batch}"
    return CheckReport(label, steps, output_tolerance(shape, act_dtype), state_tolerance(spec, shape, act_dtype), dict(errors.worst), tuple(untouched))


def _compare(errors: KernelErrors, name: str, y: torch.Tensor, y_ref: torch.Tensor, rows: list[int], padded: list[int], step: int) -> None:
    """Outputs of active rows against the reference; padded rows must keep their NaN sentinel."""
    if rows:
        errors.record(name, relative_error(y[rows], y_ref[rows]), step)
    if padded and not torch.isnan(y[padded]).all():
        errors.record(name + " (padding row written)", float("inf"), step)


def materialize_weights(spec: Spec, shape: TargetShape, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a module's `materialize` takes: the value scale at rank > 1 (its fold scales each buffered value per
    rank), none otherwise."""
    return {spec.ranks.value_scale: weights[spec.ranks.value_scale]} if shape.rank > 1 else {}


def _compare_states(errors, module, replay, reference, slots, rows, row_slots, step, weights) -> None:
    """materialize of every row (NaN-prefilled) against the reference's states; `weights` as materialize_weights."""
    out = module.allocate_baseline(slots.shape[0], slots.device)
    for _, tensor in _named_tensors("out", out):
        tensor.fill_(float("nan"))
    mat = module.materialize(replay, slots, out=out, **weights)
    if rows:
        _record_states(errors, "materialize", state_errors(reference, mat[rows], row_slots), step)


def _record_states(errors: KernelErrors, name: str, found: tuple[float, float | None], step: int) -> None:
    """Record state_errors as `name` ("baseline" records as baseline_state) and `name`_carried."""
    state, carried = found
    errors.record("baseline_state" if name == "baseline" else name, state, step)
    if carried is not None:
        errors.record(f"{name}_carried", carried, step)


ACCEPT_PATTERNS = ("random", "all", "none")


def check_speculative(
    module: ModuleType,
    spec: Spec,
    shape: TargetShape,
    *,
    device: str | torch.device = "cpu",
    act_dtype: torch.dtype = torch.float32,
    batch: int = 3,
    steps: int = 12,
    tokens: int | None = None,
    accept: str = "random",
    mixed: bool = False,
    compare_baseline: bool = True,
    use_gate: bool = True,
    seed: int = 0,
) -> CheckReport:
    """Replay verify + commit (and the per-draft-snapshot baseline) against the reference.

    accept: "random" (0..T per row, 1..T when the baseline is compared), "all" (T), or "none"
    (0 for replay alone, 1 with the baseline: only the window's first token survives).
    mixed: every third step is a standard decode step on the same state; the snapshot baseline
    has no such step, so a mixed schedule checks the replay path alone.
    """
    if accept not in ACCEPT_PATTERNS:
        raise ValueError(f"accept must be one of {ACCEPT_PATTERNS}")
    compare_baseline = compare_baseline and not mixed
    tokens = tokens or shape.window
    factory = InputFactory(spec, shape, device, act_dtype, seed)
    weights = factory.weights()
    plan = Schedule(batch, max(2, shape.capacity // tokens), factory.gen)
    replay = module.allocate(plan.num_slots, device, act_dtype)
    snapshots, current = module.allocate_snapshots(plan.num_slots, device, tokens)
    rounding = baseline_rounding(module, plan.num_slots, device, seed)
    reference = Reference(spec, shape, plan.num_slots)
    all_slots = list(range(plan.num_slots))
    for _, tensor in (*_slot_memory(replay), *_named_tensors("baseline snapshots", snapshots)):
        _poison(tensor, all_slots)
    low = 1 if compare_baseline else 0
    errors = KernelErrors()
    total = steps + max(plan.offsets)
    for step in range(total):
        joining = plan.joining(step)
        if joining:
            init = factory.full_states(module, len(joining))
            index = torch.tensor(joining, dtype=torch.int32, device=device)
            module.load(replay, index, init)
            snapshots[joining, 0] = init
            current[joining] = 0
            load_reference(reference, joining, init)
        row_slots = plan.slots(step)
        slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        rows = [r for r, s in enumerate(row_slots) if s >= 0]
        padded = [r for r, s in enumerate(row_slots) if s < 0]
        if mixed and step % 3 == 1:
            inputs = factory.step(batch, use_gate=use_gate)
            sentinel = torch.full((batch, shape.heads, shape.value_dim), float("nan"), dtype=act_dtype, device=device)
            y_ref = reference.decode(row_slots, inputs, weights)
            _compare(errors, "replay_decode", module.decode(replay, slots, **inputs, **weights, out=sentinel), y_ref, rows, padded, step)
        else:
            inputs = factory.window(batch, tokens, use_gate=use_gate)
            sentinel = torch.full((batch, tokens, shape.heads, shape.value_dim), float("nan"), dtype=act_dtype, device=device)
            y_ref = reference.verify(row_slots, inputs, weights)
            _compare(errors, "replay_verify", module.verify(replay, slots, **inputs, **weights, out=sentinel.clone()), y_ref, rows, padded, step)
            if compare_baseline:
                y_base = module.baseline_verify(snapshots, current, slots, **inputs, **weights, out=sentinel.clone(), **rounding)
                _compare(errors, "baseline_verify", y_base, y_ref, rows, padded, step)
            if accept == "all":
                counts = [tokens] * batch
            elif accept == "none":
                counts = [low] * batch
            else:
                counts = torch.randint(low, tokens + 1, (batch,), generator=factory.gen).tolist()
            accepted = torch.tensor(counts, dtype=torch.int32, device=device)
            module.commit(replay, slots, accepted, tokens)
            if compare_baseline:
                module.baseline_commit(current, slots, accepted, tokens)
            reference.commit(row_slots, counts)
        _compare_states(errors, module, replay, reference, slots, rows, [row_slots[r] for r in rows], step, materialize_weights(spec, shape, weights))
        if compare_baseline and rows:
            active = [row_slots[r] for r in rows]
            committed = snapshots[active, current[active].long()]
            _record_states(errors, "baseline", state_errors(reference, committed, active), step)
    untouched = _untouched(replay, _named_tensors("baseline snapshots", snapshots), plan.unused)
    label = f"speculative T={tokens} accept={accept}{' mixed' if mixed else ''} {str(act_dtype).replace('torch.', '')} batch={batch}"
    return CheckReport(label, total, output_tolerance(shape, act_dtype), state_tolerance(spec, shape, act_dtype), dict(errors.worst), tuple(untouched))


def check_speculative_through_flushes(
    module: ModuleType, spec: Spec, shape: TargetShape, *, random_steps: int, tokens: int | None = None, **options: object
) -> tuple[CheckReport, CheckReport]:
    """`check_speculative` twice: `random_steps` windows of random acceptance, then every draft accepted until each
    sequence has flushed twice and wrapped its ring (twice the `verify_flush_period` cycle, plus one step: its first
    flush comes at the end of the first cycle). A few random windows may never fill a large buffer, so the second run
    is what checks the flush path."""
    tokens = tokens or shape.window
    flushing_steps = 2 * len(verify_flush_period(shape, tokens, tokens)) + 1
    return (
        check_speculative(module, spec, shape, steps=random_steps, tokens=tokens, **options),
        check_speculative(module, spec, shape, steps=flushing_steps, tokens=tokens, accept="all", **options),
    )


def check_conv(module: ModuleType, spec: Spec, shape: TargetShape, *, device: str | torch.device, act_dtype: torch.dtype, batch: int, steps: int, seed: int = 0) -> CheckReport:
    """The spec's conv (a module of a spec with `conv:`) against the float64 conv: rows join at different steps from
    loaded inputs, row 1 sits some steps out (padding), each step is a decode step or a window with random
    acceptance per row; outputs, and every slot's committed inputs (`materialize_conv`), compared; unused slots
    poisoned and checked untouched."""
    gen = torch.Generator().manual_seed(seed)
    schedule = Schedule(batch, shape.window + 1, gen)
    channels, width = module._CONV_CHANNELS, spec.conv.width

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device, act_dtype)

    weight = torch.randn(channels, width, generator=gen).to(device)
    bias = torch.randn(channels, generator=gen).to(device)
    state = module.allocate_conv(schedule.num_slots, device, act_dtype)
    _poison(state.ring, schedule.unused)
    _poison(state.cursor, schedule.unused)
    expected: dict[int, torch.Tensor] = {}
    errors = KernelErrors()
    for step in range(steps):
        joining = schedule.joining(step)
        if joining:
            history = rand(len(joining), channels, width - 1)
            module.load_conv(state, torch.tensor(joining, dtype=torch.int32, device=device), history)
            expected.update({slot: history[i].to("cpu", torch.float64) for i, slot in enumerate(joining)})
        slots = schedule.slots(step)
        rows = [r for r, slot in enumerate(slots) if slot >= 0]
        if not rows:
            continue
        slot_tensor = torch.tensor(slots, dtype=torch.int32, device=device)
        tokens = 1 + step % shape.window if step % 2 else 1
        inputs = rand(batch, tokens, channels)
        before = torch.stack([expected[slots[r]] for r in rows])
        want, _ = conv_reference(before, inputs[rows].cpu(), weight.cpu(), bias.cpu(), spec.conv)
        if step % 2:
            out = module.conv(state, slot_tensor, inputs, weight, bias)
            accepted = torch.randint(0, tokens + 1, (batch,), generator=gen, dtype=torch.int32)
            module.commit_conv(state, slot_tensor, accepted.to(device), num_tokens=tokens)
            errors.record("conv window", relative_error(out[rows], want), step)
        else:
            out = module.conv(state, slot_tensor, inputs[:, 0], weight, bias)
            accepted = torch.ones(batch, dtype=torch.int32)
            errors.record("conv", relative_error(out[rows], want[:, 0]), step)
        for i, r in enumerate(rows):
            kept = inputs[r, : int(accepted[r])].to("cpu", torch.float64).T
            expected[slots[r]] = torch.cat([before[i], kept], dim=-1)[:, -(width - 1) :]
        live = sorted(expected)
        committed = module.materialize_conv(state, torch.tensor(live, dtype=torch.int32, device=device))
        errors.record("materialize_conv", relative_error(committed, torch.stack([expected[slot] for slot in live])), step)
    untouched = [f"{name} of unused slots {schedule.unused}" for name, tensor in (("conv ring", state.ring), ("conv cursor", state.cursor)) if not _still_poisoned(tensor, schedule.unused)]
    return CheckReport("conv (decode steps and windows)", steps, TOLERANCE[act_dtype], TOLERANCE[act_dtype], errors.worst, tuple(untouched))


def check_module(module: ModuleType, spec: Spec, shape: TargetShape, *, device: str | torch.device, act_dtype: torch.dtype, batch: int, cycles: int) -> list[CheckReport]:
    """`replaygen check`'s scenarios for one module: decode on both routes over `cycles` flush cycles, speculative
    verify + commit with random and full acceptance, verify windows mixed with decode steps, and the conv where the
    spec has one."""
    reports = [
        check_decode(module, spec, shape, device=device, act_dtype=act_dtype, batch=batch, cycles=cycles, route=route)
        for route in ("output_only", "state_and_output")
    ]
    steps = cycles * max(2, shape.capacity // shape.window)
    reports += [check_speculative(module, spec, shape, device=device, act_dtype=act_dtype, batch=batch, steps=steps, accept=accept) for accept in ("random", "all")]
    reports.append(check_speculative(module, spec, shape, device=device, act_dtype=act_dtype, batch=batch, steps=steps, mixed=True))
    if spec.conv is not None:
        reports.append(check_conv(module, spec, shape, device=device, act_dtype=act_dtype, batch=batch, steps=4 * shape.window * cycles))
    return reports
