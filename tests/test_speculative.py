"""Speculative decoding: replay verify + commit and the per-draft-snapshot baseline against the reference."""

from dataclasses import replace

import pytest
import torch

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, Route, module_defaults
from replaygen.harness import InputFactory, check_decode, check_speculative, relative_error
from replaygen.codegen import render_module
from replaygen.plan import plan_module
from replaygen.reference import Reference
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.keys import render_candidate
from replaygen.tune.apply import changed_definitions

from conftest import DEVICE, ODD, ROOT, SMALL

SPEC_SHAPE = replace(SMALL, capacity=8, window=4)


@pytest.fixture(scope="module")
def kernels(mamba2):
    return load_kernels(mamba2, SPEC_SHAPE)


def assert_passes(report, kernels=("replay_verify", "materialize")):
    assert report.ok, "\n".join(report.lines())
    assert set(kernels) <= set(report.worst), report.worst


def knob_changes(spec, shape, kind, config, **knob):
    """Which definitions of the code a trial of `config` times change with `knob` set: a knob is a value in the
    kind's dispatch table, read as a constexpr, never other kernel text."""
    return changed_definitions(render_candidate(spec, shape, kind, config).key, render_candidate(spec, shape, kind, replace(config, **knob)).key)


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_random_acceptance_against_reference_and_baseline(mamba2, kernels, tokens):
    report = check_speculative(kernels, mamba2, SPEC_SHAPE, device=DEVICE, tokens=tokens, steps=10, seed=tokens)
    assert_passes(report, ("replay_verify", "baseline_verify", "baseline_state", "materialize"))


def test_all_accepted_flushes_every_window(mamba2, kernels):
    assert_passes(check_speculative(kernels, mamba2, SPEC_SHAPE, device=DEVICE, accept="all", steps=10, seed=5))


def test_all_rejected(mamba2, kernels):
    assert_passes(check_speculative(kernels, mamba2, SPEC_SHAPE, device=DEVICE, accept="none", compare_baseline=False, steps=8, seed=6))


def test_only_first_token_kept_with_baseline(mamba2, kernels):
    assert_passes(check_speculative(kernels, mamba2, SPEC_SHAPE, device=DEVICE, accept="none", steps=8, seed=7))


def test_mixed_decode_and_verify(mamba2, kernels):
    report = check_speculative(kernels, mamba2, SPEC_SHAPE, device=DEVICE, mixed=True, steps=12, seed=8)
    assert_passes(report, ("replay_verify", "replay_decode", "materialize"))


def test_evict_state_changes_no_result(mamba2):
    """evict_state only sets the L2 policy of the state's loads and stores: every tuned kernel with it on, the replay
    decode through the separate flush launch, mixed with verify windows and against the snapshot baseline."""
    evict = {
        KernelKind.REPLAY_VERIFY: KernelConfig(block_v=8, num_warps=1, precompute_scores=True, evict_state=True),
        KernelKind.REPLAY_DECODE: KernelConfig(block_v=8, num_warps=1, fused_flush=False, evict_state=True),
        KernelKind.BASELINE_VERIFY: KernelConfig(block_v=8, num_warps=1, evict_state=True),
        KernelKind.BASELINE_DECODE: KernelConfig(block_v=8, num_warps=1, evict_state=True),
    }
    module = load_kernels(mamba2, SPEC_SHAPE, {kind: (BucketConfig(None, config),) for kind, config in evict.items()})
    mixed = check_speculative(module, mamba2, SPEC_SHAPE, device=DEVICE, mixed=True, steps=10, seed=12)
    assert_passes(mixed, ("replay_verify", "replay_decode", "materialize"))
    against_baseline = check_speculative(module, mamba2, SPEC_SHAPE, device=DEVICE, steps=8, seed=13)
    assert_passes(against_baseline, ("replay_verify", "baseline_verify", "baseline_state"))
    assert_passes(check_decode(module, mamba2, SPEC_SHAPE, device=DEVICE, cycles=3), ("replay_decode", "baseline_decode"))


def test_ring_wraps_around(mamba2):
    """Capacity not a multiple of the window and many steps: entries wrap the ring and windows straddle its end."""
    shape = replace(SMALL, capacity=7, window=3)
    module = load_kernels(mamba2, shape)
    assert_passes(check_speculative(module, mamba2, shape, device=DEVICE, tokens=2, steps=14, seed=9, compare_baseline=False))


