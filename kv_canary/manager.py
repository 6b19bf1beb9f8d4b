"""CanaryManager: the canary state of one KV pool and the per-step protocol an engine drives.

Per forward step: plan -> HEAD verify + write -> (the model's forward) -> TAIL verify + write, and
every `sweep_interval` steps a SWEEP over the radix-held (cached) slots. HEAD writes claim the new
slots before the forward (fingerprint off: the K/V bytes are not written yet), so a request that
reads a slot someone else just claimed fails its TAIL verify in the same step; TAIL writes store
the real K/V fingerprint.

Everything is allocated once at fixed capacity (CUDA-graph friendly). Draining never stalls the
device: the ring's write index is copied asynchronously (pinned memory on CUDA) at the end of every
step and the rows are read only once such a copy shows it non-zero. Layout (tags, columns, fields,
input fields) comes from the generated layer the manager is built for.

The engine protocol (kv_canary.sim.Engine implements it): `attach(engine)` reads the pool from
`engine.full` / `engine.swa` (KvStorage: per-layer K/V tensors, row_slots, bytes_per_token),
`engine.swa_pool.full_to_swa`, `engine.cfg.swa_window`, `engine.req_to_token`, request `.rid` / `.row` / `.matched`,
`engine.alloc.epoch` / `engine.swa_pool.epoch` (allocation epoch per slot) and
`engine.cached_entries()`; batches are kv_canary.sim.ForwardBatch. Input fields of the schema
(SEMANTICS.md §8) get the owning request id when verified per request (or not verified) and the
slot's allocation epoch when verified per slot.
"""
from __future__ import annotations

import collections
import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from .runtime import runtime_for
from .violations import Violation, ViolationDecoder, ViolationGroup, group_cascades, record_link

logger = logging.getLogger("kv_canary")

MODES = ("off", "log", "raise")
HALVES = ("K", "V")
PHASES = ("HEAD", "TAIL", "SWEEP")
SNAPSHOT_DEPTH = 8  # pinned write-index snapshots in flight before a drain waits for the oldest


class CanaryViolationError(RuntimeError):
    """Raised in mode 'raise'; `violations` holds every row drained with the first one."""

    def __init__(self, message: str, violations: list[Violation]):
        super().__init__(message)
        self.violations = violations


@dataclass
class _Group:
    name: str                     # "FULL" or "SWA" (the CanaryLaunchTag suffix)
    storage: object               # KvStorage
    num_slots: int
    bufs: dict                    # half -> canary buffer
    contexts: dict                # (phase, half, kind) -> VerifyOrWriteContext, kind in {"verify", "write"}
    verify_plan: object
    write_plan: object
    sweep_plan: object
    slot_tables: dict             # per_slot field name -> int64 [num_slots]


@dataclass
class CanaryStats:
    total: int = 0                                   # rows appended, lost ones included
    lost: int = 0                                    # rows dropped because the ring was full
    drains: int = 0
    by_reason: collections.Counter = field(default_factory=collections.Counter)  # decoded rows
    by_step: collections.Counter = field(default_factory=collections.Counter)    # every row, lost ones included
    by_tag: collections.Counter = field(default_factory=collections.Counter)


