"""Plots from a saved bench JSON (the schema of bench.run's rows), the `plot` command, and no matplotlib."""

import json
import sys
from dataclasses import asdict

import pytest

from replaygen import bench, plots
from replaygen.cli import main
from replaygen.measure import Timing

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BATCHES = (1, 8, 64)
ALL_PLOTS = ("speedup", "capacity", "verify", "roofline")


def timing(ms):
    return Timing(ms, 0.95 * ms, 1.05 * ms, 20).as_dict()


def decode_rows(batch):
    base = 0.01 * batch
    kernels = (("baseline", 1, 1.0), ("replay/output_only", 16, 0.6), ("replay/state_and_output", 16, 0.8), ("replay/output_only", 1, 1.0), ("fla", 1, 1.1))
    return [
        bench.DecodeRow("small", 16, batch, kernel, flush_at, {} if kernel == "fla" else {"block_v": 8, "num_warps": 4},
                        timing(base * f), 1e6 * batch, 0.3 * base, 0.3 / f, 1 / f)
        for kernel, flush_at, f in kernels
    ]


def capacity_rows(batch):
    base = 0.01 * batch
    return [
        bench.CapacityRow("small", capacity, min(4, capacity // 2), batch, "replay/output_only", {"block_v": 8, "num_warps": 4},
                          timing(base * (0.5 + 0.02 * capacity + 1 / capacity)), 5e5 * batch, 0.15 * base, 0.5, base, 0.3 * base, 1.3)
        for capacity in (4, 8, 16, 32)
    ]


def verify_rows(batch):
    base = 0.01 * batch
    rows = []
    for tokens in (2, 4, 8):
        for kernel, accept, f in (("replay_verify", "all", 1.2), ("replay_verify", "staggered", 1.3), ("replay_verify", "random", 1.1),
                                  ("baseline_verify", "all", 0.6 * tokens)):
            shape = "small-mtp" if tokens == 4 else "small"  # a window's own verify shape, measured against small's decode
            rows.append(bench.VerifyRow(shape, "small", 16, batch, tokens, accept, kernel, {"block_v": 8, "num_warps": 4},
                                        timing(base * f), 1e6 * batch, 0.2 * base * f, 0.4, f, f / (0.6 * tokens)))
    return rows


def synthetic_result(sections=("capacity_sweep", "verify")):
    """A bench JSON of the shape bench.run writes (rows are bench's own dataclasses), with the chosen optional sections."""
    result = {
        "spec": "mamba2",
        "spec_sha256": "0" * 64,
        "activation_dtype": "bfloat16",
        "environment": {"gpu": "fake GPU"},
        "copy_bandwidth_bytes_per_s": 3e12,
        "decode": [asdict(r) for b in BATCHES for r in decode_rows(b)],
        "capacity_sweep": [asdict(r) for b in BATCHES[1:] for r in capacity_rows(b)],
        "verify": [asdict(r) for b in BATCHES for r in verify_rows(b)],
        "memory": [],
        "fla": {"version": "fake", "tolerance": 0.02, "checks": []},
        "complete": True,
    }
    for key in ("capacity_sweep", "verify"):
        if key not in sections:
            result[key] = []
    return result


def write_json(tmp_path, result):
    path = tmp_path / "bench_mamba2_small.json"
    path.write_text(json.dumps(result))
    return path


def assert_pngs(paths, names, folder):
    assert sorted(paths) == sorted(folder / f"mamba2_small_{name}.png" for name in names)
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_every_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.plot_bench(write_json(tmp_path, synthetic_result()))
    assert_pngs(paths, ALL_PLOTS, tmp_path)


def test_plots_without_sweep_or_verify_rows(tmp_path):
    """A run without --L and --T: only the decode plots."""
    pytest.importorskip("matplotlib")
    paths = plots.plot_bench(write_json(tmp_path, synthetic_result(sections=())), tmp_path / "out")
    assert_pngs(paths, ("speedup", "roofline"), tmp_path / "out")


def test_plot_command(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = write_json(tmp_path, synthetic_result())
    assert main(["plot", str(path), "--out", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == len(ALL_PLOTS) and "mamba2_small_capacity.png" in out
    assert main(["plot", str(tmp_path / "missing.json")]) == 2
    assert "no bench JSON" in capsys.readouterr().err


def test_without_matplotlib(tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    path = write_json(tmp_path, synthetic_result())
    with pytest.raises(plots.MatplotlibMissing):
        plots.plot_bench(path)
    bench.write_plots(path)
    assert "matplotlib not installed" in capsys.readouterr().out
    assert main(["plot", str(path)]) == 2
    assert "pip install 'replaygen[plot]'" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def row_with(section, **fields):
    """A copy of the synthetic result whose first `section` row has `fields` (None: the field left out)."""
    result = synthetic_result()
    result[section][0] = {k: v for k, v in {**result[section][0], **fields}.items() if v is not None}
    return result


@pytest.mark.parametrize("text, message", [
    ("not json", "not a bench JSON (Expecting value: line 1 column 1"),
    ("[1, 2]", "not a bench JSON (the object `bench --out` writes) but an array"),
    ("{}", "'spec' missing or not a spec name"),
    (json.dumps({"spec": "mamba2"}), "no 'decode' rows"),
    (json.dumps({"spec": "mamba2", "decode": {}}), "'decode' must be a list of rows, got an object"),
    (json.dumps({"spec": "mamba2", "decode": [3]}), "decode[0]: a row must be an object, got a number"),
    (json.dumps(row_with("decode", batch=None)), "decode[0]: 'batch' missing or not an integer (got None)"),
    (json.dumps(row_with("capacity_sweep", timing={"median_ms": 1.0})), "capacity_sweep[0]: 'timing' must hold the numbers"),
    (json.dumps(row_with("verify", tokens="2")), "verify[0]: 'tokens' missing or not an integer (got '2')"),
])
def test_plot_refuses_a_malformed_json(tmp_path, capsys, text, message):
    """What is not a bench JSON, or lacks what the plots read, is refused naming the file and the field."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.json"
    path.write_text(text)
    assert main(["plot", str(path)]) == 2
    assert f"replaygen plot: error: {path}: {message}" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("result, message", [
    ({**synthetic_result(), "spec": "../../escaped"}, "'spec' missing or not a spec name (lowercase letters, digits and '_'): got '../../escaped'"),
    (row_with("decode", shape="../x"), "decode[0]: 'shape' must be a shape name (lowercase letters, digits, '-' and '.'), got '../x'"),
    (row_with("verify", decode_shape="/tmp/x"), "verify[0]: 'decode_shape' must be a shape name"),
])
def test_plot_names_never_leave_the_out_folder(tmp_path, capsys, result, message):
    """The PNG names come from the JSON's spec and shape names: any other than a name the spec allows is refused."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "a" / "b"
    path = write_json(tmp_path, result)
    assert main(["plot", str(path), "--out", str(out)]) == 2
    assert f"{path}: {message}" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png"))


def test_plot_out_must_be_a_folder(tmp_path, capsys):
    """A file at --out is refused, not a FileExistsError."""
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    assert main(["plot", str(write_json(tmp_path, synthetic_result())), "--out", str(tmp_path / "file")]) == 2
    assert "a file stands at it or at a folder above it" in capsys.readouterr().err
