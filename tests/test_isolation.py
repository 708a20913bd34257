"""Isolation between batch rows and slots: a NaN or Inf in one row's inputs or in one slot's memory, or garbage in one
slot's cursor, may spoil that row and slot, never another row's outputs or another slot's state (bit for bit).

Each check runs the same calls twice from the same prepared memory, once clean and once with the fault in one row
and slot, and compares everything else between the two runs."""

import functools
import multiprocessing
import threading
import traceback
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, bucket_config, spec_traits
from replaygen.harness import InputFactory
from replaygen.runtime import import_path, load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import TargetShape
from replaygen.tune.apply import resolve_configs

from conftest import DEVICE, ROOT

# NaN and Inf make numpy warn under the Triton interpreter.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning")

SHAPE = TargetShape("isolation", heads=2, key_heads=1, value_dim=8, key_dim=16, capacity=5, window=2)
RING = SHAPE.capacity + SHAPE.window
NUM_SLOTS = 8
FAULTY_SLOT = 3
# (ring start, entry count) of each slot before the first call: rows flush on different steps (decode at h + 1 >= 5,
# verify at h >= 2), several rings wrap around their end, and the faulty slot's flushes come after a step or two.
CURSORS = ((0, 0), (5, 4), (3, 3), (6, 2), (2, 4), (1, 1), (4, 0), (0, 3))
# The slots of each batch size's rows (-1: padding): the faulty slot sits between two slots of the batch, slot 0
# (which padding rows point at, masked) is never in one.
ROWS = {3: (2, 3, 4), 4: (4, 3, -1, 2), 5: (6, 2, 3, -1, 4), 6: (4, -1, 3, 1, 2, 5)}
SENTINEL = -3.25  # what output rows hold before a call: padding rows must keep it
ACCEPTED = (2, 1, 0, 2, 1, 2)  # per row of a verify's commit

ONE_WARP = KernelConfig(block_v=8, num_warps=1)
# One dispatch bucket per batch size of ROWS (batch 3, 4, 5, 6), each kind's buckets running different kernel paths.
TABLES = {
    KernelKind.REPLAY_DECODE: (
        BucketConfig(3, ONE_WARP),
        BucketConfig(4, replace(ONE_WARP, fused_flush=False, precompute_scores=True, fold_chunk=2)),
        BucketConfig(5, replace(ONE_WARP, precompute_scores=True, align_flushes=True, flush_groups=2, prefetch_ring=False)),
        BucketConfig(None, KernelConfig(block_v=16, num_warps=4, fold_dot=True, fold_chunk=1)),
    ),
    KernelKind.REPLAY_VERIFY: (
        BucketConfig(3, ONE_WARP),
        BucketConfig(4, replace(ONE_WARP, num_warps=2, route=Route.STATE_AND_OUTPUT, flush_at=1)),
        BucketConfig(5, KernelConfig(block_v=16, num_warps=2, precompute_scores=True, readout_dot=True, fold_dot=True)),
        BucketConfig(None, replace(ONE_WARP, precompute_scores=True, window_block_v=8, window_warps=2)),
    ),
    KernelKind.COMMIT: (BucketConfig(4, ONE_WARP), BucketConfig(None, KernelConfig(block_v=16, num_warps=4))),
    KernelKind.MATERIALIZE: (BucketConfig(4, replace(ONE_WARP, fold_chunk=1)), BucketConfig(None, KernelConfig(block_v=16, num_warps=4))),
    KernelKind.LOAD: (BucketConfig(4, ONE_WARP), BucketConfig(None, KernelConfig(block_v=16, num_warps=4))),
    KernelKind.BASELINE_DECODE: (BucketConfig(4, ONE_WARP), BucketConfig(None, KernelConfig(block_v=16, num_warps=4, evict_state=True))),
    KernelKind.BASELINE_VERIFY: (BucketConfig(4, ONE_WARP), BucketConfig(None, KernelConfig(block_v=16, num_warps=4, evict_state=True))),
}
SPECS = ("mamba2", "gdn", "kda", "mamba3")


