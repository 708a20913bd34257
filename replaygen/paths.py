"""Where replaygen finds specs, tuning records and generated modules, and how GPU folders are named.

The shipped specs, records and modules are the repository's top-level specs/, tune/ and generated/ folders when
replaygen runs from a checkout (an editable install), and their copies in the package (replaygen/shipped/) when it
was installed from a wheel. A spec file's own records and modules belong to its project: the folder above the spec's
folder when that is named specs/ (DIR/specs/x.yaml: DIR/tune, DIR/generated), else the spec's folder itself. Every
command takes flags to put them elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from replaygen.errors import ReplaygenError

PACKAGE = Path(__file__).resolve().parent
GPU_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")  # the whole name (fullmatch), after lowercasing
SPECS, RECORDS, MODULES = "specs", "tune", "generated"


def shipped(folder: str) -> Path:
    """The shipped `folder` (SPECS, RECORDS or MODULES): the checkout's, else the installed package's copy."""
    checkout = PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / folder).is_dir():
        return checkout / folder
    return PACKAGE / "shipped" / folder


def spec_file(name: str) -> Path:
    """The spec file a command names: a path, or the name of a shipped spec ('gdn' or 'gdn.yaml')."""
    path = Path(name)
    if path.is_file():
        return path
    if len(path.parts) == 1:
        shipped_path = shipped(SPECS) / (name if name.endswith(".yaml") else f"{name}.yaml")
        if shipped_path.is_file():
            return shipped_path
    names = ", ".join(sorted(p.stem for p in shipped(SPECS).glob("*.yaml")))
    raise ReplaygenError(f"no spec file {name!r} (not a file here, nor a shipped spec: {names or 'none found'})")


def project_of(spec_path: Path) -> Path:
    """The folder a spec's records and modules live in (see the module docstring)."""
    return project_of_folder(Path(spec_path).resolve().parent)


def project_of_folder(specs_folder: Path) -> Path:
    """The project a folder of spec files belongs to: the folder above it when it is named specs/, else itself."""
    folder = Path(specs_folder).resolve()
    return folder.parent if folder.name == SPECS else folder


def records_dir(spec_path: Path) -> Path:
    """The default tuning-records folder of the spec at `spec_path`."""
    return project_of(spec_path) / RECORDS


def modules_dir(spec_path: Path) -> Path:
    """The default output folder of `build` for the spec at `spec_path`: its project's generated/, or generated/ in
    the current folder for a spec inside an installed package (never into site-packages)."""
    project = project_of(spec_path)
    if PACKAGE in project.parents or project == PACKAGE:
        return Path(MODULES)
    return project / MODULES


def gpu_name(name: str, flag: str = "--gpu") -> str:
    """A GPU name as records and module folders are named (lowercase: 'H200' is 'h200'); ReplaygenError naming
    `flag` where it cannot name a folder."""
    lowered = name.lower()
    if not GPU_NAME.fullmatch(lowered):
        raise ReplaygenError(f"{flag} {name!r} must be letters, digits, '-' or '_' (e.g. h200)")
    return lowered


def gpus_with_records(tune_dir: Path) -> list[str]:
    """The GPU folders under `tune_dir`."""
    return sorted(p.name for p in Path(tune_dir).iterdir() if p.is_dir()) if Path(tune_dir).is_dir() else []
