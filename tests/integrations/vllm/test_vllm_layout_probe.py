"""The layout probe of kv_canary.integrations.vllm (no vLLM needed): it finds where a cache update
puts each K/V element and describes it with KvLayout, or refuses a layout it cannot describe."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_canary.engine.contract import KvLayout
from kv_canary.integrations.vllm import layout

BS, HEADS, HD = 4, 2, 8


def cpu_cache_update(key, value, cache, slot_mapping):
    """vLLM CPU: [blocks, heads, block_size, 2 * head_size]; per head K transposed, then V rows."""
    nb, heads, bs, two_hd = cache.shape
    hd = two_hd // 2
    flat = cache.view(nb, heads, 2 * bs * hd)
    for i, slot in enumerate(slot_mapping.tolist()):
        b, t = divmod(slot, bs)
        for h in range(heads):
            flat[b, h, torch.arange(hd) * bs + t] = key[i, h]
            flat[b, h, bs * hd + t * hd + torch.arange(hd)] = value[i, h]


def amx_cache_update(key, value, cache, slot_mapping, tile=2, v_tile=4):
    """vLLM CPU with AMX (bf16): per head K in tiles of `tile` tokens (16 in vLLM), each tile's K as
    [head_size / 2, tile, 2] (pairs of a token's elements); then V as [head_size / v_tile, block_size / 2,
    v_tile, 2] (16 elements per tile in vLLM; pairs of tokens per element)."""
    nb, heads, bs, two_hd = cache.shape
    hd = two_hd // 2
    flat = cache.view(nb, heads, 2 * bs * hd)
    e = torch.arange(hd)
    for i, slot in enumerate(slot_mapping.tolist()):
        b, t = divmod(slot, bs)
        g, u = divmod(t, tile)
        for h in range(heads):
            flat[b, h, g * tile * hd + (e // 2) * 2 * tile + u * 2 + e % 2] = key[i, h]
            flat[b, h, bs * hd + (e // v_tile) * bs * v_tile + (t // 2) * 2 * v_tile + (e % v_tile) * 2 + t % 2] = \
                value[i, h]


def flash_like_update(key, value, cache, slot_mapping):
    """A block as [block_size, 2, heads, head_size]: a slot's K heads, then its V heads, back to back."""
    nb, bs = cache.shape[:2]
    for i, slot in enumerate(slot_mapping.tolist()):
        b, t = divmod(slot, bs)
        cache[b, t, 0] = key[i]
        cache[b, t, 1] = value[i]


def swapped_update(key, value, cache, slot_mapping):
    """K's first two elements of a head stored swapped: no token/head stride and chunking describes it."""
    order = [1, 0, *range(2, key.shape[-1])]
    cpu_cache_update(key[..., order], value, cache, slot_mapping)


def reversed_update(key, value, cache, slot_mapping):
    """K elements of a head in reverse order: strides that would have to be negative."""
    cpu_cache_update(key.flip(-1), value, cache, slot_mapping)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vllm_cpu_layout_is_k_transposed_and_v_heads_major(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    found = layout.probe(cpu_cache_update, (3, HEADS, BS, 2 * HD), dtype, "cpu", block_size=BS, num_heads=HEADS,
                         head_size=HD)
    region = BS * 2 * HD * size
    assert found.block_bytes == HEADS * region
    assert layout.kv_layout(found.k) == KvLayout(token_stride_bytes=size, num_heads=HEADS, head_stride_bytes=region,
                                                 chunk_bytes=size, chunk_stride_bytes=BS * size)
    assert layout.kv_layout(found.v) == KvLayout(token_stride_bytes=HD * size, num_heads=HEADS,
                                                 head_stride_bytes=region)
    assert (found.k.base, found.v.base) == (0, BS * HD * size)


def test_vllm_cpu_amx_k_is_found_in_token_tiles():
    found = layout.probe(amx_cache_update, (3, HEADS, BS, 2 * HD), torch.bfloat16, "cpu", block_size=BS,
                         num_heads=HEADS, head_size=HD)
    tiles = KvLayout.token_tiles(block_size=BS, num_heads=HEADS, head_dim=HD, element_size=2, tile_tokens=2,
                                 run_bytes=4)
    # A head's K tiles, then its V rows: the next head's K is a whole K + V region further.
    assert layout.kv_layout(found.k) == dataclasses.replace(tiles, head_stride_bytes=BS * 2 * HD * 2)
    # V: pairs of tokens (2 B apart, pairs 16 B apart), elements 4 B apart in tiles of 4 (32 B apart).
    assert layout.kv_layout(found.v) == KvLayout(token_stride_bytes=2, num_heads=HEADS, head_stride_bytes=BS * 2 * HD * 2,
                                                 chunk_bytes=2, chunk_stride_bytes=4, token_group_size=2,
                                                 token_group_stride_bytes=16, chunk_group_size=4,
                                                 chunk_group_stride_bytes=BS * 4 * 2)
    assert "in groups of 2 tokens every 32 B" in layout.describe(found.k)
    assert "in groups of 4 runs every 32 B" in layout.describe(found.v)


def test_packed_slots_are_plain_rows():
    found = layout.probe(flash_like_update, (3, BS, 2, HEADS, HD), torch.bfloat16, "cpu", block_size=BS,
                         num_heads=HEADS, head_size=HD)
    slot_bytes = HEADS * HD * 2
    assert found.k.contiguous_rows is False   # K and V interleave per slot: a slot's K is one run, rows 2x apart
    assert layout.kv_layout(found.k) == KvLayout(token_stride_bytes=2 * slot_bytes, num_heads=HEADS,
                                                 head_stride_bytes=HD * 2)
    assert found.v.base == slot_bytes


@pytest.mark.parametrize("update", [swapped_update, reversed_update])
def test_a_layout_it_cannot_describe_is_refused(update):
    with pytest.raises(ValueError, match="vLLM's K cache does not follow one token stride, head stride and element "
                                         "chunking; this layout cannot be guarded"):
        layout.probe(update, (3, HEADS, BS, 2 * HD), torch.bfloat16, "cpu", block_size=BS, num_heads=HEADS,
                     head_size=HD)
    with pytest.raises(ValueError, match="cannot locate K/V bytes of a torch.float8_e4m3fn cache"):
        layout.probe(cpu_cache_update, (3, HEADS, BS, 2 * HD), torch.float8_e4m3fn, "cpu", block_size=BS,
                     num_heads=HEADS, head_size=HD)
