"""Schema mutations: edits of kernels.yaml's text that the mutation tests generate layers from."""
from __future__ import annotations

import re

from support.layers import default_schema_text, generate_layer, scratch_dir

REASON_LINE = re.compile(r"^    ([A-Z_]+): \{value: (\d+), kind: (\w+)\}$", re.M)


class EditDrift(AssertionError):
    """An edit's text is no longer in the schema it edits: the case must follow the schema."""


def sub(pattern: str, repl, text: str, count: int = 0, *, case: str = "mutation") -> str:
    new, n = re.subn(pattern, repl, text, count=count, flags=re.M)
    if not n:
        raise EditDrift(f"{case}: pattern {pattern!r} no longer matches the schema it edits; update {case} to the schema")
    return new


def edit(text: str, old: str, new: str, count: int = 1, *, case: str) -> str:
    """`old` (literal text, found exactly `count` times) replaced by `new`."""
    found = text.count(old)
    if found != count:
        raise EditDrift(f"{case}: edit expects {count} occurrence{'s' if count != 1 else ''} of {old!r} in the "
                        f"schema it edits, found {found}; update {case} to the schema")
    return text.replace(old, new)


def reorder_reasons(text):
    """FailReason members renumbered (other bits) and listed in another order."""
    members = REASON_LINE.findall(text)
    block = "".join(f"    {n}: {{value: {1 << (20 - i)}, kind: {k}}}\n" for i, (n, _, k) in enumerate(reversed(members)))
    return sub(r"(^    [A-Z_]+: \{value: \d+, kind: \w+\}\n)+", lambda m: block, text, count=1, case="reorder_reasons")


def layer_of(mutation) -> object:
    path = scratch_dir("kv_canary_mutation_") / "kernels.yaml"
    try:
        text = mutation(default_schema_text())
    except EditDrift as exc:
        raise EditDrift(f"{getattr(mutation, '__name__', mutation)}: {exc}") from None
    path.write_text(text, encoding="utf-8")
    return generate_layer(path)
