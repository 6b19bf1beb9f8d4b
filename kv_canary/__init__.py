"""kv-canary: KV-cache integrity canaries generated from kernels.yaml.

SGLang-compatible names are re-exported from the generated layer; no layout literal lives here.
"""
from __future__ import annotations

import sys as _sys

from ._loader import default_generated_dir, load_generated, register_codegen

register_codegen()  # kv_canary.codegen: the generator, importable from a checkout as from a wheel
generated = _sys.modules.get("kv_canary.generated") or load_generated(default_generated_dir(), "kv_canary.generated")
_layout = generated.layout

ABI_VERSION = _layout.ABI_VERSION
LAYOUT_FINGERPRINT = _layout.LAYOUT_FINGERPRINT
CanaryLaunchTag = _layout.CanaryLaunchTag
FailReason = _layout.FailReason
RealKvHashMode = _layout.RealKvHashMode
CANARY_CHAIN_ANCHOR = _layout.CANARY_CHAIN_ANCHOR
MAX_REAL_KV_SOURCES = _layout.MAX_REAL_KV_SOURCES
REQ_POOL_IDX_PADDING = _layout.REQ_POOL_IDX_PADDING
TOKEN_TO_KV_SLOT_PADDING = _layout.TOKEN_TO_KV_SLOT_PADDING
CANARY_FIELDS_PER_SLOT = _layout.CANARY_FIELDS_PER_SLOT
CANARY_SLOT_BYTES = _layout.CANARY_RECORD_BYTES  # SGLang's name (its verify.py): bytes of the record, fields x 8
# SGLang's names address fields by role, so they stay right when a schema renames or moves fields.
CANARY_FIELD_TOKEN = _layout.CANARY_TOKEN_WORD
CANARY_FIELD_POSITION = _layout.CANARY_POSITION_WORD
CANARY_FIELD_PREV_HASH = _layout.CANARY_CHAIN_LINK_WORD
CANARY_FIELD_REAL_KV_HASH = _layout.CANARY_KV_FINGERPRINT_WORD
VIOLATION_FIELDS = _layout.VIOLATION_FIELDS
REAL_KV_SOURCE_FIELDS_PER_ENTRY = _layout.REAL_KV_SOURCE_FIELDS_PER_ENTRY
splitmix64 = _layout.splitmix64
splitmix64_mix3 = _layout.splitmix64_mix3

# Every VIOLATION_FIELD_* and REAL_KV_SOURCE_FIELD_* the schema declares.
globals().update({k: getattr(_layout, k) for k in dir(_layout)
                  if k.startswith(("VIOLATION_FIELD_", "REAL_KV_SOURCE_FIELD_")) and not k.endswith("_NAMES")})

# The launch API, data classes and allocators need torch; they load on first use (PEP 562) so that
# `kv-canary describe/check/diff` and layout-only users do not pay for importing torch. The launch
# functions are the generated api's (its __all__); the data classes the default layer runtime's.
_ALLOCATOR_NAMES = ("RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "allocate_canary_buf",
                    "allocate_violation_ring", "allocate_reason_counts", "allocate_counter",
                    "allocate_chain_position_flag", "allocate_context")
_LAZY = {
    "BackendUnavailable": ("kv_canary.backends", "BackendUnavailable"),
    "get_backend": ("kv_canary.backends", "get_backend"),
    "runtime_for": ("kv_canary.runtime", "runtime_for"),
    "generate_layer": ("kv_canary.layers", "generate_layer"),
    "CanaryManager": ("kv_canary.manager", "CanaryManager"),
    "CanaryViolationError": ("kv_canary.manager", "CanaryViolationError"),
    "CanaryHealthError": ("kv_canary.monitor", "CanaryHealthError"),
    "CanaryConfig": ("kv_canary.config", "CanaryConfig"),
    "FleetMonitor": ("kv_canary.distributed", "FleetMonitor"),
    "CanaryMetrics": ("kv_canary.metrics", "CanaryMetrics"),
    "Violation": ("kv_canary.violations", "Violation"),
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
    elif name in ("allocators", "validators") or name in _ALLOCATOR_NAMES:
        rt = generated._runtime()
        value = getattr(rt, name) if name in ("allocators", "validators") else getattr(rt.allocators, name)
    elif name in generated.api.__all__:
        value = getattr(generated.api, name)
    else:
        raise AttributeError(f"module 'kv_canary' has no attribute {name!r}")
    globals()[name] = value  # cache: the next access is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_ALLOCATOR_NAMES) | {"allocators", "validators"}
                  | set(generated.api.__all__))
