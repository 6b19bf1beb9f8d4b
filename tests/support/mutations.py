"""Schema mutations: edits of kernels.yaml's text that the mutation tests generate trees from."""
from __future__ import annotations

import re

from support.trees import default_schema_text, generate_tree, scratch_dir

# A FailReason member: `NAME: 4` (a built-in reason: the generator knows its kind) or
# `NAME: {value: 4, kind: verify}` (a reason of the schema's own).
REASON_LINE = re.compile(r"^    ([A-Z_]+): (?:(\d+)|\{value: (\d+), kind: (\w+)\})$", re.M)
REASON_BLOCK = r"(?:^    [A-Z_]+: (?:\d+|\{value: \d+, kind: \w+\})\n)+"


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


def reasons(text: str) -> list[tuple[str, int, str]]:
    """(name, bit, kind) of every FailReason member; kind "" for a built-in one."""
    return [(name, int(bit or value), kind) for name, bit, value, kind in REASON_LINE.findall(text)]


def reason_line(name: str, value: int, kind: str = "") -> str:
    return f"    {name}: {{value: {value}, kind: {kind}}}\n" if kind else f"    {name}: {value}\n"


def reorder_reasons(text):
    """FailReason members renumbered (other bits) and listed in another order."""
    block = "".join(reason_line(n, 1 << (20 - i), k) for i, (n, _, k) in enumerate(reversed(reasons(text))))
    return sub(REASON_BLOCK, lambda m: block, text, count=1, case="reorder_reasons")


def tree_of(mutation) -> object:
    path = scratch_dir("kv_canary_mutation_") / "kernels.yaml"
    try:
        text = mutation(default_schema_text())
    except EditDrift as exc:
        raise EditDrift(f"{getattr(mutation, '__name__', mutation)}: {exc}") from None
    path.write_text(text, encoding="utf-8")
    return generate_tree(path)
