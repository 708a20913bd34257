"""The command line: each verb runs, errors are clear and exit non-zero."""

from pathlib import Path

import pytest

from replaygen.cli import main

from conftest import HAS_GPU, ROOT

TINY = """\
spec_version: 1
name: tiny
inputs: {value: x, key: B, query: C}
decay: {granularity: head, form: neg_exp_softplus, input: dt, rate: A_log, bias: dt_bias}
update: {kind: additive, weight: decay_dt}
readout: {skip: D, gate: {input: z, activation: silu, optional: true}}
state: {dtype: float32}
activations: [float32, bfloat16]
replay:
  cache: {value: activation, key: activation, log_decay: float32, weight: float32}
  capacity: 4
  window: 1
shapes:
  t: {heads: 2, key_heads: 1, value_dim: 4, key_dim: 8}
"""


def write_tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_show(capsys):
    assert main(["show", str(ROOT / "specs" / "mamba2.yaml"), "--shape", "nemotron-h"]) == 0
    out = capsys.readouterr().out
    assert "speedup bound (equal bandwidth efficiency): 1.809x" in out
    assert "buf_key" in out and "8,425,728" in out


def test_show_speculative_memory_per_state_dtype(capsys):
    """The sequences a fixed state budget holds with windows of the shape's T, at its own state dtype and at another:
    a bfloat16 state halves the state and every snapshot, not the buffers. GDN qwen3.5-mtp (L=28, T=4): a 2 MiB
    float32 state per sequence, snapshots 4 of those, replay the state plus 32 ring entries of 12,416 B."""
    gdn = str(ROOT / "specs" / "gdn.yaml")
    assert main(["show", gdn, "--shape", "qwen3.5-mtp"]) == 0
    out = capsys.readouterr().out
    assert "state float32" in out
    assert "snapshot verify 8,388,608 B per slot" in out
    assert "plain decode 20,480, snapshot verify 5,120, replay 17,189 (3.36x snapshot verify)" in out
    assert main(["show", gdn, "--shape", "qwen3.5-mtp", "--state-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "state bfloat16" in out and "nearest rounding" in out
    assert "replay 1,449,984 B (checkpoint 1,048,576 + buffers 397,312" in out
    assert "plain decode 40,960, snapshot verify 10,240, replay 29,620 (2.89x snapshot verify)" in out


def test_list(capsys, tmp_path):
    """Specs, shapes, and per GPU which shapes' records hold trials of which kernels (a corrupt file named)."""
    records = tmp_path / "tune" / "h100"
    records.mkdir(parents=True)
    (records / "mamba2_nemotron_h.json").write_text((ROOT / "tune" / "h100" / "mamba2_nemotron_h.json").read_text())
    (records / "mamba2_nemotron_h_tp2.json").write_text("{")
    assert main(["list", "--specs-dir", str(ROOT / "specs"), "--tune-dir", str(tmp_path / "tune")]) == 0
    out = capsys.readouterr().out
    assert "nemotron-h-tp8" in out and "GPUs with tuning records in" in out and "h100" in out
    assert "  h100 mamba2:\n    trials of baseline_decode, replay_decode: nemotron-h\n" in out
    assert f"    UNREADABLE ({records / 'mamba2_nemotron_h_tp2.json'}: corrupt or truncated" in out
    assert "    no records (build needs --allow-default: documented defaults): nemotron-h-tp4, nemotron-h-tp8, nemotron-h-l8" in out
    assert "  h100 gdn:\n    no records (build needs --allow-default: documented defaults): qwen3.5, " in out


def test_build(capsys, tmp_path):
    spec = str(write_tiny(tmp_path))
    assert main(["build", spec, "--gpu", "h100", "--out", str(tmp_path / "gen"), "--tune-dir", str(tmp_path / "tune")]) == 2
    assert "--allow-default" in capsys.readouterr().err
    assert main(["build", spec, "--gpu", "h100", "--out", str(tmp_path / "gen"), "--tune-dir", str(tmp_path / "tune"), "--allow-default"]) == 0
    out = capsys.readouterr().out
    assert "tiny/t for h100: wrote" in out and "replay_decode: documented defaults (no records, --allow-default)" in out
    assert "1 module(s) in" in out and "from gen.h100 import tiny_t" in out
    assert (tmp_path / "gen" / "h100" / "tiny_t.py").is_file()


def test_check_runs_and_passes(capsys, tmp_path):
    assert main(["check", str(write_tiny(tmp_path)), "--cycles", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "route=output_only" in out and "route=state_and_output" in out


@pytest.mark.skipif(HAS_GPU, reason="the refusal happens only without CUDA")
def test_check_of_tuned_configs_needs_a_gpu(capsys):
    """Without CUDA, `check --gpu` refuses (tuned configs run at the full shapes) instead of checking defaults."""
    assert main(["check", str(ROOT / "specs" / "mamba2.yaml"), "--gpu", "h100"]) == 2
    assert "check --gpu h100 needs a CUDA GPU" in capsys.readouterr().err


def test_check_bucket_picks_positions_of_the_gpu_tables(capsys):
    """`check --gpu G --bucket K` runs only the Kth config set of the tables `build --gpu G` bakes; a position the
    tables lack, or --bucket without --gpu, is refused."""
    import argparse

    from replaygen.cli import _check_variants
    from replaygen.errors import ReplaygenError
    from replaygen.spec import load_spec

    spec = load_spec(ROOT / "specs" / "mamba2.yaml")
    shape = spec.shape("nemotron-h")
    args = argparse.Namespace(gpu="h100", tune_dir=ROOT / "tune", bucket=None)
    every = _check_variants(spec, shape, args)
    assert len(every) > 2
    picked = _check_variants(spec, shape, argparse.Namespace(**{**vars(args), "bucket": [len(every), 2]}))
    assert picked == [every[1], every[-1]]
    with pytest.raises(ReplaygenError, match=f"has bucket positions 1-{len(every)} for h100"):
        _check_variants(spec, shape, argparse.Namespace(**{**vars(args), "bucket": [len(every) + 1]}))
    assert main(["check", str(ROOT / "specs" / "mamba2.yaml"), "--bucket", "1"]) == 2
    assert "pass --gpu" in capsys.readouterr().err


def test_bad_spec_exits_nonzero_with_location(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.replace("capacity: 4", "capacity: 1"))
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "replay.capacity" in err


def test_unknown_shape(capsys, tmp_path):
    assert main(["build", str(write_tiny(tmp_path)), "--shape", "nope", "--out", str(tmp_path)]) == 2
    assert "has no shape 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["check", "--cycles", "0"], "--cycles must be at least 1, got 0"),
    (["check", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["check", "--batch", "-1"], "--batch must be at least 1, got -1"),
    (["check", "--gpu", "h100", "--bucket", "2", "--bucket", "0"], "--bucket must be at least 1, got 0"),
    (["build", "--flush-groups", "0"], "--flush-groups must be at least 1, got 0"),
    (["tune", "--trials", "0"], "--trials must be at least 1, got 0"),
    (["tune", "--recorded", "-1"], "--recorded must be at least 0, got -1"),
    (["tune", "--seed", "-1"], "--seed must be at least 0, got -1"),
    (["tune", "--compile-workers", "-1"], "--compile-workers must be at least 0, got -1"),
    (["tune", "--timeout", "0"], "--timeout must be positive, got 0.0"),
])
def test_numbers_below_their_minimum_are_refused(capsys, argv, message):
    """A count that makes no sense is refused with the option named, before anything runs (no empty 'PASS')."""
    verb, *options = argv
    assert main([verb, str(ROOT / "specs" / "mamba2.yaml"), *options]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"replaygen {verb}: error: {message}\n" and not captured.out


@pytest.mark.parametrize("verb, flag", [("build", "--gpu"), ("check", "--gpu"), ("compile", "--gpu"), ("bench", "--gpu"), ("tune", "--gpu"),
                                        ("tune", "--recorded-gpu")])
@pytest.mark.parametrize("gpu", ["../../tmp", "h100\n", "h 100", ""])
def test_every_verb_checks_gpu_names(capsys, verb, flag, gpu):
    """A GPU name names a folder of records (and of modules): every verb holds it to build's rule, a trailing newline too."""
    needs = ["--recorded", "1"] if flag == "--recorded-gpu" else []
    assert main([verb, str(ROOT / "specs" / "mamba2.yaml"), *needs, flag, gpu]) == 2
    assert f"{flag} {gpu!r} must be letters, digits" in capsys.readouterr().err


def test_gpu_names_are_read_in_lowercase(capsys, tmp_path):
    """`--gpu H100` names the folder h100, as `replaygen list` shows it."""
    from replaygen.paths import gpu_name

    assert gpu_name("H200") == "h200" and gpu_name("RTX_4090") == "rtx_4090"
    argv = ["build", str(write_tiny(tmp_path)), "--gpu", "H100", "--out", str(tmp_path / "gen"), "--allow-default"]
    assert main(argv) == 0
    assert (tmp_path / "gen" / "h100" / "tiny_t.py").is_file()


def test_build_leaves_a_package_init_of_its_own(capsys, caplog, tmp_path):
    """An --out folder whose __init__.py is not replaygen's (a user's package) keeps it, with a warning; a folder
    without one gets replaygen's."""
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "__init__.py").write_text("from .core import *\n")
    argv = ["build", str(write_tiny(tmp_path)), "--out", str(out), "--tune-dir", str(tmp_path / "tune"), "--allow-default"]
    assert main(argv) == 0
    assert (out / "__init__.py").read_text() == "from .core import *\n"
    assert (out / "h200" / "__init__.py").read_text() == '"""Modules generated by replaygen."""\n'
    assert f"{out / '__init__.py'} is not the one replaygen writes: left as it is" in caplog.text
    assert f"{out / 'h200' / '__init__.py'}" not in caplog.text
    assert main(argv) == 0 and "unchanged" in capsys.readouterr().out


@pytest.mark.parametrize("file, out", [("out", "out"), ("out/h200", "out"), ("out", "out/below")])
def test_build_out_must_be_a_folder(capsys, tmp_path, file, out):
    """A file at --out, at its GPU folder or at a folder above it is refused before anything is written."""
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text("")
    assert main(["build", str(write_tiny(tmp_path)), "--out", str(tmp_path / out), "--allow-default"]) == 2
    assert f"--out {tmp_path / out}: {tmp_path / file} is a file, not a folder" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.py"))


def test_dtype_must_be_one_of_the_spec_activations(capsys, tmp_path):
    """Every verb with --dtype refuses one the spec's activations lack, naming them (before any kernel runs)."""
    spec = tmp_path / "fp32.yaml"
    spec.write_text(TINY.replace("activations: [float32, bfloat16]", "activations: [float32]"))
    for verb in ("show", "compile", "check"):
        assert main([verb, str(spec), "--dtype", "bf16"]) == 2
        assert f"--dtype bf16 (bfloat16): {spec} supports activations float32 only" in capsys.readouterr().err


def test_default_dtype_is_one_the_spec_supports(capsys, tmp_path):
    """By default a verb keeps its usual dtype where the spec supports it (the shipped specs all three), else takes
    the spec's first activation."""
    from replaygen.cli import _activation_dtype
    from replaygen.spec import load_spec

    mamba2 = load_spec(ROOT / "specs" / "mamba2.yaml")
    assert _activation_dtype(mamba2, None, "fp32") == "fp32" and _activation_dtype(mamba2, None, "bf16") == "bf16"
    path = tmp_path / "half.yaml"
    path.write_text(TINY.replace("activations: [float32, bfloat16]", "activations: [bfloat16, float16]"))
    half = load_spec(path)
    assert _activation_dtype(half, None, "fp32") == "bf16"
    assert _activation_dtype(half, "fp16", "fp32") == "fp16"
    assert main(["show", str(path)]) == 0
    assert "activations bfloat16" in capsys.readouterr().out


def test_verbose_after_the_command(tmp_path):
    """`-v` reads the same before and after the command."""
    from replaygen.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["list", "-v"]).verbose and parser.parse_args(["-v", "list"]).verbose
    assert not parser.parse_args(["list"]).verbose


def test_a_gpu_without_records_names_those_with_them(capsys, tmp_path):
    assert main(["build", "mamba2", "--shape", "nemotron-h", "--gpu", "b200", "--out", str(tmp_path)]) == 2
    assert "no tuning records for mamba2/nemotron-h on b200" in (err := capsys.readouterr().err) and "records of it exist for h100, h200" in err
    assert main(["list", "--specs-dir", str(tmp_path)]) == 2
    assert f"no spec files (*.yaml) in {tmp_path}: pass --specs-dir" in capsys.readouterr().err
    assert main(["show", "nosuchspec"]) == 2
    assert "no spec file 'nosuchspec' (not a file here, nor a shipped spec: gdn, kda, mamba2, mamba3)" in capsys.readouterr().err


def test_check_runs_each_distinct_reduced_shape_once():
    """Tensor-parallel splits that reduce to the same sizes run once; a shape of another layout or state dtype runs
    apart."""
    from dataclasses import replace

    from replaygen.cli import _check_groups
    from replaygen.spec import load_spec
    from replaygen.spec.model import DType

    spec = load_spec(ROOT / "specs" / "kda.yaml")
    groups = _check_groups(spec.shapes, reduce=True)
    layouts = {run.layout for run in groups}
    assert len(layouts) == 2 and all(len({shape.layout for shape in shapes}) == 1 for shapes in groups.values())
    assert sum(len(shapes) for shapes in groups.values()) == len(spec.shapes) and len(groups) < len(spec.shapes)
    half = replace(spec.shapes[0], name="half", state_dtype=DType.BFLOAT16)
    assert len(_check_groups((spec.shapes[0], half), reduce=True)) == 2


def test_bench_times_the_documented_defaults_where_no_record_applies_only_when_allowed(capsys, monkeypatch):
    import torch

    import replaygen.bench

    timed = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(replaygen.bench, "run", lambda spec, shapes, *args, tuned, **kwargs: timed.update(tuned))
    argv = ["bench", "mamba2", "--shape", "nemotron-h", "--gpu", "b200", "--T", ""]
    assert main(argv) == 2
    assert "no tuning records for mamba2/nemotron-h on b200" in capsys.readouterr().err and not timed
    assert main([*argv, "--allow-default"]) == 0
    assert "nemotron-h" in timed and "documented defaults" in capsys.readouterr().out
