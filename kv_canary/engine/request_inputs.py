"""Per-request values of a schema's `request_input` fields (docs/schema.md, input sources).

`CanaryManager(request_inputs=fn)` calls `fn(request)` once per request (its first batch) and writes
the values into every record the request writes; each record a request reads (a prefix-cache hit
included) is checked against the READING request's own value. What the values are is the engine's
business; for isolation (kv_canary/schemas/isolation.yaml) the value is a namespace of the request:

- `namespace_of(*parts)`: a stable 64-bit namespace of the parts that key an engine's prefix cache
  besides the tokens (adapter, cache salt, multimodal hashes). Stable across processes and machines
  (blake2b, not Python's `hash`), never `UNKNOWN` (-1: "no check"), and `namespace_of()` (no parts)
  is `DEFAULT_NAMESPACE` (0): the namespace of a request with nothing that isolates it.
- `vllm_request_namespace(req)`: the namespace of a vLLM request from what vLLM's prefix cache keys
  blocks on (`lora_request`, `cache_salt`, optionally multimodal hashes), read by duck typing.
- `namespace_inputs(field, namespace_fn)`: the `request_inputs` function that fills one field.

Engine-neutral: nothing here imports an engine.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from ..trees.loader import default_tree

__all__ = ("DEFAULT_NAMESPACE", "NAMESPACE_FIELD", "namespace_of", "vllm_request_namespace", "namespace_inputs",
           "check_request_values")

DEFAULT_NAMESPACE = 0
NAMESPACE_FIELD = "cache_namespace"   # the field of kv_canary/schemas/isolation.yaml
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_UNKNOWN = default_tree().layout.UNKNOWN   # -1 in every layout: an expected value that is not checked
_PERSON = b"kv-canary-ns"              # blake2b personalisation: these hashes are ours alone


def _encode(part: Any, out: bytearray, where: str) -> None:
    """A prefix-free byte encoding (type tag, length, bytes), so ("ab", "c") and ("a", "bc") differ."""
    if part is None:
        out += b"N"
    elif isinstance(part, bool):
        out += b"T" if part else b"F"
    elif isinstance(part, int):
        data = str(part).encode("ascii")
        out += b"I" + len(data).to_bytes(4, "little") + data
    elif isinstance(part, str):
        data = part.encode("utf-8", "surrogatepass")
        out += b"S" + len(data).to_bytes(8, "little") + data
    elif isinstance(part, (bytes, bytearray, memoryview)):
        data = bytes(part)
        out += b"B" + len(data).to_bytes(8, "little") + data
    elif isinstance(part, (tuple, list)):
        out += b"L" + len(part).to_bytes(8, "little")
        for i, item in enumerate(part):
            _encode(item, out, f"{where}[{i}]")
    else:
        raise ValueError(f"kv-canary: namespace_of parts must be None, bool, int, str, bytes or tuples/lists of "
                         f"them, got {type(part).__name__} at {where}")


def namespace_of(*parts: Any) -> int:
    """The int64 namespace of `parts` (in order; None counts as a part). No parts: DEFAULT_NAMESPACE."""
    if not parts:
        return DEFAULT_NAMESPACE
    data = bytearray()
    for i, part in enumerate(parts):
        _encode(part, data, f"parts[{i}]")
    value = int.from_bytes(hashlib.blake2b(bytes(data), digest_size=8, person=_PERSON).digest(), "little",
                           signed=True)
    # 0 and -1 mean "nothing isolates it" and "not checked"; a hash landing there (p = 2^-63) moves.
    return value if value not in (DEFAULT_NAMESPACE, _UNKNOWN) else value ^ 0x5A5A5A5A5A5A5A5A


def _multimodal_hashes(req) -> tuple:
    """A vLLM request's multimodal input hashes: `mm_features[i].identifier` (newer vLLM) or `mm_hashes`."""
    features = getattr(req, "mm_features", None)
    if features:
        return tuple(str(getattr(f, "identifier", None) or getattr(f, "mm_hash", "")) for f in features)
    return tuple(str(h) for h in (getattr(req, "mm_hashes", None) or ()))


def vllm_request_namespace(req, *, multimodal: bool = False) -> int:
    """The namespace of a vLLM request (any object with its attribute names): its LoRA adapter
    (`lora_request.lora_int_id` and `.lora_name`), its `cache_salt` and, with `multimodal=True`, its
    multimodal input hashes. No adapter, salt or media: DEFAULT_NAMESPACE.

    vLLM keys every block on the adapter and (through the chained block hash) on the salt: both are
    request-wide, as a namespace is. vLLM's key names the adapter by `lora_name` (older versions by
    `lora_int_id`); the namespace takes both, so an adapter reloaded under its old name with a new id
    reusing the blocks its previous weights wrote is reported too. A multimodal hash keys only the blocks from the input's
    placeholder on, so two requests with the same text and different images correctly share the text
    blocks before the images: a request-wide namespace with the hashes would report that sharing.
    Turn `multimodal` on only where every prompt puts its media before any text it shares."""
    parts = []
    lora = getattr(req, "lora_request", None)
    if lora is not None:
        parts.append(("lora", getattr(lora, "lora_int_id", None), getattr(lora, "lora_name", None)))
    salt = getattr(req, "cache_salt", None)
    if salt is not None:
        parts.append(("salt", salt))
    if multimodal:
        hashes = _multimodal_hashes(req)
        if hashes:
            parts.append(("mm", hashes))
    return namespace_of(*parts)


def namespace_inputs(namespace: Callable[[Any], int], field: str = NAMESPACE_FIELD) -> Callable[[Any], dict]:
    """`request_inputs` for a schema with one namespace field: request -> {field: namespace(request)}."""
    return lambda request: {field: namespace(request)}


def check_request_values(values: Any, fields: tuple, request) -> tuple:
    """The values of `fields` in what a request_inputs function returned, as ints; a ValueError naming
    the request, the field and what was given otherwise. Extra keys are ignored (one function may
    serve schemas with and without a field)."""
    rid = getattr(request, "rid", None)
    if not isinstance(values, Mapping):
        raise ValueError(f"kv-canary: request_inputs(request rid={rid}) must return a mapping of the schema's "
                         f"request_input fields ({', '.join(fields)}) to int64 values, got {values!r}")
    out = []
    for name in fields:
        if name not in values:
            raise ValueError(f"kv-canary: request_inputs(request rid={rid}) gave no value for the schema's "
                             f"request_input field {name!r} (got keys: {', '.join(map(repr, values)) or 'none'})")
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"kv-canary: request_inputs(request rid={rid})[{name!r}] must be an int in the int64 "
                             f"range [{INT64_MIN}, {INT64_MAX}], got {value!r}")
        if value == _UNKNOWN:
            raise ValueError(f"kv-canary: request_inputs(request rid={rid})[{name!r}] must not be {_UNKNOWN} "
                             f"(UNKNOWN: it would turn the check off); namespace_of never returns it")
        out.append(int(value))
    return tuple(out)
