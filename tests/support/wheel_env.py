"""A built wheel of this checkout, installed (not editable) into a fresh virtual environment that
reuses this environment's third-party packages through a path file (nothing is downloaded);
kv-canary itself comes only from the wheel. Used by test_wheel_install.py and test_engine_repo.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def run(cmd: list[str], *, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def session_dir(tmp_path_factory) -> Path:
    """A directory of this pytest session that every xdist worker sees (each worker's basetemp is a
    child of it), and nothing outside the session does."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_wheel(shared: Path, env: dict) -> Path:
    """The wheel of this checkout, built once per session: the modules that need it (on any xdist
    worker) take turns on a lock in `shared` and the later ones reuse the first one's wheel. It is
    built from a copy of the checkout: setuptools writes build/ and kv_canary.egg-info/ into the
    tree it builds, and a half-written egg-info at the checkout's root (on every test's sys.path)
    hides the installed kv-canary's metadata (its entry points) from the tests running meanwhile."""
    import fcntl
    dist = shared / "kv-canary-wheel"
    dist.mkdir(parents=True, exist_ok=True)
    with open(shared / "kv-canary-wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(dist.glob("kv_canary-*.whl"))
        if not found:
            source = shared / "kv-canary-source"
            shutil.rmtree(source, ignore_errors=True)
            shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
                ".git", ".venv", "build", "out", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
            run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                 "-w", str(dist), str(source)], cwd=source, env=env)
            found = sorted(dist.glob("kv_canary-*.whl"))
    return found[0]


def install_wheel(base: Path, shared: Path):
    """(venv python, venv bin dir, a working directory outside the checkout, environment). `shared`: a
    directory every worker of the session sees (the wheel is built there once)."""
    # No PYTHONPATH anywhere: a checkout on the path would make pip think kv-canary is installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KV_CANARY_BACKEND")}
    wheel = build_wheel(shared, env)
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=base, env=env)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=base, env=env).stdout.strip())
    # Third-party dependencies from this environment (its .pth files, e.g. an editable kv-canary,
    # are not processed from a path entry, so kv_canary can only come from the wheel).
    (site / "_kv_canary_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], cwd=base, env=env)
    work = base / "elsewhere"
    work.mkdir()
    env["KV_CANARY_CACHE_DIR"] = str(base / "cache")
    return python, venv / "bin", work, env
