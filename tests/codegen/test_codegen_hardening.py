"""Regression tests of the generator hardening: what the schema fuzzer and its reproducers
found, beyond the located diagnostics of tests/support/schema_errors.py (alias bombs, nesting, control and
bidirectional characters, limits), which test_schema_errors.py checks.

- bounded memory: the 9-line alias bomb runs in a process limited to 512 MiB of address space;
- one line per diagnostic whatever the schema says; unexpected exceptions are reported, not raised;
- generation: concurrent runs take turns (lock), leftover temporary files are removed and ignored
  by git, a CRLF schema is the same schema;
- mixed trees: a file from another generator run is refused by the package and by the CUDA sources.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kv_canary.codegen import cli, trees
from kv_canary.codegen.diagnostics import Diagnostic, Loc, SchemaError, escape_text, quote
from kv_canary.codegen.limits import MAX_SET_MEMBERS
from kv_canary.codegen.load import load_schema_text, read_schema
from kv_canary.codegen.render import Provenance, make_environment, render_all, sha256_text, split_header
from kv_canary.codegen.writer import LOCK_NAME, compare_tree, tree_lock, write_tree
from support.schema_errors import case
from support.trees import DEFAULT_SCHEMA, default_schema_text

import kv_canary
from kv_canary.trees.sources import MixedTreeError, read_source

ROOT = Path(__file__).resolve().parents[2]


def codegen_cli(*args: str, cwd: Path, limit_bytes: int | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.Popen([sys.executable, "-m", "codegen", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=limit if limit_bytes else None, **kwargs)


@pytest.fixture(scope="module")
def env():
    return make_environment()


# -- bounded resources -----------------------------------------------------------------------
def test_an_alias_bomb_is_diagnosed_in_bounded_memory(tmp_path):
    # Before the event pre-pass, converting the composed graph walked every alias: 9^9 nodes.
    bomb = case("yaml_alias_bomb").write(tmp_path)
    proc = codegen_cli("check", "--schema", bomb.name, "--out", str(tmp_path / "out"), cwd=tmp_path,
                       limit_bytes=512 << 20)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and out == ""
    assert err.count("YAML anchors") == 9 and err.endswith("\n9 errors\n") and "Traceback" not in err


def test_nesting_far_past_the_recursion_limit_is_one_diagnostic():
    text = "a: " + "[" * 100_000 + "]" * 100_000 + "\n"
    with pytest.raises(SchemaError) as err:
        load_schema_text(text)
    assert str(err.value) == "kernels.yaml:1:67: error: YAML nesting is deeper than 64 levels"


def test_a_flag_set_of_too_many_members_is_refused():
    members = ", ".join(f"M{i}: {i}" for i in range(MAX_SET_MEMBERS + 1))
    text = default_schema_text().replace("enums:\n", f"enums:\n  Big: {{{members}}}\n", 1)
    with pytest.raises(SchemaError) as err:
        load_schema_text(text)
    line = text.splitlines().index(f"  Big: {{{members}}}") + 1
    assert str(err.value).splitlines() == [
        f"kernels.yaml:{line}:3: error: enum set 'Big' has {MAX_SET_MEMBERS + 1} members; at most "
        f"{MAX_SET_MEMBERS} are supported"]


# -- diagnostics stay one line; nothing escapes as a traceback --------------------------------
@pytest.mark.parametrize("raw,shown", [("a\nb", "a\\nb"), ("\x1b[31m", "\\x1b[31m"), ("x\u202ey", "x\\u202ey"),
                                        ("\u2028", "\\u2028"), ("\ud800", "\\ud800"), ("é日", "é日")])
def test_echoed_text_is_escaped_to_one_printable_line(raw, shown):
    assert escape_text(raw) == shown and escape_text(shown) == shown
    assert quote(raw) == f"'{shown}'"
    line = str(Diagnostic(Loc("k\n.yaml", 1, 1), f"bad {raw}"))
    assert line == f"k\\n.yaml:1:1: error: bad {shown}" and "\n" not in line


def test_an_unexpected_exception_is_an_internal_error_diagnostic(monkeypatch):
    from kv_canary.codegen import load

    def broken(schema, d):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(load, "check_schema", broken)
    with pytest.raises(SchemaError) as err:
        load_schema_text(DEFAULT_SCHEMA.read_text(encoding="utf-8"))
    assert err.value.internal
    (line,) = str(err.value).splitlines()
    assert line.startswith("kernels.yaml:1:1: error: internal error of the generator (ZeroDivisionError: boom at "
                           "codegen/load.py:")
    assert line.endswith("this is a kv-canary bug, please report it together with the schema that triggers it")


def test_the_cli_reports_an_unexpected_exception_without_a_traceback(monkeypatch, capsys, tmp_path):
    def broken(*args, **kwargs):
        raise KeyError("x")

    monkeypatch.setattr(cli, "render_all", broken)
    assert cli.main(["generate", "--schema", str(DEFAULT_SCHEMA), "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2 and lines[1] == "1 error"
    assert re.fullmatch(rf"{re.escape(cli._display(DEFAULT_SCHEMA))}:1:1: error: internal error of the generator "
                        rf"\(KeyError: 'x' at codegen/cli\.py:\d+\); this is a kv-canary bug, please report it "
                        rf"together with the schema that triggers it", lines[0]), lines[0]


# -- generation: line endings, temporary files, concurrent runs -------------------------------
def test_a_crlf_schema_is_the_same_schema(tmp_path, env):
    crlf = tmp_path / "kernels.yaml"
    crlf.write_bytes(b"\xef\xbb\xbf" + DEFAULT_SCHEMA.read_bytes().replace(b"\n", b"\r\n"))  # and a BOM
    schema, text = read_schema(crlf)
    files = render_all(schema, text, env)
    assert compare_tree(ROOT / "generated", files, "generated") == []
    assert split_header(files[0].text)[0]["schema"] == sha256_text(DEFAULT_SCHEMA.read_text(encoding="utf-8"))


def test_temporary_files_of_a_killed_run_are_removed_and_ignored_by_git(tmp_path, env):
    schema, text = read_schema(DEFAULT_SCHEMA)
    files = render_all(schema, text, env)
    write_tree(tmp_path, files)
    leftovers = [".layout.py.k3j_x9a1.tmp", "cuda/.canary_write.cu.abcdefgh.tmp"]
    for rel in leftovers:
        (tmp_path / rel).write_text("half a file", encoding="utf-8")
    (tmp_path / ".notes.tmp").write_text("not a name mkstemp gives: kept", encoding="utf-8")
    assert write_tree(tmp_path, files) == ([], sorted(leftovers))
    assert not any((tmp_path / rel).exists() for rel in leftovers) and (tmp_path / ".notes.tmp").exists()
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    probe = ["generated/.layout.py.k3j_x9a1.tmp", "generated/cuda/.canary_write.cu.abcdefgh.tmp",
             f"generated/{LOCK_NAME}"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *probe], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == probe


def _waits_for_the_lock(out: Path, *args: str) -> subprocess.Popen:
    """Start a codegen command while this process holds `out`'s lock; return it once it says it waits."""
    proc = codegen_cli(*args, "--schema", str(DEFAULT_SCHEMA), "--out", str(out), cwd=out.parent)
    line = proc.stderr.readline()  # blocks until the command reaches the lock (or ends without waiting)
    assert line.startswith("waiting for another generator run on this tree to finish (lock "), line
    return proc


