"""The renderer and writer: literal filters, template guards, headers, determinism, atomic writes."""
from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from kv_canary.codegen import render
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.load import load_schema, load_schema_text
from kv_canary.codegen.model import Constant
from kv_canary.codegen.render import (
    cpp_literal,
    make_environment,
    make_header,
    make_identity_header,
    py_literal,
    render_all,
    render_body,
    sha256_text,
    split_header,
)
from kv_canary.codegen.writer import LOCK_NAME, files_on_disk, write_tree

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "kernels.yaml"


def const(ctype: str, value: int) -> Constant:
    return Constant("X", ctype, value, "", None)


# -- literal filters --------------------------------------------------------------------------
@pytest.mark.parametrize("ctype, value, want", [
    ("u64", 0xC0FFEE1234567890, "0xC0FFEE1234567890ULL"),
    ("u64", 0, "0x0000000000000000ULL"),
    ("u64", (1 << 64) - 1, "0xFFFFFFFFFFFFFFFFULL"),
    ("i64", -(1 << 63), "(-9223372036854775807LL - 1)"),
    ("i64", (1 << 63) - 1, "9223372036854775807LL"),
    ("i64", -5, "-5LL"),
    ("u32", 7, "7u"),
    ("i32", -3, "-3"),
])
def test_cpp_literal_has_an_explicit_type(ctype, value, want):
    assert cpp_literal(const(ctype, value)) == want
    assert cpp_literal(value, ctype) == want


def test_i64_min_literal_means_i64_min_in_cpp_arithmetic():
    # The spelled-out expression must evaluate to -2^63 (a bare 9223372036854775808LL overflows).
    text = cpp_literal(-(1 << 63), "i64").replace("LL", "")
    assert eval(text) == -(1 << 63)  # noqa: S307 - a literal we just produced


def test_py_literal_renders_u64_as_int_and_strings_safely():
    assert py_literal(const("u64", 0xC0FFEE1234567890)) == "0xC0FFEE1234567890"
    assert eval(py_literal(const("u64", 0xC0FFEE1234567890))) == 0xC0FFEE1234567890  # noqa: S307
    assert py_literal(const("i64", -(1 << 63))) == str(-(1 << 63))
    tricky = 'a "quoted" {brace}'
    assert eval(py_literal(tricky)) == tricky  # noqa: S307


def test_filters_in_a_template():
    env = make_environment()
    env.loader = jinja2.DictLoader({"t.j2": "{{ c | cpp }} {{ c | py }} {{ v | hex64 }} {{ n | upper_ident }}\n"})
    body = render_body(env, "t.j2", {"c": const("u64", 1 << 63), "v": (1 << 64) - 1, "n": "real_kv_hash"}, "t")
    assert body == "0x8000000000000000ULL 0x8000000000000000 0xFFFFFFFFFFFFFFFF REAL_KV_HASH\n"


# -- template guards --------------------------------------------------------------------------
def _env(source: str) -> jinja2.Environment:
    env = make_environment()
    env.loader = jinja2.DictLoader({"t.j2": source})
    return env


def test_surviving_template_syntax_is_an_error():
    # A raw block renders `{{ x }}` literally: exactly the kind of leftover the guard must catch.
    env = _env("line one\n{% raw %}value = {{ x }}{% endraw %}\n")
    with pytest.raises(SchemaError) as info:
        render_body(env, "t.j2", {}, "out.py")
    assert str(info.value) == "generated/out.py:2:1: error: template syntax '{{' survived rendering of t.j2"


def test_undefined_template_variable_is_an_error_not_an_empty_string():
    with pytest.raises(SchemaError) as info:
        render_body(_env("x = {{ missing }}\n"), "t.j2", {}, "out.py")
    assert "'missing' is undefined" in str(info.value)
    assert str(info.value).startswith("codegen/templates/t.j2:1:1: error: template error while rendering out.py")


def test_line_directive_names_the_template_line():
    body = render_body(_env("a\n#line @\nb\n"), "t.j2", {}, "x.cu")
    assert body == 'a\n#line 3 "codegen/templates/t.j2"\nb\n'


# -- headers ----------------------------------------------------------------------------------
def test_a_header_names_the_command_and_the_template_and_no_hash():
    body = "x = 1\n"
    text = make_header("layout.py", "python/layout.py.j2") + body
    lines = text.splitlines()
    assert "DO NOT EDIT" in lines[0] and "`make generate`" in lines[0]
    assert split_header(text) == ({"template": "codegen/templates/python/layout.py.j2"}, body)
    md = make_header("LAYOUT.md", "docs/LAYOUT.md.j2")
    assert all(line.startswith("<!-- ") and line.endswith(" -->") for line in md.splitlines())


