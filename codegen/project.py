"""Where the generator runs: the schema/output pairs it works on (kv-canary.yaml's trees), and what its
hints and generated headers tell the user. (Which base revision a pull request's schema is judged
against is the workflow's: workflow/base.py.)

Three places run the same commands:
- kv-canary's own checkout: `kernels.yaml` -> `generated/`, and each example schema
  `kv_canary/schemas/NAME.yaml` -> its golden `examples/generated/NAME/`, regenerated with `make generate`;
- an engine's repository with a `kv-canary.yaml` config (made by `kv-canary init`): its pairs, regenerated
  with `kv-canary generate` and no arguments;
- anywhere else: the paths given on the command line, regenerated with `kv-canary generate --schema S --out O`.
Hints name the user's schema file, output path and command for the place they run in; only kv-canary's
own checkout is told about codegen/templates.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from .diagnostics import Diagnostic, Diagnostics, Loc, SchemaError, closest_hint, describe_unreadable
from .yaml_loader import YMap, YScalar, YSeq, load_yaml

CONFIG_NAME = "kv-canary.yaml"
CONFIG_FORMAT = 1
_CONFIG_KEYS = ("kv-canary", "trees", "base_branch")
_TREE_KEYS = ("schema", "out")
CODEGEN_DIR = Path(__file__).resolve().parent
EXAMPLE_SCHEMAS_DIR = "kv_canary/schemas"
# The example schemas' generated trees, checked in so that a pull request that changes an example's
# output shows it (`make generate` writes them, `make check-generated` checks them). Only for review:
# nothing imports them (kv_canary.trees.schemas generates its own cached trees).
GOLDENS_DIR = "examples/generated"


@functools.cache
def own_trees() -> tuple[tuple[Path, Path], ...]:
    """(schema, out) of kv-canary's own trees in its source checkout: kernels.yaml -> generated/ first,
    then each example schema -> its golden. Empty outside a source checkout (an installed wheel)."""
    top = CODEGEN_DIR.parent
    if not (top / "Makefile").is_file():
        return ()
    examples = sorted((top / EXAMPLE_SCHEMAS_DIR).glob("*.yaml"))
    return ((top / "kernels.yaml").resolve(), (top / "generated").resolve()), \
        *(((p.resolve(), (top / GOLDENS_DIR / p.stem).resolve()) for p in examples))


@dataclass(frozen=True)
class Tree:
    """One schema and the generated tree rendered from it."""
    schema: Path          # absolute
    out: Path             # absolute
    root: Path            # what paths are shown relative to: kv-canary.yaml's directory, else the current one
    configured: bool      # listed in kv-canary.yaml: `kv-canary generate` alone regenerates it
    base_branch: str | None = None  # kv-canary.yaml's base_branch: what the ABI check's merge base is taken with

    @property
    def own_checkout(self) -> bool:
        """One of kv-canary's own trees (own_trees), in a source checkout (there `make generate` exists)."""
        return (self.schema, self.out) in own_trees()

    @property
    def golden(self) -> bool:
        """An example schema's tree in kv-canary's own checkout (own_trees after the first)."""
        return (self.schema, self.out) in own_trees()[1:]

    def goldens(self) -> list[Tree]:
        """The example schemas' golden trees when this is kv-canary's default tree (what `generate` and
        `check` add to it when no paths are given), else none."""
        pairs = own_trees()
        if not pairs or (self.schema, self.out) != pairs[0]:
            return []
        return [Tree(schema, out, CODEGEN_DIR.parent, False) for schema, out in pairs[1:]]

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return path.as_posix()

    @property
    def schema_name(self) -> str:
        """The schema as a generated file's header names it (relative to the project root)."""
        return self.rel(self.schema)

    def regenerate(self, cwd: Path | None = None) -> str:
        """The command that regenerates this tree, as the user types it (paths relative to `cwd`,
        default: the project root)."""
        if self.own_checkout:
            return "make generate"
        if self.configured:
            return "kv-canary generate"
        base = (cwd or self.root).resolve()
        return (f"kv-canary generate --schema {shlex.quote(_relative(self.schema, base))} "
                f"--out {shlex.quote(_relative(self.out, base))}")

    @property
    def file_schema_name(self) -> str:
        """The schema as generated files name it: its path in the project when kv-canary.yaml lists the
        tree, else its file name (so the files do not depend on where the tree was generated from)."""
        if self.own_checkout:
            return self.schema.relative_to(CODEGEN_DIR.parent.resolve()).as_posix()
        return self.schema_name if self.configured else self.schema.name

    @property
    def file_regenerate(self) -> str:
        """The regenerate command as generated files name it (independent of the current directory)."""
        if self.own_checkout or self.configured:
            return self.regenerate()
        return f"kv-canary generate --schema {shlex.quote(self.schema.name)} --out <this tree>"

    @property
    def edit_hint(self) -> str:
        """What to edit instead of a generated file."""
        return f"{self.file_schema_name} (or codegen/)" if self.own_checkout else self.file_schema_name


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        try:
            return Path(os.path.relpath(path, base)).as_posix()
        except ValueError:  # another drive
            return path.as_posix()


