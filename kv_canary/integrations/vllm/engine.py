"""vLLM's worker seen through the engine contract (kv_canary.engine.contract): a block-table engine.

- slots: vLLM's own, `block * block_size + offset` (its slot_mapping numbering; block 0 is vLLM's null
  block, so the canary's padding slot 0 is never a real token's);
- the block table is the attention metadata's `block_table` (what the forward reads), copied per step
  into the canary rows of the batch's requests; where the step writes is its `slot_mapping`;
- request rows: the scheduler names, per request, the slot its write starts at (StepMeta), which is
  how a batch row (the attention metadata has no request ids) is matched to its request;
- token ids come from the scheduler's requests (prompt at admission, then each sampled token), so the
  appended tokens are read from the canary's own expected-token pool;
- the sweep walks the full blocks finished requests left in the prefix cache, dropped once the
  scheduler hands such a block to a new owner.

Host work per step is per request (its row, its lengths, its new blocks), never per token.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...engine.contract import KvPoolView, Limits
from . import layout as kv_layout

logger = logging.getLogger("kv_canary")
FULL_GROUP = "full"


class VllmKvStorage:
    """KvStorage over one KV cache group's per-layer cache tensors, read in place: each half's rows start
    at its first byte in a block, and its KvLayout says where a slot's heads and chunks lie."""

    def __init__(self, caches: list, layout: kv_layout.BlockLayout, block_size: int):
        self.row_slots = block_size
        self.block_layout = layout
        self.bytes_per_token = layout.k.num_heads * layout.k.head_bytes
        self.num_slots = int(caches[0].shape[0]) * block_size
        self.k = [kv_layout.row_view(c, layout, layout.k) for c in caches]
        self.v = [kv_layout.row_view(c, layout, layout.v) for c in caches]
        self.layouts = (kv_layout.kv_layout(layout.k), kv_layout.kv_layout(layout.v))

    def halves(self):
        return (self.k, self.v)


@dataclass(eq=False)
class Request:
    rid: int
    row: int
    matched: int
    req_id: str
    inputs: dict = field(default_factory=dict)   # its request_input values (the scheduler side's, at admission)