def test_a_second_generate_waits_for_the_first(tmp_path):
    out = tmp_path / "generated"
    out.mkdir()
    with tree_lock(out):
        proc = _waits_for_the_lock(out, "generate")
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]  # nothing written while the lock is held
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert compare_tree(out, render_all(*read_schema(DEFAULT_SCHEMA), provenance=trees.provenance_for(DEFAULT_SCHEMA, out)),
                        "generated") == []


def test_check_waits_for_a_generate_in_progress(tmp_path, env):
    out = tmp_path / "generated"
    write_tree(out, render_all(*read_schema(DEFAULT_SCHEMA), env, provenance=trees.provenance_for(DEFAULT_SCHEMA, out)))
    with tree_lock(out):
        proc = _waits_for_the_lock(out, "check")
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "is up to date" in stdout, err


def test_concurrent_generate_runs_all_succeed(tmp_path):
    out = tmp_path / "generated"
    procs = [codegen_cli("generate", "--schema", str(DEFAULT_SCHEMA), "--out", str(out), cwd=tmp_path)
             for _ in range(3)]
    results = [p.communicate(timeout=180) + (p.returncode,) for p in procs]
    assert [r[2] for r in results] == [0, 0, 0], results
    assert sum(r[0].count("\nwrote ") + r[0].startswith("wrote ") for r in results) == len(
        render_all(*read_schema(DEFAULT_SCHEMA)))  # each file written by exactly one run
    assert compare_tree(out, render_all(*read_schema(DEFAULT_SCHEMA), provenance=trees.provenance_for(DEFAULT_SCHEMA, out)),
                        "generated") == []


