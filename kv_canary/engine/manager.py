"""CanaryManager: the canary state of one KV pool and the per-step protocol an engine drives.

Per forward step: plan -> HEAD verify + write -> (the model's forward) -> TAIL verify + write, and
every `sweep_interval` steps a SWEEP over the cached slots. HEAD writes claim the new slots before
the forward (no fingerprint: the K/V bytes are not written yet), so a request that reads a slot
someone else just claimed fails its TAIL verify in the same step; TAIL writes store the real K/V
fingerprint. What it needs from an engine is kv_canary.engine.contract (checked at attach).

Every launch is bound at attach over buffers the manager owns; a step stages the batch into them
(device copies), so a CUDA graph can capture `launch_head(batch)` and `tail(batch)` once
`stage(batch)` (host side) ran outside it. The per-request and per-token buffers follow the work,
not the cache: their columns start at the context the engine has admitted so far (`initial_context`,
at most the engine's max_ctx) and double on demand, in `on_tokens` and `stage` (host side, outside
any graph: a growth rebinds the launches, `resizes` counts them); per-step work is proportional to
the batch and its contexts. What it launches comes from the
schema: each launch tag's phase, K/V half and pool group, each input field's value source
(docs/semantics.md §8). SGLang's runtime surface (modes, stats line, health check: docs/semantics.md §9) is
`from_config(CanaryConfig)`; metrics and the fleet decision attach as listeners (engine.listeners).
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..launch.runtime import runtime_for
from ..trees.loader import default_tree
from .config import check_caller_tables, check_count, check_fingerprint_layers, parse_hash_mode, parse_mode
from .contract import KvLayout, KvPoolView, check_engine, check_storage_layouts, slot_table_kind
from .drain import CanaryStats, CanaryViolationError, RingDrain
from .listeners import Listened
from .monitor import CanaryHealthError, RuntimeMonitor
from .reporting import ViolationReporter
from .request_inputs import check_request_values
from .staging import HostStaging
from .violations import Violation, ViolationGroup, group_cascades

logger = logging.getLogger("kv_canary")

# Context columns the per-request and per-token buffers start with (CanaryManager initial_context).
INITIAL_CONTEXT = 256
LATE = "late"       # the launches of same-forward reads, verified after TAIL (Engine.same_forward_reads)
__all__ = ("CanaryManager", "CanaryViolationError", "CanaryHealthError", "CanaryCoverageWarning", "KvPoolView",
           "KvLayout", "CanaryStats")


class CanaryCoverageWarning(UserWarning):
    """Some KV layers are not fingerprinted (a launch reads at most MAX_REAL_KV_SOURCES layers)."""


@dataclass
class _Group:
    name: str                     # the launch-tag group (`full`, `swa`, ...)
    pool: KvPoolView
    num_slots: int
    verify_plan: object
    write_plan: object
    sweep_plan: object
    slot_tables: dict             # input field name -> int64 [num_slots] (allocation epochs, caller tables)
    out_cache_loc: torch.Tensor   # int64 [token capacity]: the step's slots in this pool
    token_inputs: dict            # input field name -> int64 [token capacity]: the step's per-token values
    bufs: dict = field(default_factory=dict)      # half -> canary buffer
    launches: dict = field(default_factory=dict)  # (phase, half, kind) or "plan" -> its PreparedLaunch


class CanaryManager(Listened):
    """The canary of one engine. The plain constructor's defaults check everything (mode log, real-KV
    fingerprint ALL, expected tokens, V buffers, a sweep every 8 steps); `from_config` starts from
    SGLang's defaults instead (docs/sglang-compat.md, Runtime surface). `initial_context`: the
    context columns its per-request and per-token buffers start with (default INITIAL_CONTEXT, at most
    the engine's max_ctx); they grow on demand (docs/attach-your-engine.md, "What the canary costs")."""

    def __init__(self, *, tree=None,
                 layer=None,  # tree's former name (a DeprecationWarning), kept for engines
                 mode: str = "log", real_kv_hash_mode: str = "ALL",
                 check_verify_expected_token: bool = True, ring_capacity: int = 1024, sweep_interval: int = 8,
                 chain_position_assert: bool = True, backend: Optional[str] = None, keep_violations: int = 100_000,
                 fingerprint_layers: Optional[Mapping] = None, caller_tables: Optional[Mapping] = None,
                 enable_write_input_assert: bool = False, enable_mha_v: bool = True,
                 stats_print_every_n_steps: int = 0, request_inputs: Optional[Callable] = None,
                 initial_context: Optional[int] = None):
        self.mode = parse_mode(mode, "mode")
        if layer is not None:  # layer=: tree's former name, kept for engines
            if tree is not None:
                raise ValueError("kv-canary: CanaryManager takes tree= (the generated tree to run) or layer=, its former name, not both")
            warnings.warn("kv-canary: CanaryManager(layer=...) is the former name of CanaryManager(tree=...); "  # former name
                          "pass tree=", DeprecationWarning, stacklevel=2)
            tree = layer  # former name
        self.tree = tree if tree is not None else default_tree()
        self.L = self.tree.layout
        self.real_kv_hash_mode = parse_hash_mode(self.L, real_kv_hash_mode)
        for name, value, low in (("ring_capacity", ring_capacity, 1), ("sweep_interval", sweep_interval, 0),
                                 ("keep_violations", keep_violations, 0),
                                 ("stats_print_every_n_steps", stats_print_every_n_steps, 0)):
            check_count(name, value, low)
        if initial_context is not None:
            check_count("initial_context", initial_context, 1)
        # Context columns the per-request / per-token buffers start with (None: INITIAL_CONTEXT); they
        # grow on demand up to the engine's max_ctx. An engine that captures CUDA graphs passes its
        # max_ctx here, so that no growth moves a captured buffer.
        self.initial_context = initial_context
        self.resizes = 0
        self.check_verify_expected_token = bool(check_verify_expected_token)
        self.ring_capacity = ring_capacity
        self.sweep_interval = sweep_interval
        self.chain_position_assert = bool(chain_position_assert)
        self.enable_write_input_assert = bool(enable_write_input_assert)
        self.enable_mha_v = bool(enable_mha_v)
        # The K/V halves whose launches run: V only when checked (SGLang's ENABLE_MHA_V gate).
        self.halves = tuple(h for h in self.L.LAUNCH_HALVES if h != self.L.STEP_V_HALF or self.enable_mha_v)
        self.stats_print_every_n_steps = stats_print_every_n_steps
        self.backend = backend
        self.keep_violations = keep_violations
        self.fingerprint_layers = check_fingerprint_layers(self.L, fingerprint_layers)
        self.fingerprinted: dict = {}  # group name -> layer indices whose K/V bytes are fingerprinted
        self.rt = runtime_for(self.tree)
        self.alloc = self.rt.allocators
        self.reporter = ViolationReporter(self.L)
        self.tags = tuple(self.L.CanaryLaunchTag)        # index i: kernel_run_counters[i]
        self.sweep_passes = 0
        self.last_step = 0                               # the step of the latest after_step (step_when_pumped)
        self.monitor: Optional[RuntimeMonitor] = None
        self.ring_drain: Optional[RingDrain] = None
        self.listeners: list = []                        # add_listener: metrics, the fleet decision
        self.groups: list[_Group] = []
        self.engine = None
        self._per_request = [f.name for f in self.L.INPUT_FIELDS if f.verify_expected == "per_request"]
        self._per_slot = [f.name for f in self.L.INPUT_FIELDS if f.verify_expected == "per_slot"]
        self.caller_tables = check_caller_tables(self.L, caller_tables)
        # request_input fields: request_inputs(request) -> {field: int}, called once per request
        # (kv_canary.engine.request_inputs); checked at attach.
        self.request_inputs = request_inputs
        self._request_fields = tuple(f.name for f in self.L.INPUT_FIELDS if f.source == "request_input")
        self._request_cache: dict = {}  # request row -> (rid, its request_input values)
        self._no_stats = CanaryStats()

    @classmethod
    def from_config(cls, config, **engine_options) -> "CanaryManager":
        """A manager with a CanaryConfig's options (SGLang's flags and environment variables, defaults
        included) and the engine-side ones given here (tree, backend, fingerprint_layers,
        caller_tables, request_inputs, chain_position_assert, keep_violations)."""
        from .config import CanaryConfig

        if not isinstance(config, CanaryConfig):
            raise ValueError(f"kv-canary: from_config needs a CanaryConfig, got {_describe(config)}")
        options = config.manager_options()
        clash = sorted(set(options) & set(engine_options))
        if clash:
            raise ValueError(f"kv-canary: from_config takes {', '.join(clash)} from the CanaryConfig; "
                             f"set it there (flag or environment variable), not as a keyword")
        return cls(**options, **engine_options)

    @property
    def layer(self):
        """`tree` under its former name (kept for engines that read it; a DeprecationWarning)."""
        warnings.warn("kv-canary: CanaryManager.layer is the former name of CanaryManager.tree; read .tree",  # former name
                      DeprecationWarning, stacklevel=2)
        return self.tree

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def stats(self) -> CanaryStats:
        return self.ring_drain.stats if self.ring_drain is not None else self._no_stats

    @property
    def violations(self) -> list[Violation]:
        """Every drained row kept so far (at most keep_violations)."""
        return self.ring_drain.violations if self.ring_drain is not None else []

    def _choose_layers(self, pools: dict) -> dict:
        """Layers fingerprinted per group; warns once when the default leaves layers uncovered."""
        cap, chosen, uncovered = self.L.MAX_REAL_KV_SOURCES, {}, []
        for name, layers in self.fingerprint_layers.items():
            n = len(pools[name].storage.k) if name in pools else 0
            if n == 0 or max(layers) >= n:
                raise ValueError(f"kv-canary: fingerprint_layers[{name!r}] must name layers of the {name} pool, "
                                 f"which has {n} layer(s); got {list(layers)}")
        for name, pool in pools.items():
            n = len(pool.storage.k)
            chosen[name] = self.fingerprint_layers.get(name, tuple(range(min(n, cap))))
            if name not in self.fingerprint_layers and n > cap:
                uncovered.append(f"{n - cap} of {n} {name} layers (layers {cap}..{n - 1})")
        if uncovered:
            warnings.warn(f"kv-canary: the real-KV fingerprint does not cover {' and '.join(uncovered)}: one launch "
                          f"reads at most MAX_REAL_KV_SOURCES={cap} layers; damage there goes unseen. Pass "
                          f"fingerprint_layers={{group: [layer, ...]}} to choose which layers are covered.",
                          CanaryCoverageWarning, stacklevel=3)
        return chosen

    # -- setup ------------------------------------------------------------------------------
    def _pools(self, engine) -> dict:
        """The engine's pools the schema has launch tags for (in the schema's group order)."""
        offered = dict(engine.canary_pools())
        groups = self.L.LAUNCH_GROUPS
        if groups[0] not in offered:
            raise ValueError(f"kv-canary: the engine offers no {groups[0]!r} KV pool (canary_pools() gave "
                             f"{', '.join(offered) or 'none'}); the schema's launch tags start with group {groups[0]!r}")
        unserved = [g for g in offered if g not in groups]
        if unserved:
            warnings.warn(f"kv-canary: the schema declares no launch tags for the engine's {', '.join(unserved)} KV "
                          f"pool(s) (launch_tags groups: {', '.join(groups)}); damage there goes unseen",
                          CanaryCoverageWarning, stacklevel=3)
        return {g: offered[g] for g in groups if g in offered}

    def _slot_tables(self, name: str, pool: KvPoolView) -> dict:
        """Per-slot tables of the group's input fields: what writes store and per-slot verifies check."""
        tables = {}
        for f in self.L.INPUT_FIELDS:
            if f.source == "allocation_epoch":
                tables[f.name] = pool.allocation_epoch
            elif f.source == "caller_table":
                table = self.caller_tables[f.name].get(name)
                if not isinstance(table, torch.Tensor) or table.dtype != torch.int64 or \
                        tuple(table.shape) != (pool.storage.num_slots,) or table.device != self.device:
                    raise ValueError(f"kv-canary: caller_tables[{f.name!r}][{name!r}] must be an int64 tensor of "
                                     f"shape ({pool.storage.num_slots},) on {self.device}, got "
                                     f"{_describe(table)}")
                tables[f.name] = table
        return tables

    def attach(self, engine) -> None:
        """Allocate every buffer, plan and context for `engine`'s pools (once, at fixed capacity)."""
        check_engine(engine)
        self.check_request_inputs()
        self._request_cache = {}  # a new engine's rows and request ids start over
        self.engine = engine
        if not self.enabled:
            return
        self.device = dev = engine.device
        A = self.alloc
        self.ring, self.write_index = A.allocate_violation_ring(self.ring_capacity, device=dev)
        self.reason_counts = A.allocate_reason_counts(device=dev)  # shared like the ring; never reset
        self.slot_run_counter = A.allocate_counter(device=dev)
        # One kernel-run counter per launch tag (its verify and write share it): the health check
        # tells which launch stopped running.
        self.kernel_run_counters = A.allocate_counters(len(self.tags), device=dev)
        self.chain_flag = A.allocate_chain_position_flag(device=dev, enabled=self.chain_position_assert)
        cfg = engine.cfg
        self.write_capacity = 1 << max(0, (cfg.max_running - 1).bit_length())  # padded batch size
        self.max_ctx = int(cfg.max_ctx)
        self.ctx_cols = min(self.max_ctx, self.initial_context or INITIAL_CONTEXT)
        self.req_pool = torch.zeros((engine.req_rows, self.ctx_cols), dtype=torch.int32, device=dev)
        self._valid_len = [0] * engine.req_rows
        self._unreported = False    # warned once: a batch row whose tokens the engine never reported
        self._block_table = slot_table_kind(engine) == "blocks"
        self._slot_table = self._allocate_slot_table(engine, self.ctx_cols)
        pools = self._pools(engine)
        self.fingerprinted = self._choose_layers(pools)
        self._allocate_inputs(cfg, pools)
        self._buf_of_tag: dict = {}  # launch tag value -> its canary buffer (what the drain reads records from)
        # Engines whose batch may read a block another row writes in the same forward (vLLM: a prefix hit
        # on a block cached when it was scheduled) get a second verify plan per group, run after TAIL.
        self._late_capable = bool(getattr(engine, "same_forward_reads", False))
        self._late_now = False
        self.groups = [self._make_group(name, pool, self._verify_capacity()) for name, pool in pools.items()]
        self._scatter = self.rt.bind("scatter_req_token_ids", flat_in=self._scatter_flat, offsets=self._scatter_offsets,
                                     req_pool_indices=self._scatter_row, pool_out=self.req_pool, backend=self.backend)
        self.ring_drain = RingDrain(self.L, ring=self.ring, write_index=self.write_index,
                                    reason_counts=self.reason_counts, keep_violations=self.keep_violations,
                                    canary_bufs=self._buf_of_tag)
        self.monitor = RuntimeMonitor(self)

    def check_request_inputs(self) -> None:
        """A schema with request_input fields needs the function that supplies them (at attach, before
        anything is allocated; an engine adapter may call it sooner)."""
        if self._request_fields and self.request_inputs is None:
            raise ValueError(f"kv-canary: the schema's request_input field(s) {', '.join(self._request_fields)} need "
                             f"their per-request values: pass request_inputs=fn(request) -> {{field: int}} "
                             f"(kv_canary.engine.request_inputs has namespace_of and vllm_request_namespace)")
        if self.request_inputs is not None and not callable(self.request_inputs):
            raise ValueError(f"kv-canary: request_inputs must be a function request -> {{field: int}}, got "
                             f"{self.request_inputs!r}")

    def _allocate_slot_table(self, engine, cols: int) -> torch.Tensor:
        """The engine's slot table, or (block-table engine) the manager's own of `cols` positions,
        refilled per batch."""
        if not self._block_table:
            return engine.req_to_token
        positions = torch.arange(cols, dtype=torch.int64, device=self.device)
        self._block_col = positions // engine.block_size   # the block-table column of each position
        self._block_off = positions % engine.block_size    # the position's offset in its block
        return torch.zeros((engine.req_rows, cols), dtype=torch.int32, device=self.device)

    def _expand_block_table(self, batch) -> None:
        """Slots of the batch's rows from the engine's block table, on the device (capturable); as
        many positions as the engine's table holds blocks for (it may grow on demand too)."""
        e = self.engine
        width = min(self.ctx_cols, int(e.req_to_block.shape[1]) * e.block_size)
        blocks = e.req_to_block.index_select(0, batch.req_pool_indices).to(torch.int64)[:, self._block_col[:width]]
        slots = blocks * e.block_size + self._block_off[:width]
        self._slot_table[:, :width].index_copy_(0, batch.req_pool_indices, slots.to(torch.int32))

    def _make_group(self, name: str, pool: KvPoolView, verify_capacity: int) -> _Group:
        """The group's canary buffers and plans, and every launch it makes, validated and bound once
        over the manager's fixed buffers."""
        A, L, dev, bind, b = self.alloc, self.L, self.device, self.rt.bind, self.backend
        storage = pool.storage
        g = _Group(name, pool, storage.num_slots, A.VerifyPlan.allocate(verify_capacity=verify_capacity, device=dev),
                   A.WritePlan.allocate(write_req_capacity=self.write_capacity, device=dev),
                   A.VerifyPlan.allocate(verify_capacity=storage.num_slots, device=dev),
                   self._slot_tables(name, pool), self._fixed(self.token_capacity),
                   {f.name: self._fixed(self.token_capacity) for f in L.INPUT_FIELDS})
        if self._late_capable:
            g.late_plan = A.VerifyPlan.allocate(verify_capacity=verify_capacity, device=dev)
        g.launches["plan"] = bind(
            "launch_canary_plan_kernels", verify_plan_out=g.verify_plan, write_plan_out=g.write_plan,
            req_pool_indices=self._req_pool_indices, prefix_lens=self._prefix_lens,
            extend_seq_lens=self._extend_seq_lens, req_to_token=self._slot_table,
            swa_window_size=pool.window, full_to_swa_index_mapping=pool.full_to_pool,
            verify_capacity=int(g.verify_plan.verify_slot_indices.shape[0]),
            req_to_verify_expected_tokens=self.req_pool, req_to_verify_expected_tokens_valid_lens=self._valid_lens,
            kv_token_id_vs_position_offset=0, extra_request_values={n: self._row_values[n] for n in self._per_request},
            backend=b)
        tables = {n: g.slot_tables[n] for n in self._per_slot}
        layouts = check_storage_layouts(name, storage)
        for (half, tensors), kv_layout in zip(zip(L.LAUNCH_HALVES, storage.halves()), layouts):
            if half not in self.halves:
                continue
            buf = g.bufs[half] = A.allocate_canary_buf(storage.num_slots, device=dev)
            sources = tuple(self._source(name, half, i, tensors[i], storage, kv_layout) for i in self.fingerprinted[name])
            for phase in L.LAUNCH_PHASES:
                tag = L.launch_tag(phase, half, name)
                self._buf_of_tag[int(tag)] = buf
                g.launches[(phase, half, "verify")] = bind(
                    "launch_canary_verify_kernel", context=self._context(buf, tag, sources, self.real_kv_hash_mode),
                    plan=g.sweep_plan if phase == L.STEP_SWEEP else g.verify_plan,
                    check_verify_expected_token=self.check_verify_expected_token, extra_slot_tables=tables, backend=b)
                if phase == L.STEP_AFTER_FORWARD and self._late_capable:   # the same-forward reads, verified after TAIL writes
                    g.launches[(LATE, half, "verify")] = bind(
                        "launch_canary_verify_kernel", context=self._context(buf, tag, sources, self.real_kv_hash_mode),
                        plan=g.late_plan, check_verify_expected_token=self.check_verify_expected_token,
                        extra_slot_tables=tables, backend=b)
                if phase != L.STEP_SWEEP:
                    # HEAD writes run before the forward has written K/V: no fingerprint yet.
                    mode = L.RealKvHashMode.NONE if phase == L.STEP_BEFORE_FORWARD else self.real_kv_hash_mode
                    g.launches[(phase, half, "write")] = bind(
                        "launch_canary_write_kernel", context=self._context(buf, tag, sources, mode), plan=g.write_plan,
                        input_ids=self._input_ids, positions=self._positions, out_cache_loc=g.out_cache_loc,
                        enable_write_input_assert=self.enable_write_input_assert, extra_inputs=g.token_inputs,
                        backend=b, **self._expected)
        return g

    def _source(self, group: str, half: str, layer: int, tensor: torch.Tensor, storage, kv_layout: Optional[KvLayout]):
        """One KV layer's half as a real-KV source, read where it lies (kv_layout None: packed rows)."""
        fields = {} if kv_layout is None else dataclasses.asdict(kv_layout)
        try:
            return self.alloc.RealKvSource(tensor=tensor, page_size=storage.row_slots,
                                           num_bytes_per_token=storage.bytes_per_token,
                                           read_bytes=storage.bytes_per_token, **fields)
        except ValueError as exc:  # which pool, half and layer the source's own message is about
            raise ValueError(f"kv-canary: the {group!r} pool's {half.upper()} layer {layer}: "
                             f"{str(exc).removeprefix('kv-canary: ')}") from None

    def _context(self, buf: torch.Tensor, tag, sources: tuple, mode):
        """One launch's context: the canary buffer, the shared ring and counters, the tag's own
        kernel-run counter."""
        i = self.tags.index(tag)
        return self.alloc.VerifyOrWriteContext(
            canary_buf=buf, kernel_kind=tag, violation_ring=self.ring, violation_write_index=self.write_index,
            slot_run_counter=self.slot_run_counter, kernel_run_counter=self.kernel_run_counters[i:i + 1],
            real_kv_sources=sources, real_kv_hash_mode=mode, enable_chain_position_assert=self.chain_flag,
            violation_reason_counts=self.reason_counts)

    def _fixed(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, device=self.device)

    def _verify_capacity(self) -> int:
        """Verify entries of one step: no batch row reads more than ctx_cols prefix positions."""
        return self.engine.cfg.max_running * self.ctx_cols

    def _allocate_token_inputs(self) -> None:
        """The per-token buffers (and the scatter's input): ctx_cols tokens per batch row."""
        fixed = self._fixed
        # No request extends by more than ctx_cols tokens in one step (stage grows it first).
        self.token_capacity = self.write_capacity * self.ctx_cols
        # The write's input assert: what each batch token should be (no inputs when the assert is off).
        names = ("expected_input_tokens", "expected_input_positions") if self.enable_write_input_assert else ()
        self._expected = {name: fixed(self.token_capacity) for name in names}
        self._input_ids = fixed(self.token_capacity)
        self._positions = fixed(self.token_capacity)
        self._scatter_flat = fixed(self.ctx_cols)

    def _allocate_inputs(self, cfg, pools: dict) -> None:
        """Every device input the manager itself passes to a launch: steps refill these in place
        (HostStaging), so a captured CUDA graph keeps reading the right addresses until a growth."""
        fixed = self._fixed
        self._valid_lens = fixed(self.write_capacity)   # per batch row: valid expected tokens
        # Per batch row, per input field with a per-request value: what per_request verifies expect and
        # what request_input fields write.
        per_row = dict.fromkeys(self._per_request + list(self._request_fields))
        self._row_values = {name: fixed(self.write_capacity) for name in per_row}
        # The batch, staged at every step: request rows beyond the batch are padding (row
        # REQ_POOL_IDX_PADDING, no prefix, no extend), tokens beyond it are never read.
        self._req_pool_indices = fixed(self.write_capacity)
        self._prefix_lens = fixed(self.write_capacity)
        self._extend_seq_lens = fixed(self.write_capacity)
        self._allocate_token_inputs()
        self._scatter_offsets = fixed(2)
        self._scatter_row = fixed(1)
        sweep_cap = max(p.storage.num_slots for p in pools.values())
        rows_per_step = (1 + len(self._row_values)) * self.write_capacity  # stage: valid lengths + row values
        self._stage = HostStaging(max(4 * sweep_cap, rows_per_step, cfg.max_ctx + 3), self.device)

    # -- expected-token pool ----------------------------------------------------------------
    def on_tokens(self, row: int, start: int, tokens: list[int]) -> None:
        """Record a request's known token ids (prompt at admission, then sampled tokens)."""
        if not self.enabled or not tokens:
            return
        n = len(tokens)
        if start < 0 or start + n > self.max_ctx:
            raise ValueError(f"kv-canary: on_tokens needs 0 <= start and start + len(tokens) <= max_ctx="
                             f"{self.max_ctx}, got start={start} len(tokens)={n}")
        if start + n > self.ctx_cols:
            self._grow(start + n)
        if start == 0:
            self._stage.upload([(tokens, self._scatter_flat), ([0, n], self._scatter_offsets),
                                ([row], self._scatter_row)])
            self._scatter.run()
        else:
            self._stage.upload([(tokens, self._scatter_flat)])
            self.req_pool[row, start:start + n].copy_(self._scatter_flat[:n])
        self._valid_len[row] = start + n

    def _grow(self, needed: int) -> None:
        """Columns for `needed` context positions (doubled, at most max_ctx): the per-request and
        per-token buffers reallocated (the expected-token pool keeps its contents) and every launch
        that reads them bound again. Host side only; runs on the cold path of a longer context."""
        cols = min(self.max_ctx, max(needed, 2 * self.ctx_cols))
        old = self.req_pool
        self.ctx_cols = cols
        self.req_pool = torch.zeros((old.shape[0], cols), dtype=old.dtype, device=self.device)
        self.req_pool[:, :old.shape[1]].copy_(old)
        if self._block_table:
            self._slot_table = self._allocate_slot_table(self.engine, cols)
        self._allocate_token_inputs()
        A = self.alloc
        for g in self.groups:
            g.verify_plan = A.VerifyPlan.allocate(verify_capacity=self._verify_capacity(), device=self.device)
            if self._late_capable:   # the same-forward reads' plan holds as many entries as the step's
                g.late_plan = A.VerifyPlan.allocate(verify_capacity=self._verify_capacity(), device=self.device)
            g.out_cache_loc = self._fixed(self.token_capacity)
            g.token_inputs = {f.name: self._fixed(self.token_capacity) for f in self.L.INPUT_FIELDS}
            g.launches["plan"] = g.launches["plan"].rebind(
                verify_plan_out=g.verify_plan, req_to_token=self._slot_table, req_to_verify_expected_tokens=self.req_pool,
                verify_capacity=int(g.verify_plan.verify_slot_indices.shape[0]))
            for key, launch in list(g.launches.items()):
                if key == "plan" or key[0] == self.L.STEP_SWEEP:
                    continue
                plan = g.late_plan if key[0] == LATE else g.verify_plan
                g.launches[key] = launch.rebind(plan=plan) if key[2] == "verify" else launch.rebind(
                    input_ids=self._input_ids, positions=self._positions, out_cache_loc=g.out_cache_loc,
                    extra_inputs=g.token_inputs, **self._expected)
        self._scatter = self._scatter.rebind(flat_in=self._scatter_flat, pool_out=self.req_pool)
        self.resizes += 1

    # -- the step protocol ------------------------------------------------------------------
    def head(self, batch) -> None:
        """HEAD of a step: `stage(batch)` then `launch_head(batch)` (each does nothing in mode none)."""
        self.stage(batch)
        self.launch_head(batch)

    def prepare(self, batch) -> None:
        """`stage(batch)` under its former name (kept for engines that call it)."""
        self.stage(batch)

    def stage(self, batch) -> None:
        """Host side of a step (its staging): refill the manager's fixed inputs in place (outside a CUDA graph)."""
        if not self.enabled:
            return
        bs, n = batch.bs, int(batch.input_ids.shape[0])
        if bs > self.write_capacity or n > self.write_capacity * self.max_ctx:
            raise ValueError(f"kv-canary: a batch may hold at most {self.write_capacity} rows and "
                             f"{self.write_capacity * self.max_ctx} tokens (the engine's max_running and max_ctx), "
                             f"got {bs} rows and {n} tokens")
        valid = [self._valid_len[r.row] if r is not None else 0 for r in batch.requests]
        # A row's prefix and extend lie within its reported tokens plus this step's (drafts); a row whose
        # tokens were never reported (on_tokens) could read anywhere: the engine's whole context.
        unreported = any(r is not None and not self._valid_len[r.row] for r in batch.requests)
        if unreported and not self._unreported:
            self._unreported = True
            warnings.warn("kv-canary: a batch row's tokens were never reported (manager.on_tokens at admission): "
                          "the canary's tables are sized to the engine's whole max_ctx for it",
                          CanaryCoverageWarning, stacklevel=2)
        needed = self.max_ctx if unreported else max(valid, default=0) + n
        if needed > self.ctx_cols:
            self._grow(needed)
        self._stage.upload([(valid, self._valid_lens)] + [(values, self._row_values[name])
                                                          for name, values in self._per_row_values(batch).items()])
        self.monitor.forwards += 1

    def _per_row_values(self, batch) -> dict:
        """Per batch row, the value of each input field with a per-request value (UNKNOWN: no check)."""
        unknown, out = self.L.UNKNOWN, {}
        sources = {f.name: f.source for f in self.L.INPUT_FIELDS}
        supplied = [self._supplied(r) if r is not None else None for r in batch.requests] \
            if self._request_fields else []
        for name in self._row_values:
            if sources[name] == "request_input":
                # Every entry a request reads, prefix-cache hits included, is checked against the
                # reader's own value: a hit across namespaces is what the field is there to catch.
                i = self._request_fields.index(name)
                out[name] = [values[i] if values is not None else unknown for values in supplied]
            else:
                # UNKNOWN disables the owner check: padding rows, and requests whose prefix came from the
                # radix cache (those slots were written, and are owned, by an earlier request).
                out[name] = [r.rid if r is not None and not r.matched else unknown for r in batch.requests]
        return out

    def _supplied(self, request) -> tuple:
        """The request's request_input values, asked once per request (kept while it holds its row)."""
        cached = self._request_cache.get(request.row)
        if cached is None or cached[0] != request.rid:
            cached = (request.rid, check_request_values(self.request_inputs(request), self._request_fields, request))
            self._request_cache[request.row] = cached
        return cached[1]

    def launch_head(self, batch) -> None:
        """Device side of HEAD: the batch staged into the manager's buffers, plan, HEAD verify and
        write. No host sync, so a CUDA graph can capture it (and `tail`); `stage` must have refilled
        the host-side inputs for this batch."""
        if self.enabled:
            if self._block_table:
                self._expand_block_table(batch)
            self._stage_batch(batch)
            for g in self.groups:
                g.launches["plan"].run()
            self._late_now = self._late_capable and bool(getattr(batch, "same_forward_reads", False))
            if self._late_now:
                self._defer_same_forward_reads(int(batch.input_ids.shape[0]))
            if self.enable_write_input_assert:
                self._fill_expected_inputs(batch)
            self._verify_and_write(self.L.STEP_BEFORE_FORWARD, batch)

    def tail(self, batch) -> None:
        """TAIL verify and write, after the forward (device side only, capturable)."""
        if self.enabled:
            self._verify_and_write(self.L.STEP_AFTER_FORWARD, batch)
            if self._late_now:
                for g in self.groups:
                    for half in self.halves:
                        g.launches[(LATE, half, "verify")].run()

    def _defer_same_forward_reads(self, n: int) -> None:
        """Move the verify entries of slots this very forward writes (a row reading a block another row
        fills in the same step) from the step's plan to the late plan: HEAD would find those slots
        before their records exist; after TAIL's writes they hold the writer's records and fingerprints.
        A moved entry becomes slot 0 (padding, skipped) in the plan it leaves."""
        for g in self.groups:
            plan, late = g.verify_plan, g.late_plan
            written = torch.isin(plan.verify_slot_indices, g.out_cache_loc[:n])
            for f in dataclasses.fields(plan):
                getattr(late, f.name).copy_(getattr(plan, f.name))
            late.verify_slot_indices.masked_fill_(~written, 0)
            plan.verify_slot_indices.masked_fill_(written, 0)

    def after_step(self, step: int) -> None:
        """End of an engine step: the sweep when due, draining, the stats line and the health check;
        then the metrics exporter and the fleet decision, when attached."""
        if not self.enabled:
            return
        self.last_step = step
        if self.sweep_interval and step % self.sweep_interval == self.sweep_interval - 1:
            self.monitor.sweeps_due += 1
            self.sweep()
        self.ring_drain.snapshot(step)
        if self.ring_drain.pending():
            self.drain()
        health = None
        try:
            self.monitor.after_step(step, sweep_passes=self.sweep_passes, drained=self.stats.total)
        except CanaryHealthError as e:
            health = e
        self.notify_step(step, health)  # with a fleet decision, every rank raises a health error together

    def _stage_batch(self, batch) -> None:
        """The batch's tensors copied into the buffers the launches are bound to (device copies:
        capturable); request rows past the batch become padding."""
        bs, n = batch.bs, int(batch.input_ids.shape[0])
        for buf, src in ((self._req_pool_indices, batch.req_pool_indices), (self._prefix_lens, batch.prefix_lens),
                         (self._extend_seq_lens, batch.extend_seq_lens)):
            buf[:bs].copy_(src)
            buf[bs:].fill_(0 if buf is not self._req_pool_indices else self.L.REQ_POOL_IDX_PADDING)
        self._input_ids[:n].copy_(batch.input_ids)
        self._positions[:n].copy_(batch.positions)
        rows = self._token_rows(batch) if self._request_fields else None
        for g in self.groups:
            g.out_cache_loc[:n].copy_(g.pool.out_cache_loc(batch))
            self._write_inputs(g, batch, g.out_cache_loc[:n], rows)

    def _verify_and_write(self, phase: str, batch) -> None:
        for kind in ("verify", "write"):  # the phase's verifies read the records before its writes change them
            for g in self.groups:
                for half in self.halves:
                    g.launches[(phase, half, kind)].run()

    def _fill_expected_inputs(self, batch) -> None:
        """What the write's input assert compares each batch token with, on the device: position =
        its request's prefix length + its index in the request's extend; token = the request's known
        token at that position (the expected-token pool), or the token itself where the pool does not
        know it yet (a draft). Padding requests own no tokens (as in the write plan)."""
        n, bs = int(batch.input_ids.shape[0]), batch.bs
        active = batch.req_pool_indices != self.L.REQ_POOL_IDX_PADDING
        extend = torch.where(active, batch.extend_seq_lens, torch.zeros_like(batch.extend_seq_lens))
        ends = torch.cumsum(extend, 0)
        flat = torch.arange(n, dtype=ends.dtype, device=self.device)
        req = torch.searchsorted(ends, flat, right=True).clamp_(max=bs - 1)
        positions = batch.prefix_lens[req] + flat - (ends[req] - extend[req])
        known = (positions >= 0) & (positions < self._valid_lens[req])
        column = positions.clamp(0, self.req_pool.shape[1] - 1)
        tokens = self.req_pool[batch.req_pool_indices[req], column].to(torch.int64)
        self._expected["expected_input_tokens"][:n].copy_(torch.where(known, tokens, batch.input_ids))
        self._expected["expected_input_positions"][:n].copy_(positions)

    def _token_rows(self, batch) -> torch.Tensor:
        """The batch row of each token, on the device (as the write plan assigns them: padding rows own
        no tokens, so a padding token gets the last row; nothing writes it)."""
        n, bs = int(batch.input_ids.shape[0]), batch.bs
        active = batch.req_pool_indices != self.L.REQ_POOL_IDX_PADDING
        ends = torch.cumsum(torch.where(active, batch.extend_seq_lens, torch.zeros_like(batch.extend_seq_lens)), 0)
        flat = torch.arange(n, dtype=ends.dtype, device=self.device)
        return torch.searchsorted(ends, flat, right=True).clamp_(max=bs - 1)

    def _write_inputs(self, g: _Group, batch, locs: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
        """Per-token values of the schema's input fields, computed on the device into fixed buffers."""
        n = int(locs.shape[0])
        for f in self.L.INPUT_FIELDS:
            buf = g.token_inputs[f.name][:n]
            if f.source == "request_id":
                buf.copy_(batch.token_rids)
            elif f.source == "request_input":  # the writing request's value
                torch.index_select(self._row_values[f.name], 0, rows, out=buf)
            else:  # a per-slot table (allocation epoch, caller table) at the written slot; 0 for skipped slots
                torch.index_select(g.slot_tables[f.name], 0, locs.clamp(0, g.num_slots - 1), out=buf)
                buf.masked_fill_((locs < 0) | (locs >= g.num_slots), 0)

    # -- sweep ------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Verify every radix-held slot (SWEEP_* tags); returns the number of entries per half. A pass
        with nothing cached still launches (an empty verify), so the health check sees it ran."""
        if not self.enabled:
            return 0
        slots, positions, tokens, prevs = self.engine.cached_entries()
        self.sweep_passes += 1
        for g in self.groups:
            s, p = slots, prevs
            lut = g.pool.translate
            if lut is not None:
                s = [lut(x) for x in slots]
                p = [lut(x) if x >= 0 else self.L.UNKNOWN for x in prevs]
            n, plan = len(s), g.sweep_plan
            self._stage.upload([(s, plan.verify_slot_indices), (positions, plan.verify_expected_positions),
                                (tokens, plan.verify_expected_tokens), (p, plan.verify_prev_slot_indices)])
            for name in self._per_request:  # the owner of a cached page is not tracked: no check
                getattr(plan, "verify_expected_" + name)[:n] = self.L.UNKNOWN
            plan.verify_num_valid.fill_(n)
            plan.enable.fill_(1)
            for half in self.halves:
                g.launches[(self.L.STEP_SWEEP, half, "verify")].run()
        return len(slots)

    # -- host-offload support (records travel with the K/V bytes) ----------------------------
    def export_records(self, full_slots: torch.Tensor) -> Optional[dict]:
        if not self.enabled:
            return None
        return {(g.name, half): g.bufs[half][self._group_slots(g, full_slots)].clone()
                for g in self.groups for half in self.halves}

    def import_records(self, full_slots: torch.Tensor, records: Optional[dict], n: int) -> None:
        """Paste exported records into new slots and restamp per-slot fields (allocation epochs, caller
        tables: the new slots' values, as a correct transfer would)."""
        if not self.enabled or records is None:
            return
        words = {f.name: f.word for f in self.L.INPUT_FIELDS}
        for g in self.groups:
            idx = self._group_slots(g, full_slots)
            for half in self.halves:
                buf = g.bufs[half]
                buf[idx] = records[(g.name, half)][:n].to(buf.device)
                view = buf.view(torch.int64)
                for name, table in g.slot_tables.items():
                    view[idx, words[name]] = table[idx]

    def _group_slots(self, g: _Group, full_slots: torch.Tensor) -> torch.Tensor:
        full_slots = full_slots.to(self.device)
        lut = g.pool.full_to_pool
        return lut[full_slots] if lut is not None else full_slots

    # -- draining ---------------------------------------------------------------------------
    def drain(self) -> list[Violation]:
        """Read every pending row now (waits for the device), decode and record them; then mode `log`
        logs each row's report once (a WARNING each), mode `raise` raises one CanaryViolationError
        with all of them (with a FleetMonitor attached: hands it to the fleet decision, which raises
        on every rank). The write index restarts at 0, so no row is ever reported twice."""
        if not self.enabled or self.ring_drain is None:
            return []
        found = self.ring_drain.drain()
        if not found:  # nothing appended since the last drain
            return found
        st = self.stats
        # total_violations: rows appended since attach (SGLang's write index never restarts);
        # ring_overflow: some row was ever dropped for lack of room.
        reports = [self.reporter.message(v, total_violations=st.total, ring_overflow=st.lost > 0,
                                         step_when_pumped=self.last_step) for v in found]
        self.notify_drain(found)
        if self.mode == "log":
            for text in reports:
                logger.warning(text)
        elif self.mode == "raise":
            self.raise_or_defer(CanaryViolationError("\n".join(reports), found))
        return found

    def flush(self) -> list[Violation]:
        """The end of a run: drain, then every listener brings itself up to date (metrics read the
        device counters, a JSON-lines sink flushes its file)."""
        try:
            return self.drain()
        finally:   # mode raise: the listeners are brought up to date before the error leaves
            if self.enabled and self.ring_drain is not None:
                self.notify_flush()

    # -- reporting helpers ------------------------------------------------------------------
    def link_of(self, v: Violation) -> Optional[int]:
        """Chain link of the record a violation's slot held when it was drained (None if unknown)."""
        return self.ring_drain.link_of(v) if self.ring_drain is not None else None

    def grouped(self, violations: Optional[list[Violation]] = None) -> list[ViolationGroup]:
        """Root-cause groups of `violations` (default: everything drained so far)."""
        return group_cascades(self.violations if violations is None else violations, self.link_of)

    @property
    def kernel_runs(self) -> int:
        """Verify and write launches so far, every tag together."""
        return int(self.kernel_run_counters.sum()) if self.enabled and self.groups else 0


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return repr(value)
