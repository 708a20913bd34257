"""YAML parsed into nodes that remember their line and path, so errors can point at them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from replaygen.errors import SpecError

# A spec nests four levels deep (top > shapes > shape > size); the composer recurses once per level.
MAX_NESTING = 32


@dataclass(frozen=True)
class Node:
    """A YAML value with its source position. `value` is a python scalar, dict or list of Nodes."""

    value: Any
    line: int
    path: str
    file: str
    key_lines: dict[str, int] = field(default_factory=dict)

    def error(self, message: str, key: str | None = None) -> SpecError:
        """A SpecError located at this node (or at one of its keys)."""
        if key is not None:
            return SpecError(self.file, self.key_lines.get(key, self.line), _join(self.path, key), message)
        return SpecError(self.file, self.line, self.path, message)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


class _SpecLoader(yaml.SafeLoader):
    """A SafeLoader that resolves plain scalars by YAML 1.2's core schema (null, true/false, decimal integers,
    floats such as 1e-6 or .inf; not YAML 1.1's octal 016, sexagesimal 1:00, yes/no booleans or dates) and, while
    composing, rejects anchors and aliases (so no alias bomb expands) and nesting deeper than MAX_NESTING (before
    it exhausts the stack)."""

    yaml_implicit_resolvers: dict[str | None, list[tuple[str, re.Pattern[str]]]] = {}  # only CORE_SCHEMA's, below

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        event = self.peek_event()
        if event.anchor is not None:
            what = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise yaml.composer.ComposerError(None, None, f"{what}{event.anchor}: anchors and aliases are not allowed in a spec", event.start_mark)
        if self.depth == MAX_NESTING:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_NESTING} levels", event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _construct_int(loader: _SpecLoader, node: yaml.ScalarNode) -> int:
    value = loader.construct_scalar(node)
    try:
        return int(value)
    except ValueError as exc:
        raise yaml.constructor.ConstructorError(None, None, f"not an integer ({exc})", node.start_mark) from None


def _construct_float(loader: _SpecLoader, node: yaml.ScalarNode) -> float:
    value = loader.construct_scalar(node)
    special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
    if value.lower() in special:
        return special[value.lower()]
    try:
        return float(value)
    except ValueError as exc:
        raise yaml.constructor.ConstructorError(None, None, f"not a number ({exc})", node.start_mark) from None


# Plain scalars by YAML 1.2's core schema (section 10.3.2, without its 0o and 0x integers): tag, regex, first characters.
CORE_SCHEMA = (
    ("null", r"~|null|Null|NULL|", ("~", "n", "N", "")),
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?[0-9]+", "-+0123456789"),
    ("float", r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", "-+.0123456789"),
)
for tag, pattern, first in CORE_SCHEMA:
    _SpecLoader.add_implicit_resolver(f"tag:yaml.org,2002:{tag}", re.compile(rf"(?:{pattern})\Z"), list(first))
_SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_SpecLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def parse_yaml(text: str, file: str) -> Node:
    """Parse YAML text into a Node tree; syntax errors and duplicate keys become SpecErrors."""
    try:
        root = yaml.compose(text, Loader=_SpecLoader)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise SpecError(file, line, "", f"invalid YAML: character #x{exc.character:04x} is not allowed ({exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise SpecError(file, line, "", f"invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if root is None:
        raise SpecError(file, 1, "", "the file is empty")
    return _convert(root, "", file)


def _convert(node: yaml.Node, path: str, file: str) -> Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        items: dict[str, Node] = {}
        key_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = _SpecLoader("").construct_scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            key_line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise SpecError(file, key_line, path, "mapping keys must be plain strings")
            if key in items:
                raise SpecError(file, key_line, _join(path, key), f"duplicate key '{key}' (first at line {key_lines[key]})")
            key_lines[key] = key_line
            items[key] = _convert(value_node, _join(path, key), file)
        return Node(items, line, path, file, key_lines)
    if isinstance(node, yaml.SequenceNode):
        return Node([_convert(item, _join(path, i), file) for i, item in enumerate(node.value)], line, path, file)
    loader = _SpecLoader("")
    try:
        value = loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise SpecError(file, line, path, f"invalid scalar: {getattr(exc, 'problem', exc)}") from None
    return Node(value, line, path, file)
