"""Entry point of the front end: text -> located YAML -> frozen model -> checked model."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from .checks import attach_kernel_params, check_schema
from .diagnostics import Diagnostic, Diagnostics, Loc, SchemaError, describe_unreadable, internal_error
from .limits import MAX_SCHEMA_CHARS
from .messages import resolve_messages
from .model import Schema
from .parse import Parser
from .yaml_loader import load_yaml, normalise_text


def load_schema_text(text: str, display_name: str = "kernels.yaml") -> Schema:
    """Parse and check a schema; raise SchemaError listing every problem (sorted).

    Nothing else escapes: an exception the front end did not expect is a bug of the generator, and is
    reported as one diagnostic that says so (SchemaError.internal), never as a bare traceback."""
    try:
        return _load_schema_text(text, display_name)
    except SchemaError:
        raise
    except Exception as exc:  # the last resort (MemoryError and RecursionError included)
        raise internal_error(display_name, exc) from exc


def _load_schema_text(text: str, display_name: str) -> Schema:
    root = load_yaml(text, display_name)
    d = Diagnostics()
    schema = Parser(d).schema(root, display_name)
    if schema is None:
        if not d:
            d.error(Loc(display_name, 1, 1), "the schema is incomplete")
        d.raise_if_any()
    check_schema(schema, d)
    schema = resolve_messages(schema, d)
    d.raise_if_any()
    schema = attach_kernel_params(schema, d)
    d.raise_if_any()
    return dataclasses.replace(schema, notes=d.note_lines())


def schema_text(raw: bytes, display_name: str) -> str:
    """The text of schema bytes, as it is parsed and hashed: decoded strictly as UTF-8 (a bad byte is
    a diagnostic at its line and column) with line endings normalised (normalise_text)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SchemaError([Diagnostic(Loc(display_name, line, col),
                                      f"schema is not UTF-8: {exc.reason} (byte 0x{raw[exc.start]:02X} at offset "
                                      f"{exc.start})")]) from None
    return normalise_text(text)


def load_schema_bytes(raw: bytes, display_name: str) -> Schema:
    """Decode (see schema_text) and load."""
    return load_schema_text(schema_text(raw, display_name), display_name)


def read_schema(path: Path, display_name: str | None = None) -> tuple[Schema, str]:
    """(schema, the text it was parsed from) of a schema file, read once: the generated files' headers
    hash exactly the text that was checked, even if the file changes meanwhile."""
    path = Path(path)
    display_name = display_name or path.name
    try:
        with path.open("rb") as fh:
            raw = fh.read(4 * MAX_SCHEMA_CHARS + 1)  # UTF-8 takes at most 4 bytes a character
    except OSError as exc:
        raise SchemaError([Diagnostic(Loc(display_name, 1, 1),
                                      f"cannot read schema {path}: {describe_unreadable(path, exc)}")]) from None
    if len(raw) > 4 * MAX_SCHEMA_CHARS:
        raise SchemaError([Diagnostic(Loc(display_name, 1, 1), f"the schema is larger than {4 * MAX_SCHEMA_CHARS} "
                                                               f"bytes; at most {MAX_SCHEMA_CHARS} characters are "
                                                               f"supported")])
    text = schema_text(raw, display_name)
    return load_schema_text(text, display_name), text


def load_schema(path: Path, display_name: str | None = None) -> Schema:
    return read_schema(path, display_name)[0]


def layout_description(schema: Schema) -> dict:
    """The layout-relevant part of the schema as plain data (what the ABI fingerprint hashes). Not the
    canary slot stride: kernels take each buffer's own stride, slot_stride_bytes is only the default
    of new allocations."""
    def rec(r):
        return {
            "word": r.word,
            "fields": [[f.name, f.offset, f.role, f.carries,
                        [f.verify.expected, f.verify.fail_reason] if f.verify else None] for f in r.fields],
        }
    return {
        "abi_version": schema.abi_version,
        "constants": [[c.name, c.type, c.value] for c in schema.constants],
        "canary": rec(schema.canary),
        "chain": [schema.canary.chain.anchor, list(schema.canary.chain.fold)],
        "violation": rec(schema.violation),
        "real_kv_source": rec(schema.real_kv_source),
        "flags": [[vs.name, [[m.name, m.value] for m in vs.members]] for vs in schema.flags],
        "enums": [[vs.name, [[m.name, m.value] for m in vs.members]] for vs in schema.enums],
    }


def layout_fingerprint(schema: Schema) -> str:
    """16 hex digits identifying the binary layout; generated code of every backend embeds it."""
    blob = json.dumps(layout_description(schema), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
