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

__all__ = ("KvLayout", "KvStorage", "KvPool", "KvPoolView", "EngineLimits", "Limits", "Request", "ForwardBatch", "SweepEntries",
           "Engine", "SlotTableEngine", "BlockTableEngine", "check_engine", "check_storage_layouts",
           "slot_table_kind")

IndexList = Union[Sequence[int], torch.Tensor]


@dataclass(frozen=True)
class KvLayout:
    """Where one K (or V) half keeps a slot's bytes inside a tensor row (a block of `row_slots` slots),
    so that the fingerprint reads them in place (docs/semantics.md §4; RealKvSource takes these fields).

    A slot's logical bytes are its heads in order, each head's bytes in element order; the
    fingerprint folds them the same way whatever the storage, so a layout changes where bytes are
    read, never the fingerprint of the same K/V. Slot s's head h, chunk c lives at
    `row(s // row_slots) + token(s % row_slots) + h * head_stride_bytes + c * chunk_stride_bytes`,
    a head being `bytes_per_token / num_heads` bytes, in chunks of `chunk_bytes` (0: contiguous), where
    `token(t) = t * token_stride_bytes`, or, when a row keeps its tokens in groups of
    `token_group_size` (vLLM's CPU K cache on AMX: 16 tokens per tile),
    `(t // token_group_size) * token_group_stride_bytes + (t % token_group_size) * token_stride_bytes`;
    chunks may be grouped the same way (`chunk_group_size`, vLLM's CPU V cache on AMX).
    SGLang's layout (slots packed one after the other in a row) is `KvLayout.rows(bytes_per_token)`.
    """
    token_stride_bytes: int        # bytes between consecutive slots of a row
    num_heads: int = 1             # heads a slot's bytes are split into (each bytes_per_token / num_heads)
    head_stride_bytes: int = 0     # bytes between consecutive heads of a slot (> 0 when num_heads > 1)
    chunk_bytes: int = 0           # 0: a head's bytes are contiguous; else its chunks' size (2, 4, 8 or 16·k)
    chunk_stride_bytes: int = 0    # bytes between consecutive chunks of a head (chunk_bytes > 0)
    token_group_size: int = 0      # 0: no groups; else the tokens of a row's groups
    token_group_stride_bytes: int = 0  # bytes between consecutive token groups (token_group_size > 0)
    chunk_group_size: int = 0      # 0: no groups; else the chunks of a head's groups
    chunk_group_stride_bytes: int = 0  # bytes between consecutive chunk groups (chunk_group_size > 0)

    @classmethod
    def rows(cls, bytes_per_token: int) -> "KvLayout":
        """Slots packed one after the other (SGLang's layout, FlashAttention's [blocks, block_size, heads, head_dim])."""
        return cls(token_stride_bytes=bytes_per_token)

    @classmethod
    def heads_major(cls, *, block_size: int, num_heads: int, head_bytes: int) -> "KvLayout":
        """A block as [heads, block_size, head_dim] (vLLM's V, FlashInfer's HND K and V): a head's
        bytes contiguous, consecutive slots one head row apart."""
        return cls(token_stride_bytes=head_bytes, num_heads=num_heads, head_stride_bytes=block_size * head_bytes)

    @classmethod
    def transposed(cls, *, block_size: int, num_heads: int, head_dim: int, element_size: int) -> "KvLayout":
        """A block as [heads, head_dim, block_size] (vLLM's K with element-strided heads): element
        i of a slot's head is block_size elements after element i - 1."""
        return cls(token_stride_bytes=element_size, num_heads=num_heads,
                   head_stride_bytes=head_dim * block_size * element_size, chunk_bytes=element_size,
                   chunk_stride_bytes=block_size * element_size)

    @classmethod
    def paged_x(cls, *, block_size: int, num_heads: int, head_dim: int, element_size: int, x_bytes: int = 16) -> "KvLayout":
        """A block as [heads, head_dim / x, block_size, x] with x = x_bytes / element_size (vLLM's
        paged-attention K): a head's bytes in x_bytes chunks, block_size chunks apart."""
        return cls(token_stride_bytes=x_bytes, num_heads=num_heads, head_stride_bytes=head_dim * block_size * element_size,
                   chunk_bytes=x_bytes, chunk_stride_bytes=block_size * x_bytes)

    @classmethod
    def token_tiles(cls, *, block_size: int, num_heads: int, head_dim: int, element_size: int, tile_tokens: int = 16,
                    run_bytes: int = 4) -> "KvLayout":
        """A block as [heads, block_size / T, head_dim * element_size / run_bytes, T, run_bytes] with T =
        tile_tokens (vLLM's CPU K cache on AMX: 16 tokens, 4-byte runs): a head's bytes in run_bytes
        chunks, T chunks apart, inside the tile of T tokens its slot belongs to."""
        chunk_stride = tile_tokens * run_bytes
        group_stride = head_dim * element_size // run_bytes * chunk_stride
        return cls(token_stride_bytes=run_bytes, num_heads=num_heads,
                   head_stride_bytes=-(-block_size // tile_tokens) * group_stride, chunk_bytes=run_bytes,
                   chunk_stride_bytes=chunk_stride, token_group_size=tile_tokens,
                   token_group_stride_bytes=group_stride)


@runtime_checkable
class KvStorage(Protocol):
    """The real K/V bytes of one pool, per layer (what the real-K/V fingerprint reads).

    An optional attribute `layouts: tuple[KvLayout, KvLayout]` (K, V) says where a slot's bytes lie
    in a row when they are not packed one slot after the other; absent or None: packed
    (KvLayout.rows(bytes_per_token)), SGLang's layout. check_storage_layouts checks it."""
    k: Sequence[torch.Tensor]      # per layer: a >= 2-D tensor, row r = slots r*row_slots .. (r+1)*row_slots-1
    v: Sequence[torch.Tensor]
    num_slots: int                 # slots of the pool (canary records allocated per slot)
    row_slots: int                 # slots per tensor row (a page of a paged pool; 1 for a token-granular one)
    bytes_per_token: int           # K (or V) bytes of one slot in one layer (every head), a multiple of 16

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


@dataclass(frozen=True)
class Limits:
    """A ready-made EngineLimits."""
    max_running: int
    max_ctx: int


class Request(Protocol):
    """One running request as a batch row names it (also what `CanaryManager(request_inputs=fn)` hands
    `fn` for a schema's request_input fields: the engine's own request object may be it)."""
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

    # Optional: `same_forward_reads = True` for an engine whose forward may read a slot that another row
    # of the same batch writes in that forward (vLLM: a prefix-cache hit on a block cached when it was
    # scheduled); a batch then says so with `batch.same_forward_reads = True`, and the manager verifies
    # those entries after TAIL's writes instead of at HEAD (CanaryManager._defer_same_forward_reads).


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


def check_storage_layouts(group: str, storage) -> tuple[Optional[KvLayout], Optional[KvLayout]]:
    """The (K, V) layouts of a pool's storage, (None, None) for packed rows; a ValueError when the
    optional `layouts` attribute is not None or a pair of KvLayout. Their numbers are checked where
    the fingerprint's sources are built (RealKvSource, naming the field)."""
    layouts = getattr(storage, "layouts", None)
    if layouts is None:
        return None, None
    if not isinstance(layouts, tuple) or len(layouts) != 2 or not all(isinstance(x, KvLayout) for x in layouts):
        got = (f"a {len(layouts)}-tuple of " + ", ".join(type(x).__name__ for x in layouts)
               if isinstance(layouts, tuple) else type(layouts).__name__)
        raise ValueError(f"kv-canary: the {group!r} pool's storage.layouts must be None or a (k, v) tuple of two "
                         f"KvLayout, got {got}")
    return layouts


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
