"""Replay verify's key-tiled structures compiled offline for sm_90 (no GPU): registers, local memory, shared memory,
SASS instructions and shuffles of each kernel, beside the documented large-batch default, at qwen3.5-mtp and
nemotron-h-mtp with bf16 activations (`replaygen.offline`; perf.md 73).

    python docs/experiments/offline_verify_tiles.py
"""

from __future__ import annotations

from dataclasses import replace

from replaygen.configs import BucketConfig, KernelKind, module_defaults, replay_verify_structures, spec_traits
from replaygen.offline import architecture, compile_job, compile_modules
from replaygen.paths import spec_file
from replaygen.spec import load_spec


def variants(spec, shape):
    """The configs compiled per shape, by name."""
    tiled, tiled_readouts, output_only = replay_verify_structures(shape, spec_traits(spec, shape))
    return {
        "default above b8": module_defaults(spec, shape)[KernelKind.REPLAY_VERIFY][-1].config,
        "key tiles, state route": tiled,
        "key tiles, output-only": output_only,
        "key tiles, state route, readout product": replace(tiled, readout_dot=True),
        "key tiles, state route, readout product in the buffers' dtype": tiled_readouts,
        "key tiles, output-only, readout product": replace(output_only, readout_dot=True),
        "key tiles, state route, bv32": replace(tiled, block_v=32),
        "key tiles, output-only, bv32 bk32": replace(output_only, block_v=32, block_k=32),
    }


def main() -> None:
    jobs, names = [], []
    for spec_name, shape_name in (("gdn", "qwen3.5-mtp"), ("mamba2", "nemotron-h-mtp")):
        spec = load_spec(spec_file(spec_name))
        shape = spec.shape(shape_name)
        for name, config in variants(spec, shape).items():
            tables = {**module_defaults(spec, shape), KernelKind.REPLAY_VERIFY: (BucketConfig(None, config),)}
            jobs.append(compile_job(spec, shape, tables, architecture("sm_90"), "bfloat16", kinds=(KernelKind.REPLAY_VERIFY,)))
            names.append(f"{shape_name}, {name}")
    for name, report in zip(names, compile_modules(jobs)):
        print(name)
        print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
