"""Scenarios that drive SGLang's canary runtime (sglang.srt.kv_canary, on the CPU) like its model
runner does, and record everything a user of it can observe.

Run as a worker, one process per kernel provider (the hook registry patches modules process-wide):

    python sglang_scenarios.py --provider sglang  OUT.json   # SGLang's own launchers (torch references)
    python sglang_scenarios.py --provider plugin  OUT.json   # KV_CANARY_SGLANG=1 + load_plugins()

Each scenario builds a fresh CanaryManager over a small MHA (or SWA) pool, runs a few prefill and
decode batches of several requests, and records: every log record of SGLang's canary loggers
(violation reports, stats lines, sweep and perturb lines), every exception the runtime raised
(mode raise, the health check), the kernel- and slot-run counters after each step, the canary
buffers' bytes after each step, the violation ring, and the arguments of every launcher call. With
the plugin it also scrapes the Prometheus endpoint (mid-run in one perturb scenario, and after the
last step of each). SGLang's five perturb modules all run here: req_to_token, real_kv_used,
real_kv_unused_cache (over a stand-in radix cache), real_kv_post_forward, and next_token_swap (in the
place of SGLang's oracle sampler, which needs the model server's sampler layer).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import os
import random
import sys
import urllib.request
from array import array
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_cpu  # noqa: E402

sglang_cpu.install()

import torch  # noqa: E402
from sglang.kernels.ops.kv_canary.consts import RealKvHashMode  # noqa: E402
from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities  # noqa: E402
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode  # noqa: E402
from sglang.srt.kv_canary.perturb.config import PerturbConfig, TargetGroupKind  # noqa: E402
from sglang.srt.kv_canary.pool_patcher.adapters.mha import attach_mha  # noqa: E402
from sglang.srt.kv_canary.pool_patcher.adapters.swa import attach_swa  # noqa: E402
from sglang.srt.kv_canary.pool_patcher.buffer_alloc import resolve_real_kv_read_bytes  # noqa: E402
from sglang.srt.kv_canary.req_to_expected_token_ids_manager import compute_req_all_ids_info  # noqa: E402
from sglang.srt.kv_canary.runner.canary_manager import CanaryManager, context_tuple  # noqa: E402
from sglang.srt.kv_canary.token_oracle.oracle import HashOracle  # noqa: E402
from sglang.srt.kv_canary.token_oracle.oracle_manager import TokenOracleManager  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

LAUNCHERS = {
    "verify": "sglang.kernels.ops.kv_canary.verify.launch_canary_verify_kernel",
    "write": "sglang.kernels.ops.kv_canary.write.launch_canary_write_kernel",
    "plan": "sglang.kernels.ops.kv_canary.plan.api.launch_canary_plan_kernels",
    "scatter": "sglang.kernels.ops.kv_canary.scatter_req_token_ids.launch_scatter_req_token_ids_kernel",
}
CANARY_LOGGER = "sglang.srt.kv_canary"
DEVICE = torch.device(os.environ.get("KV_CANARY_SGLANG_TEST_DEVICE", "cpu"))


# -- what SGLang's runtime sends: every launcher call, argument by argument ---------------------------
def describe(value):
    """A JSON summary of one argument: tensors by dtype/shape/stride/device, dataclasses field by field."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "stride": list(value.stride()), "device": value.device.type,
                "contiguous": value.is_contiguous(), "storage_offset": value.storage_offset()}
    if dataclasses.is_dataclass(value):
        return {"class": type(value).__module__ + "." + type(value).__qualname__,
                **{f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


CALLS: list = []


def recorder(name: str):
    def around(original, *args, **kwargs):
        CALLS.append({"launcher": name, "args": len(args), "kwargs": {k: describe(v) for k, v in kwargs.items()}})
        return original(*args, **kwargs)
    return around


def load_provider(provider: str) -> dict:
    """Register the call recorder, then load the plugins the way SGLang's processes do; returns which
    launchers something other than SGLang's own code now runs."""
    from sglang.srt.plugins import load_plugins

    before = {name: _resolve(target) for name, target in LAUNCHERS.items()}
    for name, target in LAUNCHERS.items():   # AROUND: applied over whatever REPLACE the plugins register
        HookRegistry.register(target, recorder(name), HookType.AROUND)
    if provider == "sglang":
        os.environ.pop("KV_CANARY_SGLANG", None)
        # SGLang's scatter is Triton only (no torch fallback): its side uses SGLang's test reference.
        from sglang.test.kernels.kv_canary.scatter_req_token_ids_reference import (
            scatter_req_token_ids_torch_reference,
        )
        HookRegistry.register(LAUNCHERS["scatter"], scatter_req_token_ids_torch_reference, HookType.REPLACE)
    else:
        os.environ["KV_CANARY_SGLANG"] = "1"
        os.environ.setdefault("KV_CANARY_SGLANG_METRICS_PORT", "0")   # 0: any free port
        if not has_entry_point():   # a checkout on PYTHONPATH (make gpu-check), kv-canary not installed
            from kv_canary.integrations.sglang import load
            load()                  # what SGLang's loader calls through the entry point
    load_plugins()
    return {name: _resolve(target).__wrapped__ is not before[name] for name, target in LAUNCHERS.items()}


def has_entry_point() -> bool:
    from importlib.metadata import entry_points
    return any(ep.name == "kv_canary" for ep in entry_points(group="sglang.srt.plugins"))


def _resolve(target: str):
    import pkgutil
    return pkgutil.resolve_name(target)


# -- a small serving engine around SGLang's CanaryManager ----------------------------------------------
class Pool:
    """An MHA KV pool as SGLang's pool attachers see it (k_buffer / v_buffer per layer, page size 1)."""

    def __init__(self, num_slots: int, dim: int = 16, layers: int = 2):
        self.layer_num, self.page_size = layers, 1
        self.k_buffer = [torch.zeros(num_slots, dim, dtype=torch.float16, device=DEVICE) for _ in range(layers)]
        self.v_buffer = [torch.zeros(num_slots, dim, dtype=torch.float16, device=DEVICE) for _ in range(layers)]

    def get_contiguous_buf_infos(self):
        bufs = self.k_buffer + self.v_buffer
        return [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes for b in bufs]


class SwaPool:
    """A hybrid SWA pool: a full sub-pool, an SWA sub-pool and the full -> SWA index LUT."""

    def __init__(self, num_slots: int, shift: int = 3):
        self.page_size = 1
        self.full_kv_pool = Pool(num_slots)
        self.swa_kv_pool = Pool(num_slots + shift)
        self.full_to_swa_index_mapping = torch.zeros(num_slots + 1, dtype=torch.int64, device=DEVICE)
        self.full_to_swa_index_mapping[1:num_slots] = torch.arange(1, num_slots) + shift   # slot 0 stays padding

    def get_contiguous_buf_infos(self):
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self):
        return self.swa_kv_pool.get_contiguous_buf_infos()


@dataclasses.dataclass
class Request:
    row: int
    origin_input_ids: array
    output_ids: array
    slots: list


class Engine:
    """Builds batches, runs SGLang's canary brackets around a toy forward, records what happens."""

    def __init__(self, *, config: CanaryConfig, perturb: PerturbConfig, swa_window: int = 0, num_slots: int = 96,
                 max_reqs: int = 6, max_ctx: int = 40, oracle=None):
        self.config, self.oracle = config, oracle
        self.pool = SwaPool(num_slots) if swa_window else Pool(num_slots)
        self.req_to_token_pool = SimpleNamespace(
            req_to_token=torch.zeros(max_reqs, max_ctx, dtype=torch.int32, device=DEVICE),
            size=max_reqs, max_context_len=max_ctx)
        attach = attach_swa if swa_window else attach_mha
        self.groups = attach(pool=self.pool, device=DEVICE, read_bytes=resolve_real_kv_read_bytes(config),
                             kv_token_id_vs_position_offset=0)
        self.manager = CanaryManager(
            config=config, perturb_config=perturb, buffer_groups=self.groups, device=DEVICE,
            req_to_token_pool=self.req_to_token_pool,
            launch_capacities=CanaryLaunchCapacities(per_forward_verify_capacity=num_slots * 3,
                                                     per_forward_write_req_capacity=max_reqs,
                                                     per_forward_write_entry_capacity=max_reqs * max_ctx),
            swa_window_size=swa_window,
            token_oracle_manager=None if oracle is None else TokenOracleManager(oracle=oracle))
        self.manager.mark_init_finished()
        self.next_slot, self.next_row, self.step_no = 1, 1, 0
        self.requests: dict[str, Request] = {}
        self.record = {"errors": [], "counters": [], "buffers": []}

    # the engine's side: rows, slots and tokens
    def new_request(self, name: str, tokens: list[int], *, share_prefix_of: str | None = None,
                    shared: int = 0) -> tuple[Request, int]:
        req = Request(self.next_row, array("q", tokens), array("q"), [])
        self.next_row += 1
        if share_prefix_of is not None:    # a radix-cache hit: the prefix's slots are reused
            req.slots = list(self.requests[share_prefix_of].slots[:shared])
            self.req_to_token_pool.req_to_token[req.row, :shared] = torch.tensor(req.slots, dtype=torch.int32)
        self.requests[name] = req
        return req, shared

    def _alloc(self, req: Request, n: int) -> list[int]:
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        start = len(req.slots)
        req.slots += slots
        self.req_to_token_pool.req_to_token[req.row, start:start + n] = torch.tensor(slots, dtype=torch.int32)
        return slots

    def prefill(self, items: list[tuple[str, list[int], dict]]) -> None:
        ids, pos, locs, prefix_lens, extend_lens, reqs = [], [], [], [], [], []
        for name, tokens, share in items:
            req, shared = self.new_request(name, tokens, **share)
            new = self._alloc(req, len(tokens) - shared)
            ids += tokens[shared:]
            pos += list(range(shared, len(tokens)))
            locs += new
            prefix_lens.append(shared)
            extend_lens.append(len(tokens) - shared)
            reqs.append(req)
        self._forward(sglang_cpu.EXTEND, reqs, ids, pos, locs, prefix_lens, extend_lens)

    def decode(self, names: list[str], *, written_token=None, sampler=None) -> None:
        """One decode step: each request's last sampled token is appended (`sampler` post-processes the
        batch's sampled tokens, as SGLang's sampler backends do)."""
        ids, pos, locs, reqs = [], [], [], []
        sampled = [self.sampled(self.requests[name], len(self.requests[name].slots)) for name in names]
        if sampler is not None:
            sampled = sampler(torch.tensor(sampled, dtype=torch.int64)).tolist()
        for name, token in zip(names, sampled):
            req = self.requests[name]
            req.output_ids.append(token)
            p = len(req.slots)
            locs += self._alloc(req, 1)
            ids.append(written_token(name, token) if written_token else token)
            pos.append(p)
            reqs.append(req)
        self._forward(sglang_cpu.DECODE, reqs, ids, pos, locs, None, None)

    def sampled(self, req: Request, position: int) -> int:
        """What the "model" sampled for `position` (the token oracle's choice when there is one)."""
        if self.oracle is None:
            return 1000 + 7 * position + req.row
        as_t = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
        return int(self.oracle.expected_tokens(generalized_req_ids=as_t(req.row), positions=as_t(position))[0])

    def _forward(self, mode, reqs, ids, pos, locs, prefix_lens, extend_lens) -> None:
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
        flat, lens = (compute_req_all_ids_info(reqs) if self.config.enable_verify_token_assert else (None, None))
        rows = as_t([r.row for r in reqs])
        seq_lens = torch.tensor([len(r.slots) for r in reqs], dtype=torch.int32, device=DEVICE)
        fb = SimpleNamespace(
            forward_mode=mode, batch_size=len(reqs), req_pool_indices=rows, seq_lens=seq_lens,
            seq_lens_sum=int(seq_lens.sum()), extend_prefix_lens=None if prefix_lens is None else as_t(prefix_lens),
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens=None if extend_lens is None else as_t(extend_lens),
            extend_seq_lens_cpu=extend_lens, spec_info=None, input_ids=as_t(ids).to(torch.int32),
            positions=as_t(pos), out_cache_loc=as_t(locs), global_num_token_non_padded_cpu=len(ids),
            req_all_ids_flat=flat, req_all_ids_lens=lens, rids_int=rows, bootstrap_room_ids_int=None)
        m = self.manager
        try:
            # ModelRunner.forward's bracket, then api._patch_model_forward's pre/post around model.forward
            with context_tuple(m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb),
                               m.with_active_single_forward_manager(0)):
                with m.model_forward_bracket_scope():
                    pre = m.pre_ops_maybe_inside_graph(fb)
                    self._model_forward(fb)
                    m.post_ops_maybe_inside_graph(fb, pre)
        except Exception as exc:   # mode raise, the health check, or a launcher refusing SGLang's call
            chain = [exc] + ([exc.__context__] if exc.__context__ is not None else [])
            self.record["errors"].append({"step": self.step_no, "type": type(exc).__name__, "text": str(exc),
                                          "during": [f"{type(x).__name__}: {x}" for x in chain[1:]]})
        self.step_no += 1
        state = m._device_state
        self.record["counters"].append({"kernel": state.kernel_run_counters.tolist(),
                                        "slot": state.slot_run_counters.tolist(),
                                        "write_index": int(state.violation_log.violation_write_index[0])})
        self.record["buffers"].append(self.buffer_digest())

    def _model_forward(self, fb) -> None:
        """The toy model writes each new token's K and V rows (a function of token, position, layer)."""
        ids, pos = fb.input_ids.to(torch.float32), fb.positions.to(torch.float32)
        pools = [self.pool] if not isinstance(self.pool, SwaPool) else [self.pool.full_kv_pool, self.pool.swa_kv_pool]
        for i, pool in enumerate(pools):
            locs = fb.out_cache_loc if i == 0 else self.pool.full_to_swa_index_mapping[fb.out_cache_loc]
            for layer in range(len(pool.k_buffer)):
                cols = torch.arange(pool.k_buffer[layer].shape[1], dtype=torch.float32, device=DEVICE)
                pool.k_buffer[layer][locs] = (ids[:, None] * 0.5 + pos[:, None] + cols + layer).to(torch.float16)
                pool.v_buffer[layer][locs] = (ids[:, None] - pos[:, None] * 0.25 - cols - layer).to(torch.float16)

    def buffer_digest(self) -> str:
        h = hashlib.sha256()
        for g in self.groups:
            for buf in (g.k_head, g.k_tail, g.v_head, g.v_tail):
                h.update(buf.cpu().numpy().tobytes())
        return h.hexdigest()

    def finish(self) -> dict:
        log = self.manager._device_state.violation_log
        wi = int(log.violation_write_index[0])
        self.record["ring"] = log.violation_ring[:min(wi, log.violation_ring.shape[0])].tolist()
        self.record["write_index"] = wi
        self.record["canary_bytes"] = {f"{g.kind.name}.{half}": getattr(g, half).cpu().numpy().tobytes().hex()
                                       for g in self.groups for half in ("k_head", "k_tail", "v_head", "v_tail")}
        return self.record


