"""`check` (make check-generated): every kind of drift has its own message, the file and the fix.

Each test works on a private copy (kernels.yaml + a generated tree in tmp_path), never on the
checked-in generated/.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kv_canary.codegen import render
from kv_canary.codegen.cli import main
from kv_canary.codegen.load import load_schema, read_schema
from kv_canary.codegen.render import GeneratedFile, make_header, render_all, sha256_text, split_header
from kv_canary.codegen.writer import compare_tree, write_tree
from support.layers import default_schema_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A directory laid out like the repository root, generated and up to date; cwd is set to it."""
    shutil.copy(ROOT / "kernels.yaml", tmp_path / "kernels.yaml")
    assert main(["generate", "--schema", str(tmp_path / "kernels.yaml"), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.chdir(tmp_path)
    return tmp_path


def check(capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["check"])
    return rc, capsys.readouterr().err


def test_up_to_date_tree_passes(repo, capsys):
    capsys.readouterr()
    assert main(["check"]) == 0
    assert "generated is up to date with kernels.yaml" in capsys.readouterr().out


def test_hand_edit_names_the_file_the_template_and_the_fix(repo, capsys):
    layout = repo / "generated" / "layout.py"
    layout.write_text(layout.read_text().replace("CANARY_FIELDS_PER_SLOT = 4", "CANARY_FIELDS_PER_SLOT = 5"))
    rc, err = check(capsys)
    assert rc == 1
    lines = err.splitlines()
    assert lines[0] == "generated/layout.py: hand-edited: its body no longer matches the body-sha256 in its header"
    # Outside kv-canary's own checkout the fix names the schema and the command, never codegen/templates.
    assert lines[1] == ("    fix: make the change in kernels.yaml, "
                        "then run `kv-canary generate --schema kernels.yaml --out generated` (it overwrites this file)")
    assert "--- generated/layout.py (on disk)" in err and "+++ generated/layout.py (generated)" in err
    assert "-CANARY_FIELDS_PER_SLOT = 5" in err and "+CANARY_FIELDS_PER_SLOT = 4" in err
    assert lines[-1] == "1 generated file(s) out of date with kernels.yaml; run `kv-canary generate --schema kernels.yaml --out generated` and commit generated/"


def test_removed_header_counts_as_a_hand_edit(repo, capsys):
    md = repo / "generated" / "LAYOUT.md"
    md.write_text("\n".join(md.read_text().splitlines()[4:]) + "\n")
    rc, err = check(capsys)
    assert rc == 1
    assert err.startswith("generated/LAYOUT.md: hand-edited: its do-not-edit header was removed or changed\n"
                          "    fix: make the change in kernels.yaml, then run `kv-canary generate --schema kernels.yaml --out generated`\n")


def test_schema_edited_without_make_generate_is_stale(repo, capsys):
    schema = repo / "kernels.yaml"
    wider = load_schema(schema).canary.stride_bytes + 16
    schema.write_text(default_schema_text(stride=wider))
    rc, err = check(capsys)
    assert rc == 1
    listing = err.split("\n---", 1)[0].splitlines()
    # Every generated file is stale (its schema hash moved, even where the body did not), and the
    # shared fix is printed once, after the list.
    stale = [line.split(":")[0] for line in listing if ": stale: the schema changed since this file was generated" in line]
    assert "generated/layout.py" in stale and "generated/__init__.py" in stale and len(stale) == len(listing) - 1
    assert listing[-1] == "    fix: run `kv-canary generate --schema kernels.yaml --out generated` and commit the result"
    assert f"+CANARY_SLOT_STRIDE_BYTES = {wider}" in err


def test_generator_change_is_named_as_such(tmp_path, monkeypatch):
    schema_path = ROOT / "kernels.yaml"
    text = schema_path.read_text(encoding="utf-8")
    schema = load_schema(schema_path)
    monkeypatch.setattr(render, "generator_sha256", lambda: "0" * 64)
    old = render_all(schema, text)
    # The old generator also rendered one body differently (with a consistent header).
    layout = next(f for f in old if f.path == "layout.py")
    body = split_header(layout.text)[1].replace("# -- constants", "# -- consts")
    old[old.index(layout)] = GeneratedFile(layout.path, make_header(layout.path, sha256_text(text), "0" * 64, body)
                                           + body, layout.template)
    write_tree(tmp_path, old)
    monkeypatch.undo()
    drifts = compare_tree(tmp_path, render_all(schema, text), "gen")
    assert drifts and {d.kind for d in drifts} == {"generator-changed"}
    layout = next(d for d in drifts if d.path == "gen/layout.py")
    assert layout.detail == "stale: the generator (codegen/) changed since this file was generated"
    assert layout.fix == "run `make generate` and commit the result"
    assert "-# -- consts" in layout.diff and "+# -- constants" in layout.diff


def test_missing_file(repo, capsys):
    (repo / "generated" / "LAYOUT.md").unlink()
    rc, err = check(capsys)
    assert rc == 1
    assert err.startswith("generated/LAYOUT.md: missing: the generator produces it but it is not on disk\n"
                          "    fix: run `kv-canary generate --schema kernels.yaml --out generated`\n")


def test_extra_file(repo, capsys):
    (repo / "generated" / "notes.py").write_text("x = 1\n")
    rc, err = check(capsys)
    assert rc == 1
    assert err.startswith("generated/notes.py: extra: no template produces this file\n"
                          "    fix: delete it (`git rm generated/notes.py`); generated/ holds only what "
                          "kv-canary generates; keep your own files outside it\n")


def test_several_drifts_are_listed_hand_edits_first(repo, capsys):
    (repo / "generated" / "LAYOUT.md").unlink()
    (repo / "generated" / "zz_extra.py").write_text("x = 1\n")
    (repo / "generated" / "layout.py").write_text((repo / "generated" / "layout.py").read_text() + "# edit\n")
    rc, err = check(capsys)
    assert rc == 1
    heads = [line.split(":")[0] for line in err.splitlines() if line.startswith("generated/")]
    # Hand edits first (they need a decision), then what `make generate` fixes.
    assert heads == ["generated/layout.py", "generated/LAYOUT.md", "generated/zz_extra.py"]
    assert err.count("    fix: ") == 3
    assert "3 generated file(s) out of date" in err.splitlines()[-1]


def test_fix_command_names_non_default_paths(tmp_path, capsys, monkeypatch):
    shutil.copy(ROOT / "kernels.yaml", tmp_path / "other.yaml")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["check", "--schema", "other.yaml", "--out", "out"]) == 1
    err = capsys.readouterr().err
    assert "fix: run `kv-canary generate --schema other.yaml --out out`" in err


def test_check_in_a_subprocess_exits_1_on_a_hand_edit(repo):
    (repo / "generated" / "layout.py").write_text((repo / "generated" / "layout.py").read_text() + "# edit\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "codegen", "check", "--quiet"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0] == ("generated/layout.py: hand-edited: its body no longer matches the "
                                           "body-sha256 in its header")
    assert "---" not in proc.stderr  # --quiet: no diff
    assert "Traceback" not in proc.stderr


def test_kv_canary_checkout_hints_name_the_templates_and_make_generate(tmp_path):
    """In kv-canary's own checkout (Hints' defaults) a hand edit points at the template and `make generate`."""
    schema_path = ROOT / "kernels.yaml"
    files = render_all(*read_schema(schema_path))
    write_tree(tmp_path, files)
    layout = tmp_path / "layout.py"
    layout.write_text(layout.read_text() + "# edit\n")
    extra = tmp_path / "notes.py"
    extra.write_text("x = 1\n")
    drifts = {d.path: d for d in compare_tree(tmp_path, files, "generated")}
    assert drifts["generated/layout.py"].fix == ("make the change in kernels.yaml or codegen/templates/python/layout.py.j2, "
                                                 "then run `make generate` (it overwrites this file)")
    assert drifts["generated/notes.py"].fix == ("delete it (`git rm generated/notes.py`), or add a template and a row in "
                                                "codegen/outputs.py")


def test_the_checkout_itself_is_told_make_generate(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    import argparse

    from kv_canary.codegen.cli import trees_of
    (tree,) = trees_of(argparse.Namespace(schema=None, out=None, tree=None, config=None))
    assert tree.own_checkout and tree.regenerate() == "make generate"