@pytest.mark.parametrize("tokens,readout_dot,route", [
    (1, False, "output_only"), (3, False, "output_only"), (4, False, "output_only"),
    (1, True, "output_only"), (3, True, "output_only"), (4, True, "output_only"),
    (3, False, "state_and_output"), (4, True, "state_and_output"),
])
def test_precomputed_scores(mamba2, tokens, readout_dot, route):
    """Ring and window scores from `_scores_kernel` (one program per key head) in verify and decode, mixed steps,
    over windows shorter than the spec's (token rows of the scores workspace left unused) and a wrapping ring;
    with readout_dot the verify reads the state and ring by tensor-core products (and folds by one); on the state-and-output route
    it folds the buffer on every step and reads the formed state."""
    shape = replace(SMALL, capacity=9, window=4)
    verify = KernelConfig(block_v=16 if readout_dot else 8, num_warps=1, precompute_scores=True, readout_dot=readout_dot, fold_dot=readout_dot, route=Route(route),
                          overlap_scores=tokens == 3)
    decode = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, overlap_scores=tokens == 3)
    module = load_kernels(mamba2, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),), KernelKind.REPLAY_DECODE: (BucketConfig(None, decode),)})
    report = check_speculative(module, mamba2, shape, device=DEVICE, tokens=tokens, mixed=True, steps=12, seed=20 + tokens)
    assert_passes(report, ("replay_verify", "replay_decode", "materialize"))