@functools.cache
def spec_of(name):
    return load_spec(ROOT / "specs" / f"{name}.yaml")


def tables_for(spec):
    """TABLES with what the spec's recurrence cannot run turned off: where its keys are not scored once per key head
    (a per-channel decay, an entry carried, keys per rank) no scores kernel, nor what reads it (aligned flushes,
    tensor-core readouts, the split verify's window half). Each bucket still runs its own kernel path."""
    if spec_traits(spec, SHAPE).scores:
        return TABLES
    unscored = dict(precompute_scores=False, overlap_scores=False, align_flushes=False, flush_groups=1, readout_dot=False, window_block_v=0, window_warps=1)
    return {kind: tuple(BucketConfig(b.max_batch, replace(b.config, **unscored)) for b in table) for kind, table in TABLES.items()}


@functools.cache
def module_of(name):
    return load_kernels(spec_of(name), SHAPE, tables_for(spec_of(name)))


@dataclass(frozen=True)
class Op:
    """One call (with its commit, for a verify): kind is decode, verify, baseline_decode, baseline_verify, load or
    materialize."""

    kind: str
    batch: int
    route: str | None = None
    flush_at: int | None = None
    tokens: int = SHAPE.window

    @property
    def label(self):
        knobs = "".join(f" {name}={value}" for name, value in (("route", self.route), ("flush_at", self.flush_at)) if value)
        tokens = f" tokens={self.tokens}" if self.kind == "verify" and self.tokens != SHAPE.window else ""
        return f"{self.kind} batch={self.batch}{knobs}{tokens}"

    @property
    def rows(self):
        return ROWS[self.batch]

    @property
    def faulty_row(self):
        return self.rows.index(FAULTY_SLOT)


@dataclass(frozen=True)
class Scenario:
    name: str
    ops: tuple[Op, ...]
    act: torch.dtype = torch.float32
    direct: bool = False  # GDN's direct gates (g, beta) instead of their pre-activations


def decode(batch, **knobs):
    return Op("decode", batch, **knobs)


def verify(batch, **knobs):
    return Op("verify", batch, **knobs)


def materialize(batch):
    return Op("materialize", batch)


SCENARIOS = (
    Scenario("decode-fused-flush", (decode(3), decode(3, route="state_and_output"), decode(3, flush_at=1), decode(3), materialize(3))),
    Scenario("decode-flush-launch", (decode(4), decode(4), decode(4), materialize(4))),
    Scenario("decode-aligned-scores", (decode(5), decode(5), decode(5), materialize(5)), act=torch.bfloat16, direct=True),
    Scenario("decode-multi-warp", (decode(6), decode(6, flush_at=1), decode(6, route="state_and_output"), materialize(6))),
    Scenario("verify-commit", (verify(3), decode(3), verify(3, tokens=1), verify(3), materialize(3))),
    Scenario("verify-state-route", (verify(4), verify(4), materialize(4))),
    Scenario("verify-readout-dot", (verify(5), verify(5), materialize(5)), act=torch.bfloat16, direct=True),
    Scenario("verify-split", (verify(6), verify(6), materialize(6))),
    Scenario("baseline", (Op("baseline_decode", 3), Op("baseline_verify", 3), Op("baseline_decode", 6), Op("baseline_verify", 6))),
    Scenario("load", (Op("load", 4), decode(4), Op("load", 6), decode(6), materialize(6))),
)
# What a run poisons in the faulty row and slot: every step input of the row (and of the padding rows; for a load,
# the state it loads), or all of the slot's memory (checkpoint, rings, scores workspace, baseline state and
# snapshots); with NaN, or with +Inf and -Inf in turn.
TARGETS = ("inputs-nan", "inputs-inf", "memory-nan", "memory-inf")


def poison_values(target):
    """The values a target writes, one per tensor in turn."""
    return (float("nan"),) if target.endswith("nan") else (float("inf"), float("-inf"))


