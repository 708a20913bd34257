"""On the GPU: one captured CUDA graph per batch size serves every step, whatever the acceptance pattern."""

import pytest
import torch

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, bucket_config
from replaygen.harness import TOLERANCE, InputFactory, check_decode, check_speculative, relative_error, state_tolerance
from replaygen.reference import Reference
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.tune.apply import resolve_configs

from conftest import ROOT

pytestmark = pytest.mark.gpu


def _same_state(module, a, b, slots):
    assert torch.equal(a.cursor, b.cursor)
    assert torch.equal(module.materialize(a, slots), module.materialize(b, slots))


# Verify launches as the H100 records pick them: precomputed scores (a second launch in the graph), both routes.
SCORED = KernelConfig(block_v=32, num_warps=1, precompute_scores=True)
SCORED_STATE = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, route=Route.STATE_AND_OUTPUT)
# The replay kernel as a programmatic dependent of the scores kernel, the state streamed evict-first.
OVERLAPPED = KernelConfig(block_v=16, num_warps=1, precompute_scores=True, overlap_scores=True, evict_state=True)
# The split verify: its window half a programmatic dependent of its checkpoint half, the readouts in a scratch buffer.
SPLIT = KernelConfig(block_v=16, num_warps=1, precompute_scores=True, overlap_scores=True, evict_state=True, window_block_v=64, window_warps=2)


@pytest.mark.parametrize("config", [None, SCORED, SCORED_STATE, OVERLAPPED, SPLIT], ids=["default", "scores", "scores-state-route", "overlapped", "split"])
def test_verify_commit_graph_matches_eager(mamba2, config):
    shape = mamba2.shape("nemotron-h-mtp")
    module = load_kernels(mamba2, shape, None if config is None else {KernelKind.REPLAY_VERIFY: (BucketConfig(None, config),)})
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


@pytest.mark.parametrize("spec_name,shape_name", [("mamba2", "nemotron-h-mtp"), ("gdn", "qwen3.5-mtp")])
@pytest.mark.parametrize("config", [
    SCORED, SCORED_STATE, KernelConfig(block_v=32, num_warps=2, precompute_scores=True, readout_dot=True, fold_dot=True), OVERLAPPED, SPLIT,
], ids=["scores", "scores-state-route", "readout-dot", "overlapped", "split"])
def test_verify_options_match_the_reference(spec_name, shape_name, config):
    """The verify options against the float64 reference on the GPU at the spec's MTP shape (tensor-core paths run
    in tf32x3 here, exactly in the interpreter)."""
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, config),)})
    for accept in ("random", "all"):
        report = check_speculative(module, spec, shape, device="cuda", act_dtype=torch.bfloat16, accept=accept, steps=16, seed=3)
        assert report.ok, "\n".join(report.lines())


@pytest.mark.parametrize("spec_name,shape_name", [("mamba2", "nemotron-h-mtp"), ("gdn", "qwen3.5-mtp")])
@pytest.mark.parametrize("aligned", [False, True], ids=["own-count", "aligned"])
def test_overlapped_decode_and_verify_match_the_reference(spec_name, shape_name, aligned):
    """Decode and verify launched as programmatic dependents of their scores kernels, mixed on one state: the
    overlap changes when the kernels run, never what they compute. Aligned: the decode reads the step clock its
    scores kernel advanced (a read before that kernel's end would split one row's programs between flushing and
    appending); then decode alone over several clock periods with rows joining at different steps."""
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    decode = KernelConfig(block_v=32, num_warps=1, precompute_scores=True, overlap_scores=True, evict_state=True, align_flushes=aligned)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, OVERLAPPED),), KernelKind.REPLAY_DECODE: (BucketConfig(None, decode),)})
    report = check_speculative(module, spec, shape, device="cuda", act_dtype=torch.bfloat16, mixed=True, steps=16, seed=4)
    assert report.ok, "\n".join(report.lines())
    if aligned:
        report = check_decode(module, spec, shape, device="cuda", act_dtype=torch.bfloat16, batch=24, cycles=3, use_gate=False, seed=5)
        assert report.ok, "\n".join(report.lines())


