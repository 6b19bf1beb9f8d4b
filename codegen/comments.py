"""Schema text inside a generated comment: one line that cannot end the comment, continue it onto
the next line, or display differently from what a compiler reads.

The schema parser rejects most such text already; the renderers do not rely on it. Every character
that could do harm in a C, C++, Python or Markdown comment is written as `<U+XXXX>`:
- control and format characters of every kind (Unicode categories Cc, Cf, Cs, Co, Cn), line and
  paragraph separators (Zl, Zp): a line break ends a `//` or `#` comment early, and the bidi
  controls (U+202A..U+202E, U+2066..U+2069, ...) are "Trojan Source" reorderings;
- the backslash: at the end of a `//` comment it continues the comment onto the next line;
- the first `?` of a trigraph (`??/` is a backslash to a pre-C++17 compiler);
- the `/` of `*/` and the `>` of `-->`, which end block and HTML comments.
"""
from __future__ import annotations

import re
import unicodedata

_TRIGRAPH = re.compile(r"\?(?=\?[=/'()!<>\-])")
_COMMENT_END = re.compile(r"(?<=\*)/|(?<=--)>")


def _escaped(ch: str) -> str:
    return f"<U+{ord(ch):04X}>"


def _unsafe(ch: str) -> bool:
    return ch == "\\" or unicodedata.category(ch)[0] == "C" or unicodedata.category(ch) in ("Zl", "Zp")


def comment_text(text: str) -> str:
    """`text` made safe to place after `//`, `#` or inside `<!-- -->` on one line."""
    text = "".join(_escaped(ch) if _unsafe(ch) else ch for ch in str(text))
    text = _TRIGRAPH.sub(_escaped("?"), text)
    return _COMMENT_END.sub(lambda m: _escaped(m.group()), text)
