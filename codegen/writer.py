"""Write a rendered tree to disk atomically, and compare a tree on disk with a rendered one.

Each file is replaced atomically (a temporary `.NAME.XXXXXXXX.tmp` renamed into place), and writers
of one tree take turns (an exclusive lock on `OUT/.kv-canary-generate.lock`; readers such as
`check` take it shared). A kill between two files can still leave a tree of two generator runs:
the generated package refuses to load one (its identity file, __init__.py, lists the sha256 of every
other file).
"""
from __future__ import annotations

import ast
import contextlib
import difflib
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: writers are not serialised there
    fcntl = None

from .render import GENERATOR_NOT_RECORDED, IDENTITY_FILE, GeneratedFile, sha256_text, split_header

IGNORED_DIRS = {"__pycache__"}
LOCK_NAME = ".kv-canary-generate.lock"
# What _atomic_write's mkstemp leaves behind when the process dies between creating and renaming.
_TEMP_FILE = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp")


def _umask() -> int:
    try:  # Linux reports it without changing it (os.umask would, for every thread, for a moment)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)  # elsewhere the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        # mkstemp creates 0600; a generated file gets the mode any new file would (0666 & ~umask).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def files_on_disk(out_dir: Path) -> dict[str, Path]:
    if not out_dir.is_dir():
        return {}
    found = {}
    for p in sorted(out_dir.rglob("*")):
        rel = p.relative_to(out_dir)
        if p.is_file() and not IGNORED_DIRS.intersection(rel.parts) and not p.name.startswith(".") \
                and p.suffix not in (".pyc",):
            found[rel.as_posix()] = p
    return found


@contextlib.contextmanager
def tree_lock(out_dir: Path, *, shared: bool = False,
              on_wait: Callable[[Path], None] | None = None) -> Iterator[None]:
    """Hold the tree's lock: exclusive to write it, shared to read it. `on_wait(lock_path)` is called
    once when another process holds it and this one has to wait. Where no lock can be taken (no
    fcntl, a read-only tree, a file system without locks) it proceeds unlocked."""
    lock = out_dir / LOCK_NAME
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        except OSError:
            fd = None
    try:
        if fd is not None:
            op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait(lock)
                fcntl.flock(fd, op)
            except OSError:  # e.g. ENOLCK on a network file system
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _remove_temp_files(out_dir: Path) -> list[str]:
    """Temporary files of writes that were killed before their rename (only ever ours: the caller
    holds the tree's exclusive lock, so no other writer is between create and rename)."""
    removed = []
    for p in sorted(out_dir.rglob(".*.tmp")):
        if _TEMP_FILE.fullmatch(p.name) and p.is_file() and not IGNORED_DIRS.intersection(p.parts):
            p.unlink(missing_ok=True)
            removed.append(p.relative_to(out_dir).as_posix())
    return removed


def write_tree(out_dir: Path, files: list[GeneratedFile],
               on_wait: Callable[[Path], None] | None = None) -> tuple[list[str], list[str]]:
    """Write changed files (only those), remove stale generated ones and temporary files that an
    interrupted run left behind. Returns (written, removed). Concurrent calls on one tree take
    turns (see tree_lock; `on_wait` is told when this one waits)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tree_lock(out_dir, on_wait=on_wait):
        return _write_tree(out_dir, files)


def _write_tree(out_dir: Path, files: list[GeneratedFile]) -> tuple[list[str], list[str]]:
    written, removed = [], _remove_temp_files(out_dir)
    wanted = {f.path for f in files}
    mode = 0o666 & ~_umask()
    for f in files:
        target = out_dir / f.path
        if target.is_file() and target.read_text(encoding="utf-8") == f.text:
            if stat.S_IMODE(target.stat().st_mode) != mode:  # e.g. 0600 from an older generator
                os.chmod(target, mode)
            continue
        _atomic_write(target, f.text)
        written.append(f.path)
    for rel, p in files_on_disk(out_dir).items():
        # Only files the generator made (they carry its header) are ours to delete.
        if rel not in wanted and split_header(p.read_text(encoding="utf-8", errors="replace")) is not None:
            p.unlink()
            removed.append(rel)
    return written, removed


# How drifts are listed: what needs a human decision first, then what `make generate` fixes.
DRIFT_ORDER = ("hand-edited", "stale", "generator-changed", "changed", "missing", "extra")


@dataclass(frozen=True)
class Drift:
    path: str        # as shown to the user (display dir + relative path)
    kind: str        # hand-edited | stale | generator-changed | changed | missing | extra
    detail: str      # what is wrong, one line
    fix: str         # what to do about it, one line
    diff: str        # unified diff, on disk -> freshly generated ("" for missing/extra)


@dataclass(frozen=True)
class Hints:
    """What fix lines name: the command that regenerates the tree, the schema to edit, and whether this
    is kv-canary's own checkout (only there do the templates in codegen/ exist to be edited)."""
    regenerate: str = "make generate"
    schema: str = "kernels.yaml"
    own_checkout: bool = True


@dataclass(frozen=True)
class _Identity:
    """What the identity file on disk says about the run that wrote the tree (None: nothing readable)."""
    schema: str | None = None
    generator: str | None = None
    files: dict | None = None  # path -> sha256 of its text (FILE_SHA256)