def ring_buffers(state):
    """The ring-buffer tensors of a replay state by attribute name."""
    return {name: t for name, t in vars(state).items() if isinstance(t, torch.Tensor) and any(t is b for b in state.buffers())}


def named_states(module, states, label):
    """The tensors of full states by name: `label` for a plain state tensor; for a spec that carries entries beside its
    state (SlotStates), `label` for the state and `label` plus each carried entry's name for the others."""
    if isinstance(states, torch.Tensor):
        return {label: states}
    names = ("", *(f" {name}" for name, _ in module.CARRIED))
    return {f"{label}{name}": t for name, t in zip(names, states.tensors(), strict=True)}


def random_states(module, lead, gen):
    """Full states of [*lead] slots (SlotStates where the spec carries entries), standard normal."""
    state = torch.randn((*lead, *module.STATE_SHAPE), generator=gen).to(DEVICE)
    if not hasattr(module, "SlotStates"):
        return state
    return module.SlotStates(state, *(torch.randn((*lead, *sizes), generator=gen).to(DEVICE) for _, sizes in module.CARRIED))


class Run:
    """One pass of calls from freshly prepared memory: the outputs of every call and the memory after it.

    `target` poisons the faulty row and slot (TARGETS); `cursor`, a (start, count) pair, is written into every copy
    of the faulty slot's cursor before every kernel call."""

    def __init__(self, spec_name, act=torch.float32, direct=False, target=None, cursor=None, seed=0):
        self.module = module_of(spec_name)
        self.factory = InputFactory(spec_of(spec_name), SHAPE, DEVICE, act, seed)
        self.weights = self.factory.weights()
        self.direct = direct
        self.target = target
        self.cursor = cursor
        self.outputs = []  # (label, output rows, faulty row)
        self.memory = []  # (label, {name: tensor [slots, ...]}, shared {name: tensor})
        gen = torch.Generator().manual_seed(seed + 1)
        self.replay = self.module.allocate(NUM_SLOTS, DEVICE, act)
        self.replay.checkpoint.copy_(0.5 * torch.randn(self.replay.checkpoint.shape, generator=gen))
        for name, ring in ring_buffers(self.replay).items():
            values = torch.randn(ring.shape, generator=gen)
            ring.copy_(-0.05 - 0.2 * values.abs() if "decay" in name else 0.1 + 0.5 * values.abs() if "weight" in name else 0.5 * values)
        self.replay.scores.copy_(torch.randn(self.replay.scores.shape, generator=gen))
        self.replay.cursor.copy_(torch.tensor(CURSORS, dtype=torch.int32)[:, None, None, :].expand(self.replay.cursor.shape))
        self.baseline = self.module.allocate_baseline(NUM_SLOTS, DEVICE)
        self.snapshots, self.current = self.module.allocate_snapshots(NUM_SLOTS, DEVICE)
        for t in (*named_states(self.module, self.baseline, "").values(), *named_states(self.module, self.snapshots, "").values()):
            t.copy_(0.5 * torch.randn(t.shape, generator=gen))
        self.current.copy_(torch.arange(NUM_SLOTS, dtype=torch.int32) % SHAPE.window)
        if target and target.startswith("memory"):
            values = poison_values(target)
            baseline = (*named_states(self.module, self.baseline, "").values(), *named_states(self.module, self.snapshots, "").values())
            for i, t in enumerate((self.replay.checkpoint, *ring_buffers(self.replay).values(), self.replay.scores, *baseline)):
                t[FAULTY_SLOT] = values[i % len(values)]

    def slot_tensors(self):
        return {
            "checkpoint": self.replay.checkpoint, **ring_buffers(self.replay), "cursor": self.replay.cursor, "scores": self.replay.scores,
            "pending": self.replay.pending, **named_states(self.module, self.baseline, "baseline state"),
            **named_states(self.module, self.snapshots, "snapshots"), "current": self.current,
        }

    def run(self, ops):
        for op in ops:
            self.call(op)
        return self

    def call(self, op):
        slots = torch.tensor(op.rows, dtype=torch.int32, device=DEVICE)
        if op.kind == "load":
            states = random_states(self.module, (op.batch,), self.factory.gen)
            self.poison_rows(op, named_states(self.module, states, "").values())
            self.before_kernel()
            self.module.load(self.replay, slots, states)
        elif op.kind == "materialize":
            out = random_states(self.module, (op.batch,), self.factory.gen)
            for t in named_states(self.module, out, "").values():
                t.fill_(SENTINEL)
            self.before_kernel()
            self.module.materialize(self.replay, slots, out=out)
            self.outputs += [(name, t, op.faulty_row) for name, t in named_states(self.module, out, op.label).items()]
        else:
            windowed = op.kind in ("verify", "baseline_verify")
            inputs = self.factory.window(op.batch, op.tokens, use_direct=self.direct) if windowed else self.factory.step(op.batch, use_direct=self.direct)
            self.poison_rows(op, inputs.values())
            lead = (op.batch, op.tokens) if windowed else (op.batch,)
            out = torch.full((*lead, SHAPE.heads, SHAPE.value_dim), SENTINEL, dtype=self.replay.activation_dtype, device=DEVICE)
            accepted = torch.tensor([ACCEPTED[r] % (op.tokens + 1) for r in range(op.batch)], dtype=torch.int32, device=DEVICE)
            self.before_kernel()
            if op.kind == "decode":
                self.module.decode(self.replay, slots, **inputs, **self.weights, out=out, route=op.route, flush_at=op.flush_at)
            elif op.kind == "baseline_decode":
                self.module.baseline_decode(self.baseline, slots, **inputs, **self.weights, out=out)
            elif op.kind == "verify":
                self.module.verify(self.replay, slots, **inputs, **self.weights, out=out)
                self.before_kernel()
                self.module.commit(self.replay, slots, accepted, op.tokens)
            else:
                self.module.baseline_verify(self.snapshots, self.current, slots, **inputs, **self.weights, out=out)
                self.module.baseline_commit(self.current, slots, accepted.clamp_min(1), op.tokens)
            self.outputs.append((op.label, out, op.faulty_row))
        self.memory.append((op.label, {name: t.clone() for name, t in self.slot_tensors().items()}, {"clock": self.replay.clock.clone()}))

    def poison_rows(self, op, tensors):
        """Inputs targets: the faulty row's and the padding rows' rows of `tensors` (None where an input is left out)."""
        if not (self.target and self.target.startswith("inputs")):
            return
        rows = [op.faulty_row] + [r for r, slot in enumerate(op.rows) if slot < 0]
        values = poison_values(self.target)
        for i, t in enumerate(t for t in tensors if t is not None):
            t[rows] = values[i % len(values)]

    def before_kernel(self):
        if self.cursor is not None:
            self.replay.cursor[FAULTY_SLOT, ..., 0] = self.cursor[0]
            self.replay.cursor[FAULTY_SLOT, ..., 1] = self.cursor[1]