def make_config(*, mode=CanaryMode.LOG, real=RealKvHashMode.NONE, sweep=0, token_assert=False, stats=3,
                input_assert=False):
    return CanaryConfig(mode=mode, ring_capacity=1024, sweep_interval=sweep, real_kv_hash_mode=real,
                        enable_write_input_assert=input_assert, enable_verify_token_assert=token_assert,
                        stats_print_every_n_steps=stats)


def make_perturb(**probs):
    fields = dict(req_to_token_prob=0.0, real_kv_used_prob=0.0, real_kv_unused_cache_prob=0.0,
                  real_kv_post_forward_prob=0.0, target_group_kind=None, warmup_steps=2)
    fields.update(probs)
    if any(v for k, v in fields.items() if k.startswith("real_kv") and isinstance(v, float)):
        fields["target_group_kind"] = TargetGroupKind.FULL
    return PerturbConfig(**fields)


# -- the workload: several requests, prefill and decode, a radix-cache prefix hit ------------------------
def workload(e: Engine, *, between=None, decode_rounds: int = 3) -> None:
    """prefill A, B; decode A, B; prefill C and D (D reuses A's first 3 slots); decode all four."""
    hook = between or (lambda step: None)
    e.prefill([("A", [11, 12, 13, 14, 15], {}), ("B", [21, 22, 23], {})])
    hook(0)
    for i in range(decode_rounds):
        e.decode(["A", "B"])
        hook(1 + i)
    e.prefill([("C", [31, 32, 33, 34], {}), ("D", [11, 12, 13, 41, 42], {"share_prefix_of": "A", "shared": 3})])
    hook(1 + decode_rounds)
    for i in range(decode_rounds):
        e.decode(["A", "B", "C", "D"])
        hook(2 + decode_rounds + i)