@pytest.mark.parametrize("tokens,window_block_v,overlap", [(4, 16, False), (3, 8, True)])
def test_split_verify(mamba2, tokens, window_block_v, overlap):
    """The split verify (window_block_v): the checkpoint half, 8 value rows per program, folds on flushes and writes
    the checkpoint readouts; the window half reads them over window_block_v rows (16: the whole head and masked rows)
    and does the rest. Mixed with decode steps, through flushes, a wrapping ring and padded rows."""
    shape = replace(SMALL, capacity=9, window=4)
    verify = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, overlap_scores=overlap, window_block_v=window_block_v, window_warps=2)
    module = load_kernels(mamba2, shape, {KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)})
    report = check_speculative(module, mamba2, shape, device=DEVICE, tokens=tokens, mixed=True, steps=12, seed=30 + tokens)
    assert_passes(report, ("replay_verify", "replay_decode", "materialize"))


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_early_launch_changes_no_result(spec_file):
    """early_launch (the step's kernels as programmatic dependents of the kernel before them, each waiting for it
    first; sm90+ only, so the interpreter runs them in stream order): decode on both kinds of step, verify + commit
    in one launch and split, with and without overlapped scores, against the reference; the knob changes only the
    kind's dispatch table."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=9, window=4)
    decode = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, overlap_scores=True, early_launch=True)
    verify = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, early_launch=True)
    split = replace(verify, overlap_scores=True, window_block_v=8)
    tables = {KernelKind.REPLAY_DECODE: (BucketConfig(2, replace(decode, flush_at=1)), BucketConfig(None, decode)),
              KernelKind.REPLAY_VERIFY: (BucketConfig(2, replace(verify, precompute_scores=False)), BucketConfig(None, split))}
    module = load_kernels(spec, shape, tables)
    assert not module._dependent_launch(torch.device(DEVICE))
    for batch in (2, 3):
        report = check_speculative(module, spec, shape, device=DEVICE, tokens=4, mixed=True, steps=10, seed=40 + batch, batch=batch)
        assert_passes(report, ("replay_verify", "replay_decode", "materialize"))
    assert knob_changes(spec, shape, KernelKind.REPLAY_DECODE, replace(decode, early_launch=False), early_launch=True) == "_REPLAY_DECODE_CONFIGS changed"
    assert knob_changes(spec, shape, KernelKind.REPLAY_VERIFY, replace(split, early_launch=False), early_launch=True) == "_REPLAY_VERIFY_CONFIGS changed"


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_fold_key_prefetch_changes_no_result(spec_file):
    """prefetch_fold_keys (inline PTX; the module passes it off on CPU tensors, so the interpreter runs the kernels
    without it): decode and verify + commit against the reference through flushes; the knob changes only the kind's
    dispatch table, and one kind's knob none of the other kind's code."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=9, window=4)
    decode = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, prefetch_fold_keys=True)
    verify = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, prefetch_fold_keys=True)
    tables = {KernelKind.REPLAY_DECODE: (BucketConfig(None, decode),), KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),)}
    module = load_kernels(spec, shape, tables)
    assert not module._on_gpu(torch.device(DEVICE))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=4, mixed=True, steps=10, seed=50), ("replay_verify", "replay_decode", "materialize"))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=4, accept="all", steps=7, seed=51), ("replay_verify",))

    for kind, config in ((KernelKind.REPLAY_DECODE, decode), (KernelKind.REPLAY_VERIFY, verify)):
        assert knob_changes(spec, shape, kind, replace(config, prefetch_fold_keys=False), prefetch_fold_keys=True) == f"_{kind.value.upper()}_CONFIGS changed"


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_verify_flush_at_folds_every_step(spec_file):
    """A replay verify config's flush_at = 1: every step that finds committed entries folds them into the checkpoint
    and stores it (the flush rule alone waits for h + 2T > L). One launch on the state-and-output route at batch <= 2,
    the split verify over precomputed scores above; mixed with decode steps, random and all accepted, against the
    reference and the snapshot baseline."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=9, window=4)
    small = KernelConfig(block_v=8, num_warps=1, route=Route.STATE_AND_OUTPUT, flush_at=1)
    split = KernelConfig(block_v=8, num_warps=1, precompute_scores=True, overlap_scores=True, window_block_v=16, window_warps=2, flush_at=1)
    tables = {KernelKind.REPLAY_VERIFY: (BucketConfig(2, small), BucketConfig(None, split))}
    module = load_kernels(spec, shape, tables)
    for batch in (2, 3):
        mixed = check_speculative(module, spec, shape, device=DEVICE, tokens=4, mixed=True, steps=10, seed=70 + batch, batch=batch)
        assert_passes(mixed, ("replay_verify", "replay_decode", "materialize"))
        against_baseline = check_speculative(module, spec, shape, device=DEVICE, tokens=3, accept="all", steps=6, seed=72 + batch, batch=batch)
        assert_passes(against_baseline, ("replay_verify", "baseline_verify", "baseline_state"))

    factory = InputFactory(spec, shape, DEVICE, torch.float32, seed=75)
    weights = factory.weights()
    slots = torch.tensor([0, 2, -1], dtype=torch.int32, device=DEVICE)
    state = module.allocate(3, DEVICE, torch.float32)
    module.load(state, slots[:2], factory.states(2, tuple(module.STATE_SHAPE)))
    for accepted in ([2, 1, 2], [1, 2, 0], [0, 2, 1]):  # windows of 2: the rule alone would wait for h > 5
        module.verify(state, slots, **factory.window(3, 2), **weights)
        module.commit(state, slots, torch.tensor(accepted, dtype=torch.int32, device=DEVICE), num_tokens=2)
        counts = state.cursor[..., 1][slots[:2].long()]
        assert (counts == torch.tensor(accepted[:2], device=DEVICE).view(2, 1, 1)).all()  # the previous window's entries were folded

    assert knob_changes(spec, shape, KernelKind.REPLAY_VERIFY, replace(split, flush_at=0), flush_at=1) == "_REPLAY_VERIFY_CONFIGS changed"


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_early_commit_changes_no_result(spec_file):
    """early_commit (the commit after a verify of that bucket launched as a programmatic dependent of the kernel before
    it, waiting for it first; sm90+ only, so the interpreter runs it in stream order): verify + commit mixed with decode
    steps against the reference, with the bucket that sets it and the one that does not; the knob changes only the
    verify's dispatch table, which the commit reads."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=9, window=4)
    early = KernelConfig(block_v=8, num_warps=1, route=Route.STATE_AND_OUTPUT, flush_at=1, early_commit=True)
    tables = {KernelKind.REPLAY_VERIFY: (BucketConfig(2, early), BucketConfig(None, replace(early, early_commit=False)))}
    module = load_kernels(spec, shape, tables)
    assert not module._dependent_launch(torch.device(DEVICE))
    for batch in (2, 3):
        report = check_speculative(module, spec, shape, device=DEVICE, tokens=4, mixed=True, steps=10, seed=80 + batch, batch=batch)
        assert_passes(report, ("replay_verify", "replay_decode", "materialize"))

    assert knob_changes(spec, shape, KernelKind.REPLAY_VERIFY, replace(early, early_commit=False), early_commit=True) == "_REPLAY_VERIFY_CONFIGS changed"


