"""kv-canary's Prometheus counters (kv_canary.engine.metrics.CanaryMetrics) for SGLang's own canary state.

CanaryMetrics reads a manager's totals; `SglangCanaryTotals` gives it those of one SGLang
`CanaryManager`: the device's kernel- and slot-run counters, and the violation rows of SGLang's
ring (fill-once: rows past its capacity are counted as lost), decoded by kv-canary's decoder. The
ring's write index is copied asynchronously every step (kv_canary.engine.staging); the ring itself is
read only when that index grew. The health gauge follows SGLang's health check. The decoded rows also
go to the listeners that take them: the JSON-lines sink (kv_canary.engine.jsonl) of
KV_CANARY_SGLANG_VIOLATIONS_JSONL.
"""
from __future__ import annotations

import collections
import logging
from types import SimpleNamespace

from kv_canary.engine.listeners import Listened

logger = logging.getLogger(__name__)
_MANAGER = "sglang.srt.kv_canary.runner.canary_manager.CanaryManager"
HEALTH_ERROR = "kv-canary: kernel_run_counter did not increase"   # SGLang's health-check text (docs/semantics.md §9)
SERVER: dict = {}
_HEALTH = "sglang.srt.kv_canary.runner.health_checker"
# What register() hooks and _was_health_check_step reads (checked before anything is registered).
TARGETS = (f"{_MANAGER}.__init__", f"{_MANAGER}._post_ops_outside_graph", f"{_HEALTH}._HEALTH_CHECK_WARMUP_STEPS",
           f"{_HEALTH}._HEALTH_CHECK_EVERY_N_STEPS")


class SglangCanaryTotals(Listened):
    """What CanaryMetrics reads of a manager, taken from an SGLang CanaryManager's device state."""

    def __init__(self, sglang_manager):
        import kv_canary
        from kv_canary.engine.violations import ViolationDecoder

        self.engine = sglang_manager
        self.enabled = True
        self.listeners = []
        self.L = kv_canary.generated.layout
        self.monitor = SimpleNamespace(healthy=True)
        self.stats = SimpleNamespace(total=0, lost=0, by_tag_reason=collections.Counter())
        self._state = sglang_manager._device_state
        self._decoder = ViolationDecoder(self.L)
        self._decoded = 0
        self._pending: list = []
        self.last_step = None     # the step of the latest after_step (a violation line's step_when_pumped)

    @property
    def kernel_run_counters(self):
        return self._state.kernel_run_counters

    @property
    def slot_run_counter(self):
        return self._state.slot_run_counters.sum().view(1)

    def after_step(self, step: int) -> None:
        from kv_canary.engine.staging import CounterSnapshot

        self.last_step = step
        self._pending.append(CounterSnapshot([self._state.violation_log.violation_write_index]))
        while self._pending and self._pending[0].ready():
            self._read_rows(self._pending.pop(0).values()[0])
        self.notify_step(step)

    def _read_rows(self, write_index: int) -> None:
        ring = self._state.violation_log.violation_ring
        capacity = int(ring.shape[0])
        if write_index <= self.stats.total:
            return
        end = min(write_index, capacity)
        found = [self._decoder.decode_row(row) for row in ring[self._decoded:end].tolist()]  # cold path: rows appended
        for v in found:
            self.stats.by_tag_reason.update((v.launch_tag, r) for r in v.reasons)
        self._decoded = end
        self.stats.total, self.stats.lost = write_index, max(0, write_index - capacity)
        self.notify_drain(found)   # listeners with on_violations (kv_canary.engine.jsonl) get the rows


class _Newest:
    """The /metrics endpoint's collector: the newest SGLang canary manager's counters in this process."""

    def __init__(self):
        self.registry = None

    def collect(self):
        return [] if self.registry is None else list(self.registry.collect())


def _rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