def redirect_req_to_token(e: Engine, at: int):
    """After step `at`, request B's position 1 points at one of A's slots (a slot-table bug)."""
    def between(step):
        if step == at:
            e.req_to_token_pool.req_to_token[e.requests["B"].row, 1] = e.requests["A"].slots[2]
    return between


def overwrite_kv(e: Engine, at: int, *, half: str = "k"):
    """After step `at`, A's slot 1 K (or V) bytes change after they were fingerprinted."""
    def between(step):
        if step == at:
            pool = e.pool.full_kv_pool if isinstance(e.pool, SwaPool) else e.pool
            buf = (pool.k_buffer if half == "k" else pool.v_buffer)[0]
            buf[e.requests["A"].slots[1], 0] += 1
    return between


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sc_clean(run):
    e = run(make_config(real=RealKvHashMode.ALL))
    workload(e)
    return e


def sc_redirected_req_to_token(run):
    e = run(make_config())
    workload(e, between=redirect_req_to_token(e, 1))
    return e


def sc_kv_bytes_changed(run):
    e = run(make_config(real=RealKvHashMode.ALL))
    workload(e, between=overwrite_kv(e, 1))
    return e


def sc_mha_v(run):
    with env(SGLANG_KV_CANARY_ENABLE_MHA_V=1):
        e = run(make_config(real=RealKvHashMode.PARTIAL))
        workload(e, between=overwrite_kv(e, 2, half="v"))
    return e


