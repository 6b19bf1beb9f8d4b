"""The `kv-canary` command: the generator's subcommands (same parser code), the workflow's and `demo`."""
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


def subcommands(parser) -> list[str]:
    """The parser's subcommands, in the order --help lists them."""
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(action.choices)


def test_kv_canary_has_the_codegen_commands_then_the_workflows_plus_demo():
    import argparse

    from kv_canary.codegen.cli import add_codegen_commands
    plain = argparse.ArgumentParser()
    add_codegen_commands(plain.add_subparsers(), ROOT)
    assert subcommands(plain) == ["generate", "check", "describe", "diff"]
    assert subcommands(build_parser()) == [*subcommands(plain), "abi-check", "pr-report", "init", "demo"]


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


# -- paths the user names that no command can use: a located message naming the file, never a traceback --
@pytest.fixture
def project(tmp_path, monkeypatch):
    """An engine repository's top (a .git folder ends kv-canary.yaml's search) with a schema."""
    (tmp_path / ".git").mkdir()
    (tmp_path / "canary.yaml").write_bytes((ROOT / "kv_canary" / "default_schema.yaml").read_bytes())
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("link, why", [("nowhere.yaml", "it is a symbolic link to nowhere.yaml, which does not exist"),
                                       ("kv-canary.yaml", "it is a symbolic link that loops (kv-canary.yaml -> "
                                                          "kv-canary.yaml)")])
@pytest.mark.parametrize("command", ["generate", "check"])
def test_a_config_link_that_dangles_or_loops_is_an_error_not_ignored(project, capsys, link, why, command):
    """It was taken for no config at all: with a kernels.yaml, `generate` wrote kernels.yaml -> generated/,
    a tree the config never named, and exited 0."""
    (project / "kernels.yaml").write_bytes((project / "canary.yaml").read_bytes())
    (project / "kv-canary.yaml").symlink_to(link)
    assert kv_main([command]) == 1
    assert capsys.readouterr().err == f"kv-canary.yaml:1:1: error: cannot read the kv-canary config: {why}\n1 error\n"
    assert not (project / "generated").exists()


def test_nested_outputs_are_refused_where_they_are_named(project, capsys):
    """`check` always failed on them (advising `git rm` of the inner tree) and every `generate` deleted
    and rewrote the inner tree."""
    (project / "kv-canary.yaml").write_text("kv-canary: 1\ntrees:\n  - schema: canary.yaml\n    out: gen\n"
                                            "  - schema: canary.yaml\n    out: gen/inner\n")
    for command in ("generate", "check"):
        assert kv_main([command]) == 1
        assert capsys.readouterr().err == (
            "kv-canary.yaml:6:10: error: out gen/inner lies inside out gen (line 4): a generated tree holds only what "
            "kv-canary generates, so another tree cannot live in it; give each tree its own folder\n1 error\n")
    assert not (project / "gen").exists()
    (project / "kv-canary.yaml").unlink()
    assert kv_main(["generate", "--tree", "canary.yaml=gen/a/b", "--tree", "canary.yaml=gen"]) == 2
    assert capsys.readouterr().err == (
        "kv-canary: error: the generated tree gen/a/b lies inside the generated tree gen: a generated tree holds only "
        "what kv-canary generates, so another tree cannot live in it; give each tree its own folder\n")
    assert not (project / "gen").exists()
    assert kv_main(["generate", "--tree", "canary.yaml=gen", "--tree", "canary.yaml=gen2"]) == 0  # siblings: fine


@pytest.mark.parametrize("command", ["generate", "check", "describe"])
def test_a_schema_that_is_a_symlink_loop_is_a_located_error(project, capsys, command):
    """A bare traceback: the last-resort error handler itself crashed resolving the path."""
    (project / "loop.yaml").symlink_to("loop.yaml")
    assert kv_main([command, "--schema", "loop.yaml"]) == 1
    assert capsys.readouterr().err == ("loop.yaml:1:1: error: cannot read schema loop.yaml: it is a symbolic link "
                                       "that loops (loop.yaml -> loop.yaml)\n1 error\n")


def test_describe_reports_a_kernels_yaml_it_cannot_read(project, capsys, monkeypatch):
    """Without --schema, describe printed the installed tree's layout when kernels.yaml was a link
    that loops, as if there were none."""
    from kv_canary.codegen.cli import run

    (project / "kernels.yaml").symlink_to("kernels.yaml")
    assert run(build_parser(), ["describe"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("kernels.yaml:1:1: error: cannot read schema kernels.yaml: it is a symbolic "
                                      "link that loops (kernels.yaml -> kernels.yaml)\n1 error\n")


@pytest.mark.parametrize("out, why", [("loop", "it is a symbolic link that loops (loop -> loop)"),
                                      ("loop/inner", "Too many levels of symbolic links"),
                                      ("canary.yaml", "it is not a folder")])
@pytest.mark.parametrize("command", ["generate", "check"])
def test_an_output_folder_that_cannot_be_one_is_named(project, capsys, out, why, command):
    """A loop was reported as "internal error ... this is a kv-canary bug"."""
    (project / "loop").symlink_to("loop")
    before = sorted(p.name for p in project.iterdir())
    assert kv_main([command, "--schema", "canary.yaml", "--out", out]) == 1
    assert capsys.readouterr().err == f"kv-canary: error: {out} cannot hold a generated tree: {why}\n"
    assert sorted(p.name for p in project.iterdir()) == before
    (project / "kv-canary.yaml").write_text(f"kv-canary: 1\ntrees:\n  - schema: canary.yaml\n    out: {out}\n")
    assert kv_main([command]) == 1
    assert capsys.readouterr().err == f"kv-canary.yaml:4:10: error: out {out} cannot hold a generated tree: {why}\n1 error\n"


@pytest.mark.parametrize("old, new, why", [
    ("somedir", "canary.yaml", "somedir is a directory, not a schema file (give a schema file, a git revision such as "
                               "HEAD~1, or REV:PATH)"),
    ("canary.yaml", "somedir", "somedir is a directory, not a schema file (give a schema file, a git revision such as "
                               "HEAD~1, or REV:PATH)"),
    ("loop.yaml", "canary.yaml", "loop.yaml: cannot read it: it is a symbolic link that loops (loop.yaml -> loop.yaml)"),
    ("canary.yaml", "gone.yaml", "gone.yaml: cannot read it: it is a symbolic link to nowhere.yaml, which does not "
                                 "exist"),
])
def test_diff_names_a_path_that_is_not_a_schema_file(project, capsys, old, new, why):
    """`kv-canary diff <directory> ...` said "git revision does not exist"."""
    (project / "somedir").mkdir()
    (project / "loop.yaml").symlink_to("loop.yaml")
    (project / "gone.yaml").symlink_to("nowhere.yaml")
    assert kv_main(["diff", old, new]) == 1
    assert capsys.readouterr().err == f"kv-canary diff: {why}\n"
