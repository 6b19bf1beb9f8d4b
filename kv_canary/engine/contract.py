"""What a serving engine hands the CanaryManager, as code (typing.Protocol classes).

An engine implements `CanaryEngine` (the manager's `attach(engine)` reads it) and passes batches that
implement `ForwardBatch` to `prepare` / `launch_head` / `tail`. kv_canary.demo.sim.Engine is one
implementation; nothing here imports it. Structural typing: an engine needs no base class, only
these attributes (`isinstance(engine, CanaryEngine)` checks their presence at run time).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class KvStorage(Protocol):
    """One pool's K/V bytes: per layer one uint8 tensor [rows, row_slots * bytes_per_token]; slot s
    is row s // row_slots at byte (s % row_slots) * bytes_per_token (how a RealKvSource reads it)."""
    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    num_slots: int
    row_slots: int
    bytes_per_token: int

    def halves(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """(K tensors, V tensors), in the schema's launch-tag half order."""


@runtime_checkable
class KvPool(Protocol):
    """One KV pool as the engine offers it (`canary_pools()[group]`); kv_canary.engine.manager.KvPoolView
    is a ready-made implementation."""
    storage: KvStorage
    window: int                                  # sliding window in tokens (0: full attention)
    full_to_pool: Optional[torch.Tensor]         # int64 LUT full-pool slot -> this pool's slot (None: same)
    allocation_epoch: torch.Tensor               # int64 [num_slots]: the allocator's epoch of each slot
    out_cache_loc: Callable                      # batch -> int64 [tokens]: the batch's slots in this pool
    translate: Optional[Callable[[int], int]]    # full-pool slot -> this pool's slot, on the host (sweep)


@runtime_checkable
class Request(Protocol):
    """A request row of a batch (None in `ForwardBatch.requests` for a padding row)."""
    rid: int          # the request's id (what a `request_id` input field stores)
    row: int          # its row of req_to_token
    matched: int      # prefix tokens taken from the radix cache (owned by an earlier request)


@runtime_checkable
class ForwardBatch(Protocol):
    """One forward step's batch (SGLang's names); token tensors list each request's extend in order."""
    requests: Sequence[Optional[Request]]
    bs: int                                      # len(requests), padding rows included
    req_pool_indices: torch.Tensor               # int64 [bs]: request rows (REQ_POOL_IDX_PADDING: padding)
    prefix_lens: torch.Tensor                    # int64 [bs]
    extend_seq_lens: torch.Tensor                # int64 [bs]
    input_ids: torch.Tensor                      # int64 [tokens]
    positions: torch.Tensor                      # int64 [tokens]
    token_rids: torch.Tensor                     # int64 [tokens]: each token's request id


@runtime_checkable
class EngineConfig(Protocol):
    max_running: int  # requests in one batch at most (the manager pads to the next power of two)
    max_ctx: int      # context positions of a request row


@runtime_checkable
class CanaryEngine(Protocol):
    """What `CanaryManager.attach(engine)` reads."""
    device: torch.device
    cfg: EngineConfig
    req_rows: int                                # rows of req_to_token
    req_to_token: torch.Tensor                   # int32 [req_rows, max_ctx]: slots of each request's positions

    def canary_pools(self) -> dict[str, KvPool]:
        """{group: pool} for the schema's launch-tag groups (`full`, and `swa` for sliding-window layers)."""

    def cached_entries(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """What the sweep verifies: (slots, positions, tokens, predecessor slots) of every cached slot."""
