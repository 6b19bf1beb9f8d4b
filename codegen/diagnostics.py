"""Source locations and collected diagnostics.

Every schema problem is reported as ``FILE:LINE:COL: error: MESSAGE`` (1-based, like a compiler),
one line each, and all problems of one run are reported together, sorted, so a schema author fixes
them in one go. Schema text echoed in a message is escaped (escape_text), so no newline, control or
bidirectional character in a schema can forge a diagnostic line or reorder what the terminal shows.
"""
from __future__ import annotations

import difflib
import errno
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

CODEGEN_DIR = Path(__file__).resolve().parent


_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_text(text: str) -> str:
    """`text` with every non-printable character (C0/C1 controls, line and paragraph separators,
    bidirectional and other invisible format characters, surrogates, unassigned code points) as a
    `\\n`, `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN` escape. Idempotent: escapes are printable ASCII."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        cp = ord(ch)
        if ch.isprintable():
            out.append(ch)
        elif ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        else:
            out.append(f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}")
    return "".join(out)


def quote(value) -> str:
    """A schema value as a message echoes it: in single quotes, escaped (see escape_text)."""
    return f"'{escape_text(str(value))}'"


@dataclass(frozen=True, order=True)
class Loc:
    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True, order=True)
class Diagnostic:
    loc: Loc
    message: str

    def __str__(self) -> str:
        # The one place every diagnostic passes: whatever a message quotes, it stays one line.
        return escape_text(f"{self.loc}: error: {self.message}")


class SchemaError(Exception):
    """Raised with every diagnostic of a schema; str() is the full, sorted report.

    `internal` is True when the report stands for a bug of the generator (see internal_error),
    not for a problem of the schema."""

    def __init__(self, diagnostics: list[Diagnostic], *, internal: bool = False):
        self.diagnostics = sorted(set(diagnostics))
        self.internal = internal
        super().__init__("\n".join(str(d) for d in self.diagnostics))


def internal_error(display_name: str, exc: BaseException) -> SchemaError:
    """The last-resort report of an exception the front end did not expect: one diagnostic at 1:1
    that names the exception and where in codegen/ it was raised, and asks for a bug report."""
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(CODEGEN_DIR):
            where = f" at codegen/{path.relative_to(CODEGEN_DIR).as_posix()}:{frame.lineno}"
            break
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if len(detail) > 300:
        detail = detail[:300] + "..."
    return SchemaError([Diagnostic(Loc(display_name, 1, 1),
                                   f"internal error of the generator ({detail}{where}); this is a kv-canary bug, "
                                   f"please report it together with the schema that triggers it")], internal=True)


class Diagnostics:
    """Collects errors; ``raise_if_any`` turns them into one SchemaError. Notes (``FILE:LINE:COL:
    note: ...``) say what a valid schema may drop; they never fail a run."""

    def __init__(self) -> None:
        self._items: list[Diagnostic] = []
        self.notes: list[Diagnostic] = []

    def error(self, loc: Loc, message: str) -> None:
        self._items.append(Diagnostic(loc, message))

    def note(self, loc: Loc, message: str) -> None:
        self.notes.append(Diagnostic(loc, message))

    def note_lines(self) -> tuple[str, ...]:
        return tuple(escape_text(f"{n.loc}: note: {n.message}") for n in sorted(set(self.notes)))

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def raise_if_any(self) -> None:
        if self._items:
            raise SchemaError(self._items)


def closest_name(word: str, choices, cutoff: float = 0.7) -> str | None:
    """The choice that `word` is most likely a misspelling of, if any is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    return match[0] if match else None


def closest_hint(word: str, choices, cutoff: float = 0.7) -> str:
    """` (did you mean 'x'?)`, or '' when nothing is close (`cutoff`: higher for names that share
    long prefixes and suffixes, such as VERIFY_*_MISMATCH)."""
    match = closest_name(word, choices, cutoff)
    return f" (did you mean '{match}'?)" if match else ""


def describe_unreadable(path: Path, exc: OSError) -> str:
    """Why `path` could not be read, saying what a symbolic link points at when it is one."""
    try:
        target = os.readlink(path) if path.is_symlink() else None
    except OSError:
        target = None
    if target is not None and exc.errno == errno.ELOOP:
        return f"it is a symbolic link that loops ({path.name} -> {target})"
    if target is not None and exc.errno == errno.ENOENT:
        return f"it is a symbolic link to {target}, which does not exist"
    return exc.strerror or str(exc)
