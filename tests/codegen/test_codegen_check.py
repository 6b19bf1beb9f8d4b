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
from kv_canary.codegen.render import COMMENT_STYLES, HEADER_MARKER, render_all, sha256_text, split_header
from kv_canary.codegen.trees import provenance_for
from kv_canary.codegen.writer import compare_tree, write_tree
from support.trees import default_schema_text

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
    assert lines[0] == ("generated/layout.py: hand-edited: its text no longer matches the sha256 that "
                        "generated/__init__.py lists for it")
    # Outside kv-canary's own checkout the fix names the schema and the command, never codegen/templates.
    assert lines[1] == ("    fix: make the change in kernels.yaml, "
                        "then run `kv-canary generate --schema kernels.yaml --out generated` (it overwrites this file)")
    assert "--- generated/layout.py (on disk)" in err and "+++ generated/layout.py (generated)" in err
    assert "-CANARY_FIELDS_PER_SLOT = 5" in err and "+CANARY_FIELDS_PER_SLOT = 4" in err
    assert lines[-1] == "1 generated file(s) out of date with kernels.yaml; run `kv-canary generate --schema kernels.yaml --out generated` and commit generated/"


def test_removed_header_counts_as_a_hand_edit(repo, capsys):
    md = repo / "generated" / "LAYOUT.md"
    md.write_text("\n".join(md.read_text().splitlines()[2:]) + "\n")
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
    # Every file whose text the wider stride changes is stale (and only those: the schema hash is in
    # __init__.py alone), and the shared fix is printed once, after the list.
    stale = [line.split(":")[0] for line in listing if ": stale: the schema changed since this file was generated" in line]
    fresh = {f.path: f.text for f in render_all(*read_schema(schema), provenance=provenance_for(schema, repo / "generated"))}
    changed = [f"generated/{rel}" for rel, text in sorted(fresh.items()) if (repo / "generated" / rel).read_text() != text]
    assert sorted(stale) == changed and len(stale) == len(listing) - 1
    assert "generated/layout.py" in stale and "generated/__init__.py" in stale
    assert listing[-1] == "    fix: run `kv-canary generate --schema kernels.yaml --out generated` and commit the result"
    assert f"+CANARY_SLOT_STRIDE_BYTES = {wider}" in err


def test_generator_change_is_named_as_such(tmp_path, monkeypatch):
    schema_path = ROOT / "kernels.yaml"
    text = schema_path.read_text(encoding="utf-8")
    schema = load_schema(schema_path)
    monkeypatch.setattr(render, "generator_sha256", lambda: "0" * 64)
    # The old generator also rendered one body differently (a consistent tree: __init__.py lists it).
    monkeypatch.setattr(render, "render_body", lambda *args, real=render.render_body: (
        real(*args).replace("# -- constants", "# -- consts")))
    write_tree(tmp_path, render_all(schema, text))
    monkeypatch.undo()
    drifts = {d.path: d for d in compare_tree(tmp_path, render_all(schema, text), "gen")}
    assert {d.kind for d in drifts.values()} == {"generator-changed"}
    assert sorted(drifts) == ["gen/__init__.py", "gen/layout.py"]  # what the old generator rendered differently
    layout = drifts["gen/layout.py"]
    assert layout.detail == "stale: the generator (codegen/) changed since this file was generated"
    assert layout.fix == "run `make generate` and commit the result"
    assert "-# -- consts" in layout.diff and "+# -- constants" in layout.diff


def test_a_tree_of_a_generator_older_than_the_identity_file_is_generator_changed(tmp_path):
    """Such a tree has the hashes in every header (and no FILE_SHA256): each file vouches for itself."""
    schema, text = read_schema(ROOT / "kernels.yaml")
    files = render_all(schema, text)
    schema_sha = split_header(files[0].text)[0]["schema"]
    for f in files:
        body = split_header(f.text)[1]
        open_, close = COMMENT_STYLES[Path(f.path).suffix]
        old = "".join(f"{open_}{line}{close}\n" for line in (
            f"{HEADER_MARKER} kernels.yaml. DO NOT EDIT: edit kernels.yaml, then run `make generate`.",
            f"schema-sha256: {schema_sha}", f"generator-sha256: {'0' * 64}", f"generation-id: {'0' * 16}",
            f"body-sha256: {sha256_text(body)}"))
        (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f.path).write_text(old + body)
    drifts = compare_tree(tmp_path, files, "gen")
    assert [d.path for d in drifts] == sorted(f"gen/{f.path}" for f in files)
    assert {d.kind for d in drifts} == {"generator-changed"}
    (tmp_path / "layout.py").write_text((tmp_path / "layout.py").read_text() + "# edit\n")
    drifts = {d.path: d.kind for d in compare_tree(tmp_path, files, "gen")}
    assert drifts.pop("gen/layout.py") == "hand-edited" and set(drifts.values()) == {"generator-changed"}


