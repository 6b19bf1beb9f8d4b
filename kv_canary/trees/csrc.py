"""The hand-written device headers (kv_canary/csrc/, shipped as package data).

The generated kernels hold only the schema's constants, tables and entry points; their device code
is in these headers, which every compiler finds here: NVRTC as in-memory includes (nvrtc.py), g++
(the emulation and sanitizer builds) and nvcc through CSRC_DIR on the include path. Every compile
cache key covers their bytes, so editing a header rebuilds what includes it.
"""
from __future__ import annotations

from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"


def csrc_headers() -> dict[str, str]:
    """{include name: text} of every header in CSRC_DIR, by name."""
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(CSRC_DIR.iterdir())
            if p.suffix in (".cuh", ".h") and p.is_file()}
