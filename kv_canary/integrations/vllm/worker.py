"""The worker side of the vLLM connector: a CanaryManager driven from the connector's hooks.

Per step: `before_forward(meta, forward_context)` (from `bind_connector_metadata`, inside vLLM's
forward context, before the model runs) applies the scheduler's StepMeta, builds the batch from the
attention metadata and runs HEAD; `after_forward()` (from `wait_for_save`, after the forward) runs
TAIL, the sweep when due, the drain, the stats line and the health check.

Never breaks the engine: an error inside the canary (a bug, a capacity it was not sized for) is
caught, logged once with its traceback, counted in `failures`, and turns the canary off for the rest
of the run (its records would no longer match what vLLM holds). Only mode `raise` lets something out:
the CanaryViolationError of a drain that found violations, or the health check's CanaryHealthError,
which stops vLLM's engine (its callers see EngineDeadError) after the report is logged.
"""
from __future__ import annotations

import logging
import traceback
import warnings
from typing import Optional

from ...engine.drain import CanaryViolationError
from ...engine.manager import CanaryCoverageWarning, CanaryManager
from ...engine.monitor import CanaryHealthError
from . import layout as kv_layout
from .engine import VllmEngine, VllmKvStorage
from .inputs import Schema, resolve
from .options import Options

logger = logging.getLogger("kv_canary")
STOPS = (CanaryViolationError, CanaryHealthError)   # what mode raise lets out of a hook


class WorkerCanary:
    def __init__(self, options: Options, *, block_size: int, max_running: int, max_ctx: int, layer_names: list,
                 schema: Optional[Schema] = None):
        self.options = options
        self.schema = schema if schema is not None else resolve(options.tree, options.request_inputs)
        self.block_size = block_size
        self.max_running = max_running
        self.max_ctx = max_ctx
        self.layer_names = list(layer_names)
        self.manager: Optional[CanaryManager] = None
        self.engine: Optional[VllmEngine] = None
        self.metrics = None
        self.server = None
        self.active = False
        self.steps = 0                # forwards guarded so far (the manager's step numbers)
        self.failures = 0             # errors caught inside the canary
        self._batch = None
        self._logged: set = set()

    # -- the guard ------------------------------------------------------------------------------
    def guarded(self, hook: str, fn):
        """Run one hook body: never let a canary error out (mode raise's violations excepted)."""
        if not self.active:
            return None
        try:
            return fn()
        except STOPS:
            if self.options.mode == "raise":
                self.active = False
                logger.error("kv-canary: mode raise: stopping vLLM's engine at step %d (violation report above)",
                             self.steps)
                raise
            self._fail(hook)
        except Exception:
            self._fail(hook)
        return None

    def turn_off(self, why: str) -> None:
        if self.active:
            self.active = False
            self._batch = None
            logger.error("kv-canary: the canary is off for the rest of this run: %s", why)

    def _fail(self, hook: str) -> None:
        self.failures += 1
        self.active = False
        self._batch = None
        if hook not in self._logged:
            self._logged.add(hook)
            logger.error("kv-canary: internal error in %s; the canary is off for the rest of this run, vLLM goes "
                         "on unguarded:\n%s", hook, traceback.format_exc())

    # -- start-up -------------------------------------------------------------------------------
    def register(self, kv_caches: dict, write, *, dtype, device, num_kv_heads: int, head_size: int) -> dict:
        """Attach to the group's per-layer caches; `write(key, value, cache, slot_mapping)` is the backend's
        own cache update (the layout probe). Returns what the start-up line reports."""
        if not self.options.enabled:
            return {}
        caches = [kv_caches[name] for name in self.layer_names]
        shape = tuple(caches[0].shape)
        for name, c in zip(self.layer_names, caches):
            if tuple(c.shape) != shape or c.dtype != caches[0].dtype:
                raise ValueError(f"kv-canary: layer {name}'s KV cache is {c.dtype} {tuple(c.shape)}, unlike "
                                 f"{self.layer_names[0]}'s {caches[0].dtype} {shape}; cannot guard mixed layouts")
        blk = kv_layout.probe(write, shape, dtype, device, block_size=self.block_size, num_heads=num_kv_heads,
                              head_size=head_size)
        storage = VllmKvStorage(caches, blk, self.block_size)
        self.engine = VllmEngine(storage, block_size=self.block_size, max_running=self.max_running,
                                 max_ctx=self.max_ctx, device=device, max_requests=self.options.max_requests,
                                 input_fields=self.schema.fields)
        # The request_input values came from the scheduler side with the request's admission.
        reads = (lambda request: request.inputs) if self.schema.fields else None
        self.manager = CanaryManager(tree=self.schema.tree, request_inputs=reads, **self.options.manager_options())
        with warnings.catch_warnings():
            warnings.simplefilter("always", CanaryCoverageWarning)
            self.manager.attach(self.engine)
        self.engine.canary = self.manager
        if self.options.metrics_port is not None:
            try:
                self._serve_metrics(self.options.metrics_port)
            except OSError as e:   # a port in use: the canary still runs, without its endpoint
                logger.error("kv-canary: cannot serve Prometheus metrics on 127.0.0.1:%s (%s); running without them",
                             self.options.metrics_port, e)
        self.active = True
        return {"k": kv_layout.describe(blk.k), "v": kv_layout.describe(blk.v),
                "layers": len(self.manager.fingerprinted.get("full", ())), "of": len(caches)}

    def _serve_metrics(self, port: int) -> None:
        import prometheus_client

        from ...engine.metrics import CanaryMetrics, serve_metrics

        registry = prometheus_client.CollectorRegistry()
        self.metrics = CanaryMetrics(self.manager, registry=registry)
        self.server = serve_metrics(port, registry=registry)
        logger.info("kv-canary: Prometheus metrics at %s", self.server.url)

    # -- per step -------------------------------------------------------------------------------
    def before_forward(self, meta, attn) -> None:
        """Apply the step's StepMeta and, when the step runs a forward (`attn`: its attention metadata), HEAD."""
        if meta.unguardable:
            self.turn_off(meta.unguardable)
            return

        def body():
            self.engine.apply(meta)
            self._batch = self.engine.batch(meta, attn, self.steps) if attn is not None else None
            if self._batch is not None:
                self.manager.head(self._batch)
        self.guarded("bind_connector_metadata (HEAD)", body)

    def after_forward(self) -> None:
        def body():
            batch, self._batch = self._batch, None
            if batch is None:
                return
            self.manager.tail(batch)
            self.manager.after_step(self.steps)
            self.steps += 1
        self.guarded("wait_for_save (TAIL)", body)

    def close(self) -> None:
        def body():
            if self.manager is not None and self.manager.enabled:
                self.manager.drain()
                if self.metrics is not None:
                    self.metrics.refresh()
        self.guarded("shutdown (drain)", body)
        if self.server is not None:
            self.server.close()
            self.server = None