def test_a_hand_edit_after_a_generator_change_is_still_a_hand_edit(repo, capsys, monkeypatch):
    """__init__.py's table is the on-disk run's: a file it does not vouch for is hand-edited, whatever
    else changed since."""
    init = repo / "generated" / "__init__.py"
    layout = repo / "generated" / "layout.py"
    layout.write_text(layout.read_text() + "# edit\n")
    monkeypatch.setattr(render, "generator_sha256", lambda: "0" * 64)
    rc, err = check(capsys)
    assert rc == 1
    assert err.startswith("generated/layout.py: hand-edited: its text no longer matches the sha256 that "
                          "generated/__init__.py lists for it\n")
    assert "generated/__init__.py: stale: generated by another version of kv-canary than the one running " \
           "(the generator-sha256 in generated/__init__.py's header differs)\n" in err
    init.write_text(init.read_text().replace("REGENERATE_COMMAND =", "REGENERATE_COMMAND  ="))
    rc, err = check(capsys)
    assert err.startswith("generated/__init__.py: hand-edited: its body no longer matches the body-sha256 in its "
                          "header\n")
    # A hand-edited identity file vouches for nothing: the others are told apart no further.
    assert "generated/layout.py: changed: " not in err
    assert "generated/layout.py: differs from what the generator produces, and generated/__init__.py lists no " \
           "sha256 for it to tell a hand edit from a stale tree\n" in err


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
    assert proc.stderr.splitlines()[0] == ("generated/layout.py: hand-edited: its text no longer matches the sha256 "
                                           "that generated/__init__.py lists for it")
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


def _checkout_copy(root: Path) -> Path:
    """What `make check-generated` reads, copied: the Makefile, the generator, the schemas, the trees."""
    for rel in ("Makefile", "kernels.yaml"):
        shutil.copy(ROOT / rel, root / rel)
    for rel in ("codegen", "generated", "kv_canary/schemas", "examples/generated"):
        shutil.copytree(ROOT / rel, root / rel, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    return root


def _make_check_generated(root: Path) -> subprocess.CompletedProcess:
    # STAMP= : the copy has no .venv to set up; PY: this interpreter, with the copied generator first.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(["make", "-s", "check-generated", "STAMP=", f"PY={sys.executable}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_check_generated_fails_on_a_hand_edit_of_an_example_golden(tmp_path):
    """The example schemas' trees are checked in (examples/generated/NAME/) and `make check-generated`
    covers them: a hand edit of one fails, naming the file, the example schema and `make generate`."""
    root = _checkout_copy(tmp_path)
    clean = _make_check_generated(root)
    assert clean.returncode == 0, clean.stderr
    examples = sorted(p.stem for p in (ROOT / "kv_canary" / "schemas").glob("*.yaml"))
    assert examples and [line.split()[0] for line in clean.stdout.splitlines()] == \
        ["generated"] + [f"examples/generated/{name}" for name in examples]
    golden = root / "examples" / "generated" / "owner_epoch" / "layout.py"
    golden.write_text(golden.read_text(encoding="utf-8") + "# edit\n", encoding="utf-8")
    proc = _make_check_generated(root)
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert lines[0] == ("examples/generated/owner_epoch/layout.py: hand-edited: its text no longer matches the sha256 "
                        "that examples/generated/owner_epoch/__init__.py lists for it")
    assert lines[1] == ("    fix: make the change in kv_canary/schemas/owner_epoch.yaml or "
                        "codegen/templates/python/layout.py.j2, then run `make generate` (it overwrites this file)")
    assert ("1 generated file(s) out of date with kv_canary/schemas/owner_epoch.yaml; run `make generate` and commit "
            "examples/generated/owner_epoch/") in proc.stderr
