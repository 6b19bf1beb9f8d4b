"""Build the frozen model from located YAML, with closed key sets.

Each entry is parsed where its location is known, so every error names its line and column.
Parsing keeps going after an error (collecting them all); entries that cannot be built are left
out, and semantic checks (checks.py) run only on a schema that parsed cleanly.
"""
from __future__ import annotations

import re
import string
import unicodedata
from types import MappingProxyType
from typing import Optional

from .diagnostics import Diagnostics, Loc, closest_hint, closest_name, quote
from .facts import supply_constants, supply_real_kv_source
from .limits import MAX_ABI_VERSION, MAX_RECORD_FIELDS, MAX_TEXT_CHARS
from .model import (
    BUILTIN_FAIL_REASON_KINDS,
    CANARY_ROLES,
    CONSTANT_TYPES,
    FAIL_REASON_KINDS,
    INPUT_EXPECTED_SOURCES,
    INPUT_VALUE_SOURCES,
    LAUNCH_HALVES,
    LAUNCH_PHASES,
    LAUNCH_SHAPES,
    LAUNCH_TAG_ENUM,
    ROLE_INPUT,
    VIOLATION_CARRIES,
    WORD_TYPES,
    Chain,
    Constant,
    Field,
    InputVerify,
    Kernel,
    Launch,
    LaunchTag,
    Member,
    Message,
    Record,
    Schema,
    Specialization,
    ValueSet,
    where_of,
)
from .yaml_loader import YMap, YNode, YScalar, YSeq

TOP_KEYS = ("format", "abi_version", "constants", "records", "flags", "enums", "launch_tags", "messages", "kernels")
# real_kv_source is supplied by the generator (codegen/facts.py); an old schema may still state it.
RECORD_NAMES = ("canary", "violation", "real_kv_source")
REQUIRED_RECORDS = ("canary", "violation")
CONSTANT_KEYS = ("type", "value", "doc")
RECORD_KEYS = {
    "canary": ("word", "slot_stride_bytes", "fields", "chain", "doc"),
    "violation": ("word", "fields", "doc"),
    "real_kv_source": ("word", "fields", "doc"),
}
FIELD_KEYS = {
    "canary": ("name", "role", "offset", "source", "verify", "doc"),
    "violation": ("name", "carries", "doc"),
    "real_kv_source": ("name", "doc"),
}
CHAIN_KEYS = ("anchor", "fold")
VERIFY_KEYS = ("expected", "fail_reason")
FLAG_MEMBER_KEYS = ("value", "kind", "doc")
LAUNCH_TAG_KEYS = ("value", "phase", "half", "group", "doc")
KERNEL_KEYS = ("name", "operation", "launch", "warp_reduction", "specializations", "doc")
# A kernel key's former name -> its name: still accepted, with a note (a schema written before the
# rename keeps generating the same tree).
FORMER_KERNEL_KEYS = {"template": "operation"}
SUPPORTED_FORMATS = (1,)


def _kind(node: YNode) -> str:
    if isinstance(node, YMap):
        return "a mapping"
    if isinstance(node, YSeq):
        return "a list"
    v = node.value
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {node.text}"
    if isinstance(v, int):
        return f"the integer {node.text}"
    if isinstance(v, float):
        return f"the number {node.text}"
    if isinstance(v, str):
        return f"the string '{node.text}'"
    return f"'{node.text}'"  # dates and other YAML 1.1 scalars


# Text that ends up inside generated comments and string literals must stay on its line and must
# not close a comment or look like template syntax: this is the injection guard for free text.
_UNSAFE_TEXT = re.compile(r"[\x00-\x1f\x7f\\]|\{\{|\{%|\{#|%\}|#\}|\*/|-->")
# Beyond that: text that a reader or a compiler sees differently from what it says. Bidirectional
# controls reorder what an editor shows (Trojan Source); other invisible or non-printable characters
# hide text; a trigraph (`??=` is `#`, `??/` a backslash that continues a comment) changes C++.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_TRIGRAPH = re.compile(r"\?\?[=/'()!<>-]")
_INVISIBLE_CATEGORIES = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def text_problem(value: str) -> Optional[str]:
    """What is wrong with one line of schema text that passed _UNSAFE_TEXT (None when nothing is)."""
    if len(value) > MAX_TEXT_CHARS:
        return f"must be at most {MAX_TEXT_CHARS} characters long, got {len(value)}"
    bidi = _BIDI.search(value)
    if bidi:
        return (f"must not contain bidirectional control characters (they make text display in a different "
                f"order than it is read), found U+{ord(bidi.group()):04X}")
    hidden = next((c for c in value if unicodedata.category(c) in _INVISIBLE_CATEGORIES), None)
    if hidden is not None:
        return f"must be printable text, found U+{ord(hidden):04X}"
    trigraph = _TRIGRAPH.search(value)
    if trigraph:
        return f"must not contain the trigraph {quote(trigraph.group())} (a C or C++ compiler may replace it)"
    return None