def sc_raise(run):
    e = run(make_config(mode=CanaryMode.RAISE))
    workload(e, between=redirect_req_to_token(e, 1))
    return e


def sc_perturb_req_to_token(run):
    e = run(make_config(), make_perturb(req_to_token_prob=0.5))
    workload(e, between=SCRAPE_HOOK)
    return e


def sc_perturb_real_kv_used(run):
    e = run(make_config(real=RealKvHashMode.ALL), make_perturb(real_kv_used_prob=0.6))
    workload(e)
    return e


def sc_perturb_real_kv_post_forward(run):
    e = run(make_config(real=RealKvHashMode.ALL), make_perturb(real_kv_post_forward_prob=0.6))
    workload(e)
    return e


def sc_perturb_real_kv_unused_cache(run):
    """The sweep verifies cached (orphan) slots; the perturb flips K bytes of one of them."""
    e = run(make_config(real=RealKvHashMode.ALL, sweep=2), make_perturb(real_kv_unused_cache_prob=1.0))
    radix = sglang_cpu.RadixCacheStandIn(e.req_to_token_pool)
    e.manager.attach_radix_cache(radix)

    def between(step):
        if step == 0:
            radix.chains = [list(e.requests["B"].slots)]    # B's prompt is cached, B is done with it
    workload(e, between=between)
    return e


