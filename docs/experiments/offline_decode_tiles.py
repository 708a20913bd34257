"""Replay decode's structures compiled offline for sm_90 (no GPU): registers, local memory, shared memory, SASS
instructions and shuffles of each kernel, beside the documented large-batch default, at Kimi Linear's sizes with
bf16 activations (`replaygen.offline`; perf.md 76).

    python docs/experiments/offline_decode_tiles.py [--spec kda --shape kimi-linear]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from replaygen.configs import KernelKind, module_defaults, replay_decode_structures, spec_traits
from replaygen.keys import candidate_tables
from replaygen.offline import architecture, compile_job, compile_modules
from replaygen.paths import spec_file
from replaygen.spec import load_spec


def variants(spec, shape):
    """The configs compiled, by name: the default above b8, each structure a search starts from, and the key-tiled
    structures' other fold precisions and widths."""
    structures = replay_decode_structures(shape, spec_traits(spec, shape))
    named = {"default above b8": module_defaults(spec, shape)[KernelKind.REPLAY_DECODE][-1].config}
    for config in structures:
        label = f"{config.route.value}, block_k={config.block_k}, bv{config.block_v}, {config.num_warps} warp(s), fold {config.fold_precision if config.fold_dot else 'loop'}"
        named[label] = replace(config, flush_at=config.flush_at or shape.capacity)
    tiled = structures[0]
    if tiled.block_k:
        named["key tiles, fold tf32x3"] = replace(tiled, fold_precision="tf32x3", flush_at=shape.capacity)
        named["key tiles, bv32"] = replace(tiled, block_v=32, flush_at=shape.capacity)
        named["key tiles, bk32"] = replace(tiled, block_k=32, flush_at=shape.capacity)
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="kda")
    parser.add_argument("--shape", default="kimi-linear")
    args = parser.parse_args()
    spec = load_spec(spec_file(args.spec))
    shape = spec.shape(args.shape)
    jobs, names = [], []
    for name, config in variants(spec, shape).items():
        tables = candidate_tables(spec, shape, KernelKind.REPLAY_DECODE, config)
        jobs.append(compile_job(spec, shape, tables, architecture("sm_90"), "bfloat16", kinds=(KernelKind.REPLAY_DECODE,)))
        names.append(f"{args.shape}, {name}")
    for name, report in zip(names, compile_modules(jobs)):
        print(name)
        print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
