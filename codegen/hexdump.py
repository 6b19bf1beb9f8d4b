"""The annotated hex dump of one golden record that LAYOUT.md shows.

The record is the first one of docs/semantics.md's chain example (tests/spec/vectors.json `chain_example`): token
11 at position 0, linked to HEAD, real-KV fingerprint 0 (mode NONE); input and reserved fields
are 0. It is laid out from the model, so a stride, order or anchor change shows in the diff.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import (
    MASK64,
    ROLE_CHAIN_LINK,
    ROLE_KV_FINGERPRINT,
    ROLE_POSITION,
    ROLE_TOKEN,
    Schema,
)

GOLDEN_TOKEN = 11
GOLDEN_POSITION = 0


@dataclass(frozen=True)
class HexRow:
    offset: int
    hex: str        # the 8 bytes, little-endian, as 'xx xx ...'
    field: str      # field name, or "(padding)"
    value: str      # the value as it reads back, annotated


def golden_values(schema: Schema) -> dict[str, int]:
    """Field name -> int64 value of the golden record."""
    head = schema.chain_head
    by_role = {ROLE_TOKEN: GOLDEN_TOKEN, ROLE_POSITION: GOLDEN_POSITION, ROLE_CHAIN_LINK: head,
               ROLE_KV_FINGERPRINT: 0}
    return {f.name: by_role.get(f.role, 0) for f in schema.canary.fields}


def _describe(schema: Schema, role: str, value: int) -> str:
    if role == ROLE_CHAIN_LINK:
        signed = value - (1 << 64) if value >> 63 else value
        return f"0x{value:016X} = HEAD (int64 {signed})"
    return str(value)


def golden_rows(schema: Schema) -> tuple[HexRow, ...]:
    """One row per 8-byte word of a whole slot (stride), padding included."""
    rec = schema.canary
    values = golden_values(schema)
    by_offset = {f.offset: f for f in rec.fields}
    rows = []
    for offset in range(0, rec.stride_bytes, rec.word_bytes):
        f = by_offset.get(offset)
        value = values[f.name] if f else 0
        raw = (value & MASK64).to_bytes(8, "little")
        rows.append(HexRow(offset, " ".join(f"{b:02x}" for b in raw), f.name if f else "(padding)",
                           _describe(schema, f.role, value) if f else "never touched"))
    return tuple(rows)
