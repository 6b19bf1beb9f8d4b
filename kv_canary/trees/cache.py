"""The project-owned compile cache (never the working directory).

`$KV_CANARY_CACHE_DIR`, else `$XDG_CACHE_HOME/kv-canary`, else `~/.cache/kv-canary`. Entries are
named by a hash of everything that determines their content, so a stale entry cannot be picked
up for changed sources; they are written atomically (temp file + rename) so concurrent processes
never see half a file, and built under a per-entry lock so that processes starting together (the
ranks of one engine, test workers) compile an entry once and the others wait for it (`entry`).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

ENV_CACHE_DIR = "KV_CANARY_CACHE_DIR"


def cache_root() -> Path:
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kv-canary"


def cache_dir(kind: str) -> Path:
    path = cache_root() / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def content_key(*parts) -> str:
    """sha256 over the parts (str or bytes), each length-prefixed so boundaries cannot shift."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def entry(path: Path, make: Callable[[Path], None]) -> Path:
    """The cache entry `path`, created on a miss by `make(tmp)`, which writes it to a temporary file
    beside it; the file is then renamed into place (atomic: no reader sees half an entry). Misses
    are built under a per-entry lock (an flock on `<path>.lock`, released if the process dies) and
    checked again inside it, so processes that miss together (the ranks of one engine, test
    workers) build an entry once and the others reuse it. On an error nothing is left behind."""
    if path.exists():
        return path
    with open(path.with_name(path.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.exists():
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
                os.close(fd)
                try:
                    make(Path(tmp))
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path
