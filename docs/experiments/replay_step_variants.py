"""Launch structures for the Mamba-2 replay decode step, one kernel body each (GPU; docs/perf.md entry 46).

The body is the shipped output-only step at nemotron-h sizes (H=128, P=64, G=8, N=128, a ring of 20 positions in a
32-row tile): the checkpoint tile read at the query, the live ring entries weighted by their decays and by scores,
the step's own term, D skip, the entry appended, the cursor written (unchanged), the output stored. The scores come from a
static buffer (no scores kernel) and the cursor does not advance, so every step holds `--fill` live entries and is
timed alike. Variants:

    grid      one tile (batch row, head, block_v value rows) per program, pointer loads: the shipped structure
    pers      persistent programs (per_sm per multiprocessor) looping over the tiles, tl.range(num_stages=NS)
    tma       as pers, the checkpoint tile through a TMA descriptor (a bulk async copy into shared memory)
    self      as grid, each program scoring the live ring keys itself (no scores buffer)
    fold      as grid, with the flush branch compiled in: the ring folded into the register tile and stored
    foldmem   as fold, the branch an out-of-line function (noinline) that reads the tile again from memory
    ...keep   (fold, foldmem) the checkpoint read with the default L2 policy instead of evict-first

With `--cycle` the fold variants flush on 2 of the 16 steps of each timed graph, half the rows each (slot % 2, as the
shipped align_flushes with two groups); otherwise no step flushes. Per step, cold layers (past 4x L2), 16-step
CUDA graphs, medians of 20. Outputs are compared with the first variant's (the self variant's scores differ; with
`--cycle` not at all, since the folds change the checkpoints).

    python docs/experiments/replay_step_variants.py --batch 32,128 --variants grid:32:1,fold:32:1,foldmem:64:2 --cycle
"""

import argparse
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from replaygen.measure import capture, l2_bytes, time_callable

HEADS, VALUE_DIM, GROUPS, KEY_DIM, RING, BLOCK_R = 128, 64, 8, 128, 20, 32
STEPS = 16
NEVER = 1 << 30


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit(noinline=True)
def _fold_in_memory(p_state, p_value, p_key, p_log_decay, p_weight, p_x, p_k, start, count, total, dt, i_v,
                    P: tl.constexpr, N: tl.constexpr, RING: tl.constexpr, BV: tl.constexpr):
    """Fold `count` ring entries and the step into the [BV, N] checkpoint tile at p_state, read again from memory."""
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, N)
    p_s = p_state + tl.arange(0, BV)[:, None] * N + o_k[None, :]
    b_s = tl.load(p_s) * tl.exp(total)
    through = 0.0
    for j in range(0, count):
        r = (start + j) % RING
        through += tl.load(p_log_decay + r)
        b_k = tl.load(p_key + r * N + o_k).to(tl.float32)
        b_u = tl.load(p_value + r * P + o_v).to(tl.float32)
        b_s += b_u[:, None] * (b_k * tl.exp(total - through) * tl.load(p_weight + r))[None, :]
    b_s += (dt * tl.load(p_x + o_v).to(tl.float32))[:, None] * tl.load(p_k + o_k).to(tl.float32)[None, :]
    tl.store(p_s, b_s, eviction_policy="evict_first")


