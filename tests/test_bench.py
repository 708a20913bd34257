"""The bench pipeline end to end on the CPU with a fake timer: rows, traffic model, capacity sweep, FLA column, JSON."""

import json
import sys
import types
from dataclasses import replace

import pytest
import torch

from replaygen import bench, measure
from replaygen.configs import KernelKind, bucket_config, default_configs, module_defaults
from replaygen.errors import ReplaygenError
from replaygen.measure import Timing
from replaygen.spec import load_spec
from replaygen.spec.model import DType, StateLayout
from replaygen.traffic import baseline_decode_bytes, replay_decode_bytes

from conftest import ROOT, SMALL

CPU = torch.device("cpu")
COPY_BW = 1e9
CAPACITY_KEYS = {
    "shape", "capacity", "window", "batch", "kernel", "config", "timing", "bytes_per_step", "model_ms",
    "bandwidth_fraction", "baseline_ms", "baseline_model_ms", "speedup",
}


def fake_timing(ms):
    return Timing(median_ms=ms, p20_ms=ms * 0.99, p80_ms=ms * 1.01, samples=20)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Fixed times instead of CUDA graphs; a tiny L2 so workloads stay small."""
    monkeypatch.setattr(measure.DecodeWorkload, "time_baseline", lambda self, steps, repeats=20: fake_timing(1.0))
    monkeypatch.setattr(measure.DecodeWorkload, "time_replay", lambda self, route, flush_at, repeats=20: fake_timing(0.6 if flush_at > 1 else 1.0))
    monkeypatch.setattr(measure.DecodeWorkload, "time_replay_steps", lambda self, route, flush_at, cycles=20: (0.5,) * (flush_at - 1) + (2.1,))
    monkeypatch.setattr(measure.VerifyWorkload, "time_replay", lambda self, accept, steps, repeats=20: fake_timing(0.7))
    monkeypatch.setattr(measure.VerifyWorkload, "time_baseline", lambda self, accept, steps, repeats=20: fake_timing(2.5))
    monkeypatch.setattr(bench.FlaWorkload, "time", lambda self, steps, repeats=20: fake_timing(0.8))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: COPY_BW)
    monkeypatch.setattr(bench, "environment", lambda device: {"gpu": "fake"})
    monkeypatch.setattr(measure, "l2_bytes", lambda device: 1 << 16)


@pytest.fixture(scope="module")
def gdn():
    return load_spec(ROOT / "specs" / "gdn.yaml")


def test_bench_rows_and_json(mamba2, tmp_path, fake_gpu):
    shape = replace(SMALL, window=2, capacity=8)
    result = bench.run(mamba2, (shape,), [2], torch.float32, tmp_path, sweep=False, windows=[2], device=CPU)
    saved = json.loads((tmp_path / "bench_mamba2_small.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved) == {"spec", "spec_sha256", "activation_dtype", "environment", "copy_bandwidth_bytes_per_s", "decode_configs", "decode", "capacity_sweep", "verify", "memory", "fla", "complete"}
    assert saved["decode_configs"] == "defaults"
    assert saved["complete"] is True
    assert saved["fla"] == "not applicable: update kind additive"
    assert saved["capacity_sweep"] == []  # no --L
    kernels = {(r["kernel"], r["flush_at"]) for r in saved["decode"]}
    assert kernels == {("baseline", 1), ("replay/output_only", 8), ("replay/state_and_output", 8), ("replay/output_only", 1)}
    replay = next(r for r in saved["decode"] if r["kernel"] == "replay/output_only" and r["flush_at"] == 8)
    assert replay["speedup"] == 1.0 / 0.6
    assert replay["bandwidth_fraction"] == replay["bytes_per_step"] / (0.6e-3) / COPY_BW
    for row in saved["decode"] + saved["verify"]:
        assert row["model_ms"] == pytest.approx(row["bytes_per_step"] / COPY_BW * 1e3)
        assert row["bandwidth_fraction"] == pytest.approx(row["model_ms"] / row["timing"]["median_ms"])
    defaults = module_defaults(mamba2, shape)  # without --gpu each decode kernel runs its own default
    base = next(r for r in saved["decode"] if r["kernel"] == "baseline")
    assert base["config"] == bucket_config(defaults[KernelKind.BASELINE_DECODE], 2).as_dict()
    assert replay["config"] == bucket_config(defaults[KernelKind.REPLAY_DECODE], 2).as_dict()
    verify = {(r["kernel"], r["accept"]): r for r in saved["verify"]}
    assert {r["decode_shape"] for r in saved["verify"]} == {"small"}
    assert verify[("replay_verify", "all")]["vs_decode"] == 0.7
    assert verify[("replay_verify", "all")]["vs_baseline_verify"] == 0.7 / 2.5
    memory = saved["memory"][0]
    assert memory["snapshot_bytes_per_slot"] == 2 * 4 * 8 * 16 * 4  # T=2 snapshots of the fp32 state
    assert memory["max_sequences_snapshot"] == memory["budget_bytes"] // memory["snapshot_bytes_per_slot"]
    assert memory["max_sequences_replay"] == memory["budget_bytes"] // memory["replay_bytes_per_slot"]
    assert memory["decode_bytes_per_slot"] == 4 * 8 * 16 * 4  # one fp32 state
    assert memory["max_sequences_decode"] == memory["budget_bytes"] // memory["decode_bytes_per_slot"]


def test_tuned_rows_report_the_slowest_step_of_the_cycle(mamba2, fake_gpu):
    """The tuned replay row's peak step: the cycle's median per step scaled by the per-step profile's slowest step over
    its mean; the table prints it as a multiple of the baseline's step."""
    shape = replace(SMALL, window=2, capacity=8)
    configs = module_defaults(mamba2, shape)
    rows = bench.bench_tuned_decode(mamba2, shape, [2], torch.float32, CPU, COPY_BW, configs)
    base, replay = rows
    assert base.peak_step_ms is None
    assert replay.flush_at == 8 and replay.peak_step_ms == pytest.approx(0.6 * 2.1 / ((7 * 0.5 + 2.1) / 8))
    table = bench.format_rows(rows).splitlines()
    assert table[0].split()[-2:] == ["peak", "config"]
    assert f"{replay.peak_step_ms / 1.0:.2f}x" in table[2] and " - " in table[1]


