"""Replay verify's key-tiled structures compiled offline for sm_90 (no GPU): registers, local memory, shared memory,
SASS instructions and shuffles of each kernel, beside the documented large-batch default, at qwen3.5-mtp and
nemotron-h-mtp (or the shape named) with bf16 activations (`replaygen.offline`; perf.md 73, 77, 80).

    python docs/experiments/offline_verify_tiles.py [--spec kda --shape kimi-linear-mtp]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from replaygen.configs import KernelKind, module_defaults, replay_verify_structures, spec_traits
from replaygen.keys import candidate_tables
from replaygen.offline import architecture, compile_job, compile_modules
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
        scored, in_loop = output_only
        configs["key tiles, output-only"] = scored
        configs["key tiles, output-only, readout product"] = replace(scored, readout_dot=True)
        configs["key tiles, output-only, bv32 bk32"] = replace(scored, block_v=32, block_k=32)
        configs["key tiles, output-only, entries scored in the key loop, products in the buffers' dtype"] = in_loop
        configs["the same, fold by loop"] = replace(in_loop, fold_dot=False, fold_precision="tf32x3")
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="one spec (with --shape) instead of gdn qwen3.5-mtp and mamba2 nemotron-h-mtp")
    parser.add_argument("--shape")
    args = parser.parse_args()
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
