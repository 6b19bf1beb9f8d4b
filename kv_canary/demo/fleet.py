"""`kv-canary demo --world-size N`: the simulated engine on N local gloo ranks, all serving the same
workload, one fault scenario injected on rank 1 only, and the fleet's view of it: which rank saw
what, and that every rank acted on it at the same step. With a metrics port, this process serves
every rank's Prometheus values (multiprocess mode, label `tp_rank`).
"""
from __future__ import annotations

import logging
import logging.handlers
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..engine.distributed import FleetHealthError, FleetMonitor, FleetViolationError
from ..engine.distributed.rows import FLEET_PREFIX, STATS_PREFIX
from ..engine.manager import CanaryManager
from . import faults
from .local_ranks import HOST, run_local_ranks
from .sim import Engine

FAULT_RANK = 1
DEFAULT_SCENARIO = "out_of_range_slot"
STATS_EVERY = 50            # steps between the fleet stats lines
GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FleetDemo:
    """What every rank runs (sent to the ranks, so plain values only)."""
    world_size: int
    scenario: str
    steps: int
    manager: dict                 # CanaryManager keywords (the demo's canary flags)
    device: str = "cpu"
    backend: Optional[str] = None
    metrics_dir: Optional[str] = None


def rank_main(rank: int, world_size: int, demo: FleetDemo) -> dict:
    """One rank: serve `demo.steps` steps with a FleetMonitor (and CanaryMetrics with a metrics
    directory); returns what this rank saw."""
    import torch

    if demo.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    sc = next(s for s in faults.scenarios() if s.name == demo.scenario)
    log = logging.getLogger("kv_canary")
    lines = logging.handlers.BufferingHandler(capacity=sys.maxsize)  # never flushed: the fleet lines of this rank
    lines.addFilter(lambda record: record.getMessage().startswith((FLEET_PREFIX, STATS_PREFIX)))
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    log.propagate = False   # the parent prints the fleet's view; ranks print nothing themselves
    tree = faults.example_tree(sc.tree)
    manager = CanaryManager(tree=tree, backend=demo.backend, **{**demo.manager, **sc.manager})
    fault = sc.make_fault() if rank == FAULT_RANK else None
    engine = Engine(sc.sim, canary=manager, hooks=[fault] if fault else [], device=demo.device)
    fleet = FleetMonitor(manager, stats_every=STATS_EVERY)
    metrics = None
    if demo.metrics_dir is not None:
        from ..engine.metrics import CanaryMetrics
        metrics = CanaryMetrics(manager, tp_rank=rank)
    raised = None
    try:
        engine.run(demo.steps)
        manager.drain()
        fleet.close()
    except (FleetViolationError, FleetHealthError) as e:
        raised = {"type": type(e).__name__, "step": manager.last_step, "rows": len(e.violations),
                  "line": str(e).splitlines()[0]}
    finally:
        if metrics is not None:
            metrics.refresh()
    st = manager.stats
    return {
        "rank": rank, "damage_step": fault.damage_step if fault else None, "detail": fault.detail if fault else "",
        "local_rows": st.total, "first_local_step": min(st.by_step, default=None),
        "first_line": manager.violations[0].log_line() if manager.violations else None,
        "decisions": fleet.decisions,
        "raised": raised, "fleet_lines": [record.getMessage() for record in lines.buffer],
        "totals": {"kernel_runs": dict(zip((t.name for t in manager.tags), manager.kernel_run_counters.tolist())),
                   "protected_tokens": int(manager.slot_run_counter[0]), "rows": st.total, "lost": st.lost,
                   "by_tag_reason": dict(st.by_tag_reason)},
    }


def run(demo: FleetDemo, *, out_dir: Path, stream, metrics_port: Optional[int] = None) -> bool:
    """Run the ranks, then judge and report the fleet's view (console, out_dir/fleet_report.md);
    returns whether the fleet behaved as documented."""
    t0 = time.perf_counter()
    server, metrics_dir = None, None
    if metrics_port is not None:
        from ..engine.metrics import serve_metrics
        metrics_dir = tempfile.mkdtemp(prefix="kv_canary_prometheus_")
        try:
            server = serve_metrics(metrics_port, addr=HOST, multiprocess_dir=metrics_dir)
        except BaseException:   # a busy port: nothing started, nothing left behind
            shutil.rmtree(metrics_dir, ignore_errors=True)
            raise
        demo = FleetDemo(**{**demo.__dict__, "metrics_dir": metrics_dir})
    try:
        stream.write(f"kv-canary fleet demo: {demo.world_size} ranks (gloo on {HOST}), scenario {demo.scenario} "
                     f"on rank {FAULT_RANK} only, mode {demo.manager['mode']}, {demo.steps} steps\n")
        if server is not None:
            stream.write(f"  serving /metrics of every rank on {server.url}\n")
        stream.flush()
        outcomes = run_local_ranks(rank_main, demo.world_size, args=(demo,), group_timeout_s=GROUP_TIMEOUT_S,
                                   timeout_s=120 + 2 * demo.steps,
                                   env={"PROMETHEUS_MULTIPROC_DIR": metrics_dir} if metrics_dir else None)
        failed = [o for o in outcomes if o.status != "ok"]
        if failed:
            raise RuntimeError("kv-canary: fleet demo ranks failed: " + "; ".join(o.describe() for o in failed)
                               + "\n" + "\n".join(o.traceback for o in failed))
        ranks = [o.value for o in outcomes]
        return report(demo, ranks, out_dir, time.perf_counter() - t0, stream)
    finally:
        if server is not None:   # and its metrics_dir
            server.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)