def test_the_identity_header_carries_three_hashes_and_the_generation():
    body = "x = 1\n"
    fields, rest = split_header(make_identity_header("__init__.py", "python/__init__.py.j2", "a" * 64, "b" * 64, body)
                                + body)
    generation = hashlib.sha256(("a" * 64 + ":" + "b" * 64).encode()).hexdigest()[:16]
    assert fields == {"template": "codegen/templates/python/__init__.py.j2", "schema": "a" * 64, "generator": "b" * 64,
                      "generation": generation, "body": sha256_text(body)}
    assert rest == body


def test_a_header_from_before_the_identity_file_still_splits():
    """Every header of an older generator: marker, schema, generator, generation, body (no template line)."""
    body = "x = 1\n"
    old = ("# Generated by kv-canary codegen from kernels.yaml. DO NOT EDIT: edit kernels.yaml, then run `make generate`.\n"
           f"# schema-sha256: {'a' * 64}\n# generator-sha256: {'b' * 64}\n# generation-id: {'c' * 16}\n"
           f"# body-sha256: {sha256_text(body)}\n")
    fields, rest = split_header(old + body)
    assert fields == {"schema": "a" * 64, "generator": "b" * 64, "generation": "c" * 16, "body": sha256_text(body)}
    assert rest == body


def test_only_the_identity_file_carries_hashes_and_it_lists_every_other_file():
    files = render_all(load_schema(SCHEMA), SCHEMA.read_text(encoding="utf-8"))
    assert files[0].path == render.IDENTITY_FILE
    fields, body = split_header(files[0].text)
    assert fields["schema"] == sha256_text(SCHEMA.read_text(encoding="utf-8"))
    assert fields["generator"] == render.generator_sha256() and fields["body"] == sha256_text(body)
    assert f'\nGENERATION_ID = "{fields["generation"]}"\n' in body
    (table,) = [ast.literal_eval(node.value) for node in ast.parse(body).body
                if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["FILE_SHA256"]]
    assert table == {f.path: hashlib.sha256(f.text.encode()).hexdigest() for f in files[1:]}
    for f in files:
        if f is not files[0]:
            header = split_header(f.text)[0]
            assert header == {"template": f"codegen/templates/{f.template}"}, f.path
        assert "\r" not in f.text and f.text.endswith("\n"), f.path
        assert str(ROOT) not in f.text, f"{f.path} embeds an absolute path"


# -- determinism and writing ------------------------------------------------------------------
def _generate_in_subprocess(out: Path, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "codegen", "generate", "--schema", str(SCHEMA), "--out", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)


def _tree(path: Path) -> dict[str, bytes]:
    return {rel: p.read_bytes() for rel, p in files_on_disk(path).items()}


def test_generation_is_byte_identical_across_hash_seeds(tmp_path):
    _generate_in_subprocess(tmp_path / "a", "1")
    _generate_in_subprocess(tmp_path / "b", "4242")
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    assert a and a == b
    # ... and identical to an in-process render (a third hash seed, and no disk round trip).
    from kv_canary.codegen.trees import provenance_for
    files = render_all(load_schema(SCHEMA), SCHEMA.read_text(encoding="utf-8"),
                       provenance=provenance_for(SCHEMA, tmp_path / "a"))
    assert a == {f.path: f.text.encode("utf-8") for f in files}


def test_regenerating_an_unchanged_tree_writes_nothing(tmp_path):
    text = SCHEMA.read_text(encoding="utf-8")
    files = render_all(load_schema(SCHEMA), text)
    written, removed = write_tree(tmp_path, files)
    assert sorted(written) == sorted(f.path for f in files) and removed == []
    stamps = {rel: (p.stat().st_mtime_ns, p.stat().st_ino) for rel, p in files_on_disk(tmp_path).items()}
    assert write_tree(tmp_path, render_all(load_schema(SCHEMA), text)) == ([], [])
    assert {rel: (p.stat().st_mtime_ns, p.stat().st_ino) for rel, p in files_on_disk(tmp_path).items()} == stamps
    assert not [p for p in tmp_path.rglob(".*.tmp")], "an atomic write left its temp file behind"


