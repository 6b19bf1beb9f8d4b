"""HF transformers' continuous batching seen through the engine contract (kv_canary.engine.contract).

`TransformersEngine` wraps one run's `ContinuousBatchProcessor` (its PagedAttentionCache, the
full-attention allocator's block tables and ledger, the IO's static input tensors) as a
block-table engine:

- slots: the full-attention allocator stores token `o` of block `b` at physical index
  `b * block_physical_stride + o` of every layer's K and V views; the canary numbers that slot
  `b * tokens_per_page + o` (one record per slot, `tokens_per_page` slots per block), so the
  allocator's own block table is the canary's block table;
- per step (`batch()`, after the engine prepared its inputs, before the forward): the batch's rows,
  prefix and extend lengths from the scheduled requests, the appended tokens and positions from the
  IO's `input_ids` / `position_ids`, and where they are written from the IO's `write_index` (the
  decode fast path, which writes through the block table instead, takes them from the block table);
- real K/V: each layer's K (and V) bytes as a [blocks, tokens_per_page * bytes_per_token] view of
  the cache tensor, which is what a RealKvSource reads;
- the sweep walks the blocks the ledger keeps for reuse (`ledger.cached_blocks`), with the tokens
  and positions recorded when their request released them.

Host work per step is per request (its block list, its lengths), never per token. The per-request
block table follows the work: its columns start at what the requests hold and double on demand
(up to `max_context`, default the whole cache), so a large cache costs nothing until a request is long.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...engine.contract import KvPoolView, Limits
from ...engine.manager import CanaryCoverageWarning

FULL_GROUP = "full"           # the canary's launch-tag group of full-attention layers
FULL_ATTENTION = "full_attention"  # transformers' allocator key of those layers
INITIAL_BLOCKS = 16           # block-table columns per request row before the first growth


class PagedKvStorage:
    """KvStorage over the full-attention allocator's share of the paged cache tensor."""

    def __init__(self, allocator):
        self.row_slots = allocator.tokens_per_page
        dtype = allocator.cache_dtype
        self.bytes_per_token = allocator.num_key_value_heads * allocator.head_dim * dtype.itemsize
        blocks = allocator.cache_tensor.reshape(-1).view(torch.uint8).view(-1, allocator.bytes_per_block)
        self.num_slots = blocks.shape[0] * self.row_slots
        page = self.row_slots * self.bytes_per_token
        # Per block and layer i of the group: K rows of its tokens, then V rows (2 * i and 2 * i + 1).
        self.k = [blocks[:, (2 * i) * page:(2 * i + 1) * page] for i in range(len(allocator.layer_indices))]
        self.v = [blocks[:, (2 * i + 1) * page:(2 * i + 2) * page] for i in range(len(allocator.layer_indices))]
        self.layers = list(allocator.layer_indices)

    def halves(self):
        return (self.k, self.v)


@dataclass(eq=False)
class Request:
    """A transformers request as a canary request row."""
    rid: int                      # the canary's request id (> 0)
    row: int
    matched: int                  # prefix tokens it did not write itself (prefix match, de-duplicated blocks)
    request_id: str               # transformers' id
    state: object                 # transformers' RequestState
    sent: int = 0                 # its token ids handed to the manager's expected-token pool so far


@dataclass
class Batch:
    """One step's batch (the contract's ForwardBatch) plus what the adapter and faults need."""
    step: int
    requests: list
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_rids: torch.Tensor
    out_cache_loc: torch.Tensor
    future_states: list = field(default_factory=list)   # transformers' FutureRequestState per row
    block_table_path: bool = False                      # the decode fast path (kernel writes via block table)

    @property
    def bs(self) -> int:
        return len(self.requests)


@dataclass
class _BlockMeta:
    """What a block kept for reuse holds, recorded when its request released it."""
    block_hash: int
    first_position: int
    tokens: list
    parent: Optional[int]         # the block before it in its request (None: first block)
    parent_hash: Optional[int]