def sc_stalled_sweep(run):
    """A sweep interval without an attached radix cache: the sweep tags never launch, and the health
    check (step 100) says so."""
    e = run(make_config(sweep=10, stats=50), max_ctx=112, num_slots=120)
    e.prefill([("A", [5, 6, 7], {})])
    for _ in range(100):
        e.decode(["A"])
    return e


def sc_verify_token_assert(run):
    """The token check on: D's decode writes a token other than the one its request records."""
    e = run(make_config(token_assert=True))
    workload(e, between=None)
    e.decode(["A", "B", "C", "D"], written_token=lambda name, token: token + 1 if name == "D" else token)
    for _ in range(2):   # the next forward verifies the token, the one after reports it
        e.decode(["A", "B", "C", "D"])
    return e


def sc_write_input_assert(run):
    """The write's input check against SGLang's token oracle: one decode writes another token."""
    e = run(make_config(input_assert=True), oracle=HashOracle(vocab_size=5000))
    workload(e)
    e.decode(["A", "B", "C", "D"], written_token=lambda name, token: token + 1 if name == "B" else token)
    e.decode(["A", "B", "C", "D"])
    return e


def sc_perturb_next_token_swap(run):
    """SGLang's next-token-swap perturb in the oracle sampler's place; the write-input assert sees it."""
    from sglang.srt.kv_canary.perturb import next_token_swap

    with env(SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB=0.5, SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS=1):
        next_token_swap._config, next_token_swap._step_counter = None, 0   # its config is read once per process
        e = run(make_config(input_assert=True), oracle=HashOracle(vocab_size=5000))
        e.prefill([("A", [11, 12, 13], {}), ("B", [21, 22], {}), ("C", [31, 32, 33, 34], {})])
        for _ in range(6):
            e.decode(["A", "B", "C"], sampler=next_token_swap.maybe_perturb_swap_next_tokens)
        next_token_swap._config = None
    return e


