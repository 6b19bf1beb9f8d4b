"""Facts the kernels fix, supplied by the generator: a schema states only its choices.

The 16-byte real-KV load alignment (model.BUILTIN_CONSTANTS), the real-KV source record
(model.REAL_KV_SOURCE_FIELDS) and the kinds of the built-in fail reasons
(model.BUILTIN_FAIL_REASON_KINDS, filled in by the parser) are not the schema's to choose. A schema
written before they left it may still state them: the same fact is accepted (the line is redundant
and can go), another one is an error at its line that names the file to remove it from.
"""
from __future__ import annotations

from typing import Optional

from .diagnostics import Diagnostics, Loc
from .model import BUILTIN_CONSTANTS, REAL_KV_SOURCE_FIELDS, REAL_KV_SOURCE_WORD, WORD_TYPES, Constant, Field, Record


def supplied(what: str, loc: Loc, it: str = "it") -> str:
    """The hint of a restated built-in fact that disagrees with the generator's."""
    return f" (the generator supplies {what}: remove {it} from {loc.file})"


def supply_constants(stated: tuple[Constant, ...], d: Diagnostics, loc: Loc) -> tuple[Constant, ...]:
    """The schema's constants, then the built-in ones (at `loc`, the constants section); a restated
    built-in is checked, then dropped, so that old and new schemas give the same constants in one order."""
    for c in stated:
        if c.name not in BUILTIN_CONSTANTS:
            continue
        ctype, value, _, why = BUILTIN_CONSTANTS[c.name]
        if c.type != ctype:
            d.error(c.where.get("type", c.loc), f"constant '{c.name}' must have type {ctype}, got {c.type}"
                                                f"{supplied(c.name, c.loc)}")
        elif c.value != value:
            d.error(c.where.get("value", c.loc), f"{c.name} must be {value}: {why}, got {c.value}"
                                                 f"{supplied(c.name, c.loc)}")
        else:
            d.note(c.loc, f"constant '{c.name}' is supplied by the generator ({ctype} {value}); this line "
                          f"can be removed")
    return tuple(c for c in stated if c.name not in BUILTIN_CONSTANTS) + tuple(
        Constant(name, ctype, value, doc, loc) for name, (ctype, value, doc, _) in BUILTIN_CONSTANTS.items())


def supply_real_kv_source(stated: Optional[Record], d: Diagnostics, loc: Loc) -> Record:
    """The real-KV source record (at `loc`, the records section); a restated one must match it."""
    if stated is not None:
        hint = supplied("the real_kv_source record", stated.loc)
        if stated.word != REAL_KV_SOURCE_WORD:
            d.error(stated.where.get("word", stated.loc),
                    f"record 'real_kv_source' word must be {REAL_KV_SOURCE_WORD}, got {stated.word}{hint}")
        names = tuple(f.name for f in stated.fields)
        if names != REAL_KV_SOURCE_FIELDS:
            d.error(stated.where.get("fields", stated.loc),
                    f"record 'real_kv_source' fields must be {', '.join(REAL_KV_SOURCE_FIELDS)} in this order, "
                    f"got {', '.join(names) or 'none'}{hint}")
        elif stated.word == REAL_KV_SOURCE_WORD:
            d.note(stated.loc, "record 'real_kv_source' is supplied by the generator; it can be removed")
    wb = WORD_TYPES[REAL_KV_SOURCE_WORD]
    fields = tuple(Field(n, i, i * wb, "", "", None, "", loc) for i, n in enumerate(REAL_KV_SOURCE_FIELDS))
    return Record("real_kv_source", REAL_KV_SOURCE_WORD, wb, fields, len(fields) * wb, None, loc)
