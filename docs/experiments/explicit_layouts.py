"""Explicit register layouts (Gluon) for the state tile's arithmetic, against plain Triton (docs/perf.md entry 61).

Plain Triton takes a tile's register layout from its load: lanes run along the contiguous key axis, so every
readout of a [BLOCK_V, K] state tile reduces across lanes (shuffles), and a tensor-core product needs the tile
converted into the MMA layout through shared memory (entries 4, 7, 12, 18, 34, 35). Gluon, Triton's lower-level
language, states each layout. Standalone kernels (no slots, cursor or ring bookkeeping; every row takes the same
path), one program per (value block, head, batch row) of a state [batch, heads, V, K] fp32:

    fold      S' = a S + (diag(w) X)^T B   X [R, BLOCK_V] bf16 ring values, B [R, K] bf16 ring keys (the head's
              group), w [R] and a fp32: plain Triton as R rank-1 updates (the shipped fold's form), Gluon as two tf32
              tensor-core products (diag(w) X split into a tf32 high part and the rest, B exact in tf32)
    readouts  y_t = S' q_t for NQ rows q_t [K] bf16 of the group, each written out [BLOCK_V] fp32
    store     S' written back

Experiments: `flush` (Mamba-2 nemotron-h, every row flushing, one readout: a decode step where every row flushes),
`gdn-readouts` (GDN qwen3.5, eight readouts, nothing stored: the split verify's checkpoint half at T=4),
`gdn-flush` (the same with the fold and store: its flushing rows). Where the state sits in registers (`memory`):
`mma` loads and stores it in the MMA accumulator layout; `blocked` loads and stores it in a blocked layout (four
consecutive keys per thread, `rows` lanes across value rows) and converts to and from the MMA layout around the
fold; `blocked-only` keeps the blocked layout throughout (readouts only). Each variant is checked against float64,
then timed: cold states (layers past 4x L2), CUDA graphs of one launch per layer, three rounds, medians.

With `--shipped MODULE` (a generated GDN speculative module), the split verify's checkpoint half of that module
(its SPLIT 1 launch alone, through the module's internal `_launch_verify`; timing only) runs beside the GDN
variants in the same process, every row holding 8 entries (no flush) or 24 (every row flushing): the anchor that
says how far the plain-Triton variants here are from the shipped kernel.

    python docs/experiments/explicit_layouts.py --offline     # sm_90 registers and SASS, no GPU needed
    python docs/experiments/explicit_layouts.py --batch 32,256
    python docs/experiments/explicit_layouts.py --experiments gdn-readouts,gdn-flush --shipped generated.h200.gdn_qwen3_5_mtp
"""

import argparse
import importlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from replaygen.measure import capture, copy_bandwidth, l2_bytes, random_replay_states, set_entry_counts, time_callable


@dataclass(frozen=True)
class Dims:
    heads: int
    value_dim: int
    key_dim: int
    groups: int


SHAPES = {"nemotron-h": Dims(128, 64, 128, 8), "qwen3.5": Dims(32, 128, 128, 16)}
READOUTS_ONLY, FOLD_AND_STORE, STORE_ONLY = 0, 1, 2
MEMORY = {"mma": 0, "blocked": 1, "blocked-only": 2}


@dataclass(frozen=True)
class Variant:
    gluon: bool
    block_v: int
    warps: int
    mode: int  # READOUTS_ONLY, FOLD_AND_STORE or STORE_ONLY
    memory: str = "mma"  # Gluon only: where the state tile sits (MEMORY)
    rows: int = 4  # Gluon blocked layouts: lanes across value rows


