"""A YAML loader that keeps a source location on every mapping, sequence and scalar.

PyYAML's composer gives nodes with marks; we turn them into small located values instead of
plain dicts so that every later check can point at the exact line and column. Duplicate keys
are errors (plain PyYAML silently keeps the last one). Keys stay strings exactly as written,
so YAML 1.1 surprises (``NO: 1`` becoming ``False: 1``) cannot happen to names.

Before anything is composed, two cheap passes make sure that composing is safe: a scan of the
characters (controls, odd line breaks and bidirectional controls, each at its line and column) and
an iterative pass over the parser's events that refuses anchors, aliases and explicit tags and
bounds the nesting depth. So an alias bomb, a self-referencing alias or thousands of nested
brackets are diagnostics, never unbounded memory or a RecursionError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

import yaml

from .diagnostics import Diagnostic, Loc, SchemaError, quote
from .limits import MAX_INT_LITERAL_CHARS, MAX_SCHEMA_CHARS, MAX_YAML_DEPTH


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


def _text_loc(display_name: str, text: str, index: int) -> Loc:
    line_start = text.rfind("\n", 0, index) + 1
    return Loc(display_name, text.count("\n", 0, index) + 1, index - line_start + 1)


def normalise_text(text: str) -> str:
    """The text that is parsed and hashed: LF line endings (a CRLF or CR checkout of kernels.yaml is
    the same schema) and no byte-order mark."""
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


# Characters refused anywhere in a schema, comments included, with why.
_CHARACTER_RULES = (
    # What YAML itself refuses (PyYAML's Reader: it would report them at 1:1, as a character offset).
    (re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"),
     "control character {cp} is not allowed in a schema"),
    # Line breaks of YAML 1.1 that editors and `grep -n` do not count: every later line number would be off.
    (re.compile("[\x85\u2028\u2029]"), "line break {cp} is not allowed in a schema; use a plain newline"),
    # Trojan Source: text that displays in another order than it is parsed.
    (re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"),
     "bidirectional control character {cp} is not allowed in a schema (it makes text display in a "
     "different order than it is read)"),
)
MAX_CHARACTER_ERRORS = 10


def _character_errors(text: str, display_name: str) -> list[Diagnostic]:
    hits = sorted((m.start(), message) for pattern, message in _CHARACTER_RULES for m in pattern.finditer(text))
    errors = []
    for index, message in hits[:MAX_CHARACTER_ERRORS]:
        errors.append(Diagnostic(_text_loc(display_name, text, index), message.format(cp=f"U+{ord(text[index]):04X}")))
    if len(hits) > MAX_CHARACTER_ERRORS:
        index = hits[MAX_CHARACTER_ERRORS][0]
        errors.append(Diagnostic(_text_loc(display_name, text, index),
                                 f"{len(hits) - MAX_CHARACTER_ERRORS} more characters that are not allowed, "
                                 f"from here on"))
    return errors


def _syntax_error(exc: yaml.YAMLError, display_name: str, text: str) -> Diagnostic:
    if isinstance(exc, yaml.reader.ReaderError):  # a character offset (_CHARACTER_RULES should prevent it)
        return Diagnostic(_text_loc(display_name, text, exc.position), f"YAML error: {exc.reason}")
    if not isinstance(exc, yaml.MarkedYAMLError):
        return Diagnostic(Loc(display_name, 1, 1), f"YAML error: {exc}")
    mark = exc.problem_mark or exc.context_mark
    loc = _loc(display_name, mark) if mark else Loc(display_name, 1, 1)
    problem = exc.problem or "invalid YAML"
    context = f" ({exc.context})" if exc.context else ""
    if exc.context and exc.context_mark and exc.problem_mark and exc.context_mark.line != exc.problem_mark.line:
        # Point back at the construct that is left open (e.g. a flow mapping started lines above).
        context = f" ({exc.context} started at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
    return Diagnostic(loc, f"YAML syntax error: {problem}{context}")


class _Anchor:
    def __init__(self, name: str, loc: Loc) -> None:
        self.name, self.loc, self.uses, self.first_use = name, loc, 0, 0


def _event_errors(text: str, display_name: str, loader) -> tuple[list[Diagnostic], bool]:
    """(errors, whether one is a YAML syntax error): anchors, aliases, explicit tags and nesting past
    MAX_YAML_DEPTH, from the parser's events. Iterative, and it stops where the nesting goes too deep:
    PyYAML's pure-Python scanner is quadratic in the nesting depth (1000 levels take seconds)."""
    errors, anchors, current = [], [], {}
    depth, syntax = 0, False
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                anchor = current.get(event.anchor)
                if anchor is None:
                    errors.append(Diagnostic(_loc(display_name, event.start_mark),
                                             f"YAML aliases are not supported: {quote('*' + event.anchor)} "
                                             f"refers to no anchor"))
                else:
                    anchor.uses += 1
                    anchor.first_use = anchor.first_use or event.start_mark.line + 1
                continue
            if not isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                if isinstance(event, yaml.CollectionEndEvent):
                    depth -= 1
                continue
            loc = _loc(display_name, event.start_mark)
            if event.anchor is not None:  # a redefined name: later aliases refer to the new anchor
                anchors.append(_Anchor(event.anchor, loc))
                current[event.anchor] = anchors[-1]
            if event.tag is not None:
                tag = event.tag.replace("tag:yaml.org,2002:", "!!", 1)  # as it is usually written
                errors.append(Diagnostic(loc, f"YAML tags are not supported: {quote(tag)}; write the plain value"))
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    errors.append(Diagnostic(loc, f"YAML nesting is deeper than {MAX_YAML_DEPTH} levels"))
                    break
    except yaml.YAMLError as exc:
        errors.append(_syntax_error(exc, display_name, text))
        syntax = True
    for a in anchors:
        if a.uses:
            errors.append(Diagnostic(a.loc, f"YAML anchors and aliases are not supported: {quote('&' + a.name)} is "
                                            f"used by {a.uses} alias{'es' if a.uses != 1 else ''} (first at line "
                                            f"{a.first_use}); write the value out where it is used"))
        else:
            errors.append(Diagnostic(a.loc, f"YAML anchors are not supported: remove {quote('&' + a.name)}"))
    return errors, syntax


