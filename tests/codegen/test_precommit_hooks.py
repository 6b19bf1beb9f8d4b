"""The pre-commit hooks (.pre-commit-hooks.yaml) through the real `pre-commit try-repo`, on a throw-away
engine repository made by `kv-canary init`: passes clean, fails on a stale tree, fails on a breaking
change without an abi_version bump, passes with the bump.

pre-commit installs the hook repository (a commit of this checkout's files) into its own virtualenv
with kv-canary's core dependencies only (jinja2, pyyaml, numpy; never torch), as an engine's pre-commit
does. try-repo makes a new store, so a new virtualenv, on every call; here its store is one directory
shared by the four runs (try_repo.Store pointed at it), so the environment is built once.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.trees import files_changed_by
from test_diff import RENAME

from kv_canary.cli import main as kv_main

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300
# The hook repository needs only what `pip install .` builds kv-canary from.
HOOK_REPO_PATHS = ("pyproject.toml", "README.md", "kernels.yaml", ".pre-commit-hooks.yaml", "codegen", "workflow",
                   "generated", "docs", "kv_canary")
PRE_COMMIT = """
import os, sys
from pre_commit.commands import try_repo
from pre_commit.main import main
from pre_commit.store import Store
try_repo.Store = lambda _tempdir: Store(os.environ["KV_CANARY_TEST_PRE_COMMIT_STORE"])
sys.exit(main(sys.argv[1:]))
"""

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def make_hook_repo(dest: Path) -> str:
    """A git repository holding this checkout's files (committed or not, as `make test` sees them);
    returns its commit."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard", "--", *HOOK_REPO_PATHS], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src, dst = ROOT / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copyfile(src, dst)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "hooks")
    return git(dest, "rev-parse", "HEAD").strip()


@pytest.fixture(scope="module")
def try_repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("pre-commit")
    hooks = base / "hooks"
    hooks.mkdir()
    rev = make_hook_repo(hooks)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "PRE_COMMIT", "KV_CANARY_BACKEND"))}
    # Faster, not different: no .pyc up front, and kv-canary built with the setuptools that virtualenv
    # seeds into the hook environment instead of a second, isolated one (pip reads "0" as "no isolation").
    env.update(KV_CANARY_TEST_PRE_COMMIT_STORE=str(base / "store"), PIP_NO_COMPILE="1", PIP_NO_BUILD_ISOLATION="0",
               PIP_DISABLE_PIP_VERSION_CHECK="1")

    def run(repo: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", PRE_COMMIT, "try-repo", str(hooks), "--ref", rev, "--color",
                               "never"], cwd=repo, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return run


def test_the_hooks_pass_clean_fail_stale_fail_breaking_and_pass_bumped(try_repo, tmp_path, monkeypatch, capsys):
    repo = tmp_path / "engine"
    (repo / "myengine").mkdir(parents=True)
    (repo / "myengine" / "__init__.py").write_text("")
    git(repo, "init", "-q", "-b", "main")
    monkeypatch.chdir(repo)
    assert kv_main(["init", "--package", "myengine/_canary"]) == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "kv-canary init")
    git(repo, "checkout", "-q", "-b", "feature")
    schema = repo / "canary.yaml"
    original = schema.read_text()

    def outcome(text: str | None, generate: bool) -> subprocess.CompletedProcess:
        if text is not None:
            schema.write_text(text)
        if generate:
            assert kv_main(["generate"]) == 0
        git(repo, "add", "-A")  # what a commit would hold: the hooks see the staged files
        return try_repo(repo)

    (repo / "touched.txt").write_text("a staged file, so that the hooks run\n")
    clean = outcome(None, generate=False)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "kv-canary generated tree is up to date" in clean.stdout and "Passed" in clean.stdout

    message_edit = original.replace('"{name} must be contiguous"', '"{name} is not contiguous"')
    stale = outcome(message_edit, generate=False)
    assert stale.returncode == 1
    assert f"{files_changed_by(original, message_edit)} generated file(s) out of date with canary.yaml; run " \
           "`kv-canary generate` and commit myengine/_canary/" in stale.stdout
    assert stale.stdout.count("Failed") == 1  # the ABI hook passes: a message change is compatible

    breaking = outcome(original.replace(*RENAME), generate=True)
    assert breaking.returncode == 1
    assert "| **BREAKING** |" not in breaking.stdout  # the hook prints text, not the PR table
    assert "  BREAKING    field renamed: violation.stored_token: stored_token -> token_stored" in breaking.stdout
    assert "bump `abi_version` in canary.yaml (to 2) and run `kv-canary generate`." in breaking.stdout
    assert breaking.stdout.count("Failed") == 1

    bumped = outcome(original.replace(*RENAME)
                     .replace("abi_version: 1", "abi_version: 2"), generate=True)
    assert bumped.returncode == 0, bumped.stdout + bumped.stderr
    assert bumped.stdout.count("Passed") == 2
