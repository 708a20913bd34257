"""GDN decode's two checkpoint readouts in Triton's default tile layout and in key chunks (GPU; docs/perf.md entry 65).

The output-only route of a GDN decode step reads its checkpoint tile at the normalized key and query,
S k^ and S q^ ([BLOCK_V] each). Loaded as one [BLOCK_V, K] fp32 tile, Triton puts the lanes along the contiguous
key axis, so each readout reduces across 32 lanes (330 SHFL in a one-warp bv32 program, offline sm_90). Loaded as
K / 16 separate [BLOCK_V, 16] chunks, all issued before any arithmetic and summed element-wise before one
reduction, the lanes go 8 across value rows by 4 across keys: 4-lane reductions, 20 SHFL and half the instructions
(`--offline`). The question is whether those shuffles are on the decode's critical path: entry 31 left about 8% of
the shipped GDN decode's time at batch 256 unexplained and entry 61's explicit layouts targeted the verify's eight
readouts, not the decode's two.

Kernels here read one state [batch, HV, V, K] fp32 per layer at two bf16 vectors per key head (HV / H = 2), l2-norm
them, and write both readouts; no slots, cursor or ring. Each is checked against float64, then timed: cold layers
(past 4x L2), one CUDA graph over the layers, best of three medians; % of the 1 GiB copy for the state bytes read.
Beside them, in the same process, the shipped GDN `qwen3.5` replay decode (records of `--gpu`) over whole flush
cycles and never flushing (speed_of_light.py's measure), the anchor for what the readouts leave to the rest of the
step.

    python docs/experiments/readout_layouts.py --offline        # sm_90 registers and SASS, no GPU needed
    python docs/experiments/readout_layouts.py --batch 32,128,256,512 --gpu h200
"""

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

HEADS, KEY_HEADS, VALUE_DIM, KEY_DIM = 32, 16, 128, 128  # qwen3.5: two value heads per key head
KEY_CHUNK = 16


