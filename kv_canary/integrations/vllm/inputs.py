"""The connector's schema: which generated tree it runs (`tree`) and where the values of the tree's
`request_input` fields come from (`request_inputs`), both from kv_connector_extra_config, checked at
start-up in both of the connector's roles (a schema it cannot fill is refused there, naming the field).

- `tree`: the generated package `kv-canary init` + `kv-canary generate` made in the engine's
  repository, by its import name (`"myengine._canary"`: importable in vLLM's processes) or by its
  directory; absent: kv-canary's own default tree.
- `request_inputs`: `"vllm_namespace"` (the schema's `cache_namespace` field, isolation.yaml's: the
  namespace of the request's LoRA adapter and cache salt, kv_canary.engine.request_inputs), or
  `"module:function"` naming a function `fn(request) -> {field: int}` over vLLM's scheduler-side
  `Request` (`lora_request`, `cache_salt`, `mm_features`, `sampling_params`, ...).

The function runs on the scheduler side, once per admission; the values travel to the worker in the
step's metadata (meta.Scheduled.inputs), where the CanaryManager's request_inputs reads them.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from ...engine.request_inputs import NAMESPACE_FIELD, namespace_inputs, vllm_request_namespace
from ...trees.loader import default_tree, load_generated

WHERE = "kv_connector_extra_config"
VLLM_NAMESPACE = "vllm_namespace"
# Sources the connector serves without the user: the manager's request ids and the engine's epochs.
SERVED = ("request_id", "allocation_epoch")


@dataclass(frozen=True)
class Schema:
    """What the connector runs: the tree, its request_input fields and the function that fills them."""
    tree: ModuleType
    fields: tuple                          # the tree's request_input field names, in schema order
    request_inputs: Optional[Callable]     # None when `fields` is empty

    @property
    def name(self) -> str:
        return getattr(self.tree, "__name__", "kv_canary.generated")


def load_tree(spec: Optional[str]) -> ModuleType:
    """The generated tree named by `tree` (an import name or a directory); the default one for None."""
    if spec is None:
        return default_tree()
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"kv-canary: {WHERE}['tree'] must name a generated package (its import name, e.g. "
                         f"'myengine._canary', or its directory), got {spec!r}")
    try:
        if "/" in spec or Path(spec).is_dir():
            tree = load_generated(spec)
        else:
            tree = importlib.import_module(spec)
    except Exception as e:
        raise ValueError(f"kv-canary: {WHERE}['tree'] = {spec!r} cannot be loaded ({type(e).__name__}: {e}); "
                         f"expected the package `kv-canary generate` wrote (its directory, or its import name "
                         f"with its repository on the engine processes' sys.path / PYTHONPATH)") from e
    if not hasattr(getattr(tree, "layout", None), "INPUT_FIELDS") or not hasattr(tree, "GENERATION_ID"):
        raise ValueError(f"kv-canary: {WHERE}['tree'] = {spec!r} is not a generated kv-canary package (no layout "
                         f"tables, no GENERATION_ID): expected the package `kv-canary generate` wrote")
    return tree


def load_function(spec: Optional[str]) -> Optional[Callable]:
    """The function named by `request_inputs` (None when not given)."""
    if spec is None:
        return None
    if spec == VLLM_NAMESPACE:
        return namespace_inputs(vllm_request_namespace)
    module, _, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module or not name:
        raise ValueError(f"kv-canary: {WHERE}['request_inputs'] must be {VLLM_NAMESPACE!r} or 'module:function' "
                         f"(a function of vLLM's Request returning {{field: int}}), got {spec!r}")
    try:
        fn: Any = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
    except Exception as e:
        raise ValueError(f"kv-canary: {WHERE}['request_inputs'] = {spec!r} cannot be loaded "
                         f"({type(e).__name__}: {e})") from e
    if not callable(fn):
        raise ValueError(f"kv-canary: {WHERE}['request_inputs'] = {spec!r} is not a function, got {fn!r}")
    return fn


def resolve(tree_spec: Optional[str], inputs_spec: Optional[str]) -> Schema:
    """The connector's schema, or a ValueError naming each input field it cannot fill (all at once)."""
    tree = load_tree(tree_spec)
    fn = load_function(inputs_spec)
    where = f"{WHERE}['tree'] = {tree_spec!r}" if tree_spec is not None else "kv-canary's default schema"
    problems, fields = [], []
    for f in tree.layout.INPUT_FIELDS:
        if f.source == "request_input":
            fields.append(f.name)
            if fn is None:
                problems.append(f"request_input field {f.name!r} has no function: set {WHERE}['request_inputs'] to "
                                f"{VLLM_NAMESPACE!r} (fills {NAMESPACE_FIELD!r}) or 'module:function'")
            elif inputs_spec == VLLM_NAMESPACE and f.name != NAMESPACE_FIELD:
                problems.append(f"request_input field {f.name!r} is not filled by {VLLM_NAMESPACE!r} (it fills "
                                f"{NAMESPACE_FIELD!r} only): set {WHERE}['request_inputs'] to 'module:function'")
        elif f.source not in SERVED:
            problems.append(f"input field {f.name!r} has source {f.source!r}, which the vLLM connector cannot serve "
                            f"(it serves {', '.join(SERVED)} and request_input)")
    if problems:
        raise ValueError(f"kv-canary: cannot fill the schema of {where}: " + "; ".join(problems))
    return Schema(tree, tuple(fields), fn if fields else None)
