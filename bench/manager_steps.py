"""The CanaryManager's host cost per serving step, on a minimal engine of one fixed batch shape.

A StepEngine implements the engine protocol kv_canary/engine/manager.py reads (canary_pools, device, cfg,
req_rows, req_to_token, requests' rid/row/matched, cached_entries) for `requests` requests whose
slots lie side by side (slot = 1 + request * max_ctx + position, page size 1) and whose token ids
are known in advance (handed to the manager once, so every verify checks expected tokens). A step
builds its batch tensors afresh, as an engine does, then runs the manager's step: prepare + HEAD
(plan, verify, write) + TAIL (verify, write) + after_step (snapshot, poll, drain). Nothing is
corrupted, so a step that reports a violation is an error (the manager runs in mode "raise").

- decode: every request holds `prefix` tokens (written by one untimed prefill) and each step appends
  one token per request, so the HEAD/TAIL verifies check the whole prefix of every request;
- prefill: every step writes `extend` tokens per request from position 0 (the same slots again).

Used by bench/bench_host.py (torch and emulated backends on the CPU) and bench/bench_gpu.py (cuda).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from kv_canary.demo.sim.pool import KvStorage
from kv_canary.engine.manager import CanaryManager, KvPoolView
from kv_canary.engine.request_inputs import namespace_of
from kv_canary.trees.loader import default_tree

LAYERS = 2          # K and V tensors per layer, all fingerprinted (mode ALL)
BYTES_PER_TOKEN = 64


def token(request: int, position: int) -> int:
    return 1 + (request * 7919 + position * 104_729) % 50_000


class StepEngine:
    """The engine side of the manager's protocol for one batch shape (see the module docstring)."""

    def __init__(self, *, requests: int, max_ctx: int, device):
        self.device = torch.device(device)
        self.cfg = SimpleNamespace(max_running=requests, max_ctx=max_ctx)
        self.req_rows = requests + 1                       # row 0 is the padding row
        self.num_slots = 1 + requests * max_ctx            # slot 0 is the padding slot
        slots = torch.arange(1, self.num_slots, dtype=torch.int32, device=self.device).view(requests, max_ctx)
        self.req_to_token = torch.cat([torch.zeros((1, max_ctx), dtype=torch.int32, device=self.device), slots])
        self.storage = KvStorage(LAYERS, self.num_slots, 1, BYTES_PER_TOKEN, self.device)
        for half in self.storage.halves():
            for t in half:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        self.epoch = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self.requests = [SimpleNamespace(rid=r + 1, row=r + 1, matched=0) for r in range(requests)]

    def slot(self, row: int, position: int) -> int:
        """req_to_token[row, position], computed on the host (no device read)."""
        return 1 + (row - 1) * self.cfg.max_ctx + position

    def canary_pools(self) -> dict:
        return {"full": KvPoolView(self.storage, window=0, full_to_pool=None, allocation_epoch=self.epoch,
                                   out_cache_loc=lambda batch: batch.out_cache_loc)}

    def cached_entries(self):
        return [], [], [], []

    def tell_tokens(self, manager: CanaryManager) -> None:
        """Every request's token ids up to max_ctx, known to the manager before the first step."""
        for r in self.requests:
            manager.on_tokens(r.row, 0, [token(r.rid, p) for p in range(self.cfg.max_ctx)])

    def batch(self, step: int, *, prefix: int, extend: int):
        """Fresh batch tensors (as an engine builds them every step): each request extends its
        `prefix` tokens by `extend`."""
        n = len(self.requests)
        ids, pos, locs, rids = [], [], [], []
        for r in self.requests:
            for p in range(prefix, prefix + extend):
                ids.append(token(r.rid, p))
                pos.append(p)
                locs.append(self.slot(r.row, p))
                rids.append(r.rid)
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        return SimpleNamespace(step=step, requests=list(self.requests), bs=n,
                               req_pool_indices=t([r.row for r in self.requests]), prefix_lens=t([prefix] * n),
                               extend_seq_lens=t([extend] * n), input_ids=t(ids), positions=t(pos),
                               out_cache_loc=t(locs), token_rids=t(rids))


class KernelClock:
    """Time spent in, and number of, the backend's launch calls: the torch reference's operations or
    the emulated library's kernel launches (kernel execution: the rest of a step is host overhead),
    or the cuda backend's kernel launches (their driver calls: host time too, kernels run
    asynchronously). The plan is one operation of the reference and two kernel launches."""

    def __init__(self, runtime, backend: str, device="cpu"):
        self.backend, self.seconds, self.launches = backend, 0.0, 0
        b = runtime.backend(backend)
        # Installed before the manager attaches: its launches are bound then, through these.
        self._restore = []
        if backend == "torch":
            ref = b.reference
            self._restore.append((b, "reference", ref, "reference" in vars(b)))
            b.reference = SimpleNamespace(**{op: self._timed(getattr(ref, op))
                                             for op in ("write", "verify", "plan", "plan_offsets", "plan_entries",
                                                        "scatter")})
        elif backend == "emulated":
            launcher = b.library.launcher
            self._restore.append((b.library, "launcher", launcher, "launcher" in vars(b.library)))
            b.library.launcher = lambda *a, **kw: self._timed(launcher(*a, **kw))
        elif backend == "cuda":
            mods = b.warm_up(device)
            launcher = mods.launcher
            self._restore.append((mods, "launcher", launcher, "launcher" in vars(mods)))
            mods.launcher = lambda *a, **kw: self._timed(launcher(*a, **kw))

    def close(self) -> None:
        """Put the backend's own functions back (launches bound meanwhile keep the timed ones)."""
        for obj, name, value, own in reversed(self._restore):
            if own:
                setattr(obj, name, value)
            else:
                delattr(obj, name)  # a method: drop the instance attribute that shadowed it
        self._restore = []

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.launches += 1
        return timed