def test_bf16_activations(mamba2, kernels):
    assert_passes(check_speculative(kernels, mamba2, SPEC_SHAPE, device=DEVICE, act_dtype=torch.bfloat16, use_gate=False, steps=6, seed=10))


def test_verify_does_not_commit(kernels):
    """Until commit, the window is not part of the state: materialize sees only committed entries."""
    state = kernels.allocate(2, DEVICE, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    init = torch.randn((2, *kernels.STATE_SHAPE), device=DEVICE)
    kernels.load(state, slots, init)
    gen = torch.Generator().manual_seed(0)
    h, g, p, n = SPEC_SHAPE.heads, SPEC_SHAPE.key_heads, SPEC_SHAPE.value_dim, SPEC_SHAPE.key_dim
    window = {
        "x": torch.randn(2, 4, h, p, generator=gen).to(DEVICE),
        "B": torch.randn(2, 4, g, n, generator=gen).to(DEVICE),
        "C": torch.randn(2, 4, g, n, generator=gen).to(DEVICE),
        "dt": torch.randn(2, 4, h, generator=gen).to(DEVICE),
    }
    weights = {"A_log": torch.zeros(h, device=DEVICE), "dt_bias": torch.zeros(h, device=DEVICE), "D": torch.ones(h, device=DEVICE)}
    kernels.verify(state, slots, **window, **weights)
    assert torch.equal(kernels.materialize(state, slots), init)
    kernels.commit(state, slots, torch.tensor([0, 2], dtype=torch.int32, device=DEVICE))
    after = kernels.materialize(state, slots)
    assert torch.equal(after[0], init[0]) and not torch.equal(after[1], init[1])
    assert state.cursor[1, ..., 1].unique().tolist() == [2]


@pytest.mark.parametrize("block_v", [8, 16])
def test_commit_moves_every_cursor_copy(mamba2, block_v):
    """commit adds each row's clamped accepted count to every cursor copy of its slot (every head, every value
    block; 6 heads and 2 copies per head exercise the masks), leaves the ring starts alone, and never touches
    the cursors of padded rows or of slots outside the batch."""
    shape = replace(ODD, capacity=8, window=3)
    module = load_kernels(mamba2, shape, {KernelKind.COMMIT: (BucketConfig(None, KernelConfig(block_v=block_v, num_warps=1)),)})
    assert module.CURSOR_BLOCKS == 2
    state = module.allocate(4, DEVICE, torch.float32)
    state.cursor[..., 0] = torch.arange(4, dtype=torch.int32, device=DEVICE).view(4, 1, 1) + 5
    state.cursor[..., 1] = torch.arange(4, dtype=torch.int32, device=DEVICE).view(4, 1, 1)
    before = state.cursor.clone()
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEVICE)
    module.commit(state, slots, torch.tensor([2, 3, 7], dtype=torch.int32, device=DEVICE))
    assert torch.equal(state.cursor[..., 0], before[..., 0])
    assert state.cursor[2, ..., 1].unique().tolist() == [2 + 2]
    assert state.cursor[0, ..., 1].unique().tolist() == [0 + 3]  # 7 clamped to T = 3
    assert torch.equal(state.cursor[[1, 3]], before[[1, 3]])


