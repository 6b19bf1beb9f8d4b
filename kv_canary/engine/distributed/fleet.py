"""FleetMonitor: one canary decision for every rank of a torch.distributed process group.

Each rank's CanaryManager sees only its own KV pool. At the end of every step each rank starts an
asynchronous MAX all-reduce of its row (kv_canary.engine.distributed.rows) and reads the result one
step later, so no step waits on the network. Then every rank holds the same decision: violations
somewhere raise FleetViolationError on every rank in mode `raise` (a rank's own raise is deferred
to it, so no rank raises alone while the others block in their next collective) or make rank 0 log
the fleet line in mode `log`; a failed health check somewhere raises FleetHealthError on every
rank. Every `stats_every` steps the ranks' counters ride along and rank 0 logs `[canary fleet]`.
A rank that dies or stalls makes the others' next read fail with FleetCollectiveError instead of
hanging. Without an initialised process group, or for one rank, the monitor stays inactive.
"""
from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..config import MODES, check_count
from ..drain import CanaryViolationError
from ..manager import CanaryManager
from ..monitor import CanaryHealthError
from ..staging import CounterSnapshot
from .collective import FleetCollectiveError, RowReducer, collective_device, group_timeout
from .rows import FleetDecision, FleetRows, FleetStats, StatsSample

logger = logging.getLogger("kv_canary")

# The settings every rank must share (compared once, when the monitor attaches).
SETTINGS = ("canary enabled", "mode", "stats_every", "layout fingerprint (high 32 bits)",
            "layout fingerprint (low 32 bits)", "launch tags", "fail-reason columns")


class FleetViolationError(CanaryViolationError):
    """Mode `raise`: some rank found violations. Raised on every rank at the same step; the text is
    the fleet line, then this rank's own reports; `violations`: this rank's rows (possibly none);
    `decision`: the FleetDecision."""

    def __init__(self, message: str, violations: list, decision: FleetDecision):
        super().__init__(message, violations)
        self.decision = decision


class FleetHealthError(CanaryHealthError):
    """Some rank's health check failed. Raised on every rank at the same step, in every mode; the
    text is the fleet line, then this rank's own health errors; `decision`: the FleetDecision."""

    def __init__(self, message: str, decision: FleetDecision, *, tags, step: int, violations: list):
        super().__init__(message, tags=tags, step=step)
        self.decision = decision
        self.violations = violations


