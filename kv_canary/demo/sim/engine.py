"""The serving loop: admission with prefix matching, chunked prefill, (speculative) decode, finish.
Each step builds a ForwardBatch as an engine does (CUDA-graph padding rows included) and runs the
canary around the stand-in model's forward; fault `hooks` may edit any of it (kv_canary.demo.faults).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import SimConfig
from .model import kv_bytes, next_token
from .pool import FULL, SWA, KvStorage, PageAllocator, SwaPool
from .radix import RadixCache

PADDING_ROW = 0   # request row 0 is the padding row (REQ_POOL_IDX_PADDING in every shipped schema)
PADDING_SLOT = 0  # slot 0 is the padded-token dummy slot (TOKEN_TO_KV_SLOT_PADDING)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as vLLM's LoRARequest names it (what vllm_request_namespace reads)."""
    lora_name: str
    lora_int_id: int


@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)   # prompt + sampled outputs
    row: int = 0
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0                                     # tokens whose K/V (and canary record) is written
    nodes: list = field(default_factory=list)           # locked radix nodes
    matched: int = 0                                    # prefix tokens taken from the radix cache
    spec_rejected: int = 0                              # drafts rejected by the last speculative step
    # The request's tenant, as vLLM names it: what keys the prefix cache besides the tokens.
    cache_salt: Optional[str] = None
    lora_request: Optional[Adapter] = None

    @property
    def namespace(self):
        """The prefix cache's key besides the tokens (None: shared by every request without one)."""
        return None if self.cache_salt is None and self.lora_request is None else (self.lora_request, self.cache_salt)

    @property
    def num_out(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def done(self) -> bool:
        return self.num_out >= self.max_new


@dataclass
class ForwardBatch:
    step: int
    requests: list                       # Request per row, None for padding rows
    req_pool_indices: torch.Tensor       # int64 [bs]
    prefix_lens: torch.Tensor            # int64 [bs]
    extend_seq_lens: torch.Tensor        # int64 [bs]
    input_ids: torch.Tensor              # int64 [tokens] (padding tokens last)
    positions: torch.Tensor              # int64 [tokens]
    out_cache_loc: torch.Tensor          # int64 [tokens], full-pool slots
    swa_out_cache_loc: Optional[torch.Tensor]  # int64 [tokens], SWA slots (None without SWA)
    token_rids: torch.Tensor             # int64 [tokens], owning request id (0 for padding)
    drafts: dict = field(default_factory=dict)  # row -> number of draft tokens in its extend

    @property
    def bs(self) -> int:
        return len(self.requests)

    @property
    def num_padding(self) -> int:
        return sum(r is None for r in self.requests)


class Engine:
    def __init__(self, config: SimConfig, canary=None, hooks=(), device="cpu"):
        self.cfg = c = config
        self.device = torch.device(device)
        self.rng = random.Random(c.seed)
        self.canary = canary
        self.hooks = list(hooks)
        self.alloc = PageAllocator(c.num_pages, c.page_size, c.seed, self.device)
        self.full = KvStorage(c.num_full_layers, c.num_slots, c.page_size, c.bytes_per_token, self.device)
        self.swa_pool = SwaPool(c.num_slots, c.seed, self.device) if c.swa_enabled else None
        # SWA K/V rows hold one slot each (the SWA pool is token-granular).
        self.swa = KvStorage(c.num_swa_layers, c.num_slots, 1, c.bytes_per_token, self.device) if c.swa_enabled else None
        if self.swa_pool is not None:
            self.alloc.on_free.append(lambda page: self.swa_pool.release(self.alloc.slots(page)))
        self.radix = RadixCache(self.alloc, c.page_size) if c.radix_cache else None
        self.req_rows = c.max_running + 1
        self.req_to_token = torch.zeros((self.req_rows, c.max_ctx), dtype=torch.int32, device=self.device)
        self.free_rows = list(range(1, self.req_rows))
        self.system_prompts = [[self.rng.randrange(1, c.vocab) for _ in range(c.system_prompt_len)]
                               for _ in range(c.num_system_prompts)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.host_snapshots: dict[int, dict] = {}  # rid -> host copy taken by retract()
        self.step_no = 0
        self._next_rid = 1
        if canary is not None:
            canary.attach(self)

    # -- workload ---------------------------------------------------------------------------
    def new_request(self) -> Request:
        c = self.cfg
        n = self.rng.randint(*c.prompt_len)
        prompt = []
        if self.system_prompts and self.rng.random() < 0.7:
            prompt = list(self.rng.choice(self.system_prompts))[:n - 1]
        prompt += [self.rng.randrange(1, c.vocab) for _ in range(n - len(prompt))]
        req = Request(self._next_rid, prompt, self.rng.randint(*c.output_len), tokens=list(prompt))
        if c.tenants:  # drawn only then: a config without tenants keeps its random stream
            k = self.rng.randrange(c.tenants)
            if c.tenant_kind == "cache_salt":
                req.cache_salt = f"tenant-{k}"
            else:
                req.lora_request = Adapter(f"adapter-{k}", k + 1)
        self._next_rid += 1
        return req

    def _arrivals(self) -> None:
        while len(self.waiting) + len(self.running) < self.cfg.max_running + 1 and self._next_rid <= self.cfg.num_requests:
            self.waiting.append(self.new_request())

    # -- memory -----------------------------------------------------------------------------
    def slot_of(self, req: Request, pos: int) -> int:
        return req.pages[pos // self.cfg.page_size] * self.cfg.page_size + pos % self.cfg.page_size

    def _ensure_pages(self, req: Request, upto: int) -> None:
        need = -(-upto // self.cfg.page_size) - len(req.pages)
        if need > 0:
            if need > self.alloc.num_free and self.radix is not None:
                self.radix.evict(need - self.alloc.num_free)
            req.pages += self.alloc.alloc(need)

    def _admit(self) -> None:
        while self.waiting and self.free_rows:
            req = self.waiting[0]
            # Leave at least one token to extend, as a serving engine must.
            path = self.radix.match(req.tokens[:len(req.tokens) - 1], req.namespace) if self.radix is not None else []
            if not self._fits(req, len(path)):
                break  # admission control: running requests must be able to finish
            if self.radix is not None:
                self.radix.lock(path, +1)
            req.nodes, req.matched = path, len(path) * self.cfg.page_size
            req.pages = [n.page for n in path]
            self.alloc.ref(req.pages)
            req.kv_len = req.matched
            self.waiting.pop(0)
            self._place(req)

    def _pages_for(self, req: Request) -> int:
        return -(-(len(req.prompt) + req.max_new + self.cfg.spec_draft_tokens) // self.cfg.page_size)

    def _fits(self, req: Request, matched_pages: int) -> bool:
        need = sum(max(0, self._pages_for(r) - len(r.pages)) for r in self.running)
        need += self._pages_for(req) - matched_pages
        evictable = sum(n.lock == 0 for n in self.radix.nodes()) - matched_pages if self.radix is not None else 0
        return need <= self.alloc.num_free + evictable

    def _place(self, req: Request) -> None:
        req.row = self.free_rows.pop(0)
        if req.pages:
            slots = [self.slot_of(req, p) for p in range(req.kv_len)]
            self.req_to_token[req.row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
        self.running.append(req)
        if self.canary is not None:
            self.canary.on_tokens(req.row, 0, req.tokens)

    def _release(self, req: Request, cache: bool) -> None:
        if self.radix is not None:
            self.radix.lock(req.nodes, -1)
            if cache:
                full = req.kv_len - req.kv_len % self.cfg.page_size
                self.radix.insert(req.tokens[:full], req.pages, req.namespace)
        self.alloc.unref(req.pages)
        req.pages, req.nodes = [], []
        self.free_rows.append(req.row)
        self.running.remove(req)

    # -- retract / restore (host offload), used by the stale-transfer scenario ---------------
    def retract(self, req: Request) -> None:
        """Copy a running request's K/V bytes and canary records to the host and free its slots."""
        slots = torch.tensor([self.slot_of(req, p) for p in range(req.kv_len)], dtype=torch.int64)
        self.host_snapshots[req.rid] = {"kv_len": req.kv_len, "bytes": self._copy_bytes(slots),
                                        "records": self.canary.export_records(slots) if self.canary else None}
        self._release(req, cache=False)

    def restore(self, req: Request, snapshot_of: Optional[int] = None, upto: Optional[int] = None) -> None:
        """Bring a retracted request back into fresh slots from its host copy; with `snapshot_of` (the
        stale-transfer bug) its first `upto` tokens come from that request's copy instead."""
        n = req.kv_len
        other = self.host_snapshots[snapshot_of] if snapshot_of is not None else None
        k = n if upto is None else upto
        if other is not None and not 0 <= k <= min(n, other["kv_len"]):
            raise ValueError(f"Engine.restore upto must be in [0, {min(n, other['kv_len'])}] (tokens both "
                             f"copies hold), got {k}")
        own = self.host_snapshots.pop(req.rid)   # a host copy is restored once
        self._ensure_pages(req, n)   # fresh pages: retract() released the old ones
        slots = torch.tensor([self.slot_of(req, p) for p in range(n)], dtype=torch.int64)
        if self.swa_pool is not None:
            self.swa_pool.assign(slots.tolist())
        self._place(req)
        # The stale-transfer bug: the other copy lands over the first k tokens of the request's own.
        for snap, m in [(own, n)] if other is None else [(own, n), (other, k)]:
            self._paste_bytes(slots[:m], snap["bytes"])
            if self.canary is not None:
                self.canary.import_records(slots[:m], snap["records"], m)

    def _copy_bytes(self, slots: torch.Tensor) -> dict:
        return {name: [[store.slot_view(t)[idx].clone() for t in half] for half in store.halves()]
                for name, store, idx in self._stores(slots)}

    def _paste_bytes(self, slots: torch.Tensor, data: dict) -> None:
        """Write a _copy_bytes copy into `slots` (its first len(slots) rows, when it holds more)."""
        for name, store, idx in self._stores(slots):
            for half, half_data in zip(store.halves(), data[name]):
                for t, rows in zip(half, half_data):
                    store.slot_view(t)[idx] = rows[:len(idx)]

    def _stores(self, slots: torch.Tensor):
        yield "full", self.full, slots.to(self.device)
        if self.swa_pool is not None:
            yield "swa", self.swa, self.swa_pool.full_to_swa[slots.to(self.device)]

    # -- one forward step --------------------------------------------------------------------
    def schedule(self) -> Optional[ForwardBatch]:
        c = self.cfg
        rows, pre, ext, ids, pos, locs, rids, drafts = [], [], [], [], [], [], [], {}
        for req in list(self.running):
            start = req.kv_len
            if start < len(req.prompt):                      # (chunked) prefill
                toks = req.tokens[start:start + c.chunk_size]
            else:                                            # decode, optionally with drafts
                d = c.spec_draft_tokens
                toks = [req.tokens[start]] + [self._draft(req, start + 1 + j) for j in range(d)]
                drafts[len(rows)] = d
            n = len(toks)
            self._ensure_pages(req, start + n)
            slots = [self.slot_of(req, p) for p in range(start, start + n)]
            self.req_to_token[req.row, start:start + n] = torch.tensor(slots, dtype=torch.int32)
            rows.append(req)
            pre.append(start)
            ext.append(n)
            ids += toks
            pos += range(start, start + n)
            locs += slots
            rids += [req.rid] * n
        if not rows:
            return None
        if len(drafts) == len(rows):
            # Decode-only: CUDA-graph replay pads to the captured batch size (a power of two), padding rows last.
            pad = (1 << (len(rows) - 1).bit_length()) - len(rows)
            rows += [None] * pad
            for column, value in ((pre, 0), (ext, 1), (ids, 0), (pos, 0), (locs, PADDING_SLOT), (rids, 0)):
                column += [value] * pad
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        swa_loc = None
        if self.swa_pool is not None:
            self.swa_pool.assign([s for s in locs if s > 0])
            swa_loc = t([self.swa_pool.lookup(s) if s > 0 else PADDING_SLOT for s in locs])
        return ForwardBatch(self.step_no, rows, t([r.row if r else PADDING_ROW for r in rows]), t(pre), t(ext),
                            t(ids), t(pos), t(locs), swa_loc, t(rids), drafts)

    def _draft(self, req: Request, pos: int) -> int:
        # The draft model is right 60% of the time (seeded), so steps accept 0..d drafts.
        truth = next_token(req.rid, pos - 1, self.cfg.vocab)
        return truth if self.rng.random() < 0.6 else (truth + 1) % self.cfg.vocab

    def forward(self, batch: ForwardBatch) -> None:
        """The stand-in model writes K/V bytes of every batch token (padding tokens included)."""
        c = self.cfg
        self._store(self.full, range(c.num_full_layers), batch.out_cache_loc, batch)
        if self.swa is not None:
            self._store(self.swa, range(c.num_full_layers, c.num_full_layers + c.num_swa_layers),
                        batch.swa_out_cache_loc, batch)

    def _store(self, store: KvStorage, layers, locs: torch.Tensor, batch: ForwardBatch) -> None:
        # Index with the slots as given: -1 wraps to the last slot exactly like a GPU store
        # through a signed index would land there; indices past the pool would fault on a GPU
        # (or corrupt other memory), here they are dropped.
        keep = locs < store.num_slots
        locs, ids, pos = locs[keep], batch.input_ids[keep], batch.positions[keep]
        for i, layer in enumerate(layers):
            for half, tensors in enumerate(store.halves()):
                store.slot_view(tensors[i])[locs] = kv_bytes(ids, pos, layer, half, store.bytes_per_token)

    def commit(self, batch: ForwardBatch) -> None:
        """Advance request state after the forward: sample, accept drafts, finish."""
        ids = batch.input_ids.tolist()
        for row, req in enumerate(batch.requests):
            if req is None:
                continue
            n = int(batch.extend_seq_lens[row])
            d = batch.drafts.get(row, 0)
            if d:
                drafted = ids[self._flat_index(batch, row) + 1:][:d]
                accepted = 0
                while accepted < d and drafted[accepted] == next_token(req.rid, req.kv_len + accepted, self.cfg.vocab):
                    accepted += 1
                req.spec_rejected = d - accepted
                req.kv_len += 1 + accepted
                self._append(req, drafted[:accepted] + [next_token(req.rid, req.kv_len - 1, self.cfg.vocab)])
                req.kv_len = min(req.kv_len, len(req.tokens))
            else:
                req.kv_len += n
                if req.kv_len == len(req.tokens):
                    self._append(req, [next_token(req.rid, req.kv_len - 1, self.cfg.vocab)])
        for req in [r for r in batch.requests if r is not None and r.done]:
            self._release(req, cache=True)
            self.finished.append(req)

    def _append(self, req: Request, toks: list[int]) -> None:
        toks = toks[:req.max_new - req.num_out]
        if self.canary is not None:
            self.canary.on_tokens(req.row, len(req.tokens), toks)
        req.tokens += toks

    @staticmethod
    def _flat_index(batch: ForwardBatch, row: int) -> int:
        return int(batch.extend_seq_lens[:row].sum())

    def step(self) -> Optional[ForwardBatch]:
        self._arrivals()
        for h in self.hooks:
            getattr(h, "before_schedule", lambda e: None)(self)
        self._admit()
        batch = self.schedule()
        if batch is not None:
            for h in self.hooks:
                getattr(h, "edit_batch", lambda e, b: None)(self, batch)
            if self.canary is not None:
                self.canary.head(batch)
            self.forward(batch)
            for h in self.hooks:
                getattr(h, "during_forward", lambda e, b: None)(self, batch)
            if self.canary is not None:
                self.canary.tail(batch)
            self.commit(batch)
        if self.canary is not None:
            self.canary.after_step(self.step_no)
        self.step_no += 1
        return batch

    def run(self, steps: int, progress=None) -> None:
        for i in range(steps):
            self.step()
            if progress is not None:
                progress(i + 1, steps)

    # -- what the canary protects ------------------------------------------------------------
    def canary_pools(self) -> dict:
        """The KV pools by launch-tag group (kv_canary.engine.contract.KvPoolView): the full pool, and
        the sliding-window pool when the model has SWA layers."""
        from ...engine.contract import KvPoolView
        pools = {FULL: KvPoolView(self.full, window=0, full_to_pool=None, allocation_epoch=self.alloc.epoch,
                                  out_cache_loc=lambda batch: batch.out_cache_loc, translate=None)}
        if self.swa is not None:
            pools[SWA] = KvPoolView(self.swa, window=self.cfg.swa_window, full_to_pool=self.swa_pool.full_to_swa,
                                    allocation_epoch=self.swa_pool.epoch,
                                    out_cache_loc=lambda batch: batch.swa_out_cache_loc,
                                    translate=self.swa_pool.lookup)
        return pools

    # -- what the sweep verifies -------------------------------------------------------------
    def cached_entries(self):
        """(slots, positions, tokens, prev_slots) of every radix-held slot, chain by chain."""
        slots, positions, tokens, prevs = [], [], [], []
        if self.radix is None:
            return slots, positions, tokens, prevs
        ps = self.cfg.page_size
        for node in self.radix.nodes():
            parent_last = node.parent.page * ps + ps - 1 if node.depth > 1 else -1
            for i, tok in enumerate(node.key):
                s = node.page * ps + i
                slots.append(s)
                positions.append((node.depth - 1) * ps + i)
                tokens.append(tok)
                prevs.append(s - 1 if i else parent_last)
        return slots, positions, tokens, prevs
