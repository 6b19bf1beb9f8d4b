"""`kv-canary diff OLD NEW`: each kind of schema change is found and classified; the exit status
gates breaking changes on an abi_version bump; OLD/NEW may be files or git revisions."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kv_canary.codegen.cli import main
from kv_canary.codegen.diff import diff_schemas, format_markdown
from kv_canary.codegen.load import load_schema_text
from support.trees import sglang_schema_text

ROOT = Path(__file__).resolve().parents[2]
# SGLang's default ABI (stride 32, abi_version 1), whatever stride and abi_version the checked-in
# schema currently uses: every expectation below is spelled against this base.
BASE = sglang_schema_text()


def edit(*pairs: tuple[str, str], text: str = BASE) -> str:
    for old, new in pairs:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def rows(new_text: str, old_text: str = BASE) -> list[tuple[str, str, str, str, bool]]:
    report = diff_schemas(load_schema_text(old_text), load_schema_text(new_text))
    return [(c.kind, c.subject, c.old, c.new, c.breaking) for c in report.changes]


ADD_EPOCH = ("      - {name: real_kv_hash, role: kv_fingerprint}\n",
             "      - {name: real_kv_hash, role: kv_fingerprint}\n      - {name: epoch, role: input, source: allocation_epoch}\n")
STRIDE_64 = ("slot_stride_bytes: 32", "slot_stride_bytes: 64")
# A breaking edit of one row (a violation column renamed): what the gates below must stop.
RENAME = ("{name: stored_token, carries: stored_token}", "{name: token_stored, carries: stored_token}")

# (id, edits, expected rows). Each is one kind of change; abi_version is left alone.
CASES = [
    ("field added", [ADD_EPOCH, STRIDE_64], [
        ("slot stride changed", "canary", "32 bytes", "64 bytes", False),
        ("field added", "canary.epoch", "-", "offset 32, role input", True),
        ("message text changed", "messages.canary_stride",
         "canary_buf slot stride must hold at least 4 int64 fields, got {n}",
         "canary_buf slot stride must hold at least 5 int64 fields, got {n}", False)]),
    ("field moved", [("      - {name: prev_hash, role: chain_link}\n      - {name: real_kv_hash, role: kv_fingerprint}\n",
                      "      - {name: real_kv_hash, role: kv_fingerprint}\n      - {name: prev_hash, role: chain_link}\n")], [
        ("field moved", "canary.prev_hash", "offset 16", "offset 24", True),
        ("field moved", "canary.real_kv_hash", "offset 24", "offset 16", True)]),
    ("field renamed", [RENAME], [
        ("field renamed", "violation.stored_token", "stored_token", "token_stored", True)]),
    # The default allocation stride: kernels take each buffer's own stride, so old buffers keep working.
    ("stride change", [STRIDE_64], [("slot stride changed", "canary", "32 bytes", "64 bytes", False)]),
    ("chain fold change", [("fold: [token, position]", "fold: [position, token]")], [
        ("chain fold changed (every stored hash changes)", "canary.chain.fold", "token, position", "position, token", True)]),
    ("anchor change", [("value: 0xC0FFEE1234567890", "value: 0xC0FFEE1234567891")], [
        ("chain anchor changed (HEAD changes)", "canary.chain.anchor",
         "CANARY_CHAIN_ANCHOR, HEAD 0xDE7FAE23A9A1B716", pytest.approx, True),
        ("constant changed", "CANARY_CHAIN_ANCHOR", "u64 0xC0FFEE1234567890", "u64 0xC0FFEE1234567891", True)]),
    ("flag bit renumbered", [("SLOT_OUT_OF_RANGE: 64", "SLOT_OUT_OF_RANGE: 128")], [
        ("flag bit renumbered", "FailReason.SLOT_OUT_OF_RANGE", "64", "128", True)]),
    ("flag bit reused", [("    SLOT_OUT_OF_RANGE: 64\n", "    SLOT_OUT_OF_RANGE: 128\n    VERIFY_EPOCH_MISMATCH: {value: 64, kind: verify}\n")], [
        ("flag bit renumbered", "FailReason.SLOT_OUT_OF_RANGE", "64", "128", True),
        ("flag bit reused", "FailReason.VERIFY_EPOCH_MISMATCH", "64 was SLOT_OUT_OF_RANGE", "64", True)]),
    ("flag bit added", [("    SLOT_OUT_OF_RANGE: 64\n", "    SLOT_OUT_OF_RANGE: 64\n    VERIFY_EPOCH_MISMATCH: {value: 128, kind: verify}\n")], [
        ("flag bit added", "FailReason.VERIFY_EPOCH_MISMATCH", "-", "128", False)]),
    ("enum value change", [("{NONE: 0, PARTIAL: 1, ALL: 2}", "{NONE: 0, PARTIAL: 2, ALL: 1}")], [
        ("enum value renumbered", "RealKvHashMode.PARTIAL", "1", "2", True),
        ("enum value renumbered", "RealKvHashMode.ALL", "2", "1", True)]),
    ("constant change", [("MAX_REAL_KV_SOURCES: {type: i32, value: 4", "MAX_REAL_KV_SOURCES: {type: i32, value: 8")], [
        ("constant changed", "MAX_REAL_KV_SOURCES", "i32 4", "i32 8", True),
        ("message text changed", "messages.real_kv_source_count",
         "at most 4 RealKvSource entries supported by the CUDA ABI, got {n}",
         "at most 8 RealKvSource entries supported by the CUDA ABI, got {n}", False)]),
    ("constant added", [("constants:\n", "constants:\n  EXTRA_LIMIT: {type: i32, value: 3}\n")], [
        ("constant added", "EXTRA_LIMIT", "-", "i32 3", False)]),
    ("kernel launch change", [("launch: {shape: persistent, threads: 256, blocks_per_sm: 8}",
                               "launch: {shape: fixed_grid, threads: 512, blocks: 64}")], [
        ("kernel launch changed", "canary_verify", "persistent, 256 threads, 8 blocks/SM, warp reduction",
         "fixed_grid, 512 threads, 64 blocks, warp reduction", False)]),
    ("write launch shape", [("launch: {shape: block_per_request, threads: 256}",
                             "launch: {shape: per_request, threads: 128}")], [
        ("kernel launch changed", "canary_write", "block_per_request, 256 threads", "per_request, 128 threads", False)]),
    ("kernel renamed", [("- name: canary_write\n", "- name: canary_store\n")], [
        ("kernel renamed (entry points change)", "write kernel", "canary_write", "canary_store", True)]),
    ("message text change", [('"{name} must be contiguous"', '"{name} must be a contiguous tensor"')], [
        ("message text changed", "messages.not_contiguous", "{name} must be contiguous",
         "{name} must be a contiguous tensor", False)]),
    ("launch tag moved", [("SWEEP_K_SWA: {value: 10, phase: sweep, half: k, group: swa}",
                           "SWEEP_K_SWA: {value: 10, phase: sweep, half: v, group: swa}"),
                          ("SWEEP_V_SWA: {value: 11, phase: sweep, half: v, group: swa}",
                           "SWEEP_V_SWA: {value: 11, phase: sweep, half: k, group: swa}")], [
        ("launch tag moved to another launch", "CanaryLaunchTag.SWEEP_K_SWA", "sweep/k/swa", "sweep/v/swa", True),
        ("launch tag moved to another launch", "CanaryLaunchTag.SWEEP_V_SWA", "sweep/v/swa", "sweep/k/swa", True)]),
    ("launch group added", [("  SWEEP_V_SWA: {value: 11, phase: sweep, half: v, group: swa}\n",
                             "  SWEEP_V_SWA: {value: 11, phase: sweep, half: v, group: swa}\n" + "".join(
                                 f"  {p.upper()}_{h.upper()}_MLA: {{value: {12 + i}, phase: {p}, half: {h}, group: mla}}\n"
                                 for i, (p, h) in enumerate((p, h) for p in ("head", "tail", "sweep") for h in "kv")))],
     [("enum value added", f"CanaryLaunchTag.{p.upper()}_{h.upper()}_MLA", "-", str(12 + i), False)
      for i, (p, h) in enumerate((p, h) for p in ("head", "tail", "sweep") for h in "kv")]),
    ("input field verify change", [ADD_EPOCH, STRIDE_64], None),  # base for the next case, see below
]


@pytest.mark.parametrize("case_id, edits, want", [c for c in CASES if c[2] is not None], ids=[c[0] for c in CASES if c[2]])
def test_change_is_found_and_classified(case_id, edits, want):
    got = rows(edit(*edits))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w[3] is pytest.approx:  # a value computed by splitmix64: only its shape is fixed here
            assert g[:3] == w[:3] and g[3].startswith("CANARY_CHAIN_ANCHOR, HEAD 0x") and g[4] == w[4]
        else:
            assert g == w


def test_input_field_source_change_is_breaking():
    old = edit(ADD_EPOCH, STRIDE_64)
    new = edit(("{name: epoch, role: input, source: allocation_epoch}", "{name: epoch, role: input, source: caller_table}"),
               text=old)
    assert rows(new, old) == [("input field source changed", "canary.epoch", "allocation_epoch", "caller_table", True)]


def test_field_removed():
    old = edit(ADD_EPOCH, STRIDE_64)
    assert rows(edit(STRIDE_64), old) == [
        ("field removed", "canary.epoch", "offset 32, role input", "-", True),
        ("message text changed", "messages.canary_stride",
         "canary_buf slot stride must hold at least 5 int64 fields, got {n}",
         "canary_buf slot stride must hold at least 4 int64 fields, got {n}", False)]


def test_input_field_verify_change():
    old = edit(ADD_EPOCH, STRIDE_64)
    new = edit(("{name: epoch, role: input, source: allocation_epoch}",
                "{name: epoch, role: input, source: allocation_epoch, verify: {expected: per_slot, fail_reason: VERIFY_EPOCH_MISMATCH}}"),
               ("    SLOT_OUT_OF_RANGE: 64\n", "    SLOT_OUT_OF_RANGE: 64\n    VERIFY_EPOCH_MISMATCH: {value: 128, kind: verify}\n"), text=old)
    assert rows(new, old) == [
        ("input field verify changed", "canary.epoch", "not verified", "per_slot → VERIFY_EPOCH_MISMATCH", True),
        ("flag bit added", "FailReason.VERIFY_EPOCH_MISMATCH", "-", "128", False),
    ]


def test_abi_version_change_alone_is_compatible():
    assert rows(edit(("abi_version: 1", "abi_version: 2"))) == [("abi_version changed", "abi_version", "1", "2", False)]


def test_no_change():
    report = diff_schemas(load_schema_text(BASE), load_schema_text(BASE))
    assert report.changes == () and report.exit_status == 0
    assert "No semantic change." in format_markdown(report)


def test_exit_status_gates_breaking_changes_on_an_abi_bump():
    old = load_schema_text(BASE)
    breaking = load_schema_text(edit(RENAME))
    bumped = load_schema_text(edit(RENAME, ("abi_version: 1", "abi_version: 2")))
    compatible = load_schema_text(edit(('"{name} must be contiguous"', '"{name} is not contiguous"')))
    assert diff_schemas(old, breaking).exit_status == 2
    assert diff_schemas(old, bumped).exit_status == 0
    assert diff_schemas(old, compatible).exit_status == 0
    assert diff_schemas(old, load_schema_text(edit(STRIDE_64))).exit_status == 0


def test_markdown_table(tmp_path):
    report = diff_schemas(load_schema_text(BASE), load_schema_text(edit(RENAME)), "HEAD~1:kernels.yaml", "kernels.yaml")
    assert format_markdown(report) == (
        "### kv-canary schema diff: `HEAD~1:kernels.yaml` → `kernels.yaml`\n"
        "\n"
        "| verdict | change | what | old | new |\n"
        "|---|---|---|---|---|\n"
        "| **BREAKING** | field renamed | `violation.stored_token` | stored_token | token_stored |\n"
        "\n"
        "**1 breaking change(s) but abi_version is still 1: bump `abi_version` in kernels.yaml (to 2) "
        "and run `make generate`.**\n")


# -- the CLI, with files and git revisions ---------------------------------------------------
def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def git_repo(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "kernels.yaml").write_text(BASE, encoding="utf-8")
    git(repo, "add", "kernels.yaml")
    git(repo, "commit", "-q", "-m", "base")
    monkeypatch.chdir(repo)
    return repo


def test_cli_diff_against_a_git_revision(git_repo, capsys):
    (git_repo / "kernels.yaml").write_text(edit(RENAME))
    assert main(["diff", "HEAD"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("### kv-canary schema diff: `HEAD:kernels.yaml` → `kernels.yaml`\n")
    assert "| **BREAKING** | field renamed | `violation.stored_token` | stored_token | token_stored |" in out
    (git_repo / "kernels.yaml").write_text(edit(RENAME, ("abi_version: 1", "abi_version: 2")))
    assert main(["diff", "HEAD"]) == 0
    assert "abi_version bumped 1 → 2" in capsys.readouterr().out


def test_cli_diff_between_two_revisions(git_repo, capsys):
    (git_repo / "kernels.yaml").write_text(edit(("SLOT_OUT_OF_RANGE: 64", "SLOT_OUT_OF_RANGE: 128")))
    git(git_repo, "commit", "-q", "-am", "renumber")
    assert main(["diff", "HEAD~1", "HEAD:kernels.yaml"]) == 2
    assert "| **BREAKING** | flag bit renumbered | `FailReason.SLOT_OUT_OF_RANGE` | 64 | 128 |" in capsys.readouterr().out


def test_cli_diff_missing_base(git_repo, capsys):
    """A first commit has no parent: that base is tolerated, but only with --missing-base-ok."""
    assert main(["diff", "HEAD~1"]) == 1
    assert capsys.readouterr().err == ("kv-canary diff: git revision 'HEAD~1' does not exist: HEAD is the first "
                                       "commit (it has no parent)\n")
    assert main(["diff", "--missing-base-ok", "HEAD~1"]) == 0
    out = capsys.readouterr().out
    assert "nothing to compare" in out and "HEAD is the first commit" in out


@pytest.mark.parametrize("rev", ["origin/mian", "mian", "deadbeef", "v9.9"])
def test_cli_diff_mistyped_base_fails_even_with_missing_base_ok(git_repo, capsys, rev):
    git(git_repo, "commit", "-q", "--allow-empty", "-m", "second")  # a full clone where HEAD~1 exists
    assert main(["diff", "--missing-base-ok", rev]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"kv-canary diff: git revision '{rev}' does not exist: no such branch, tag or commit "
                            f"(check the spelling; `git branch -a` lists the branches)\n")
    assert main(["diff", "--missing-base-ok", "HEAD~1"]) == 0  # the real base is compared
    assert "No semantic change." in capsys.readouterr().out


def test_cli_diff_mistyped_base_fails_on_a_first_commit_too(git_repo, capsys):
    assert main(["diff", "--missing-base-ok", "origin/mian"]) == 1
    assert "no such branch, tag or commit" in capsys.readouterr().err


def test_cli_diff_history_shorter_than_asked_fails_in_a_full_clone(git_repo, capsys):
    git(git_repo, "commit", "-q", "--allow-empty", "-m", "second")
    assert main(["diff", "--missing-base-ok", "HEAD~2"]) == 1
    assert capsys.readouterr().err == ("kv-canary diff: git revision 'HEAD~2' does not exist: the history of HEAD "
                                       "is shorter than that\n")


def test_cli_diff_base_beyond_a_shallow_clone(git_repo, tmp_path, monkeypatch, capsys):
    (git_repo / "kernels.yaml").write_text(edit(STRIDE_64))
    git(git_repo, "commit", "-q", "-am", "second")
    old_id = subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=git_repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", git_repo.as_uri(), str(shallow))
    monkeypatch.chdir(shallow)
    for rev in ("HEAD~1", old_id):
        assert main(["diff", rev]) == 1
        assert "this is a shallow clone" in capsys.readouterr().err
        assert main(["diff", "--missing-base-ok", rev]) == 0
        out = capsys.readouterr().out
        assert "nothing to compare" in out and "this is a shallow clone" in out and "git fetch --unshallow" in out
    assert main(["diff", "--missing-base-ok", "origin/mian"]) == 1  # a typo is a typo, shallow or not
    assert "no such branch, tag or commit" in capsys.readouterr().err


def test_cli_diff_base_path_that_exists_nowhere_fails(git_repo, capsys):
    assert main(["diff", "--missing-base-ok", "HEAD:kernel.yaml"]) == 1
    assert capsys.readouterr().err == ("kv-canary diff: git revision 'HEAD' has no kernel.yaml (and there is no "
                                       "kernel.yaml in the working tree either)\n")


# -- `make abi-check`, the CI gate, in a scratch repository --------------------------------------
def make_abi_check(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """The Makefile's abi-check recipe with this interpreter; `-o` keeps make from (re)building .venv."""
    shutil.copy(ROOT / "Makefile", repo / "Makefile")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", f"PY={sys.executable}",
                           "abi-check", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_abi_check(git_repo):
    first = make_abi_check(git_repo)  # a single-commit repository: HEAD~1 does not exist
    assert first.returncode == 0, first.stderr
    assert "HEAD is the first commit" in first.stdout
    typo = make_abi_check(git_repo, "BASE=origin/mian")
    assert typo.returncode != 0
    assert "git revision 'origin/mian' does not exist" in typo.stderr
    (git_repo / "kernels.yaml").write_text(edit(RENAME))
    git(git_repo, "commit", "-q", "-am", "breaking, no bump")  # a full clone: HEAD~1 is compared
    breaking = make_abi_check(git_repo)
    assert breaking.returncode != 0
    assert "| **BREAKING** | field renamed | `violation.stored_token` | stored_token | token_stored |" in breaking.stdout
    (git_repo / "kernels.yaml").write_text(edit(RENAME, ("abi_version: 1", "abi_version: 2")))
    git(git_repo, "commit", "-q", "-am", "bump")
    assert make_abi_check(git_repo, "BASE=HEAD~2").returncode == 0