class FleetMonitor:
    """One rank's seat in the fleet, made on every rank once the manager is attached. stats_every:
    default the manager's stats_print_every_n_steps; timeout: default the group's; active: None runs
    the fleet for more than one rank, True also for one, False never. Construction (the ranks
    compare their settings) and `close()` (once per rank, at the end) are collectives."""

    takes_errors = True  # the manager's listener that raises for it: every rank at the same step

    def __init__(self, manager, group=None, *, stats_every: Optional[int] = None, timeout=None,
                 active: Optional[bool] = None):
        if not isinstance(manager, CanaryManager):
            raise ValueError(f"kv-canary: FleetMonitor needs a CanaryManager, got {type(manager).__name__}")
        if manager.engine is None:
            raise ValueError("kv-canary: FleetMonitor needs a CanaryManager attached to its engine "
                             "(manager.attach(engine) first); this one is not attached")
        if manager.listener(FleetMonitor) is not None:
            raise ValueError("kv-canary: this CanaryManager already has a FleetMonitor; close() it first")
        stats_every = manager.stats_print_every_n_steps if stats_every is None else stats_every
        check_count("FleetMonitor stats_every", stats_every, 0)
        if active is not None and not isinstance(active, bool):
            raise ValueError(f"kv-canary: FleetMonitor active must be None, True or False, got {active!r}")
        timeout = _check_timeout(timeout)
        self.manager = manager
        self.stats_every = stats_every
        self.decisions: list[FleetDecision] = []
        self.last_stats: Optional[FleetStats] = None
        self.exchanges = 0
        self.rank, self.world_size, self.active = 0, 1, False
        initialised = dist.is_available() and dist.is_initialized()
        if not initialised:
            if group is not None or active:
                raise ValueError("kv-canary: FleetMonitor got a process group (or active=True) but "
                                 "torch.distributed is not initialised (call init_process_group first)")
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("kv-canary: FleetMonitor's process group does not include this process")
        self.active = self.world_size > 1 if active is None else active
        if not self.active:
            return
        self.device = collective_device(self.group, self._manager_device())
        self.timeout = timeout if timeout is not None else group_timeout(self.group, self.device)
        self.rows = FleetRows(manager.L)
        self._closed = False
        self._failed: Optional[FleetCollectiveError] = None   # a collective failed: the group is unusable
        self._exchange = self._reducer(self.rows.width)
        self._stats_due: Optional[tuple] = None     # (snapshot, step, drained rows, drained lost rows)
        self._violations: list[CanaryViolationError] = []   # deferred local raises (mode raise)
        self._health: list[CanaryHealthError] = []          # deferred local health errors
        self._health_unsent: list[CanaryHealthError] = []
        self._sent_rows = manager.stats.total
        self._sent_by_reason = self._by_reason()
        self._check_settings()
        if not manager.enabled:   # mode none on every rank (checked): no canary, nothing to decide
            self.active = False
            return
        manager.add_listener(self)

    # -- setup --------------------------------------------------------------------------------
    def _manager_device(self) -> Optional[torch.device]:
        if self.manager.enabled:
            return self.manager.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def _check_settings(self) -> None:
        """Every rank must run the same canary (mode, cadence, layout): compare them once."""
        m = self.manager
        fingerprint = int(m.L.LAYOUT_FINGERPRINT, 16)
        mine = [int(m.enabled), MODES.index(m.mode), self.stats_every, fingerprint >> 32, fingerprint & 0xFFFFFFFF,
                len(self.rows.tags), len(self.rows.reasons)]
        settings = self._reducer(len(mine))
        settings.start(mine, what="settings check", step=None)
        table = settings.result()
        diffs = [f"rank {r} has {name}={_setting(name, row[i])} (rank 0: {_setting(name, table[0][i])})"
                 for r, row in enumerate(table) for i, name in enumerate(SETTINGS) if row[i] != table[0][i]]
        if diffs:
            raise ValueError("kv-canary: FleetMonitor needs the same canary settings on every rank of the group: "
                             + "; ".join(diffs))

    def _reducer(self, width: int) -> RowReducer:
        return RowReducer(group=self.group, device=self.device, timeout=self.timeout, rank=self.rank,
                          world_size=self.world_size, width=width)

    # -- what the manager calls -----------------------------------------------------------------
    def defer(self, error: Exception) -> None:
        """Keep a local CanaryViolationError / CanaryHealthError for the fleet decision."""
        if isinstance(error, CanaryHealthError):
            self._health.append(error)
            self._health_unsent.append(error)
        elif isinstance(error, CanaryViolationError):
            self._violations.append(error)
        else:
            raise TypeError(f"kv-canary: FleetMonitor.defer takes a CanaryViolationError or CanaryHealthError, "
                            f"got {type(error).__name__}")

    def on_drain(self) -> None:
        """Nothing to do at a drain: the rows reach the fleet through the manager's stats, each step."""

    def after_step(self, step: int) -> None:
        """End of step `step` (the manager calls this): act on the previous step's exchange, start
        this step's."""
        if not self.active or self._closed:
            return
        with self._failing():
            self._collect(step)
            self._start(step, self._stats_due)
        self._stats_due = None
        if self.stats_every and step > 0 and step % self.stats_every == 0:
            self._stats_due = self._snapshot(step)

    def close(self) -> None:
        """End of the run, on every rank (a collective): read the outstanding exchange, exchange once
        more what this rank has not shared yet (a final drain, the final counters when fleet stats
        are on), act on both and detach from the manager."""
        if not self.active or self._closed:
            return
        step = self.manager.last_step
        try:
            if self._failed is None:   # a broken group has nothing more to exchange
                with self._failing():
                    self._collect(step)
                    final = self._snapshot(step) if self.stats_every else None
                    self._start(step, final)
                    self._collect(step)
        finally:
            self._closed = True
            self.manager.remove_listener(self)

    @contextlib.contextmanager
    def _failing(self):
        """A failed collective leaves the group unusable: every later step raises the same error."""
        if self._failed is not None:
            raise FleetCollectiveError(f"{self._failed} (the fleet stopped at that step; close() detaches it)")
        try:
            yield
        except FleetCollectiveError as e:
            self._failed = e
            local = [str(x) for x in (*self._health, *self._violations)]
            if not local:
                raise
            # The fleet failed before this rank's own findings could be shared: they must not be lost.
            raise FleetCollectiveError("\n".join([str(e), "this rank's own canary errors, not shared with the "
                                                   "fleet:", *local])) from e

    # -- the exchange ---------------------------------------------------------------------------
    def _by_reason(self) -> list[int]:
        by_reason = self.manager.stats.by_reason
        return [by_reason.get(name, 0) for name in self.rows.reason_names]

    def _snapshot(self, step: int) -> tuple:
        m = self.manager
        counters = CounterSnapshot([m.kernel_run_counters, m.slot_run_counter, m.reason_counts, m.write_index])
        return counters, step, m.stats.total, m.stats.lost

    def _sample(self, due: tuple) -> StatsSample:
        counters, step, drained, lost = due
        # Taken a step ago: on CUDA the copy has normally landed. index: rows in the ring not drained yet,
        # dropped ones included.
        *values, index = counters.values()
        return self.rows.sample(step, [*values, drained + index, lost + max(0, index - self.manager.ring_capacity)])

    def _start(self, step: int, stats_due: Optional[tuple]) -> None:
        rows = self.manager.stats.total - self._sent_rows
        by_reason = self._by_reason()
        new_by_reason = [now - sent for now, sent in zip(by_reason, self._sent_by_reason)]
        health = self._health_unsent
        row = self.rows.encode(rows=rows, new_by_reason=new_by_reason,
                               health_step=min((e.step for e in health if e.step is not None), default=step)
                               if health else None,
                               stalled_tags={t for e in health for t in e.tags},
                               stats=self._sample(stats_due) if stats_due is not None else None)
        self._exchange.start(row, what="decision", step=step)
        self._sent_rows, self._sent_by_reason, self._health_unsent = self.manager.stats.total, by_reason, []

    def _collect(self, step: int) -> None:
        if not self._exchange.in_flight:
            return
        sent_step = self._exchange.step
        matrix = self._exchange.result()
        self.exchanges += 1
        stats = self.rows.stats(matrix)
        if stats is not None:
            self.last_stats = stats
            if self.rank == 0:
                logger.info(stats.line())
        decision = self.rows.decision(matrix, step=sent_step, decided_step=step)
        if decision.reports:
            self.decisions.append(decision)
            self._act(decision)

    def _act(self, decision: FleetDecision) -> None:
        mine = [v for e in self._violations for v in e.violations]
        texts = [decision.line(), *(str(e) for e in self._health), *(str(e) for e in self._violations)]
        if decision.health_ranks:
            tags = {t for r in decision.reports for t in r.stalled}
            self._health, self._violations = [], []
            raise FleetHealthError("\n".join(texts), decision, tags=[t for t in self.rows.tags if t in tags],
                                   step=decision.step, violations=mine)
        if self.manager.mode == "raise":
            self._violations = []
            raise FleetViolationError("\n".join(texts), mine, decision)
        if self.rank == 0:
            logger.warning(decision.line())


def _check_timeout(timeout) -> Optional[timedelta]:
    """None (the group's timeout), or positive seconds / a positive timedelta."""
    if timeout is None:
        return None
    seconds = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    value = timedelta(seconds=timeout) if seconds else timeout
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ValueError(f"kv-canary: FleetMonitor timeout must be positive seconds or a timedelta, got {timeout!r}")
    return value


def _setting(name: str, value: int):
    return MODES[value] if name == "mode" and 0 <= value < len(MODES) else value
