"""`make demo` / `kv-canary demo`: a clean serving run, then every fault scenario, then a report.

Exits 0 when the clean run is silent and every scenario behaves as documented. SGLang's canary flags
and SGLANG_KV_CANARY_* variables configure the clean run (once any flag is given, the others take
SGLang's defaults too; without them it checks everything). Then the same for HF transformers'
continuous batching, and vLLM through its KV connector API (each skipped, saying how to get it, when
not installed; vLLM's only in a full demo, without --only). `--world-size N`: the
fleet demo (kv_canary.demo.fleet).
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..engine.config import FLAG_MODE, FLAG_REAL_KV_DATA, FLAG_SWEEP_INTERVAL, CanaryConfig
from ..engine.metrics import MetricsPortUnavailable
from . import faults, fleet, report
from . import transformers as tf
from . import vllm as vllm_demo

# The clean run's canary when no flag or environment variable says otherwise: every check on.
DEMO_CANARY = CanaryConfig(mode="log", real_kv_data="all", sweep_interval=faults.SWEEP, stats_print_every_n_steps=0,
                           enable_verify_token_assert=True, enable_mha_v=True)


def _live(stream) -> str:
    """The prefix of a line that later output overwrites: a carriage return on a terminal; elsewhere
    (a log file, CI) nothing, and such lines are not written at all."""
    return "\r" if getattr(stream, "isatty", lambda: False)() else ""


def _transient(stream, text: str) -> None:
    """A progress line shown on a terminal only (overwritten by what follows)."""
    if _live(stream):
        stream.write("\r" + text)
        stream.flush()


def _progress(label: str, stream):
    def show(done: int, total: int) -> None:
        if done == total:
            stream.write(f"{_live(stream)}  {label}: step {done}/{total}\n")
            stream.flush()
        elif done % 20 == 0:
            _transient(stream, f"  {label}: step {done}/{total}")
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
    handler.setFormatter(logging.Formatter(_live(stream) + "  %(message)s"))
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
    ap.add_argument("--backend", default=None, help="force a backend: torch, cpu, cuda or emulated")
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
    ap.add_argument("--violations-jsonl", type=Path, default=None, metavar="PATH",
                    help="append every run's violations to PATH as JSON lines (docs/violations-jsonl.md; label "
                         "scenario), beside the log and the report")
    argv = sys.argv[1:] if argv is None else list(argv)
    sglang_flags = any(a.split("=", 1)[0] in (FLAG_MODE, FLAG_REAL_KV_DATA, FLAG_SWEEP_INTERVAL) for a in argv)
    base = CanaryConfig() if sglang_flags else DEMO_CANARY   # SGLang's flags given: SGLang's defaults
    CanaryConfig.add_cli_args(ap, base)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.world_size < 1:
        ap.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        ap.error(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    try:
        canary = CanaryConfig.from_args(args, base=base)
    except ValueError as e:
        ap.error(str(e))
    _check_args(ap, args)   # before anything runs: a typo must not cost a clean run and a traceback
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
    known, real = faults.scenarios(), tf.scenarios()
    chosen = known if not args.only else [s for s in known if s.name in args.only]
    real_chosen = real if not args.only else [s for s in real if s.name in args.only]
    real_clean = not args.only or tf.PREFIX + "clean" in args.only
    if args.only and len(chosen) + len(real_chosen) + real_clean != len(set(args.only)):
        names = ", ".join([s.name for s in known] + [tf.PREFIX + "clean"] + [s.name for s in real])
        ap.error(f"--only must name scenarios from: {names}; got {', '.join(args.only)}")
    t0, out = time.perf_counter(), sys.stdout
    backend_name = args.backend or _default_backend_name(device)
    out.write(f"kv-canary demo on {device}, backend: {backend_name}\n")
    with contextlib.ExitStack() as stack:
        try:
            registry = _serve_metrics(stack, args.metrics_port, out) if args.metrics_port is not None else None
        except MetricsPortUnavailable as e:   # a busy port: a usage error, not a traceback
            ap.error(str(e).removeprefix("kv-canary: "))
        args.jsonl = None if args.violations_jsonl is None else \
            stack.enter_context(args.violations_jsonl.open("a", encoding="utf-8"))
        return _single_process_demo(args, canary, device, backend_name, chosen, registry, out, t0, real_clean,
                                    real_chosen)


def _check_args(ap, args) -> None:
    """--backend, --device and --out checked up front (argparse errors, exit 2)."""
    from ..backends import KNOWN_BACKENDS
    if args.backend is not None and args.backend not in KNOWN_BACKENDS:
        close = difflib.get_close_matches(args.backend, KNOWN_BACKENDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        ap.error(f"--backend must be one of {', '.join(KNOWN_BACKENDS)}, got {args.backend!r}{hint}")
    if args.backend == "cuda" and not torch.cuda.is_available():
        ap.error("--backend cuda needs a CUDA GPU, and none is visible; use torch or emulated")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            ap.error(f"--device must be a torch device such as cpu or cuda, got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
            ap.error(f"--device {args.device}: {why}; use --device cpu (or leave --device out)")
        if device.type not in ("cpu", "cuda"):
            ap.error(f"--device must be cpu or cuda, got {args.device!r}")
    problem = _unwritable(args.out)
    if problem:
        ap.error(f"--out {args.out}: cannot write the report there ({problem})")
    if args.violations_jsonl is not None:
        if args.world_size > 1:
            ap.error("--violations-jsonl is for the single-process demo (each rank of --world-size runs its own "
                     "process; attach kv_canary.engine.jsonl.ViolationJsonl on each rank)")
        problem = _unwritable(args.violations_jsonl.parent)
        if problem or args.violations_jsonl.is_dir():
            ap.error(f"--violations-jsonl {args.violations_jsonl}: cannot write there ({problem or 'a directory'})")


def _unwritable(out: Path) -> str:
    """Why the report directory cannot be written ('' when it can): created now, probed with a file."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return ""


