"""Wrong types everywhere: any value of kernels.yaml replaced or removed gives diagnostics (or a
valid schema), never a traceback. Set KV_CANARY_FUZZ=full to try every replacement at every node."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.load import load_schema_text

ROOT = Path(__file__).resolve().parents[2]
REPLACEMENTS = (None, True, 7, -1, "x", "1bad", [], [1], {}, {"a": 1}, 2**70, 1.5, "DELETE")
FULL = os.environ.get("KV_CANARY_FUZZ") == "full"


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _node(base, path):
    for key in path:
        base = base[key]
    return base


def _mutated(base, path, replacement):
    doc = copy.deepcopy(base)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if replacement == "DELETE":
        del parent[path[-1]]
    elif replacement == "EXTRA_KEY":  # a soft error: the semantic checks still run on the rest
        parent[path[-1]]["zz_extra"] = 1
    else:
        parent[path[-1]] = replacement
    return yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)


def test_no_value_of_any_type_crashes_the_loader():
    base = yaml.load((ROOT / "kernels.yaml").read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    paths = [p for p in _paths(base) if p]
    tried = rejected = 0
    for i, path in enumerate(paths):
        # Default: one replacement per node, rotating through the list (every kind of value meets many
        # nodes); full mode: all of them at every node.
        choices = REPLACEMENTS if FULL else (REPLACEMENTS[i % len(REPLACEMENTS)],)
        if isinstance(_node(base, path), dict):
            choices = (*choices, "EXTRA_KEY")
        for replacement in choices:
            text = _mutated(base, path, replacement)
            tried += 1
            try:
                load_schema_text(text)
            except SchemaError as exc:
                rejected += 1
                assert exc.diagnostics, (path, replacement)
                for d in exc.diagnostics:
                    assert str(d).startswith("kernels.yaml:") and ": error: " in str(d), (path, replacement, str(d))
            # Any other exception propagates and fails the test with its (path, replacement) in the traceback.
    assert tried >= len(paths) and rejected > tried // 2