@triton.jit
def _triton_tile(ckpt, ring_x, ring_b, ring_w, decay, q, y, H: tl.constexpr, G: tl.constexpr, V: tl.constexpr,
                 K: tl.constexpr, R: tl.constexpr, NQ: tl.constexpr, BLOCK_V: tl.constexpr, MODE: tl.constexpr):
    """ckpt [B, H, V, K] fp32; ring_x [B, R, H, V] bf16; ring_b [B, R, G, K] bf16; ring_w [B, H, R]; decay [B, H];
    q [B, G, NQ, K] bf16; y [B, H, NQ, V] fp32."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    i_g = i_h // (H // G)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    o_k = tl.arange(0, K)
    p_s = ckpt + ((i_b * H + i_h) * V + o_v[:, None]) * K + o_k[None, :]
    b_s = tl.load(p_s, eviction_policy="evict_first")
    if MODE == 1:
        b_s = b_s * tl.load(decay + i_b * H + i_h)
        for j in tl.static_range(R):
            b_x = tl.load(ring_x + ((i_b * R + j) * H + i_h) * V + o_v).to(tl.float32) * tl.load(ring_w + (i_b * H + i_h) * R + j)
            b_b = tl.load(ring_b + ((i_b * R + j) * G + i_g) * K + o_k).to(tl.float32)
            b_s += b_x[:, None] * b_b[None, :]
    for t in tl.static_range(NQ):
        b_q = tl.load(q + ((i_b * G + i_g) * NQ + t) * K + o_k).to(tl.float32)
        tl.store(y + ((i_b * H + i_h) * NQ + t) * V + o_v, tl.sum(b_s * b_q[None, :], 1))
    if MODE != 0:
        tl.store(p_s, b_s)


@gluon.jit
def _gluon_tile(ckpt, ring_x, ring_b, ring_w, decay, q, y, H: gl.constexpr, G: gl.constexpr, V: gl.constexpr,
                K: gl.constexpr, R: gl.constexpr, NQ: gl.constexpr, BLOCK_V: gl.constexpr, WARPS: gl.constexpr,
                MODE: gl.constexpr, MEMORY: gl.constexpr, ROWS: gl.constexpr):
    """As _triton_tile, with explicit layouts: the fold by two tf32 mma.sync products on the tile in the MMA
    accumulator layout. MEMORY 0: the tile loaded and stored in that layout; 1: in a blocked layout converted to and
    from it; 2: the blocked layout throughout (MODE 0 only)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    lhs: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    rhs: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=1)
    blocked: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[ROWS, 32 // ROWS],
                                             warps_per_cta=[WARPS, 1], order=[1, 0])
    io: gl.constexpr = mma if MEMORY == 0 else blocked
    work: gl.constexpr = blocked if MEMORY == 2 else mma
    i_v = gl.program_id(0)
    i_h = gl.program_id(1)
    i_b = gl.program_id(2)
    i_g = i_h // (H // G)
    m_v = i_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=gl.SliceLayout(1, io))
    m_k = gl.arange(0, K, layout=gl.SliceLayout(0, io))
    p_s = ckpt + ((i_b * H + i_h) * V + m_v[:, None]) * K + m_k[None, :]
    b_s = gl.convert_layout(gl.load(p_s), work)
    o_v = i_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=gl.SliceLayout(1, work))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, work))
    if MODE == 1:
        b_s = b_s * gl.load(decay + i_b * H + i_h)
        x_v = i_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=gl.SliceLayout(1, lhs))
        x_j = gl.arange(0, R, layout=gl.SliceLayout(0, lhs))
        b_x = gl.load(ring_x + ((i_b * R + x_j[None, :]) * H + i_h) * V + x_v[:, None]).to(gl.float32)
        b_x = b_x * gl.load(ring_w + (i_b * H + i_h) * R + x_j)[None, :]
        b_j = gl.arange(0, R, layout=gl.SliceLayout(1, rhs))
        b_k = gl.arange(0, K, layout=gl.SliceLayout(0, rhs))
        b_b = gl.load(ring_b + ((i_b * R + b_j[:, None]) * G + i_g) * K + b_k[None, :]).to(gl.float32)
        b_hi = (b_x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)
        b_s = mma_v2(b_hi, b_b, b_s, input_precision="tf32")
        b_s = mma_v2(b_x - b_hi, b_b, b_s, input_precision="tf32")
    for t in gl.static_range(NQ):
        b_q = gl.load(q + ((i_b * G + i_g) * NQ + t) * K + o_k).to(gl.float32)
        gl.store(y + ((i_b * H + i_h) * NQ + t) * V + o_v, gl.sum(b_s * b_q[None, :], axis=1))
    if MODE != 0:
        gl.store(p_s, gl.convert_layout(b_s, io))