@dataclass(frozen=True)
class Config:
    path: Path                      # the kv-canary.yaml file
    trees: tuple[Tree, ...]
    base_branch: str | None         # the default branch whose merge base the ABI check compares with

    @property
    def root(self) -> Path:
        return self.path.parent


def resolve_path(path: Path) -> Path:
    """`path` made absolute with its symbolic links resolved where they resolve. A link that loops or
    dangles is kept as the link (made absolute), so that errors name the file the user named:
    Python 3.11's resolve() raises RuntimeError for a loop (a command would report it as a bug of the
    generator) and follows a dangling link to a target the user never wrote."""
    try:
        resolved = path.resolve()
    except RuntimeError:   # a symlink loop
        return Path(os.path.abspath(path))
    if path.is_symlink() and not resolved.exists():
        return resolve_path(path.parent) / path.name
    return resolved


def unusable_out(path: Path) -> str | None:
    """Why a generated tree cannot be at `path` (a symbolic link that loops or dangles, on the way or
    at the end; a file where a folder must be), or None: writing would fail with a bare OSError."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT and not path.is_symlink():
            return None   # not there yet: generate creates it
        return describe_unreadable(path, exc)
    return None if path.is_dir() else "it is not a folder"


def find_config(start: Path) -> Path | None:
    """kv-canary.yaml in `start` or a parent, up to the top of its git repository. Anything of that name
    counts, a dangling or looping symbolic link included (load_config then says why it cannot be
    read): falling back to kernels.yaml -> generated/ would generate a tree the config never named."""
    d = start.resolve()
    while True:
        candidate = d / CONFIG_NAME
        if candidate.is_file() or candidate.is_symlink() or candidate.exists():
            return candidate
        if (d / ".git").exists() or d.parent == d:
            return None
        d = d.parent


def _str(node, loc_of, d: Diagnostics, what: str) -> str | None:
    if not isinstance(node, YScalar) or not isinstance(node.value, str) or not node.value:
        d.error(loc_of, f"{what} must be a non-empty path string")
        return None
    return node.value


def load_config(path: Path, display_name: str | None = None) -> Config:
    """Parse kv-canary.yaml; every problem is a `FILE:LINE:COL: error:` diagnostic (all at once)."""
    shown = display_name or path.name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError([Diagnostic(Loc(shown, 1, 1), f"cannot read the kv-canary config: "
                                                        f"{describe_unreadable(path, exc)}")]) from None
    except UnicodeDecodeError as exc:
        raise SchemaError([Diagnostic(Loc(shown, 1, 1), f"cannot read the kv-canary config: {exc}")]) from None
    node = load_yaml(text, shown)
    d = Diagnostics()
    if not isinstance(node, YMap):
        d.error(node.loc, "the kv-canary config must be a mapping with keys kv-canary, trees, base_branch")
        d.raise_if_any()
    for key, _ in node.entries:
        if key.value not in _CONFIG_KEYS:
            d.error(key.loc, f"unknown key '{key.value}' in the kv-canary config{closest_hint(key.value, _CONFIG_KEYS)}; "
                             f"allowed: {', '.join(_CONFIG_KEYS)}")
    version = node.get("kv-canary")
    if version is None:
        d.error(node.loc, f"missing key 'kv-canary' (the config format, {CONFIG_FORMAT})")
    elif not (isinstance(version, YScalar) and version.value == CONFIG_FORMAT):
        d.error(version.loc, f"kv-canary: config format must be {CONFIG_FORMAT}, got {getattr(version, 'text', '?')!r}"
                             f" (written by a newer kv-canary?)")
    root = path.resolve().parent
    trees: list[Tree] = []
    seq = node.get("trees")
    if not isinstance(seq, YSeq) or not seq.items:
        d.error(node.key_loc("trees") if seq is not None else node.loc,
                "trees must be a non-empty list of {schema: FILE, out: DIR}")
    else:
        outs: dict[Path, Loc] = {}
        for item in seq.items:
            if not isinstance(item, YMap):
                d.error(item.loc, "each entry of trees must be a mapping {schema: FILE, out: DIR}")
                continue
            for key, _ in item.entries:
                if key.value not in _TREE_KEYS:
                    d.error(key.loc, f"unknown key '{key.value}' in a tree{closest_hint(key.value, _TREE_KEYS)}; "
                                     f"allowed: schema, out")
            values = {}
            for key in _TREE_KEYS:
                value = item.get(key)
                if value is None:
                    d.error(item.loc, f"a tree needs '{key}'")
                else:
                    values[key] = _str(value, value.loc, d, key)
            if None in values.values() or len(values) != 2:
                continue
            out = resolve_path(root / values["out"])
            problem = unusable_out(root / values["out"])
            if problem:
                d.error(item.get("out").loc, f"out {values['out']} cannot hold a generated tree: {problem}")
                continue
            if out in outs:
                d.error(item.get("out").loc, f"out {values['out']} is listed twice (first at line {outs[out].line})")
                continue
            outs[out] = item.get("out").loc
            trees.append(Tree(resolve_path(root / values["schema"]), out, root, True))
        for out, loc in outs.items():
            outer = nesting(out, outs)
            if outer is not None:
                d.error(loc, f"out {_relative(out, root)} lies inside out {_relative(outer, root)} (line "
                             f"{outs[outer].line}): a generated tree holds only what kv-canary generates, so "
                             f"another tree cannot live in it; give each tree its own folder")
    base = node.get("base_branch")
    branch = None
    if base is not None:
        branch = _str(base, base.loc, d, "base_branch")
    d.raise_if_any()
    return Config(resolve_path(path), tuple(dataclasses.replace(t, base_branch=branch) for t in trees), branch)


def nesting(out: Path, outs) -> Path | None:
    """The first of `outs` that holds `out` inside it (not `out` itself), or None."""
    return next((other for other in outs if other != out and other in out.parents), None)


def resolve_trees(schema: Path | None, out: Path | None, cwd: Path, config_path: Path | None = None) -> list[Tree]:
    """The trees a command works on. Neither --schema nor --out: every tree of kv-canary.yaml, else
    kernels.yaml -> generated/ in `cwd` (kv-canary's own layout). One of them: the config's tree that
    matches it, else the default for the other."""
    found = config_path or find_config(cwd)
    # The config's name as the user sees it: its folder resolved, not the file (a link may dangle or loop).
    shown = _relative(resolve_path((cwd / found).parent) / found.name, cwd.resolve()) if found else None
    config = load_config(found, shown) if found else None
    if schema is None and out is None and config is not None:
        return list(config.trees)
    schema_path = resolve_path(cwd / schema) if schema is not None else None
    out_path = resolve_path(cwd / out) if out is not None else None
    for tree in (config.trees if config else ()):
        if (schema_path in (None, tree.schema)) and (out_path in (None, tree.out)):
            return [tree]
    schema_path = schema_path or resolve_path(cwd / "kernels.yaml")
    out_path = out_path or resolve_path(cwd / "generated")
    return [Tree(schema_path, out_path, config.root if config is not None else cwd.resolve(), False)]