class TestApiErrors:
    def test_window_too_long(self, kernels):
        state = kernels.allocate(1, DEVICE, torch.float32)
        h, g, p, n = SPEC_SHAPE.heads, SPEC_SHAPE.key_heads, SPEC_SHAPE.value_dim, SPEC_SHAPE.key_dim
        x = torch.randn(1, 5, h, p, device=DEVICE)
        with pytest.raises(ValueError, match="a window holds 1..4 tokens"):
            kernels.verify(state, torch.zeros(1, dtype=torch.int32, device=DEVICE), x=x, B=torch.randn(1, 5, g, n, device=DEVICE),
                           C=torch.randn(1, 5, g, n, device=DEVICE), dt=torch.randn(1, 5, h, device=DEVICE), A_log=torch.zeros(h, device=DEVICE),
                           dt_bias=torch.zeros(h, device=DEVICE), D=torch.zeros(h, device=DEVICE))

    def test_accepted_dtype(self, kernels):
        state = kernels.allocate(1, DEVICE, torch.float32)
        with pytest.raises(TypeError, match="accepted must be an int32 tensor"):
            kernels.commit(state, torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int64, device=DEVICE))

    def test_accepted_range_validated_on_request(self, kernels):
        state = kernels.allocate(1, DEVICE, torch.float32)
        with pytest.raises(ValueError, match="accepted counts must be in 0..4"):
            kernels.commit(state, torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.full((1,), 5, dtype=torch.int32, device=DEVICE), validate=True)

    def test_strided_accepted_is_refused(self, kernels):
        state = kernels.allocate(2, DEVICE, torch.float32)
        counts = torch.tensor([[1, 4], [3, 4]], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match=r"accepted must be contiguous \(stride 1, got 2\)"):
            kernels.commit(state, torch.arange(2, dtype=torch.int32, device=DEVICE), counts[:, 0])

    def test_baseline_commit_checks_current(self, kernels):
        """`current` (the committed snapshot per slot) is checked as baseline_verify checks it: int32, one per slot,
        packed."""
        slots, accepted = torch.arange(2, dtype=torch.int32, device=DEVICE), torch.ones(2, dtype=torch.int32, device=DEVICE)
        with pytest.raises(TypeError, match=r"current must be an int32 tensor \[slots\], got tensor \(4,\) torch.float32"):
            kernels.baseline_commit(torch.zeros(4, device=DEVICE), slots, accepted)
        with pytest.raises(ValueError, match="current must be contiguous"):
            kernels.baseline_commit(torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)[:, 0], slots, accepted)
        snapshots, current = kernels.allocate_snapshots(3, DEVICE)
        h, g, p, n = SPEC_SHAPE.heads, SPEC_SHAPE.key_heads, SPEC_SHAPE.value_dim, SPEC_SHAPE.key_dim
        window = dict(x=torch.randn(2, 4, h, p, device=DEVICE), B=torch.randn(2, 4, g, n, device=DEVICE), C=torch.randn(2, 4, g, n, device=DEVICE),
                      dt=torch.randn(2, 4, h, device=DEVICE), A_log=torch.zeros(h, device=DEVICE), dt_bias=torch.zeros(h, device=DEVICE), D=torch.zeros(h, device=DEVICE))
        with pytest.raises(ValueError, match="current has 2 slots, the snapshots 3"):
            kernels.baseline_verify(snapshots, current[:2], slots, **window)

    def test_baseline_accepted_at_least_one(self, kernels):
        _, current = kernels.allocate_snapshots(1, DEVICE)
        with pytest.raises(ValueError, match="accepted counts must be in 1..4"):
            kernels.baseline_commit(current, torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE), validate=True)


