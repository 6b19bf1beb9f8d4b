"""The periodic host checks of a CanaryManager (docs/semantics.md §9; their texts are SGLang's, which
harnesses parse): the stats line every N steps, and the health check every HEALTH_CHECK_EVERY steps
from step HEALTH_CHECK_FROM on. Both judge one asynchronous copy of the device counters taken at the
cadence step (kv_canary.engine.staging), once it has landed: no step waits for the device, and a
health error names the step it read.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Optional

from .staging import CounterSnapshot

logger = logging.getLogger("kv_canary")

HEALTH_CHECK_FROM = 100    # SGLang's warm-up: no health check before this step
HEALTH_CHECK_EVERY = 100


class CanaryHealthError(RuntimeError):
    """A launch tag that should run did not advance its kernel-run counter since the previous check.
    `tags`: the stalled tags' names; `step`: the step whose counters were read."""

    def __init__(self, message: str, *, tags=(), step: Optional[int] = None):
        super().__init__(message)
        self.tags = tuple(tags)
        self.step = step


@dataclass
class _Reading:
    step: int
    counters: CounterSnapshot  # kernel runs per tag, then the slot runs, then the write index
    stats: bool
    owed: Optional[list]       # health readings: the tags that must have run since the previous one
    sweep_passes: int
    drained: int               # rows drained before the copy: the device index counts from there


class RuntimeMonitor:
    """Stats line and health check over an attached manager's counters. The health check expects the
    tags of the engine's pools, V only when checked, sweep tags only with a sweep interval; the stats
    line's A counts every tag of the engine's pools, T every tag of the schema."""

    def __init__(self, manager):
        m, coordinates = manager, manager.L.LAUNCH_TAG_COORDINATES
        self.kernel_runs, self.slot_runs, self.write_index = m.kernel_run_counters, m.slot_run_counter, m.write_index
        self.tag_names = [t.name for t in m.tags]
        groups = {g.name for g in m.groups}
        mine = [(i, coordinates[t]) for i, t in enumerate(m.tags) if coordinates[t][2] in groups]
        checked = [(i, phase) for i, (phase, half, _) in mine if half in m.halves]
        # indices into kernel_runs / tag_names of the tags that must run every forward step / every sweep
        self.per_forward = [i for i, phase in checked if phase != m.L.STEP_SWEEP]
        self.sweep = [i for i, phase in checked if phase == m.L.STEP_SWEEP and m.sweep_interval > 0]
        self.active_tags = len(mine)
        self.stats_every = m.stats_print_every_n_steps
        self._pending: collections.deque = collections.deque()
        self._previous: Optional[list] = None   # the counters at the previous health reading
        self.forwards = 0      # forward steps since the last health reading (the manager counts them)
        self.sweeps_due = 0    # sweeps due by the cadence since the last health reading (likewise)
        self.healthy = True    # False while the latest health check found a stalled tag

    def after_step(self, step: int, *, sweep_passes: int, drained: int) -> None:
        """Read the counters if `step` is a stats or health step; judge every reading that has landed."""
        stats = self.stats_every > 0 and step > 0 and step % self.stats_every == 0
        owed = None
        if step >= HEALTH_CHECK_FROM and step % HEALTH_CHECK_EVERY == 0:
            # A window without a forward step (an idle engine) or without a due sweep owes no launch.
            owed = sorted((self.per_forward if self.forwards else []) + (self.sweep if self.sweeps_due else []))
            self.forwards = self.sweeps_due = 0
        if stats or owed is not None:
            counters = CounterSnapshot([self.kernel_runs, self.slot_runs, self.write_index])
            self._pending.append(_Reading(step, counters, stats, owed, sweep_passes, drained))
        # Log / check every reading whose copy has completed, oldest first (never waits).
        while self._pending and self._pending[0].counters.ready():
            self._judge(self._pending.popleft())

    def _judge(self, r: _Reading) -> None:
        values = r.counters.values()
        n = len(self.tag_names)
        runs, slot_runs, index = values[:n], values[n], values[n + 1]
        if r.stats:
            logger.info(f"[canary] step={r.step} protected_tokens={slot_runs} sweep_passes={r.sweep_passes} "
                        f"violations={r.drained + index} launch_tags_active={self.active_tags}/{n}")
        if r.owed is not None:
            previous = self._previous if self._previous is not None else [0] * n
            self._previous = runs
            stalled = [self.tag_names[i] for i in r.owed if runs[i] == previous[i]]
            self.healthy = not stalled
            if stalled:
                raise CanaryHealthError(f"kv-canary: kernel_run_counter did not increase since previous check for "
                                        f"tags=[{', '.join(stalled)}] at step={r.step}; canary path is not executing",
                                        tags=stalled, step=r.step)