def test_cli_diff_base_without_a_schema(git_repo, capsys):
    (git_repo / "other.txt").write_text("x\n")
    git(git_repo, "rm", "-q", "kernels.yaml")
    git(git_repo, "add", "other.txt")
    git(git_repo, "commit", "-q", "-m", "no schema")
    shutil.copy(ROOT / "kernels.yaml", git_repo / "kernels.yaml")
    assert main(["diff", "--missing-base-ok", "HEAD"]) == 0
    assert "git revision 'HEAD' has no kernels.yaml" in capsys.readouterr().out


def test_cli_diff_of_files_reports_schema_errors(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    bad = tmp_path / "bad.yaml"
    good.write_text(BASE)
    bad.write_text(edit(("slot_stride_bytes: 32", "slot_stride_bytes: 36")))
    assert main(["diff", str(good), str(bad)]) == 1
    assert "error: slot_stride_bytes must be a positive multiple of 8, got 36" in capsys.readouterr().err


# -- docs/schema-change.md shows real output ---------------------------------------------------
# The isolation namespace of kv_canary/schemas/isolation.yaml, as an edit of kernels.yaml.
SCHEMA_CHANGE_EDIT = (
    ("slot_stride_bytes: 32", "slot_stride_bytes: 40"),
    ("      - {name: real_kv_hash, role: kv_fingerprint}\n",
     "      - {name: real_kv_hash, role: kv_fingerprint}\n"
     "      - {name: cache_namespace, role: input, source: request_input,\n"
     "         verify: {expected: per_request, fail_reason: VERIFY_NAMESPACE_MISMATCH},\n"
     "         doc: \"64-bit namespace of the writing request (adapter, cache salt, media); checked against each reader's\"}\n"),
    ("fold: [token, position]}", "fold: [token, position, cache_namespace]}"),
    ("    SLOT_OUT_OF_RANGE: 64\n", "    SLOT_OUT_OF_RANGE: 64\n    VERIFY_NAMESPACE_MISMATCH: {value: 128, kind: verify}\n"),
)


def _fenced(doc: str, lang: str) -> list[str]:
    blocks = doc.split(f"```{lang}\n")[1:]
    return [b.split("```", 1)[0] for b in blocks]


def test_schema_change_doc_is_real():
    from kv_canary.codegen.render import render_all, split_header

    doc = (ROOT / "docs" / "schema-change.md").read_text(encoding="utf-8")
    new_text = edit(*SCHEMA_CHANGE_EDIT)
    bumped_text = edit(("abi_version: 1", "abi_version: 2"), text=new_text)
    # The shipped example is this change (its own header comment and abi_version aside).
    example = (ROOT / "kv_canary" / "schemas" / "isolation.yaml").read_text(encoding="utf-8")
    assert example[example.index("format: 1"):] == bumped_text[bumped_text.index("format: 1"):]
    # The schema edit shown is the one replayed here.
    schema_diff, layout_diff, kernels_diff = _fenced(doc, "diff")[:3]
    for line in schema_diff.splitlines():
        if line.startswith("+"):
            assert line[1:] in new_text.splitlines(), line
        elif line.startswith("-"):
            assert line[1:] in BASE.splitlines() and line[1:] not in new_text.splitlines(), line
    # Both ABI reports, verbatim.
    old = load_schema_text(BASE)
    for text in (new_text, bumped_text):
        report = format_markdown(diff_schemas(old, load_schema_text(text), "HEAD:kernels.yaml", "kernels.yaml"))
        assert report in doc
    rendered = {name: {f.path: split_header(f.text)[1].splitlines() for f in render_all(load_schema_text(t), t)}
                for name, t in (("before", BASE), ("after", bumped_text))}

    def check(diff: str, before: list, after: list) -> None:
        for line in diff.splitlines():
            if line.startswith(("---", "+++", "@@")):
                continue
            if line.startswith("-"):
                assert line[1:] in before and line[1:] not in after, line
            elif line.startswith("+"):
                assert line[1:] in after and line[1:] not in before, line
            elif line.startswith(" "):
                assert line[1:] in before and line[1:] in after, line
    # The LAYOUT.md lines shown are in the old (-) and new (+) LAYOUT.md bodies.
    check(layout_diff, rendered["before"]["LAYOUT.md"], rendered["after"]["LAYOUT.md"])
    # The kernel excerpts: each file's lines in its old and new text.
    for part in kernels_diff.split("--- a/generated/")[1:]:
        path = part.split("\n", 1)[0]
        check(part.split("\n", 2)[2], rendered["before"][path], rendered["after"][path])
    assert kernels_diff.count("--- a/generated/") >= 4
