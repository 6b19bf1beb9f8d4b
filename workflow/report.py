"""The schema-change gate against a base revision: `abi-check` (the pre-commit hook) and `pr-report`
(the GitHub Action's script: job summary, a comment file and step outputs).

Both compare each tree's schema in the working tree with the same path at the base revision; a
schema the base does not have yet has nothing to break. `pr-report` also checks each generated tree
and shows the LAYOUT.md diff, rendered from both schemas by the running generator (so it shows what
the schema change does, without header hashes).
"""
from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..codegen.diff import FORMATS, DiffReport, diff_schemas, format_markdown, report_json, summary_line
from ..codegen.load import load_schema_bytes
from ..codegen.project import Tree, resolve_path
from ..codegen.render import make_environment, render_body, template_context
from ..codegen.sources import SourceUnavailable, read_source
from ..codegen.trees import check_tree, fix_hint
from ..codegen.version import kv_canary_version
from .base import BaseError, not_a_repository, resolve_base

# `abi-check --format json` and `pr-report --format json`: one object (workflow/report.schema.json).
REPORT_JSON_FORMAT = "kv-canary-abi-report"
REPORT_JSON_VERSION = 1

VERDICT_TEXT = {
    "unchanged": "no ABI change",
    "compatible": "compatible ABI change",
    "breaking": "breaking ABI change, abi_version bumped",
    "new-schema": "new schema (nothing to compare with)",
    "breaking-without-bump": "BREAKING ABI change without an abi_version bump",
    "stale": "generated tree out of date",
}
# How bad a tree's outcome is, worst last: the report's verdict is the worst of its trees.
VERDICTS = ("unchanged", "new-schema", "compatible", "breaking", "breaking-without-bump", "stale")


def _shown(path: Path) -> str:
    try:
        return resolve_path(path).relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


@dataclass
class TreeResult:
    tree: Tree
    files: int = 0
    drifts: tuple = ()
    report: DiffReport | None = None
    note: str = ""          # why there is no report (the base has no such schema)
    layout_diff: str = ""

    @property
    def verdict(self) -> str:
        if self.drifts:
            return "stale"
        if self.report is None:
            return "new-schema"
        return self.report.verdict


def _layout(schema) -> list[str]:
    return render_body(make_environment(), "docs/LAYOUT.md.j2", template_context(schema), "LAYOUT.md").splitlines(True)


def _diff_tree(tree: Tree, base: str, result: TreeResult, want_layout: bool) -> None:
    new_spec = _shown(tree.schema)
    try:
        old_name, old_raw = read_source(f"{base}:{new_spec}", Path.cwd())
    except SourceUnavailable as exc:
        if not exc.no_base:
            raise BaseError(str(exc)) from None
        result.note = f"{exc}: a new schema has nothing to break"
        return
    if len(base) == 40:  # a merge base: its short form is what people read
        old_name = f"{base[:12]}:{old_name.partition(':')[2]}"
    old = load_schema_bytes(old_raw, old_name)
    new = load_schema_bytes(tree.schema.read_bytes(), new_spec)
    result.report = diff_schemas(old, new, old_name, new_spec)
    if want_layout and result.report.changes:
        result.layout_diff = "".join(difflib.unified_diff(_layout(old), _layout(new), fromfile=f"{old_name} LAYOUT.md",
                                                          tofile=f"{new_spec} LAYOUT.md", n=1))


def report_doc(command: str, results: list, rev: str | None, how: str, status: int, error: str | None = None) -> dict:
    """The versioned JSON shape of both commands' reports (workflow/report.schema.json)."""
    verdict = "error" if error else max((r.verdict for r in results), key=VERDICTS.index, default="unchanged")
    return {"format": REPORT_JSON_FORMAT, "version": REPORT_JSON_VERSION, "kv_canary_version": kv_canary_version(),
            "command": command, "base": {"revision": rev, "how": how}, "verdict": verdict, "exit_status": status,
            "error": error,
            "trees": [{"schema": _shown(r.tree.schema), "out": _shown(r.tree.out), "verdict": r.verdict,
                       "up_to_date": None if command == "abi-check" else not r.drifts,
                       "drifts": [{"path": d.path, "kind": d.kind, "detail": d.detail, "fix": d.fix} for d in r.drifts],
                       "note": r.note or None,
                       "diff": report_json(r.report, fix_hint(r.tree)) if r.report is not None else None}
                      for r in results]}


def _print_json(doc: dict) -> int:
    import json
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    return doc["exit_status"]


def _abi_check_json(trees: list[Tree], base: str | None) -> int:
    """abi-check's verdicts as one JSON object on stdout (errors too: `error`, exit status 1)."""
    try:
        rev, how = resolve_base(base, trees)
        results = []
        for tree in trees:
            r = TreeResult(tree)
            if rev is None:
                r.note = f"nothing to compare: {how}"
            else:
                _diff_tree(tree, rev, r, want_layout=False)
            results.append(r)
    except BaseError as exc:
        return _print_json(report_doc("abi-check", [], None, "", 1, error=str(exc)))
    status = max((r.report.exit_status for r in results if r.report is not None), default=0)
    return _print_json(report_doc("abi-check", results, rev, how, status))


