"""`make demo` / `kv-canary demo`: a clean serving run, then every fault scenario, then a report.

Runs on the default backend (CUDA when a GPU is present, else the CPU torch reference); exits 0
when the clean run is silent and every scenario behaves as documented. SGLang's canary flags and
SGLANG_KV_CANARY_* environment variables configure the clean run (the scenarios keep the settings
their expectations need); its log lines, the stats line included, are shown as it runs.
`--metrics-port PORT` serves the clean run's Prometheus metrics on 127.0.0.1 while the demo runs.
`--world-size N` runs the fleet demo instead (kv_canary.demo.fleet): N gloo ranks, a fault on rank 1.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

import torch

from ..engine.config import CanaryConfig
from . import faults, fleet, report

# The clean run's canary when no flag or environment variable says otherwise: every check on.
DEMO_CANARY = CanaryConfig(mode="log", real_kv_data="all", sweep_interval=faults.SWEEP, stats_print_every_n_steps=0,
                           enable_verify_token_assert=True, enable_mha_v=True)


def _progress(label: str, stream):
    def show(done: int, total: int) -> None:
        if done == total or done % 20 == 0:
            stream.write(f"\r  {label}: step {done}/{total}")
            if done == total:
                stream.write("\n")
            stream.flush()
    return show


def _describe(c: CanaryConfig) -> str:
    stats = f"stats line every {c.stats_print_every_n_steps} steps" if c.stats_print_every_n_steps else "no stats line"
    return (f"--kv-canary {c.mode} --kv-canary-real-data {c.real_kv_data} --kv-canary-sweep-interval "
            f"{c.sweep_interval}, {stats}")


@contextlib.contextmanager
def _canary_log_shown(stream):
    """The kv_canary logger's INFO and above on `stream`, each line on its own (over the progress line)."""
    log = logging.getLogger("kv_canary")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("\r  %(message)s"))
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # shown once, here, not again by a root handler
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kv-canary demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of the clean run (default 200)")
    ap.add_argument("--out", type=Path, default=Path("out"), help="report directory (default ./out)")
    ap.add_argument("--backend", default=None, help="force a backend: torch, cuda or emulated")
    ap.add_argument("--device", default=None, help="tensor device (default: cuda when available, else cpu)")
    ap.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="run only these scenarios (with --world-size: the one scenario injected on rank 1, "
                         f"default {fleet.DEFAULT_SCENARIO})")
    ap.add_argument("--world-size", type=int, default=1, metavar="N",
                    help="N >= 2: the fleet demo, the engine on N gloo ranks on 127.0.0.1 with a fault on rank 1 "
                         "only (default 1: the single-process demo)")
    ap.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                    help="serve Prometheus /metrics on 127.0.0.1:PORT while the demo runs (0: a free port; "
                         "needs prometheus_client)")
    CanaryConfig.add_cli_args(ap, DEMO_CANARY)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.world_size < 1:
        ap.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        ap.error(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    try:
        canary = CanaryConfig.from_args(args, base=DEMO_CANARY)
    except ValueError as e:
        ap.error(str(e))
    if args.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            ap.error("--metrics-port needs prometheus_client: pip install 'kv-canary[metrics]'")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.world_size > 1:
        return _fleet_demo(ap, args, canary, device)
    if device == "cpu":
        torch.set_num_threads(1)  # the simulation's tensors are tiny: thread fan-out only costs time
    out = sys.stdout
    known = faults.scenarios()
    chosen = known if not args.only else [s for s in known if s.name in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        names = ", ".join(s.name for s in known)
        ap.error(f"--only must name scenarios from: {names}; got {', '.join(args.only)}")
    t0 = time.perf_counter()
    backend_name = args.backend or ("cuda (default dispatch)" if device == "cuda" else "torch reference (CPU)")
    out.write(f"kv-canary demo on {device}, backend: {backend_name}\n")
    with contextlib.ExitStack() as stack:
        registry = None
        if args.metrics_port is not None:
            registry = _serve_metrics(stack, args.metrics_port, out)
        rc = _single_process_demo(args, canary, device, chosen, backend_name, registry, out, t0)
    return rc


def _serve_metrics(stack: contextlib.ExitStack, port: int, out):
    """A fresh registry served on 127.0.0.1:port until `stack` closes."""
    from prometheus_client import CollectorRegistry

    from ..engine.metrics import serve_metrics

    registry = CollectorRegistry()
    server = serve_metrics(port, registry=registry)
    stack.callback(server.close)
    out.write(f"serving the clean run's Prometheus metrics on {server.url}\n")
    return registry


def _single_process_demo(args, canary: CanaryConfig, device: str, chosen, backend_name: str, registry, out,
                         t0: float) -> int:
    out.write(f"clean run ({args.steps} steps, prefix sharing, chunked prefill, SWA; canary: {_describe(canary)}):\n")
    with _canary_log_shown(out):
        engine, manager = faults.run_clean(args.steps, backend=args.backend, device=device,
                                           progress=_progress("clean run", out), metrics_registry=registry,
                                           **canary.manager_options())
    logging.getLogger("kv_canary").setLevel(logging.ERROR)  # the table and report show the scenarios' violations
    clean = {"steps": args.steps, "finished": len(engine.finished),
             "shared": sum(r.matched > 0 for r in engine.finished), "swa_window": engine.cfg.swa_window,
             "backend": backend_name, "kernel_runs": manager.kernel_runs, "violations": manager.stats.total}
    out.write(f"  {clean['finished']} requests finished ({clean['shared']} with a shared prefix), "
              f"{clean['kernel_runs']} canary launches, violations: {clean['violations']}\n")
    results = []
    for i, sc in enumerate(chosen, 1):
        out.write(f"\r  scenario {i}/{len(chosen)}: {sc.name:<45}")
        out.flush()
        results.append(faults.run_scenario(sc, backend=args.backend, device=device))
    out.write("\n\n" + report.format_table(results) + "\n\n")
    md, chart = report.write_report(results, clean, args.out)
    ok = clean["violations"] == 0 and all(r.ok for r in results)
    out.write(f"report: {md}  chart: {chart}\n")
    out.write(f"{'all scenarios behaved as documented' if ok else 'SOME SCENARIOS FAILED'} "
              f"({time.perf_counter() - t0:.1f}s)\n")
    return 0 if ok else 1


def _fleet_demo(ap, args, canary: CanaryConfig, device: str) -> int:
    if not canary.enabled:
        ap.error("--world-size needs --kv-canary log or raise")
    known = [s.name for s in faults.scenarios()]
    if args.only and (len(args.only) != 1 or args.only[0] not in known):
        ap.error(f"--world-size takes at most one --only scenario, from: {', '.join(known)}; got {', '.join(args.only)}")
    demo = fleet.FleetDemo(world_size=args.world_size, scenario=args.only[0] if args.only else fleet.DEFAULT_SCENARIO,
                           steps=args.steps, manager=canary.manager_options(), device=device, backend=args.backend)
    try:
        result = fleet.run(demo, out_dir=args.out, metrics_port=args.metrics_port, stream=sys.stdout)
    except (RuntimeError, TimeoutError) as e:
        sys.stdout.write(f"FLEET DEMO FAILED: {e}\n")
        return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