def test_sweep_reports_the_config_each_row_ran(mamba2, tmp_path, fake_gpu):
    """--sweep: decode and verify rows name the grid config that won (the verify grid used to crash the bench)."""
    shape = replace(SMALL, window=2, capacity=8)
    result = bench.run(mamba2, (shape,), [2], torch.float32, tmp_path, sweep=True, windows=[2], device=CPU)
    assert result["decode_configs"] == "sweep" and result["complete"] is True
    decode_grid = {c.as_dict()["block_v"] for c in bench.sweep_configs(shape)}
    assert {r["config"]["block_v"] for r in result["decode"]} <= decode_grid
    assert {(r["config"]["block_v"], r["config"]["num_warps"]) for r in result["verify"]} <= {(8, 4), (16, 8)}


def test_capacity_sweep(mamba2, monkeypatch, fake_gpu):
    """Rows per (L, batch), the window clamped to L/2, the traffic model at each L, baselines reused or timed."""
    shape = replace(SMALL, window=3, capacity=8)
    calls = []

    def time_replay(self, route, flush_at, repeats=20):
        calls.append((self.shape.capacity, self.shape.window, route, flush_at))
        return fake_timing(0.6)

    monkeypatch.setattr(measure.DecodeWorkload, "time_replay", time_replay)
    rows = bench.bench_capacity(mamba2, shape, [4, 8], [2, 3], torch.float32, CPU, COPY_BW, baseline_ms={2: 0.9})
    assert [(r.capacity, r.window, r.batch) for r in rows] == [(4, 2, 2), (4, 2, 3), (8, 3, 2), (8, 3, 3)]
    assert set(calls) == {(4, 2, "output_only", 4), (8, 3, "output_only", 8)}
    act = DType.FLOAT32
    for r in rows:
        assert set(vars(r)) == CAPACITY_KEYS
        expected = replay_decode_bytes(mamba2, replace(shape, capacity=r.capacity, window=r.window), act, r.capacity).total * r.batch
        assert r.bytes_per_step == expected
        assert r.model_ms == expected / COPY_BW * 1e3
        assert r.baseline_model_ms == baseline_decode_bytes(mamba2, shape, act).total * r.batch / COPY_BW * 1e3
        assert r.baseline_ms == (0.9 if r.batch == 2 else 1.0)  # batch 3 has no decode row: timed by the sweep
        assert r.speedup == r.baseline_ms / 0.6
    assert "model ms" in bench.format_capacity_rows(rows)


def test_plots_need_an_output_folder(mamba2):
    with pytest.raises(ReplaygenError, match="--out"):
        bench.run(mamba2, (SMALL,), [1], torch.float32, None, sweep=False, windows=[], device=CPU, plots=True)