def manager_for(engine: StepEngine, backend: str, tree=None) -> CanaryManager:
    """Mode raise, every check on; `tree`: another schema's (its request_input fields get a namespace
    per request, four tenants)."""
    fields = [f.name for f in (tree or default_tree()).layout.INPUT_FIELDS if f.source == "request_input"]
    m = CanaryManager(mode="raise", real_kv_hash_mode="ALL", sweep_interval=0, backend=backend,
                      check_verify_expected_token=True, ring_capacity=1024, tree=tree,
                      request_inputs=lambda r: {name: namespace_of("tenant", r.rid % 4) for name in fields})
    m.attach(engine)
    engine.tell_tokens(m)
    return m


def run_step(manager: CanaryManager, batch) -> None:
    manager.stage(batch)
    manager.launch_head(batch)
    manager.tail(batch)
    manager.after_step(batch.step)


def measure(kind: str, *, requests: int, tokens: int, steps: int, backend: str, device,
            sync=lambda: None, clock: KernelClock | None = None, tree=None) -> dict:
    """Host seconds per step of a `kind` ("decode": `tokens` prefix tokens per request, one appended per
    step; "prefill": `tokens` written per request per step), best and median over `steps` steps."""
    if kind == "decode":
        engine = StepEngine(requests=requests, max_ctx=tokens + steps + 2, device=device)
        manager = manager_for(engine, backend, tree)
        run_step(manager, engine.batch(0, prefix=0, extend=tokens))  # untimed: writes every prefix
        shape = lambda s: dict(prefix=tokens + s, extend=1)  # noqa: E731
    else:
        engine = StepEngine(requests=requests, max_ctx=tokens, device=device)
        manager = manager_for(engine, backend, tree)
        shape = lambda s: dict(prefix=0, extend=tokens)  # noqa: E731
    run_step(manager, engine.batch(1, **shape(0)))  # warm-up: compiles, allocates, prepares the launches
    times, kernel, launches = [], [], []
    for s in range(1, steps + 1):
        batch = engine.batch(s + 1, **shape(s))
        sync()
        before = (clock.seconds, clock.launches) if clock else (0.0, 0)
        start = time.perf_counter()
        run_step(manager, batch)
        times.append(time.perf_counter() - start)
        if clock:
            kernel.append(clock.seconds - before[0])
            launches.append(clock.launches - before[1])
    sync()
    if clock:
        clock.close()
    manager.drain()
    if manager.stats.total:
        raise RuntimeError(f"manager step bench: {manager.stats.total} violation(s) in a clean run")
    order = sorted(range(len(times)), key=times.__getitem__)
    median = order[len(order) // 2]
    out = {"kind": kind, "backend": backend, "requests": requests, "tokens": tokens, "steps": steps,
           "step_ms_best": times[order[0]] * 1e3, "step_ms_median": times[median] * 1e3}
    if clock:
        outside = [t - k for t, k in zip(times, kernel)]
        out.update(launches_per_step=launches[0], in_launch_calls_ms_median=kernel[median] * 1e3,
                   outside_launch_calls_ms_best=min(outside) * 1e3,
                   outside_launch_calls_ms_median=sorted(outside)[len(outside) // 2] * 1e3)
    return out


def describe(r: dict) -> str:
    what = (f"decode, {r['requests']} requests x {r['tokens']:,} prefix tokens" if r["kind"] == "decode"
            else f"prefill, {r['requests']} x {r['tokens']:,} tokens")
    line = (f"manager step ({r['backend']}; {what}): {r['step_ms_median']:.2f} ms per step "
            f"(best {r['step_ms_best']:.2f})")
    if "launches_per_step" not in r:
        return line
    n = max(1, r["launches_per_step"])
    if r["backend"] == "cuda":  # kernels run asynchronously: the whole step is host time
        return (line + f" of host time for {r['launches_per_step']} launches = {r['step_ms_median'] * 1e3 / n:.0f} us "
                f"per launch, {r['in_launch_calls_ms_median'] * 1e3 / n:.0f} us of it in the driver's launch calls")
    return (line + f"; kernels {r['in_launch_calls_ms_median']:.2f} ms, host overhead "
            f"{r['outside_launch_calls_ms_median']:.2f} ms (best {r['outside_launch_calls_ms_best']:.2f}) for "
            f"{r['launches_per_step']} launches = {r['outside_launch_calls_ms_median'] * 1e3 / n:.0f} us per launch")
