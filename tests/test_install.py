"""A user's first run: the README's plain install (not editable) of a copy of the repository into a fresh virtualenv,
then every default path found from another folder: the shipped specs, their records, a spec file given by path, a
generated module run under Triton's interpreter through its buffer's flushes, and `check` of a spec."""

import os
import shutil
import subprocess
import sys

from replaygen.spec import load_spec

from conftest import ROOT


def run(argv, cwd, env, timeout=900):
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_plain_install_from_a_copy_runs_from_another_folder(tmp_path):
    copy = tmp_path / "copy"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "VIRTUAL_ENV", "PYTHONPATH", "REPLAYGEN_TEMPLATES")}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python, replaygen = str(venv / "bin" / "python"), str(venv / "bin" / "replaygen")
    run([python, "-m", "pip", "install", "-q", "torch==2.13.0", "triton==3.6.0"], tmp_path, env)  # as the README installs them
    run([python, "-m", "pip", "install", "-q", str(copy)], tmp_path, env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    listed = run([replaygen, "list"], elsewhere, env)
    assert "gdn (" in listed and "qwen3.5-mtp" in listed and "GPUs with tuning records in" in listed and "h200" in listed
    # a shape whose records apply to the current kernels (the H100's qwen3.5, retimed in perf.md 71)
    built = run([replaygen, "build", "gdn", "--shape", "qwen3.5", "--gpu", "H100", "--out", "kernels"], elsewhere, env)
    assert "replay_decode: tuned (b1 " in built and (elsewhere / "kernels" / "h100" / "gdn_qwen3_5.py").is_file()
    run([replaygen, "build", str(copy / "specs" / "gdn.yaml"), "--allow-default", "--out", "all"], elsewhere, env)
    assert len(list((elsewhere / "all" / "h200").glob("gdn_*.py"))) == len(load_spec(ROOT / "specs" / "gdn.yaml").shapes)

    run([replaygen, "build", str(copy / "examples" / "tiny.yaml"), "--gpu", "cpu", "--allow-default", "--out", "kernels"], elsewhere, env)
    tried = run([python, str(copy / "examples" / "try_on_cpu.py")], elsewhere, env)
    assert "17 decode steps: outputs within" in tried
    checked = run([replaygen, "check", str(copy / "examples" / "tiny.yaml"), "--cycles", "1", "--batch", "2"], elsewhere, env)
    assert "[1/1] tiny/toy on cpu" in checked and "all checks passed" in checked