class CanaryManager:
    def __init__(self, *, layer=None, mode: str = "log", real_kv_hash_mode: str = "ALL",
                 check_verify_expected_token: bool = True, ring_capacity: int = 1024, sweep_interval: int = 8,
                 chain_position_assert: bool = True, backend: Optional[str] = None, keep_violations: int = 100_000):
        if mode not in MODES:
            raise ValueError(f"kv-canary: mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.layer = layer if layer is not None else sys.modules["kv_canary.generated"]
        self.L = self.layer.layout
        if isinstance(real_kv_hash_mode, str):
            names = [m.name for m in self.L.RealKvHashMode]
            if real_kv_hash_mode.upper() not in names:
                raise ValueError(f"kv-canary: real_kv_hash_mode must be one of {', '.join(names)}, got {real_kv_hash_mode!r}")
            real_kv_hash_mode = self.L.RealKvHashMode[real_kv_hash_mode.upper()]
        self.real_kv_hash_mode = self.L.RealKvHashMode(real_kv_hash_mode)
        for name, value, low in (("ring_capacity", ring_capacity, 1), ("sweep_interval", sweep_interval, 0),
                                 ("keep_violations", keep_violations, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"kv-canary: {name} must be an int >= {low}, got {value!r}")
        self.mode = mode
        self.check_verify_expected_token = bool(check_verify_expected_token)
        self.ring_capacity = ring_capacity
        self.sweep_interval = sweep_interval
        self.chain_position_assert = bool(chain_position_assert)
        self.backend = backend
        self.keep_violations = keep_violations
        self.rt = runtime_for(self.layer)
        self.alloc = importlib.import_module(self.layer.__name__ + ".allocators")
        self.decoder = ViolationDecoder(self.L)
        self.stats = CanaryStats()
        self.violations: list[Violation] = []
        self.groups: list[_Group] = []
        self.engine = None
        self._per_request = [f.name for f in self.L.INPUT_FIELDS if f.verify_expected == "per_request"]
        self._per_slot = [f.name for f in self.L.INPUT_FIELDS if f.verify_expected == "per_slot"]

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    # -- setup ------------------------------------------------------------------------------
    def attach(self, engine) -> None:
        """Allocate every buffer, plan and context for `engine`'s pool (once, at fixed capacity)."""
        self.engine = engine
        if not self.enabled:
            return
        dev = engine.device
        self.device = dev
        A = self.alloc
        self.ring, self.write_index = A.allocate_violation_ring(self.ring_capacity, device=dev)
        self.slot_run_counter = A.allocate_counter(device=dev)
        self.kernel_run_counter = A.allocate_counter(device=dev)
        self.chain_flag = A.allocate_chain_position_flag(device=dev, enabled=self.chain_position_assert)
        cfg = engine.cfg
        self.write_capacity = 1 << max(0, (cfg.max_running - 1).bit_length())  # padded batch size
        self.req_pool = torch.zeros((engine.req_rows, cfg.max_ctx), dtype=torch.int32, device=dev)
        self._valid_len = [0] * engine.req_rows
        self.groups = [self._make_group("FULL", engine.full, cfg.max_running * cfg.max_ctx,
                                        {n: engine.alloc.epoch for n in self._per_slot})]
        if engine.swa is not None:
            self.groups.append(self._make_group("SWA", engine.swa, cfg.max_running * cfg.max_ctx,
                                                {n: engine.swa_pool.epoch for n in self._per_slot}))
        self._buf_of_tag = {int(ctx.kernel_kind): (g, half) for g in self.groups
                            for (phase, half, kind), ctx in g.contexts.items()}
        self._links: dict = {}
        self._snapshots = collections.deque()   # (step, host int32 [1] tensor or int, cuda event or None)
        self._pinned = dev.type == "cuda"
        if self._pinned:
            self._pinned_idx = [torch.zeros(1, dtype=torch.int32, pin_memory=True) for _ in range(SNAPSHOT_DEPTH)]
            self._next_pin = 0

    def _make_group(self, name: str, storage, verify_capacity: int, slot_tables: dict) -> _Group:
        A, L, dev = self.alloc, self.L, self.device
        bufs, contexts = {}, {}
        for half, tensors in zip(HALVES, storage.halves()):
            bufs[half] = A.allocate_canary_buf(storage.num_slots, device=dev)
            sources = tuple(A.RealKvSource(tensor=t, page_size=storage.row_slots,
                                           num_bytes_per_token=storage.bytes_per_token,
                                           read_bytes=storage.bytes_per_token)
                            for t in tensors[:L.MAX_REAL_KV_SOURCES])
            for phase in PHASES:
                tag = L.CanaryLaunchTag[f"{phase}_{half}_{name}"]
                for kind in ("verify", "write"):
                    # HEAD writes run before the forward has written K/V: no fingerprint yet.
                    mode = L.RealKvHashMode.NONE if (phase, kind) == ("HEAD", "write") else self.real_kv_hash_mode
                    contexts[(phase, half, kind)] = A.VerifyOrWriteContext(
                        canary_buf=bufs[half], kernel_kind=tag, violation_ring=self.ring,
                        violation_write_index=self.write_index, slot_run_counter=self.slot_run_counter,
                        kernel_run_counter=self.kernel_run_counter, real_kv_sources=sources,
                        real_kv_hash_mode=mode, enable_chain_position_assert=self.chain_flag)
        return _Group(name, storage, storage.num_slots, bufs, contexts,
                      A.VerifyPlan.allocate(verify_capacity=verify_capacity, device=dev),
                      A.WritePlan.allocate(write_req_capacity=self.write_capacity, device=dev),
                      A.VerifyPlan.allocate(verify_capacity=storage.num_slots, device=dev), slot_tables)

    def set_chain_position_assert(self, enabled: bool) -> None:
        """Flip the device flag (0 during warm-up or CUDA-graph capture)."""
        self.chain_position_assert = bool(enabled)
        if self.enabled:
            self.chain_flag.fill_(int(self.chain_position_assert))

    # -- expected-token pool ----------------------------------------------------------------
    def on_tokens(self, row: int, start: int, tokens: list[int]) -> None:
        """Record a request's known token ids (prompt at admission, then sampled tokens)."""
        if not self.enabled or not tokens:
            return
        flat = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        if start == 0:
            self.rt.scatter_req_token_ids(
                flat_in=flat, offsets=torch.tensor([0, len(tokens)], dtype=torch.int64, device=self.device),
                req_pool_indices=torch.tensor([row], dtype=torch.int64, device=self.device),
                pool_out=self.req_pool, backend=self.backend)
        else:
            self.req_pool[row, start:start + len(tokens)] = flat.to(torch.int32)
        self._valid_len[row] = start + len(tokens)

    # -- the step protocol ------------------------------------------------------------------
    def head(self, batch) -> None:
        if not self.enabled:
            return
        self._plan(batch)
        self._verify_and_write("HEAD", batch)

    def tail(self, batch) -> None:
        if self.enabled:
            self._verify_and_write("TAIL", batch)

    def after_step(self, step: int) -> None:
        if not self.enabled:
            return
        if self.sweep_interval and step % self.sweep_interval == self.sweep_interval - 1:
            self.sweep()
        self._snapshot(step)
        self._poll()

    def _plan(self, batch) -> None:
        e, dev = self.engine, self.device
        valid = torch.tensor([self._valid_len[r.row] if r is not None else 0 for r in batch.requests],
                             dtype=torch.int64, device=dev)
        # -1 disables the owner check: padding rows, and requests whose prefix came from the radix
        # cache (those slots were written, and are owned, by an earlier request).
        owners = [r.rid if r is not None and not r.matched else -1 for r in batch.requests]
        extra = {n: torch.tensor(owners, dtype=torch.int64, device=dev) for n in self._per_request}
        for g in self.groups:
            swa = g.name == "SWA"
            self.rt.launch_canary_plan_kernels(
                verify_plan_out=g.verify_plan, write_plan_out=g.write_plan,
                req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                extend_seq_lens=batch.extend_seq_lens, req_to_token=e.req_to_token,
                swa_window_size=e.cfg.swa_window if swa else 0,
                full_to_swa_index_mapping=e.swa_pool.full_to_swa if swa else None,
                verify_capacity=int(g.verify_plan.verify_slot_indices.shape[0]),
                req_to_verify_expected_tokens=self.req_pool, req_to_verify_expected_tokens_valid_lens=valid,
                kv_token_id_vs_position_offset=0, extra_request_values=extra, backend=self.backend)

    def _verify_and_write(self, phase: str, batch) -> None:
        for g in self.groups:
            for half in HALVES:
                self._verify(g, phase, half, g.verify_plan)
        for g in self.groups:
            locs = batch.swa_out_cache_loc if g.name == "SWA" else batch.out_cache_loc
            extra = self._write_inputs(g, batch, locs)
            for half in HALVES:
                self.rt.launch_canary_write_kernel(
                    context=g.contexts[(phase, half, "write")], plan=g.write_plan, input_ids=batch.input_ids,
                    positions=batch.positions, out_cache_loc=locs, enable_write_input_assert=False,
                    extra_inputs=extra, backend=self.backend)

    def _verify(self, g: _Group, phase: str, half: str, plan) -> None:
        self.rt.launch_canary_verify_kernel(
            context=g.contexts[(phase, half, "verify")], plan=plan,
            check_verify_expected_token=self.check_verify_expected_token,
            extra_slot_tables=g.slot_tables, backend=self.backend)

    def _write_inputs(self, g: _Group, batch, locs: torch.Tensor) -> dict:
        out = {}
        for f in self.L.INPUT_FIELDS:
            if f.verify_expected == "per_slot":
                table = g.slot_tables[f.name]
                ok = (locs >= 0) & (locs < g.num_slots)
                out[f.name] = torch.where(ok, table[locs.clamp(0, g.num_slots - 1)], torch.zeros_like(locs))
            else:
                out[f.name] = batch.token_rids
        return out

    # -- sweep ------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Verify every radix-held slot (SWEEP_* tags); returns the number of entries per half."""
        if not self.enabled:
            return 0
        slots, positions, tokens, prevs = self.engine.cached_entries()
        if not slots:
            return 0
        for g in self.groups:
            s, p = slots, prevs
            if g.name == "SWA":
                lut = self.engine.swa_pool.lookup
                s = [lut(x) for x in slots]
                p = [lut(x) if x >= 0 else -1 for x in prevs]
            n = len(s)
            plan, dev = g.sweep_plan, self.device
            plan.verify_slot_indices[:n] = torch.tensor(s, dtype=torch.int64, device=dev)
            plan.verify_expected_positions[:n] = torch.tensor(positions, dtype=torch.int64, device=dev)
            plan.verify_expected_tokens[:n] = torch.tensor(tokens, dtype=torch.int64, device=dev)
            plan.verify_prev_slot_indices[:n] = torch.tensor(p, dtype=torch.int64, device=dev)
            for name in self._per_request:  # the owner of a cached page is not tracked: -1 = no check
                getattr(plan, "verify_expected_" + name)[:n] = -1
            plan.verify_num_valid.fill_(n)
            plan.enable.fill_(1)
            for half in HALVES:
                self._verify(g, "SWEEP", half, plan)
        return len(slots)

    # -- host-offload support (records travel with the K/V bytes) ----------------------------
    def export_records(self, full_slots: torch.Tensor) -> Optional[dict]:
        if not self.enabled:
            return None
        return {(g.name, half): g.bufs[half][self._group_slots(g, full_slots)].clone()
                for g in self.groups for half in HALVES}

    def import_records(self, full_slots: torch.Tensor, records: Optional[dict], n: int) -> None:
        """Paste exported records into new slots and restamp per-slot fields (allocation epochs)."""
        if not self.enabled or records is None:
            return
        words = {f.name: f.word for f in self.L.INPUT_FIELDS}
        for g in self.groups:
            idx = self._group_slots(g, full_slots)
            for half in HALVES:
                buf = g.bufs[half]
                buf[idx] = records[(g.name, half)][:n].to(buf.device)
                view = buf.view(torch.int64)
                for name in self._per_slot:
                    view[idx, words[name]] = g.slot_tables[name][idx]

    def _group_slots(self, g: _Group, full_slots: torch.Tensor) -> torch.Tensor:
        full_slots = full_slots.to(self.device)
        return self.engine.swa_pool.full_to_swa[full_slots] if g.name == "SWA" else full_slots

    # -- draining ---------------------------------------------------------------------------
    def _snapshot(self, step: int) -> None:
        if self._pinned:
            if len(self._snapshots) >= SNAPSHOT_DEPTH:
                self._snapshots[0][2].synchronize()  # the device is SNAPSHOT_DEPTH steps behind
                self._poll()
            host = self._pinned_idx[self._next_pin]
            self._next_pin = (self._next_pin + 1) % SNAPSHOT_DEPTH
            host.copy_(self.write_index, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._snapshots.append((step, host, event))
        else:
            self._snapshots.append((step, int(self.write_index[0]), None))

    def _poll(self) -> list[Violation]:
        """Drain if a completed snapshot shows rows; never waits for the device otherwise."""
        hit = False
        while self._snapshots:
            step, host, event = self._snapshots[0]
            if event is not None and not event.query():
                break
            if (int(host[0]) if event is not None else host) > 0:
                hit = True
                break
            self._snapshots.popleft()
        return self.drain() if hit else []

    def drain(self) -> list[Violation]:
        """Read every pending row now (waits for the device), decode, record, log or raise."""
        if not self.enabled:
            return []
        count = int(self.write_index[0])  # synchronises: every snapshot copy before it has landed
        bounds = [(s, int(h[0]) if e is not None else h) for s, h, e in self._snapshots]
        self._snapshots.clear()
        if count == 0:
            return []
        last_step = bounds[-1][0] if bounds else None
        rows = self.ring[:min(count, self.ring_capacity)].cpu()
        steps = [self._step_of(i, bounds, last_step) for i in range(count)]
        self.write_index.zero_()
        found = self.decoder.decode(rows, steps[:len(rows)])
        lost = count - len(rows)
        st = self.stats
        st.drains += 1
        st.total += count
        st.lost += lost
        st.by_step.update(steps)
        for v in found:
            st.by_reason.update(v.reasons)
            st.by_tag[v.launch_tag] += 1
        self._capture_links(found)
        room = self.keep_violations - len(self.violations)
        self.violations += found[:max(0, room)]
        if self.mode == "log":
            for v in found:
                logger.warning(v.log_line())
            if lost:
                logger.warning(self.overflow_line(lost))
        if self.mode == "raise":
            more = f" (+{count - 1} more, {lost} lost to ring overflow)" if count > 1 else ""
            raise CanaryViolationError(
                f"kv-canary: violation at step {found[0].step if found else last_step}{more}: "
                + (found[0].log_line() if found else self.overflow_line(lost)), found)
        return found

    @staticmethod
    def _step_of(i: int, bounds, last_step) -> Optional[int]:
        for step, end in bounds:
            if i < end:
                return step
        return last_step

    def overflow_line(self, lost: int) -> str:
        return (f"kv_canary ring overflow: {lost} violation row(s) lost "
                f"(ring_capacity={self.ring_capacity}); per-step totals still count them")

    # -- reporting helpers ------------------------------------------------------------------
    def _capture_links(self, found: list[Violation]) -> None:
        """Remember, at drain time, the chain link of the record at each verify violation's slot
        (what cascade grouping compares expected_aux with; later writes may change the record)."""
        wanted = collections.defaultdict(list)
        for v in found:
            if v.is_verify and v.launch_tag_value in self._buf_of_tag:
                g, half = self._buf_of_tag[v.launch_tag_value]
                if 0 <= v.slot < g.num_slots:
                    wanted[(g.name, half)].append(v)
        for (name, half), vs in wanted.items():
            g = next(x for x in self.groups if x.name == name)
            idx = torch.tensor([v.slot for v in vs], dtype=torch.int64, device=self.device)
            records = g.bufs[half][idx].view(torch.int64).cpu().tolist()
            for v, words in zip(vs, records):
                self._links[(v.step, v.launch_tag_value, v.slot)] = record_link(self.L, words)

    def link_of(self, v: Violation) -> Optional[int]:
        """Chain link of the record a violation's slot held when it was drained (None if unknown)."""
        return self._links.get((v.step, v.launch_tag_value, v.slot))

    def grouped(self, violations: Optional[list[Violation]] = None) -> list[ViolationGroup]:
        """Root-cause groups of `violations` (default: everything drained so far)."""
        return group_cascades(self.violations if violations is None else violations, self.link_of)

    @property
    def kernel_runs(self) -> int:
        return int(self.kernel_run_counter[0]) if self.enabled else 0
