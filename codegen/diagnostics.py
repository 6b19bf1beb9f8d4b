"""Source locations and collected diagnostics.

Every schema problem is reported as ``FILE:LINE:COL: error: MESSAGE`` (1-based, like a compiler),
and all problems of one run are reported together, sorted, so a schema author fixes them in one go.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass


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
        return f"{self.loc}: error: {self.message}"


class SchemaError(Exception):
    """Raised with every diagnostic of a schema; str() is the full, sorted report."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = sorted(set(diagnostics))
        super().__init__("\n".join(str(d) for d in self.diagnostics))


class Diagnostics:
    """Collects errors; ``raise_if_any`` turns them into one SchemaError."""

    def __init__(self) -> None:
        self._items: list[Diagnostic] = []

    def error(self, loc: Loc, message: str) -> None:
        self._items.append(Diagnostic(loc, message))

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def raise_if_any(self) -> None:
        if self._items:
            raise SchemaError(self._items)


def closest_name(word: str, choices) -> str | None:
    """The choice that `word` is most likely a misspelling of, if any is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.7)
    return match[0] if match else None


def closest_hint(word: str, choices) -> str:
    """` (did you mean 'x'?)`, or '' when nothing is close."""
    match = closest_name(word, choices)
    return f" (did you mean '{match}'?)" if match else ""