def sc_swa(run):
    e = run(make_config(real=RealKvHashMode.ALL), swa_window=4)
    workload(e, between=redirect_req_to_token(e, 2))
    return e


SCENARIOS = {name[3:]: fn for name, fn in globals().items() if name.startswith("sc_")}
SCRAPE_HOOK = None
EMULATED_SCENARIOS = ("redirected_req_to_token",)


def run_scenario(name: str, scrape_metrics: bool) -> dict:
    global SCRAPE_HOOK
    random.seed(1234)
    torch.manual_seed(1234)
    CALLS.clear()
    records: list = []
    handler = _ListHandler(records)
    logger = logging.getLogger(CANARY_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    scrapes: list = []
    jsonl = os.environ.get("KV_CANARY_SGLANG_VIOLATIONS_JSONL")
    jsonl_start = os.path.getsize(jsonl) if jsonl and os.path.exists(jsonl) else 0
    SCRAPE_HOOK = (lambda step: scrapes.append(scrape()) if step == 5 else None) if scrape_metrics else None
    engines: list = []

    def run(config, perturb=None, **kw):
        engines.append(Engine(config=config, perturb=perturb or make_perturb(), **kw))
        return engines[-1]
    try:
        SCENARIOS[name](run)
    finally:
        logger.removeHandler(handler)
    result = engines[0].finish()
    if jsonl and os.path.exists(jsonl):   # the lines this scenario's managers appended
        with open(jsonl, encoding="utf-8") as fh:
            fh.seek(jsonl_start)
            result["jsonl"] = [json.loads(line) for line in fh.read().splitlines()]
    result["logs"] = records
    result["calls"] = list(CALLS)
    if scrape_metrics:
        scrapes.append(scrape())       # after the last step
        result["scrapes"] = scrapes
    return result


def scrape() -> str:
    from kv_canary.integrations.sglang import metrics_server
    server = metrics_server()
    with urllib.request.urlopen(server.url, timeout=10) as r:
        return r.read().decode()


class _ListHandler(logging.Handler):
    def __init__(self, out: list):
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record):
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:   # SGLang's loader logs a plugin's error so
            message += f"\n{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.out.append([record.name, record.levelname, message])


BROKEN = {"on": False}


def break_write() -> None:
    """A kv-canary write launcher with a bug, once BROKEN["on"]: it drops every request's chain seed."""
    from kv_canary.integrations.sglang import hooks

    correct = hooks.REPLACEMENTS["write"]

    def broken(*, plan, **kwargs):
        if BROKEN["on"]:
            plan.write_seed_slot_indices.fill_(-1)
        correct(plan=plan, **kwargs)
    hooks.REPLACEMENTS["write"] = broken


