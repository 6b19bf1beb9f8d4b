"""`make setup` (scripts/setup_venv.py) says what it does, one line per phase, while pip runs quietly."""
from __future__ import annotations

import importlib.util
import subprocess

from support.trees import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("setup_venv", ROOT / "scripts" / "setup_venv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Done:
    returncode = 0

    def wait(self):
        return 0


def test_setup_prints_one_line_per_phase(monkeypatch, capsys):
    setup = _script()
    calls = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: calls.append(cmd) or _Done())
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or _Done())
    assert setup.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 3)[2] for line in lines] == ["1/3", "2/3", "3/3", "done"]
    assert all(line.startswith("make setup: ") for line in lines)
    assert "torch==" in lines[0] and "sglang==" in lines[2]
    assert all("-q" in cmd for cmd in calls) and len(calls) == 4   # two parallel runs, the check, the no-deps one


def test_a_failed_install_says_so(monkeypatch, capsys):
    setup = _script()

    class Failed(_Done):
        returncode = 1
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: _Done())
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: Failed())
    assert setup.main([]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("make setup: FAILED: pip install -e '.[dev]' exited 1")


def test_every_folder_of_the_package_is_declared():
    """setuptools warns ("Package would be ignored") about a folder of package data that `packages`
    does not list: every folder under kv_canary/ with files is declared."""
    import tomllib
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    declared = set(tool["packages"])
    folders = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "kv_canary").rglob("*")
               if p.is_dir() and "__pycache__" not in p.parts and any(f.is_file() for f in p.iterdir())}
    assert sorted(folders - declared) == []
    assert {"kv_canary.csrc", "kv_canary.docs"} <= declared and tool["package-dir"]["kv_canary.docs"] == "docs"