def same_bits(a, b):
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def differences(clean, faulty):
    """Where `faulty` differs from `clean` outside the faulty row and slot (empty when nowhere)."""
    found = []
    for (label, a, row), (_, b, _) in zip(clean.outputs, faulty.outputs, strict=True):
        rows = [r for r in range(a.shape[0]) if r != row and not same_bits(a[r], b[r])]
        if rows:
            found.append(f"after {label}: output rows {rows} (faulty row {row})")
    others = [s for s in range(NUM_SLOTS) if s != FAULTY_SLOT]
    for (label, a, shared_a), (_, b, shared_b) in zip(clean.memory, faulty.memory, strict=True):
        for name in a:
            slots = [s for s in others if not same_bits(a[name][s], b[name][s])]
            if slots:
                found.append(f"after {label}: {name} of slots {slots}")
        found += [f"after {label}: {name}" for name in shared_a if not same_bits(shared_a[name], shared_b[name])]
    return found


def faulty_row_differs(clean, faulty):
    """Whether the poison reached the faulty row's outputs or its slot's memory at all."""
    outputs = any(not same_bits(a[row], b[row]) for (_, a, row), (_, b, _) in zip(clean.outputs, faulty.outputs))
    memory = any(not same_bits(a[name][FAULTY_SLOT], b[name][FAULTY_SLOT]) for (_, a, _), (_, b, _) in zip(clean.memory, faulty.memory) for name in a)
    return outputs or memory


