"""The project-owned compile cache (never the working directory).

`$KV_CANARY_CACHE_DIR`, else `$XDG_CACHE_HOME/kv-canary`, else `~/.cache/kv-canary`. Entries are
named by a hash of everything that determines their content, so a stale entry cannot be picked
up for changed sources; they are written atomically (temp file + rename) so concurrent processes
never see half a file, and built under a per-entry lock (`building`) so that processes starting
together (the ranks of one engine, test workers) compile an entry once and the others wait for it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

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


def store_atomically(path: Path, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def building(path: Path):
    """Hold `path`'s build lock (an flock on `<path>.lock`, released when the process dies); the
    caller checks for the entry again inside, since another process may have built it meanwhile."""
    with open(path.with_name(path.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
