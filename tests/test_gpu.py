"""On the GPU: one captured CUDA graph per batch size serves every step, whatever the acceptance pattern."""

import pytest
import torch

from replaygen.harness import InputFactory
from replaygen.runtime import load_kernels

pytestmark = pytest.mark.gpu


def _same_state(module, a, b, slots):
    assert torch.equal(a.cursor, b.cursor)
    assert torch.equal(module.materialize(a, slots), module.materialize(b, slots))


def test_verify_commit_graph_matches_eager(mamba2):
    shape = mamba2.shape("nemotron-h-mtp")
    module = load_kernels(mamba2, shape)
    batch, tokens = 6, shape.window
    factory = InputFactory(mamba2, shape, "cuda", torch.bfloat16, seed=0)
    weights = factory.weights()
    slots = torch.tensor([3, 0, -1, 5, 1, 2], dtype=torch.int32, device="cuda")
    eager, graphed = (module.allocate(8, "cuda", torch.bfloat16) for _ in range(2))
    init = factory.states(batch, tuple(module.STATE_SHAPE))
    for state in (eager, graphed):
        module.load(state, slots, init)
    static = factory.window(batch, tokens, use_gate=False)
    accepted = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    out = torch.empty((batch, tokens, shape.heads, shape.value_dim), dtype=torch.bfloat16, device="cuda")

    def step():
        module.verify(graphed, slots, **static, **weights, out=out)
        module.commit(graphed, slots, accepted)

    step()  # warm-up (compiles); replayed eagerly below too
    module.verify(eager, slots, **static, **weights)
    module.commit(eager, slots, accepted)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(12):
        window = factory.window(batch, tokens, use_gate=False)
        counts = torch.randint(0, tokens + 1, (batch,), generator=factory.gen).to("cuda", torch.int32)
        for name, value in window.items():
            if value is not None:
                static[name].copy_(value)
        accepted.copy_(counts)
        graph.replay()
        expected = module.verify(eager, slots, **window, **weights)
        module.commit(eager, slots, counts)
        live = slots >= 0
        assert torch.equal(out[live], expected[live])
        _same_state(module, eager, graphed, slots)


def test_decode_graph_matches_eager_across_flushes(mamba2):
    shape = mamba2.shape("nemotron-h-l8")
    module = load_kernels(mamba2, shape)
    batch = 4
    factory = InputFactory(mamba2, shape, "cuda", torch.bfloat16, seed=1)
    weights = factory.weights()
    slots = torch.tensor([1, 3, 0, 2], dtype=torch.int32, device="cuda")
    eager, graphed = (module.allocate(4, "cuda", torch.bfloat16) for _ in range(2))
    init = factory.states(batch, tuple(module.STATE_SHAPE))
    for state in (eager, graphed):
        module.load(state, slots, init)
        state.cursor[..., 1] = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None, None]  # staggered phases
    static = factory.step(batch, use_gate=False)
    out = torch.empty((batch, shape.heads, shape.value_dim), dtype=torch.bfloat16, device="cuda")
    warm = module.allocate(4, "cuda", torch.bfloat16)
    module.decode(warm, slots, **static, **weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.decode(graphed, slots, **static, **weights, out=out)
    for _ in range(3 * shape.capacity):
        inputs = factory.step(batch, use_gate=False)
        for name, value in inputs.items():
            if value is not None:
                static[name].copy_(value)
        graph.replay()
        expected = module.decode(eager, slots, **inputs, **weights)
        assert torch.equal(out, expected)
        _same_state(module, eager, graphed, slots)