# -- mixed trees: one file from another generator run -----------------------------------------
@pytest.fixture(scope="module")
def two_generations(tmp_path_factory, env):
    """Two trees of one schema from two generator runs that differ in every file: the second names
    another schema file and regenerate command (as a tree of an engine's repository does)."""
    root = tmp_path_factory.mktemp("generations")
    schema, text = read_schema(DEFAULT_SCHEMA)
    trees = []
    for name, provenance in (("old", Provenance()), ("new", Provenance("canary.yaml", "canary.yaml",
                                                                       "kv-canary generate"))):
        write_tree(root / name, render_all(schema, text, env, provenance=provenance))
        trees.append(root / name)
    return trees


def test_every_generated_python_module_checks_it_is_the_file_its_package_lists(env):
    files = [f for f in render_all(*read_schema(DEFAULT_SCHEMA), env) if f.path.endswith(".py")]
    assert {f.path for f in files} >= {"__init__.py", "layout.py", "api.py", "kernel_abi.py"}
    for f in files:  # a new template must include python/_generation.j2 too
        body = split_header(f.text)[1]
        assert (f.path == "__init__.py") != ("\n_check_generated_file(__file__)\n" in body), f.path


def _mixed(tmp_path: Path, trees, rel: str) -> Path:
    """The first tree with `rel` copied from the second: what a kill between two writes leaves."""
    assert (trees[0] / rel).read_text() != (trees[1] / rel).read_text(), f"{rel} is the same in both trees"
    out = tmp_path / "mixed"
    shutil.copytree(trees[0], out)
    shutil.copyfile(trees[1] / rel, out / rel)
    return out


def test_the_package_refuses_an_eagerly_loaded_module_of_another_generation(tmp_path, two_generations):
    out = _mixed(tmp_path, two_generations, "layout.py")
    with pytest.raises(ImportError, match=r"mixes files of two generator runs .*; run `make generate`"):
        kv_canary.load_generated(out, "kv_canary_mixed_layout")
    assert "kv_canary_mixed_layout" not in sys.modules


@pytest.mark.parametrize("rel", ["api.py", "reference.py", "kernel_abi.py"])
def test_the_package_refuses_a_lazily_loaded_module_of_another_generation(tmp_path, two_generations, rel):
    out = _mixed(tmp_path, two_generations, rel)
    tree = kv_canary.load_generated(out, f"kv_canary_mixed_{rel[:-3]}")
    with pytest.raises(ImportError) as err:
        getattr(tree, rel[:-3])
    assert str(err.value) == (f"kv-canary: generated file {out / rel} is not the one its package kv_canary_mixed_"
                              f"{rel[:-3]} lists (FILE_SHA256 in {out / '__init__.py'}): it was edited by hand, or "
                              f"the tree mixes files of two generator runs (an interrupted generator run?); run "
                              f"`make generate`")


