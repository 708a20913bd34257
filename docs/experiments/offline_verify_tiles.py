"""Replay verify's key-tiled structures compiled offline for sm_90 (no GPU): registers, local memory, shared memory,
SASS instructions and shuffles of each kernel, beside the documented large-batch default, at qwen3.5-mtp and
nemotron-h-mtp (or the shape named) with bf16 activations (`replaygen.offline`; perf.md 73, 77, 80). With --public,
the vLLM ReplaySSM PR's GDN verify kernel too (its verify and flush specializations at qwen3.5's sizes, history 16,
T=4, its own launch config), compiled by Triton for sm_90 from the PR's file.

    python docs/experiments/offline_verify_tiles.py [--spec kda --shape kimi-linear-mtp] [--public DIR]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from replaygen.configs import KernelKind, module_defaults, replay_verify_structures, spec_traits
from replaygen.keys import candidate_tables
from replaygen.offline import architecture, compile_job, compile_modules, cubin_stats
from replaygen.paths import spec_file
from replaygen.spec import load_spec


def variants(spec, shape):
    """The configs compiled per shape, by name (the output-only ones where the spec's structures have that route)."""
    tiled, tiled_readouts, *output_only = replay_verify_structures(shape, spec_traits(spec, shape))
    configs = {
        "default above b8": module_defaults(spec, shape)[KernelKind.REPLAY_VERIFY][-1].config,
        "key tiles, state route": tiled,
        "key tiles, state route, readout product": replace(tiled, readout_dot=True),
        "key tiles, state route, readout product in the buffers' dtype": tiled_readouts,
        "key tiles, state route, bv32": replace(tiled, block_v=32),
    }
    if output_only:
        scored, in_loop, flush_launch = output_only
        configs["key tiles, output-only"] = scored
        configs["key tiles, output-only, readout product"] = replace(scored, readout_dot=True)
        configs["key tiles, output-only, bv32 bk32"] = replace(scored, block_v=32, block_k=32)
        configs["key tiles, output-only, entries scored in the key loop, products in the buffers' dtype"] = in_loop
        configs["the same, fold by loop"] = replace(in_loop, fold_dot=False, fold_precision="tf32x3")
        configs["the same, the flushing rows in a second launch (the PR's structure)"] = flush_launch
    return configs


def public_gdn_verify(folder: Path) -> None:
    """Compile the PR's GDN verify kernel (IS_FLUSH off and on) for sm_90 and print its registers, shared memory, SASS
    instructions and shuffles; qwen3.5's sizes (H=16, HV=32, K=V=128), bf16 activations, fp32 state, ring of 32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).parent))
    from vs_vllm_replayssm import _load_public

    kernel = _load_public(folder, "gdn", "verify").gdn_replayssm_spec_circular_kernel
    pointers = {"mixed_qkv": "*bf16", "a": "*bf16", "b": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "o": "*bf16", "h0": "*fp32", "ht": "*fp32",
                "d_cache": "*bf16", "k_cache": "*bf16", "g_cache": "*fp32", "query_start_loc": "*i32", "ssm_state_indices": "*i32", "write_pos": "*i32",
                "cache_base": "*i32", "is_flush_flags": "*i8", "scale": "fp32"}
    heads, value_heads, dim, ring = 16, 32, 128, 32
    block_v, warps, key_tiles, stages = 64, 1, 2, 2  # the PR's _gdn_spec config at T=4
    print("vLLM ReplaySSM PR, gdn_replayssm_spec_circular_kernel (qwen3.5 sizes, history 16, T=4)")
    print(f"  {'kernel':<24} warps stages  regs  smem B   SASS  SHFL")
    for flush in (False, True):
        constants = dict(
            stride_mqkv_t=2 * heads * dim + value_heads * dim, stride_a_t=value_heads, stride_b_t=value_heads, stride_o_t=value_heads * dim,
            stride_state_slot=value_heads * dim * dim, stride_d_slot=value_heads * ring * dim, stride_k_slot=heads * ring * dim, stride_g_slot=value_heads * ring,
            stride_qsl=1, stride_indices=1, H=heads, HV=value_heads, K=dim, V=dim, BK=dim, BV=block_v, BS=4, BC=16, NK=key_tiles, BKT=dim // key_tiles,
            MAX_CACHE_LEN=ring, SOFTPLUS_THRESHOLD=20.0, USE_QK_L2NORM_IN_KERNEL=True, IS_FLUSH=flush, NULL_BLOCK_ID=0,
        )
        names = kernel.arg_names
        source = ASTSource(fn=kernel, signature={n: pointers.get(n, "constexpr") for n in names}, constexprs={(names.index(n),): v for n, v in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        stats = cubin_stats(compiled.asm["cubin"], "gdn_replayssm_spec_circular_kernel")
        label = "flush (IS_FLUSH)" if flush else "verify"
        print(f"  {label:<24} {warps:>5} {stages:>6} {stats.registers:>5} {compiled.metadata.shared:>7} {stats.instructions:>6} {stats.shuffles:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="one spec (with --shape) instead of gdn qwen3.5-mtp and mamba2 nemotron-h-mtp")
    parser.add_argument("--shape")
    parser.add_argument("--public", type=Path, help="folder with the vLLM ReplaySSM PR's kernel files: compile its GDN verify too")
    args = parser.parse_args()
    if args.public:
        public_gdn_verify(args.public)
    targets = ((args.spec, args.shape),) if args.spec else (("gdn", "qwen3.5-mtp"), ("mamba2", "nemotron-h-mtp"))
    jobs, names = [], []
    for spec_name, shape_name in targets:
        spec = load_spec(spec_file(spec_name))
        shape = spec.shape(shape_name)
        for name, config in variants(spec, shape).items():
            tables = candidate_tables(spec, shape, KernelKind.REPLAY_VERIFY, config)
            jobs.append(compile_job(spec, shape, tables, architecture("sm_90"), "bfloat16", kinds=(KernelKind.REPLAY_VERIFY,)))
            names.append(f"{shape_name}, {name}")
    for name, report in zip(names, compile_modules(jobs)):
        print(name)
        print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