def test_a_comment_change_in_the_generator_rewrites_only_the_identity_file(tmp_path):
    """A generator whose source differs only in comments (a Python one, a Jinja one) has another
    generator hash, and that hash lives in one file: the rest of the tree is not rewritten."""
    from kv_canary.codegen.trees import provenance_for

    out = tmp_path / "tree"
    write_tree(out, render_all(load_schema(SCHEMA), SCHEMA.read_text(encoding="utf-8"),
                               provenance=provenance_for(SCHEMA, out)))
    copy = tmp_path / "copy" / "codegen"
    shutil.copytree(ROOT / "codegen", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "writer.py", "a", encoding="utf-8") as fh:
        fh.write("# a comment that changes the generator hash\n")
    generation = copy / "templates" / "python" / "_generation.j2"
    generation.write_text(generation.read_text(encoding="utf-8").replace("{# Included", "{# Rendered", 1),
                          encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(copy.parent)}
    proc = subprocess.run([sys.executable, "-m", "codegen", "generate", "--schema", str(SCHEMA), "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("wrote ")] == ["wrote tree/__init__.py"]
    assert split_header((out / "__init__.py").read_text(encoding="utf-8"))[0]["generator"] != render.generator_sha256()


def test_a_comment_change_in_the_checkout_rewrites_only_generated_init(tmp_path):
    """In kv-canary's own checkout `generate` writes generated/ and the example schemas' goldens; only
    generated/__init__.py pins the generator, so a comment change in codegen/ rewrites that one file
    and no golden (a golden's identity file names its schema, not the generator)."""
    checkout = tmp_path / "checkout"
    for part in ("codegen", "generated", "examples", "kv_canary/schemas"):
        shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("kernels.yaml", "Makefile"):
        shutil.copy(ROOT / part, checkout / part)
    with open(checkout / "codegen" / "writer.py", "a", encoding="utf-8") as fh:
        fh.write("# a comment that changes the generator hash\n")
    proc = subprocess.run([sys.executable, "-m", "codegen", "generate"], cwd=checkout,
                          env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("wrote ")] == ["wrote generated/__init__.py"]
    golden = checkout / "examples" / "generated" / "owner_epoch" / "layout.py"
    golden.write_text(golden.read_text(encoding="utf-8") + "# hand edit\n", encoding="utf-8")
    check = subprocess.run([sys.executable, "-m", "codegen", "check"], cwd=checkout,
                           env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode != 0 and "examples/generated/owner_epoch/layout.py" in check.stdout + check.stderr


def test_write_tree_replaces_changed_files_and_removes_only_generated_leftovers(tmp_path):
    text = SCHEMA.read_text(encoding="utf-8")
    files = render_all(load_schema(SCHEMA), text)
    write_tree(tmp_path, files)
    (tmp_path / "layout.py").write_text("hand edit\n", encoding="utf-8")
    leftover = make_header("old.py", "python/old.py.j2") + "x = 1\n"
    (tmp_path / "old.py").write_text(leftover, encoding="utf-8")
    (tmp_path / "notes.txt").write_text("mine\n", encoding="utf-8")
    written, removed = write_tree(tmp_path, files)
    assert written == ["layout.py"] and removed == ["old.py"]
    assert (tmp_path / "notes.txt").exists()


def test_an_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    text = SCHEMA.read_text(encoding="utf-8")
    files = render_all(load_schema(SCHEMA), text)
    target = tmp_path / "layout.py"
    target.write_text("previous\n", encoding="utf-8")

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_tree(tmp_path, [f for f in files if f.path == "layout.py"])
    assert target.read_text(encoding="utf-8") == "previous\n"
    assert [p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME] == ["layout.py"]  # no temporary file


def test_generate_cli_on_an_unchanged_tree_reports_zero_written(tmp_path, capsys):
    from kv_canary.codegen.cli import main
    args = ["generate", "--schema", str(SCHEMA), "--out", str(tmp_path / "g")]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "wrote" not in out and " 0 written, 0 removed" in out


def test_schema_values_reach_the_model():
    schema = load_schema_text(SCHEMA.read_text(encoding="utf-8"))
    assert schema.chain_head == 0xDE7FAE23A9A1B716  # docs/semantics.md §2
    assert schema.canary.record_bytes == 32  # docs/semantics.md §3: four int64 words (any stride holds them)
    assert [f.offset for f in schema.canary.fields] == [0, 8, 16, 24]


def test_cpp_literal_bools_and_strings():
    assert cpp_literal(True) == "true" and cpp_literal(False) == "false"
    assert cpp_literal('got "x" {n}') == '"got \\"x\\" {n}"'
    assert cpp_literal("a\\b\n1") == '"a\\\\b\\0121"'  # octal: cannot swallow the digit after it
    assert cpp_literal("×") == '"\\303\\227"'
    with pytest.raises(ValueError, match="unknown type 'u16'"):
        cpp_literal(1, "u16")
