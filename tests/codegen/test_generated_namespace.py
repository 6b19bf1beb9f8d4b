"""One namespace for generated names: every module-level name the generator emits into the generated
layout module (and the package that re-exports it) is one definition. A schema name that would replace
or hide another one is a located error, whatever its kind (constant, flag set, enum set)."""
from __future__ import annotations

import ast

import pytest
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.load import load_schema_text
from kv_canary.codegen.render import render_all, split_header
from support.trees import default_schema_text

CONSTANT_ANCHOR = "  REQ_POOL_IDX_PADDING: {type: i64"
ENUM_ANCHOR = "  RealKvHashMode: {NONE: 0, PARTIAL: 1, ALL: 2}\n"


def add_constant(text: str, name: str) -> str:
    return text.replace(CONSTANT_ANCHOR, f"  {name}: {{type: i64, value: 0, doc: \"x\"}}\n{CONSTANT_ANCHOR}", 1)


def add_enum(text: str, name: str) -> str:
    assert ENUM_ANCHOR in text
    return text.replace(ENUM_ANCHOR, f"{ENUM_ANCHOR}  {name}: {{A: 0, B: 1}}\n", 1)


def line_of(text: str, prefix: str) -> int:
    """1-based line of the only line starting with `prefix`."""
    hits = [i for i, line in enumerate(text.splitlines(), 1) if line.startswith(prefix)]
    assert len(hits) == 1, (prefix, hits)
    return hits[0]


def diagnostics(text: str) -> list[str]:
    with pytest.raises(SchemaError) as info:
        load_schema_text(text)
    return str(info.value).splitlines()


def module_names(source: str) -> set[str]:
    """Public module-level names a module defines (assignments, classes, functions, imports)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
    return {n for n in names if not n.startswith("_")}


def test_an_enum_set_named_like_a_constant_is_a_located_error():
    text = add_enum(default_schema_text(), "MAX_REAL_KV_SOURCES")
    assert diagnostics(text) == [
        f"kernels.yaml:{line_of(text, '  MAX_REAL_KV_SOURCES: {A')}:3: error: enum set 'MAX_REAL_KV_SOURCES' has the "
        f"name of the constant defined at line {line_of(text, '  MAX_REAL_KV_SOURCES: {type')}: both would be "
        f"MAX_REAL_KV_SOURCES in the generated layout module; rename one"]


def test_a_constant_named_like_a_flag_set_is_a_located_error():
    text = add_constant(default_schema_text(), "FailReason")
    flag_line = text.splitlines().index("  FailReason:") + 1
    assert diagnostics(text) == [
        f"kernels.yaml:{flag_line}:3: error: flag set 'FailReason' has the name of the constant defined at line "
        f"{line_of(text, '  FailReason: {type')}: both would be FailReason in the generated layout module; "
        f"rename one"]


def test_an_enum_set_named_like_the_package_regenerate_command_is_an_error():
    text = add_enum(default_schema_text(), "REGENERATE_COMMAND")
    assert diagnostics(text) == [
        f"kernels.yaml:{line_of(text, '  REGENERATE_COMMAND:')}:3: error: enum set 'REGENERATE_COMMAND' collides "
        f"with the generated name REGENERATE_COMMAND (a name of the generated package's __init__); rename it"]


def test_names_that_differ_from_every_generated_name_still_generate():
    """Negative control: a new constant and a new enum set of fresh names load and render."""
    text = add_enum(add_constant(default_schema_text(), "MY_PADDING"), "MyMode")
    files = {f.path: split_header(f.text)[1] for f in render_all(load_schema_text(text), text)}
    assert {"MY_PADDING", "MyMode"} <= module_names(files["layout.py"])


def emitted_names() -> list[str]:
    """Every public module-level name of the default schema's generated layout module and package,
    other than the schema's own constant and set names (those are the ones a schema may define)."""
    text = default_schema_text()
    schema = load_schema_text(text)
    files = {f.path: split_header(f.text)[1] for f in render_all(schema, text)}
    own = {c.name for c in schema.constants} | {vs.name for vs in schema.flags + schema.enums}
    return sorted((module_names(files["layout.py"]) | module_names(files["__init__.py"])) - own)


@pytest.mark.parametrize("kind", ["constant", "enum"])
def test_every_name_the_generator_emits_is_refused_as_a_schema_name(kind):
    """The check's tables cover what the templates emit: a schema constant or enum set named like any
    emitted name fails with an error located on it (and not with a crash or a silent replacement)."""
    names = emitted_names()
    assert len(names) > 60  # the layout's fixed names, the per-field names, the package's names
    base = default_schema_text()
    unrefused = []
    for name in names:
        text = add_constant(base, name) if kind == "constant" else add_enum(base, name)
        line = line_of(text, f"  {name}: {{")
        try:
            load_schema_text(text)
        except SchemaError as exc:
            if not any(ln.startswith(f"kernels.yaml:{line}:") for ln in str(exc).splitlines()):
                unrefused.append((name, str(exc)))
        else:
            unrefused.append((name, "accepted"))
    assert unrefused == []