class _PureLoader(yaml.SafeLoader):
    """PyYAML's pure-Python loader without its quadratic look-ahead on deep flow nesting.

    Its scanner keeps one possible simple key per flow level and rescans all of them for every token
    it reads ahead (up to 1024 characters), so `[[[[...` costs O(depth) per token: 1000 levels take
    seconds, 100k levels forever. Past MAX_YAML_DEPTH flow levels a bracket or scalar is not
    remembered as a possible key. That changes no token or event at a shallower depth, and the event
    pre-pass stops at the first collection past MAX_YAML_DEPTH anyway."""

    def save_possible_simple_key(self):
        if self.flow_level <= MAX_YAML_DEPTH:
            super().save_possible_simple_key()


def _loaders():
    """libyaml when present (much faster), then the pure-Python loader: on a syntax error the
    pure-Python result is used, so that messages are the same on every machine."""
    fast = getattr(yaml, "CSafeLoader", None)
    return (fast, _PureLoader) if fast is not None else (_PureLoader,)


class _Converter:
    def __init__(self, display_name: str) -> None:
        self.display_name = display_name
        self.constructor = yaml.SafeLoader("")  # only its scalar constructors are used
        self.errors: list[Diagnostic] = []

    def scalar(self, node: yaml.ScalarNode, loc: Loc) -> object:
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_INT_LITERAL_CHARS:
            self.errors.append(Diagnostic(loc, f"integer literal of {len(node.value)} characters is too long "
                                               f"(at most {MAX_INT_LITERAL_CHARS}; schema integers fit in 64 bits)"))
            return node.value
        try:
            return self.constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:  # e.g. a timestamp like 2001-02-30
            reason = exc.problem if isinstance(exc, yaml.MarkedYAMLError) and exc.problem else str(exc)
            self.errors.append(Diagnostic(loc, f"invalid scalar {quote(node.value)}: {reason}"))
            return node.value

    def convert(self, node: yaml.Node) -> YNode:
        # Recursion is bounded by MAX_YAML_DEPTH (checked on the events before composing).
        loc = _loc(self.display_name, node.start_mark)
        if isinstance(node, yaml.ScalarNode):
            return YScalar(self.scalar(node, loc), loc, node.value)
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
                        key_loc, f"duplicate key {quote(key)} (first defined at line {first.line})"))
                    continue
                seen[key] = key_loc
                entries.append((YScalar(key, key_loc, key), self.convert(value_node)))
            return YMap(tuple(entries), loc)
        raise AssertionError(f"unexpected YAML node {node!r}")  # aliases are refused before composing


def load_yaml(text: str, display_name: str) -> YNode:
    """Parse ``text``; raise SchemaError (never a bare YAML traceback) on any problem."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise SchemaError([Diagnostic(Loc(display_name, 1, 1), f"the schema is {len(text)} characters long; at "
                                                               f"most {MAX_SCHEMA_CHARS} are supported")])
    text = normalise_text(text)
    errors = _character_errors(text, display_name)
    if errors:
        raise SchemaError(errors)
    for loader in _loaders():
        errors, syntax = _event_errors(text, display_name, loader)
        if not errors:
            try:
                node = yaml.compose(text, Loader=loader)
                break
            except yaml.YAMLError as exc:  # e.g. a second document
                errors, syntax = [_syntax_error(exc, display_name, text)], True
        if not syntax:  # the pre-pass's own diagnostics read the same from either parser
            break
    if errors:
        raise SchemaError(errors)
    if node is None:
        raise SchemaError([Diagnostic(Loc(display_name, 1, 1), "the schema is empty")])
    converter = _Converter(display_name)
    root = converter.convert(node)
    if converter.errors:
        raise SchemaError(converter.errors)
    return root