@functools.cache
def clean_run(spec_name, scenario):
    return Run(spec_name, scenario.act, scenario.direct).run(scenario.ops)


def test_differences_name_every_change_outside_the_faulty_row_and_slot():
    """The comparison is not vacuous: one bit of another row's output, of another slot's ring or of the step clock is
    named; changes to the faulty row and slot are not."""
    clean = clean_run("mamba2", SCENARIOS[0])
    outputs = [(label, out.clone(), row) for label, out, row in clean.outputs]
    memory = [(label, {name: t.clone() for name, t in slots.items()}, {name: t.clone() for name, t in shared.items()}) for label, slots, shared in clean.memory]
    outputs[1][1][0, 0, 0] = torch.nextafter(outputs[1][1][0, 0, 0], torch.full_like(outputs[1][1][0, 0, 0], float("inf")))
    outputs[1][1][outputs[1][2]] = float("nan")
    memory[2][1]["buf_key"][FAULTY_SLOT + 1, 0, 0, 0] *= -1
    memory[2][1]["checkpoint"][FAULTY_SLOT] = float("nan")
    memory[3][2]["clock"] += 1
    found = differences(clean, SimpleNamespace(outputs=outputs, memory=memory))
    assert found == [
        f"after {outputs[1][0]}: output rows [0] (faulty row 1)", f"after {memory[2][0]}: buf_key of slots [4]", f"after {memory[3][0]}: clock",
    ]


def test_batch_sizes_land_in_the_buckets_they_are_meant_for():
    """The generated module dispatches every batch size of ROWS as TABLES say; each of them runs a replay decode and a
    replay verify bucket of its own, and the other kinds' two buckets both run."""
    module = module_of("mamba2")
    for kind, table in TABLES.items():
        for batch in ROWS:
            assert module._pick(getattr(module, f"_{kind.value.upper()}_CONFIGS"), batch) == bucket_config(table, batch).as_dict(kind), (kind, batch)
        assert len({id(bucket_config(table, batch)) for batch in ROWS}) == len(table), kind
    for batch, rows in ROWS.items():
        assert len(rows) == batch and rows.count(FAULTY_SLOT) == 1 and 0 not in rows
        faulty = rows.index(FAULTY_SLOT)
        assert FAULTY_SLOT - 1 in rows and FAULTY_SLOT + 1 in rows and 0 < faulty < batch - 1


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("spec_name", SPECS)
def test_poison_in_one_row_leaves_every_other_row_and_slot_bit_identical(spec_name, scenario, target):
    """Every kernel kind (replay decode through each flush path, verify + commit in one launch, on the state route,
    with tensor-core readouts and split, materialize, load, the baselines) at batch sizes of different buckets: with
    the faulty row's inputs or its slot's memory poisoned, every other row's outputs (padding rows keep their
    sentinel) and every other slot's memory after every call equal the clean run's, bit for bit."""
    clean = clean_run(spec_name, scenario)
    faulty = Run(spec_name, scenario.act, scenario.direct, target=target).run(scenario.ops)
    assert faulty_row_differs(clean, faulty), "the poison never reached the faulty row: the check would pass vacuously"
    found = differences(clean, faulty)
    assert not found, "\n".join(found)


