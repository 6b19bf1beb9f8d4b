"""The schema-change workflow in an engine's repository (issue 23), in process: the JSON shapes of
`diff` and `check`, kv-canary.yaml, `init`, `abi-check` against a merge base, and `pr-report` (the
GitHub Action's script) with the GITHUB_* files it reads and writes. The wheel, the real pre-commit
and the action's shell step are exercised in test_wheel_install.py and test_precommit_hooks.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kv_canary.generated
import pytest
import yaml
from kv_canary.codegen import diff as diff_module
from kv_canary.codegen.diff import KINDS, Change, DiffReport, diff_schemas, format_json
from kv_canary.codegen.load import load_schema_text
from support.trees import files_changed_by
from test_diff import BASE, CASES, RENAME, edit

from kv_canary.cli import main as kv_main

# Files of one generated tree: its __init__.py and every file whose hash it lists.
TREE_FILES = 1 + len(kv_canary.generated.FILE_SHA256)

ROOT = Path(__file__).resolve().parents[2]
DIFF_SHAPE = json.loads((ROOT / "codegen" / "diff.schema.json").read_text(encoding="utf-8"))
CHECK_SHAPE = json.loads((ROOT / "codegen" / "check.schema.json").read_text(encoding="utf-8"))
REPORT_SHAPE = json.loads((ROOT / "workflow" / "report.schema.json").read_text(encoding="utf-8"))


def validate(doc: dict, shape: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(shape)
    jsonschema.Draft202012Validator(shape).validate(doc)


# -- machine-readable output --------------------------------------------------------------------
def test_the_documented_kinds_are_the_kinds_the_diff_knows():
    assert DIFF_SHAPE["$defs"]["change"]["properties"]["kind"]["enum"] == list(KINDS)
    # Every kind the diff's code can emit has a `why`: each `c.add(` names a key of KINDS (or builds
    # one from flag/enum, bit/value), and _Collector.add refuses any other.
    source = Path(diff_module.__file__).read_text(encoding="utf-8")
    literal = {k for k in KINDS if f'"{k}"' in source}
    built = {k for k in KINDS if k.split(" ", 1)[0] in ("flag", "enum")}
    assert literal | built == set(KINDS)


def test_diff_json_of_every_real_change_validates():
    seen = set()
    for _, edits, want in CASES:
        if want is None:
            continue
        report = diff_schemas(load_schema_text(BASE), load_schema_text(edit(*edits)), "old.yaml", "new.yaml")
        doc = json.loads(format_json(report))
        validate(doc, DIFF_SHAPE)
        assert [(c["kind"], c["path"], c["breaking"]) for c in doc["changes"]] == [(w[0], w[1], w[4]) for w in want]
        assert doc["exit_status"] == report.exit_status and doc["verdict"] == report.verdict
        seen |= {c["kind"] for c in doc["changes"]}
    assert len(seen) >= 15


def test_diff_json_of_every_kind_validates():
    """One row of every kind (including those no valid schema pair can produce today, e.g. a word type:
    the shape still has to hold for them)."""
    rows = tuple(Change(kind, f"x.{i}", "-" if i % 3 == 0 else "a", "-" if i % 3 == 1 else "b", i % 2 == 0)
                 for i, kind in enumerate(KINDS))
    for old_abi, new_abi in ((1, 1), (1, 2)):
        report = DiffReport("HEAD:canary.yaml", "canary.yaml", old_abi, new_abi, rows)
        doc = json.loads(format_json(report))
        validate(doc, DIFF_SHAPE)
        assert doc["abi_version_bumped"] is (new_abi > old_abi)
        assert doc["verdict"] == ("breaking" if new_abi > old_abi else "breaking-without-bump")
        assert [c["why"] for c in doc["changes"]] == [KINDS[k] for k in KINDS]
        assert doc["changes"][0]["old"] is None and doc["changes"][1]["new"] is None
    validate(json.loads(format_json(DiffReport("a", "b", 1, 1, ()))), DIFF_SHAPE)


def test_a_wrong_document_does_not_validate():
    doc = json.loads(format_json(diff_schemas(load_schema_text(BASE), load_schema_text(edit(RENAME)))))
    validate(doc, DIFF_SHAPE)
    for broken in ({**doc, "verdict": "fine"}, {**doc, "changes": [{**doc["changes"][0], "kind": "field exploded"}]},
                   {k: v for k, v in doc.items() if k != "abi_version_bumped"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, DIFF_SHAPE)


@pytest.mark.parametrize("fmt", ["markdown", "text", "json"])
def test_diff_formats_keep_the_exit_status(tmp_path, capsys, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.yaml").write_text(BASE)
    (tmp_path / "new.yaml").write_text(edit(RENAME))
    assert kv_main(["diff", "old.yaml", "new.yaml", "--format", fmt]) == 2
    out = capsys.readouterr().out
    if fmt == "json":
        doc = json.loads(out)
        validate(doc, DIFF_SHAPE)
        assert doc["summary"].endswith("bump `abi_version` in new.yaml (to 2) and run "
                                       "`kv-canary generate --schema new.yaml --out generated`.")
    elif fmt == "text":
        assert "  BREAKING    field renamed: violation.stored_token: stored_token -> token_stored" in out
    else:
        assert "| **BREAKING** | field renamed | `violation.stored_token` | stored_token | token_stored |" in out
    (tmp_path / "new.yaml").write_text(edit(RENAME, ("abi_version: 1", "abi_version: 2")))
    assert kv_main(["diff", "old.yaml", "new.yaml", "--format", fmt]) == 0


# -- an engine repository: init, config, check --------------------------------------------------
def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def engine_template(tmp_path_factory):
    """An engine repository after `kv-canary init --package myengine/_canary`, committed on main, on a
    branch `feature` (made once; each test gets a copy)."""
    repo = tmp_path_factory.mktemp("engine") / "engine"
    (repo / "myengine").mkdir(parents=True)
    (repo / "myengine" / "__init__.py").write_text("")
    git(repo, "init", "-q", "-b", "main")
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        assert kv_main(["init", "--package", "myengine/_canary"]) == 0
    finally:
        os.chdir(cwd)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "kv-canary init")
    git(repo, "checkout", "-q", "-b", "feature")
    return repo


@pytest.fixture
def engine(engine_template, tmp_path, monkeypatch, capsys):
    repo = tmp_path / "engine"
    shutil.copytree(engine_template, repo, symlinks=True)
    monkeypatch.chdir(repo)
    capsys.readouterr()
    return repo


def test_init_writes_schema_config_tree_and_snippets(engine):
    config = yaml.safe_load((engine / "kv-canary.yaml").read_text())
    assert config == {"kv-canary": 1, "trees": [{"schema": "canary.yaml", "out": "myengine/_canary"}]}
    assert (engine / "myengine" / "_canary" / "layout.py").is_file()
    header = (engine / "myengine" / "_canary" / "layout.py").read_text().splitlines()[0]
    assert header == ("# Generated by kv-canary codegen from canary.yaml. DO NOT EDIT: edit canary.yaml, then run "
                      "`kv-canary generate`.")
    schema = (engine / "canary.yaml").read_text()
    assert "make generate" not in schema and "kv-canary generate" in schema
    assert load_schema_text(schema).canary.stride_bytes == load_schema_text(BASE).canary.stride_bytes
    hooks = yaml.safe_load((engine / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    manifest = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == [h["id"] for h in manifest]
    workflow = yaml.safe_load((engine / ".github" / "workflows" / "kv-canary.yml").read_text())
    assert workflow == yaml.safe_load((ROOT / "examples" / "kv-canary-workflow.yml").read_text())
    # The generator's lock file is ignored, so committing the package (init's advice) leaves it out.
    assert "/myengine/_canary/.kv-canary-generate.lock" in (engine / ".gitignore").read_text().splitlines()
    assert (engine / "myengine" / "_canary" / ".kv-canary-generate.lock").exists()
    assert ".kv-canary-generate.lock" not in git(engine, "ls-files")   # the fixture committed with `add -A`


def test_init_keeps_an_existing_gitignore_and_pins_the_rev_it_is_given(engine, capsys):
    (engine / ".gitignore").write_text("*.pyc")
    assert kv_main(["init", "--force", "--package", "myengine/_canary", "--rev", "0123abc"]) == 0
    out = capsys.readouterr().out
    assert (engine / ".gitignore").read_text() == ("*.pyc\n# kv-canary: the generator's lock file (kv-canary generate "
                                                    "takes it while it writes)\n/myengine/_canary/.kv-canary-generate.lock\n")
    assert "git ls-remote https://github.com/kv-canary/kv-canary 0123abc" in out
    assert yaml.safe_load((engine / ".pre-commit-config.yaml").read_text())["repos"][0]["rev"] == "0123abc"
    steps = yaml.safe_load((engine / ".github" / "workflows" / "kv-canary.yml").read_text())["jobs"]["abi"]["steps"]
    assert steps[1]["uses"] == "kv-canary/kv-canary@0123abc"
    assert kv_main(["init", "--force", "--package", "myengine/_canary", "--rev", "0123abc"]) == 0
    assert (engine / ".gitignore").read_text().count(".kv-canary-generate.lock") == 1


def test_init_refuses_to_overwrite_and_takes_an_example(engine, capsys):
    assert kv_main(["init", "--package", "myengine/_canary"]) == 1
    assert "canary.yaml exists (--force overwrites it)" in capsys.readouterr().err
    assert kv_main(["init", "--package", "my-engine/x"]) == 2
    assert "--package must be a path of Python identifiers" in capsys.readouterr().err
    assert kv_main(["init", "--force", "--from", "owner_epoch", "--package", "myengine/_canary"]) == 0
    out = capsys.readouterr().out
    assert ".pre-commit-config.yaml" in out and f"myengine/_canary: {TREE_FILES} files" in out
    assert [f.name for f in load_schema_text((engine / "canary.yaml").read_text()).canary.fields][-2:] == \
        ["request_id", "epoch"]
    # Where the pre-commit config and the workflow exist, init leaves them alone and prints what to add.
    (engine / "canary.yaml").unlink()
    (engine / "kv-canary.yaml").unlink()
    (engine / ".pre-commit-config.yaml").write_text("repos: []\n")
    assert kv_main(["init", "--package", "myengine/_canary"]) == 0
    out = capsys.readouterr().out
    assert ".pre-commit-config.yaml exists; add this to it:\n  # kv-canary" in out and "      - id: kv-canary-abi\n" in out
    assert ".github/workflows/kv-canary.yml exists and is left as it is; kv-canary's workflow (for another file in " \
           ".github/workflows/):" in out
    assert (engine / ".pre-commit-config.yaml").read_text() == "repos: []\n"


def test_check_reads_the_config_and_names_the_users_files(engine, capsys):
    assert kv_main(["check"]) == 0
    assert capsys.readouterr().out == f"myengine/_canary is up to date with canary.yaml ({TREE_FILES} files)\n"
    layout = engine / "myengine" / "_canary" / "layout.py"
    layout.write_text(layout.read_text() + "# edit\n")
    (engine / "myengine" / "_canary" / "mine.py").write_text("x = 1\n")
    assert kv_main(["check", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert ("myengine/_canary/layout.py: hand-edited: its text no longer matches the sha256 that "
            "myengine/_canary/__init__.py lists for it\n"
            "    fix: make the change in canary.yaml, then run `kv-canary generate` (it overwrites this file)\n") in err
    assert "keep your own files outside it" in err
    for word in ("codegen/", "python -m codegen", "make generate", "kernels.yaml"):
        assert word not in err, word
    assert kv_main(["check", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    validate(doc, CHECK_SHAPE)
    assert doc["trees"][0]["regenerate"] == "kv-canary generate"
    assert [(d["path"], d["kind"]) for d in doc["trees"][0]["drifts"]] == [
        ("myengine/_canary/layout.py", "hand-edited"), ("myengine/_canary/mine.py", "extra")]
    # From a subdirectory the config is found and the paths are shown from there.
    monkeypatch_dir = engine / "myengine"
    os.chdir(monkeypatch_dir)
    assert kv_main(["generate"]) == 0
    assert f"_canary: {TREE_FILES} files, 1 written" in capsys.readouterr().out
    assert kv_main(["check", "--format", "json"]) == 1  # mine.py is still there
    validate(json.loads(capsys.readouterr().out), CHECK_SHAPE)


def test_several_trees_and_tree_arguments(engine, capsys):
    shutil.copy(ROOT / "kv_canary" / "schemas" / "wide_stride.yaml", engine / "wide.yaml")
    (engine / "kv-canary.yaml").write_text((engine / "kv-canary.yaml").read_text() +
                                           "  - schema: wide.yaml\n    out: myengine/_wide\n")
    assert kv_main(["check", "--quiet"]) == 1
    assert "run `kv-canary generate` and commit myengine/_wide/" in capsys.readouterr().err
    assert kv_main(["generate"]) == 0
    capsys.readouterr()
    assert kv_main(["check", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate(doc, CHECK_SHAPE)
    assert [(t["schema"], t["out"], t["up_to_date"]) for t in doc["trees"]] == [
        ("canary.yaml", "myengine/_canary", True), ("wide.yaml", "myengine/_wide", True)]
    assert kv_main(["check", "--tree", "wide.yaml=elsewhere"]) == 1
    assert "run `kv-canary generate --schema wide.yaml --out elsewhere`" in capsys.readouterr().err


def test_config_errors_have_their_line_and_column(engine, capsys):
    (engine / "kv-canary.yaml").write_text("kv-canary: 2\ntrees:\n  - schema: canary.yaml\n    ot: x\n")
    assert kv_main(["check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["kv-canary.yaml:1:12: error: kv-canary: config format must be 1, got '2' (written by a newer "
                   "kv-canary?)",
                   "kv-canary.yaml:3:5: error: a tree needs 'out'",
                   "kv-canary.yaml:4:5: error: unknown key 'ot' in a tree (did you mean 'out'?); allowed: schema, out",
                   "3 errors"]


def test_a_misspelled_config_key_gets_a_did_you_mean(engine, capsys):
    (engine / "kv-canary.yaml").write_text("kv-canary: 1\nbase-branch: main\ntrees:\n"
                                           "  - {schema: canary.yaml, out: myengine/_canary}\n")
    assert kv_main(["check"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "kv-canary.yaml:2:1: error: unknown key 'base-branch' in the kv-canary config (did you mean 'base_branch'?); "
        "allowed: kv-canary, trees, base_branch")


def test_check_and_describe_where_there_is_no_schema_say_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert kv_main(["check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kernels.yaml:1:1: error: cannot read schema kernels.yaml: No such file or directory; without --schema")
    assert "`kv-canary init` sets up a repository" in err and "--config" in err
    assert kv_main(["describe"]) == 0
    captured = capsys.readouterr()
    assert "describing kv-canary's built-in schema" in captured.err and "# Canary ABI layout" in captured.out


def test_describe_in_a_configured_repository_describes_its_schema(engine, capsys):
    (engine / "canary.yaml").write_text((engine / "canary.yaml").read_text().replace("abi_version: 1", "abi_version: 7"))
    assert kv_main(["describe"]) == 0
    assert "abi_version **7**" in capsys.readouterr().out


# -- abi-check (the pre-commit hook) and pr-report (the action) against the merge base ------------
def _break(engine: Path, bump: bool = False, commit: bool = True) -> None:
    schema = engine / "canary.yaml"
    text = edit(RENAME, text=schema.read_text())
    if bump:
        text = text.replace("abi_version: 1", "abi_version: 2")
    schema.write_text(text)
    assert kv_main(["generate"]) == 0
    if commit:
        git(engine, "commit", "-q", "-am", "stride 64")


def test_abi_check_compares_with_the_merge_base_of_the_default_branch(engine, capsys):
    assert kv_main(["abi-check"]) == 0
    assert "No semantic change." in capsys.readouterr().out
    _break(engine)
    git(engine, "checkout", "-q", "main")
    (engine / "README").write_text("main moves on\n")
    git(engine, "add", "README")
    git(engine, "commit", "-q", "-m", "main moves")
    git(engine, "checkout", "-q", "feature")
    capsys.readouterr()
    assert kv_main(["abi-check"]) == 2
    out = capsys.readouterr().out
    base = git(engine, "merge-base", "HEAD", "main").strip()[:12]
    assert out.startswith(f"kv-canary schema diff: {base}:canary.yaml -> canary.yaml\n")
    assert out.endswith("bump `abi_version` in canary.yaml (to 2) and run `kv-canary generate`.\n")
    assert kv_main(["abi-check", "--base", "HEAD"]) == 0  # the commit itself changed nothing since
    capsys.readouterr()
    assert kv_main(["abi-check", "--base", "mian"]) == 1
    assert "git revision 'mian' does not exist" in capsys.readouterr().err


def test_abi_check_and_pr_report_speak_json(engine, capsys, tmp_path, monkeypatch):
    """--format json: one versioned object (workflow/report.schema.json) with the version that ran,
    the base, each tree's verdict and its diff in the diff's own JSON shape."""
    from kv_canary.codegen.version import kv_canary_version
    _break(engine)
    capsys.readouterr()
    assert kv_main(["abi-check", "--format", "json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    validate(doc, REPORT_SHAPE)
    assert (doc["command"], doc["verdict"], doc["exit_status"], doc["error"]) == \
        ("abi-check", "breaking-without-bump", 2, None)
    assert doc["kv_canary_version"] == kv_canary_version()
    assert doc["base"]["revision"] == git(engine, "merge-base", "HEAD", "main").strip()
    [tree] = doc["trees"]
    assert (tree["schema"], tree["out"], tree["up_to_date"]) == ("canary.yaml", "myengine/_canary", None)
    validate(tree["diff"], DIFF_SHAPE)
    assert tree["diff"]["changes"][0]["path"] == "violation.stored_token"
    assert kv_main(["abi-check", "--format", "json", "--base", "mian"]) == 1
    doc = json.loads(capsys.readouterr().out)
    validate(doc, REPORT_SHAPE)
    assert doc["verdict"] == "error" and "'mian' does not exist" in doc["error"] and doc["trees"] == []
    for key, value in pr_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    assert kv_main(["pr-report", "--format", "json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    validate(doc, REPORT_SHAPE)
    assert (doc["command"], doc["verdict"], doc["trees"][0]["up_to_date"]) == ("pr-report", "breaking-without-bump", True)
    assert (tmp_path / "runner" / "kv-canary-report.md").read_text().startswith("## kv-canary ABI report")


def test_version_is_printed_and_recorded(engine, capsys):
    from kv_canary.codegen.render import generator_sha256
    from kv_canary.codegen.version import CHECKOUT_VERSION, kv_canary_version
    with pytest.raises(SystemExit) as exc:
        kv_main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"kv-canary {kv_canary_version()} (generator {generator_sha256()[:12]})\n"
    assert CHECKOUT_VERSION == yaml.safe_load("\n".join(
        line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("version = ")
    ).replace(" = ", ": "))["version"]
    assert kv_main(["check", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate(doc, CHECK_SHAPE)
    assert (doc["version"], doc["kv_canary_version"]) == (2, kv_canary_version())


def test_abi_check_without_a_default_branch_passes_with_a_note(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "trunk")
    monkeypatch.chdir(repo)
    (repo / "kernels.yaml").write_text(BASE)
    assert kv_main(["abi-check"]) == 0
    assert "nothing to compare: no default branch found" in capsys.readouterr().out


def pr_env(tmp_path: Path, base_ref: str = "main") -> dict[str, str]:
    files = {"GITHUB_STEP_SUMMARY": tmp_path / "summary.md", "GITHUB_OUTPUT": tmp_path / "output"}
    for p in files.values():
        p.write_text("earlier step\n")
    (tmp_path / "runner").mkdir(exist_ok=True)
    return {**{k: str(v) for k, v in files.items()}, "RUNNER_TEMP": str(tmp_path / "runner"),
            "GITHUB_BASE_REF": base_ref, "GITHUB_EVENT_NAME": "pull_request"}


def outputs(path: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in Path(path).read_text().splitlines()[1:])


@pytest.mark.parametrize("change", ["compatible", "breaking", "bumped", "stale"])
def test_pr_report_writes_summary_comment_and_outputs(engine, tmp_path, monkeypatch, capsys, change):
    env = pr_env(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    schema = engine / "canary.yaml"
    if change == "compatible":
        schema.write_text(schema.read_text().replace('"{name} must be contiguous"', '"{name} is not contiguous"'))
        assert kv_main(["generate"]) == 0
    elif change == "stale":
        before = schema.read_text()
        schema.write_text(before.replace('"{name} must be contiguous"', '"{name} is not contiguous"'))
    else:
        _break(engine, bump=change == "bumped", commit=False)
    capsys.readouterr()
    status = kv_main(["pr-report"])
    assert status == {"compatible": 0, "breaking": 2, "bumped": 0, "stale": 1}[change]
    summary = Path(env["GITHUB_STEP_SUMMARY"]).read_text()
    assert summary.startswith("earlier step\n## kv-canary ABI report\n")  # appended, not overwritten
    out = outputs(env["GITHUB_OUTPUT"])
    comment = Path(out["report"]).read_text()
    assert Path(out["report"]).parent == Path(env["RUNNER_TEMP"])
    assert summary == "earlier step\n" + comment + "\n" and capsys.readouterr().out == comment
    base = git(engine, "merge-base", "HEAD", "main").strip()
    assert f"Base: `{base[:12]}` (the merge base of HEAD with main)." in comment
    assert out["exit-status"] == str(status)
    verdict = {"compatible": "compatible", "breaking": "breaking-without-bump", "bumped": "breaking",
               "stale": "stale"}[change]
    assert out["verdict"] == verdict and out["breaking"] == ("true" if change in ("breaking", "bumped") else "false")
    if change == "compatible":
        assert "| compatible | message text changed | `messages.not_contiguous` |" in comment
        assert "LAYOUT.md diff" not in comment or "~~~diff" in comment
    if change in ("breaking", "bumped"):
        assert "| **BREAKING** | field renamed | `violation.stored_token` | stored_token | token_stored |" in comment
        assert "<details><summary>LAYOUT.md diff</summary>" in comment
        assert "+| 3 | `token_stored` | stored_token |" in comment
    if change == "breaking":
        assert "**BREAKING ABI change without an abi_version bump**" in comment
        assert ("**1 breaking change(s) but abi_version is still 1: bump `abi_version` in canary.yaml (to 2) and run "
                "`kv-canary generate`.**") in comment
    if change == "stale":
        stale = files_changed_by(before, schema.read_text())
        assert 1 < stale < 13  # __init__.py and the files holding the message
        assert f"**Generated tree out of date: {stale} file(s).** Run `kv-canary generate` and commit " \
               f"`myengine/_canary/`." in comment


def test_pr_report_without_the_base_branch_in_the_clone_says_how_to_fetch_it(engine, tmp_path, monkeypatch, capsys):
    for k, v in pr_env(tmp_path, base_ref="release").items():
        monkeypatch.setenv(k, v)
    assert kv_main(["pr-report"]) == 1
    assert "base branch release is not in this clone (actions/checkout with `fetch-depth: 0`" in capsys.readouterr().err


# -- action.yml and the example workflow ----------------------------------------------------------
def lint_actions():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import lint_actions as module
    finally:
        sys.path.pop(0)
    return module


def test_action_metadata_is_well_formed_and_the_checker_can_fail(tmp_path):
    module = lint_actions()
    assert module.check_action(ROOT / "action.yml") == []
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    assert action["runs"]["using"] == "composite"
    assert any("kv-canary\" pr-report" in s.get("run", "") for s in action["runs"]["steps"])
    broken = dict(action, outputs={**action["outputs"], "x": {"description": "d", "value": "${{ steps.nope.outputs.y }}"}})
    broken["runs"] = {"using": "composite", "steps": [dict(action["runs"]["steps"][1], shell=None)] +
                      [{"run": "echo ${{ inputs.missing }}"}]}
    del broken["runs"]["steps"][0]["shell"]
    bad = tmp_path / "action.yml"
    bad.write_text(yaml.safe_dump(broken))
    problems = "\n".join(module.check_action(bad))
    assert "no step has id 'nope'" in problems and "needs `shell`" in problems and "inputs.missing" in problems
    workflow = yaml.safe_load(module.action_as_workflow(ROOT / "action.yml"))
    assert set(workflow["on"]["workflow_call"]["inputs"]) == set(action["inputs"])


def test_actionlint_passes_the_shipped_files_and_fails_a_broken_workflow(tmp_path):
    """`make lint`'s actionlint step: the action's steps and the example workflow pass; an undefined
    input in a workflow is actionlint's finding, reported with its location."""
    module = lint_actions()
    assert module.actionlint(), "actionlint is part of the dev extra (make setup)"
    assert module.main([]) == 0
    text = (ROOT / "examples" / "kv-canary-workflow.yml").read_text()
    bad = tmp_path / "broken-workflow.yml"
    # one more step at the end of the (only) job's steps
    bad.write_text(text.rstrip("\n") + "\n      - run: echo ${{ inputs.no_such_input }}\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_actions.py"), str(ROOT / "action.yml"), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "broken-workflow.yml:" in proc.stderr and "no_such_input" in proc.stderr, proc.stderr


