"""YAML parsed into nodes that remember their line and path, so errors can point at them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from replaygen.errors import SpecError


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


def parse_yaml(text: str, file: str) -> Node:
    """Parse YAML text into a Node tree; syntax errors and duplicate keys become SpecErrors."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
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
            key = yaml.SafeLoader.construct_scalar(yaml.SafeLoader(""), key_node) if isinstance(key_node, yaml.ScalarNode) else None
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
    loader = yaml.SafeLoader("")
    try:
        value = loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise SpecError(file, line, path, f"invalid scalar: {exc}") from None
    return Node(value, line, path, file)