def _serve_metrics(stack: contextlib.ExitStack, port: int, out):
    """A fresh registry served on 127.0.0.1:port until `stack` closes."""
    from prometheus_client import CollectorRegistry

    from ..engine.metrics import serve_metrics

    registry = CollectorRegistry()
    server = serve_metrics(port, registry=registry)
    stack.callback(server.close)
    out.write(f"serving the Prometheus metrics of every run (label scenario) on {server.url}\n")
    return registry


def _default_backend_name(device: str) -> str:
    """What the launches pick for `device` without backend= (kv_canary.launch.runtime's choice)."""
    from .. import generated
    from ..launch.runtime import runtime_for
    if device == "cuda":
        return "cuda (default dispatch)"
    if runtime_for(generated).use_torch_reference(device):
        return "torch reference (CPU)"
    return "cpu kernels (default dispatch)"


def _single_process_demo(args, canary: CanaryConfig, device: str, backend_name: str, chosen, registry, out,
                         t0: float, real_clean: bool, real_chosen) -> int:
    out.write(f"clean run ({args.steps} steps, prefix sharing, chunked prefill, SWA; canary: {_describe(canary)}):\n")
    # Only the clean runs' log is shown (_canary_log_shown); the table and report show the scenarios' violations.
    logging.getLogger("kv_canary").setLevel(logging.ERROR)
    with _canary_log_shown(out):
        engine, manager = faults.run_clean(args.steps, backend=args.backend, device=device,
                                           progress=_progress("clean run", out), metrics_registry=registry,
                                           violations_jsonl=args.jsonl, **canary.manager_options())
    clean = {"steps": args.steps, "finished": len(engine.finished),
             "shared": sum(r.matched > 0 for r in engine.finished), "swa_window": engine.cfg.swa_window,
             "backend": backend_name, "kernel_runs": manager.kernel_runs, "violations": manager.stats.total}
    out.write(f"  {clean['finished']} requests finished ({clean['shared']} with a shared prefix), "
              f"{clean['kernel_runs']} canary launches, violations: {clean['violations']}\n")
    out.write(report.SCENARIO_CANARY + "\n")
    results = _run_scenarios(chosen, 45, out, lambda sc: faults.run_scenario(
        sc, backend=args.backend, device=device, metrics_registry=registry, violations_jsonl=args.jsonl))
    isolation = report.isolation_summary(results)
    if isolation is not None:
        out.write(isolation + "\n\n")
    real = _real_engine_section(args, canary, device, registry, out, real_clean, real_chosen)
    in_vllm = vllm_demo.demo_section(out, args.backend) if not args.only and device == "cpu" else {}
    md, chart, no_chart = report.write_report(results, clean, args.out, real)
    ok = clean["violations"] == 0 and all(r.ok for r in results) and real.get("ok", True) and in_vllm.get("ok", True)
    out.write(f"report: {md}  " + (f"chart: {chart}\n" if chart else f"no chart: {no_chart}\n"))
    if args.jsonl is not None:
        out.write(f"violations as JSON lines: {args.violations_jsonl}\n")
    out.write(f"{'all scenarios behaved as documented' if ok else 'SOME SCENARIOS FAILED'} "
              f"({time.perf_counter() - t0:.1f}s)\n")
    return 0 if ok else 1