@triton.jit
def _tile_readouts(ckpt, k, q, out, K: tl.constexpr, V: tl.constexpr, H: tl.constexpr, BLOCK_V: tl.constexpr,
                   BOTH: tl.constexpr):
    """ckpt [B, H, V, K] fp32 read as one [BLOCK_V, K] tile; k, q [B, H / 2, K] bf16; out [B, H, 2, V] fp32
    (the query readout only with BOTH)."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    o_k = tl.arange(0, K)
    b_s = tl.load(ckpt + ((i_b * H + i_h) * V + o_v[:, None]) * K + o_k[None, :], eviction_policy="evict_first")
    b_k = tl.load(k + (i_b * (H // 2) + i_h // 2) * K + o_k).to(tl.float32)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    tl.store(out + ((i_b * H + i_h) * 2) * V + o_v, tl.sum(b_s * b_k[None, :], 1))
    if BOTH:
        b_q = tl.load(q + (i_b * (H // 2) + i_h // 2) * K + o_k).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        tl.store(out + ((i_b * H + i_h) * 2 + 1) * V + o_v, tl.sum(b_s * b_q[None, :], 1))


@triton.jit
def _chunked_readouts(ckpt, k, q, out, K: tl.constexpr, V: tl.constexpr, H: tl.constexpr, BLOCK_V: tl.constexpr,
                      KC: tl.constexpr, BOTH: tl.constexpr):
    """As _tile_readouts, the tile read as K / KC [BLOCK_V, KC] chunks (unrolled; only element-wise products
    between the loads), the key and query loaded per chunk in the chunk's layout, one reduction per readout."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    o_c = tl.arange(0, KC)
    p_s = ckpt + ((i_b * H + i_h) * V + o_v[:, None]) * K + o_c[None, :]
    p_k = k + (i_b * (H // 2) + i_h // 2) * K + o_c[None, :]
    p_q = q + (i_b * (H // 2) + i_h // 2) * K + o_c[None, :]
    b_pk = tl.zeros([BLOCK_V, KC], tl.float32)
    b_pq = tl.zeros([BLOCK_V, KC], tl.float32)
    b_nk = tl.zeros([1, KC], tl.float32)
    b_nq = tl.zeros([1, KC], tl.float32)
    for c in tl.static_range(K // KC):
        b_s = tl.load(p_s + c * KC, eviction_policy="evict_first")
        b_k = tl.load(p_k + c * KC).to(tl.float32)
        b_nk += b_k * b_k
        b_pk += b_s * b_k
        if BOTH:
            b_q = tl.load(p_q + c * KC).to(tl.float32)
            b_nq += b_q * b_q
            b_pq += b_s * b_q
    tl.store(out + ((i_b * H + i_h) * 2) * V + o_v, tl.sum(b_pk, 1) / tl.sqrt(tl.sum(b_nk, 1) + 1e-6))
    if BOTH:
        tl.store(out + ((i_b * H + i_h) * 2 + 1) * V + o_v, tl.sum(b_pq, 1) / tl.sqrt(tl.sum(b_nq, 1) + 1e-6))


@dataclass(frozen=True)
class Variant:
    chunked: bool
    block_v: int
    warps: int
    both: bool = True  # both readouts (k and q); False: the key readout only

    @property
    def name(self) -> str:
        return f"{'key chunks' if self.chunked else 'one tile'} bv{self.block_v} w{self.warps}{'' if self.both else ', k only'}"


VARIANTS = (
    Variant(False, 16, 1), Variant(False, 32, 1),
    Variant(True, 16, 1), Variant(True, 16, 2), Variant(True, 32, 1), Variant(True, 32, 2), Variant(True, 64, 1),
    Variant(True, 64, 2), Variant(False, 16, 1, both=False), Variant(True, 32, 1, both=False),
)


def launch(variant: Variant, ckpt: torch.Tensor, k: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    grid = (VALUE_DIM // variant.block_v, HEADS, ckpt.shape[0])
    dims = dict(K=KEY_DIM, V=VALUE_DIM, H=HEADS, BLOCK_V=variant.block_v, BOTH=variant.both, num_warps=variant.warps)
    if variant.chunked:
        _chunked_readouts[grid](ckpt, k, q, out, KC=KEY_CHUNK, **dims)
    else:
        _tile_readouts[grid](ckpt, k, q, out, **dims)


def reference(ckpt: torch.Tensor, k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float64 readouts [B, H, 2, V]."""
    def normed(x):
        x = x.double()
        return (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(HEADS // KEY_HEADS, dim=1)

    state = ckpt.double()
    return torch.stack([torch.einsum("bhvk,bhk->bhv", state, normed(k)), torch.einsum("bhvk,bhk->bhv", state, normed(q))], 2)


def offline() -> None:
    """Compile every variant for sm_90 through replaygen's stand-in driver; print registers and SASS counts."""
    from replaygen.offline import _Recorder, _use_stand_in, architecture

    recorder = _Recorder()
    _use_stand_in(architecture("sm_90"), recorder)
    ckpt = torch.randn(2, HEADS, VALUE_DIM, KEY_DIM)
    k, q = (torch.randn(2, KEY_HEADS, KEY_DIM).to(torch.bfloat16) for _ in range(2))
    out = torch.empty(2, HEADS, 2, VALUE_DIM)
    for variant in VARIANTS:
        recorder.call = variant.name
        launch(variant, ckpt, k, q, out)
    for _name, _metadata, binary, calls in recorder.kernels.values():
        print(f"{', '.join(calls)}: {binary.registers} registers, {binary.instructions} SASS, {binary.shuffles} SHFL")


def time_variants(batch: int, copy: float, device: torch.device) -> None:
    from replaygen.measure import capture, l2_bytes, time_callable

    per_layer = batch * HEADS * VALUE_DIM * KEY_DIM * 4
    layers = max(2, math.ceil(4 * l2_bytes(device) / per_layer))
    gen = torch.Generator(device=device).manual_seed(batch)
    ckpts = [torch.randn(batch, HEADS, VALUE_DIM, KEY_DIM, device=device, generator=gen) for _ in range(layers)]
    k, q = (torch.randn(batch, KEY_HEADS, KEY_DIM, device=device, generator=gen).to(torch.bfloat16) for _ in range(2))
    out = torch.empty(batch, HEADS, 2, VALUE_DIM, device=device)
    expected = reference(ckpts[-1], k, q)
    for variant in VARIANTS:
        out.fill_(float("nan"))
        launch(variant, ckpts[-1], k, q, out)
        readouts = slice(None) if variant.both else slice(0, 1)
        got, want = out[:, :, readouts].double(), expected[:, :, readouts]
        error = ((got - want).norm() / want.norm()).item()
        if not error < 1e-5:
            raise SystemExit(f"b{batch} {variant.name}: relative error {error:.1e} against float64")

        def run(variant=variant):
            for ckpt in ckpts:
                launch(variant, ckpt, k, q, out)

        graph = capture(run)
        us = min(time_callable(graph.replay, repeats=30, per_call=layers).median_ms for _ in range(3)) * 1e3
        print(f"b{batch} {variant.name:22s} {us:8.2f} us  {per_layer / (us * 1e-6) / copy * 100:6.1f}% of copy  (error {error:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 without a GPU")
    parser.add_argument("--batch", default="32,256", help="comma-separated batch sizes")
    parser.add_argument("--gpu", default="h100", help="whose tuning records pick the shipped decode configs")
    args = parser.parse_args()
    if args.offline:
        offline()
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from speed_of_light import replay_times

    from replaygen.configs import KernelKind, bucket_config
    from replaygen.measure import copy_bandwidth
    from replaygen.spec import load_spec
    from replaygen.tune.apply import resolve_configs

    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy {copy / 1e12:.3f} TB/s")
    spec = load_spec(Path("specs/gdn.yaml"))
    shape = spec.shape("qwen3.5")
    tables = resolve_configs(spec, shape, args.gpu, Path("tune")).configs
    for batch in (int(b) for b in args.batch.split(",")):
        time_variants(batch, copy, device)
        config = bucket_config(tables[KernelKind.REPLAY_DECODE], batch)
        cycle, never_flushing = replay_times(spec, shape, tables, batch, args.gpu, device)
        print(f"b{batch} shipped replay decode (bv{config.block_v} w{config.num_warps}): {cycle:.1f} us per step over"
              f" whole cycles, {never_flushing:.1f} never flushing")


if __name__ == "__main__":
    main()
