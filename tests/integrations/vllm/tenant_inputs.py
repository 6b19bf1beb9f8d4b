"""request_inputs functions as a user writes them (`"request_inputs": "tenant_inputs:FUNCTION"` in
kv_connector_extra_config): functions of vLLM's scheduler-side Request (imported by the connector)."""
from __future__ import annotations

from kv_canary.engine.request_inputs import namespace_of

CALLS = []


def by_salt(request) -> dict:
    """The tenant alone (its cache salt), ignoring adapters: a user's own namespace."""
    CALLS.append(request.request_id)
    return {"cache_namespace": namespace_of("tenant", request.cache_salt)}


def broken(request) -> dict:
    raise RuntimeError("injected request_inputs bug")


NOT_A_FUNCTION = 3
