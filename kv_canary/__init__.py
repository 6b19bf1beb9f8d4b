"""kv-canary: KV-cache integrity canaries generated from kernels.yaml.

This root names the public API above the package's tiers (docs/architecture.md): SGLang-compatible
names from the default generated tree (no layout literal lives here), the rest loaded on first use.
"""
from __future__ import annotations

import importlib
import warnings

from .trees import loader as _loader
from .trees.loader import load_generated  # noqa: F401  (public: another schema's tree)

_loader.register_codegen()  # kv_canary.codegen and .workflow: importable from a checkout as from a wheel
generated = _loader.default_tree()
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
# The schema names the row and real-KV source columns: VIOLATION_FIELD_<NAME>, REAL_KV_SOURCE_FIELD_<NAME>.
SCHEMA_FIELD_PREFIXES = ("VIOLATION_FIELD_", "REAL_KV_SOURCE_FIELD_")

# Names that need torch load on first use (PEP 562), so that `kv-canary describe/check/diff` and
# layout-only users do not import it: public name -> (module, attribute). The launch functions are
# the generated api's (its __all__); the data classes and allocators the default tree runtime's.
LAZY = {
    "BackendUnavailable": ("kv_canary.backends", "BackendUnavailable"),
    "get_backend": ("kv_canary.backends", "get_backend"),
    "runtime_for": ("kv_canary.launch.runtime", "runtime_for"),
    "generate_tree": ("kv_canary.trees.schemas", "generate_tree"),
    "CanaryManager": ("kv_canary.engine.manager", "CanaryManager"),
    "CanaryViolationError": ("kv_canary.engine.manager", "CanaryViolationError"),
    "CanaryHealthError": ("kv_canary.engine.monitor", "CanaryHealthError"),
    "CanaryConfig": ("kv_canary.engine.config", "CanaryConfig"),
    "FleetMonitor": ("kv_canary.engine.distributed", "FleetMonitor"),
    "CanaryMetrics": ("kv_canary.engine.metrics", "CanaryMetrics"),
    "Violation": ("kv_canary.engine.violations", "Violation"),
}
ALLOCATOR_NAMES = ("RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "allocate_canary_buf",
                   "allocate_violation_ring", "allocate_reason_counts", "allocate_counter",
                   "allocate_chain_position_flag", "allocate_context")


def __getattr__(name: str):
    if name in LAZY:
        module_name, attr = LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
    elif name in ("allocators", "validators"):
        value = getattr(generated._runtime(), name)
    elif name in ALLOCATOR_NAMES:
        value = getattr(generated._runtime().allocators, name)
    elif name in generated.api.__all__:
        value = getattr(generated.api, name)
    elif name.startswith(SCHEMA_FIELD_PREFIXES) and not name.endswith("_NAMES") and hasattr(_layout, name):
        value = getattr(_layout, name)
    elif name == "generate_layer":  # generate_tree's former name, kept for engines (never cached: it warns)
        warnings.warn("kv-canary: kv_canary.generate_layer is the former name of kv_canary.generate_tree; "  # former name
                      "call generate_tree", DeprecationWarning, stacklevel=2)
        return __getattr__("generate_tree")
    else:
        raise AttributeError(f"module 'kv_canary' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__():
    schema_fields = {k for k in dir(_layout) if k.startswith(SCHEMA_FIELD_PREFIXES) and not k.endswith("_NAMES")}
    return sorted(set(globals()) | set(LAZY) | set(ALLOCATOR_NAMES) | {"allocators", "validators"}
                  | set(generated.api.__all__) | schema_fields)
