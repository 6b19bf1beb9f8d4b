"""What one rank puts into a fleet exchange (its row), and what the reduced rows say. A row has a
decision part (what the rank saw since its previous exchange: new rows, new rows per fail reason, a
failed health check and its stalled tags) and a stats part (its cumulative counters, every N
steps); its columns come from the tree's layout tables, never from names. Every value is >= 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..violations import sglang_reason_name

FLEET_PREFIX = "kv-canary fleet: "
STATS_PREFIX = "[canary fleet] "


@dataclass(frozen=True)
class StatsSample:
    """One rank's cumulative counters at one step."""
    step: int
    kernel_runs: tuple[int, ...]     # per launch tag
    protected_tokens: int            # the slot-run counter
    by_reason: tuple[int, ...]       # violation rows per reason, lost rows included
    rows: int                        # violation rows appended, lost rows included
    lost: int                        # rows dropped because the ring was full


@dataclass(frozen=True)
class RankReport:
    """What one rank saw since its previous exchange."""
    rank: int
    rows: int                              # new violation rows
    by_reason: tuple[tuple[str, int], ...]  # (reason label, new rows), non-zero ones
    health_step: Optional[int]             # the step of a failed health check, if any
    stalled: tuple[str, ...]               # its stalled launch tags

    def describe(self) -> str:
        parts = []
        if self.rows:
            parts.append(" ".join([f"rows={self.rows}", *(f"{name}={n}" for name, n in self.by_reason)]))
        if self.health_step is not None:
            parts.append(f"health check failed at step={self.health_step} for tags=[{', '.join(self.stalled)}]")
        return f"rank {self.rank}: " + ", ".join(parts)


@dataclass(frozen=True)
class FleetDecision:
    """The fleet's view of one step, which every rank acts on at `decided_step`."""
    step: int                         # the step whose state the ranks exchanged
    decided_step: int                 # the step at which every rank read it
    world_size: int
    reports: tuple[RankReport, ...]   # the ranks that saw something, in rank order

    @property
    def violation_ranks(self) -> list[int]:
        return [r.rank for r in self.reports if r.rows]

    @property
    def health_ranks(self) -> list[int]:
        return [r.rank for r in self.reports if r.health_step is not None]

    def line(self) -> str:
        seen = []
        if self.violation_ranks:
            seen.append(f"violations on ranks={self.violation_ranks}")
        if self.health_ranks:
            seen.append(f"health check failed on ranks={self.health_ranks}")
        details = "; ".join(r.describe() for r in self.reports)
        return (f"{FLEET_PREFIX}step={self.step} {' and '.join(seen)} of world_size={self.world_size}: {details}; "
                f"every rank acts at step={self.decided_step}")


@dataclass(frozen=True)
class FleetStats:
    """Every rank's counters at one step (`per_rank[r]` is rank r's)."""
    step: int
    tags: tuple[str, ...]
    reasons: tuple[str, ...]          # reason labels, in the per-reason columns' order
    per_rank: tuple[StatsSample, ...]

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    def total(self, name: str) -> int:
        """The fleet's sum of one scalar counter: protected_tokens, rows or lost."""
        return sum(getattr(s, name) for s in self.per_rank)

    @property
    def kernel_runs(self) -> tuple[int, ...]:
        return tuple(sum(col) for col in zip(*(s.kernel_runs for s in self.per_rank)))

    @property
    def by_reason(self) -> tuple[int, ...]:
        return tuple(sum(col) for col in zip(*(s.by_reason for s in self.per_rank)))

    @property
    def violation_ranks(self) -> list[int]:
        return [r for r, s in enumerate(self.per_rank) if s.rows]

    def line(self) -> str:
        def pairs(names, values) -> str:
            return ",".join(f"{n}:{v}" for n, v in zip(names, values) if v) or "none"
        return (f"{STATS_PREFIX}step={self.step} world_size={self.world_size} "
                f"protected_tokens={self.total('protected_tokens')} kernel_runs={sum(self.kernel_runs)} "
                f"violations={self.total('rows')} ring_rows_lost={self.total('lost')} "
                f"ranks_with_violations={self.violation_ranks} "
                f"kernel_runs_by_tag={pairs(self.tags, self.kernel_runs)} "
                f"violations_by_reason={pairs(self.reasons, self.by_reason)}")


class FleetRows:
    """The column layout of a rank's row for one generated tree (`layout`)."""

    def __init__(self, layout):
        self.tags = tuple(t.name for t in layout.CanaryLaunchTag)
        self.reason_names = tuple(layout.VIOLATION_REASON_COUNT_NAMES)     # FailReason member names
        self.reasons = tuple(sglang_reason_name(n) for n in self.reason_names)  # the labels reports print
        t, r = len(self.tags), len(self.reasons)
        # decision part: rows, health step + 1, new rows per reason, stalled flag per tag
        self.ROWS, self.HEALTH = 0, 1
        self.new_by_reason = slice(2, 2 + r)
        self.stalled = slice(2 + r, 2 + r + t)
        # stats part, from column STATS on: stats step + 1, kernel runs per tag, protected tokens, rows
        # per reason, rows, lost
        self.STATS = 2 + r + t
        self.width = self.STATS + 1 + t + 1 + r + 2

    def encode(self, *, rows: int, new_by_reason, health_step: Optional[int], stalled_tags,
               stats: Optional[StatsSample]) -> list[int]:
        row = [0] * self.width
        row[self.ROWS] = rows
        row[self.new_by_reason] = list(new_by_reason)
        if health_step is not None:
            row[self.HEALTH] = health_step + 1
            row[self.stalled] = [int(name in stalled_tags) for name in self.tags]
        if stats is not None:
            row[self.STATS:] = [stats.step + 1, *stats.kernel_runs, stats.protected_tokens, *stats.by_reason,
                                stats.rows, stats.lost]
        return row

    def decision(self, matrix: list[list[int]], *, step: int, decided_step: int) -> FleetDecision:
        reports = []
        for rank, row in enumerate(matrix):
            health = row[self.HEALTH] - 1 if row[self.HEALTH] else None
            if row[self.ROWS] or health is not None:
                reasons = tuple((n, v) for n, v in zip(self.reasons, row[self.new_by_reason]) if v)
                stalled = tuple(n for n, f in zip(self.tags, row[self.stalled]) if f)
                reports.append(RankReport(rank, row[self.ROWS], reasons, health, stalled))
        return FleetDecision(step, decided_step, len(matrix), tuple(reports))

    def stats(self, matrix: list[list[int]]) -> Optional[FleetStats]:
        """The carried stats, or None when this exchange carried none (every rank carries them at
        the same exchange)."""
        if not matrix[0][self.STATS]:
            return None
        samples = tuple(self.sample(row[self.STATS] - 1, row[self.STATS + 1:]) for row in matrix)
        return FleetStats(samples[0].step, self.tags, self.reasons, samples)

    def sample(self, step: int, counters: list[int]) -> StatsSample:
        """`counters` in the stats part's order: kernel runs per tag, protected tokens, rows per reason,
        rows, lost."""
        t = len(self.tags)
        *counters, rows, lost = counters
        return StatsSample(step, tuple(counters[:t]), counters[t], tuple(counters[t + 1:]), rows, lost)