def _run_scenarios(chosen, width: int, out, run) -> list:
    """Each scenario run (a progress line on a terminal), then the results table."""
    results = []
    for i, sc in enumerate(chosen, 1):
        _transient(out, f"  scenario {i}/{len(chosen)}: {sc.name:<{width}}")
        results.append(run(sc))
    out.write(("\n" if _live(out) else "") + "\n" + report.format_table(results) + "\n\n")
    return results


def _real_engine_section(args, canary: CanaryConfig, device: str, registry, out, run_clean: bool, chosen) -> dict:
    """HF transformers' continuous batching under the canary: a clean run, then its fault scenarios."""
    if not run_clean and not chosen:
        return {}
    out.write("real engine: HF transformers continuous batching (tiny random Llama, paged KV cache):\n")
    skipped = tf.available() or (device != "cpu" and f"runs on the CPU only in this demo (device {device})")
    if skipped:
        out.write(f"  skipped: {skipped}\n\n")
        return {"skipped": skipped}
    import transformers
    section = {"results": [], "ok": True, "clean": {"requests": 0, "steps": 0, "kernel_runs": 0, "sweeps": 0,
                                                    "violations": 0, "unchanged": True,
                                                    "version": transformers.__version__, "model": "not run"}}
    if run_clean:
        options = canary.manager_options()
        # Its run is ~30 engine steps: the stats line every 10 unless the flags or environment chose a cadence.
        options["stats_print_every_n_steps"] = options["stats_print_every_n_steps"] or tf.STATS_EVERY
        with _canary_log_shown(out):
            handle, outputs = tf.run_clean(backend=args.backend, metrics_registry=registry,
                                           violations_jsonl=args.jsonl, **options)
        m = handle.manager
        plain = tf.generate(tf.model())
        unchanged = all(list(plain[k].generated_tokens) == list(v.generated_tokens) for k, v in outputs.items())
        cfg = tf.model().config
        section["clean"] = {"requests": len(outputs), "steps": handle.steps, "kernel_runs": m.kernel_runs,
                            "sweeps": m.sweep_passes, "violations": m.stats.total, "unchanged": unchanged,
                            "version": transformers.__version__,
                            "model": f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"}
        section["ok"] = m.stats.total == 0 and unchanged and not handle.errors
        out.write(f"  clean run: {len(outputs)} requests (chunked prefill, prefix sharing), {handle.steps} engine "
                  f"steps, {m.kernel_runs} canary launches, violations: {m.stats.total}, output tokens unchanged: "
                  f"{'yes' if unchanged else 'NO'}\n")
    if chosen:
        section["results"] = _run_scenarios(chosen, 55, out, lambda sc: tf.run_scenario(
            sc, backend=args.backend, metrics_registry=registry, violations_jsonl=args.jsonl))
        first = next((r for r in section["results"] if r.first is not None), None)
        if first is not None:   # what an engine's log shows for it (docs/semantics.md §9, logger kv_canary)
            from .. import generated
            from ..engine.reporting import ViolationReporter
            text = ViolationReporter(generated.layout).message(
                first.first, total_violations=first.violations, ring_overflow=first.lost > 0,
                step_when_pumped=first.first.step)
            out.write(f"  {first.scenario.name}: its first violation as the canary logs it:\n")
            out.write("".join(f"    {line}\n" for line in text.splitlines()) + "\n")
    section["ok"] = section["ok"] and all(r.ok for r in section["results"])
    return section


def _fleet_demo(ap, args, canary: CanaryConfig, device: str) -> int:
    if not canary.enabled:
        ap.error("--world-size needs --kv-canary log or raise")
    known = [s.name for s in faults.scenarios()]
    if args.only and (len(args.only) != 1 or args.only[0] not in known):
        ap.error(f"--world-size takes at most one --only scenario, from: {', '.join(known)}; got {', '.join(args.only)}")
    demo = fleet.FleetDemo(world_size=args.world_size, scenario=args.only[0] if args.only else fleet.DEFAULT_SCENARIO,
                           steps=args.steps, manager=canary.manager_options(), device=device, backend=args.backend)
    try:
        ok = fleet.run(demo, out_dir=args.out, metrics_port=args.metrics_port, stream=sys.stdout)
    except MetricsPortUnavailable as e:
        ap.error(str(e).removeprefix("kv-canary: "))
    except (RuntimeError, TimeoutError) as e:
        sys.stdout.write(f"FLEET DEMO FAILED: {e}\n")
        return 1
    return 0 if ok else 1
