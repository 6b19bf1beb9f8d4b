"""The `kv-canary` command: the codegen subcommands (same parser code) plus `demo`."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from kv_canary.codegen.cli import main as codegen_main

import kv_canary
from kv_canary.cli import build_parser
from kv_canary.cli import main as kv_main

ROOT = Path(__file__).resolve().parents[2]


def subcommands(parser) -> set[str]:
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(action.choices)


def test_kv_canary_has_the_codegen_commands_plus_demo():
    import argparse

    from kv_canary.codegen.cli import add_codegen_commands
    plain = argparse.ArgumentParser()
    add_codegen_commands(plain.add_subparsers(), ROOT)
    assert subcommands(plain) == {"generate", "check", "describe", "diff", "abi-check", "pr-report"}
    assert subcommands(build_parser()) == subcommands(plain) | {"init", "demo"}


def test_describe_and_check_match_python_m_codegen(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for argv in (["describe"], ["check", "--quiet"]):
        assert kv_main(argv) == codegen_main(argv)
        ours, theirs = capsys.readouterr(), None
        codegen_main(argv)
        theirs = capsys.readouterr()
        assert ours.out == theirs.out * 2 and ours.err == theirs.err * 2


def test_demo_gets_every_argument_and_its_status_is_the_exit_status(monkeypatch):
    seen = []
    fake = types.ModuleType("kv_canary.demo")
    fake.main = lambda argv: seen.append(list(argv)) or 3
    monkeypatch.setitem(sys.modules, "kv_canary.demo", fake)
    monkeypatch.setattr(kv_canary, "demo", fake, raising=False)
    assert kv_main(["demo", "--backend", "torch", "-v"]) == 3
    assert kv_main(["demo"]) == 3
    assert seen == [["--backend", "torch", "-v"], []]


def test_no_command_prints_help_and_exits_2(capsys):
    assert kv_main([]) == 2
    assert "usage: kv-canary" in capsys.readouterr().out


def test_schema_errors_exit_1_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: 1\nabi_version: [\n")
    assert kv_main(["describe", "--schema", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:3:1: error: YAML syntax error") and err.endswith("1 error\n")


@pytest.mark.parametrize("command", [[sys.executable, "-m", "kv_canary"],
                                     [str(Path(sys.executable).parent / "kv-canary")]],
                         ids=["python -m kv_canary", "console script"])
def test_entry_points_run_describe(command, tmp_path):
    if not Path(command[0]).exists():
        pytest.fail(f"{command[0]} is missing: run `make setup` (pip install -e .)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*command, "describe"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# Canary ABI layout\n")


def test_unwritable_output_is_a_message_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    assert codegen_main(["generate", "--schema", str(ROOT / "kernels.yaml"), "--out", str(blocker / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m codegen: error: ") and str(blocker) in err and "Traceback" not in err