def test_the_actions_report_step_runs_as_written(engine, tmp_path, monkeypatch):
    """The report step's shell line, run by bash with the step's env, against a kv-canary on PATH."""
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    step = next(s for s in action["runs"]["steps"] if s.get("id") == "report")
    venv_bin = tmp_path / "runner" / "kv-canary-venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "kv-canary").symlink_to(Path(sys.executable).parent / "kv-canary")
    _break(engine, commit=False)
    env = {**os.environ, **pr_env(tmp_path), "BASE": ""}
    proc = subprocess.run(["bash", "-c", step["run"]], cwd=engine, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert outputs(env["GITHUB_OUTPUT"])["verdict"] == "breaking-without-bump"
    env["BASE"] = "HEAD"  # the input `base`: compared with the branch's own HEAD the tree is the same change
    proc = subprocess.run(["bash", "-c", step["run"]], cwd=engine, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Base: `HEAD` (given as --base)." in proc.stdout


# -- docs/schema-change.md shows real output ------------------------------------------------------
def _doc() -> str:
    return (ROOT / "docs" / "schema-change.md").read_text(encoding="utf-8")


def test_the_documented_job_summary_is_what_pr_report_writes(engine, tmp_path, monkeypatch, capsys):
    import re

    from test_diff import SCHEMA_CHANGE_EDIT
    doc = _doc()
    shown = doc.split("<!-- job-summary:begin -->\n", 1)[1].split("<!-- job-summary:end -->", 1)[0]
    for k, v in pr_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    (engine / "canary.yaml").write_text(edit(*SCHEMA_CHANGE_EDIT, text=(engine / "canary.yaml").read_text()))
    assert kv_main(["generate"]) == 0
    capsys.readouterr()
    assert kv_main(["pr-report"]) == 2
    written = capsys.readouterr().out
    sha = re.compile(r"(?<=[`\- ])[0-9a-f]{12}(?=[`:])")  # the merge base's commit id
    assert sha.sub("SHA", written) == sha.sub("SHA", shown) and sha.sub("SHA", written) != written


def test_the_documented_json_is_what_diff_prints(engine, capsys):
    block = _doc().split("```json\n", 1)[1].split("```", 1)[0]
    documented = json.loads(block)
    validate(documented, DIFF_SHAPE)
    (engine / "canary.yaml").write_text(edit(RENAME, text=(engine / "canary.yaml").read_text()))
    assert kv_main(["diff", "main", "--format", "json"]) == 2
    assert json.loads(capsys.readouterr().out) == documented


def test_run_time_messages_about_an_engine_tree_name_its_command(engine):
    """The tree records what regenerates it; the runtime's messages about its tree use that."""
    import kv_canary
    from kv_canary.trees.sources import read_source
    tree = kv_canary.load_generated(engine / "myengine" / "_canary")
    assert tree.REGENERATE_COMMAND == "kv-canary generate"
    (engine / "myengine" / "_canary" / "cuda" / "canary_write.cu").unlink()
    with pytest.raises(ValueError, match=r"canary_write\.cu is missing .*; run `kv-canary generate`$"):
        read_source(tree, "cuda/canary_write.cu")
    assert kv_canary.generated.REGENERATE_COMMAND == "make generate"  # kv-canary's own checkout


def test_abi_check_and_pr_report_outside_git_say_so(tmp_path, monkeypatch, capsys):
    """Outside a git repository there is no base to compare with: both say why (not 'no default
    branch' or 'new schema'), and a named --base is an error."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_BASE_REF", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    (tmp_path / "kernels.yaml").write_text(BASE)
    assert kv_main(["generate"]) == 0
    capsys.readouterr()
    assert kv_main(["abi-check"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path} is not inside a git repository" in out and "no default branch" not in out
    assert kv_main(["abi-check", "--base", "HEAD~1"]) == 1
    assert f"--base HEAD~1: {tmp_path} is not inside a git repository" in capsys.readouterr().err
    assert kv_main(["pr-report", "--comment", str(tmp_path / "c.md")]) == 0
    assert f"No base revision: {tmp_path} is not inside a git repository" in capsys.readouterr().out