def bounded(seconds, fn):
    """fn()'s result, or a test failure if it runs past `seconds` or dies. On the CPU fn runs in a forked child
    (killed at the limit: a kernel loop under the interpreter cannot be interrupted); on a GPU in a thread."""
    if DEVICE != "cpu":
        result = []
        worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            pytest.fail(f"still running after {seconds} s")
        assert result, "the call raised (see the thread's traceback above)"
        return result[0]
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child():
        try:
            sender.send(("done", fn()))
        except BaseException:
            sender.send(("raised", traceback.format_exc()))

    process = context.Process(target=child, daemon=True)
    process.start()
    sender.close()
    try:
        if not receiver.poll(seconds):
            process.kill()
            pytest.fail(f"still running after {seconds} s (killed)")
        try:
            status, value = receiver.recv()
        except EOFError:
            process.join()
            pytest.fail(f"the child process died (exit code {process.exitcode})")
    finally:
        process.join()
    if status == "raised":
        pytest.fail(value, pytrace=False)
    return value


CURSOR_TIME_LIMIT_S = 60
# (ring start, entry count) written into the faulty slot's cursor: a count no loop may run to, a negative count
# (whose append position falls before the ring), a start far past the ring's end (start + count wraps around int32
# to a negative position), a negative start.
CORRUPT_CURSORS = {"count-2^30": (1, 2**30), "count-negative": (1, -3), "start-past-ring": (2**31 - 1, 1), "start-negative": (-4, 1)}
# The calls of each kind, every one with the corrupt cursor: decode through its flush paths (fused, state route,
# flush every step with leftovers, the separate flush launch, multi-warp), verify + commit in each verify bucket,
# materialize in both of its buckets.
CURSOR_CALLS = {
    "decode": (decode(3), decode(3, route="state_and_output"), decode(3, flush_at=1), decode(4), decode(6, flush_at=1)),
    "verify-commit": (verify(3), verify(4), verify(5), verify(6)),
    "materialize": (Op("materialize", 3), Op("materialize", 6)),
}


@functools.cache
def clean_cursor_run(spec_name, kind):
    return Run(spec_name).run(CURSOR_CALLS[kind])


@pytest.mark.parametrize("corruption", CORRUPT_CURSORS)
@pytest.mark.parametrize("kind", CURSOR_CALLS)
@pytest.mark.parametrize("spec_name", SPECS)
def test_corrupt_cursor_finishes_promptly_and_stays_in_its_slot(spec_name, kind, corruption):
    """A slot whose cursor holds garbage (written into every copy before each kernel call) makes decode, verify,
    commit and materialize finish within CURSOR_TIME_LIMIT_S, and changes no other row's outputs and no other slot's
    memory (bit for bit against the same calls with the slot's cursor intact)."""
    clean = clean_cursor_run(spec_name, kind)
    found = bounded(CURSOR_TIME_LIMIT_S, lambda: differences(clean, Run(spec_name, cursor=CORRUPT_CURSORS[corruption]).run(CURSOR_CALLS[kind])))
    assert not found, "\n".join(found)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("source", ["shipped", "rendered"])
