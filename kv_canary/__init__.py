"""kv-canary: KV-cache integrity canaries generated from kernels.yaml.

SGLang-compatible names are re-exported from the generated layer; no layout literal lives here.
"""
from __future__ import annotations

import sys as _sys

from ._loader import default_generated_dir, load_generated

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

# Launch data classes and allocators (generated/allocators.py), then the launch API.
import importlib as _importlib  # noqa: E402

allocators = _importlib.import_module("kv_canary.generated.allocators")
validators = _importlib.import_module("kv_canary.generated.validators")
RealKvSource = allocators.RealKvSource
VerifyOrWriteContext = allocators.VerifyOrWriteContext
VerifyPlan = allocators.VerifyPlan
WritePlan = allocators.WritePlan
allocate_canary_buf = allocators.allocate_canary_buf
allocate_violation_ring = allocators.allocate_violation_ring
allocate_counter = allocators.allocate_counter
allocate_chain_position_flag = allocators.allocate_chain_position_flag
allocate_context = allocators.allocate_context

from .api import *  # noqa: E402,F401,F403  (the launch functions, SGLang's names)
from .backends import BackendUnavailable, get_backend  # noqa: E402,F401
from .runtime import runtime_for  # noqa: E402,F401
