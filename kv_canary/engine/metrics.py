"""Prometheus metrics of one CanaryManager (prometheus_client: `pip install 'kv-canary[metrics]'`).

`CanaryMetrics(manager, tp_rank=..., pp_rank=..., dp_rank=...)` exports, under a name prefix (default
`kv_canary`), the manager's own totals (README: the metric names): violations from its drains, kernel
runs and protected tokens from asynchronous copies of its device counters (every `read_every`
steps, applied once landed; `refresh()` reads them now), and its health. Each update adds the
difference to the previous reading, so nothing is counted twice. In prometheus_client's
multiprocess mode every rank writes its own values and one `serve_metrics(...,
multiprocess_dir=...)` serves them all, told apart by the rank labels.
"""
from __future__ import annotations

import errno
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from .config import check_count
from .staging import CounterSnapshot
from .violations import sglang_reason_name

RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")
_FAMILIES: dict = {}   # (registry id, prefix, label names) -> the metric families, for `labels=` managers
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
INSTALL_HINT = "pip install 'kv-canary[metrics]' (or prometheus_client)"


def _prometheus():
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(f"kv-canary: Prometheus metrics need prometheus_client: {INSTALL_HINT}") from e
    return prometheus_client


class CanaryMetrics:
    """Prometheus counters and a health gauge for `manager`, attached to its engine or not yet: the
    metrics follow from the first step the engine runs (an engine integration such as
    kv_canary.integrations.transformers attaches the manager only when a run starts)."""

    def __init__(self, manager, *, registry=None, prefix: str = "kv_canary", tp_rank: int = 0, pp_rank: int = 0,
                 dp_rank: int = 0, read_every: int = 1, labels: Optional[Mapping[str, str]] = None):
        """`labels`: constant labels beside the rank labels (e.g. {"scenario": name}); managers with the
        same label names share one registry's metric families, told apart by the label values."""
        prom = _prometheus()
        if not isinstance(prefix, str) or not _NAME.fullmatch(prefix):
            raise ValueError(f"kv-canary: CanaryMetrics prefix must be a Prometheus metric name "
                             f"([a-zA-Z_:][a-zA-Z0-9_:]*), got {prefix!r}")
        ranks = {"tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": dp_rank}
        for name, value in [*ranks.items(), ("read_every", read_every)]:
            check_count(f"CanaryMetrics {name}", value, 1 if name == "read_every" else 0)
        if manager.listener(CanaryMetrics) is not None:
            raise ValueError("kv-canary: this CanaryManager already has a CanaryMetrics; close() it first")
        self.manager = manager
        self.read_every = read_every
        extra = {str(k): str(v) for k, v in (labels or {}).items()}
        self.labels = {**{k: str(v) for k, v in ranks.items()}, **extra}
        registry = prom.REGISTRY if registry is None else registry
        names = list(RANK_LABELS) + list(extra)
        key = (id(registry), prefix, tuple(names))
        families = _FAMILIES.get(key) if extra else None
        if families is None:
            families = _families(prom, prefix, names, registry)
            if extra:
                _FAMILIES[key] = families
        (self.violations, self.violation_rows, self.rows_lost, self.kernel_runs, self.protected_tokens,
         self.healthy) = families
        self.tags = tuple(t.name for t in manager.L.CanaryLaunchTag)   # the kernel-run counters' order
        for tag in self.tags:
            self.kernel_runs.labels(**self.labels, launch_tag=tag)     # every tag's series exists from 0
        for counter in (self.violation_rows, self.rows_lost, self.protected_tokens):
            counter.labels(**self.labels)
        self.healthy.labels(**self.labels).set(1)
        self._seen: dict = {}   # (metric, label values) -> the total it was last brought to
        self._pending: list[CounterSnapshot] = []
        manager.add_listener(self)
        self.on_drain()
        if self._attached():   # made after steps ran: their totals now, not at the next step
            self.refresh()

    # -- what the manager calls -----------------------------------------------------------------
    def on_drain(self) -> None:
        """Add the rows the manager drained since the previous update."""
        st = self.manager.stats
        for (tag, reason), n in st.by_tag_reason.items():
            self._advance(self.violations, n, launch_tag=tag, fail_reason=sglang_reason_name(reason))
        self._advance(self.violation_rows, st.total)
        self._advance(self.rows_lost, st.lost)

    def after_step(self, step: int) -> None:
        """Every `read_every` steps, copy the device counters (asynchronously); apply the copies that
        have landed, and the health check's latest verdict."""
        if step % self.read_every == 0 and self._attached():
            self._pending.append(self._snapshot())
        self._apply_pending(wait=False)

    def refresh(self) -> None:
        """Bring every metric up to the manager's totals now (waits for the device's counters)."""
        self.on_drain()
        if self._attached():
            self._pending.append(self._snapshot())
            self._apply_pending(wait=True)

    def flush(self) -> None:
        """The manager's run ended (CanaryManager.flush): the final totals, without waiting for a next step."""
        self.refresh()

    def _attached(self) -> bool:
        """The manager runs on an engine (its device counters exist)."""
        return self.manager.enabled and getattr(self.manager, "kernel_run_counters", None) is not None

    def close(self) -> None:
        """Stop updating (the metrics stay registered with their last values)."""
        self.manager.remove_listener(self)

    # -- device counters ----------------------------------------------------------------------
    def _snapshot(self) -> CounterSnapshot:
        return CounterSnapshot([self.manager.kernel_run_counters, self.manager.slot_run_counter])

    def _apply_pending(self, *, wait: bool) -> None:
        """Apply the device-counter copies that have landed (every one: `wait`), oldest first, and the
        health check's latest verdict."""
        while self._pending and (wait or self._pending[0].ready()):
            values = self._pending.pop(0).values()
            for tag, n in zip(self.tags, values):
                self._advance(self.kernel_runs, n, launch_tag=tag)
            self._advance(self.protected_tokens, values[len(self.tags)])
        monitor = self.manager.monitor
        self.healthy.labels(**self.labels).set(int(monitor.healthy) if monitor is not None else 1)

    def _advance(self, metric, total: int, **labels) -> None:
        """Bring one series up to `total` (a reading older than the last one adds nothing)."""
        key = (id(metric), *labels.values())
        seen = self._seen.get(key, 0)
        if total > seen:
            metric.labels(**self.labels, **labels).inc(total - seen)
            self._seen[key] = total


