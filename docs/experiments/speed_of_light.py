"""Speed of light of the replay decode's traffic (GPU only; docs/perf.md entry 31).

A traffic-only Triton kernel moves what one replay decode step moves, with the shipped config's grid
(block_v, warps), and almost no arithmetic: the checkpoint tile read, ring value rows read, the output row
written. Its ring holds L rows (the shipped ring has L + T positions, padded to a power of two) and it reads no
ring keys (the shipped scores kernel does). Stages add the replay step's memory structure one at a time:

    plain     the tile's address from the program ids; every ring row read
    slot      the tile's address through slots[b] (one dependent load)
    cursor    + the entry count read; only live ring rows read (a second dependent load)
    step      + the step's inputs (value row, key and query) read, the entry appended, the cursor written
    prefetch  step, with every ring row read without waiting for the cursor
    cycle     step, with the flush cycle's write-back: on flush_groups of every flush_at steps,
              that group's rows (slot % groups) write their tile back

Beside them, in the same process: the shipped module's replay decode over whole flush cycles (the bench's
measure), and the same kernel never flushing (flush_at past the capacity; timing only, its outputs are not
the recurrence's). Per step, cold layers (past 4x L2), 16-step CUDA graphs, medians; % of the best-of-three
1 GiB copy, counting the traffic kernel's bytes.

    python docs/experiments/speed_of_light.py --batch 32,256 --gpu h100
"""

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from replaygen.configs import BucketConfig, KernelConfig, KernelKind, bucket_config
from replaygen.measure import DecodeWorkload, capture, copy_bandwidth, l2_bytes, time_callable
from replaygen.runtime import load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import Spec, TargetShape
from replaygen.tune.apply import resolve_configs

STEPS = 16
STAGES = {
    # name: (SLOT, CURSOR, STEP, PREFETCH, cycle write-back)
    "plain": (0, 0, 0, 1, False),
    "slot": (1, 0, 0, 1, False),
    "cursor": (1, 1, 0, 0, False),
    "step": (1, 1, 1, 0, False),
    "prefetch": (1, 1, 1, 1, False),
    "cycle": (1, 1, 1, 0, True),
}


