"""The demo's outputs: a plain-text results table, a Markdown report and a PNG chart."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..engine.violations import format_group

COLUMNS = ("scenario", "canary", "expected detection", "detected by", "first step", "violations",
           "first decoded line")


# Said before the scenarios' table: what they run with (the flags and variables set the clean runs only).
SCENARIO_CANARY = ("fault scenarios: each runs its own canary in mode log, not the flags above; "
                   "canary 'defaults': real-KV ALL, expected-token check on")


def canary_cell(r) -> str:
    """What the scenario's canary runs with, where it departs from the manager's defaults (SCENARIO_CANARY)."""
    s, out = r.settings, []
    if s.get("schema", "kernels.yaml") != "kernels.yaml":
        out.append(s["schema"].rsplit("/", 1)[-1])
    if not s.get("check_verify_expected_token", True):
        out.append("token check OFF")
    if s.get("real_kv_hash_mode", "ALL") != "ALL":
        out.append(f"real-KV {s['real_kv_hash_mode']}")
    return ", ".join(out) or "defaults"


def table_rows(results) -> list[tuple[str, ...]]:
    """One row of COLUMNS per scenario result."""
    return [(f"[{'ok' if r.ok else 'FAIL'}] {r.scenario.name}", canary_cell(r), r.expected, r.detected_by,
             "-" if r.first is None else f"{r.first.step} (damage {r.damage_step})", str(r.violations),
             "-" if r.first is None else r.first.log_line()) for r in results]


# The prefix-cache isolation story (kv_canary/schemas/isolation.yaml): the same faulty run under each schema.
ISOLATION_PAIR = ("cross_tenant_prefix/default_schema", "cross_tenant_prefix/isolation")


def isolation_summary(results) -> Optional[str]:
    """One line on the cross-tenant prefix reuse under both schemas, when both ran: the default record
    is blind to it, isolation.yaml's namespace field catches it (None when either did not run)."""
    by_name = {r.scenario.name: r for r in results}
    if not all(name in by_name for name in ISOLATION_PAIR):
        return None
    blind, caught = (by_name[n] for n in ISOLATION_PAIR)
    said = (f"default schema {'blind' if blind.first is None else 'NOT blind'} ({blind.violations} violations), "
            f"isolation schema {'catches it' if caught.first is not None else 'MISSES it'}")
    where = "" if caught.first is None else f": {caught.detected_by} at step {caught.first.step}, {caught.detail}"
    return f"prefix-cache isolation (a tenant reuses another tenant's cached prefix, same run): {said}{where}"


CONSOLE_WIDTH = 120  # the console listing's width; the report's table keeps every full row


