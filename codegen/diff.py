"""Semantic ABI diff between two schemas: what changed, and whether it breaks the ABI.

A change is BREAKING when data or code built against the old schema would be misread by, or
refuse to work with, the new one (a record byte moves, a stored hash or bit means something else,
an entry point disappears). Additions that old consumers never see, launch tuning, the default slot
stride of new allocations and message wording are compatible. `kv-canary diff` prints the rows as a Markdown table for a PR comment, as
text, or as JSON (the versioned shape of diff-format.schema.json, docs/schema-change.md) and exits 2
when something is breaking but abi_version was not bumped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .model import Record, Schema, ValueSet
from .version import kv_canary_version

BREAKING = "BREAKING"
COMPATIBLE = "compatible"
JSON_FORMAT = "kv-canary-diff"
JSON_VERSION = 2   # 2: kv_canary_version added

# Every kind of change the diff reports, with why it is (or is not) breaking: the `why` of each JSON row.
KINDS: dict[str, str] = {
    "abi_version changed": "the version number itself; bumping it is how a breaking change is announced",
    "schema format changed": "the format of kernels.yaml-style files, not the ABI they describe",
    "word type changed": "every word of the record is read with another width or signedness",
    "slot stride changed": "the default allocation stride only: kernels take each buffer's own stride, so existing "
                           "buffers keep working",
    "field added": "the record's words are read at other offsets, and old records hold no value for it",
    "field removed": "code built for the old layout reads or writes a word that is gone",
    "field renamed": "generated names (CANARY_FIELD_*, keywords, columns) change for callers",
    "field moved": "the word is read at another byte offset",
    "field role changed": "the stored word means something else",
    "violation column meaning changed": "violation rows carry another value in that column",
    "input field verify changed": "the same records are checked differently",
    "input field source changed": "old records would be checked against the wrong table",
    "chain fold changed (every stored hash changes)": "every stored chain hash changes",
    "chain anchor changed (HEAD changes)": "the hash of the first slot of every request changes",
    "flag set added": "a new set that old consumers never see",
    "flag set removed": "code that decodes the set loses it",
    "flag bit added": "a new bit that old decoders never see set for old data",
    "flag bit removed": "old data with the bit set is no longer decodable",
    "flag bit renumbered": "old data decodes as another bit",
    "flag bit reused": "old data with the bit set decodes as another name",
    "enum set added": "a new set that old consumers never see",
    "enum set removed": "code that decodes the set loses it",
    "enum value added": "a new value that old data never holds",
    "enum value removed": "old data holding the value is no longer decodable",
    "enum value renumbered": "old data decodes as another member",
    "enum value reused": "old data holding the value decodes as another name",
    "fail reason kind changed": "decoders tell verify rows from write rows by the kind",
    "launch tag moved to another launch": "rows logged before are attributed to the wrong launch",
    "constant added": "a new name; nothing existing changes",
    "constant removed": "code that uses the constant loses it",
    "constant changed": "data or kernels built with the old value disagree with the new one",
    "kernel added": "a new entry point; existing ones are unchanged",
    "kernel removed": "callers of its entry points fail",
    "kernel renamed (entry points change)": "the exported entry points change name",
    "kernel launch changed": "launch tuning: grid and block shape only, the record layout is unchanged",
    "kernel specializations changed": "breaking when an entry point is removed, else only new entry points",
    "message text changed": "wording of run-time errors only",
}


@dataclass(frozen=True)
class Change:
    kind: str       # e.g. "field moved", "flag bit renumbered": a key of KINDS
    subject: str    # what changed, e.g. "canary.real_kv_hash" (the JSON row's `path`)
    old: str        # as shown: "-" when there was nothing
    new: str
    breaking: bool

    @property
    def verdict(self) -> str:
        return BREAKING if self.breaking else COMPATIBLE

    @property
    def why(self) -> str:
        return KINDS[self.kind]

    def as_json(self) -> dict:
        return {"path": self.subject, "kind": self.kind, "old": None if self.old == "-" else self.old,
                "new": None if self.new == "-" else self.new, "breaking": self.breaking,
                "verdict": "breaking" if self.breaking else "compatible", "why": self.why}


@dataclass(frozen=True)
class DiffReport:
    old_name: str
    new_name: str
    old_abi: int
    new_abi: int
    changes: tuple[Change, ...]

    @property
    def breaking(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.breaking)

    @property
    def abi_bumped(self) -> bool:
        return self.new_abi > self.old_abi

    @property
    def exit_status(self) -> int:
        """2 when something breaks and abi_version was not bumped, else 0."""
        return 2 if self.breaking and not self.abi_bumped else 0

    @property
    def verdict(self) -> str:
        """unchanged | compatible | breaking (with the abi_version bump) | breaking-without-bump."""
        if not self.changes:
            return "unchanged"
        if not self.breaking:
            return "compatible"
        return "breaking" if self.abi_bumped else "breaking-without-bump"


def _fmt(value) -> str:
    return "-" if value is None or value == "" else str(value)


class _Collector:
    def __init__(self) -> None:
        self.rows: list[Change] = []

    def add(self, kind: str, subject: str, old, new, breaking: bool) -> None:
        assert kind in KINDS, f"diff kind {kind!r} has no entry in KINDS"
        self.rows.append(Change(kind, subject, _fmt(old), _fmt(new), breaking))


def _field_desc(f) -> str:
    bits = [f"offset {f.offset}"]
    if f.role:
        bits.append(f"role {f.role}")
    if f.carries:
        bits.append(f"carries {f.carries}")
    return ", ".join(bits)


def _verify_desc(f) -> str | None:
    return f"{f.verify.expected} → {f.verify.fail_reason}" if f.verify else None


def _diff_record(c: _Collector, old: Record, new: Record) -> None:
    r = old.name
    if old.word != new.word:
        c.add("word type changed", r, old.word, new.word, True)
    if r == "canary" and old.stride_bytes != new.stride_bytes:
        c.add("slot stride changed", r, f"{old.stride_bytes} bytes", f"{new.stride_bytes} bytes", False)
    olds = {f.name: f for f in old.fields}
    news = {f.name: f for f in new.fields}
    removed = [f for f in old.fields if f.name not in news]
    added = [f for f in new.fields if f.name not in olds]
    # A removed and an added field at the same offset with the same meaning is a rename.
    for f in list(removed):
        twin = next((g for g in added if g.offset == f.offset and g.role == f.role and g.carries == f.carries), None)
        if twin is not None:
            c.add("field renamed", f"{r}.{f.name}", f.name, twin.name, True)
            removed.remove(f)
            added.remove(twin)
    for f in removed:
        c.add("field removed", f"{r}.{f.name}", _field_desc(f), None, True)
    for f in added:
        c.add("field added", f"{r}.{f.name}", None, _field_desc(f), True)
    for f in old.fields:
        g = news.get(f.name)
        if g is None:
            continue
        if f.offset != g.offset:
            c.add("field moved", f"{r}.{f.name}", f"offset {f.offset}", f"offset {g.offset}", True)
        if f.role != g.role:
            c.add("field role changed", f"{r}.{f.name}", f.role, g.role, True)
        if f.carries != g.carries:
            c.add("violation column meaning changed", f"{r}.{f.name}", f.carries, g.carries, True)
        if _verify_desc(f) != _verify_desc(g):
            c.add("input field verify changed", f"{r}.{f.name}", _verify_desc(f) or "not verified",
                  _verify_desc(g) or "not verified", True)
        if f.source and g.source and f.source != g.source:
            # The stored word means something else: old records would be checked against the wrong table.
            c.add("input field source changed", f"{r}.{f.name}", f.source, g.source, True)


def _diff_chain(c: _Collector, old: Schema, new: Schema) -> None:
    of, nf = old.canary.chain.fold, new.canary.chain.fold
    if of != nf:
        c.add("chain fold changed (every stored hash changes)", "canary.chain.fold",
              ", ".join(of), ", ".join(nf), True)
    if old.chain_head != new.chain_head or old.canary.chain.anchor != new.canary.chain.anchor:
        c.add("chain anchor changed (HEAD changes)", "canary.chain.anchor",
              f"{old.canary.chain.anchor}, HEAD 0x{old.chain_head:016X}",
              f"{new.canary.chain.anchor}, HEAD 0x{new.chain_head:016X}", True)


def _diff_value_sets(c: _Collector, old: tuple[ValueSet, ...], new: tuple[ValueSet, ...], kind: str) -> None:
    olds = {v.name: v for v in old}
    news = {v.name: v for v in new}
    for name in olds:
        if name not in news:
            c.add(f"{kind} set removed", name, None, None, True)
    for name, vs in news.items():
        if name not in olds:
            c.add(f"{kind} set added", name, None, ", ".join(f"{m.name}={m.value}" for m in vs.members), False)
            continue
        before = {m.name: m.value for m in olds[name].members}
        after = {m.name: m.value for m in vs.members}
        owner_before = {v: n for n, v in before.items()}
        what = "bit" if kind == "flag" else "value"
        for m, v in before.items():
            if m not in after:
                c.add(f"{kind} {what} removed", f"{name}.{m}", v, None, True)
            elif after[m] != v:
                c.add(f"{kind} {what} renumbered", f"{name}.{m}", v, after[m], True)
        for m, v in after.items():
            if m in before:
                continue
            previous = owner_before.get(v)
            if previous is not None:
                # The value meant something else before: old data would be misread.
                c.add(f"{kind} {what} reused", f"{name}.{m}", f"{v} was {previous}", v, True)
            else:
                c.add(f"{kind} {what} added", f"{name}.{m}", None, v, False)


def _diff_fail_reason_kinds(c: _Collector, old: Schema, new: Schema) -> None:
    before = {m.name: m.kind for m in old.fail_reason.members}
    for m in new.fail_reason.members:
        if m.name in before and before[m.name] != m.kind:
            # Decoders and reports tell verify rows from write rows by the kind.
            c.add("fail reason kind changed", f"FailReason.{m.name}", before[m.name], m.kind, True)


def _diff_launch_tags(c: _Collector, old: Schema, new: Schema) -> None:
    """A tag now stamped by another launch misattributes every row logged before (values: the enum diff)."""
    before = {t.name: t for t in old.launch_tags}
    for t in new.launch_tags:
        o = before.get(t.name)
        if o is not None and o.coordinates != t.coordinates:
            c.add("launch tag moved to another launch", f"CanaryLaunchTag.{t.name}", "/".join(o.coordinates),
                  "/".join(t.coordinates), True)


def _const_desc(k) -> str:
    return f"{k.type} 0x{k.value:016X}" if k.type == "u64" else f"{k.type} {k.value}"


def _diff_constants(c: _Collector, old: Schema, new: Schema) -> None:
    olds = {k.name: k for k in old.constants}
    news = {k.name: k for k in new.constants}
    for name, k in olds.items():
        n = news.get(name)
        if n is None:
            c.add("constant removed", name, _const_desc(k), None, True)
        elif (k.type, k.value) != (n.type, n.value):
            c.add("constant changed", name, _const_desc(k), _const_desc(n), True)
    for name, n in news.items():
        if name not in olds:
            c.add("constant added", name, None, _const_desc(n), False)


def _launch_desc(k) -> str:
    launch = k.launch
    parts = [launch.shape, f"{launch.threads} threads"]
    if launch.blocks_per_sm:
        parts.append(f"{launch.blocks_per_sm} blocks/SM")
    if launch.blocks:
        parts.append(f"{launch.blocks} blocks")
    if k.warp_reduction:
        parts.append("warp reduction")
    return ", ".join(parts)


def _diff_kernels(c: _Collector, old: Schema, new: Schema) -> None:
    olds = {k.operation: k for k in old.kernels}
    news = {k.operation: k for k in new.kernels}
    for operation, k in olds.items():
        n = news.get(operation)
        if n is None:
            c.add("kernel removed", k.name, _launch_desc(k), None, True)
            continue
        if k.name != n.name:
            c.add("kernel renamed (entry points change)", f"{operation} kernel", k.name, n.name, True)
        if _launch_desc(k) != _launch_desc(n):
            c.add("kernel launch changed", n.name, _launch_desc(k), _launch_desc(n), False)
        old_symbols = [s for s, _ in k.variants]
        new_symbols = [s for s, _ in n.variants]
        if k.name == n.name and old_symbols != new_symbols:
            gone = [s for s in old_symbols if s not in new_symbols]
            c.add("kernel specializations changed", n.name, ", ".join(old_symbols), ", ".join(new_symbols),
                  bool(gone))
    for operation, n in news.items():
        if operation not in olds:
            c.add("kernel added", n.name, None, _launch_desc(n), False)


def _diff_messages(c: _Collector, old: Schema, new: Schema) -> None:
    if old.message_prefix != new.message_prefix:
        c.add("message text changed", "messages.prefix", repr(old.message_prefix), repr(new.message_prefix), False)
    olds = {m.key: m.text for m in old.messages}
    for m in new.messages:
        if m.key in olds and olds[m.key] != m.text:
            c.add("message text changed", f"messages.{m.key}", olds[m.key], m.text, False)


def diff_schemas(old: Schema, new: Schema, old_name: str = "old", new_name: str = "new") -> DiffReport:
    c = _Collector()
    if old.abi_version != new.abi_version:
        c.add("abi_version changed", "abi_version", old.abi_version, new.abi_version, False)
    if old.format != new.format:
        c.add("schema format changed", "format", old.format, new.format, False)
    for o, n in ((old.canary, new.canary), (old.violation, new.violation), (old.real_kv_source, new.real_kv_source)):
        _diff_record(c, o, n)
    _diff_chain(c, old, new)
    _diff_value_sets(c, old.flags, new.flags, "flag")
    _diff_value_sets(c, old.enums, new.enums, "enum")
    _diff_fail_reason_kinds(c, old, new)
    _diff_launch_tags(c, old, new)
    _diff_constants(c, old, new)
    _diff_kernels(c, old, new)
    _diff_messages(c, old, new)
    return DiffReport(old_name, new_name, old.abi_version, new.abi_version, tuple(c.rows))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


@dataclass(frozen=True)
class FixHint:
    """What the verdict line tells the user to edit and run (their schema file, their command)."""
    schema: str = "kernels.yaml"
    regenerate: str = "make generate"


def summary_line(report: DiffReport, hint: FixHint = FixHint()) -> str:
    n = len(report.breaking)
    if not report.changes:
        return "No semantic change."
    if not n:
        return f"{len(report.changes)} change(s), none breaking."
    if report.abi_bumped:
        return f"{n} breaking change(s); abi_version bumped {report.old_abi} → {report.new_abi}."
    return (f"{n} breaking change(s) but abi_version is still {report.new_abi}: "
            f"bump `abi_version` in {hint.schema} (to {report.old_abi + 1}) and run `{hint.regenerate}`.")


def format_markdown(report: DiffReport, hint: FixHint = FixHint()) -> str:
    """A short Markdown report fit for a pull-request comment."""
    lines = [f"### kv-canary schema diff: `{report.old_name}` → `{report.new_name}`", ""]
    if not report.changes:
        lines.append(summary_line(report, hint))
        return "\n".join(lines) + "\n"
    lines += ["| verdict | change | what | old | new |", "|---|---|---|---|---|"]
    for ch in report.changes:
        verdict = f"**{BREAKING}**" if ch.breaking else COMPATIBLE
        lines.append(f"| {verdict} | {ch.kind} | `{_cell(ch.subject)}` | {_cell(ch.old)} | {_cell(ch.new)} |")
    lines.append("")
    line = summary_line(report, hint)
    lines.append(f"**{line}**" if report.exit_status else line)
    return "\n".join(lines) + "\n"


def format_text(report: DiffReport, hint: FixHint = FixHint()) -> str:
    """Plain text for a terminal: one line per change."""
    lines = [f"kv-canary schema diff: {report.old_name} -> {report.new_name}"]
    for ch in report.changes:
        lines.append(f"  {ch.verdict:<10}  {ch.kind}: {ch.subject}: {ch.old} -> {ch.new}")
    lines.append(summary_line(report, hint))
    return "\n".join(lines) + "\n"


def report_json(report: DiffReport, hint: FixHint = FixHint()) -> dict:
    """The versioned JSON shape (codegen/diff-format.schema.json)."""
    return {
        "format": JSON_FORMAT, "version": JSON_VERSION, "kv_canary_version": kv_canary_version(),
        "old": {"name": report.old_name, "abi_version": report.old_abi},
        "new": {"name": report.new_name, "abi_version": report.new_abi},
        "abi_version_bumped": report.abi_bumped,
        "verdict": report.verdict,
        "exit_status": report.exit_status,
        "breaking_changes": len(report.breaking),
        "summary": summary_line(report, hint),
        "changes": [c.as_json() for c in report.changes],
    }


def format_json(report: DiffReport, hint: FixHint = FixHint()) -> str:
    return json.dumps(report_json(report, hint), indent=2, ensure_ascii=False) + "\n"


FORMATS = {"markdown": format_markdown, "text": format_text, "json": format_json}