EXPERIMENTS = {
    # name: (shape, readouts per tile, variants)
    "flush": ("nemotron-h", 1, {
        "triton loop bv32 w1": Variant(False, 32, 1, FOLD_AND_STORE),
        "triton loop bv16 w1": Variant(False, 16, 1, FOLD_AND_STORE),
        "gluon mma bv32 w1": Variant(True, 32, 1, FOLD_AND_STORE),
        "gluon mma bv16 w1": Variant(True, 16, 1, FOLD_AND_STORE),
        "gluon mma bv32 w2": Variant(True, 32, 2, FOLD_AND_STORE),
        "gluon mma bv64 w4": Variant(True, 64, 4, FOLD_AND_STORE),
        "gluon mma via blocked bv32 w1": Variant(True, 32, 1, FOLD_AND_STORE, "blocked"),
        "gluon mma via blocked bv32 w2": Variant(True, 32, 2, FOLD_AND_STORE, "blocked"),
        "gluon mma via blocked bv16 w1": Variant(True, 16, 1, FOLD_AND_STORE, "blocked"),
        "store only: triton bv32 w1": Variant(False, 32, 1, STORE_ONLY),
        "store only: gluon mma bv32 w1": Variant(True, 32, 1, STORE_ONLY),
        "store only: gluon via blocked bv32 w1": Variant(True, 32, 1, STORE_ONLY, "blocked"),
    }),
    "gdn-readouts": ("qwen3.5", 8, {
        "triton bv16 w1": Variant(False, 16, 1, READOUTS_ONLY),
        "triton bv32 w1": Variant(False, 32, 1, READOUTS_ONLY),
        "gluon mma bv16 w1": Variant(True, 16, 1, READOUTS_ONLY),
        "gluon mma bv32 w1": Variant(True, 32, 1, READOUTS_ONLY),
        "gluon mma bv32 w2": Variant(True, 32, 2, READOUTS_ONLY),
        "gluon mma bv64 w4": Variant(True, 64, 4, READOUTS_ONLY),
        "gluon blocked bv16 w1, 16 row lanes": Variant(True, 16, 1, READOUTS_ONLY, "blocked-only", 16),
        "gluon blocked bv32 w1, 16 row lanes": Variant(True, 32, 1, READOUTS_ONLY, "blocked-only", 16),
        "gluon blocked bv32 w1, 8 row lanes": Variant(True, 32, 1, READOUTS_ONLY, "blocked-only", 8),
        "gluon blocked bv32 w2, 16 row lanes": Variant(True, 32, 2, READOUTS_ONLY, "blocked-only", 16),
    }),
    "gdn-flush": ("qwen3.5", 8, {
        "triton loop bv16 w1": Variant(False, 16, 1, FOLD_AND_STORE),
        "gluon mma bv16 w1": Variant(True, 16, 1, FOLD_AND_STORE),
        "gluon mma bv32 w2": Variant(True, 32, 2, FOLD_AND_STORE),
        "gluon mma via blocked bv32 w1": Variant(True, 32, 1, FOLD_AND_STORE, "blocked"),
        "gluon mma via blocked bv32 w2": Variant(True, 32, 2, FOLD_AND_STORE, "blocked"),
        "store only: triton bv16 w1": Variant(False, 16, 1, STORE_ONLY),
    }),
}


def make_layer(dims: Dims, batch: int, entries: int, readouts: int, device) -> dict[str, torch.Tensor]:
    """One layer's random inputs (never zeros) and output buffer, shapes as _triton_tile's docstring."""
    gen = torch.Generator(device=device).manual_seed(batch * 7 + entries)

    def normal(*shape, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device=device) * 0.5).to(dtype)

    return dict(
        ckpt=normal(batch, dims.heads, dims.value_dim, dims.key_dim),
        ring_x=normal(batch, entries, dims.heads, dims.value_dim, dtype=torch.bfloat16),
        ring_b=normal(batch, entries, dims.groups, dims.key_dim, dtype=torch.bfloat16),
        ring_w=torch.rand(batch, dims.heads, entries, generator=gen, device=device) * 0.5 + 0.05,
        decay=torch.rand(batch, dims.heads, generator=gen, device=device) * 0.5 + 0.5,
        q=normal(batch, dims.groups, readouts, dims.key_dim, dtype=torch.bfloat16),
        y=torch.empty(batch, dims.heads, readouts, dims.value_dim, device=device),
    )


