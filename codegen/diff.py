"""Semantic ABI diff between two schemas: what changed, and whether it breaks the ABI.

A change is BREAKING when data or code built against the old schema would be misread by, or
refuse to work with, the new one (a record byte moves, a stored hash or bit means something else,
an entry point disappears). Additions that old consumers never see, launch tuning and message
wording are compatible. `kv-canary diff` prints the rows as a Markdown table for a PR comment and
exits 2 when something is breaking but abi_version was not bumped.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import Record, Schema, ValueSet

BREAKING = "BREAKING"
COMPATIBLE = "compatible"


@dataclass(frozen=True)
class Change:
    kind: str       # e.g. "field moved", "flag bit renumbered"
    subject: str    # what changed, e.g. "canary.real_kv_hash"
    old: str
    new: str
    breaking: bool

    @property
    def verdict(self) -> str:
        return BREAKING if self.breaking else COMPATIBLE


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


def _fmt(value) -> str:
    return "-" if value is None or value == "" else str(value)


class _Collector:
    def __init__(self) -> None:
        self.rows: list[Change] = []

    def add(self, kind: str, subject: str, old, new, breaking: bool) -> None:
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
        c.add("slot stride changed", r, f"{old.stride_bytes} bytes", f"{new.stride_bytes} bytes", True)
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
    olds = {k.template: k for k in old.kernels}
    news = {k.template: k for k in new.kernels}
    for template, k in olds.items():
        n = news.get(template)
        if n is None:
            c.add("kernel removed", k.name, _launch_desc(k), None, True)
            continue
        if k.name != n.name:
            c.add("kernel renamed (entry points change)", f"{template} kernel", k.name, n.name, True)
        if _launch_desc(k) != _launch_desc(n):
            c.add("kernel launch changed", n.name, _launch_desc(k), _launch_desc(n), False)
        old_symbols = [s for s, _ in k.variants]
        new_symbols = [s for s, _ in n.variants]
        if k.name == n.name and old_symbols != new_symbols:
            gone = [s for s in old_symbols if s not in new_symbols]
            c.add("kernel specializations changed", n.name, ", ".join(old_symbols), ", ".join(new_symbols),
                  bool(gone))
    for template, n in news.items():
        if template not in olds:
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


def format_markdown(report: DiffReport) -> str:
    """A short Markdown report fit for a pull-request comment."""
    lines = [f"### kv-canary schema diff: `{report.old_name}` → `{report.new_name}`", ""]
    if not report.changes:
        lines.append("No semantic change.")
        return "\n".join(lines) + "\n"
    lines += ["| verdict | change | what | old | new |", "|---|---|---|---|---|"]
    for ch in report.changes:
        verdict = f"**{BREAKING}**" if ch.breaking else COMPATIBLE
        lines.append(f"| {verdict} | {ch.kind} | `{_cell(ch.subject)}` | {_cell(ch.old)} | {_cell(ch.new)} |")
    lines.append("")
    n = len(report.breaking)
    if not n:
        lines.append(f"{len(report.changes)} change(s), none breaking.")
    elif report.abi_bumped:
        lines.append(f"{n} breaking change(s); abi_version bumped {report.old_abi} → {report.new_abi}.")
    else:
        lines.append(f"**{n} breaking change(s) but abi_version is still {report.new_abi}: "
                     f"bump `abi_version` in kernels.yaml (to {report.old_abi + 1}) and run `make generate`.**")
    return "\n".join(lines) + "\n"
