"""A YAML loader that keeps a source location on every mapping, sequence and scalar.

PyYAML's composer gives nodes with marks; we turn them into small located values instead of
plain dicts so that every later check can point at the exact line and column. Duplicate keys
are errors (plain PyYAML silently keeps the last one). Keys stay strings exactly as written,
so YAML 1.1 surprises (``NO: 1`` becoming ``False: 1``) cannot happen to names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import yaml

from .diagnostics import Diagnostic, Loc, SchemaError


@dataclass(frozen=True)
class YScalar:
    value: object  # int, str, bool, float or None as YAML 1.1 resolves it
    loc: Loc
    text: str = ""  # the scalar as written


@dataclass(frozen=True)
class YSeq:
    items: tuple["YNode", ...]
    loc: Loc


@dataclass(frozen=True)
class YMap:
    entries: tuple[tuple[YScalar, "YNode"], ...]  # (key, value) in source order
    loc: Loc

    def get(self, key: str) -> "YNode | None":
        for k, v in self.entries:
            if k.value == key:
                return v
        return None

    def key_loc(self, key: str) -> Loc:
        for k, _ in self.entries:
            if k.value == key:
                return k.loc
        return self.loc


YNode = Union[YScalar, YSeq, YMap]


def _loc(display_name: str, mark) -> Loc:
    return Loc(display_name, mark.line + 1, mark.column + 1)


class _Converter:
    def __init__(self, display_name: str) -> None:
        self.display_name = display_name
        self.constructor = yaml.SafeLoader("")  # only its scalar constructors are used
        self.errors: list[Diagnostic] = []

    def convert(self, node: yaml.Node) -> YNode:
        loc = _loc(self.display_name, node.start_mark)
        if isinstance(node, yaml.ScalarNode):
            try:
                value = self.constructor.construct_object(node, deep=True)
            except yaml.YAMLError as exc:  # e.g. a malformed timestamp
                self.errors.append(Diagnostic(loc, f"invalid scalar: {exc}"))
                value = node.value
            return YScalar(value, loc, node.value)
        if isinstance(node, yaml.SequenceNode):
            return YSeq(tuple(self.convert(n) for n in node.value), loc)
        if isinstance(node, yaml.MappingNode):
            entries = []
            seen: dict[str, Loc] = {}
            for key_node, value_node in node.value:
                key_loc = _loc(self.display_name, key_node.start_mark)
                if not isinstance(key_node, yaml.ScalarNode):
                    self.errors.append(Diagnostic(key_loc, "mapping keys must be plain names"))
                    continue
                key = key_node.value
                if key in seen:
                    first = seen[key]
                    self.errors.append(Diagnostic(
                        key_loc, f"duplicate key '{key}' (first defined at line {first.line})"))
                    continue
                seen[key] = key_loc
                entries.append((YScalar(key, key_loc, key), self.convert(value_node)))
            return YMap(tuple(entries), loc)
        raise AssertionError(f"unexpected YAML node {node!r}")  # aliases are resolved by compose


def _compose(text: str):
    """Compose with libyaml when present (15x faster); on any error, re-parse with the pure-Python
    loader so that error messages are the same on every machine."""
    fast = getattr(yaml, "CSafeLoader", None)
    if fast is not None:
        try:
            return yaml.compose(text, Loader=fast)
        except yaml.YAMLError:
            pass
    return yaml.compose(text, Loader=yaml.SafeLoader)


def load_yaml(text: str, display_name: str) -> YNode:
    """Parse ``text``; raise SchemaError (never a bare YAML traceback) on any problem."""
    try:
        node = _compose(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = _loc(display_name, mark) if mark else Loc(display_name, 1, 1)
        problem = exc.problem or "invalid YAML"
        context = f" ({exc.context})" if exc.context else ""
        if exc.context and exc.context_mark and exc.problem_mark and exc.context_mark.line != exc.problem_mark.line:
            # Point back at the construct that is left open (e.g. a flow mapping started lines above).
            context = f" ({exc.context} started at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
        raise SchemaError([Diagnostic(loc, f"YAML syntax error: {problem}{context}")]) from None
    except yaml.YAMLError as exc:
        raise SchemaError([Diagnostic(Loc(display_name, 1, 1), f"YAML error: {exc}")]) from None
    if node is None:
        raise SchemaError([Diagnostic(Loc(display_name, 1, 1), "the schema is empty")])
    converter = _Converter(display_name)
    root = converter.convert(node)
    if converter.errors:
        raise SchemaError(converter.errors)
    return root
