"""The sanitizer builds of the host libraries (the emulation library and the cpu backend's).

With KV_CANARY_EMULATION_SANITIZE=1 (what `make sanitize` sets) each library is built with
AddressSanitizer and UndefinedBehaviorSanitizer, every finding fatal, as its own cache entry. Such a
library only loads into a process that has the ASan runtime first in its library list (LD_PRELOAD);
`make sanitize` arranges that, and building one anywhere else is refused with a clear error.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV_SANITIZE = "KV_CANARY_EMULATION_SANITIZE"
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=all")


def sanitize_enabled() -> bool:
    return os.environ.get(ENV_SANITIZE, "") not in ("", "0")


def asan_runtime_loaded() -> bool:
    """Whether this process has the ASan runtime mapped (it must come first: LD_PRELOAD)."""
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def build_flags(flags: tuple[str, ...], *, library: str, error: type[Exception]) -> tuple[tuple[str, ...], bool]:
    """(the compiler flags, whether sanitized) of a host library: `flags`, plus SANITIZE_FLAGS when
    sanitize_enabled(). Raises `error` (the caller's build error) naming `library` when a sanitized
    library could not be loaded into this process."""
    if not sanitize_enabled():
        return flags, False
    if not asan_runtime_loaded():
        raise error(f"kv-canary: {ENV_SANITIZE}=1 builds the {library} library with AddressSanitizer, which loads "
                    f"only into a process started with the ASan runtime first "
                    f"(LD_PRELOAD=$(g++ -print-file-name=libasan.so)); run `make sanitize`, or unset {ENV_SANITIZE}")
    return flags + SANITIZE_FLAGS, True
