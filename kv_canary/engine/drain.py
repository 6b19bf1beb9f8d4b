"""Reading a manager's violation ring without stalling a step: snapshots, the drain, and its totals.

Every step ends with an asynchronous snapshot of the ring's write index; the ring is read only once
a landed snapshot shows rows, so a clean step never waits for the device. A drain decodes and
records the rows and restarts the write index (no row is reported twice); what to do with them
(log, raise) is the manager's.
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Optional

import torch

from .staging import CounterSnapshot
from .violations import Violation, ViolationDecoder, record_link

SNAPSHOT_DEPTH = 8  # write-index snapshots in flight before a drain waits for the oldest


class CanaryViolationError(RuntimeError):
    """Raised in mode 'raise' by a drain that found rows: the text is every new row's report (docs/semantics.md
    §9) joined by newlines; `violations` holds those rows."""

    def __init__(self, message: str, violations: list[Violation]):
        super().__init__(message)
        self.violations = violations


@dataclass
class CanaryStats:
    total: int = 0                                   # rows appended, lost ones included
    lost: int = 0                                    # rows dropped because the ring was full
    drains: int = 0
    # Rows per FailReason name, lost ones included: the device's per-reason totals, read at drain time.
    by_reason: collections.Counter = field(default_factory=collections.Counter)
    by_step: collections.Counter = field(default_factory=collections.Counter)    # every row, lost ones included
    # Decoded rows per (launch tag name, FailReason name): a row with two reasons counts under both.
    by_tag_reason: collections.Counter = field(default_factory=collections.Counter)


class RingDrain:
    """The violation ring of one manager (`canary_bufs`: launch tag value -> the canary buffer whose
    slots that tag's verify rows name)."""

    def __init__(self, layout, *, ring: torch.Tensor, write_index: torch.Tensor, reason_counts: torch.Tensor,
                 keep_violations: int, canary_bufs: dict):
        self.L = layout
        self.ring, self.write_index, self.reason_counts = ring, write_index, reason_counts
        self.ring_capacity = int(ring.shape[0])
        self.keep_violations = keep_violations
        self.canary_bufs = canary_bufs
        self.decoder = ViolationDecoder(layout)
        self.stats = CanaryStats()
        self.violations: list[Violation] = []
        self.links: dict = {}
        self._snapshots: collections.deque = collections.deque()   # (step, CounterSnapshot)

    def snapshot(self, step: int) -> None:
        """Take this step's write-index snapshot; waits for the oldest in flight when the device is
        SNAPSHOT_DEPTH steps behind."""
        if len(self._snapshots) >= SNAPSHOT_DEPTH:
            self._snapshots[0][1].values()
        self._snapshots.append((step, CounterSnapshot([self.write_index])))

    def pending(self) -> bool:
        """Whether a landed snapshot shows rows (never waits for the device)."""
        while self._snapshots:
            step, snap = self._snapshots[0]
            if not snap.ready():
                return False
            if snap.values()[0] > 0:
                return True
            self._snapshots.popleft()
        return False

    def drain(self) -> list[Violation]:
        """Every pending row, decoded and recorded; the write index restarts at 0 (waits for the device)."""
        count = int(self.write_index[0])  # synchronises: every snapshot copy before it has landed
        bounds = [(step, snap.values()[0]) for step, snap in self._snapshots]
        self._snapshots.clear()
        if count == 0:
            return []
        # Row i was appended by the step of the first snapshot whose index exceeds i (the indices
        # only grow between drains); rows after the last snapshot count for its step.
        ends = [end for _, end in bounds]
        last = len(bounds) - 1
        rows = self.ring[:min(count, self.ring_capacity)].cpu()
        steps = [bounds[min(bisect.bisect_right(ends, i), last)][0] if bounds else None for i in range(count)]
        self.write_index.zero_()
        found = [self.decoder.decode_row(row, s) for row, s in zip(rows.tolist(), steps)]
        st = self.stats
        st.drains += 1
        st.total += count
        st.lost += count - len(rows)
        st.by_step.update(steps)
        # Cumulative device totals: the kernels count dropped rows too (the host cannot decode them).
        totals = self.reason_counts.cpu().tolist()
        st.by_reason = collections.Counter({name: n for name, n in zip(self.L.VIOLATION_REASON_COUNT_NAMES, totals) if n})
        st.by_tag_reason.update((v.launch_tag, r) for v in found for r in v.reasons)
        self._capture_links(found)
        room = self.keep_violations - len(self.violations)
        self.violations += found[:max(0, room)]
        return found

    def _capture_links(self, found: list[Violation]) -> None:
        """Remember, at drain time, the chain link of the record at each verify violation's slot
        (what cascade grouping compares expected_aux with; later writes may change the record)."""
        by_tag: dict = {}
        for v in found:
            buf = self.canary_bufs.get(v.launch_tag_value)
            if v.is_verify and buf is not None and 0 <= v.slot < buf.shape[0]:
                by_tag.setdefault(v.launch_tag_value, []).append(v)
        for tag, verify in by_tag.items():
            slots = torch.tensor([v.slot for v in verify], dtype=torch.int64, device=self.ring.device)
            for v, words in zip(verify, self.canary_bufs[tag][slots].view(torch.int64).cpu().tolist()):
                self.links[(v.step, v.launch_tag_value, v.slot)] = record_link(self.L, words)

    def link_of(self, v: Violation) -> Optional[int]:
        return self.links.get((v.step, v.launch_tag_value, v.slot))