def serve(port: int) -> None:
    """The process's /metrics endpoint on 127.0.0.1:port + its rank (0: any free port), started once.

    Started by the first canary manager (before SGLang builds it), not when the plugin loads: SGLang
    loads plugins in every one of its processes (main, detokenizer, schedulers) before any knows its
    rank, and only a scheduler's canary manager has counters to serve, on the port plus its rank."""
    import prometheus_client

    from kv_canary.engine.metrics import MetricsPortUnavailable, serve_metrics

    if "server" in SERVER:
        return
    rank = _rank()
    newest = _Newest()
    served = prometheus_client.CollectorRegistry()
    served.register(newest)
    try:
        server = serve_metrics(port + rank if port else 0, registry=served)
    except MetricsPortUnavailable as exc:   # the same error, saying where the port came from
        raise MetricsPortUnavailable(
            exc.addr, exc.port, f"{exc.reason} (KV_CANARY_SGLANG_METRICS_PORT={port} plus this process's "
            f"torch.distributed rank {rank})", ("another process is listening there; " if exc.busy else "")
            + "set KV_CANARY_SGLANG_METRICS_PORT to a free port (0 picks one) or unset it to run without the endpoint",
            busy=exc.busy) from None
    SERVER.update(newest=newest, server=server)
    logger.info("kv-canary: Prometheus metrics of SGLang's canary at %s", server.url)


def attach(sglang_manager, port, jsonl=None) -> SglangCanaryTotals:
    """The totals of one SGLang CanaryManager, with CanaryMetrics served at 127.0.0.1:port (+ the
    process's rank) when `port` is not None, and its violations appended to `jsonl` (a path; `{rank}`
    in it is the process's rank) when given."""
    totals = SglangCanaryTotals(sglang_manager)
    if jsonl is not None:
        from kv_canary.engine.jsonl import ViolationJsonl
        ViolationJsonl(totals, jsonl.replace("{rank}", str(_rank())), labels={"rank": str(_rank())})
    sglang_manager._kv_canary_totals = totals
    if port is not None:
        _serve(totals, port)
    return totals


def _serve(totals: SglangCanaryTotals, port: int) -> None:
    import prometheus_client

    from kv_canary.engine.metrics import CanaryMetrics

    serve(port)
    registry = prometheus_client.CollectorRegistry()
    CanaryMetrics(totals, registry=registry, tp_rank=_rank())
    SERVER["newest"].registry = registry


def register(port, jsonl=None) -> None:
    """Hooks: a new SGLang CanaryManager gets its metrics (port not None) and its JSON-lines sink
    (jsonl); each of its steps updates them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def before_init(*args, **kwargs):   # a busy port refuses the manager before SGLang allocates anything
        if port is not None:
            serve(port)

    def after_init(_result, manager, *args, **kwargs):
        attach(manager, port, jsonl)

    def around_step(original, manager, *args, **kwargs):
        totals = getattr(manager, "_kv_canary_totals", None)
        try:
            result = original(manager, *args, **kwargs)
        except RuntimeError as exc:
            if totals is not None and str(exc).startswith(HEALTH_ERROR):
                totals.monitor.healthy = False
            raise
        finally:
            if totals is not None:
                totals.after_step(manager._outer_step_counter)
        if totals is not None and _was_health_check_step(manager._outer_step_counter):
            totals.monitor.healthy = True
        return result

    HookRegistry.register(f"{_MANAGER}.__init__", before_init, HookType.BEFORE)
    HookRegistry.register(f"{_MANAGER}.__init__", after_init, HookType.AFTER)
    HookRegistry.register(f"{_MANAGER}._post_ops_outside_graph", around_step, HookType.AROUND)


def _was_health_check_step(step: int) -> bool:
    """Whether SGLang's health checker judged its previous copy at this step (and found nothing)."""
    from sglang.srt.kv_canary.runner import health_checker as hc

    checked = step - 1
    return checked >= hc._HEALTH_CHECK_WARMUP_STEPS and checked % hc._HEALTH_CHECK_EVERY_N_STEPS == 0
