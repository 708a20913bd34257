"""What a tuning trial timed: the kernel key of one config of one kernel kind.

A trial renders a candidate module (the config for its kind, the documented defaults for every other kind) and
times the module functions `TIMED_ENTRY_POINTS` names for its kind. Its key is a digest of the code those functions
reach in the candidate: the top-level definitions they name, transitively, each in a canonical form of its syntax
tree. So comments, docstrings, blank lines, line breaks, spacing and the order of definitions leave the key as it
was, and so do the module's argument checks (`ARGUMENT_CHECK_PREFIX`: host code that runs before a launch, never
inside the CUDA graph a trial times). Everything else the timed code holds changes it: kernel text, launch code,
the shape's sizes baked in as constants, the config in the candidate's dispatch table.

The key also lists a short digest per reached definition (`KernelKey.parts`), so a record whose key no longer
matches can say which definitions changed.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass

from replaygen.codegen import render_module
from replaygen.configs import BucketConfig, KernelConfig, KernelKind, module_defaults
from replaygen.plan import plan_module
from replaygen.spec.model import Spec, TargetShape

# The module functions a trial of each kind runs (replaygen.measure's workloads: allocation, then the timed step).
TIMED_ENTRY_POINTS: dict[KernelKind, tuple[str, ...]] = {
    KernelKind.BASELINE_DECODE: ("allocate_baseline", "baseline_decode"),
    KernelKind.REPLAY_DECODE: ("allocate", "decode"),
    KernelKind.REPLAY_VERIFY: ("allocate", "verify", "commit"),
    KernelKind.BASELINE_VERIFY: ("allocate_snapshots", "baseline_verify", "baseline_commit"),
    KernelKind.MATERIALIZE: ("allocate", "materialize"),
    KernelKind.LOAD: ("allocate", "load"),
    KernelKind.COMMIT: ("allocate", "commit"),
}
# Top-level functions whose names start with this only check their arguments (they raise on bad input and return an
# argument, a size read from one, or the documented output buffer): left out of a key, with the statements that only
# call one.
ARGUMENT_CHECK_PREFIX = "_check_"
# Candidates are rendered for no particular GPU: the GPU name stays out of the key.
CANDIDATE_GPU = "any"
CANDIDATE_SOURCE = "tune candidate"
PART_DIGEST_CHARS = 12


@dataclass(frozen=True)
class KernelKey:
    """The code one kernel kind's timed functions reach: its digest, and a short digest per definition reached."""

    kind: KernelKind
    code: str  # sha256 hex of the canonical form of every reached definition
    parts: tuple[tuple[str, str], ...]  # (definition name, first PART_DIGEST_CHARS of its own digest), by name


@dataclass(frozen=True)
class Candidate:
    """One config of one kernel kind, rendered: the module a trial imports, checks and times."""

    key: KernelKey
    config: KernelConfig
    source: str

    @property
    def kind(self) -> KernelKind:
        return self.key.kind


def candidate_tables(spec: Spec, shape: TargetShape, kind: KernelKind, config: KernelConfig) -> dict[KernelKind, tuple[BucketConfig, ...]]:
    """The dispatch tables of a candidate: `config` for `kind` (every bucket), the defaults for every other kind."""
    tables = module_defaults(spec, shape)
    tables[kind] = (BucketConfig(None, config),)
    return tables


def render_candidate(spec: Spec, shape: TargetShape, kind: KernelKind, config: KernelConfig) -> Candidate:
    """The module that runs `config` for `kind` at every batch size, and its key (UnsupportedShapeError if the
    config is not valid for the shape)."""
    tables = candidate_tables(spec, shape, kind, config)
    source = render_module(plan_module(spec, shape, CANDIDATE_GPU, tables, CANDIDATE_SOURCE))
    return Candidate(key=kernel_key(source, kind), config=config, source=source)


def kernel_key(source: str, kind: KernelKind) -> KernelKey:
    """The key of the code `source` (a generated module) runs for `kind`'s timed functions."""
    parts = reached_definitions(source, TIMED_ENTRY_POINTS[kind])
    digest = hashlib.sha256()
    named = []
    for name, text in parts:
        digest.update(f"{name}\0{text}\0".encode())
        named.append((name, hashlib.sha256(text.encode()).hexdigest()[:PART_DIGEST_CHARS]))
    return KernelKey(kind=kind, code=digest.hexdigest(), parts=tuple(named))


def reached_definitions(source: str, roots: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, canonical form) of every top-level definition of `source` that `roots` reach by name, transitively,
    sorted by name; argument checks are not followed. A definition binding several names (an import of two
    modules) is listed once, under its first name."""
    tree = ast.parse(source)
    defined: dict[str, ast.stmt] = {}
    for node in tree.body:
        for name in _defined_names(node):
            defined.setdefault(name, node)
    missing = [name for name in roots if name not in defined]
    if missing:
        raise KeyError(f"the module defines no {', '.join(missing)}")
    reached: dict[int, tuple[str, ast.stmt]] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        node = defined[name]
        if id(node) in reached:
            continue
        reached[id(node)] = (_defined_names(node)[0], node)
        for inner in ast.walk(node):
            if isinstance(inner, ast.Name) and inner.id in defined and not inner.id.startswith(ARGUMENT_CHECK_PREFIX):
                pending.append(inner.id)
    return sorted((name, canonical(node)) for name, node in reached.values())


def canonical(node: ast.AST) -> str:
    """A canonical text of `node`'s syntax tree: node types and fields, empty and unset fields left out, without
    docstrings or statements that only call an argument check. The same on every Python version this runs on."""
    if isinstance(node, list):
        items = [canonical(item) for item in node if not _skipped(item)]
        return "[" + ",".join(items) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name in node._fields:
        value = getattr(node, name, None)
        if value is None or value == [] or name in ("ctx", "type_comment"):
            continue
        if name == "body" and isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and value and _is_docstring(value[0]):
            value = value[1:]
        fields.append(f"{name}={canonical(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


def _skipped(node: object) -> bool:
    """A statement that only calls an argument check."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func
        return isinstance(func, ast.Name) and func.id.startswith(ARGUMENT_CHECK_PREFIX)
    return False


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [alias.asname or alias.name.split(".")[0] for alias in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)]


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