def _file_table(body: str) -> dict | None:
    """The FILE_SHA256 literal of the identity file's body (None when it has none)."""
    try:
        module = ast.parse(body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # not Python: no table
        return None
    for node in module.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["FILE_SHA256"]:
            try:
                table = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            return table if isinstance(table, dict) else None
    return None


def _identity_on_disk(out_dir: Path) -> _Identity:
    try:
        parsed = split_header((out_dir / IDENTITY_FILE).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return _Identity()
    if parsed is None or parsed[0].get("body") != sha256_text(parsed[1]):
        return _Identity()  # missing, hand-edited or not generated: it vouches for nothing
    return _Identity(parsed[0].get("schema"), parsed[0].get("generator"), _file_table(parsed[1]))


def _classify(current: str, wanted: GeneratedFile, fresh: _Identity, on_disk: _Identity, identity_shown: str,
              hints: Hints) -> tuple[str, str, str]:
    """(kind, detail, fix) for a file whose text differs from what the generator produces. `fresh` is
    the identity the generator would write, `on_disk` the one the tree's identity file (shown as
    `identity_shown`) holds."""
    regenerate = hints.regenerate
    if hints.own_checkout:
        source = f"codegen/templates/{wanted.template}" if wanted.template else "its template in codegen/templates/"
        edit = f"make the change in {hints.schema} or {source}"
    else:
        edit = f"make the change in {hints.schema}"
    parsed = split_header(current)
    if parsed is None:
        return ("hand-edited", "hand-edited: its do-not-edit header was removed or changed",
                f"{edit}, then run `{regenerate}`")
    fields = parsed[0]
    if "schema" in fields:  # the identity file, or a file of a generator older than it (hashes in every header)
        if fields.get("body") != sha256_text(parsed[1]):
            return ("hand-edited", "hand-edited: its body no longer matches the body-sha256 in its header",
                    f"{edit}, then run `{regenerate}` (it overwrites this file)")
        written_by = _Identity(fields["schema"], fields.get("generator"))
    else:
        listed = (on_disk.files or {}).get(wanted.path)
        if listed is None:
            return ("changed", f"differs from what the generator produces, and {identity_shown} lists no sha256 "
                               f"for it to tell a hand edit from a stale tree",
                    f"run `{regenerate}`")
        if listed != sha256_text(current):
            return ("hand-edited", f"hand-edited: its text no longer matches the sha256 that {identity_shown} lists "
                                   f"for it",
                    f"{edit}, then run `{regenerate}` (it overwrites this file)")
        written_by = on_disk
    if written_by.schema != fresh.schema:
        return ("stale", "stale: the schema changed since this file was generated",
                f"run `{regenerate}` and commit the result")
    if fresh.generator == GENERATOR_NOT_RECORDED:  # a golden: only the generator can have moved it
        return ("generator-changed", "stale: its schema is unchanged, so the generator (codegen/) changed since "
                                     "this golden was generated", f"run `{regenerate}` and commit the result")
    if written_by.generator != fresh.generator:
        if hints.own_checkout:
            return ("generator-changed", "stale: the generator (codegen/) changed since this file was generated",
                    f"run `{regenerate}` and commit the result")
        return ("generator-changed", "stale: generated by another version of kv-canary than the one running "
                                     f"(the generator-sha256 in {identity_shown}'s header differs)",
                f"run `{regenerate}` with the kv-canary version this repository pins, and commit the result")
    if parsed[1] == split_header(wanted.text)[1]:
        return ("changed", "differs only in its header (the schema path, regenerate command or template it names)",
                f"run `{regenerate}`")
    outside = "outside codegen/" if hints.own_checkout else "besides the schema and kv-canary's version"
    return ("changed", "differs from what the generator produces (same schema and generator hashes)",
            f"run `{regenerate}`; if it persists, the output depends on something {outside} "
            f"(e.g. the Jinja2 version)")


def compare_tree(out_dir: Path, files: list[GeneratedFile], display_dir: str,
                 hints: Hints | str = Hints()) -> list[Drift]:
    """Every difference between out_dir and the freshly rendered files, classified (DRIFT_ORDER, then
    path). `hints` (or just the regenerate command) is what the fix lines name."""
    if isinstance(hints, str):
        hints = Hints(regenerate=hints)
    regenerate = hints.regenerate
    drifts = []
    on_disk = files_on_disk(out_dir)
    identity = next((split_header(f.text)[0] for f in files if f.path == IDENTITY_FILE), {})
    fresh, written = _Identity(identity.get("schema"), identity.get("generator")), _identity_on_disk(out_dir)
    for f in files:
        shown = f"{display_dir}/{f.path}"
        p = on_disk.get(f.path)
        if p is None:
            drifts.append(Drift(shown, "missing", "missing: the generator produces it but it is not on disk",
                                f"run `{regenerate}`", ""))
            continue
        current = p.read_text(encoding="utf-8", errors="replace")
        if current == f.text:
            continue
        diff = "".join(difflib.unified_diff(
            current.splitlines(keepends=True), f.text.splitlines(keepends=True),
            fromfile=f"{shown} (on disk)", tofile=f"{shown} (generated)", n=2))
        drifts.append(Drift(shown, *_classify(current, f, fresh, written, f"{display_dir}/{IDENTITY_FILE}", hints),
                                diff))
    wanted_paths = {f.path for f in files}
    for rel in on_disk:
        if rel not in wanted_paths:
            also = ("or add a template and a row in codegen/outputs.py" if hints.own_checkout else
                    f"{display_dir}/ holds only what kv-canary generates; keep your own files outside it")
            drifts.append(Drift(f"{display_dir}/{rel}", "extra", "extra: no template produces this file",
                                f"delete it (`git rm {display_dir}/{rel}`); {also}" if not hints.own_checkout else
                                f"delete it (`git rm {display_dir}/{rel}`), {also}", ""))
    return sorted(drifts, key=lambda d: (DRIFT_ORDER.index(d.kind), d.path))
