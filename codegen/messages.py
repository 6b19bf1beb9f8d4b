"""Run-time error messages (SEMANTICS.md §7) declared in the schema.

A message may quote schema values as ``{schema.NAME}`` (substituted at generation time, so the
numbers always match the layout) and run-time values as ``{name}`` (filled by the validator).
Each message key has a fixed set of run-time placeholders that the validators pass.
"""
from __future__ import annotations

import dataclasses
import string

from .diagnostics import Diagnostics, closest_hint, closest_name
from .model import Message, Schema

# message key -> the run-time placeholders its validator provides
REQUIRED_MESSAGES = {
    "real_kv_page_size": ("page_size",),
    "real_kv_num_bytes_per_token": ("n",),
    "real_kv_read_bytes": ("n", "r"),
    "real_kv_tensor_rank": ("shape",),
    "real_kv_row_stride": ("b", "shape", "strides", "dtype"),
    "real_kv_row_width": ("b", "p", "n", "m"),
    "real_kv_source_count": ("n",),
    "canary_stride": ("n",),
    "not_contiguous": ("name",),
    "expected_inputs_required": (),
    "expected_inputs_forbidden": (),
    "verify_capacity": ("n",),
    "write_capacity": ("n",),
    "swa_index": ("s", "n"),
}
# Messages added after schemas were in use: a schema may state them (checked like the required
# ones), and the generator supplies the default text where it does not, so older schemas still
# generate. key -> (run-time placeholders, default text).
OPTIONAL_MESSAGES = {
    "real_kv_layout": (("field", "expected", "got"), "RealKvSource.{field} must be {expected}, got {got}"),
    "real_kv_extent": (("end", "have", "shape", "strides", "dtype"),
                       "RealKvSource.tensor is too small for its slot layout: the farthest byte a slot of a row "
                       "reads ends {end} bytes past the tensor's first element, but its storage holds {have} "
                       "bytes from there (shape={shape}, strides={strides}, dtype={dtype})"),
    "real_kv_partial": (("i", "n"),
                        "real_kv_hash_mode PARTIAL reads the first {schema.REAL_KV_PARTIAL_READ_BYTES} bytes of "
                        "a slot, but real_kv_sources[{i}].num_bytes_per_token is {n}"),
}
KNOWN_MESSAGES = {**REQUIRED_MESSAGES, **{key: placeholders for key, (placeholders, _) in OPTIONAL_MESSAGES.items()}}


def schema_values(schema: Schema) -> dict[str, int]:
    """Values a message can quote as {schema.NAME}: constants plus derived layout sizes."""
    values = {c.name: c.value for c in schema.constants}
    values.update(
        CANARY_FIELDS_PER_SLOT=len(schema.canary.fields),
        CANARY_RECORD_BYTES=schema.canary.record_bytes,
        CANARY_SLOT_STRIDE_BYTES=schema.canary.stride_bytes,
        VIOLATION_FIELDS=len(schema.violation.fields),
    )
    return values


def resolve_messages(schema: Schema, d: Diagnostics) -> Schema:
    """Check every message and substitute its {schema.X} references, supplying the optional
    messages the schema leaves out (OPTIONAL_MESSAGES); returns the updated schema."""
    values = schema_values(schema)
    resolved = []
    present = {msg.key for msg in schema.messages}
    supplied = tuple(Message(key, text, (), schema.section_loc("messages"))
                     for key, (_, text) in OPTIONAL_MESSAGES.items() if key not in present)
    for msg in schema.messages + supplied:
        present.add(msg.key)
        if msg.key not in KNOWN_MESSAGES:
            meant = closest_name(msg.key, KNOWN_MESSAGES)
            present.add(meant)  # a misspelt key: one error, not also "missing"
            d.error(msg.loc, f"unknown message '{msg.key}'{closest_hint(msg.key, KNOWN_MESSAGES)}; "
                             f"known messages: prefix, {', '.join(KNOWN_MESSAGES)}")
            continue
        try:
            parts = list(string.Formatter().parse(msg.text))
        except ValueError as exc:
            d.error(msg.loc, f"message '{msg.key}' is not a valid format string: {exc}")
            continue
        out, runtime = [], []
        for literal, field_name, spec, conv in parts:
            out.append(literal.replace("{", "{{").replace("}", "}}"))
            if field_name is None:
                continue
            if spec or conv:
                d.error(msg.loc, f"message '{msg.key}' placeholder '{field_name}' must not use a format spec")
            if field_name.startswith("schema."):
                key = field_name[len("schema."):]
                if key not in values:
                    d.error(msg.loc, f"message '{msg.key}' quotes unknown schema value '{key}'; "
                                     f"known: {', '.join(sorted(values))}")
                    continue
                out.append(str(values[key]))
            else:
                runtime.append(field_name)
                out.append("{" + field_name + "}")
        expected = KNOWN_MESSAGES[msg.key]
        if sorted(set(runtime)) != sorted(expected):
            d.error(msg.loc, f"message '{msg.key}' must use exactly the placeholders "
                             f"{', '.join('{' + p + '}' for p in expected) or '(none)'}, got "
                             f"{', '.join('{' + p + '}' for p in runtime) or '(none)'}")
        resolved.append(dataclasses.replace(msg, text="".join(out), placeholders=tuple(runtime)))
    for key in REQUIRED_MESSAGES:
        if key not in present:
            d.error(schema.section_loc("messages"), f"missing required message '{key}'")
    return dataclasses.replace(schema, messages=tuple(resolved))
