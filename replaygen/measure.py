"""GPU timing as the project measures: cold state, whole flush cycles, CUDA graphs, medians and spread.

In a model, dozens of layers run between two visits to one layer's state, so a
decode step never finds its state in L2. `DecodeWorkload` therefore keeps
enough independent layer states that together they exceed L2 several times and
captures, in one CUDA graph, whole flush cycles over all of them. Inputs are
random (never zeros); the replay cursors start at staggered phases, as they do
under continuous batching.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from replaygen.harness import InputFactory, baseline_rounding
from replaygen.spec.model import Spec, TargetShape
from replaygen.traffic import state_bytes, verify_flush_period

MAX_LAYERS = 64


@dataclass(frozen=True)
class Timing:
    """Time of one decode step (per layer), from repeated graph replays."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int

    def as_dict(self) -> dict[str, float]:
        return {"median_ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms, "samples": self.samples}


def l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, rounds: int = 3) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the best of
    `rounds` medians of 30 copies of `nbytes`, each round on fresh buffers (single rounds at the start of a process
    ranged over 2% on the H100 (docs/design.md, "Measuring")."""
    best = 0.0
    for _ in range(rounds):
        src = torch.randn(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        timing = time_callable(lambda: dst.copy_(src), repeats=30)
        best = max(best, 2 * nbytes / (timing.median_ms * 1e-3))
        del src, dst
    return best


def event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds one call of `fn` takes on the current stream, between two CUDA events (synchronized)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_callable(fn: Callable[[], object], repeats: int = 50, warmup: int = 5, per_call: int = 1) -> Timing:
    """Median and spread of `fn` timed with CUDA events, divided by `per_call` (steps inside one call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = [event_ms(fn) / per_call for _ in range(repeats)]
    samples.sort()
    q = statistics.quantiles(samples, n=10) if len(samples) >= 10 else [samples[0]] * 9
    return Timing(statistics.median(samples), q[1], q[7], len(samples))


_primed = False


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Capture `fn` (already warmed up) into a CUDA graph.

    The first graph a process captures and replays runs short kernels faster than every later one, itself included
    once a second graph exists (H100: 7.2 against 8.0 us per step at batch 2, 1-3% at batch 32; the SM clock stayed
    at 1980 MHz; docs/design.md, "Measuring"). A serving engine captures a graph per batch size, so the first call in a
    process captures and replays a throwaway graph of `fn` first: every timed graph is a later one, whichever
    kernel a tune or a bench happens to time first."""
    global _primed
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    if not _primed:
        throwaway = torch.cuda.CUDAGraph()
        with torch.cuda.graph(throwaway):
            fn()
        throwaway.replay()
        torch.cuda.synchronize()
        del throwaway
        _primed = True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def cold_layers(spec: Spec, shape: TargetShape, batch: int, device: torch.device) -> int:
    """Enough independent layer states that together they exceed 4x the GPU's L2 (at least 2)."""
    per_layer = batch * state_bytes(spec, shape)
    return max(2, min(MAX_LAYERS, math.ceil(4 * l2_bytes(device) / per_layer)))


def random_replay_states(module: ModuleType, layers: int, batch: int, act_dtype: torch.dtype, device: torch.device) -> list:
    """`layers` replay states of `batch` slots with random checkpoints and ring contents (never zeros)."""
    states = [module.allocate(batch, device, act_dtype) for _ in range(layers)]
    for state in states:
        state.checkpoint.normal_(0, 0.5)
        for buf in state.buffers():
            buf.normal_(0, 0.5)
        state.buf_log_decay.uniform_(-1.0, -0.01)
    return states


def randomize_states(states: object) -> None:
    """Fill full states (a tensor, or a module's SlotStates: the state and what it carries) with random values."""
    for tensor in (states,) if isinstance(states, torch.Tensor) else states.tensors():
        tensor.normal_(0, 0.5)


def set_entry_counts(states: list, counts: torch.Tensor) -> None:
    """Every slot b of each replay state: the ring starting at position 0 with counts[b] ([batch] int32) entries."""
    for state in states:
        state.cursor[..., 0] = 0
        state.cursor[..., 1] = counts.view(-1, *([1] * (state.cursor.dim() - 2)))


class DecodeWorkload:
    """Layer states and inputs for timing one module's decode kernels at one batch size."""

    def __init__(
        self,
        module: ModuleType,
        spec: Spec,
        shape: TargetShape,
        batch: int,
        act_dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        layers: int | None = None,
    ):
        """`layers` defaults to enough layer states to exceed 4x the GPU's L2 (at least 2)."""
        self.module = module
        self.batch = batch
        self.shape = shape
        self.layers = layers or cold_layers(spec, shape, batch, device)
        factory = InputFactory(spec, shape, device, act_dtype, seed)
        self.weights = factory.weights()
        self.inputs = [factory.step(batch, use_gate=False) for _ in range(self.layers)]
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        self.replay = random_replay_states(module, self.layers, batch, act_dtype, device)
        self.baseline = [module.allocate_baseline(batch, device) for _ in range(self.layers)]
        self.rounding = [baseline_rounding(module, batch, device, layer) for layer in range(self.layers)]
        for state in self.baseline:
            randomize_states(state)

    def stagger(self, flush_at: int, together: bool = False) -> None:
        """Start slot i with i % flush_at buffered entries, so sequences flush on different steps; `together`: every
        slot empty, so all of them flush on the same step of the cycle."""
        rows = torch.arange(self.batch, dtype=torch.int32, device=self.slots.device)
        set_entry_counts(self.replay, rows * 0 if together else rows % flush_at)

    def time_replay(self, route: str, flush_at: int, repeats: int = 30, together: bool = False) -> Timing:
        """Per-step time of replay decode over whole flush cycles of `flush_at` steps, as many cycles as cover the
        buffer capacity L: the baseline's graph holds L steps, and a graph of fewer steps would carry more of
        the graph launch per step (flush_at=1 measured up to 12% slow at batch 1-8 so; docs/design.md, "Measuring").
        Rows start staggered (`stagger`), or with `together` all flush on the same step."""
        self.stagger(flush_at, together)
        steps = flush_at * -(-self.shape.capacity // flush_at)

        def cycle() -> None:
            for _ in range(steps):
                self._replay_step(route, flush_at)

        graph = capture(cycle)
        return time_callable(graph.replay, repeats=repeats, per_call=steps * self.layers)

    def time_replay_steps(self, route: str, flush_at: int, cycles: int = 20) -> tuple[float, ...]:
        """Median ms per layer step at each step of the flush cycle, rows staggered as in `time_replay` (configs
        with align_flushes gather them on the step clock): a graph of one step over every layer, replayed `cycles`
        whole cycles after two, each replay timed with CUDA events. Each replay carries its graph launch, so the
        profile's shape (slowest step against the mean) is what to read, not its absolute times."""
        self.stagger(flush_at)
        graph = capture(lambda: self._replay_step(route, flush_at))
        for _ in range(2 * flush_at):
            graph.replay()
        samples: list[list[float]] = [[] for _ in range(flush_at)]
        for i in range(cycles * flush_at):
            samples[i % flush_at].append(event_ms(graph.replay) / self.layers)
        return tuple(statistics.median(s) for s in samples)

    def _replay_step(self, route: str, flush_at: int) -> None:
        """One replay decode step over every layer."""
        for state, inputs in zip(self.replay, self.inputs):
            self.module.decode(state, self.slots, **inputs, **self.weights, route=route, flush_at=flush_at)

    def time_baseline(self, steps: int, repeats: int = 30) -> Timing:
        def cycle() -> None:
            for _ in range(steps):
                for state, inputs, rounding in zip(self.baseline, self.inputs, self.rounding):
                    self.module.baseline_decode(state, self.slots, **inputs, **self.weights, **rounding)

        graph = capture(cycle)
        return time_callable(graph.replay, repeats=repeats, per_call=steps * self.layers)


ACCEPT = ("all", "staggered", "random")


class VerifyWorkload:
    """Layer states and window inputs for timing replay verify + commit against the snapshot baseline.

    "all": every window token is accepted (the most flushes), every sequence starting with an empty buffer, so all
    flush on the same step of the cycle (as a batch that started together does); "staggered": every token accepted,
    sequence i starting at the (i mod n)-th of the n steps of the flush cycle, so each step flushes 1/n of them (as
    sequences that started at different times do; up to 10% slower on the H100 (docs/design.md, "Measuring"); "random": each
    step of the captured cycle accepts a different random 1..T per sequence, so sequences diverge.
    """

    def __init__(
        self,
        module: ModuleType,
        spec: Spec,
        shape: TargetShape,
        batch: int,
        tokens: int,
        act_dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        layers: int | None = None,
        with_baseline: bool = True,
    ):
        self.module = module
        self.batch = batch
        self.tokens = tokens
        self.cycle = verify_flush_period(shape, tokens, tokens)  # entries at each step's start, every token accepted
        self.layers = layers or cold_layers(spec, shape, batch, device)
        factory = InputFactory(spec, shape, device, act_dtype, seed)
        self.weights = factory.weights()
        self.inputs = [factory.window(batch, tokens, use_gate=False) for _ in range(self.layers)]
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        self.replay = random_replay_states(module, self.layers, batch, act_dtype, device)
        self.snapshots = []
        self.rounding = [baseline_rounding(module, batch, device, layer) for layer in range(self.layers)]
        if with_baseline:
            for _ in range(self.layers):
                snapshots, current = module.allocate_snapshots(batch, device, tokens)
                randomize_states(snapshots)
                self.snapshots.append((snapshots, current))
        self.gen = factory.gen

    def accepted(self, accept: str, steps: int, low: int = 1) -> list[torch.Tensor]:
        """Accepted counts [batch] int32 for `steps` consecutive windows under `accept` (one of ACCEPT)."""
        if accept not in ACCEPT:
            raise ValueError(f"accept must be one of {ACCEPT}, got {accept!r}")
        device = self.slots.device
        if accept in ("all", "staggered"):
            return [torch.full((self.batch,), self.tokens, dtype=torch.int32, device=device)] * steps
        return [torch.randint(low, self.tokens + 1, (self.batch,), generator=self.gen).to(device, torch.int32) for _ in range(steps)]

    def start_buffers(self, accept: str) -> None:
        """Every sequence's buffer as a timing under `accept` starts it: empty, or for "staggered" sequence i holding
        the entries of the (i mod n)-th step of the n-step flush cycle."""
        counts = torch.zeros(self.batch, dtype=torch.int32, device=self.slots.device)
        if accept == "staggered":
            cycle = torch.tensor(self.cycle, dtype=torch.int32, device=self.slots.device)
            counts = cycle[torch.arange(self.batch, device=self.slots.device) % len(self.cycle)]
        set_entry_counts(self.replay, counts)

    def time_replay(self, accept: str, steps: int, repeats: int = 20) -> Timing:
        """Per-step time of replay verify + commit over `steps` consecutive windows."""
        accepted = self.accepted(accept, steps)
        self.start_buffers(accept)

        def cycle() -> None:
            for count in accepted:
                for state, inputs in zip(self.replay, self.inputs):
                    self.module.verify(state, self.slots, **inputs, **self.weights)
                    self.module.commit(state, self.slots, count, self.tokens)

        graph = capture(cycle)
        return time_callable(graph.replay, repeats=repeats, per_call=steps * self.layers)

    def time_baseline(self, accept: str, steps: int, repeats: int = 20) -> Timing:
        """Per-step time of the per-draft-snapshot verify + rollback."""
        accepted = self.accepted(accept, steps)

        def cycle() -> None:
            for count in accepted:
                for (snapshots, current), inputs, rounding in zip(self.snapshots, self.inputs, self.rounding):
                    self.module.baseline_verify(snapshots, current, self.slots, **inputs, **self.weights, **rounding)
                    self.module.baseline_commit(current, self.slots, count, self.tokens)

        graph = capture(cycle)
        return time_callable(graph.replay, repeats=repeats, per_call=steps * self.layers)