def abi_check(trees: list[Tree], base: str | None, fmt: str) -> int:
    """Each tree's schema against `base` (default: the merge base with the default branch). Exit 2 on a
    breaking change without a bump; a schema the base does not have, or no base at all, passes with a
    note; a base that does not exist is an error (1)."""
    if fmt == "json":
        return _abi_check_json(trees, base)
    try:
        rev, how = resolve_base(base, trees)
    except BaseError as exc:
        print(f"kv-canary abi-check: {exc}", file=sys.stderr)
        return 1
    if rev is None:
        hint = "" if not_a_repository(Path.cwd()) else " (`--base REV` names one)"
        print(f"kv-canary abi-check: nothing to compare: {how}. Passing{hint}.")
        return 0
    status = 0
    for tree in trees:
        result = TreeResult(tree)
        try:
            _diff_tree(tree, rev, result, want_layout=False)
        except BaseError as exc:
            print(f"kv-canary abi-check: {exc}", file=sys.stderr)
            return 1
        if result.report is None:
            print(f"kv-canary abi-check: {_shown(tree.schema)}: {result.note}.")
            continue
        sys.stdout.write(FORMATS[fmt](result.report, fix_hint(tree)))
        status = max(status, result.report.exit_status)
    return status


def _tree_section(r: TreeResult, hint) -> list[str]:
    t = r.tree
    lines = [f"### `{_shown(t.schema)}` → `{_shown(t.out)}/`", ""]
    regenerate = t.regenerate(Path.cwd())
    if r.drifts:
        lines.append(f"**Generated tree out of date: {len(r.drifts)} file(s).** Run `{regenerate}` and commit "
                     f"`{_shown(t.out)}/`.")
        lines.append("")
        for d in r.drifts[:20]:
            lines.append(f"- `{d.path}`: {d.detail}; fix: {d.fix}")
        if len(r.drifts) > 20:
            lines.append(f"- ... and {len(r.drifts) - 20} more (`kv-canary check` lists them)")
    else:
        lines.append(f"Generated tree up to date ({r.files} files).")
    lines.append("")
    if r.report is None:
        lines += [f"ABI: {r.note}.", ""]
        return lines
    table = format_markdown(r.report, hint).splitlines()[2:]  # without its own title
    lines += [f"ABI diff: `{r.report.old_name}` → `{r.report.new_name}`", "", *table, ""]
    if r.layout_diff:
        # A tilde fence: LAYOUT.md's own ``` fences cannot close it.
        lines += ["<details><summary>LAYOUT.md diff</summary>", "", "~~~diff", *r.layout_diff.splitlines(),
                  "~~~", "", "</details>", ""]
    return lines


def render_report(results: list[TreeResult], base_how: str, rev: str | None) -> tuple[str, str]:
    """(Markdown report, overall verdict)."""
    verdict = max((r.verdict for r in results), key=VERDICTS.index, default="unchanged")
    lines = ["## kv-canary ABI report", "",
             f"**{VERDICT_TEXT[verdict]}**" if verdict in ("stale", "breaking-without-bump") else VERDICT_TEXT[verdict],
             ""]
    if rev is not None:
        lines += [f"Base: `{rev[:12]}` ({base_how}).", ""]
    else:
        lines += [f"No base revision: {base_how}.", ""]
    for r in results:
        lines += _tree_section(r, fix_hint(r.tree))
    return "\n".join(lines).rstrip("\n") + "\n", verdict


def pr_report(trees: list[Tree], *, base: str | None, summary: Path | None, comment: Path | None,
              output: Path | None, fmt: str = "markdown") -> int:
    """Check the trees, diff them against the base, write the Markdown report to the job summary,
    the comment file and the step outputs; on stdout the report (fmt markdown) or its JSON (fmt json)."""
    summary = summary or (Path(os.environ["GITHUB_STEP_SUMMARY"]) if os.environ.get("GITHUB_STEP_SUMMARY") else None)
    output = output or (Path(os.environ["GITHUB_OUTPUT"]) if os.environ.get("GITHUB_OUTPUT") else None)
    if comment is None:
        comment = Path(os.environ.get("RUNNER_TEMP") or ".") / "kv-canary-report.md"
    try:
        rev, how = resolve_base(base, trees)
    except BaseError as exc:
        if fmt == "json":
            return _print_json(report_doc("pr-report", [], None, "", 1, error=str(exc)))
        print(f"kv-canary pr-report: {exc}", file=sys.stderr)
        return 1
    results = []
    for tree in trees:
        r = TreeResult(tree)
        r.files, drifts = check_tree(tree)
        r.drifts = tuple(drifts)
        if rev is None:
            r.note = f"no base revision ({how})"
        else:
            try:
                _diff_tree(tree, rev, r, want_layout=True)
            except BaseError as exc:
                if fmt == "json":
                    return _print_json(report_doc("pr-report", [], None, "", 1, error=str(exc)))
                print(f"kv-canary pr-report: {exc}", file=sys.stderr)
                return 1
        results.append(r)
    text, verdict = render_report(results, how, rev)
    status = 1 if verdict == "stale" else 2 if verdict == "breaking-without-bump" else 0
    if fmt == "json":
        _print_json(report_doc("pr-report", results, rev, how, status))
    else:
        sys.stdout.write(text)
    if summary is not None:
        with summary.open("a", encoding="utf-8") as fh:
            fh.write(text + "\n")
    comment.parent.mkdir(parents=True, exist_ok=True)
    comment.write_text(text, encoding="utf-8")
    if output is not None:
        breaking = any(r.report is not None and r.report.breaking for r in results)
        with output.open("a", encoding="utf-8") as fh:
            fh.write(f"verdict={verdict}\nbreaking={'true' if breaking else 'false'}\n"
                     f"report={comment.resolve()}\nexit-status={status}\n")
    for r in results:
        if r.report is not None and r.report.exit_status:
            print(f"kv-canary pr-report: {_shown(r.tree.schema)}: {summary_line(r.report, fix_hint(r.tree))}", file=sys.stderr)
    return status
