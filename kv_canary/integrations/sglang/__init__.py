"""kv-canary as an SGLang plugin: SGLang's own canary runtime (`sglang.srt.kv_canary`) on kv-canary's
kernels.

SGLang (0.5.23) loads every entry point of the group `sglang.srt.plugins` in each of its processes
(`sglang.srt.plugins.load_plugins()`); kv-canary's is `load` below. It does nothing unless
`KV_CANARY_SGLANG=1` is set, so installing kv-canary never changes an SGLang server by itself. When
set, it checks the SGLang version and the generated tree, replaces SGLang's four canary launchers
(and its `use_torch_reference`, so that SGLang's CUDA-graph guard asks the launchers that run)
through SGLang's `HookRegistry` (`HookType.REPLACE`), and logs one line. With
`KV_CANARY_SGLANG_METRICS_PORT` set, each canary manager's counters are served for Prometheus on
127.0.0.1 (kv_canary.engine.metrics); with `KV_CANARY_SGLANG_VIOLATIONS_JSONL=PATH`, each violation
is appended to PATH as a JSON line (kv_canary.engine.jsonl; `{rank}` in PATH is replaced by the
process's torch.distributed rank, and every object has the label `rank`).
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV_ENABLE = "KV_CANARY_SGLANG"
ENV_METRICS_PORT = "KV_CANARY_SGLANG_METRICS_PORT"
ENV_VIOLATIONS_JSONL = "KV_CANARY_SGLANG_VIOLATIONS_JSONL"
ENTRY_POINT_GROUP = "sglang.srt.plugins"

_loaded: dict = {}


def enabled() -> bool:
    """Whether KV_CANARY_SGLANG asks for the plugin ('1', 'true', 'yes', 'on'; unset or '0' = off)."""
    raw = os.environ.get(ENV_ENABLE, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"kv-canary: {ENV_ENABLE} must be 1 (use kv-canary's kernels inside SGLang) or 0, got {raw!r}")


def load() -> None:
    """The `sglang.srt.plugins` entry point: register kv-canary's launchers with SGLang's hook registry."""
    if not enabled():
        return
    if _loaded:
        return
    from . import compat, hooks

    version = compat.check_sglang_version()
    layout = compat.check_tree()
    port = compat.metrics_port(os.environ[ENV_METRICS_PORT]) if os.environ.get(ENV_METRICS_PORT) else None
    if port is not None:
        try:             # prometheus_client missing: refuse now, before any launcher is replaced
            import prometheus_client  # noqa: F401
        except ImportError:
            from kv_canary.engine.metrics import INSTALL_HINT
            raise ImportError(f"kv-canary: {ENV_METRICS_PORT} needs prometheus_client: {INSTALL_HINT}") from None
    jsonl = os.environ.get(ENV_VIOLATIONS_JSONL) or None
    if jsonl is not None:   # an unwritable path: refused now, before any launcher is replaced
        _check_writable(jsonl.replace("{rank}", "0"))
    from . import exporter
    # Every target resolved before any hook is registered: all of them replaced, or none.
    exported = port is not None or jsonl is not None
    hooks.check_targets([*hooks.TARGETS.values(), *(exporter.TARGETS if exported else ())])
    backend = hooks.register()
    if exported:
        exporter.register(port, jsonl)
    import kv_canary

    _loaded.update(version=version, backend=backend)
    logger.info("kv-canary %s active inside SGLang %s: backend=%s schema=abi_version %d, layout %s "
                "(SGLang-compatible 32-byte records); launchers replaced: %s", _kv_canary_version(), version,
                backend, kv_canary.ABI_VERSION, layout.LAYOUT_FINGERPRINT, ", ".join(hooks.TARGETS))


def _check_writable(path: str) -> None:
    from pathlib import Path
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"kv-canary: {ENV_VIOLATIONS_JSONL}={path}: cannot append there ({e.strerror or e})") from None


def metrics_server():
    """The running /metrics endpoint (a kv_canary.engine.metrics.MetricsServer), or None."""
    from . import exporter
    return exporter.SERVER.get("server")


def _kv_canary_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kv-canary")
    except PackageNotFoundError:
        return "unknown"
