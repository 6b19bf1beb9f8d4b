"""The engine contract: what `CanaryManager` needs from a serving engine, as `typing.Protocol` classes.

An engine implements these by duck typing; `check_engine(engine)` names, before anything is
allocated, every part that is missing. docs/attach-your-engine.md walks through them and the step
protocol (attach, on_tokens, head, forward, tail, after_step). A slot is a token's index into one
KV pool; slot 0 is the padding slot and request row 0 the padding row. A request's slots are found
per token (`SlotTableEngine.req_to_token`, SGLang's) or per block (`BlockTableEngine.req_to_block`,
expanded on the device for the batch's rows each step).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union, runtime_checkable

import torch

__all__ = ("KvStorage", "KvPool", "KvPoolView", "EngineLimits", "Request", "ForwardBatch", "SweepEntries",
           "Engine", "SlotTableEngine", "BlockTableEngine", "check_engine", "slot_table_kind")

IndexList = Union[Sequence[int], torch.Tensor]


@runtime_checkable
class KvStorage(Protocol):
    """The real K/V bytes of one pool, per layer (what the real-K/V fingerprint reads)."""
    k: Sequence[torch.Tensor]      # per layer: a >= 2-D tensor, row r = slots r*row_slots .. (r+1)*row_slots-1
    v: Sequence[torch.Tensor]
    num_slots: int                 # slots of the pool (canary records allocated per slot)
    row_slots: int                 # slots per tensor row (a page of a paged pool; 1 for a token-granular one)
    bytes_per_token: int           # K (or V) bytes of one slot in one layer, a multiple of 16

    def halves(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """(k, v)."""
        ...


class KvPool(Protocol):
    """One KV pool as the engine offers it (`Engine.canary_pools()[group]`); KvPoolView is one."""
    storage: KvStorage
    window: int                                 # sliding window in tokens (0: full attention)
    full_to_pool: Optional[torch.Tensor]        # int64 LUT full-pool slot -> this pool's slot (None: same slots)
    allocation_epoch: torch.Tensor              # int64 [num_slots]: the allocator's epoch of each slot
    out_cache_loc: Callable                     # batch -> int64 [tokens]: where the batch's tokens are written
    translate: Optional[Callable[[int], int]]   # full-pool slot -> this pool's slot on the host (sweep), or None


@dataclass(frozen=True)
class KvPoolView:
    """A ready-made KvPool: what most engines hand the manager."""
    storage: KvStorage
    window: int
    full_to_pool: Optional[torch.Tensor]
    allocation_epoch: torch.Tensor
    out_cache_loc: Callable
    translate: Optional[Callable[[int], int]] = None


class EngineLimits(Protocol):
    """Capacities fixed at attach (`Engine.cfg`)."""
    max_running: int               # request rows one forward batch may hold (padding rows included)
    max_ctx: int                   # tokens one request may hold (columns of the slot table)


class Request(Protocol):
    """One running request as a batch row names it."""
    rid: int                       # request id (> 0), what a schema's `request_id` field stores
    row: int                       # its request row (1 .. req_rows-1)
    matched: int                   # prefix tokens it took from a prefix cache (0: it wrote every slot itself)


class ForwardBatch(Protocol):
    """One forward step's batch (all tensors on `Engine.device`, int64)."""
    requests: Sequence[Optional[Request]]   # per batch row; None for a padding row
    req_pool_indices: torch.Tensor          # [bs] request rows (0 = padding)
    prefix_lens: torch.Tensor               # [bs] tokens already in the cache (what the step reads)
    extend_seq_lens: torch.Tensor           # [bs] tokens this step appends
    input_ids: torch.Tensor                 # [tokens] the appended tokens, request by request
    positions: torch.Tensor                 # [tokens] their positions
    token_rids: torch.Tensor                # [tokens] each token's request id (0 for padding)

    @property
    def bs(self) -> int:
        ...


SweepEntries = tuple[IndexList, IndexList, IndexList, IndexList]
"""(slots, positions, tokens, prev_slots) of every slot the sweep verifies, in full-pool slots;
prev -1 = chain head, prev 0 = predecessor unknown (chain not checked for that entry)."""


@runtime_checkable
class Engine(Protocol):
    device: torch.device
    cfg: EngineLimits
    req_rows: int                  # request rows (row 0 = padding)

    def canary_pools(self) -> Mapping[str, KvPool]:
        """The KV pools by launch-tag group (`full`; `swa` for sliding-window layers)."""
        ...

    def cached_entries(self) -> SweepEntries:
        """What the sweep verifies: the slots the engine keeps for reuse (prefix cache), nobody reading them now."""
        ...


@runtime_checkable
class SlotTableEngine(Engine, Protocol):
    req_to_token: torch.Tensor     # int32 [req_rows, max_ctx]: slot of each request row's position


@runtime_checkable
class BlockTableEngine(Engine, Protocol):
    req_to_block: torch.Tensor     # int32 [req_rows, blocks]: block of each request row's position // block_size;
    #                                the width may grow on demand (at least every batch row's blocks, at most max_ctx's)
    block_size: int                # slots per block: slot = block * block_size + position % block_size


def slot_table_kind(engine) -> str:
    """'slots' or 'blocks': how the engine names its requests' slots (check_engine first)."""
    return "slots" if hasattr(engine, "req_to_token") else "blocks"


def check_engine(engine) -> None:
    """A ValueError naming every part of the contract `engine` misses or gets wrong."""
    problems = []
    for name in ("device", "cfg", "req_rows", "canary_pools", "cached_entries"):
        if not hasattr(engine, name):
            problems.append(f"no `{name}`")
    cfg = getattr(engine, "cfg", None)
    for name in ("max_running", "max_ctx"):
        value = getattr(cfg, name, None)
        if cfg is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"cfg.{name} must be an int >= 1, got {value!r}")
    rows = getattr(engine, "req_rows", None)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 2):
        problems.append(f"req_rows must be an int >= 2 (row 0 is the padding row), got {rows!r}")
    table = getattr(engine, "req_to_token", None)
    blocks = getattr(engine, "req_to_block", None)
    if table is None and blocks is None:
        problems.append("neither `req_to_token` (slot table) nor `req_to_block` + `block_size` (block table)")
    elif table is not None:
        problems += _table_problems("req_to_token", table, rows, cfg)
    else:
        size = getattr(engine, "block_size", None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(f"block_size must be an int >= 1, got {size!r}")
        else:
            # Its width may be less than max_ctx: a block table may grow on demand (the manager reads its
            # current width at every step); it must hold the blocks of every request in a batch.
            problems += _table_problems("req_to_block", blocks, rows, None)
    if problems:
        raise ValueError(f"kv-canary: {type(engine).__name__} does not meet the engine contract "
                         f"(kv_canary.engine.contract): " + "; ".join(problems))


def _table_problems(name: str, table, rows, cfg) -> list[str]:
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2:
        got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else repr(type(table))
        return [f"{name} must be an int32 [req_rows, columns] tensor, got {got}"]
    out = []
    if isinstance(rows, int) and table.shape[0] != rows:
        out.append(f"{name} has {table.shape[0]} rows, req_rows is {rows}")
    max_ctx = getattr(cfg, "max_ctx", None)
    if cfg is not None and isinstance(max_ctx, int) and table.shape[1] < max_ctx:
        out.append(f"{name} has {table.shape[1]} columns, fewer than cfg.max_ctx={max_ctx}")
    return out
