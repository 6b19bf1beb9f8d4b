"""`make setup`: install the development environment into the running interpreter's venv, fast.

A fresh `make test` spends a third of its time here, most of it unpacking wheels one after the
other. So torch (with its own dependencies) and the other packages are installed by two pip runs at
once; their sets are disjoint (the other run leaves out torch and what torch itself requires of
ours, jinja2), so no package is written by both. Then one `pip install -e .[dev]` is the
authoritative step: it resolves everything, installs whatever the parallel runs did not (a failure
there is not fatal, only slower) and installs kv-canary itself. Last, the packages pyproject.toml lists
under [tool.kv-canary.setup] no-deps (the SGLang release the plugin tests run against) install
without their dependencies. Pins stay in pyproject.toml.

A new venv is made without pip (`python -m venv` spends seconds compiling its bundled pip), and
pip and setuptools are installed into it by this interpreter's pip (`--python`, pip >= 22.3);
where that fails, the plain `python -m venv` runs instead.

Usage (the Makefile's setup target):
  python3 scripts/setup_venv.py --create .venv   make the venv (only when it does not exist)
  .venv/bin/python scripts/setup_venv.py         install into the running interpreter's venv
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-compile"]


def parallel_groups() -> list[list[str]]:
    """[torch's requirement], [every other requirement of the dev install but torch's own]."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: no parallel warm-up, the final install does it all
        return []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    torch = [r for r in wanted if r.startswith("torch")]
    others = [r for r in wanted if not r.startswith(("torch", "jinja2"))]  # jinja2: torch requires it too
    return [torch, others] if torch else []


def no_deps_requirements() -> list[str]:
    """[tool.kv-canary.setup] no-deps: packages whose own requirements must not be installed."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: no tomllib; the SGLang plugin tests then skip
        return []
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8")).get("tool", {})
    return list(tool.get("kv-canary", {}).get("setup", {}).get("no-deps", []))


def say(text: str) -> None:
    """One progress line per phase (pip itself runs quietly): what runs now."""
    print(f"make setup: {text}", flush=True)


def _took(start: float) -> str:
    return f"{time.monotonic() - start:.0f}s"


def create(venv: Path) -> int:
    import shutil
    say(f"creating the virtual environment {venv} (pip and setuptools only)")
    python = venv / "bin" / "python"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0
    if made and subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
                                "pip", "setuptools>=64"]).returncode == 0:
        return 0
    shutil.rmtree(venv, ignore_errors=True)
    return subprocess.run([sys.executable, "-m", "venv", str(venv)]).returncode


def main(argv: list[str]) -> int:
    if argv[:1] == ["--create"] and len(argv) == 2:
        return create(Path(argv[1]))
    start = time.monotonic()
    groups = [group for group in parallel_groups() if group]
    if groups:
        say(f"1/3 unpacking {', '.join(groups[0])} and {len(groups[1]) if len(groups) > 1 else 0} other packages "
            f"in two parallel pip runs (torch is the long one)")
    runs = [subprocess.Popen(PIP + group) for group in groups]
    for run in runs:
        run.wait()  # not checked: the install below is the one that must succeed
    try:  # kv-canary's own build needs only setuptools, which the venv has: no isolated build env
        import setuptools  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    say(f"2/3 installing kv-canary (editable, .[dev]) and checking every pin ({_took(start)} so far)")
    # setuptools cautions every editable install with a package_dir mapping (generated/, codegen/ and
    # docs/ ship as kv_canary.*) about same-named folders: deliberate here, and not actionable.
    env = {**os.environ, "PYTHONWARNINGS": "ignore:Editable installation"}
    code = subprocess.run(PIP + isolation + ["-e", ".[dev]"], cwd=ROOT, env=env).returncode
    no_deps = no_deps_requirements()
    if code:
        say(f"FAILED: pip install -e '.[dev]' exited {code} (its messages are above)")
        return code
    if no_deps:
        say(f"3/3 installing {', '.join(no_deps)} without its dependencies (the SGLang plugin's tests)")
        code = subprocess.run(PIP + ["--no-deps"] + no_deps, cwd=ROOT).returncode
    say(f"done in {_took(start)}" if not code else f"FAILED: pip exited {code} (its messages are above)")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