@triton.jit
def _tile(t, slots, cursor, ckpt, desc, ring_value, ring_key, ring_log_decay, ring_weight, scores,
          x, B, C, dt, A_log, dt_bias, D, out, flush_group,
          H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, RING: tl.constexpr, BLOCK_R: tl.constexpr,
          BV: tl.constexpr, USE_TMA: tl.constexpr, SELF_SCORES: tl.constexpr, FOLD: tl.constexpr, EVICT: tl.constexpr):
    """One (batch row, head, value block) tile of the step; tile index t, value block fastest."""
    VB: tl.constexpr = P // BV
    i_v = t % VB
    i_h = (t // VB) % H
    i_b = t // (VB * H)
    i_g = i_h // (H // G)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, N)
    o_r = tl.arange(0, BLOCK_R)
    i_slot = tl.load(slots + i_b).to(tl.int64)
    p_cursor = cursor + (i_slot * H + i_h) * 2
    start = tl.load(p_cursor)
    count = tl.load(p_cursor + 1)
    row = (i_slot * H + i_h) * P + i_v * BV
    if USE_TMA:
        b_s0 = desc.load([row.to(tl.int32), 0])
    else:
        b_s0 = tl.load(ckpt + row * N + tl.arange(0, BV)[:, None] * N + o_k[None, :], eviction_policy=EVICT)
    live = (o_r < RING) & ((o_r + RING - start) % RING < count)
    head = (i_slot * H + i_h) * RING
    keys = (i_slot * G + i_g) * RING
    b_lg_j = tl.load(ring_log_decay + head + o_r, mask=live, other=0.0)
    b_w_j = tl.load(ring_weight + head + o_r, mask=live, other=0.0)
    b_u_j = tl.load(ring_value + (head + o_r[:, None]) * P + o_v[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    wrapped = o_r < start
    total = tl.sum(b_lg_j, 0)
    b_c_j = tl.cumsum(b_lg_j, 0) - tl.sum(tl.where(wrapped, b_lg_j, 0.0), 0) + tl.where(wrapped, total, 0.0)
    b_v = tl.load(x + (i_b * H + i_h) * P + o_v).to(tl.float32)
    b_k = tl.load(B + (i_b * G + i_g) * N + o_k).to(tl.float32)
    b_q = tl.load(C + (i_b * G + i_g) * N + o_k).to(tl.float32)
    b_dt = _softplus(tl.load(dt + i_b * H + i_h).to(tl.float32) + tl.load(dt_bias + i_h))
    b_lg = -tl.exp(tl.load(A_log + i_h)) * b_dt
    if SELF_SCORES:
        b_k_j = tl.load(ring_key + (keys + o_r[:, None]) * N + o_k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        b_score = tl.sum(b_k_j * b_q[None, :], 1)
    else:
        b_score = tl.load(scores + (i_slot * G + i_g) * BLOCK_R + o_r, mask=live, other=0.0)
    b_ct = total + b_lg
    b_o = tl.exp(b_ct) * tl.sum(b_s0 * b_q[None, :], 1) + tl.sum((b_score * b_w_j * tl.exp(b_ct - b_c_j))[:, None] * b_u_j, 0)
    b_o += (b_dt * tl.sum(b_k * b_q)) * b_v + tl.load(D + i_h) * b_v
    flush = flush_group == (i_slot % 2).to(tl.int32)
    if FOLD == 2 and flush:
        _fold_in_memory(ckpt + row * N, ring_value + head * P, ring_key + keys * N, ring_log_decay + head, ring_weight + head,
                        x + (i_b * H + i_h) * P, B + (i_b * G + i_g) * N, start, count, b_ct, b_dt, i_v, P, N, RING, BV)
    elif FOLD == 1 and flush:
        b_s = b_s0 * tl.exp(b_ct)
        through = 0.0
        for j in range(0, count):
            r = (start + j) % RING
            through += tl.load(ring_log_decay + head + r)
            b_k_e = tl.load(ring_key + (keys + r) * N + o_k).to(tl.float32)
            b_u_e = tl.load(ring_value + (head + r) * P + o_v).to(tl.float32)
            b_s += b_u_e[:, None] * (b_k_e * tl.exp(b_ct - through) * tl.load(ring_weight + head + r))[None, :]
        b_s += (b_dt * b_v)[:, None] * b_k[None, :]
        tl.store(ckpt + row * N + tl.arange(0, BV)[:, None] * N + o_k[None, :], b_s, eviction_policy="evict_first")
    else:
        r_new = (start + count) % RING
        first = i_v == 0
        tl.store(ring_value + (head + r_new) * P + o_v, b_v.to(tl.bfloat16))
        tl.store(ring_log_decay + head + r_new, b_lg, mask=first)
        tl.store(ring_weight + head + r_new, b_dt, mask=first)
        tl.store(ring_key + (keys + r_new) * N + o_k, b_k.to(tl.bfloat16), mask=first & (i_h % (H // G) == 0))
    tl.store(p_cursor, start, mask=i_v == 0)
    tl.store(p_cursor + 1, count, mask=i_v == 0)
    tl.store(out + (i_b * H + i_h) * P + o_v, b_o.to(tl.bfloat16))


@triton.jit
def _step_kernel(slots, cursor, ckpt, desc, ring_value, ring_key, ring_log_decay, ring_weight, scores,
                 x, B, C, dt, A_log, dt_bias, D, out, flush_group, n_tiles,
                 H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, RING: tl.constexpr,
                 BLOCK_R: tl.constexpr, BV: tl.constexpr, USE_TMA: tl.constexpr, SELF_SCORES: tl.constexpr,
                 FOLD: tl.constexpr, EVICT: tl.constexpr, PERSISTENT: tl.constexpr, NS: tl.constexpr):
    if PERSISTENT:
        for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NS):
            _tile(t, slots, cursor, ckpt, desc, ring_value, ring_key, ring_log_decay, ring_weight, scores, x, B, C, dt,
                  A_log, dt_bias, D, out, flush_group, H, P, G, N, RING, BLOCK_R, BV, USE_TMA, SELF_SCORES, FOLD, EVICT)
    else:
        _tile(tl.program_id(0), slots, cursor, ckpt, desc, ring_value, ring_key, ring_log_decay, ring_weight, scores, x, B,
              C, dt, A_log, dt_bias, D, out, flush_group, H, P, G, N, RING, BLOCK_R, BV, USE_TMA, SELF_SCORES, FOLD, EVICT)


class Layer:
    """One layer's replay state (permuted slots, `fill` live entries per head) and step inputs, never zeros."""

    def __init__(self, batch: int, fill: int, gen: torch.Generator, device: torch.device):
        def rand(*shape, scale=1.0, dtype=torch.float32):
            return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

        self.slots = torch.randperm(batch, generator=gen).to(device, torch.int32)
        self.ckpt = rand(batch * HEADS * VALUE_DIM, KEY_DIM)
        self.ring_value = rand(batch * HEADS * RING * VALUE_DIM, scale=0.5, dtype=torch.bfloat16)
        self.ring_key = rand(batch * GROUPS * RING * KEY_DIM, scale=0.5, dtype=torch.bfloat16)
        self.ring_log_decay = (-torch.rand(batch * HEADS * RING, generator=gen) * 0.5 - 0.01).to(device)
        self.ring_weight = torch.rand(batch * HEADS * RING, generator=gen).to(device)
        self.scores = rand(batch * GROUPS * BLOCK_R)
        cursor = torch.empty(batch * HEADS, 2, dtype=torch.int32)  # (ring start, entry count) per (slot, head)
        cursor[:, 0] = torch.randint(0, RING, (cursor.shape[0],), generator=gen)
        cursor[:, 1] = fill
        self.cursor = cursor.to(device)
        self.x = rand(batch * HEADS * VALUE_DIM, dtype=torch.bfloat16)
        self.B = rand(batch * GROUPS * KEY_DIM, dtype=torch.bfloat16)
        self.C = rand(batch * GROUPS * KEY_DIM, dtype=torch.bfloat16)
        self.dt = rand(batch * HEADS, dtype=torch.bfloat16)
        self.A_log = torch.rand(HEADS, generator=gen).to(device)
        self.dt_bias = torch.rand(HEADS, generator=gen).to(device)
        self.D = torch.rand(HEADS, generator=gen).to(device)
        self.out = torch.empty(batch * HEADS * VALUE_DIM, device=device, dtype=torch.bfloat16)
        self.descriptors: dict[int, TensorDescriptor] = {}


def launch(layer: Layer, batch: int, variant: str, block_v: int, warps: int, stages: int, per_sm: int, flush_group: int) -> None:
    mode = variant.removesuffix("keep")
    tiles = batch * HEADS * (VALUE_DIM // block_v)
    persistent = mode in ("pers", "tma")
    desc = layer.ckpt
    if mode == "tma":
        if block_v not in layer.descriptors:
            layer.descriptors[block_v] = TensorDescriptor.from_tensor(layer.ckpt, [block_v, KEY_DIM])
        desc = layer.descriptors[block_v]
    programs = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count * per_sm) if persistent else tiles
    _step_kernel[(programs,)](
        layer.slots, layer.cursor, layer.ckpt, desc, layer.ring_value, layer.ring_key, layer.ring_log_decay, layer.ring_weight,
        layer.scores, layer.x, layer.B, layer.C, layer.dt, layer.A_log, layer.dt_bias, layer.D, layer.out, flush_group, tiles,
        H=HEADS, P=VALUE_DIM, G=GROUPS, N=KEY_DIM, RING=RING, BLOCK_R=BLOCK_R, BV=block_v, USE_TMA=mode == "tma",
        SELF_SCORES=mode == "self", FOLD={"fold": 1, "foldmem": 2}.get(mode, 0),
        EVICT="" if variant.endswith("keep") else "evict_first", PERSISTENT=persistent, NS=stages, num_warps=warps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="32,128")
    parser.add_argument("--fill", type=int, default=8, help="live ring entries per head (at most 20)")
    parser.add_argument("--cycle", action="store_true", help="fold variants flush half the rows on 2 of 16 steps")
    parser.add_argument("--variants", default="grid:32:1,grid:64:2,fold:32:1,fold:64:2,foldmem:64:2,pers:32:1:2:8,tma:16:1:2:8",
                        help="comma-separated VARIANT:BLOCK_V:WARPS[:STAGES:PER_SM]")
    args = parser.parse_args()
    device = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    variants = []
    for text in args.variants.split(","):
        name, *numbers = text.split(":")
        if name.removesuffix("keep") not in ("grid", "pers", "tma", "self", "fold", "foldmem") or not 2 <= len(numbers) <= 4:
            parser.error(f"--variants: {text!r} is not VARIANT:BLOCK_V:WARPS[:STAGES:PER_SM] with a variant of the list above")
        block_v, warps, stages, per_sm = map(int, numbers + ["1", "8"][len(numbers) - 2:])
        variants.append((name, block_v, warps, stages, per_sm))
    for batch in (int(b) for b in args.batch.split(",")):
        gen = torch.Generator().manual_seed(batch)
        layers = [Layer(batch, args.fill, gen, device)
                  for _ in range(max(2, math.ceil(4 * l2_bytes(device) / (batch * HEADS * VALUE_DIM * KEY_DIM * 4))))]
        reference = None
        for name, block_v, warps, stages, per_sm in variants:
            label = f"b{batch} {name} bv{block_v} w{warps}" + (f" ns{stages} per_sm{per_sm}" if name in ("pers", "tma") else "")
            launch(layers[0], batch, name, block_v, warps, stages, per_sm, -1)
            result = layers[0].out.float()
            reference = result.clone() if reference is None else reference
            diff = ((result - reference).abs().max() / reference.abs().max()).item()

            def steps(name=name, block_v=block_v, warps=warps, stages=stages, per_sm=per_sm) -> None:
                for i in range(STEPS):
                    group = i // (STEPS // 2) if args.cycle and i % (STEPS // 2) == 0 else -1
                    for layer in layers:
                        launch(layer, batch, name, block_v, warps, stages, per_sm, group)

            timing = time_callable(capture(steps).replay, repeats=20, per_call=STEPS * len(layers))
            compared = "n/a (the folds changed the checkpoints)" if args.cycle else f"{diff:.1e}"
            print(f"{label:40s} {timing.median_ms * 1e3:9.2f} us per step   max rel diff {compared}", flush=True)


if __name__ == "__main__":
    main()
