"""Where vLLM's attention backend puts a slot's K and V bytes, found by asking the backend itself.

`probe(write, shape, dtype)` writes one block of K/V whose every element has its own bit pattern
through the backend's own cache-update (`impl.do_kv_cache_update`, what the forward calls) into a
scratch tensor shaped like one layer's cache, then finds each element: a half is guarded in place
when its bytes follow `offset(t, h, e) = base + token(t) + h * head_stride + chunk(e)`. token(t) is
t * token_stride, or in groups of tokens (vLLM CPU's K on AMX: 16 tokens per tile)
(t // group) * group_stride + (t % group) * token_stride; chunk(e) puts a head's elements in one run
or in equal runs at a fixed stride (vLLM CPU's transposed K), the runs in groups likewise (vLLM
CPU's V on AMX). The result is checked element by element against that formula; a backend that
packs K/V another way gets a clear refusal instead of a wrong fingerprint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...engine.contract import KvLayout

# Bit patterns of normal, positive, finite values (so no kernel may flush or canonicalise them).
_CODE_BASE = {2: 0x3C00, 4: 0x3F800000}
_INT_VIEW = {2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class HalfLayout:
    """One half (K or V) of one block: byte offsets from the start of the block's row."""
    base: int                     # byte of token 0, head 0, element 0
    token_stride: int
    head_stride: int
    chunk_bytes: int              # bytes of one contiguous run of a head's elements (= head bytes when contiguous)
    chunk_stride: int             # bytes between runs (0 when a head is one run)
    num_heads: int
    head_bytes: int
    token_group: int = 0          # tokens per group of a block (0: none)
    token_group_stride: int = 0   # bytes between consecutive groups
    chunk_group: int = 0          # chunks per group of a head (0: none)
    chunk_group_stride: int = 0   # bytes between consecutive chunk groups

    @property
    def contiguous_rows(self) -> bool:
        """A slot's bytes are one run (heads back to back): kv-canary's plain row layout."""
        return self.chunk_stride == 0 and (self.num_heads == 1 or self.head_stride == self.head_bytes) \
            and self.token_stride == self.num_heads * self.head_bytes and self.token_group == 0


@dataclass(frozen=True)
class BlockLayout:
    block_bytes: int              # bytes of one block of one layer (the tensor's dim-0 stride)
    k: HalfLayout
    v: HalfLayout