class TransformersEngine:
    """One continuous-batching run (one ContinuousBatchProcessor) as a kv-canary BlockTableEngine."""

    def __init__(self, processor, *, max_requests: Optional[int] = None, max_context: Optional[int] = None):
        cache = processor.cache
        self.processor = processor
        self.cache = cache
        allocators = dict(cache.cache_allocators)
        if FULL_ATTENTION not in allocators:
            raise ValueError(f"kv-canary: the model's paged cache has no full-attention layers (allocators: "
                             f"{', '.join(allocators)}); kv_canary.integrations.transformers guards full-attention "
                             f"layers only")
        others = [n for n in allocators if n != FULL_ATTENTION]
        if others:
            warnings.warn(f"kv-canary: the {', '.join(others)} layers of this model are not guarded (their ring-buffer "
                          f"cache has no canary pool); only the full-attention layers are", CanaryCoverageWarning,
                          stacklevel=3)
        self.alloc = allocators[FULL_ATTENTION]
        self.group_index = self.alloc.index          # the allocator's row in the IO's write_index / block_table
        self.block_size = self.alloc.tokens_per_page
        self.stride = self.alloc.block_physical_stride
        self.storage = PagedKvStorage(self.alloc)
        self.device = torch.device(self.alloc.cache_tensor.device)
        cb = processor.cb_config
        max_running = int(cb.max_requests_per_batch)
        num_blocks = self.storage.num_slots // self.block_size
        ctx = int(max_context) if max_context is not None else min(cache.max_tokens_read, num_blocks * self.block_size)
        self.max_blocks = -(-ctx // self.block_size)
        self.cfg = Limits(max_running=max_running, max_ctx=self.max_blocks * self.block_size)
        self.max_requests = int(max_requests) if max_requests is not None else 2 * max_running
        self.req_rows = self.max_requests + 1
        # Columns grow on demand (_fit_blocks) up to max_blocks: sized by the longest request admitted.
        self.req_to_block = torch.zeros((self.req_rows, min(self.max_blocks, INITIAL_BLOCKS)), dtype=torch.int32,
                                        device=self.device)
        self.epoch = torch.zeros(self.storage.num_slots, dtype=torch.int64, device=self.device)
        self.requests: dict[str, Request] = {}
        self.free_rows = list(range(1, self.req_rows))
        self._next_rid = 1
        self._meta: dict[int, _BlockMeta] = {}
        self.canary = None
        self.step = 0                 # the step being run (or, after it, the last one run)
        self.last_batch: Optional[Batch] = None

    # -- the contract -------------------------------------------------------------------------
    def canary_pools(self) -> dict:
        return {FULL_GROUP: KvPoolView(self.storage, window=0, full_to_pool=None, allocation_epoch=self.epoch,
                                       out_cache_loc=lambda batch: batch.out_cache_loc)}

    def cached_entries(self):
        """(slots, positions, tokens, prev_slots) of every block the ledger keeps for reuse."""
        ledger = self.alloc.ledger
        for block in [b for b in self._meta if ledger.block_to_hash.get(b) != self._meta[b].block_hash]:
            del self._meta[block]   # evicted (or re-hashed): its recorded content no longer applies
        slots, positions, tokens, prevs = [], [], [], []
        bs = self.block_size
        for block in ledger.cached_blocks:
            meta = self._meta.get(block)
            if meta is None:
                continue
            first = block * bs
            if meta.parent is None:
                head = -1
            elif ledger.block_to_hash.get(meta.parent) == meta.parent_hash:
                head = meta.parent * bs + bs - 1
            else:
                head = 0   # the predecessor block was released and reused: its chain link is unknown
            slots += range(first, first + bs)
            positions += range(meta.first_position, meta.first_position + bs)
            tokens += meta.tokens
            prevs += [head, *range(first, first + bs - 1)]
        return slots, positions, tokens, prevs

    # -- per step -----------------------------------------------------------------------------
    def slot_of_physical(self, physical: torch.Tensor) -> torch.Tensor:
        """The canary slot of the allocator's physical token indices (int64, on the device)."""
        return torch.div(physical, self.stride, rounding_mode="floor") * self.block_size + physical % self.stride

    def batch(self, step: int) -> Batch:
        """The batch the IO holds now (after prepare_batch_tensors, before the forward)."""
        io = self.processor.inputs_and_outputs
        rows, prefix, extend, rids, reqs, flat_blocks, counts = [], [], [], [], [], [], []
        for fs in io.requests_in_batch:
            state = fs.state
            past = state.position_offset - fs.query_length   # prepare_batch_tensors advanced it already
            req = self.requests.get(state.request_id) or self._admit(state, past)
            blocks = self.alloc.block_table.get(state.request_id, [])
            if len(blocks) > self.max_blocks:
                raise ValueError(f"kv-canary: request {state.request_id} holds {len(blocks)} blocks, more than the "
                                 f"{self.max_blocks} the canary was attached for (max_context={self.cfg.max_ctx}); "
                                 f"attach with a larger max_context=")
            rows.append(req.row)
            prefix.append(past)
            extend.append(fs.query_length)
            rids.append(req.rid)
            reqs.append(req)
            flat_blocks += blocks
            counts.append(len(blocks))
        dev = self.device
        if counts and max(counts) > self.req_to_block.shape[1]:
            self._fit_blocks(max(counts))
        meta = torch.tensor([rows, prefix, extend, rids, counts], dtype=torch.int64).to(dev)
        rows_t, prefix_t, extend_t, rids_t, counts_t = meta
        self._refill_block_rows(rows_t, counts_t, flat_blocks)
        n = int(sum(extend))
        positions = io.position_ids[:n].to(torch.int64)
        block_path = bool(io.use_block_table)
        if block_path:  # the kernel writes through the block table: the slot of each token's position
            token_rows = torch.repeat_interleave(rows_t, extend_t)
            blocks = self.req_to_block[token_rows, torch.div(positions, self.block_size, rounding_mode="floor")]
            locs = blocks.to(torch.int64) * self.block_size + positions % self.block_size
        else:
            locs = self.slot_of_physical(io.write_index_storage[self.group_index, :n])
        return Batch(step, reqs, rows_t, prefix_t, extend_t, io.input_ids[:n].to(torch.int64), positions,
                     torch.repeat_interleave(rids_t, extend_t), locs, list(io.requests_in_batch), block_path)

    def _fit_blocks(self, blocks: int) -> None:
        """Block-table columns for `blocks` blocks (doubled, at most max_blocks), contents kept."""
        old = self.req_to_block
        cols = min(self.max_blocks, max(blocks, 2 * old.shape[1]))
        self.req_to_block = torch.zeros((old.shape[0], cols), dtype=old.dtype, device=self.device)
        self.req_to_block[:, :old.shape[1]].copy_(old)

    def _refill_block_rows(self, rows: torch.Tensor, counts: torch.Tensor, flat: list) -> None:
        """The batch's block-table rows from the allocator's lists: one host->device copy, one scatter."""
        if not flat:
            return
        values = torch.tensor(flat, dtype=torch.int32).to(self.device)
        starts = torch.cumsum(counts, 0) - counts
        token_rows = torch.repeat_interleave(rows, counts)
        cols = torch.arange(len(flat), dtype=torch.int64, device=self.device) - torch.repeat_interleave(starts, counts)
        self.req_to_block[token_rows, cols] = values

    def _admit(self, state, past: int) -> Request:
        if not self.free_rows:
            raise ValueError(f"kv-canary: more than {self.max_requests} requests hold KV cache at once; attach with a "
                             f"larger max_requests=")
        matched = past
        if self.cache.use_prefix_sharing:
            matched = max(past, 1)  # de-duplication may swap any complete block for another request's
        req = Request(self._next_rid, self.free_rows.pop(0), matched, state.request_id, state)
        self._next_rid += 1
        self.requests[state.request_id] = req
        self._send_tokens(req)
        return req

    def _send_tokens(self, req: Request) -> None:
        """Hand the manager the request's token ids it does not have yet (prompt, then sampled tokens)."""
        state = req.state
        known = len(state.initial_tokens) + len(state.generated_tokens)
        if known <= req.sent or self.canary is None:
            return
        if known > self.cfg.max_ctx:
            raise ValueError(f"kv-canary: request {req.request_id} holds {known} tokens, more than max_context="
                             f"{self.cfg.max_ctx} (fixed at attach)")
        n_init = len(state.initial_tokens)
        new = (list(state.initial_tokens[req.sent:]) + list(state.generated_tokens)) if req.sent < n_init \
            else list(state.generated_tokens[req.sent - n_init:])
        self.canary.on_tokens(req.row, req.sent, new)
        req.sent = known

    def after_update(self) -> None:
        """After the engine sampled: the new token ids of every request still holding its cache."""
        for req in list(self.requests.values()):
            self._send_tokens(req)

    # -- release --------------------------------------------------------------------------------
    def on_free(self, request_id: str) -> None:
        """Before the cache releases a request's blocks: remember what its complete blocks hold (the
        ledger may keep them for reuse) and free its row."""
        req = self.requests.pop(request_id, None)
        blocks = self.alloc.block_table.get(request_id, [])
        if req is not None:
            self.free_rows.append(req.row)
        if not blocks or req is None:
            return
        hashes = self.alloc.ledger.block_to_hash
        tokens = list(req.state.initial_tokens) + list(req.state.generated_tokens)
        bs = self.block_size
        for i, block in enumerate(blocks):
            h = hashes.get(block)
            if h is None or block in self._meta and self._meta[block].block_hash == h:
                continue
            parent = blocks[i - 1] if i else None
            self._meta[block] = _BlockMeta(h, i * bs, tokens[i * bs:(i + 1) * bs], parent,
                                           hashes.get(parent) if parent is not None else None)

    def reset(self) -> None:
        """The run's cache was reset (a persistent manager's next session): every row is free."""
        self.requests.clear()
        self.free_rows = list(range(1, self.req_rows))
        self._meta.clear()
