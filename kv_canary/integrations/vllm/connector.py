"""KvCanaryConnector: kv-canary as a vLLM v1 KV connector (imports vLLM; see the package docstring).

The scheduler role turns each step into a StepMeta (scheduler.SchedulerSide); the worker role runs
the canary (worker.WorkerCanary) from `bind_connector_metadata` (HEAD, before the forward) and
`wait_for_save` (TAIL, after it). It loads no KV from anywhere and saves none: it only reads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ...launch.runtime import choose_backend
from . import check_vllm, refusals
from .inputs import resolve
from .meta import StepMeta
from .options import Options
from .scheduler import SchedulerSide
from .worker import WorkerCanary

logger = logging.getLogger("kv_canary")


@dataclass
class KvCanaryMetadata(KVConnectorMetadata):
    step: Optional[StepMeta] = None
    off: bool = False             # the scheduler side failed: the worker side turns its canary off too


def _log_through_vllm() -> None:
    """kv-canary's logger (violation reports, stats lines) writes where vLLM's does, in its format."""
    ours = logging.getLogger("kv_canary")
    if not ours.handlers:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KvCanaryConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector that guards vLLM's own KV cache (kv_role "kv_both"; loads and saves nothing)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.options = Options.parse(ktc.kv_connector_extra_config if ktc is not None else None)
        self.vllm_version = check_vllm(self.options.allow_untested_vllm)
        self.sched: Optional[SchedulerSide] = None
        self.sched_failed = False
        self.worker: Optional[WorkerCanary] = None
        if not self.options.enabled:
            return
        _log_through_vllm()
        problems = refusals(vllm_config, kv_cache_config)
        if problems:
            raise ValueError("kv-canary: cannot guard this vLLM configuration: " + "; ".join(problems)
                             + " (or set kv_connector_extra_config {'mode': 'none'})")
        # The schema (the user's generated package or the default) and what fills its request_input
        # fields: refused here, in both roles, when the connector cannot fill it.
        self.schema = resolve(self.options.tree, self.options.request_inputs)
        group = kv_cache_config.kv_cache_groups[0]
        block_size = int(group.kv_cache_spec.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self.sched = SchedulerSide(block_size=block_size,
                                       prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                                       input_fields=self.schema.fields, request_inputs=self.schema.request_inputs)
        else:
            sc = vllm_config.scheduler_config
            self.worker = WorkerCanary(self.options, block_size=block_size, max_running=int(sc.max_num_seqs),
                                       max_ctx=int(vllm_config.model_config.max_model_len),
                                       layer_names=list(group.layer_names), schema=self.schema)
            self._vllm_config = vllm_config
            self._group = group

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.worker is None:
            return
        from importlib.metadata import version

        layers = self._vllm_config.compilation_config.static_forward_context
        first = layers[self._group.layer_names[0]]
        spec = self._group.kv_cache_spec
        cache = kv_caches[self._group.layer_names[0]]

        def write(key, value, scratch, slot_mapping):
            first.impl.do_kv_cache_update(first, key, value, scratch, slot_mapping)

        try:
            seen = self.worker.register(kv_caches, write, dtype=cache.dtype, device=cache.device,
                                        num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size))
        except ValueError:
            raise        # a refusal (a layout or capacity it cannot guard): vLLM does not start, with the reason
        except Exception:
            logger.exception("kv-canary: internal error while attaching to vLLM's KV cache; the canary is off, "
                             "vLLM runs unguarded")
            return
        m = self.worker.manager
        logger.info("kv-canary %s guarding vLLM %s: mode %s, backend %s, schema %s (abi %s), real-KV %s of %d/%d "
                    "layers (K: %s; V: %s), sweep every %s steps", version("kv-canary"), self.vllm_version, m.mode,
                    choose_backend(self.options.backend, cache.device), _schema(m), m.L.ABI_VERSION, self.options.real_kv_data,
                    seen["layers"], seen["of"], seen["k"], seen["v"] if self.options.check_v else "not checked",
                    self.options.sweep_interval or "never")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is None or not self.worker.active:
            return
        if getattr(connector_metadata, "off", False):
            self.worker.turn_off("the scheduler side of the connector failed (its error is in the engine core's log)")
            return
        meta = getattr(connector_metadata, "step", None)
        if meta is None:
            return
        from vllm.forward_context import get_forward_context, is_forward_context_available

        attn = None
        if is_forward_context_available():
            by_layer = get_forward_context().attn_metadata
            if isinstance(by_layer, dict):
                attn = by_layer.get(self._group.layer_names[0])
        self.worker.before_forward(meta, attn)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        if self.worker is not None:
            self.worker.after_forward()

    def shutdown(self):
        if self.worker is not None:
            self.worker.close()

    # -- scheduler side -------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        if self.sched is not None:
            self.sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.sched is not None:
            self._sched_guard("update_state_after_alloc", lambda: self.sched.admit(request))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self.sched is None:
            return KvCanaryMetadata()
        step = self._sched_guard("build_connector_meta", lambda: self.sched.build(scheduler_output))
        return KvCanaryMetadata(step, off=self.sched_failed)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is not None:
            self._sched_guard("request_finished", lambda: self.sched.finished(request, block_ids))
        return False, None

    def _sched_guard(self, hook: str, fn):
        """The scheduler side's hooks never raise: an error turns the canary off (logged once)."""
        if self.sched_failed:
            return None
        try:
            return fn()
        except Exception:
            self.sched_failed = True
            logger.exception("kv-canary: internal error in %s (scheduler side); the canary is off for the rest of "
                             "this run, vLLM goes on unguarded", hook)
            return None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) \
            -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])


def _schema(manager) -> str:
    return getattr(manager.tree, "__name__", "kv_canary.generated")
