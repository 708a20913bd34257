"""Importing generated modules: from a file, or straight from a plan (rendered into a cache)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from replaygen.codegen import render_module, source_hash
from replaygen.files import write_if_changed
from replaygen.configs import BucketConfig, KernelKind, module_defaults
from replaygen.errors import ReplaygenError
from replaygen.plan import plan_module
from replaygen.spec.model import Spec, TargetShape


def require_interpreter_support() -> None:
    """Fail clearly where the Triton interpreter cannot run our kernels (data-dependent loop bounds)."""
    import numpy

    major, minor = (int(part) for part in numpy.__version__.split(".")[:2])
    if (major, minor) >= (2, 4):
        raise ReplaygenError(
            f"the Triton interpreter (CPU checks) cannot run kernels with data-dependent loop bounds under numpy {numpy.__version__}; "
            "install numpy<2.4 (pip install 'numpy<2.4'), or run on a GPU"
        )


def cache_dir() -> Path:
    """Where modules rendered on the fly are written (Triton needs kernels in real files)."""
    root = os.environ.get("REPLAYGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "replaygen")
    return Path(root) / "modules"


def import_path(path: str | Path) -> ModuleType:
    """Import a generated module from its file."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no generated module at {path}")
    name = f"replaygen_generated_{path.stem}_{source_hash(str(path))[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    return import_file(name, path)


def import_file(name: str, path: str | Path) -> ModuleType:
    """Import the Python file at `path` as module `name` (registered in sys.modules before it runs, so the file's own
    imports of `name`, and dataclasses defined in it, find it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def import_source(source: str, stem: str) -> ModuleType:
    """Write `source` into the cache (named by its hash) and import it."""
    path = cache_dir() / f"{stem}_{source_hash(source)[:16]}.py"
    write_if_changed(path, source)
    return import_path(path)


def load_kernels(
    spec: Spec,
    shape: TargetShape,
    configs: dict[KernelKind, tuple[BucketConfig, ...]] | None = None,
    gpu: str = "any",
    config_source: str = "defaults",
) -> ModuleType:
    """Render and import the kernels of one shape (defaults where `configs` leaves a kernel out)."""
    chosen = module_defaults(spec, shape)
    chosen.update(configs or {})
    plan = plan_module(spec, shape, gpu, chosen, config_source)
    return import_source(render_module(plan), plan.module_name)
