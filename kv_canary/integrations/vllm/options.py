"""The connector's options: `kv_connector_extra_config` of the KVTransferConfig, checked at start-up."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Optional

from ...engine.config import MODES, REAL_KV_DATA, check_count, parse_mode


@dataclass(frozen=True)
class Options:
    """Every key kv_connector_extra_config may hold (any other key is refused)."""
    mode: str = "log"                   # none (the connector does nothing), log, or raise (stop the engine)
    backend: Optional[str] = None       # torch, cpu, emulated or cuda (default: by the tensors, as Runtime.choose)
    real_kv_data: str = "all"           # none, partial or all: how much of each slot's K/V bytes is fingerprinted
    sweep_interval: int = 8             # steps between sweeps of the prefix cache's blocks (0: never)
    ring_capacity: int = 1024           # violation rows held between drains
    stats_every: int = 0                # the [canary] stats line every N steps (0: never)
    check_v: bool = True                # V buffers and fingerprints too, not only K
    metrics_port: Optional[int] = None  # serve Prometheus /metrics on 127.0.0.1:PORT from the worker (0: any free port)
    max_requests: Optional[int] = None  # requests holding KV at once (default: twice max_num_seqs)
    allow_untested_vllm: bool = False   # run on a vLLM outside TESTED_VERSIONS (at your own risk)
    tree: Optional[str] = None          # the generated package to run (import name or directory; inputs.py)
    request_inputs: Optional[str] = None  # "vllm_namespace" or "module:function": request_input values (inputs.py)

    @classmethod
    def parse(cls, extra: Optional[dict]) -> "Options":
        extra = dict(extra or {})
        if "layer" in extra:  # the key `tree` under its former name, kept for existing configs
            if "tree" in extra:
                raise ValueError("kv-canary: kv_connector_extra_config has both 'tree' and 'layer', its former name; keep 'tree' (the generated package to run)")
            warnings.warn("kv-canary: kv_connector_extra_config['layer'] is the former name of ['tree'] (the generated "  # former name
                          "package to run); rename the key to 'tree'", DeprecationWarning, stacklevel=2)
            extra["tree"] = extra.pop("layer")  # former name
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv-canary: kv_connector_extra_config has unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"expected some of {', '.join(sorted(known))}")
        o = cls(**extra)
        where = "kv_connector_extra_config"
        object.__setattr__(o, "mode", parse_mode(o.mode, f"{where}['mode']"))
        if o.real_kv_data not in REAL_KV_DATA:
            raise ValueError(f"kv-canary: {where}['real_kv_data'] must be one of {', '.join(REAL_KV_DATA)}, "
                             f"got {o.real_kv_data!r}")
        for name, low in (("sweep_interval", 0), ("ring_capacity", 1), ("stats_every", 0)):
            check_count(f"{where}[{name!r}]", getattr(o, name), low)
        for name, low in (("metrics_port", 0), ("max_requests", 1)):
            value = getattr(o, name)
            if value is not None:
                check_count(f"{where}[{name!r}]", value, low)
        if o.metrics_port is not None and o.metrics_port > 65535:
            raise ValueError(f"kv-canary: {where}['metrics_port'] must be in [0, 65535], got {o.metrics_port}")
        for name in ("check_v", "allow_untested_vllm"):
            if not isinstance(getattr(o, name), bool):
                raise ValueError(f"kv-canary: {where}[{name!r}] must be true or false, got {getattr(o, name)!r}")
        if o.backend is not None and not isinstance(o.backend, str):
            raise ValueError(f"kv-canary: {where}['backend'] must be a backend name, got {o.backend!r}")
        return o

    @property
    def enabled(self) -> bool:
        return self.mode != MODES[0]

    def manager_options(self) -> dict:
        return dict(mode=self.mode, backend=self.backend, real_kv_hash_mode=self.real_kv_data.upper(),
                    sweep_interval=self.sweep_interval, ring_capacity=self.ring_capacity,
                    stats_print_every_n_steps=self.stats_every, enable_mha_v=self.check_v)