def test_check_runs_every_tuned_config(capsys):
    """`replaygen check --gpu h100` checks each config the build bakes (one module per bucket position)."""
    from replaygen.cli import main

    assert main(["check", str(ROOT / "specs" / "mamba2.yaml"), "--shape", "nemotron-h-tp8", "--gpu", "h100", "--tune-dir", str(ROOT / "tune"), "--cycles", "2"]) == 0
    out = capsys.readouterr().out
    assert "configs of h100 bucket 1:" in out and "configs of h100 bucket 2:" in out and "all checks passed" in out


@pytest.mark.parametrize("spec_name,shape_name", [("mamba2", "nemotron-h"), ("gdn", "qwen3.5")])
def test_rows_move_from_a_buffering_bucket_to_a_flush_every_step_bucket(spec_name, shape_name):
    """The shipped H200 configs: 32 rows buffer entries (that bucket flushes at L), then a batch of 2 and later a batch
    of 1 (batch 1 flushes every step, and GDN's batch 2 too, with eight warps per program) bring some of them, so the
    flush-every-step kernel meets leftover entries (Mamba-2 folds them in memory before its step, GDN after it, out
    of line, and redoes the step); outputs and every slot's state against the float64 reference."""
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    configs = resolve_configs(spec, shape, "h200", ROOT / "tune", accept_env_mismatch=True).configs
    decode_table = configs[KernelKind.REPLAY_DECODE]
    assert bucket_config(decode_table, 32).flush_at != 1 and bucket_config(decode_table, 1).flush_at == 1
    module = load_kernels(spec, shape, configs)
    factory = InputFactory(spec, shape, "cuda", torch.bfloat16, seed=7)
    weights = factory.weights()
    everyone = list(range(32))
    state = module.allocate(len(everyone), "cuda", torch.bfloat16)
    reference = Reference(spec, shape, len(everyone))
    init = factory.states(len(everyone), tuple(module.STATE_SHAPE))
    module.load(state, torch.tensor(everyone, dtype=torch.int32, device="cuda"), init)
    reference.load(everyone, init.cpu())
    tolerance = TOLERANCE[torch.bfloat16]
    for step, rows in enumerate([everyone] * 5 + [[7, 30]] * 3 + [everyone] * 3 + [[12]] * 2 + [everyone]):
        inputs = factory.step(len(rows))
        y = module.decode(state, torch.tensor(rows, dtype=torch.int32, device="cuda"), **inputs, **weights)
        assert relative_error(y, reference.decode(rows, inputs, weights)) < tolerance, f"step {step}, batch {len(rows)}"
        if bucket_config(decode_table, len(rows)).flush_at == 1:
            assert state.cursor[rows, ..., 1].eq(0).all(), "a flush-every-step row kept buffered entries"
    full = module.materialize(state, torch.tensor(everyone, dtype=torch.int32, device="cuda"))
    assert relative_error(full, reference.to_layout(reference.states[everyone])) < state_tolerance(spec, shape, torch.bfloat16)


@pytest.mark.parametrize("spec_name,shape_name", [("mamba2", "nemotron-h-mtp2"), ("gdn", "qwen3.5-mtp2")])
def test_eight_warp_flush_every_step_decode_meets_leftovers(spec_name, shape_name):
    """Flush-every-step decode programs of eight warps, every third step, after verify windows that left entries
    buffered (Mamba-2 folds them in memory before its step, GDN after it, out of line): fp32 activations, so a fold
    one warp skipped shows, against the float64 reference over several runs. Before the leftover fold took the cursor
    the step had read (and the step moved it after a barrier), one warp could read the cursor after another had
    emptied it and fold nothing: 1e-3 to 3e-2 off in most such runs on the H100."""
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    decode = KernelConfig(block_v=16, num_warps=8, flush_at=1, fold_chunk=1, evict_state=True, early_launch=True)
    verify = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, overlap_scores=True, evict_state=True, early_launch=True)
    module = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, decode),), KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)})
    for seed in range(4):
        report = check_speculative(module, spec, shape, device="cuda", act_dtype=torch.float32, batch=3, steps=30, mixed=True, seed=seed)
        assert report.ok, "\n".join(report.lines())
