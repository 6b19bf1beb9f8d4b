"""Size limits of a schema, each far above what a real schema needs and far below what would make
the generator (or the code it writes) slow, huge or unbuildable. Every limit is a located error."""
from __future__ import annotations

from .diagnostics import Diagnostics, quote
from .model import Schema

MAX_SCHEMA_CHARS = 1 << 20        # the whole file (the default schema is ~6 KB)
MAX_YAML_DEPTH = 64               # nested mappings/lists (the default schema nests 5 deep)
MAX_INT_LITERAL_CHARS = 80        # a 64-bit value in binary with '_' separators fits
MAX_NAME_CHARS = 64               # identifiers; kernel names also become file names and symbols
MAX_TEXT_CHARS = 1024             # one doc string or message
MAX_SLOT_STRIDE_BYTES = 4096      # one canary slot (LAYOUT.md dumps it row by row, 8 bytes a row)
MAX_RECORD_FIELDS = 64            # fields of the canary and of the violation record
MAX_CONSTANTS = 256
MAX_VALUE_SETS = 64               # flag sets + enum sets
MAX_SET_MEMBERS = 256             # members of one flag or enum set
MAX_ABI_VERSION = (1 << 31) - 1   # the CUDA modules export it as an int


def check_limits(schema: Schema, d: Diagnostics) -> None:
    """The limits that apply to a parsed schema (the YAML front end and the parser check the rest)."""
    rec = schema.canary
    if rec.stride_bytes > MAX_SLOT_STRIDE_BYTES:
        d.error(rec.where.get("slot_stride_bytes", rec.loc),
                f"slot_stride_bytes must be at most {MAX_SLOT_STRIDE_BYTES}, got {rec.stride_bytes}")
    if len(schema.constants) > MAX_CONSTANTS:
        d.error(schema.section_loc("constants"),
                f"constants declares {len(schema.constants)} constants; at most {MAX_CONSTANTS} are supported")
    sets = schema.flags + schema.enums
    if len(sets) > MAX_VALUE_SETS:
        d.error(sets[MAX_VALUE_SETS].loc,
                f"flags and enums declare {len(sets)} sets; at most {MAX_VALUE_SETS} are supported")
    for vs in sets:
        if len(vs.members) > MAX_SET_MEMBERS:
            d.error(vs.loc, f"{vs.kind} set {quote(vs.name)} has {len(vs.members)} members; at most "
                            f"{MAX_SET_MEMBERS} are supported")
