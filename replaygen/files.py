"""Writing files atomically, and only when their content changes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_if_changed(path: Path, text: str) -> bool:
    """Atomically write `text` to `path` unless it already holds exactly that; True if written. A new file gets the
    mode the process's umask gives new files (mkstemp's own is 0600), a rewritten one keeps its mode."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _file_mode(path: Path) -> int:
    """The permission bits `path` has, or those a new file gets under the current umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