@triton.jit
def _traffic_kernel(
    ckpt_ptr, ring_ptr, out_ptr, slots_ptr, cursor_ptr, value_ptr, key_query_ptr, write_group, groups,
    V: tl.constexpr, K: tl.constexpr, H: tl.constexpr, R: tl.constexpr, BLOCK_V: tl.constexpr,
    SLOT: tl.constexpr, CURSOR: tl.constexpr, STEP: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One (value block, head, batch row) tile: ckpt [slots, H, V, K] fp32, ring [slots, H, R, V] bf16,
    out [batch, H, V] bf16, cursor [slots, H, 2] int32 (start, count), value [batch, H, V], key_query
    [batch, 2, K]. Rows with slot % groups == write_group write their tile back (write_group < 0: none)."""
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, R)
    if SLOT:
        i_slot = tl.load(slots_ptr + i_b).to(tl.int64)
    else:
        i_slot = i_b.to(tl.int64)
    tile = i_slot * H + i_h
    p_s = ckpt_ptr + tile * (V * K) + o_v[:, None] * K + o_k[None, :]
    b_s = tl.load(p_s, eviction_policy="evict_first")
    if CURSOR:
        count = tl.load(cursor_ptr + tile * 2 + 1)
        used = o_r < count
    else:
        count = i_b * 0
        used = o_r < R
    if PREFETCH:
        read = o_r < R
    else:
        read = used
    b_u = tl.load(ring_ptr + tile * (R * V) + o_r[:, None] * V + o_v[None, :], mask=read[:, None], other=0).to(tl.float32)
    b_o = tl.sum(b_s, 1) + tl.sum(tl.where(used[:, None], b_u, 0.0), 0)
    if STEP:
        b_x = tl.load(value_ptr + (i_b * H + i_h) * V + o_v).to(tl.float32)
        b_k = tl.load(key_query_ptr + i_b * 2 * K + o_k).to(tl.float32)
        b_q = tl.load(key_query_ptr + (i_b * 2 + 1) * K + o_k).to(tl.float32)
        b_o = b_o * tl.sum(b_k * b_q) + b_x
        tl.store(ring_ptr + tile * (R * V) + ((count + 1) % R) * V + o_v, b_x.to(tl.bfloat16))
        tl.store(cursor_ptr + tile * 2 + 1 + tl.arange(0, 1), tl.zeros([1], tl.int32) + (count + 1) % R, mask=i_v == 0)
    tl.store(out_ptr + (i_b * H + i_h) * V + o_v, b_o.to(tl.bfloat16))
    if write_group >= 0:
        if i_slot % groups == write_group:
            tl.store(p_s, b_s + 1.0, eviction_policy="evict_first")


def traffic_times(shape: TargetShape, batch: int, config: KernelConfig, device: torch.device) -> dict[str, tuple[float, float]]:
    """Per stage: (µs per step, bytes per step) of the traffic kernel over cold layers."""
    H, V, K, R = shape.heads, shape.value_dim, shape.key_dim, shape.capacity
    per_layer = batch * H * V * K * 4
    layers = max(2, math.ceil(4 * l2_bytes(device) / per_layer))
    gen = torch.Generator(device=device).manual_seed(0)
    ckpts = [torch.randn(batch, H, V, K, device=device, generator=gen) for _ in range(layers)]
    rings = [torch.randn(batch, H, R, V, device=device, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    cursors = [torch.randint(0, R, (batch, H, 2), device=device, generator=gen, dtype=torch.int32) for _ in range(layers)]
    values = [torch.randn(batch, H, V, device=device, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    keys = [torch.randn(batch, 2, K, device=device, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    outs = [torch.empty(batch, H, V, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    slots = torch.randperm(batch, device=device, generator=gen).to(torch.int32)
    groups = max(config.flush_groups, 1)
    grid = (triton.cdiv(V, config.block_v), H, batch)
    ring_rows = R / 2  # about half the rows live: the cursor counts are uniform in 0..R-1
    results = {}
    for name, (slot, cursor, step, prefetch, cycle) in STAGES.items():
        def run():
            for i in range(STEPS):
                write_group = i // (STEPS // groups) if cycle and i % (STEPS // groups) == 0 else -1
                for tensors in zip(ckpts, rings, outs, cursors, values, keys):
                    _traffic_kernel[grid](*tensors[:3], slots, *tensors[3:], write_group, groups, V, K, H, R,
                                          config.block_v, slot, cursor, step, prefetch, num_warps=config.num_warps)

        seconds = time_callable(capture(run).replay, repeats=20, per_call=STEPS * layers).median_ms * 1e-3
        rows = R if prefetch or not cursor else ring_rows
        nbytes = per_layer + batch * H * V * 2 * (rows + 1 + 2 * step) + (per_layer / STEPS if cycle else 0)
        results[name] = (seconds * 1e6, nbytes)
    return results


def replay_times(spec: Spec, shape: TargetShape, tables: dict[KernelKind, tuple[BucketConfig, ...]], batch: int, gpu: str, device: torch.device) -> tuple[float, float]:
    """µs per step of the shipped replay decode: over whole flush cycles, and never flushing (timing only)."""
    config = bucket_config(tables[KernelKind.REPLAY_DECODE], batch)
    module = load_kernels(spec, shape, tables, gpu=gpu, config_source="speed of light")
    work = DecodeWorkload(module, spec, shape, batch, torch.bfloat16, device)
    cycle = work.time_replay(config.route.value, config.flush_at, repeats=20).median_ms * 1e3
    spread = replace(config, align_flushes=False, flush_groups=1)
    never = load_kernels(spec, shape, {**tables, KernelKind.REPLAY_DECODE: (BucketConfig(None, spread),)}, gpu=gpu, config_source="speed of light")
    never._CAPACITY = 1 << 30
    work.stagger(config.flush_at)

    def steps():
        for state, inputs in zip(work.replay, work.inputs):
            never.decode(state, work.slots, **inputs, **work.weights, flush_at=1 << 30)

    def run():
        for _ in range(STEPS):
            steps()

    never_flushing = time_callable(capture(run).replay, repeats=20, per_call=STEPS * work.layers).median_ms * 1e3
    return cycle, never_flushing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="32,256", help="comma-separated batch sizes")
    parser.add_argument("--gpu", default="h100", help="whose tuning records pick the shipped configs (as `build --gpu`)")
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy {copy / 1e12:.3f} TB/s")
    for spec_name, shape_name in (("mamba2", "nemotron-h"), ("gdn", "qwen3.5")):
        spec = load_spec(Path(f"specs/{spec_name}.yaml"))
        shape = spec.shape(shape_name)
        tables = resolve_configs(spec, shape, args.gpu, Path("tune")).configs  # what `build --gpu GPU` ships
        for batch in (int(b) for b in args.batch.split(",")):
            config = bucket_config(tables[KernelKind.REPLAY_DECODE], batch)
            cycle, never_flushing = replay_times(spec, shape, tables, batch, args.gpu, device)
            print(f"{shape_name} b{batch} bv{config.block_v} w{config.num_warps}: replay cycle {cycle:.1f} us/step, never flushing {never_flushing:.1f}")
            for name, (us, nbytes) in traffic_times(shape, batch, config, device).items():
                print(f"  traffic {name:8s} {us:7.1f} us/step  {nbytes / (us * 1e-6) / copy * 100:5.1f}% of copy")


if __name__ == "__main__":
    main()
