"""Step inputs as views: a serving engine splits q, k, v (or x, B, C) out of one projection and passes the views, so
every step input's batch and token strides are the packed row's, not its own size. The kernels read the strides
they are given: the results equal those of contiguous copies, bit for bit, over whole flush cycles."""

from dataclasses import replace

import pytest
import torch

from replaygen.harness import InputFactory
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import RotaryPairing

from conftest import DEVICE, ROOT, SMALL

BATCH = 3
GAP = 3  # packed channels before and after each input, as other projections' would be


def as_views(inputs: dict[str, torch.Tensor | None], lead: int) -> dict[str, torch.Tensor | None]:
    """Each input [*lead dims, ...] copied into the middle of a wider packed tensor [*lead dims, GAP + n + GAP] and
    returned as a view of it: the same values, every leading stride the packed width's."""
    views = {}
    for name, t in inputs.items():
        if t is None:
            views[name] = None
            continue
        n = t[(0,) * lead].numel()
        packed = torch.full((*t.shape[:lead], GAP + n + GAP), float("nan"), dtype=t.dtype, device=t.device)
        packed[..., GAP : GAP + n] = t.reshape(*t.shape[:lead], n)
        views[name] = packed[..., GAP : GAP + n].view(t.shape)
        assert not views[name].is_contiguous() or t.shape[0] == 1
    return views


def same_state(a, b) -> bool:
    """Two replay states hold the same checkpoints, rings and cursors, bit for bit."""
    return all(torch.equal(x, y) for x, y in zip((a.checkpoint, a.cursor, *a.buffers()), (b.checkpoint, b.cursor, *b.buffers()), strict=True))


def plain(states) -> tuple[torch.Tensor, ...]:
    """A baseline state's tensors: the state tensor, or every tensor of a module's SlotStates (state and carries)."""
    return (states,) if isinstance(states, torch.Tensor) else tuple(t for t in vars(states).values() if isinstance(t, torch.Tensor))


FAMILIES = {
    "mamba2": {},
    "gdn": {},
    "kda": {},
    "mamba3-mimo": {"rank": 2, "rotary_pairing": RotaryPairing.HALVES},  # keys and queries [b, R, G, N]: rank strides too
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    spec = load_spec(ROOT / "specs" / f"{request.param.split('-')[0]}.yaml")
    shape = replace(SMALL, capacity=4, window=2, layout=spec.state.layout, **FAMILIES[request.param])
    return spec, shape, load_kernels(spec, shape)


def test_decode_reads_views(family):
    """Replay decode over three flush cycles, and the baseline decode, on twin states: views against copies."""
    spec, shape, module = family
    factory = InputFactory(spec, shape, DEVICE, torch.float32, 5)
    weights, slots = factory.weights(), torch.arange(BATCH, dtype=torch.int32, device=DEVICE)
    viewed, copied = module.allocate(BATCH, DEVICE, torch.float32), module.allocate(BATCH, DEVICE, torch.float32)
    baseline_viewed, baseline_copied = module.allocate_baseline(BATCH, DEVICE), module.allocate_baseline(BATCH, DEVICE)
    for _ in range(3 * shape.capacity):
        inputs = factory.step(BATCH)
        views = as_views(inputs, 1)
        assert torch.equal(module.decode(viewed, slots, **views, **weights), module.decode(copied, slots, **inputs, **weights))
        assert torch.equal(
            module.baseline_decode(baseline_viewed, slots, **views, **weights), module.baseline_decode(baseline_copied, slots, **inputs, **weights)
        )
    assert same_state(viewed, copied) and all(torch.equal(x, y) for x, y in zip(plain(baseline_viewed), plain(baseline_copied), strict=True))


def test_verify_reads_views(family):
    """Replay verify + commit of windows with every accepted count, over several flush cycles: views against copies."""
    spec, shape, module = family
    factory = InputFactory(spec, shape, DEVICE, torch.float32, 6)
    weights, slots = factory.weights(), torch.arange(BATCH, dtype=torch.int32, device=DEVICE)
    viewed, copied = module.allocate(BATCH, DEVICE, torch.float32), module.allocate(BATCH, DEVICE, torch.float32)
    for step in range(2 * shape.capacity):
        inputs = factory.window(BATCH, shape.window)
        views = as_views(inputs, 2)
        assert torch.equal(module.verify(viewed, slots, **views, **weights), module.verify(copied, slots, **inputs, **weights))
        accepted = torch.tensor([(step + row) % (shape.window + 1) for row in range(BATCH)], dtype=torch.int32, device=DEVICE)
        module.commit(viewed, slots, accepted, num_tokens=shape.window)
        module.commit(copied, slots, accepted, num_tokens=shape.window)
    assert same_state(viewed, copied)
