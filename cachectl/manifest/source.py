"""YAML with line numbers: every later step can point a message at ``file:line: field``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

Loc = tuple[str | int, ...]


# Lists and mappings inside one another: a manifest needs a handful of levels. PyYAML composes,
# and everything after it walks, a document recursively: thousands of levels were a RecursionError
# traceback, so a deeper one is refused while it is composed, at its line.
MAX_MANIFEST_DEPTH = 64


class Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML would silently keep the last one) and
    documents nested more than MAX_MANIFEST_DEPTH levels."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_MANIFEST_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"lists and mappings nest more than {MAX_MANIFEST_DEPTH} levels deep",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable key: let PyYAML report it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {first})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# A manifest is a few hundred YAML nodes; one that expands (through aliases) to more than


def expanded_size(root: yaml.Node, limit: int) -> int:
    """How many nodes the document has once every alias is expanded, stopping past ``limit``.
    Each distinct node is sized once (memoized), so this is linear in the text."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # a recursive alias counts once
        total = 1
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                total += size(key_node) + size(value_node)
                if total > limit:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > limit:
                    break
        sizes[id(node)] = total
        return total

    return size(root)


def line_map(loader: Loader, root: yaml.Node) -> dict[Loc, int]:
    """Map each path in the document to its 1-based line: a mapping entry's key line, a list item's line."""
    lines: dict[Loc, int] = {(): root.start_mark.line + 1}

    def walk(node: yaml.Node, loc: Loc, active: frozenset[int]) -> None:
        if id(node) in active:  # a recursive alias
            return
        active = active | {id(node)}
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:  # merges were flattened in place on load
                try:
                    key = loader.construct_object(key_node, deep=True)
                    hash(key)
                except Exception:
                    continue
                lines[loc + (key,)] = key_node.start_mark.line + 1
                walk(value_node, loc + (key,), active)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[loc + (i,)] = item.start_mark.line + 1
                walk(item, loc + (i,), active)

    walk(root, (), frozenset())
    return lines


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a manifest came from, so any later step can point at a line."""

    name: str
    directory: Path | None
    lines: Mapping[Loc, int]

    def line(self, loc: Loc) -> int:
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.lines:
                return self.lines[loc[:end]]
        return 1

    def message(self, loc: Loc, problem: str) -> str:
        field = _field_path(loc)
        return f"{self.name}:{self.line(loc)}: {field + ': ' if field else ''}{problem}"


NO_SOURCE = Source("<manifest>", None, {})


def _field_path(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{part!r}]"
    return out


def describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return "nothing" if value is None else f"{type(value).__name__} {text}"