def _families(prom, prefix: str, names: list, registry) -> tuple:
    counter = functools.partial(prom.Counter, registry=registry)
    return (counter(f"{prefix}_violations", "Decoded violation rows per launch tag and fail reason (a row with two "
                    "reasons counts under both)", names + ["launch_tag", "fail_reason"]),
            counter(f"{prefix}_violation_rows", "Violation rows appended to the ring, lost rows included", names),
            counter(f"{prefix}_ring_rows_lost", "Violation rows dropped because the ring was full", names),
            counter(f"{prefix}_kernel_runs", "Verify and write launches per launch tag", names + ["launch_tag"]),
            counter(f"{prefix}_protected_tokens", "Slots verified or written (the slot-run counter)", names),
            prom.Gauge(f"{prefix}_healthy", "1, or 0 while the latest health check found a launch tag that stopped "
                       "running", names, registry=registry, multiprocess_mode="min"))


class MetricsPortUnavailable(ValueError):
    """serve_metrics could not listen on the port it was given (taken by another process, or not
    this process's to take); the message names the address, the reason and what to do."""

    def __init__(self, addr: str, port: int, reason: str, hint: str, *, busy: bool):
        super().__init__(f"kv-canary: cannot serve /metrics on {addr}:{port}: {reason}; {hint}")
        self.addr, self.port, self.reason, self.hint, self.busy = addr, port, reason, hint, busy


@dataclass
class MetricsServer:
    """A running /metrics HTTP endpoint (`close()` stops it)."""
    server: object
    thread: object
    addr: str

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def serve_metrics(port: int, *, addr: str = "127.0.0.1", registry=None,
                  multiprocess_dir: Optional[str] = None) -> MetricsServer:
    """Serve `registry` (default: prometheus_client's), or every process's values written under
    `multiprocess_dir` (multiprocess mode), on http://addr:port/metrics; port 0 picks a free port."""
    prom = _prometheus()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"kv-canary: the metrics port must be an int in [0, 65535], got {port!r}")
    if multiprocess_dir is not None:
        from prometheus_client import multiprocess

        registry = prom.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    try:
        started = prom.start_http_server(port, addr=addr, registry=prom.REGISTRY if registry is None else registry)
    except OSError as exc:   # EADDRINUSE above all: a bare [Errno 98] named neither the port nor the fix
        busy = exc.errno == errno.EADDRINUSE
        hint = ("another process is listening there; " if busy else "") + "choose another port (0 picks a free one)"
        raise MetricsPortUnavailable(addr, port, exc.strerror or str(exc), hint, busy=busy) from None
    if not isinstance(started, tuple):
        raise ImportError(f"kv-canary: serving /metrics needs prometheus_client >= 0.17: {INSTALL_HINT}")
    server, thread = started
    return MetricsServer(server, thread, addr)
