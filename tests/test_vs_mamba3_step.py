"""docs/experiments/vs_mamba3_step.py on the CPU: the script's CLI, which shapes state-spaces/mamba's
`mamba3_siso_step` can run, and the input/state mapping proven under Triton's interpreter with exact trig stand-ins:
their kernel's outputs and new states against replaygen's baseline_decode and the float64 reference over chained
steps. The kernel is not part of this project: the tests that run it read it from REPLAYGEN_PUBLIC_MAMBA3 (a folder
with mamba3_siso_step.py and utils.py; default .gpu/public/mamba_ssm_mamba3 where it exists) and skip without it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replaygen.runtime import import_file, load_kernels
from replaygen.spec import load_spec, load_spec_text
from replaygen.spec.model import RotaryPairing, TargetShape

from conftest import DEVICE, HAS_GPU, ROOT

SCRIPT = ROOT / "docs" / "experiments" / "vs_mamba3_step.py"
MAMBA3 = load_spec(ROOT / "specs" / "mamba3.yaml")
# Two heads per key head (their grouped Q/K), N = P = 16 (powers of two, as their tl.arange needs), 4 angles.
TINY = TargetShape("tiny", heads=4, key_heads=2, value_dim=16, key_dim=16, capacity=8, window=2, rotary_pairing=RotaryPairing.ADJACENT)


def _public_folder() -> Path | None:
    given = os.environ.get("REPLAYGEN_PUBLIC_MAMBA3")
    folder = Path(given) if given else ROOT / ".gpu" / "public" / "mamba_ssm_mamba3"
    return folder if (folder / "mamba3_siso_step.py").is_file() and (folder / "utils.py").is_file() else None


PUBLIC = _public_folder()
needs_public = pytest.mark.skipif(PUBLIC is None, reason="state-spaces/mamba's mamba3_siso_step.py not found (set REPLAYGEN_PUBLIC_MAMBA3)")


vs = import_file("vs_mamba3_step", SCRIPT)


@pytest.fixture(scope="module", autouse=True)
def _their_modules_unloaded_after():
    """What loading their kernel installs process-wide (the stub `mamba_ssm` packages, their modules, the
    interpreter's widened bfloat16 dot) is undone after this file's tests, so other tests see neither."""
    from triton.runtime.interpreter import InterpreterBuilder

    before, dot = set(sys.modules), InterpreterBuilder.create_dot
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "mamba_ssm" or name.startswith("public_mamba3"):
            del sys.modules[name]
    InterpreterBuilder.create_dot = dot


@pytest.fixture(scope="module")
def public():
    # exact trig on the CPU (their PTX approximations cannot run in the interpreter); their shipped helpers on a GPU
    return vs.load_public(PUBLIC, exact_trig=not HAS_GPU)


@pytest.fixture(scope="module")
def module():
    return load_kernels(MAMBA3, TINY)


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--public" in done.stdout and "--exact-trig" in done.stdout


def test_which_shapes_their_kernel_runs():
    assert vs.expressible(MAMBA3, MAMBA3.shape("mamba3")) is None
    assert vs.expressible(MAMBA3, MAMBA3.shape("mamba3-n64")) is None
    assert "SISO only" in vs.expressible(MAMBA3, MAMBA3.shape("mamba3-mimo"))
    assert vs.expressible(MAMBA3, TINY) is None
    # an odd angle count (N = 20: 5 pairs) or N not a power of two is refused with the reason
    assert "even" in vs.expressible(MAMBA3, TargetShape("odd", heads=2, key_heads=1, value_dim=16, key_dim=20, capacity=4, window=1))
    assert "powers of two" in vs.expressible(MAMBA3, TargetShape("npow", heads=2, key_heads=1, value_dim=16, key_dim=24, capacity=4, window=1))


@needs_public
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mapping_matches_baseline_and_reference(public, module, act):
    """Four chained steps: their outputs within bfloat16's tolerance (their readout is a bfloat16 dot), their SSM state,
    angle and key state within float32's of the reference and of our baseline_decode."""
    result = vs.check_mapping(public, module, MAMBA3, TINY, DEVICE, act, steps=4, batch=2, seed=2, exact_trig=not HAS_GPU)
    assert result["ok"], vs.describe_check(result)
    worst = result["worst"]
    assert worst["theirs state"] < 1e-5 and worst["theirs key"] < 1e-5 and worst["theirs vs ours state"] < 1e-5
    assert worst["theirs value"] == 0.0


@needs_public
def test_ping_pong_launch_is_their_wrapper(public, module):
    """The timed launch (our buffers, angles as a stride-0 head view, two state sets alternating) computes what their
    wrapper does, step after step."""
    from replaygen.harness import InputFactory

    factory = InputFactory(MAMBA3, TINY, DEVICE, torch.float32, seed=4)
    weights = factory.weights()
    inputs = [factory.step(2, use_gate=False)]
    kernel = vs.PublicDecode(public, MAMBA3, inputs, weights, 2, DEVICE)
    states = tuple(t.clone() for t in kernel.sets[0][0])
    args = vs.public_args(MAMBA3, inputs[0], weights)
    assert args["Angles"].stride(1) == 0
    for _ in range(3):
        want, after = public.mamba3_siso_step(**args, Input_States=states)
        kernel.step(copy_value=True)
        got_states = kernel.sets[0][kernel.phase]
        assert torch.equal(kernel.out[0], want)
        for mine, theirs in zip(got_states, after):
            assert torch.equal(mine, theirs.to(mine.dtype))
        states = tuple(t.clone() for t in after)


@needs_public
def test_cli_check_on_a_tiny_spec(tmp_path):
    """The script end to end on the CPU (--exact-trig, the check alone): a spec of one tiny SISO shape."""
    if HAS_GPU:
        pytest.skip("the CLI times on a GPU")
    text = (ROOT / "specs" / "mamba3.yaml").read_text()
    text = text[: text.index("\nshapes:")] + "\nshapes:\n  tiny: {heads: 4, key_heads: 2, value_dim: 16, key_dim: 16, capacity: 8, window: 2}\n"
    load_spec_text(text)  # a valid spec
    (tmp_path / "tiny.yaml").write_text(text)
    out = tmp_path / "r.json"
    vs.main(["--public", str(PUBLIC), "--spec", str(tmp_path / "tiny.yaml"), "--shape", "tiny", "--exact-trig", "--check-steps", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["exact_trig"] and record["checks"]["float32"]["ok"], record["checks"]


@needs_public
def test_their_output_is_a_bfloat16_readout_of_the_same_state(public, module):
    """Their outputs differ from ours only by their readout's bfloat16 dot: recomputed from their own new state and
    rotated query with both truncated to bfloat16 (as Triton 3.6's interpreter converts), plus D x and the gate, they
    agree to float32 rounding."""
    if HAS_GPU:
        pytest.skip("the interpreter's bfloat16 truncation; a GPU rounds to nearest")
    from replaygen.harness import InputFactory, relative_error

    factory = InputFactory(MAMBA3, TINY, DEVICE, torch.float32, seed=3)
    weights = factory.weights()
    init = factory.full_states(module, 2)
    step = factory.step(2)
    args = vs.public_args(MAMBA3, step, weights)
    y, (angle, state, _, _) = public.mamba3_siso_step(**args, Input_States=vs.public_states(init))
    q = args["Q"].repeat_interleave(TINY.heads // TINY.key_heads, 1) + args["Q_bias"][None]
    pairs = angle.shape[-1]
    even, odd = q[..., : 2 * pairs : 2].clone(), q[..., 1 : 2 * pairs : 2].clone()
    q[..., : 2 * pairs : 2] = even * torch.cos(angle) - odd * torch.sin(angle)
    q[..., 1 : 2 * pairs : 2] = even * torch.sin(angle) + odd * torch.cos(angle)

    def truncated(t):
        return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32)

    want = torch.einsum("bhpn,bhn->bhp", truncated(state), truncated(q)) + args["D"][None, :, None] * step["x"]
    want = want * step["z"] * torch.sigmoid(step["z"])
    assert relative_error(y, want) < 1e-6
