"""docs/experiments/vs_vllm_ssu.py on the CPU: the script's CLI, its shapes and byte counts, and the input/state
mapping proven under Triton's interpreter: vLLM's Mamba-2 `selective_state_update` beside replaygen's baseline and
replay decode and the float64 reference over chained steps, at each state dtype. vLLM's file is not part of this
project: the tests that run it read it from REPLAYGEN_PUBLIC_VLLM (a folder with vLLM's mamba_ssm.py and
triton_helpers.py; default .gpu/public where it exists) and skip without it."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from replaygen.harness import InputFactory
from replaygen.runtime import import_file, load_kernels
from replaygen.spec import load_spec
from replaygen.spec.model import DType, Rounding
from replaygen.traffic import baseline_decode_bytes

from conftest import DEVICE, HAS_GPU, ROOT

SCRIPT = ROOT / "docs" / "experiments" / "vs_vllm_ssu.py"
MAMBA2 = load_spec(ROOT / "specs" / "mamba2.yaml")


def _public_folder() -> Path | None:
    given = os.environ.get("REPLAYGEN_PUBLIC_VLLM")
    folder = Path(given) if given else ROOT / ".gpu" / "public"
    return folder if all((folder / name).is_file() for name in ("mamba_ssm.py", "triton_helpers.py")) else None


PUBLIC = _public_folder()
needs_public = pytest.mark.skipif(PUBLIC is None, reason="vLLM's mamba_ssm.py and triton_helpers.py not found in .gpu/public (set REPLAYGEN_PUBLIC_VLLM)")
on_cpu = pytest.mark.skipif(HAS_GPU, reason="the interpreter's checks (a GPU runs the script itself)")


vs = import_file("vs_vllm_ssu", SCRIPT)


def _tiny(state: str) -> list:
    """replaygen's shapes at `state`, reduced as on the CPU, at L = 4, T = 2 (a check of 6 steps flushes once)."""
    return [vs.Ours(shape, load_kernels(MAMBA2, shape), "test") for shape in (replace(s, capacity=4, window=2) for s in vs.our_shapes(MAMBA2, state, reduce=True))]


@pytest.fixture(scope="module", autouse=True)
def _vllm_stubs_unloaded_after():
    """What loading vLLM's file installs process-wide (the stub `vllm` packages, their modules, the sibling script it
    takes `_stub_vllm` from) is undone after this file's tests, so other tests see none of it."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "vllm" or name.startswith("public_vllm") or name == "vs_vllm_replayssm":
            del sys.modules[name]


@pytest.fixture(scope="module")
def public():
    return vs.load_vllm(PUBLIC)


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--public" in done.stdout and "--check-only" in done.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--states", "float8"], "--states takes float32, bfloat16, float16"),
        (["--batch", "8,0"], "--batch takes integers of at least 1"),
        (["--batch", "8,x"], "--batch takes comma-separated integers"),
        (["--check-steps", "0"], "--check-steps must be at least 1"),
        (["--device", "cpu"], "pass --check-only"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        vs.parse_args(["--public", "x", *argv])
    assert message in capsys.readouterr().err


def test_our_shapes_at_each_state_dtype():
    """float32: nemotron-h; bfloat16: the shipped nemotron-h-bf16 (stochastic) and nemotron-h-bf16-nearest; float16:
    nemotron-h rounded to nearest (a precision variant, as `replaygen drift` builds it)."""
    got = {state: [(s.name, s.state_dtype, s.rounding) for s in vs.our_shapes(MAMBA2, state, reduce=False)] for state in vs.STATES}
    assert got == {
        "float32": [("nemotron-h", DType.FLOAT32, Rounding.NEAREST)],
        "bfloat16": [("nemotron-h-bf16", DType.BFLOAT16, Rounding.STOCHASTIC), ("nemotron-h-bf16-nearest", DType.BFLOAT16, Rounding.NEAREST)],
        "float16": [("nemotron-h-float16", DType.FLOAT16, Rounding.NEAREST)],
    }
    reduced = vs.our_shapes(MAMBA2, "bfloat16", reduce=True)[1]
    assert (reduced.heads, reduced.key_heads, reduced.value_dim, reduced.key_dim) == (4, 2, 16, 32)


@pytest.mark.parametrize("state", ["float32", "bfloat16", "float16"])
def test_vllm_bytes_are_the_baseline_bytes_with_a_float32_dt(state):
    """vLLM's kernel moves the baseline's bytes (the state read and written whole, the inputs, the output), with dt
    read as the float32 it is given where replaygen's traffic model counts it at the activation dtype."""
    shape = MAMBA2.shape("nemotron-h-bf16" if state == "bfloat16" else "nemotron-h")
    shape = replace(shape, state_dtype=DType(state))
    theirs = vs.vllm_bytes(shape, getattr(torch, state), torch.bfloat16, torch.float32)
    ours = baseline_decode_bytes(MAMBA2, shape, DType.BFLOAT16)
    assert theirs.state_read == theirs.state_write == ours.state_read == 128 * 64 * 128 * DType(state).itemsize
    assert theirs.total == ours.total + 2 * shape.heads