def judge(demo: FleetDemo, ranks: list) -> tuple[bool, str]:
    """Did the fleet behave as documented?"""
    sc = next(s for s in faults.scenarios() if s.name == demo.scenario)
    decisions = [r["decisions"] for r in ranks]
    raised = [r["raised"] for r in ranks]
    others = [r["rank"] for r in ranks if r["rank"] != FAULT_RANK and r["local_rows"]]
    faulty = ranks[FAULT_RANK]
    if faulty["damage_step"] is None:
        return False, f"the fault never fired on rank {FAULT_RANK} in {demo.steps} steps"
    if others:
        return False, f"ranks {others} saw violations without a fault"
    if any(d != decisions[0] for d in decisions):
        return False, "the ranks hold different fleet decisions"
    if sc.expect.launch is None:
        ok = not decisions[0]
        return ok, "silent on every rank, as documented (a control)" if ok else "a control scenario was decided on"
    if not faulty["local_rows"]:
        return False, f"rank {FAULT_RANK}'s fault was not detected (no violation on any rank)"
    if not decisions[0] or decisions[0][0].violation_ranks != [FAULT_RANK]:
        return False, f"no fleet decision named rank {FAULT_RANK}"
    step, decided = decisions[0][0].step, decisions[0][0].decided_step
    if step < faulty["first_local_step"] or decided != step + 1:
        return False, f"the first decision (step {step}, acted on at {decided}) does not follow rank {FAULT_RANK}'s " \
                      f"first violation (step {faulty['first_local_step']})"
    if demo.manager["mode"] == "raise" and any(r is None or r["step"] != decided for r in raised):
        return False, "not every rank raised at the decision step"
    return True, f"rank {FAULT_RANK}'s violations at step {step} were acted on by every rank at step {decided}"


def verdict(demo: FleetDemo, ranks: list) -> tuple[bool, str]:
    """(ok, the verdict line): the fleet judged, unless the canary options could not see the fault at all."""
    sc = next(s for s in faults.scenarios() if s.name == demo.scenario)
    off = sc.expect.check_off({**demo.manager, **sc.manager})
    if off is not None and not ranks[FAULT_RANK]["local_rows"]:
        return False, (f"NOT DETECTABLE WITH THESE CANARY OPTIONS: {sc.name} shows as {sc.expect.reason}; {off}. "
                       f"Rank {FAULT_RANK}'s fault went unseen, so no rank had a violation to act on")
    ok, why = judge(demo, ranks)
    return ok, f"{'fleet behaved as documented' if ok else 'FLEET DEMO FAILED'}: {why}"


def report(demo: FleetDemo, ranks: list, out_dir: Path, seconds: float, stream) -> bool:
    ok, why = verdict(demo, ranks)
    faulty = ranks[FAULT_RANK]
    lines = [f"  rank {FAULT_RANK}: fault: {faulty['detail'] or 'did not fire'} (damage step {faulty['damage_step']})", ""]
    head = ("rank", "local violations", "first local step", "fleet decisions (state of step -> acted on at step)",
            "raised")
    rows = [head]
    for r in ranks:
        decided = "none"
        if r["decisions"]:
            d = r["decisions"][0]
            decided = f"{d.step} -> {d.decided_step}: violations on ranks {d.violation_ranks}"
            if d.health_ranks:
                decided += f", health on ranks {d.health_ranks}"
            if len(r["decisions"]) > 1:
                decided += f" (and {len(r['decisions']) - 1} later decision(s))"
        raised = f"{r['raised']['type']} at step {r['raised']['step']}" if r["raised"] else "-"
        first = "-" if r["first_local_step"] is None else str(r["first_local_step"])
        rows.append((str(r["rank"]), str(r["local_rows"]), first, decided, raised))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    same = all(r["decisions"] == ranks[0]["decisions"] for r in ranks)
    logged = ranks[0]["fleet_lines"]
    shown = [x for x in logged if x.startswith(FLEET_PREFIX)][:1] + [x for x in logged if x.startswith(STATS_PREFIX)][-1:]
    lines += ["", f"every rank holds the same decisions: {'yes' if same else 'NO'}"]
    if shown:
        lines += [f"rank 0 logged {len(logged)} fleet line(s), among them:", *(f"  {line}" for line in shown)]
    if ranks[0]["raised"]:
        lines += ["every rank raised:", f"  {ranks[0]['raised']['line']}"]
    if faulty["first_line"]:
        lines += [f"rank {FAULT_RANK}'s first violation: {faulty['first_line']}"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "fleet_report.md"
    summary = f"{why} ({seconds:.1f}s)"
    md.write_text("\n".join(["# kv-canary fleet demo", "",
                             f"{demo.world_size} ranks (gloo on {HOST}), scenario `{demo.scenario}` injected on "
                             f"rank {FAULT_RANK} only, mode `{demo.manager['mode']}`, {demo.steps} steps.", "",
                             "```", *lines, "```", "", f"**{summary}**", ""]), encoding="utf-8")
    stream.write("\n".join([*lines, f"report: {md}", summary]) + "\n")
    return ok
