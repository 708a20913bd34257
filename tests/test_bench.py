"""The bench pipeline end to end on the CPU with a fake timer: rows, traffic model, JSON."""

import json
from dataclasses import replace

import torch

from replaygen import bench, measure
from replaygen.measure import Timing

from conftest import SMALL


def fake_timing(ms):
    return Timing(median_ms=ms, p20_ms=ms * 0.99, p80_ms=ms * 1.01, samples=20)


def test_bench_rows_and_json(mamba2, tmp_path, monkeypatch):
    monkeypatch.setattr(measure.DecodeWorkload, "time_baseline", lambda self, steps, repeats=20: fake_timing(1.0))
    monkeypatch.setattr(measure.DecodeWorkload, "time_replay", lambda self, route, flush_at, repeats=20: fake_timing(0.6 if flush_at > 1 else 1.0))
    monkeypatch.setattr(measure.VerifyWorkload, "time_replay", lambda self, accept, steps, repeats=20: fake_timing(0.7))
    monkeypatch.setattr(measure.VerifyWorkload, "time_baseline", lambda self, accept, steps, repeats=20: fake_timing(2.5))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(bench, "environment", lambda device: {"gpu": "fake"})
    monkeypatch.setattr(measure, "l2_bytes", lambda device: 1 << 16)
    shape = replace(SMALL, window=2, capacity=8)
    result = bench.run(mamba2, (shape,), [2], torch.float32, tmp_path, sweep=False, windows=[2], device=torch.device("cpu"))
    saved = json.loads((tmp_path / "bench_mamba2_small.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert {"spec", "environment", "copy_bandwidth_bytes_per_s", "decode", "verify", "memory"} <= set(saved)
    kernels = {(r["kernel"], r["flush_at"]) for r in saved["decode"]}
    assert kernels == {("baseline", 1), ("replay/output_only", 8), ("replay/state_and_output", 8), ("replay/output_only", 1)}
    replay = next(r for r in saved["decode"] if r["kernel"] == "replay/output_only" and r["flush_at"] == 8)
    assert replay["speedup"] == 1.0 / 0.6
    assert replay["bandwidth_fraction"] == replay["bytes_per_step"] / (0.6e-3) / 1e9
    verify = {(r["kernel"], r["accept"]): r for r in saved["verify"]}
    assert verify[("replay_verify", "all")]["vs_decode"] == 0.7
    assert verify[("replay_verify", "all")]["vs_baseline_verify"] == 0.7 / 2.5
    memory = saved["memory"][0]
    assert memory["snapshot_bytes_per_slot"] == 2 * 4 * 8 * 16 * 4  # T=2 snapshots of the fp32 state
    assert memory["max_sequences_snapshot"] == memory["budget_bytes"] // memory["snapshot_bytes_per_slot"]
    assert memory["max_sequences_replay"] == memory["budget_bytes"] // memory["replay_bytes_per_slot"]