def test_the_mapping_views_per_head_values_over_values_and_keys():
    """dt, A, dt_bias and D per head become stride-0 views over P (and N), as vLLM's tie_hdim path needs."""
    shape = vs.our_shapes(MAMBA2, "float32", reduce=True)[0]
    factory = InputFactory(MAMBA2, shape, DEVICE, torch.bfloat16, seed=0)
    weights, inputs = factory.weights(), factory.step(3, use_gate=False)
    args = vs.vllm_args(inputs, weights)
    assert args["dt"].shape == args["x"].shape == (3, 4, 16) and args["dt"].stride(-1) == 0
    assert args["A"].shape == (4, 16, 32) and args["A"].stride()[1:] == (0, 0)
    assert args["dt_bias"].stride(-1) == 0 and args["D"].stride(-1) == 0 and args["z"] is None
    assert torch.equal(args["A"][:, 0, 0], -torch.exp(weights["A_log"]))


@needs_public
@on_cpu
@pytest.mark.parametrize("state", ["float32", "bfloat16", "float16"])
def test_mapping_matches_baseline_and_reference(public, state):
    """Six chained steps (replay flushes once), a gate on every other: vLLM's outputs and states within replaygen's
    tolerances of the reference, and within float32 rounding of our baseline at the same state dtype and rounding
    (the interpreter truncates both bfloat16 round-to-nearest states alike)."""
    ours = _tiny(state)
    result = vs.check_state_dtype(public, MAMBA2, ours, DEVICE, steps=6, batch=2)
    assert result["ok"], vs.describe_check(result)
    worst = result["worst"]
    nearest = [o.label for o in ours if o.shape.rounding is Rounding.NEAREST]
    assert all(worst[f"vLLM vs {label} baseline state"] < 1e-4 for label in nearest), vs.describe_check(result)
    if state != "bfloat16":
        assert not result["unheld"] and worst["vLLM state"] < {"float32": 1e-5, "float16": 2e-3}[state]


@needs_public
@on_cpu
def test_the_timed_launch_is_the_checked_call(public):
    """VllmDecode (the timed launch: per layer its own state, slots 1..batch, a preallocated output) updates its states
    as the checked call does."""
    shape = vs.our_shapes(MAMBA2, "float16", reduce=True)[0]
    factory = InputFactory(MAMBA2, shape, DEVICE, torch.bfloat16, seed=3)
    weights, inputs = factory.weights(), [factory.step(2, use_gate=False)]
    kernel = vs.VllmDecode(public, inputs, weights, 2, torch.float16, DEVICE)
    state, out = kernel.states[0].clone(), torch.empty_like(kernel.outs[0])
    kernel.step()
    public.selective_state_update(state, **vs.vllm_args(inputs[0], weights), state_batch_indices=vs.vllm_slots(2, DEVICE), out=out)
    assert torch.equal(kernel.states[0], state) and torch.equal(kernel.outs[0], out)


@needs_public
def test_vllm_finds_its_h200_configs(public, monkeypatch):
    """On an H200 vLLM's launch config comes from its tuned JSON in --public (keyed by batch x heads; bfloat16 states
    share float16's); without one, from its heuristic."""
    shape = MAMBA2.shape("nemotron-h")
    assert vs.vllm_launch_config(public, shape, 8, torch.float32)["source"] in ("default heuristic", f"tuned for {public.get_ssm_device_name()}")
    monkeypatch.setattr(sys.modules["vllm.platforms"].current_platform, "get_device_name", lambda device_id=0: "NVIDIA H200")
    for cached in (public.get_ssm_configs, public._try_get_optimal_ssm_config_cached):
        cached.cache_clear()
    try:
        folder = Path(public.__file__).parent / "configs" / "selective_state_update"
        for state, file_dtype in (("float32", "float32"), ("bfloat16", "float16"), ("float16", "float16")):
            path = folder / f"headdim=64,dstate=128,device_name=NVIDIA_H200,cache_dtype={file_dtype}.json"
            if not path.is_file():
                pytest.skip(f"{path.name} not in {folder}")
            config = vs.vllm_launch_config(public, shape, 8, getattr(torch, state))
            want = json.loads(path.read_text())[str(8 * shape.heads)]
            assert config == {**want, "source": "tuned for NVIDIA_H200"}
    finally:
        for cached in (public.get_ssm_configs, public._try_get_optimal_ssm_config_cached):
            cached.cache_clear()


@needs_public
@on_cpu
def test_cli_check_on_the_cpu(tmp_path):
    """The script end to end on the CPU (--device cpu --check-only, two steps of the float32 state)."""
    out = tmp_path / "r.json"
    record = vs.main(["--public", str(PUBLIC), "--device", "cpu", "--check-only", "--states", "float32", "--check-steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["checks"]["float32"]["ok"], record["checks"]
    assert "not timed" in record["vllm_stochastic_rounding"] and "rows" not in record
