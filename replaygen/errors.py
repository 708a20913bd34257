"""Error types with enough context to act on."""

from __future__ import annotations


class ReplaygenError(Exception):
    """Base class of every error replaygen raises on bad input."""


class SpecError(ReplaygenError):
    """A spec file is malformed or violates a rule; names file, line and YAML path."""

    def __init__(self, file: str, line: int | None, path: str, message: str):
        self.file = file
        self.line = line
        self.path = path
        self.message = message
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: at '{path}': {message}")


class UnsupportedShapeError(ReplaygenError):
    """A shape or configuration that no kernel of this version can serve."""


class TuningRecordError(ReplaygenError):
    """A tuning record is missing, corrupt or does not match the kernel/environment."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`Type: message` of an exception on one line, cut to `limit` characters (compile errors run to pages)."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
