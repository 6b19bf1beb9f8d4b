"""Schema mutations: edits of kernels.yaml's text that the mutation tests generate layers from."""
from __future__ import annotations

import re

from support.layers import default_schema_text, generate_layer, scratch_dir

REASON_LINE = re.compile(r"^    ([A-Z_]+): \{value: (\d+), kind: (\w+)\}$", re.M)


def sub(pattern: str, repl, text: str, count: int = 0) -> str:
    new, n = re.subn(pattern, repl, text, count=count, flags=re.M)
    assert n, f"mutation pattern not found: {pattern}"
    return new


def reorder_reasons(text):
    """FailReason members renumbered (other bits) and listed in another order."""
    members = REASON_LINE.findall(text)
    block = "".join(f"    {n}: {{value: {1 << (20 - i)}, kind: {k}}}\n" for i, (n, _, k) in enumerate(reversed(members)))
    return sub(r"(^    [A-Z_]+: \{value: \d+, kind: \w+\}\n)+", lambda m: block, text, count=1)


def layer_of(mutation) -> object:
    path = scratch_dir("kv_canary_mutation_") / "kernels.yaml"
    path.write_text(mutation(default_schema_text()), encoding="utf-8")
    return generate_layer(path)