class Parser:
    """Builds the model. Errors that leave the parsed value usable (an unknown extra key, bad doc
    text, a range problem) are *soft*: the semantic checks still run, so one pass reports them all.
    Errors that drop or replace a value are *hard*: checks on a half-built model would cascade."""

    def __init__(self, diags: Diagnostics) -> None:
        self.d = diags
        self.soft_errors = 0

    def soft(self, loc: Loc, message: str) -> None:
        self.d.error(loc, message)
        self.soft_errors += 1

    @property
    def has_hard_errors(self) -> bool:
        return len(self.d) > self.soft_errors

    # -- primitive expectations -------------------------------------------------------------
    def mapping(self, node: YNode, what: str, allowed, required=(), former=None) -> Optional[YMap]:
        """`node` as a mapping of `allowed` keys with every `required` one; `former` maps a key's former
        name to its name: a former name stands for its key (its note is the caller's)."""
        if not isinstance(node, YMap):
            self.d.error(node.loc, f"{what} must be a mapping, got {_kind(node)}")
            return None
        former = former or {}
        given = {former.get(key.value, key.value) for key, _ in node.entries}
        missing = [k for k in required if k not in given]
        explained = set()
        for key, _ in node.entries:
            if key.value in former:
                continue
            if key.value not in allowed:
                hint = closest_hint(key.value, allowed)
                message = f"unknown key '{key.value}' in {what}{hint}; allowed keys: {', '.join(allowed)}"
                meant = closest_name(key.value, missing)
                if meant:  # a misspelt required key: one error, not two
                    explained.add(meant)
                    self.d.error(key.loc, message)
                else:
                    self.soft(key.loc, message)
        for key in missing:
            if key not in explained:
                self.d.error(node.loc, f"{what} is missing required key '{key}'")
        return node

    def seq(self, node: YNode, what: str) -> Optional[YSeq]:
        if not isinstance(node, YSeq):
            self.d.error(node.loc, f"{what} must be a list, got {_kind(node)}")
            return None
        return node

    def integer(self, node: YNode, what: str) -> Optional[int]:
        if isinstance(node, YScalar) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        self.d.error(node.loc, f"{what} must be an integer, got {_kind(node)}")
        return None

    def boolean(self, node: YNode, what: str) -> Optional[bool]:
        if isinstance(node, YScalar) and isinstance(node.value, bool):
            return node.value
        self.d.error(node.loc, f"{what} must be true or false, got {_kind(node)}")
        return None

    def text(self, node: YNode, what: str) -> Optional[str]:
        if isinstance(node, YScalar) and isinstance(node.value, str):
            return node.value
        self.d.error(node.loc, f"{what} must be a string, got {_kind(node)}")
        return None

    def line(self, node: YNode, what: str) -> Optional[str]:
        """One line of plain text (docs, messages): see _UNSAFE_TEXT."""
        value = self.text(node, what)
        if value is None:
            return None
        bad = _UNSAFE_TEXT.search(value)
        problem = None if bad else text_problem(value)
        if bad:  # soft: the text is kept, and nothing is rendered while any error stands
            self.soft(node.loc, f"{what} must be one line of plain text (no control characters, backslashes, "
                                   f"template syntax or comment terminators), found {bad.group()!r}")
        elif problem:
            self.soft(node.loc, f"{what} {problem}")
        return value

    def name(self, node: YNode, what: str) -> Optional[str]:
        # Names become identifiers in Python and C++; validity is checked in checks.py so that
        # the bad name is still reported with the rest of the schema's problems.
        if isinstance(node, YScalar) and node.value is not None and not isinstance(node.value, (YMap, YSeq)):
            return node.text if node.text else str(node.value)
        self.d.error(node.loc, f"{what} must be a name, got {_kind(node)}")
        return None

    def choice(self, node: YNode, what: str, choices) -> Optional[str]:
        value = self.text(node, what)
        if value is None:
            return None
        if value not in choices:
            self.d.error(node.loc, f"{what} must be one of {', '.join(choices)}, got '{value}'"
                                   f"{closest_hint(value, choices)}")
            return None
        return value

    def opt(self, node: YMap, key: str, fn, what: str, default):
        child = node.get(key)
        if child is None:
            return default
        value = fn(child, what)
        return default if value is None else value

    # -- schema parts ----------------------------------------------------------------------
    def schema(self, root: YNode, source_name: str) -> Optional[Schema]:
        top = self.mapping(root, "the schema", TOP_KEYS, TOP_KEYS)
        if top is None:
            return None
        fmt = self.opt(top, "format", self.integer, "format", None)
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            self.soft(top.get("format").loc,
                         f"format must be one of {', '.join(map(str, SUPPORTED_FORMATS))}, got {fmt}")
        abi = self.opt(top, "abi_version", self.integer, "abi_version", None)
        if abi is not None and abi < 1:
            self.soft(top.get("abi_version").loc, f"abi_version must be >= 1, got {abi}")
        elif abi is not None and abi > MAX_ABI_VERSION:
            self.soft(top.get("abi_version").loc,
                      f"abi_version must be at most {MAX_ABI_VERSION} (it is exported as a 32-bit int), got {abi}")
        constants = self.constants(top.get("constants")) if top.get("constants") is not None else ()
        constants = supply_constants(constants, self.d, self._section_loc(top, "constants", source_name))
        records = self.records(top.get("records")) if top.get("records") is not None else {}
        flags = self.value_sets(top.get("flags"), "flag") if top.get("flags") is not None else ()
        enums = self.value_sets(top.get("enums"), "enum") if top.get("enums") is not None else ()
        launch_tags = self.launch_tags(top.get("launch_tags")) if top.get("launch_tags") is not None else ()
        if top.get("launch_tags") is not None:
            # The CanaryLaunchTag enum is generated from launch_tags (the checks see it as an enum).
            enums += (ValueSet(LAUNCH_TAG_ENUM, "enum", tuple(Member(t.name, t.value, t.loc) for t in launch_tags),
                               top.key_loc("launch_tags"), generated_from="launch_tags"),)
        prefix, messages = self.messages(top.get("messages"), constants, records) \
            if top.get("messages") is not None else ("", ())
        kernels = self.kernels(top.get("kernels")) if top.get("kernels") is not None else ()
        real_kv_source = supply_real_kv_source(records.get("real_kv_source"), self.d,
                                               self._section_loc(top, "records", source_name))
        if self.has_hard_errors or any(r not in records for r in REQUIRED_RECORDS):
            return None
        sections = MappingProxyType({k.value: k.loc for k, _ in top.entries})
        return Schema(fmt, abi, constants, records["canary"], records["violation"],
                      real_kv_source, flags, enums, prefix, messages, kernels, launch_tags, source_name,
                      sections)

    @staticmethod
    def _section_loc(top: YMap, key: str, source_name: str) -> Loc:
        return top.key_loc(key) if top.get(key) is not None else Loc(source_name, 1, 1)

    def constants(self, node: YNode) -> tuple[Constant, ...]:
        m = self.mapping(node, "constants", allowed=_AnyKey())
        out = []
        for key, value in (m.entries if m else ()):
            what = f"constant '{key.value}'"
            body = self.mapping(value, what, CONSTANT_KEYS, ("type", "value"))
            if body is None:
                continue
            ctype = self.opt(body, "type", lambda n, w: self.choice(n, w, tuple(CONSTANT_TYPES)),
                             f"{what} type", None)
            cvalue = self.opt(body, "value", self.integer, f"{what} value", None)
            doc = self.opt(body, "doc", self.line, f"{what} doc", "")
            if ctype is not None and cvalue is not None:
                out.append(Constant(key.value, ctype, cvalue, doc, key.loc, where_of(body.entries)))
        return tuple(out)

    def records(self, node: YNode) -> dict[str, Record]:
        m = self.mapping(node, "records", RECORD_NAMES, REQUIRED_RECORDS)
        out = {}
        for key, value in (m.entries if m else ()):
            if key.value in RECORD_NAMES:
                rec = self.record(key.value, value, key.loc)
                if rec is not None:
                    out[key.value] = rec
        return out

    def record(self, rname: str, node: YNode, loc: Loc) -> Optional[Record]:
        what = f"record '{rname}'"
        required = ("word", "fields") + (("slot_stride_bytes", "chain") if rname == "canary" else ())
        body = self.mapping(node, what, RECORD_KEYS[rname], required)
        if body is None:
            return None
        word = self.opt(body, "word", lambda n, w: self.choice(n, w, tuple(WORD_TYPES)), f"{what} word", None)
        fields_node = body.get("fields")
        seq = self.seq(fields_node, f"{what} fields") if fields_node is not None else None
        self.opt(body, "doc", self.line, f"{what} doc", "")
        if word is None or seq is None:
            return None
        if len(seq.items) > MAX_RECORD_FIELDS:
            self.d.error(seq.loc, f"{what} has {len(seq.items)} fields; at most {MAX_RECORD_FIELDS} are supported")
            return None
        wb = WORD_TYPES[word]
        fields = []
        for i, item in enumerate(seq.items):
            f = self.field(rname, item, i, wb, fields)
            if f is not None:
                fields.append(f)
        stride = self.opt(body, "slot_stride_bytes", self.integer, f"{what} slot_stride_bytes", len(fields) * wb)
        chain = None
        if rname == "canary" and body.get("chain") is not None:
            chain = self.chain(body.get("chain"))
        return Record(rname, word, wb, tuple(fields), stride, chain, loc, where_of(body.entries))

    def field(self, rname: str, node: YNode, index: int, word_bytes: int, before: list) -> Optional[Field]:
        label = node.get("name") if isinstance(node, YMap) else None
        if isinstance(label, YScalar) and isinstance(label.value, str) and label.value:
            what = f"field '{label.value}' of record '{rname}'"
        else:
            what = f"field {index} of record '{rname}'"
        required = ("name",) + (("role",) if rname == "canary" else ()) + \
            (("carries",) if rname == "violation" else ())
        body = self.mapping(node, what, FIELD_KEYS[rname], required)
        if body is None:
            return None
        name = self.opt(body, "name", self.name, f"{what} name", None)
        role = self.opt(body, "role", lambda n, w: self.choice(n, w, CANARY_ROLES), f"{what} role", "")
        carries = self.opt(body, "carries", lambda n, w: self.choice(n, w, VIOLATION_CARRIES),
                           f"{what} carries", "")
        doc = self.opt(body, "doc", self.line, f"{what} doc", "")
        source = ""
        if body.get("source") is not None:
            if role != ROLE_INPUT:
                self.soft(body.key_loc("source"),
                          f"{what}: only fields with role 'input' take a 'source', this one has role '{role}'")
            else:
                source = self.opt(body, "source", lambda n, w: self.choice(n, w, tuple(INPUT_VALUE_SOURCES)),
                                  f"{what} source", "")
        elif role == ROLE_INPUT:
            self.soft(body.loc, f"{what} is missing required key 'source' (what the runtime writes into "
                                   f"it: {', '.join(INPUT_VALUE_SOURCES)})")
        verify = None
        if body.get("verify") is not None:
            if role != ROLE_INPUT:
                self.soft(body.key_loc("verify"),
                             f"{what}: only fields with role 'input' can declare 'verify', this one has role '{role}'")
            else:
                verify = self.input_verify(body.get("verify"), f"{what} verify")
        offset = index * word_bytes
        declared = self.opt(body, "offset", self.integer, f"{what} offset", None)
        if declared is not None and declared != offset:
            self._offset_error(body.get("offset").loc, name or what, declared, offset, word_bytes, before)
        if name is None:
            return None
        return Field(name, index, offset, role, carries, verify, doc,
                     body.get("name").loc, where_of(body.entries), source)

    def _offset_error(self, loc: Loc, name: str, declared: int, offset: int, word_bytes: int, before) -> None:
        # Fields are packed in list order; an `offset:` only states (and so checks) where one lands.
        hit = next((f for f in before if f.offset < declared + word_bytes and declared < f.offset + word_bytes), None)
        why = (f"; it would overlap field '{hit.name}' (bytes {hit.offset}..{hit.offset + word_bytes - 1})"
               if hit else "")
        self.soft(loc, f"field '{name}' declares offset {declared} but fields are packed in order, so it is at "
                          f"byte {offset}{why}")

    def input_verify(self, node: YNode, what: str) -> Optional[InputVerify]:
        body = self.mapping(node, what, VERIFY_KEYS, VERIFY_KEYS)
        if body is None:
            return None
        expected = self.opt(body, "expected", lambda n, w: self.choice(n, w, INPUT_EXPECTED_SOURCES),
                            f"{what} expected", None)
        reason = self.opt(body, "fail_reason", self.name, f"{what} fail_reason", None)
        if expected is None or reason is None:
            return None
        return InputVerify(expected, reason, body.get("fail_reason").loc, where_of(body.entries))

    def chain(self, node: YNode) -> Optional[Chain]:
        body = self.mapping(node, "chain", CHAIN_KEYS, CHAIN_KEYS)
        if body is None:
            return None
        anchor = self.opt(body, "anchor", self.name, "chain anchor", None)
        fold_node = body.get("fold")
        fold = []
        seq = self.seq(fold_node, "chain fold") if fold_node is not None else None
        for item in (seq.items if seq else ()):
            n = self.name(item, "chain fold entry")
            if n is not None:
                fold.append((n, item.loc))
        if anchor is None or seq is None:
            return None
        return Chain(anchor, tuple(n for n, _ in fold), body.loc,
                     tuple(loc for _, loc in fold), where_of(body.entries))

    def value_sets(self, node: YNode, kind: str) -> tuple[ValueSet, ...]:
        section = "flags" if kind == "flag" else "enums"
        m = self.mapping(node, section, allowed=_AnyKey())
        out = []
        for key, value in (m.entries if m else ()):
            body = self.mapping(value, f"{kind} set '{key.value}'", allowed=_AnyKey())
            if body is None:
                continue
            members = []
            for mkey, mval in body.entries:
                member = self.member(key.value, mkey, mval, kind)
                if member is not None:
                    members.append(member)
            out.append(ValueSet(key.value, kind, tuple(members), key.loc))
        return tuple(out)

    def member(self, set_name: str, key: YScalar, node: YNode, kind: str) -> Optional[Member]:
        """`NAME: 4`, or for flags also `NAME: {value: 4, kind: verify}` (a FailReason bit of the
        schema's own needs the kind; a built-in reason's kind is the generator's)."""
        what = f"{kind} member '{set_name}.{key.value}'"
        builtin_kind = BUILTIN_FAIL_REASON_KINDS.get(key.value, "") if set_name == "FailReason" else ""
        if kind == "flag" and isinstance(node, YMap):
            body = self.mapping(node, what, FLAG_MEMBER_KEYS, ("value",))
            value = self.opt(body, "value", self.integer, f"{what} value", None)
            member_kind = self.opt(body, "kind", lambda n, w: self.choice(n, w, FAIL_REASON_KINDS), f"{what} kind", "")
            self.opt(body, "doc", self.line, f"{what} doc", "")
            if value is None:
                return None
            return Member(key.value, value, key.loc, member_kind or builtin_kind, where_of(body.entries))
        value = self.integer(node, what)
        return None if value is None else Member(key.value, value, key.loc, builtin_kind if kind == "flag" else "")

    def launch_tags(self, node: YNode) -> tuple[LaunchTag, ...]:
        m = self.mapping(node, "launch_tags", allowed=_AnyKey())
        out = []
        for key, value in (m.entries if m else ()):
            what = f"launch tag '{key.value}'"
            body = self.mapping(value, what, LAUNCH_TAG_KEYS, ("value", "phase", "half", "group"))
            if body is None:
                continue
            tag_value = self.opt(body, "value", self.integer, f"{what} value", None)
            phase = self.opt(body, "phase", lambda n, w: self.choice(n, w, LAUNCH_PHASES), f"{what} phase", None)
            half = self.opt(body, "half", lambda n, w: self.choice(n, w, LAUNCH_HALVES), f"{what} half", None)
            group = self.opt(body, "group", self.name, f"{what} group", None)
            self.opt(body, "doc", self.line, f"{what} doc", "")
            if None in (tag_value, phase, half, group):
                continue
            out.append(LaunchTag(key.value, tag_value, phase, half, group, key.loc, where_of(body.entries)))
        return tuple(out)

    def messages(self, node: YNode, constants, records) -> tuple[str, tuple[Message, ...]]:
        m = self.mapping(node, "messages", allowed=_AnyKey())
        prefix, out = "", []
        for key, value in (m.entries if m else ()):
            text = self.line(value, f"message '{key.value}'")
            if text is None:
                continue
            if key.value == "prefix":
                prefix = text
                continue
            out.append(Message(key.value, text, (), value.loc))
        return prefix, tuple(out)

    def kernels(self, node: YNode) -> tuple[Kernel, ...]:
        seq = self.seq(node, "kernels")
        out = []
        for i, item in enumerate(seq.items if seq else ()):
            what = f"kernel {i}"
            body = self.mapping(item, what, KERNEL_KEYS, ("name", "operation", "launch"), FORMER_KERNEL_KEYS)
            if body is None:
                continue
            name = self.opt(body, "name", self.name, f"{what} name", None)
            if name is not None:
                what = f"kernel '{name}'"
            operation = self.kernel_operation(body, what)
            launch = self.launch(body.get("launch"), what) if body.get("launch") is not None else None
            warp = self.opt(body, "warp_reduction", self.boolean, f"{what} warp_reduction", False)
            self.opt(body, "doc", self.line, f"{what} doc", "")
            specs = []
            if body.get("specializations") is not None:
                sm = self.mapping(body.get("specializations"), f"{what} specializations", allowed=_AnyKey())
                for skey, sval in (sm.entries if sm else ()):
                    sseq = self.seq(sval, f"{what} specialization '{skey.value}'")
                    vals = [self.boolean(v, f"{what} specialization '{skey.value}' value")
                            for v in (sseq.items if sseq else ())]
                    if sseq is not None and None not in vals:
                        if not vals or len(set(vals)) != len(vals):
                            self.d.error(sval.loc, f"{what} specialization '{skey.value}' must list "
                                                   f"distinct values, got {vals}")
                        specs.append(Specialization(skey.value, tuple(vals), skey.loc))
            if name is None or operation is None or launch is None:
                continue
            where = {FORMER_KERNEL_KEYS.get(k, k): loc for k, loc in where_of(body.entries).items()}
            out.append(Kernel(name, operation, launch, warp, tuple(specs), body.get("name").loc,
                              MappingProxyType(where)))
        return tuple(out)

    def kernel_operation(self, body: YMap, what: str) -> Optional[str]:
        """The operation a kernel is rendered from: `operation:`, or `template:`, its former name (a note)."""
        former = body.get("template")
        if former is None:
            return self.opt(body, "operation", self.name, f"{what} operation", None)
        if body.get("operation") is not None:
            self.d.error(body.key_loc("template"), f"{what} has both 'operation' and 'template'; 'template' is the "
                                                   f"former name of 'operation': remove it")
            return None
        self.d.note(body.key_loc("template"), f"'template' is the former name of 'operation' in {what}: it means "
                                              f"the same; rename it to 'operation'")
        return self.name(former, f"{what} operation")

    def launch(self, node: YNode, what: str) -> Optional[Launch]:
        keys = ("shape", "threads", "blocks_per_sm", "blocks")
        body = self.mapping(node, f"{what} launch", keys, ("shape", "threads"))
        if body is None:
            return None
        shape = self.opt(body, "shape", lambda n, w: self.choice(n, w, tuple(LAUNCH_SHAPES)),
                         f"{what} launch shape", None)
        threads = self.opt(body, "threads", self.integer, f"{what} launch threads", None)
        if shape is None or threads is None:
            return None
        extra = {}
        for key in ("blocks_per_sm", "blocks"):
            child = body.get(key)
            if child is None:
                if key in LAUNCH_SHAPES[shape]:
                    self.d.error(body.loc, f"{what} launch shape '{shape}' requires '{key}'")
                continue
            if key not in LAUNCH_SHAPES[shape]:
                self.soft(body.key_loc(key), f"{what} launch shape '{shape}' does not take '{key}'")
                continue
            extra[key] = self.integer(child, f"{what} launch {key}")
        return Launch(shape, threads, extra.get("blocks_per_sm") or 0, extra.get("blocks") or 0,
                      body.loc, where_of(body.entries))


class _AnyKey:
    """Allowed-key set for mappings whose keys are user-chosen names."""

    def __contains__(self, key) -> bool:
        return True


_FORMAT_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def message_placeholders(text: str) -> list[str]:
    """Placeholder names of a str.format message (errors on malformed braces)."""
    return [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