def fake_fla_module(monkeypatch, l2norm=True):
    """A stand-in `fla` package whose fused_recurrent_gated_delta_rule and fused_recurrent_kda run the recurrence in torch
    with FLA's API: q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV] (KDA: [B, T, HV, K]), beta [B, T, HV],
    initial_state [N, HV, K, V]; returns o [B, T, HV, V], ht."""

    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False):
        """KDA with the gate in the kernel: g [B, T, HV, K] raw, log decay -exp(A_log) softplus(g + dt_bias) per channel."""
        assert use_gate_in_kernel and use_beta_sigmoid_in_kernel and g.shape == v.shape[:3] + k.shape[-1:]
        log_decay = -torch.exp(A_log.float())[:, None] * torch.nn.functional.softplus(g.float() + dt_bias.float())
        return fused_recurrent_gated_delta_rule(q, k, v, log_decay, torch.sigmoid(beta.float()), scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False):
        batch, tokens, heads, key_dim = k.shape
        value_heads, value_dim = v.shape[2:]
        assert initial_state.shape == (batch, value_heads, key_dim, value_dim) and initial_state.is_contiguous()
        ratio = value_heads // heads
        state = initial_state.float().clone()
        outputs = []
        for t in range(tokens):
            qt, kt = (x[:, t].float().repeat_interleave(ratio, dim=1) for x in (q, k))
            if use_qk_l2norm_in_kernel and l2norm:
                qt, kt = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (qt, kt))
            decay = torch.exp(g[:, t].float())
            state = state * (decay[..., None] if decay.ndim == 3 else decay[..., None, None])
            u = beta[:, t, :, None] * (v[:, t].float() - torch.einsum("nhkv,nhk->nhv", state, kt))
            state = state + kt[..., None] * u[..., None, :]
            outputs.append(torch.einsum("nhkv,nhk->nhv", state, qt * scale))
        return torch.stack(outputs, 1).to(v.dtype), state if output_final_state else None

    root, ops, gdr, kda = (types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.kda"))
    root.__version__ = "0.0-fake"
    root.ops, ops.gated_delta_rule, ops.kda = ops, gdr, kda
    gdr.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    kda.fused_recurrent_kda = fused_recurrent_kda
    for module in (root, ops, gdr, kda):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def fake_decode_rows(spec, shape, batches, act_dtype, device, copy_bw, sweep=False):
    """bench_decode's baseline rows without timing anything (the FLA tests need only the baseline times)."""
    return [bench.decode_row(shape, b, "baseline", 1, {"block_v": 8, "num_warps": 4}, fake_timing(1.0), 1.0, copy_bw, 1.0) for b in batches]


def test_run_cut_short_keeps_what_it_measured(mamba2, monkeypatch, tmp_path, fake_gpu):
    def time_limit(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "bench_decode", fake_decode_rows)
    monkeypatch.setattr(bench, "bench_verify", time_limit)
    with pytest.raises(KeyboardInterrupt):
        bench.run(mamba2, (SMALL,), [2], torch.float32, tmp_path, sweep=False, windows=[2], device=CPU)
    saved = json.loads((tmp_path / "bench_mamba2_small.json").read_text())
    assert saved["complete"] is False and [r["batch"] for r in saved["decode"]] == [2] and saved["verify"] == []


def test_fla_absent(gdn, monkeypatch, capsys, fake_gpu):
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setattr(bench, "bench_decode", fake_decode_rows)
    result = bench.run(gdn, (SMALL,), [2], torch.float32, None, sweep=False, windows=[], device=CPU)
    assert result["fla"] == "absent"
    assert bench.FLA_ABSENT in capsys.readouterr().out
    assert {r["kernel"] for r in result["decode"]} == {"baseline"}


def test_fla_column_matches_and_is_timed(gdn, monkeypatch, capsys, tmp_path, fake_gpu):
    fake_fla_module(monkeypatch)
    monkeypatch.setattr(bench, "bench_decode", fake_decode_rows)
    result = bench.run(gdn, (SMALL,), [2, 3], torch.float32, tmp_path, sweep=False, windows=[], device=CPU)
    fla = json.loads((tmp_path / "bench_gdn_small.json").read_text())["fla"]
    assert fla["version"] == "0.0-fake" and fla["tolerance"] == bench.FLA_TOLERANCE[torch.float32]
    assert [c["batch"] for c in fla["checks"]] == [2, 3]
    assert all(c["ok"] and c["output_rel_error"] < 1e-5 and c["state_rel_error"] < 1e-5 for c in fla["checks"])
    rows = [r for r in result["decode"] if r["kernel"] == "fla"]
    assert [r["batch"] for r in rows] == [2, 3]
    for r in rows:
        assert r["bytes_per_step"] == baseline_decode_bytes(gdn, SMALL, DType.FLOAT32).total * r["batch"]
        assert r["speedup"] == 1.0 / 0.8 and r["flush_at"] == 1 and r["config"] == {}
    assert "fla" in capsys.readouterr().out


def test_fla_kda_column_matches_in_both_layouts(monkeypatch, tmp_path, fake_gpu):
    """A decay per key channel is compared with FLA's fused_recurrent_kda (gate and beta computed in its kernel)."""
    fake_fla_module(monkeypatch)
    kda = load_spec(ROOT / "specs" / "kda.yaml")
    monkeypatch.setattr(bench, "bench_decode", fake_decode_rows)
    assert bench.find_fla(kda).op.function == "fused_recurrent_kda"
    for layout in ("value_key", "key_value"):
        shape = replace(SMALL, name=f"small-{layout}", layout=StateLayout(layout))
        result = bench.run(kda, (shape,), [2], torch.float32, tmp_path, sweep=False, windows=[], device=CPU)
        fla = result["fla"]
        assert all(c["ok"] and c["output_rel_error"] < 1e-5 and c["state_rel_error"] < 1e-5 for c in fla["checks"]), fla
        assert [r["batch"] for r in result["decode"] if r["kernel"] == "fla"] == [2]


def test_fla_mismatch_is_not_timed(gdn, monkeypatch, capsys, fake_gpu):
    """A peer computing something else (here: no l2norm of q and k) is reported, not timed."""
    fake_fla_module(monkeypatch, l2norm=False)
    peer = bench.find_fla(gdn)
    rows, checks = bench.bench_fla(peer, gdn, SMALL, [2], torch.float32, CPU, COPY_BW, {2: 1.0})
    assert rows == [] and not checks[0].ok and checks[0].output_rel_error > 1e-2
    assert "FLA disagrees with our baseline decode at batch 2" in capsys.readouterr().out


def test_fla_that_raises_is_not_timed(gdn, monkeypatch, capsys, fake_gpu):
    """An FLA release with another API fails its check instead of stopping the bench."""
    fake_fla_module(monkeypatch)

    def old_api(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        raise AssertionError("unreachable")

    monkeypatch.setattr(sys.modules["fla.ops.gated_delta_rule"], "fused_recurrent_gated_delta_rule", old_api)
    rows, checks = bench.bench_fla(bench.find_fla(gdn), gdn, SMALL, [2], torch.float32, CPU, COPY_BW, {2: 1.0})
    assert rows == [] and not checks[0].ok and checks[0].error.startswith("TypeError")
    assert "FLA failed on our inputs at batch 2 (TypeError" in capsys.readouterr().out


def test_fla_not_applicable_to_additive_specs(mamba2, monkeypatch):
    fake_fla_module(monkeypatch)
    assert bench.find_fla(mamba2) == "not applicable: update kind additive"


def test_bench_command_passes_the_sweep_and_plots(monkeypatch, tmp_path, capsys):
    """`replaygen bench` argument handling, with the GPU run replaced by a recorder."""
    from replaygen.cli import main

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    spec = str(ROOT / "specs" / "mamba2.yaml")
    assert main(["bench", spec, "--shape", "nemotron-h", "--batch", "32,256", "--L", "4,8,16,32", "--L-batch", "32", "--plots", "--out", str(tmp_path)]) == 0
    (_, shapes, batches, _, out, _, windows), kwargs = calls[0]
    assert [s.name for s in shapes] == ["nemotron-h"] and batches == [32, 256] and out == tmp_path and windows == [2, 4, 6, 8]
    assert kwargs == {"capacities": [4, 8, 16, 32], "capacity_batches": [32], "plots": True, "tuned": None}
    assert main(["bench", spec, "--T", ""]) == 0
    assert calls[1][1] == {"capacities": [], "capacity_batches": None, "plots": False, "tuned": None} and calls[1][0][6] == []
    # a shape whose records apply to the current kernels (the H100's qwen3.5, retimed in perf.md 71)
    assert main(["bench", str(ROOT / "specs" / "gdn.yaml"), "--shape", "qwen3.5", "--gpu", "h100", "--tune-dir", str(ROOT / "tune")]) == 0
    tuned = calls[2][1]["tuned"]["qwen3.5"]
    assert tuned[KernelKind.REPLAY_DECODE] != default_configs(KernelKind.REPLAY_DECODE, calls[2][0][1][0])  # the records' winners
    assert "replay_decode: tuned" in capsys.readouterr().out
    assert main(["bench", spec, "--L", "1,8"]) == 2
    assert "--L values must be at least 2" in capsys.readouterr().err