@pytest.mark.parametrize("spec_name,shape_name", [("mamba2", "nemotron-h"), ("gdn", "qwen3.5")])
def test_poison_in_one_row_stays_there_on_the_gpu(spec_name, shape_name, source, graphed):
    """The H200's decode buckets on the GPU (the shipped module in generated/h200, or the current templates rendered
    with the H200's records, the defaults where those no longer apply), each at its largest batch (the open one at
    one past the last edge, at most 257), eager or replayed from one CUDA graph per batch size with new inputs every
    step: NaN inputs in one row and NaN in its slot's checkpoint and rings leave every other row's outputs (padding
    rows keep their sentinel) and every other slot's memory (and the shared step clock) bit-identical to a clean
    twin's, through flushes on different steps."""
    spec = spec_of(spec_name)
    shape = spec.shape(shape_name)
    if source == "shipped":
        module = import_path(ROOT / "generated" / "h200" / f"{spec_name}_{shape_name.replace('.', '_').replace('-', '_')}.py")
    else:
        module = load_kernels(spec, shape, resolve_configs(spec, shape, "h200", ROOT / "tune", allow_default=True, accept_env_mismatch=True).configs)
    ring = shape.capacity + shape.window
    edges = [edge for edge, _ in module._REPLAY_DECODE_CONFIGS[:-1]]
    for batch in [edge for edge in edges if edge <= 256] + [min(edges[-1] + 1, 257) if edges else 4]:
        faulty_row = batch // 2
        num_slots = batch + 2
        rows = [slot + 1 for slot in range(batch)]
        if batch >= 4:
            rows[-1] = -1
        slots = torch.tensor(rows, dtype=torch.int32, device="cuda")
        factory = InputFactory(spec, shape, "cuda", torch.bfloat16, seed=batch)
        weights = factory.weights()
        gen = torch.Generator().manual_seed(batch)
        twins = [module.allocate(num_slots, "cuda", torch.bfloat16) for _ in range(2)]
        checkpoint = 0.5 * torch.randn(twins[0].checkpoint.shape, generator=gen)
        rings = {name: torch.randn(t.shape, generator=gen) for name, t in ring_buffers(twins[0]).items()}
        counts = torch.arange(num_slots, dtype=torch.int32) % shape.capacity
        counts[rows[faulty_row]] = shape.capacity - 2
        cursor = torch.stack([(torch.arange(num_slots, dtype=torch.int32) * 3) % ring, counts], -1)
        for state in twins:
            state.checkpoint.copy_(checkpoint)
            for name, t in ring_buffers(state).items():
                t.copy_(-0.05 - 0.2 * rings[name].abs() if "decay" in name else 0.1 + 0.5 * rings[name].abs() if "weight" in name else 0.5 * rings[name])
            state.cursor.copy_(cursor[:, None, None, :].expand(state.cursor.shape))
        faulty_slot = rows[faulty_row]
        twins[1].checkpoint[faulty_slot] = float("nan")
        for t in ring_buffers(twins[1]).values():
            t[faulty_slot] = float("nan")
        static = [factory.step(batch) for _ in twins]
        outs = [torch.full((batch, shape.heads, shape.value_dim), SENTINEL, dtype=torch.bfloat16, device="cuda") for _ in twins]
        module.decode(module.allocate(num_slots, "cuda", torch.bfloat16), slots, **static[0], **weights)  # compiles
        graphs = []
        if graphed:
            for state, inputs, out in zip(twins, static, outs):
                graphs.append(torch.cuda.CUDAGraph())
                with torch.cuda.graph(graphs[-1]):
                    module.decode(state, slots, **inputs, **weights, out=out)
        for step in range(4):
            inputs = factory.step(batch)
            for twin, (state, buffers, out) in enumerate(zip(twins, static, outs)):
                for name, value in inputs.items():
                    if value is not None:
                        buffers[name].copy_(value)
                        if twin:
                            buffers[name][faulty_row] = float("nan")
                if graphed:
                    graphs[twin].replay()
                else:
                    module.decode(state, slots, **buffers, **weights, out=out)
            others = [r for r in range(batch) if r != faulty_row]
            assert same_bits(outs[0][others], outs[1][others]), f"batch {batch}, step {step}: outputs of other rows"
            assert not torch.isfinite(outs[1][faulty_row]).all(), f"batch {batch}, step {step}: the poison never reached the faulty row"
            for name, clean in {"checkpoint": twins[0].checkpoint, **ring_buffers(twins[0]), "cursor": twins[0].cursor, "scores": twins[0].scores}.items():
                faulty = getattr(twins[1], name)
                other_slots = [s for s in range(num_slots) if s != faulty_slot]
                assert same_bits(clean[other_slots], faulty[other_slots]), f"batch {batch}, step {step}: {name} of other slots"
            assert same_bits(twins[0].clock, twins[1].clock)
        full = [module.materialize(state, slots) for state in twins]
        others = [r for r in range(batch) if r != faulty_row]
        assert same_bits(full[0][others], full[1][others]), f"batch {batch}: materialized states of other rows"