def tree_checks() -> dict:
    """The plugin's tree check on the default tree and on every example schema's tree."""
    from kv_canary import generate_tree
    from kv_canary.integrations.sglang import compat
    from kv_canary.trees import schemas as trees

    out = {}
    schemas = sorted(trees.SCHEMAS_DIR.glob("*.yaml"))
    for name, tree in [("default", None)] + [(p.stem, generate_tree(p)) for p in schemas]:
        try:
            compat.check_tree(None if tree is None else tree.layout)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def probe(without: str, busy_metrics_port: bool) -> dict:
    """The plugin loaded into an SGLang that lacks one target (`without`: a hooks.TARGETS name, removed
    from its module first, as in a fork or dev build), or with a metrics port another socket holds;
    then one canary manager built. Records which of the five targets are replaced, what the loader
    and kv-canary logged, and how building the manager ended."""
    import importlib
    import socket

    from sglang.srt.plugins import load_plugins

    from kv_canary.integrations.sglang import hooks

    if without:
        module, _, attr = hooks.TARGETS[without].rpartition(".")
        delattr(importlib.import_module(module), attr)
    holder = None
    if busy_metrics_port:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        os.environ["KV_CANARY_SGLANG_METRICS_PORT"] = str(holder.getsockname()[1])
    os.environ["KV_CANARY_SGLANG"] = "1"
    if not has_entry_point():   # what SGLang's loader does with the entry point: run it, log a failure
        from kv_canary.integrations.sglang import load
        try:
            load()
        except Exception:
            logging.getLogger("sglang.srt.plugins").exception("Failed to execute general plugin: kv_canary")
    load_plugins()
    replaced = {}
    for name, target in hooks.TARGETS.items():
        try:
            replaced[name] = hasattr(_resolve(target), "__wrapped__")   # SGLang's hook wrappers carry it
        except (ImportError, AttributeError):
            replaced[name] = "missing"
    try:
        Engine(config=make_config(), perturb=make_perturb())
        built = "built"
    except Exception as exc:
        built = f"{type(exc).__name__}: {exc}"
    if holder is not None:
        holder.close()
    return {"replaced": replaced, "manager": built, "port": os.environ.get("KV_CANARY_SGLANG_METRICS_PORT")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", choices=("sglang", "plugin"), required=True)
    parser.add_argument("--without", default="", help="probe(): a plugin target this SGLang lacks")
    parser.add_argument("--busy-metrics-port", action="store_true", help="probe(): a metrics port already taken")
    parser.add_argument("--scenarios", default="all")
    parser.add_argument("--broken", default="",
                        help="scenarios to run once more with kv-canary's write launcher broken on purpose")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    plugin_log: list = []
    logging.getLogger("kv_canary").addHandler(_ListHandler(plugin_log))
    logging.getLogger("kv_canary").setLevel(logging.INFO)
    logging.getLogger("sglang.srt.plugins").addHandler(_ListHandler(plugin_log))
    if args.without or args.busy_metrics_port:
        out = {**probe(args.without, args.busy_metrics_port), "plugin_log": plugin_log}
        Path(args.out).write_text(json.dumps(out))
        return 0
    if args.broken:
        break_write()
    if args.provider == "plugin":   # every violation as a JSON line too (kv_canary.engine.jsonl)
        os.environ.setdefault("KV_CANARY_SGLANG_VIOLATIONS_JSONL", args.out + ".violations.jsonl")
    replaced = load_provider(args.provider)
    names = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    out = {"provider": args.provider, "replaced": replaced, "plugin_log": plugin_log, "entry_point": has_entry_point(),
           "backend": os.environ.get("KV_CANARY_BACKEND", ""), "scenarios": {}}
    import time
    for name in names:
        start = time.perf_counter()
        out["scenarios"][name] = run_scenario(name, scrape_metrics=args.provider == "plugin")
        out["scenarios"][name]["seconds"] = time.perf_counter() - start   # not compared: timing only
    BROKEN["on"] = True
    out["broken"] = {name: run_scenario(name, scrape_metrics=False) for name in filter(None, args.broken.split(","))}
    if args.provider == "plugin":
        out["tree_checks"] = tree_checks()
    Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
