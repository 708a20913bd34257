"""Replay decode side by side with the public vLLM ReplaySSM PR kernels, on one GPU, in one process, same inputs.

The PR's kernels (github.com/Johnny-Liou/ReplaySSM: `fused_recurrent_replayssm.py` for Gated DeltaNet,
`selective_state_update_replayssm_output_only.py` for Mamba-2, and `replayssm_config.py`) are read from --public,
a folder holding those three files; they are not part of this project. Each kernel gets its own layer states
(enough to exceed 4x L2, as `replaygen.measure` keeps them), random inputs (the same for every kernel), one CUDA
graph per timing over whole flush cycles of L steps, medians of 30 graph replays. The PR's ring position is a
per-row input its engine advances between steps: here step i of the cycle reads a tensor prepared for it, so
the graph holds the PR's kernels alone. Every row flushing on the same step ("together") and rows staggered
over the cycle ("staggered") are timed for every kernel. replaygen's rows: the module shipped for --gpu, and
each config of --configs (JSON: {spec: {name: {knob: value}}}, run at every batch size; a name may map to a
module file instead, relative to the project, e.g. an older build of the same shape).

    python docs/experiments/vs_vllm_replayssm.py --public DIR --gpu h200 --configs FILE --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

from replaygen.configs import BucketConfig, KernelConfig, KernelKind
from replaygen.harness import InputFactory, check_decode
from replaygen.measure import DecodeWorkload, capture, cold_layers, copy_bandwidth, time_callable
from replaygen.runtime import import_path, load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import DType
from replaygen.traffic import replay_decode_bytes

ROOT = Path(__file__).resolve().parents[2]


@triton.jit
def _softplus(x):
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


def _load_public(folder: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """The PR's GDN decode and Mamba-2 output-only decode modules, with stand-ins for the vLLM names they import."""

    def module(name: str, **attrs: object) -> types.ModuleType:
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__dict__.update(attrs)
        return mod

    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba", "vllm.model_executor.layers.mamba.ops", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        module(name)
    module("vllm.triton_utils", tl=tl, triton=triton)
    module("vllm.platforms", current_platform=types.SimpleNamespace(is_device_capability_family=lambda family: False))
    module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0)
    module("vllm.model_executor.layers.mamba.ops.mamba_ssm", softplus=_softplus)

    def load(name: str, file: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, folder / file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    load("vllm.model_executor.layers.mamba.ops.replayssm_config", "replayssm_config.py")
    gdn = load("public_gdn_decode", "fused_recurrent_replayssm.py")
    mamba2 = load("public_mamba2_decode", "selective_state_update_replayssm_output_only.py")
    return gdn, mamba2


class PublicGdnDecode:
    """The PR's GDN decode on its own layer states: checkpoint [slots, HV, V, K] fp32, rings d [slots, HV, L, V],
    k [slots, H, L, K] (activation dtype), g [slots, HV, L] fp32; slot 0 is the PR's null block, rows use 1..batch."""

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, shape, batch: int, act: torch.dtype, device):
        hv, h, v, k, cap = shape.heads, shape.key_heads, shape.value_dim, shape.key_dim, shape.capacity
        self.fn, self.cap, self.batch = public.fused_recurrent_gated_delta_rule_replayssm, cap, batch
        self.weights = weights
        self.inputs = [
            (torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], 1).contiguous(), x["a"].contiguous(), x["b"].contiguous()) for x in inputs
        ]
        self.layers = []
        for _ in inputs:
            state = torch.randn(batch + 1, hv, v, k, device=device) * 0.5
            d = (torch.randn(batch + 1, hv, cap, v, device=device) * 0.5).to(act)
            kc = (torch.randn(batch + 1, h, cap, k, device=device) * 0.5).to(act)
            g = -torch.rand(batch + 1, hv, cap, device=device) * 0.99 - 0.01
            self.layers.append((state, d, kc, g, torch.empty(batch, hv, v, device=device, dtype=act)))
        self.slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
        self.scale = k**-0.5

    def positions(self, together: bool) -> list[torch.Tensor]:
        """The ring position of every row at each of the cycle's L steps (the PR flushes at position L - 1)."""
        rows = torch.arange(self.batch, device=self.slots.device)
        start = rows * 0 if together else rows % self.cap
        return [((start + i) % self.cap).to(torch.int32) for i in range(self.cap)]

    def step(self, position: torch.Tensor) -> None:
        for (mixed, a, b), (state, d, kc, g, out) in zip(self.inputs, self.layers):
            self.fn(mixed, a, b, self.weights["A_log"], self.weights["dt_bias"], self.scale, state, d, kc, g, out, self.slots, position, use_qk_l2norm_in_kernel=True)