def launch(dims: Dims, variant: Variant, layer: dict, batch: int, entries: int, readouts: int) -> None:
    args = [layer[name] for name in ("ckpt", "ring_x", "ring_b", "ring_w", "decay", "q", "y")]
    sizes = dict(H=dims.heads, G=dims.groups, V=dims.value_dim, K=dims.key_dim, R=entries, NQ=readouts,
                 BLOCK_V=variant.block_v, MODE=variant.mode)
    grid = (dims.value_dim // variant.block_v, dims.heads, batch)
    if variant.gluon:
        _gluon_tile[grid](*args, **sizes, WARPS=variant.warps, MEMORY=MEMORY[variant.memory], ROWS=variant.rows,
                          num_warps=variant.warps)
    else:
        _triton_tile[grid](*args, **sizes, num_warps=variant.warps)


def reference(dims: Dims, layer: dict, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after the step and the readouts, in float64."""
    heads_per_group = dims.heads // dims.groups
    state = layer["ckpt"].double()
    if mode == FOLD_AND_STORE:
        values = layer["ring_x"].double() * layer["ring_w"].double().permute(0, 2, 1)[..., None]
        keys = layer["ring_b"].double().repeat_interleave(heads_per_group, dim=2)
        state = state * layer["decay"].double()[..., None, None] + torch.einsum("brhv,brhk->bhvk", values, keys)
    queries = layer["q"].double().repeat_interleave(heads_per_group, dim=1)
    return state, torch.einsum("bhvk,bhtk->bhtv", state, queries)


def offline(names: list[str], entries: int) -> None:
    """Compile every variant for sm_90 through replaygen's stand-in driver; print registers and SASS counts."""
    from replaygen.offline import _Recorder, _use_stand_in, architecture

    recorder = _Recorder()
    _use_stand_in(architecture("sm_90"), recorder)
    for experiment in names:
        shape, readouts, variants = EXPERIMENTS[experiment]
        layer = make_layer(SHAPES[shape], 2, entries, readouts, "cpu")
        for name, variant in variants.items():
            recorder.call = f"{experiment}: {name}"
            launch(SHAPES[shape], variant, layer, 2, entries, readouts)
    for _name, _metadata, binary, calls in recorder.kernels.values():
        print(f"{', '.join(calls)}: {binary.registers} registers, {binary.local_bytes} B local, "
              f"{binary.instructions} SASS, {binary.shuffles} SHFL")


def shipped_checkpoint_half(module_name: str, batch: int, layers: int, device) -> dict:
    """Per case (8 entries per row: no flush; 24: every row flushing at a window of 4 and capacity 28), a function
    that sets every row's entry count of `layers` random replay states of `batch` rows and returns the call that
    launches the module's checkpoint half on each (to capture; the checkpoint half never moves the cursor)."""
    module = importlib.import_module(module_name)
    tokens = module.SHAPE["window"]
    config = module._pick(module._REPLAY_VERIFY_CONFIGS, batch)
    print(f"shipped b{batch}: {config}")
    states = random_replay_states(module, layers, batch, torch.bfloat16, device)
    shape = module.SHAPE
    key_heads, value_heads, value_dim, key_dim = shape["key_heads"], shape["heads"], shape["value_dim"], shape["key_dim"]
    slots = torch.randperm(batch, device=device).to(torch.int32)

    def rows(*sizes):
        return torch.randn(batch, tokens, *sizes, device=device).to(torch.bfloat16)

    v, k, q, a, b = rows(value_heads, value_dim), rows(key_heads, key_dim), rows(key_heads, key_dim), rows(value_heads), rows(value_heads)
    A_log, dt_bias = torch.rand(value_heads, device=device), torch.rand(value_heads, device=device)
    out = torch.empty(batch, tokens, value_heads, value_dim, device=device, dtype=torch.bfloat16)
    readouts = torch.empty((batch, value_heads, 2, module._block_t(tokens)[0], value_dim), dtype=torch.float32, device=device)

    def run():
        for state in states:
            module._launch_verify(state, slots, v, k, q, a, None, b, None, A_log, dt_bias, out, readouts, tokens,
                                  config, 1, config["block_v"], False)

    def entries(count: int):
        def launches():
            set_entry_counts(states, torch.full((batch,), count, dtype=torch.int32, device=device))
            return run
        return launches

    return {"shipped checkpoint half, no flush (8 entries)": entries(8),
            "shipped checkpoint half, every row flushing (24 entries)": entries(24)}


def state_bytes(dims: Dims, batch: int) -> int:
    return batch * dims.heads * dims.value_dim * dims.key_dim * 4


def cold_layer_count(dims: Dims, batch: int, device) -> int:
    """Layers of `batch` fp32 states that together exceed 4x the L2 (at least 2), as `measure.cold_layers` counts."""
    return max(2, -(-4 * l2_bytes(device) // state_bytes(dims, batch)))


def timed_rounds(cases: dict, layers: int) -> dict[str, list[float]]:
    """Three rounds over `cases` (name: a function that prepares the inputs and returns the launches of one step over
    every layer), each case captured in a CUDA graph and timed in every round: ms per layer, one median per round."""
    rounds: dict[str, list[float]] = {}
    for _ in range(3):
        for name, prepare in cases.items():
            graph = capture(prepare())
            rounds.setdefault(name, []).append(time_callable(graph.replay, repeats=20, per_call=layers).median_ms)
            del graph
    return rounds


def on_gpu(names: list[str], batches: list[int], entries: int, shipped: str | None) -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy {copy / 1e12:.3f} TB/s, {entries} ring entries", flush=True)
    for batch in batches if shipped else []:
        layers = cold_layer_count(SHAPES["qwen3.5"], batch, device)
        rounds = timed_rounds(shipped_checkpoint_half(shipped, batch, layers, device), layers)
        for name, times in rounds.items():
            print(f"b{batch} {name}: {min(times) * 1e3:.1f} us ({', '.join(f'{t * 1e3:.1f}' for t in times)})", flush=True)
    for experiment in names:
        shape, readouts, variants = EXPERIMENTS[experiment]
        dims = SHAPES[shape]
        for batch in batches:
            inputs = make_layer(dims, batch, entries, readouts, device)
            for name, variant in variants.items():
                layer = {key: value.clone() for key, value in inputs.items()}
                launch(dims, variant, layer, batch, entries, readouts)
                want_state, want_y = reference(dims, inputs, variant.mode)
                state_err = ((layer["ckpt"].double() - want_state).abs().max() / want_state.abs().max()).item()
                y_err = ((layer["y"].double() - want_y).abs().max() / want_y.abs().max()).item()
                print(f"  check {experiment} b{batch} {name}: state rel err {state_err:.2e}, readouts {y_err:.2e}")
            del inputs, layer
            layers = cold_layer_count(dims, batch, device)
            data = [make_layer(dims, batch, entries, readouts, device) for _ in range(layers)]

            def step_of(variant: Variant):
                return lambda: lambda: [launch(dims, variant, layer, batch, entries, readouts) for layer in data]

            rounds = timed_rounds({name: step_of(variant) for name, variant in variants.items()}, layers)
            for name, times in rounds.items():
                mode = variants[name].mode
                moved = (state_bytes(dims, batch) * (1 if mode == READOUTS_ONLY else 2) + batch * dims.heads * readouts * dims.value_dim * 4
                         + (batch * entries * dims.heads * dims.value_dim * 2 if mode == FOLD_AND_STORE else 0))
                best = min(times)
                print(f"{experiment} b{batch} {name}: {best * 1e3:.1f} us ({', '.join(f'{t * 1e3:.1f}' for t in times)}), "
                      f"{moved / (best * 1e-3) / copy * 100:.1f}% of copy", flush=True)
            data.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 without a GPU")
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS))
    parser.add_argument("--batch", default="32,256")
    parser.add_argument("--entries", type=int, default=16, help="ring entries folded (R, a power of two)")
    parser.add_argument("--shipped", help="a generated GDN speculative module whose checkpoint half to time beside")
    args = parser.parse_args()
    names = args.experiments.split(",")
    if args.offline:
        offline(names, args.entries)
    else:
        on_gpu(names, [int(b) for b in args.batch.split(",")], args.entries, args.shipped)


if __name__ == "__main__":
    main()
