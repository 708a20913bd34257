"""Test setup: Triton runs in its interpreter on the CPU unless a GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from replaygen.runtime import require_interpreter_support

    require_interpreter_support()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from replaygen.spec import load_spec  # noqa: E402
from replaygen.spec.model import TargetShape  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"


def pytest_configure(config):
    os.environ.setdefault("REPLAYGEN_CACHE", str(Path(config.rootpath) / ".pytest_cache" / "replaygen"))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mamba2():
    return load_spec(ROOT / "specs" / "mamba2.yaml")


SMALL = TargetShape("small", heads=4, key_heads=2, value_dim=8, key_dim=16, capacity=4, window=1)
ODD = TargetShape("odd", heads=6, key_heads=3, value_dim=12, key_dim=20, capacity=5, window=2)
