"""A generated tree and its schema as the generator's commands see them: how a path is shown, the
schema read once (with its notes), what the headers and fix lines name, and a tree checked against
its schema. Shared by the generator's commands (cli.py) and the workflow beside it (workflow/report.py),
which imports the generator, never the other way.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .diagnostics import Diagnostic, Loc, SchemaError
from .diff import FixHint
from .load import read_schema
from .project import CONFIG_NAME, Tree, resolve_path, resolve_trees
from .render import Provenance, render_all
from .writer import Hints, compare_tree, tree_lock


def _display(path: Path) -> str:
    """A path as diagnostics show it: relative when under the current directory, else as given (a
    symbolic link that loops included: this also names the file of the last-resort error)."""
    try:
        return resolve_path(Path(path)).relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def _load(schema_path: Path, tree: Tree | None = None):
    """(schema, the normalised text it was parsed from): the file is read once (by the name it is shown by).
    A schema that does not exist says where schemas come from (kv-canary.yaml, init, --schema)."""
    shown = _display(schema_path)
    if not os.path.lexists(schema_path):   # a link that loops or dangles: read_schema says which
        where = "" if tree is None or not (tree.configured or tree.schema == Path.cwd().resolve() / "kernels.yaml") \
            else f"; {_where_schemas_come_from(tree)}"
        raise SchemaError([Diagnostic(Loc(shown, 1, 1), f"cannot read schema {shown}: No such file or directory{where}")])
    schema, text = read_schema(Path(shown), display_name=shown)
    for note in schema.notes:  # what the schema states that the generator supplies: never an error
        print(note, file=sys.stderr)
    return schema, text


def _where_schemas_come_from(tree: Tree) -> str:
    if tree.configured:
        return f"{CONFIG_NAME} in {_display(tree.root)} lists it (fix the entry, or restore the file)"
    return (f"without --schema a command reads the trees of {CONFIG_NAME} (looked for here and in every parent "
            f"directory up to the git top level: none found), else kernels.yaml; `kv-canary init` sets up a "
            f"repository (schema, {CONFIG_NAME}, generated package), or name one with --schema FILE or "
            f"--config PATH/{CONFIG_NAME}")


def _tell_waiting(lock: Path) -> None:
    print(f"waiting for another generator run on this tree to finish (lock {_display(lock)})", file=sys.stderr,
          flush=True)


def provenance(tree: Tree) -> Provenance:
    """What the tree's generated headers and messages name."""
    return Provenance(schema=tree.file_schema_name, edit=tree.edit_hint, regenerate=tree.file_regenerate,
                      records_generator=not tree.golden)


def provenance_for(schema: Path, out: Path) -> Provenance:
    """What `generate --schema SCHEMA --out OUT` writes into the headers (from the current directory)."""
    return provenance(resolve_trees(schema, out, Path.cwd())[0])


def hints(tree: Tree) -> Hints:
    """What `check`'s fix lines name, from where the command runs."""
    return Hints(regenerate=tree.regenerate(Path.cwd()), schema=_display(tree.schema), own_checkout=tree.own_checkout)


def fix_hint(tree: Tree) -> FixHint:
    return FixHint(schema=_display(tree.schema), regenerate=tree.regenerate(Path.cwd()))


def check_tree(tree: Tree) -> tuple[int, list]:
    """(number of files the schema produces, drifts of the tree on disk)."""
    schema, text = _load(tree.schema, tree)
    files = render_all(schema, text, provenance=provenance(tree))
    shown = _display(tree.out)
    if tree.out.is_dir():  # not while a `generate` is half-way through writing it
        with tree_lock(tree.out, shared=True, on_wait=_tell_waiting):
            return len(files), compare_tree(tree.out, files, shown, hints(tree))
    return len(files), compare_tree(tree.out, files, shown, hints(tree))