class PublicMamba2Decode:
    """The PR's Mamba-2 output-only decode on its own layer states: state [slots, H, P, N] fp32, rings x [slots, H,
    L, P], dt [slots, H, L], B [slots, G, L, N] (activation dtype), the scores scratch [batch, G, L] fp32; the flush
    flag per row is an input as the position is."""

    def __init__(self, public: types.ModuleType, inputs: list[dict], weights: dict, shape, batch: int, act: torch.dtype, device):
        hh, g, p, n, cap = shape.heads, shape.key_heads, shape.value_dim, shape.key_dim, shape.capacity
        self.fn, self.cap, self.batch = public.selective_state_update_replayssm_output_only, cap, batch
        self.A = (-torch.exp(weights["A_log"]))[:, None, None].expand(hh, p, n)
        self.dt_bias = weights["dt_bias"][:, None].expand(hh, p)
        self.D = weights["D"][:, None].expand(hh, p)
        self.inputs = [(x["x"], x["dt"].to(act)[:, :, None].expand(batch, hh, p), x["B"], x["C"]) for x in inputs]
        self.layers = []
        for _ in inputs:
            state = torch.randn(batch + 1, hh, p, n, device=device) * 0.5
            xc = (torch.randn(batch + 1, hh, cap, p, device=device) * 0.5).to(act)
            dtc = (torch.rand(batch + 1, hh, cap, device=device) * 0.1 + 0.01).to(act)
            bc = (torch.randn(batch + 1, g, cap, n, device=device) * 0.5).to(act)
            scratch = torch.empty(batch, g, cap, device=device)
            self.layers.append((state, xc, dtc, bc, scratch, torch.empty(batch, hh, p, device=device, dtype=act)))
        self.slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)

    def positions(self, together: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = torch.arange(self.batch, device=self.slots.device)
        start = rows * 0 if together else rows % self.cap
        out = []
        for i in range(self.cap):
            position = ((start + i) % self.cap).to(torch.int32)
            out.append((position, (position == self.cap - 1).to(torch.int8)))
        return out

    def step(self, position: tuple[torch.Tensor, torch.Tensor]) -> None:
        write_pos, is_flush = position
        for (x, dt, b, c), (state, xc, dtc, bc, scratch, out) in zip(self.inputs, self.layers):
            self.fn(
                state, x, dt, self.A, b, c, D=self.D, dt_bias=self.dt_bias, dt_softplus=True, x_cache=xc, dt_cache=dtc, B_cache=bc,
                bc_pre=scratch, write_pos=write_pos, is_flush=is_flush, max_cache_len=self.cap, state_batch_indices=self.slots, out=out,
            )


def time_public(kernel, together: bool, layers: int) -> float:
    positions = kernel.positions(together)

    def cycle() -> None:
        for position in positions:
            kernel.step(position)

    graph = capture(cycle)
    return time_callable(graph.replay, repeats=30, per_call=len(positions) * layers).median_ms


def run_family(args, spec_name: str, shape_name: str, public_cls, public_module, configs: dict[str, dict], device, bandwidth: float) -> list[dict]:
    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    shape = spec.shape(shape_name)
    act = torch.bfloat16
    shipped = import_path((args.generated or ROOT / "generated") / args.gpu / f"{spec.name}_{shape.ident}.py")
    shipped_table = tuple(BucketConfig(max_batch, KernelConfig.from_fields(knobs)) for max_batch, knobs in shipped._REPLAY_DECODE_CONFIGS)
    modules = {
        f"built for {args.gpu}": shipped,
        f"its {args.gpu} configs, this code": load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: shipped_table}),
    }
    for name, knobs in configs.items():
        if isinstance(knobs, str):
            modules[name] = import_path(ROOT / knobs)
        else:
            config = KernelConfig.from_fields(knobs)
            modules[name] = load_kernels(spec, shape, {KernelKind.REPLAY_DECODE: (BucketConfig(None, config),)})
    checks = {}
    for name, module in modules.items():
        report = check_decode(module, spec, shape, device=device, act_dtype=act, batch=4, cycles=2, use_gate=False, seed=3)
        checks[name] = "ok" if report.ok else "FAIL " + "; ".join(report.lines()[1:])
        print(f"check {spec_name}/{shape_name} {name}: {checks[name]}", flush=True)
    bytes_per_row = replay_decode_bytes(spec, shape, DType.BFLOAT16).total
    rows = []
    for batch in args.batch:
        layers = cold_layers(spec, shape, batch, device)
        work = {name: DecodeWorkload(module, spec, shape, batch, act, device, layers=layers) for name, module in modules.items()}
        first = next(iter(work.values()))
        public = public_cls(public_module, first.inputs, first.weights, shape, batch, act, device)
        for together in (True, False):
            timings = {"vLLM PR": time_public(public, together, layers)}
            for name, w in work.items():
                config = _bucket(w.module, batch)
                route, flush_at = config["route"], config["flush_at"] or shape.capacity
                timings[name] = w.time_replay(route, flush_at, together=together).median_ms
            baseline = first.time_baseline(shape.capacity).median_ms
            for name, ms in timings.items():
                rows.append({
                    "spec": spec_name, "shape": shape_name, "batch": batch, "flushes": "together" if together else "staggered",
                    "kernel": name, "us": ms * 1e3, "vs_public": timings["vLLM PR"] / ms, "vs_baseline": baseline / ms,
                    "copy_fraction": batch * bytes_per_row / (ms * 1e-3) / bandwidth, "check": checks.get(name, "theirs"),
                })
            rows.append({"spec": spec_name, "shape": shape_name, "batch": batch, "flushes": "together" if together else "staggered", "kernel": "replaygen baseline", "us": baseline * 1e3, "vs_public": timings["vLLM PR"] / baseline, "vs_baseline": 1.0, "copy_fraction": float("nan"), "check": "-"})
            for row in rows[-len(timings) - 1:]:
                print(f"{row['spec']:7s} b{row['batch']:<4d} {row['flushes']:9s} {row['kernel']:34s} {row['us']:9.2f} us  x{row['vs_public']:.3f} of PR  x{row['vs_baseline']:.3f} of baseline  {row['copy_fraction']:.1%} copy", flush=True)
        del work, public
        torch.cuda.empty_cache()
    return rows


def _bucket(module: types.ModuleType, batch: int) -> dict:
    return module._pick(module._REPLAY_DECODE_CONFIGS, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public", type=Path, required=True, help="folder with the PR's kernel files")
    parser.add_argument("--gpu", default="h200", help="the shipped modules' GPU (GENERATED/GPU)")
    parser.add_argument("--generated", type=Path, default=None, help="folder of built modules (default: the project's generated/)")
    parser.add_argument("--batch", default="1,8,32,128,256,512")
    parser.add_argument("--configs", type=Path, default=None, help="JSON {spec: {name: {knob: value}}} of replay decode configs to time too")
    parser.add_argument("--families", default="gdn,mamba2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    device = torch.device("cuda")
    gdn_public, mamba2_public = _load_public(args.public)
    configs = json.loads(args.configs.read_text()) if args.configs else {}
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    families = {"gdn": ("qwen3.5", PublicGdnDecode, gdn_public), "mamba2": ("nemotron-h", PublicMamba2Decode, mamba2_public)}
    for family in args.families.split(","):
        shape_name, cls, public = families[family]
        rows += run_family(args, family, shape_name, cls, public, configs.get(family, {}), device, bandwidth)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "vs_vllm_replayssm.json").write_text(json.dumps({"copy_bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