def format_table(results, width: int = CONSOLE_WIDTH) -> str:
    """The console listing: two lines per scenario (name, canary, violations, first detection; then
    what was expected and what detected it), each cut to `width`; the decoded line is in the report."""
    rows = table_rows(results)
    name_w = min(60, max([len("scenario")] + [len(r[0]) for r in rows]))
    canary_w = min(24, max([len("canary")] + [len(r[1]) for r in rows]))
    head = f"{'scenario':<{name_w}}  {'canary':<{canary_w}}  {'violations':>10}  first detection (damage step)"
    lines = [head, "-" * min(width, len(head))]
    for name, canary, expected, detected, first, violations, _ in rows:
        lines.append(_cut(f"{_cut(name, name_w):<{name_w}}  {_cut(canary, canary_w):<{canary_w}}  "
                          f"{violations:>10}  {first}", width))
        lines.append(_cut(f"    expected: {expected}; detected by: {detected}", width))
    return "\n".join(lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


@dataclass(frozen=True)
class ChartRow:
    """One scenario's row of the chart: violations per step, the fault's step, what is written beside it."""
    label: str
    counts: tuple           # violations at step 0 .. steps-1
    damage_step: Optional[int]
    first_step: Optional[int]
    note: str               # the detection latency, or what a control did
    control: bool           # the canary must stay silent
    ok: bool


def chart_rows(results) -> list[ChartRow]:
    """The chart's rows: the scenarios the canary must detect, in run order, then the controls."""
    rows = []
    for r in results:
        control = r.expected_tag is None
        first = None if r.first is None else r.first.step
        if control:
            note = "silent" if r.violations == 0 else f"{r.violations} violation(s)"
        elif first is None:
            note = "not detected"
        elif r.damage_step is None:
            note = f"detected at step {first}"
        else:
            late = first - r.damage_step
            note = f"detected, latency {late} step{'s' if late != 1 else ''}"
        counts = tuple(int(r.per_step.get(s, 0)) for s in range(r.scenario.steps))
        rows.append(ChartRow(r.scenario.name, counts, r.damage_step, first, note, control, r.ok))
    return [x for x in rows if not x.control] + [x for x in rows if x.control]


def write_chart(results, path: Path) -> Path:
    """One row per scenario, steps across, violations per step as colour (log scale), the fault's
    step marked; the detection latency beside each row; the controls grouped last, under a rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm

    rows = chart_rows(results)
    width = max(len(r.counts) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        grid[i, :len(r.counts)] = [c if c else np.nan for c in r.counts]   # no violation: the background
    top = max(1, int(np.nanmax(grid)) if np.isfinite(grid).any() else 1)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * len(rows)), layout="constrained")
    ax.set_facecolor("#f2f2f2")
    for i, r in enumerate(rows):   # the steps a scenario ran (a shorter one stops early)
        ax.add_patch(plt.Rectangle((-0.5, i - 0.5), len(r.counts), 1, color="white", zorder=0))
    # Reds from a third of the way in: one violation in a step is a visible colour, not near-white.
    cmap = ListedColormap(plt.get_cmap("Reds")(np.linspace(0.35, 1.0, 256)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap,
                      norm=LogNorm(vmin=1, vmax=max(top, 2)), extent=(-0.5, width - 0.5, len(rows) - 0.5, -0.5),
                      zorder=1)
    for i, r in enumerate(rows):
        if r.damage_step is not None:
            ax.plot([r.damage_step], [i], marker="v", color="black", markersize=6, zorder=3)
        colour = "tab:green" if r.ok else "tab:red"
        ax.text(width + 0.5, i, ("ok  " if r.ok else "FAIL  ") + r.note, va="center", fontsize=8, color=colour,
                clip_on=False)
    controls = sum(r.control for r in rows)
    if controls and controls < len(rows):
        ax.axhline(len(rows) - controls - 0.5, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), [("control: " if r.control else "") + r.label for r in rows], fontsize=8)
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_xlabel("engine step")
    ax.set_title("kv-canary demo: violations per step per scenario (▼ the step the fault did its damage; "
                 "controls, last, must stay silent)", fontsize=10)
    fig.colorbar(image, ax=ax, label="violations in the step", pad=0.2, fraction=0.025)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _table_md(results) -> list[str]:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table_rows(results):
        out.append("| " + " | ".join(cell.replace("|", "\\|") if i < len(COLUMNS) - 1 else f"`{cell}`" for i, cell in
                                     enumerate(row)) + " |")
    return out


def _details_md(results) -> list[str]:
    out = []
    for r in results:
        sc = r.scenario
        out += [f"### {sc.name}", "", f"{sc.title}.", "",
                f"- fault: {r.detail or 'did not fire'} (damage step {r.damage_step})",
                f"- canary: {r.describe_settings()}",
                f"- expected: {r.expected}; result: {r.why}",
                f"- violations: {r.violations} (ring overflow lost {r.lost})"]
        if r.groups:
            out += ["- root causes (CHAIN cascades grouped behind the first bad slot of their chain):", "", "```",
                    *(format_group(g) for g in r.groups[:5])]
            if len(r.groups) > 5:
                out.append(f"... {len(r.groups) - 5} more group(s)")
            out.append("```")
        out.append("")
    return out


def write_report(results, clean: dict, out_dir: Path, real: Optional[dict] = None) -> tuple[Path, Optional[Path], str]:
    """report.md and the chart of every scenario (simulation and real engine); without matplotlib the
    report is written without the chart and the third value says why."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    real = real or {}
    chart, no_chart = None, ""
    every = results + list(real.get("results", []))
    if not every:
        no_chart = "no fault scenario ran"
    else:
        try:
            chart = write_chart(every, out_dir / "violations_per_step.png")
        except ImportError:
            no_chart = "matplotlib is not installed: pip install 'kv-canary[demo]'"
    out = ["# kv-canary demo report", "", "## Clean run", "",
           f"- steps: {clean['steps']}, requests finished: {clean['finished']}, "
           f"with a radix-shared prefix: {clean['shared']}, SWA window: {clean['swa_window']}",
           f"- backend: {clean['backend']}, kernel launches: {clean['kernel_runs']}, "
           f"violations: **{clean['violations']}**", "", "## Scenarios", "", *_table_md(results)]
    isolation = isolation_summary(results)
    if isolation is not None:
        out += ["", isolation + " (kv_canary/schemas/isolation.yaml, docs/schema-change.md)."]
    if real.get("skipped"):
        out += ["", "## Real engine: HF transformers", "", f"Skipped: {real['skipped']}"]
    elif real:
        c = real["clean"]
        out += ["", "## Real engine: HF transformers", "",
                f"A tiny random Llama ({c['model']}) generating with continuous batching (paged KV cache, "
                f"transformers {c['version']}), guarded by kv_canary.integrations.transformers.", "",
                f"- clean run: {c['requests']} requests, {c['steps']} engine steps, kernel launches: "
                f"{c['kernel_runs']}, sweeps: {c['sweeps']}, violations: **{c['violations']}**, output tokens "
                f"unchanged by the canary: {c['unchanged']}", "", *_table_md(real["results"])]
    chart_line = f"![violations per step]({chart.name})" if chart else f"(no chart: {no_chart})"
    out += ["", chart_line, "", "## Details", "", *_details_md(results), *_details_md(real.get("results", []))]
    md = out_dir / "report.md"
    md.write_text("\n".join(out), encoding="utf-8")
    return md, chart, no_chart
