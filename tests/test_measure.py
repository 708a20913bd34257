"""Benchmark workloads: set-up and the step functions they capture run (on the CPU here; timing needs a GPU)."""

import pytest
import torch

from replaygen.measure import DecodeWorkload
from replaygen.runtime import load_kernels

from conftest import DEVICE, SMALL


def test_workload_staggers_phases_and_steps(mamba2):
    module = load_kernels(mamba2, SMALL)
    work = DecodeWorkload(module, mamba2, SMALL, batch=3, act_dtype=torch.float32, device=torch.device(DEVICE), layers=2)
    work.stagger(3)
    counts = work.replay[0].cursor[..., 1]
    assert counts[:, 0, 0].tolist() == [0, 1, 2]
    assert (counts == counts[:, :1, :1]).all()  # every copy of a slot agrees
    state, inputs = work.replay[1], work.inputs[1]
    module.decode(state, work.slots, **inputs, **work.weights, flush_at=3)
    assert state.cursor[..., 1][:, 0, 0].tolist() == [1, 2, 0]
    out = module.baseline_decode(work.baseline[0], work.slots, **inputs, **work.weights)
    assert torch.isfinite(out).all()


def test_verify_workload_steps(mamba2):
    from dataclasses import replace

    from replaygen.measure import VerifyWorkload

    shape = replace(SMALL, capacity=8, window=4)
    module = load_kernels(mamba2, shape)
    work = VerifyWorkload(module, mamba2, shape, batch=2, tokens=3, act_dtype=torch.float32, device=torch.device(DEVICE), layers=1)
    for accept in ("all", "staggered", "random"):
        (count,) = work.accepted(accept, 1)
        assert count.dtype == torch.int32 and ((count >= 1) & (count <= 3)).all()
        assert accept == "random" or (count == 3).all()
        state, inputs = work.replay[0], work.inputs[0]
        out = module.verify(state, work.slots, **inputs, **work.weights)
        module.commit(state, work.slots, count, 3)
        snapshots, current = work.snapshots[0]
        base = module.baseline_verify(snapshots, current, work.slots, **inputs, **work.weights)
        module.baseline_commit(current, work.slots, count, 3)
        assert out.shape == base.shape == (2, 3, shape.heads, shape.value_dim)
        assert torch.isfinite(out).all() and torch.isfinite(base).all()


def test_verify_workload_staggered_buffers(mamba2):
    """"staggered": sequence i starts at the (i mod n)-th step of the n-step flush cycle, so each step of the cycle
    flushes 1/n of the sequences; "all" and "random" start every buffer empty."""
    from dataclasses import replace

    from replaygen.measure import VerifyWorkload
    from replaygen.traffic import verify_flush_period

    shape = replace(SMALL, capacity=8, window=2)
    module = load_kernels(mamba2, shape)
    work = VerifyWorkload(module, mamba2, shape, batch=5, tokens=2, act_dtype=torch.float32, device=torch.device(DEVICE), layers=2,
                          with_baseline=False)
    assert work.cycle == verify_flush_period(shape, 2, 2) == (2, 4, 6)
    work.start_buffers("staggered")
    for state in work.replay:
        assert state.cursor[..., 1][:, 0, 0].tolist() == [2, 4, 6, 2, 4]
        assert (state.cursor[..., 1] == state.cursor[..., 1][:, :1, :1]).all() and (state.cursor[..., 0] == 0).all()
    state, inputs = work.replay[0], work.inputs[0]
    (count,) = work.accepted("staggered", 1)
    module.verify(state, work.slots, **inputs, **work.weights)
    module.commit(state, work.slots, count, 2)
    assert state.cursor[..., 1][:, 0, 0].tolist() == [4, 6, 2, 4, 6]  # the row at 6 entries flushed (6 + 2T > L = 8)
    work.start_buffers("all")
    assert all((state.cursor == 0).all() for state in work.replay)
    with pytest.raises(ValueError, match="accept must be one of"):
        work.accepted("some", 1)
