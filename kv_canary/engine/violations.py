"""Violation-ring rows -> structured Violation objects, SGLang's log line, and cascade grouping.

Every column, bit and tag comes from the generated tree the decoder is built for, so a schema that
reorders the row, renumbers the fail bits or adds columns decodes correctly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

MASK64 = (1 << 64) - 1


def sglang_reason_name(member_name: str) -> str:
    """SGLang's log spelling of a FailReason: VERIFY_CHAIN_HASH_MISMATCH -> verify_chain_hash."""
    name = member_name.lower()
    return name[:-len("_mismatch")] if name.endswith("_mismatch") else name


def u64(x: int) -> int:
    return x & MASK64


def hex64(x: int) -> str:
    """A hash as the reports print it: the 16 hex digits of its u64 value."""
    return f"0x{u64(x):016x}"


@dataclass(frozen=True)
class Violation:
    """One decoded ring row. Hash-valued fields keep the stored (signed int64) value."""
    launch_tag: str                 # CanaryLaunchTag name ("unknown(<n>)" for a value the schema lacks)
    launch_tag_value: int
    slot: int
    position: int                   # the stored position (verify) or the written one (write)
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    reason_bits: int
    reasons: tuple[str, ...]        # FailReason member names, lowest bit first
    extra: tuple[tuple[str, int], ...] = ()   # schema columns beyond the standard ones, by column name
    step: Optional[int] = field(default=None, compare=False)  # forward step that produced the row
    kind: str = field(default="other", compare=False)          # "verify", "write" or "other": row_kind(bits)

    def has(self, reason: str) -> bool:
        return reason in self.reasons

    @property
    def is_verify(self) -> bool:
        return self.kind == "verify"

    @property
    def is_write(self) -> bool:
        return self.kind == "write"

    @property
    def sglang_reasons(self) -> tuple[str, ...]:
        return tuple(sglang_reason_name(r) for r in self.reasons)

    def log_line(self) -> str:
        """SGLang's one-line summary (extra schema columns appended as name=value)."""
        reasons = "+".join(self.sglang_reasons) or "none"
        line = (f"kv_canary violation: launch_tag={self.launch_tag} fail_reason={reasons} "
                f"slot_idx={self.slot} position={self.position} stored_token={self.stored_token} "
                f"expected_token={self.expected_token} stored_chain_hash={hex64(self.stored_chain_hash)} "
                f"expected_aux={hex64(self.expected_aux)}")
        return line + "".join(f" {k}={v}" for k, v in self.extra)


class ViolationDecoder:
    """Decodes ring rows of one generated tree (`tree.layout`)."""

    def __init__(self, layout):
        self.width = layout.VIOLATION_FIELDS
        self.cols = {c: getattr(layout, "VIOLATION_COL_" + c.upper()) for c in layout.VIOLATION_CARRIES}
        used = set(self.cols.values())
        self.extra_cols = tuple((name, i) for i, name in enumerate(layout.VIOLATION_FIELD_NAMES) if i not in used)
        self._bits = sorted(((int(m), m.name) for m in layout.FailReason), key=lambda t: t[0])
        self._tags = {int(m): m.name for m in layout.CanaryLaunchTag}
        self._verify_bits = int(layout.VERIFY_REASON_BITS)
        self._write_bits = int(layout.WRITE_REASON_BITS)

    def row_kind(self, bits: int) -> str:
        """"write" if any bit is a write reason, "verify" if every bit is a verify reason (its expected_aux
        is then the expected chain hash), else "other" (e.g. only SLOT_OUT_OF_RANGE, raised by both)."""
        if bits & self._write_bits:
            return "write"
        if bits and not bits & ~self._verify_bits:
            return "verify"
        return "other"

    def reason_names(self, bits: int) -> tuple[str, ...]:
        names = tuple(name for value, name in self._bits if bits & value)
        unknown = bits & ~sum(v for v, _ in self._bits)
        return names + ((f"UNKNOWN_0x{u64(unknown):x}",) if unknown else ())

    def decode_row(self, row: Iterable[int], step: Optional[int] = None) -> Violation:
        row = [int(x) for x in row]
        if len(row) != self.width:
            raise ValueError(f"kv-canary: violation row must have {self.width} columns, got {len(row)}")
        c = self.cols
        tag = row[c["launch_tag"]]
        bits = row[c["fail_reason"]]
        return Violation(
            launch_tag=self._tags.get(tag, f"unknown({tag})"), launch_tag_value=tag, slot=row[c["slot"]],
            position=row[c["stored_position"]], stored_token=row[c["stored_token"]],
            expected_token=row[c["expected_token"]], stored_chain_hash=row[c["stored_chain_hash"]],
            expected_aux=row[c["expected_aux"]], reason_bits=bits, reasons=self.reason_names(bits),
            extra=tuple((name, row[i]) for name, i in self.extra_cols), step=step, kind=self.row_kind(bits))


def record_link(layout, words) -> int:
    """The chain link (u64) of one canary record given as its int64 words (docs/semantics.md §2)."""
    acc = layout.splitmix64(u64(words[layout.CANARY_CHAIN_LINK_WORD]))
    for w in layout.CANARY_CHAIN_FOLD_WORDS:
        acc = layout.splitmix64(acc ^ u64(words[w]))
    return acc


@dataclass(frozen=True)
class ViolationGroup:
    """The first bad slot of a chain and the verify violations downstream of it in the same launch."""
    root: Violation
    cascade: tuple[Violation, ...] = ()

    @property
    def size(self) -> int:
        return 1 + len(self.cascade)


def group_cascades(violations: list[Violation], link_of: Callable[[Violation], Optional[int]]) -> list[ViolationGroup]:
    """Group chained verify violations behind their chain's first bad slot, in the ring order of the
    roots. Within one launch (step, tag) row v follows u when link_of(u) (the link of the record
    that launch saw at u's slot, None if unknown) == expected_aux(v)."""
    by_launch: dict = {}
    for i, v in enumerate(violations):
        if v.is_verify:
            by_launch.setdefault((v.step, v.launch_tag_value), []).append(i)
    parent: dict[int, int] = {}
    for members in by_launch.values():
        links = {}
        for i in members:
            link = link_of(violations[i])
            if link is not None:
                links.setdefault(link, i)
        for i in members:
            u = links.get(u64(violations[i].expected_aux))
            if u is not None and u != i and violations[u].slot != violations[i].slot:
                parent[i] = u

    def root_of(i: int) -> int:
        seen = {i}
        while i in parent and parent[i] not in seen:
            i = parent[i]
            seen.add(i)
        return i

    groups: dict[int, list[int]] = {}
    for i in range(len(violations)):
        groups.setdefault(root_of(i), []).append(i)
    return [ViolationGroup(violations[r], tuple(violations[j] for j in members if j != r))
            for r, members in sorted(groups.items())]


def format_group(group: ViolationGroup) -> str:
    text = group.root.log_line()
    if group.cascade:
        slots = ", ".join(str(v.slot) for v in group.cascade)
        text += f"\n  cascade: {len(group.cascade)} downstream violation(s) caused by slot {group.root.slot}: slots {slots}"
    return text
