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


# -- paths: every command with an unusable path in every place one goes ---------------------------------
# name -> how it is made in the project (None: left absent)
BAD_PATHS = {"loop": "a symlink to itself", "dangling": "symlink:nowhere", "folder": "dir", "missing": None,
             "canary.yaml/inside": "under a file", "loop/inside": "under a symlink loop"}
PLACES = {
    "generate --schema": lambda p: ["generate", "--schema", p, "--out", "gen"],
    "generate --out": lambda p: ["generate", "--schema", "canary.yaml", "--out", p],
    "generate --tree": lambda p: ["generate", "--tree", f"canary.yaml={p}"],
    "generate --config": lambda p: ["generate", "--config", p],
    "check --schema": lambda p: ["check", "--schema", p, "--out", "gen"],
    "check --out": lambda p: ["check", "--schema", "canary.yaml", "--out", p],
    "describe --schema": lambda p: ["describe", "--schema", p],
    "diff OLD": lambda p: ["diff", p, "canary.yaml"],
    "diff NEW": lambda p: ["diff", "canary.yaml", p],
    "config schema": lambda p: ["generate"],
    "config out": lambda p: ["check"],
}


def _project(root: Path, bad: str, place: str) -> None:
    (root / ".git").mkdir()   # ends kv-canary.yaml's search here
    (root / "canary.yaml").write_bytes((ROOT / "kv_canary" / "default_schema.yaml").read_bytes())
    (root / "loop").symlink_to("loop")
    made = BAD_PATHS[bad]
    if made == "symlink:nowhere":
        (root / bad).symlink_to("nowhere")
    elif made == "dir":
        (root / bad).mkdir()
    if place.startswith("config "):
        schema, out = (bad, "gen") if place == "config schema" else ("canary.yaml", bad)
        (root / "kv-canary.yaml").write_text(f"kv-canary: 1\ntrees:\n  - schema: {schema}\n    out: {out}\n")


def test_no_path_of_any_kind_crashes_a_command(tmp_path, monkeypatch, capsys):
    """A symlink loop as the schema was a bare traceback, as the output an "internal error", a folder
    given to diff a "git revision" that does not exist: each is now an error naming the path (or, where
    the path can be used, e.g. an output folder not there yet, a success). Full mode: every command at
    every place with every kind of path; else each place with one kind, rotating."""
    from kv_canary.cli import main as kv_main

    cases = [(place, bad) for i, place in enumerate(PLACES)
             for bad in (BAD_PATHS if FULL else [list(BAD_PATHS)[i % len(BAD_PATHS)]])]
    for n, (place, bad) in enumerate(cases):
        root = tmp_path / str(n)
        root.mkdir()
        _project(root, bad, place)
        monkeypatch.chdir(root)
        status = kv_main(PLACES[place](bad))
        out, err = capsys.readouterr()
        where = (place, bad, status, err)
        assert status in (0, 1, 2), where
        assert "Traceback" not in err and "internal error" not in err and "kv-canary bug" not in err, where
        if status:
            assert bad in err, where
    if FULL:
        print(f"path fuzz: {len(cases)} command lines, no traceback")