def probe(write: Callable, shape: tuple, dtype: torch.dtype, device, *, block_size: int, num_heads: int,
          head_size: int) -> BlockLayout:
    """`write(key, value, cache, slot_mapping)` stores tokens into a cache tensor of `shape` (blocks
    first) the way the engine does; returns the layout it used, or raises ValueError naming what
    does not fit."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _CODE_BASE:
        raise ValueError(f"kv-canary: cannot locate K/V bytes of a {dtype} cache (2- or 4-byte elements only)")
    ints = _INT_VIEW[size]
    n = block_size * num_heads * head_size
    scratch = torch.zeros((2, *shape[1:]), dtype=dtype, device=device)
    codes = torch.arange(2 * n, dtype=torch.int64) + _CODE_BASE[size]
    key = codes[:n].to(ints).view(dtype).reshape(block_size, num_heads, head_size).to(device)
    value = codes[n:].to(ints).view(dtype).reshape(block_size, num_heads, head_size).to(device)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64, device=device)   # block 1
    write(key, value, scratch, slots)
    flat = scratch.view(-1).view(ints).to(torch.int64).cpu()
    block_elems = flat.numel() // 2
    where = torch.full((2 * n,), -1, dtype=torch.int64)
    found = (flat >= _CODE_BASE[size]) & (flat < _CODE_BASE[size] + 2 * n)
    idx = found.nonzero().flatten()
    where[flat[idx] - _CODE_BASE[size]] = idx
    if bool((where < 0).any()) or bool((where < block_elems).any()):
        raise ValueError("kv-canary: the attention backend's cache update did not store every K/V element of "
                         "the probe block in that block; its layout cannot be guarded")
    where = (where - block_elems) * size
    k = _fit(where[:n].reshape(block_size, num_heads, head_size), size, "K")
    v = _fit(where[n:].reshape(block_size, num_heads, head_size), size, "V")
    return BlockLayout(block_elems * size, k, v)


def _fit(off: torch.Tensor, size: int, half: str) -> HalfLayout:
    """The strides that reproduce `off[t, h, e]` (byte offsets), checked for every element."""
    bs, heads, hd = off.shape
    base = int(off[0, 0, 0])
    token = int(off[1, 0, 0] - base) if bs > 1 else 0
    group, group_stride = _groups(off[:, 0, 0] - base, token)
    head = int(off[0, 1, 0] - base) if heads > 1 else 0
    elem = off[0, 0] - base
    run = 1
    while run < hd and int(elem[run]) == run * size:
        run += 1
    chunk_stride = int(elem[run]) if run < hd else 0
    if run < hd and hd % run:
        raise ValueError(f"kv-canary: vLLM's {half} cache stores a head's elements in runs of {run}, which do not "
                         f"divide head_size={hd}; this layout cannot be guarded")
    chunk_group, chunk_group_stride = _groups(elem[::run], chunk_stride) if run < hd else (0, 0)
    t = torch.arange(bs).view(bs, 1, 1)
    h = torch.arange(heads).view(1, heads, 1)
    c = torch.arange(hd) // run
    chunk_off = (c // chunk_group) * chunk_group_stride + (c % chunk_group) * chunk_stride if chunk_group \
        else c * chunk_stride
    token_off = (t // group) * group_stride + (t % group) * token if group else t * token
    model = base + token_off + h * head + (torch.arange(hd) % run * size + chunk_off).view(1, 1, hd)
    if not torch.equal(model, off) or min(token, head, chunk_stride, group_stride, chunk_group_stride) < 0:
        raise ValueError(f"kv-canary: vLLM's {half} cache does not follow one token stride, head stride and "
                         f"element chunking; this layout cannot be guarded")
    return HalfLayout(base, token, head, run * size, chunk_stride, heads, hd * size, group, group_stride,
                      chunk_group, chunk_group_stride)


def _groups(offsets: torch.Tensor, stride: int) -> tuple[int, int]:
    """(items per group, group stride) of items at `offsets` (from the first's): one stride apart up
    to a group's end, then a group stride apart; (0, 0) when they are all one stride apart."""
    n = 1
    while n < len(offsets) and int(offsets[n]) == n * stride:
        n += 1
    return (0, 0) if n == len(offsets) else (n, int(offsets[n]))


def row_view(cache: torch.Tensor, layout: BlockLayout, half: HalfLayout) -> torch.Tensor:
    """uint8 [blocks, block_bytes - base]: one layer's cache seen from the half's first byte, one row per block
    (a view: the canary reads the cache where it is)."""
    rows = cache.view(cache.shape[0], -1).view(torch.uint8)
    if rows.shape[1] != layout.block_bytes or rows.stride(0) != layout.block_bytes:
        raise ValueError(f"kv-canary: a layer's KV cache is not packed block by block ({tuple(cache.shape)}, "
                         f"{layout.block_bytes} bytes per block expected)")
    return rows[:, half.base:]


def kv_layout(half: HalfLayout) -> KvLayout:
    """The engine contract's description of one half (what the real-K/V fingerprint reads in place)."""
    chunked = half.chunk_stride != 0
    return KvLayout(token_stride_bytes=half.token_stride, num_heads=half.num_heads,
                    head_stride_bytes=half.head_stride if half.num_heads > 1 else 0,
                    chunk_bytes=half.chunk_bytes if chunked else 0, chunk_stride_bytes=half.chunk_stride,
                    token_group_size=half.token_group, token_group_stride_bytes=half.token_group_stride,
                    chunk_group_size=half.chunk_group, chunk_group_stride_bytes=half.chunk_group_stride)


def describe(half: Optional[HalfLayout]) -> str:
    if half is None:
        return "none"
    if half.contiguous_rows:
        return f"rows of {half.token_stride} bytes"
    return (f"token stride {half.token_stride} B"
            + (f" in groups of {half.token_group} tokens every {half.token_group_stride} B" if half.token_group else "")
            + f", head stride {half.head_stride} B, "
            + (f"runs of {half.chunk_bytes} B every {half.chunk_stride} B" if half.chunk_stride else "heads contiguous")
            + (f" in groups of {half.chunk_group} runs every {half.chunk_group_stride} B" if half.chunk_group else ""))