def test_flushing_verify_whose_window_wraps_onto_folded_entries(mamba2):
    """h + T > L at a flushing verify: the window's keys and decays must not overwrite entries being folded."""
    shape = replace(SMALL, capacity=8, window=2)
    module = load_kernels(mamba2, shape)
    factory = InputFactory(mamba2, shape, DEVICE, torch.float32, seed=12)
    weights = factory.weights()
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    state = module.allocate(2, DEVICE, torch.float32)
    reference = Reference(mamba2, shape, 2)
    init = factory.states(2, tuple(module.STATE_SHAPE))
    module.load(state, slots, init)
    reference.load([1, 0], init.cpu())
    for _ in range(shape.capacity - 1):  # h = L - 1 committed entries, no flush yet
        inputs = factory.step(2)
        module.decode(state, slots, **inputs, **weights)
        reference.decode([1, 0], inputs, weights)
    assert state.cursor[..., 1].unique().tolist() == [shape.capacity - 1]
    window = factory.window(2, 2)
    out = module.verify(state, slots, **window, **weights)
    assert relative_error(out, reference.verify([1, 0], window, weights)) < 1e-5
    module.commit(state, slots, torch.tensor([2, 2], dtype=torch.int32, device=DEVICE))
    reference.commit([1, 0], [2, 2])
    assert relative_error(module.materialize(state, slots), reference.states[[1, 0]]) < 1e-5


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
def test_multi_warp_leftover_fold_takes_the_steps_cursor(spec_file):
    """Where some decode bucket runs several warps per program, a flush-every-step step that meets leftover entries
    folds them with the cursor it read and moves the cursor itself after a barrier (tests/test_gpu.py has the race
    this closes); mixed decode and verify steps against the reference. A one-warp program's fold reads and moves
    its cursor itself (MULTI_WARP, a constexpr of the launch, picks the variant)."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=9, window=4)
    decode = KernelConfig(block_v=8, num_warps=4, flush_at=1, fold_chunk=1)
    verify = KernelConfig(block_v=8, num_warps=1)

    def tables(warps):
        return module_defaults(spec, shape) | {
            KernelKind.REPLAY_DECODE: (BucketConfig(None, replace(decode, num_warps=warps)),),
            KernelKind.REPLAY_VERIFY: (BucketConfig(None, verify),),
        }

    module = load_kernels(spec, shape, tables(4))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=4, mixed=True, steps=10, seed=60), ("replay_verify", "replay_decode", "materialize"))
    source = render_module(plan_module(spec, shape, "any", tables(4), "defaults"))
    kernel = source.split("def _replay_decode_kernel(")[1].split("\n@triton.jit")[0]
    assert "if MULTI_WARP:\n" in kernel and "_fold_buffered_tile_shared_cursor(" in kernel and "i_h, i_b, start, count, slots_ptr, ckpt_ptr" in kernel
    assert "i_h, i_b, slots_ptr, cursor_ptr, ckpt_ptr" in kernel  # the one-warp program's fold reads and moves its cursor
    assert 'MULTI_WARP=config["num_warps"] > 1' in source.split("def _decode(")[1]


def _barrier_before_cursor_stores(source: str, kernel: str) -> list[str]:
    """Per cursor store of `kernel` in a rendered module: "always" where a barrier comes right before it (other stores
    and blank lines in between), "multi-warp" where one under `if MULTI_WARP:` does, "none" otherwise."""
    body = source.split(f"def {kernel}(")[1].split("\n@triton.jit")[0].splitlines()
    found = []
    for i, line in enumerate(body):
        if line.strip().startswith("tl.store(p_cursor,"):
            before = [other.strip() for other in reversed(body[:i]) if other.strip() and not other.strip().startswith("tl.store(")]
            if before[0] == "if MULTI_WARP:":  # a store only multi-warp programs make, after the barrier every program passes
                before = before[1:]
            found.append("none" if before[0] != "tl.debug_barrier()" else "multi-warp" if before[1] == "if MULTI_WARP:" else "always")
    assert found, f"{kernel} stores no cursor"
    return found


@pytest.mark.parametrize("spec_file", ["mamba2.yaml", "gdn.yaml"])
@pytest.mark.parametrize("fused_flush", [True, False])
def test_multi_warp_programs_pass_a_barrier_before_moving_their_cursor(spec_file, fused_flush):
    """Every thread of a program reads its cursor (a scalar), a few store it: with several warps, a warp that falls
    behind could read the cursor another warp already moved and take the wrong entries. Where some bucket buffers in a
    multi-warp decode program, runs a multi-warp verify (either launch of the split) or flushes in its own launch
    (four warps), that kernel passes a barrier before it stores its cursor; the mixed schedule of decode and verify
    steps runs such configs against the reference. One-warp programs skip the barriers (MULTI_WARP, a constexpr of
    each launch)."""
    spec = load_spec(ROOT / "specs" / spec_file)
    shape = replace(SMALL, capacity=9, window=2)
    decode = KernelConfig(block_v=8, num_warps=4, flush_at=4, fused_flush=fused_flush)
    verify = KernelConfig(block_v=8, num_warps=2, precompute_scores=True, window_block_v=8, window_warps=2)

    def tables(warps):
        return module_defaults(spec, shape) | {
            KernelKind.REPLAY_DECODE: (BucketConfig(None, replace(decode, num_warps=warps)),),
            KernelKind.REPLAY_VERIFY: (BucketConfig(None, replace(verify, num_warps=warps, window_warps=warps)),),
        }

    module = load_kernels(spec, shape, tables(4))
    assert_passes(check_speculative(module, spec, shape, device=DEVICE, tokens=2, mixed=True, steps=12, seed=61), ("replay_verify", "replay_decode", "materialize"))
    source = render_module(plan_module(spec, shape, "any", tables(4), "defaults"))
    for kernel in ("_replay_decode_kernel", "_replay_verify_kernel"):
        found = _barrier_before_cursor_stores(source, kernel)
        assert "none" not in found and "multi-warp" in found, (kernel, found)
    assert set(_barrier_before_cursor_stores(source, "_flush_kernel")) == {"always"}  # the flush launch runs four warps
    assert 'MULTI_WARP=config["num_warps"] > 1' in source.split("def _launch_verify(")[1]  # per launch: each half of the split its own