def test_a_module_under_a_package_that_lists_no_files_is_refused(tmp_path, two_generations):
    """A package of a generator older than the identity file (no _check_generated_file)."""
    out = tmp_path / "old_package"
    shutil.copytree(two_generations[0], out)
    init = out / "__init__.py"
    init.write_text(init.read_text().replace("def _check_generated_file(", "def _renamed("))
    with pytest.raises(ImportError, match=r"generated module kv_canary_unlisted\.layout: its package kv_canary_unlisted "
                                          r"lists no files .*; run `make generate`"):
        kv_canary.load_generated(out, "kv_canary_unlisted")


def test_an_unmixed_tree_loads(two_generations):
    tree = kv_canary.load_generated(two_generations[1], "kv_canary_unmixed")
    assert tree.api and tree.kernel_abi and tree.reference
    assert read_source(tree, "cuda/canary_write.cu")


@pytest.mark.parametrize("rel", ["cuda/canary_write.cu", "cuda/kv_canary_layout.cuh",
                                 "emulation/kv_canary_launchers.cpp"])
def test_cuda_sources_of_another_generation_are_refused_before_a_build(tmp_path, two_generations, rel):
    from kv_canary.trees.emulation_build import library_inputs

    out = _mixed(tmp_path, two_generations, rel)
    tree = kv_canary.load_generated(out, f"kv_canary_mixed_src_{rel.replace('/', '_').replace('.', '_')}")
    with pytest.raises(MixedTreeError, match=rf"{rel} is not the one its Python package .* lists \(FILE_SHA256 in "):
        read_source(tree, rel)
    with pytest.raises(MixedTreeError):
        library_inputs(tree)   # what the emulated build hashes and compiles


def test_a_tree_that_lists_no_files_has_its_sources_refused(tmp_path, two_generations):
    """A tree of a generator older than the identity file: its package has no FILE_SHA256."""
    out = tmp_path / "unlisted"
    shutil.copytree(two_generations[0], out)
    tree = kv_canary.load_generated(out, "kv_canary_unlisted_sources")
    del tree.FILE_SHA256
    with pytest.raises(MixedTreeError, match=r"generated tree kv_canary_unlisted_sources lists no files \(FILE_SHA256: "
                                             r"generated by an older kv-canary\?\), so its source .*canary_write\.cu "
                                             r"cannot be vouched for; run `make generate`"):
        read_source(tree, "cuda/canary_write.cu")


def test_a_kernel_abi_without_the_typed_parameter_table_is_refused(tmp_path, two_generations):
    """A tree of a generator older than the typed kernel ABI (generated bind functions, no
    kernel_for_operation): the runtime says to regenerate instead of failing on an attribute."""
    from kv_canary.trees.sources import kernel_abi

    out = tmp_path / "untyped"
    shutil.copytree(two_generations[0], out)
    abi = out / "kernel_abi.py"
    text = abi.read_text().replace("def kernel_for_operation(", "def kernel_for_template(")
    abi.write_text(text)
    init = out / "__init__.py"
    init.write_text(re.sub(r'("kernel_abi\.py": )"[0-9a-f]{64}"', rf'\1"{sha256_text(text)}"', init.read_text()))
    tree = kv_canary.load_generated(out, "kv_canary_untyped_abi")
    with pytest.raises(ValueError, match=r"^kv-canary: generated tree kv_canary_untyped_abi's kernel_abi\.py lists no "
                                         r"typed kernel parameters \(generated by an older kv-canary\); run "
                                         r"`make generate`$"):
        kernel_abi(tree)