@dataclass
class Batch:
    """One forward (the contract's ForwardBatch) plus where it writes."""
    step: int
    requests: list
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_rids: torch.Tensor
    out_cache_loc: torch.Tensor
    same_forward_reads: bool = False

    @property
    def bs(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class _Kept:
    block: object                 # meta.CachedBlock
    serial: int
    parent_serial: int            # the parent's serial when this block was recorded (-1: none)


class VllmEngine:
    """The worker's KV cache group as a kv-canary BlockTableEngine."""

    same_forward_reads = True     # a prefix hit may read a block another row writes in the same forward

    def __init__(self, storage: VllmKvStorage, *, block_size: int, max_running: int, max_ctx: int, device,
                 max_requests: Optional[int] = None, input_fields: tuple = ()):
        self.storage = storage
        self.input_fields = tuple(input_fields)   # the schema's request_input fields (Scheduled.inputs' order)
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_blocks = -(-max_ctx // block_size)
        self.cfg = Limits(max_running=max_running, max_ctx=self.max_blocks * block_size)
        self.max_requests = max_requests or 2 * max_running
        self.req_rows = self.max_requests + 1
        self.req_to_block = torch.zeros((self.req_rows, self.max_blocks), dtype=torch.int32, device=self.device)
        self.epoch = torch.zeros(storage.num_slots, dtype=torch.int64, device=self.device)
        self.requests: dict[str, Request] = {}
        self.free_rows = list(range(1, self.req_rows))
        self._next_rid = 1
        self._kept: dict[int, _Kept] = {}
        self._serial = 0
        self.canary = None            # the manager, once attached and enabled
        self.unmatched_rows = 0       # batch rows no scheduled request could be matched to (left unguarded)
        self.same_forward_steps = 0   # forwards with a row reading a block another row writes in them

    # -- the contract -------------------------------------------------------------------------
    def canary_pools(self) -> dict:
        return {FULL_GROUP: KvPoolView(self.storage, window=0, full_to_pool=None, allocation_epoch=self.epoch,
                                       out_cache_loc=lambda batch: batch.out_cache_loc)}

    def cached_entries(self):
        """(slots, positions, tokens, prev_slots) of every block kept for reuse."""
        slots, positions, tokens, prevs = [], [], [], []
        bs = self.block_size
        for block, kept in self._kept.items():
            b = kept.block
            parent = self._kept.get(b.parent)
            if b.parent < 0:
                head = -1
            elif parent is not None and parent.serial == kept.parent_serial:
                head = b.parent * bs + bs - 1
            else:
                head = 0   # the predecessor was handed to another request since: its link is unknown
            first = block * bs
            slots += range(first, first + bs)
            positions += range(b.first_position, b.first_position + bs)
            tokens += b.tokens
            prevs += [head, *range(first, first + bs - 1)]
        return slots, positions, tokens, prevs

    # -- per step -----------------------------------------------------------------------------
    def apply(self, meta) -> None:
        """A step's request knowledge: rows freed and taken, token ids, new blocks, cached blocks."""
        for rid in meta.released:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.free_rows.append(req.row)
        for b in meta.cached:
            parent = self._kept.get(b.parent)
            self._serial += 1
            self._kept[b.block] = _Kept(b, self._serial, parent.serial if parent is not None else -1)
        new_blocks = []
        for s in meta.scheduled:
            req = self.requests.get(s.req_id)
            if s.matched >= 0 or req is None:
                if req is not None:       # admitted again without a release in between: a fresh row anyway
                    self.free_rows.append(req.row)
                req = self._admit(s)
            if s.new_tokens:
                if s.sent + len(s.new_tokens) > self.cfg.max_ctx:
                    raise ValueError(f"kv-canary: request {s.req_id} holds {s.sent + len(s.new_tokens)} tokens, more "
                                     f"than max_ctx={self.cfg.max_ctx} (vLLM's max_model_len, fixed at start-up)")
                if self.canary is not None:
                    self.canary.on_tokens(req.row, s.sent, list(s.new_tokens))
            new_blocks += s.new_blocks
        if new_blocks:
            for b in new_blocks:
                self._kept.pop(b, None)  # handed to a new owner: what it held no longer applies
            idx = torch.tensor(new_blocks, dtype=torch.int64).to(self.device)
            self.epoch.view(-1, self.block_size)[idx] += 1

    def _admit(self, s) -> Request:
        if not self.free_rows:
            raise ValueError(f"kv-canary: more than {self.max_requests} requests hold KV cache at once")
        req = Request(self._next_rid, self.free_rows.pop(0), max(s.matched, 0), s.req_id,
                      dict(zip(self.input_fields, s.inputs)))
        self._next_rid += 1
        self.requests[s.req_id] = req
        return req

    def batch(self, meta, attn, step: int) -> Optional[Batch]:
        """The forward's batch from its attention metadata (`query_start_loc`, `seq_lens`, `block_table`,
        `slot_mapping`) and the step's StepMeta; None when nothing is scheduled."""
        qsl = attn.query_start_loc.to("cpu", torch.int64)
        rows_n = int(qsl.shape[0]) - 1
        if rows_n <= 0 or not meta.scheduled:
            return None
        starts = qsl[:-1]
        lens = (qsl[1:] - starts).tolist()
        seq = attn.seq_lens[:rows_n].to("cpu", torch.int64).tolist()
        slot_mapping = attn.slot_mapping
        first = slot_mapping[starts.clamp(max=max(int(slot_mapping.shape[0]) - 1, 0)).to(slot_mapping.device)]
        first = first.to("cpu", torch.int64).tolist()
        by_slot = {s.write_slot: s for s in meta.scheduled}
        matched: list = [None] * rows_n
        for r in range(rows_n):
            s = by_slot.get(first[r])
            if s is not None and s.scheduled == lens[r] and s.computed == seq[r] - lens[r]:
                matched[r] = s
        left = [s for s in meta.scheduled if s not in matched]
        for r in range(rows_n):   # a row whose write slot is not where the scheduler put it: by its lengths
            if matched[r] is None and lens[r] > 0:
                fits = [s for s in left if s.scheduled == lens[r] and s.computed == seq[r] - lens[r]]
                if len(fits) == 1:
                    matched[r] = fits[0]
                    left.remove(fits[0])
        kept = [r for r in range(rows_n) if matched[r] is not None and lens[r] > 0]
        if len(kept) < rows_n:
            self.unmatched_rows += sum(1 for r in range(rows_n) if matched[r] is None and lens[r] > 0)
        if not kept:
            return None
        reqs = [self.requests[matched[r].req_id] for r in kept]
        self.same_forward_steps += bool(meta.same_forward_reads)
        dev = self.device
        extend = [lens[r] for r in kept]
        prefix = [seq[r] - lens[r] for r in kept]
        host = torch.tensor([[q.row for q in reqs], prefix, extend, [q.rid for q in reqs]], dtype=torch.int64)
        rows_t, prefix_t, extend_t, rids_t = host.to(dev)
        width = min(int(attn.block_table.shape[1]), self.max_blocks)
        kept_t = torch.tensor(kept, dtype=torch.int64)
        table = attn.block_table.index_select(0, kept_t.to(attn.block_table.device))[:, :width]
        self.req_to_block[rows_t, :width] = table.to(dev, torch.int32)
        n = int(sum(extend))
        if len(kept) == rows_n:
            locs = slot_mapping[:n]
        else:
            idx = torch.cat([torch.arange(int(starts[r]), int(starts[r]) + lens[r]) for r in kept])
            locs = slot_mapping.index_select(0, idx.to(slot_mapping.device))
        out_cache_loc = locs.to(dev, torch.int64)
        # Each token's batch row (one searchsorted: cheaper here than three repeat_interleave under vLLM's
        # thread settings), then its canary row, position and token id.
        ends = torch.cumsum(extend_t, 0)
        flat = torch.arange(n, device=dev)
        seg = torch.searchsorted(ends, flat, right=True)
        positions = prefix_t[seg] + flat - (ends - extend_t)[seg]
        pool = self.canary.req_pool
        input_ids = pool[rows_t[seg], positions.clamp(max=pool.shape[1] - 1)].to(torch.int64)
        return Batch(step, reqs, rows_t, prefix_t, extend_t, input_ids, positions, rids_t[seg], out_cache_loc,
                     meta.same_forward_reads)
