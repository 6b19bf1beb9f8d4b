"""Reads of what the same forward writes (Engine.same_forward_reads): a request admitted with a
prefix-cache hit on a block that another request of the same batch fills in that very forward (vLLM
caches a block when it is scheduled). Driven through the vLLM adapter's engine (pure torch: no vLLM)
with a cache in vLLM CPU's layout, written by a model of its cache update: with the batch flagged,
those entries are verified after TAIL and the step is silent; unflagged, HEAD finds the block without
records (what the flag is for); a K/V byte changed before TAIL's late verify is still caught."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_canary.engine.manager import CanaryManager
from kv_canary.integrations.vllm import layout
from kv_canary.integrations.vllm.engine import VllmEngine, VllmKvStorage
from kv_canary.integrations.vllm.meta import Scheduled, StepMeta

BS, HD, BLOCKS = 4, 8, 6


def cpu_cache_update(key, value, cache, slot_mapping):
    """vLLM CPU's layout: a block is [heads, block_size, 2 * head_size]; per head, K transposed
    ([head_size, block_size]), then V rows ([block_size, head_size])."""
    nb, heads, bs, two_hd = cache.shape
    hd = two_hd // 2
    flat = cache.view(nb, heads, 2 * bs * hd)
    for i, slot in enumerate(slot_mapping.tolist()):
        b, t = divmod(slot, bs)
        for h in range(heads):
            flat[b, h, torch.arange(hd) * bs + t] = key[i, h]
            flat[b, h, bs * hd + t * hd + torch.arange(hd)] = value[i, h]


def _step(flag: bool, damage=None):
    cache = torch.zeros((BLOCKS, 1, BS, 2 * HD), dtype=torch.bfloat16)
    found = layout.probe(cpu_cache_update, tuple(cache.shape), torch.bfloat16, "cpu", block_size=BS, num_heads=1,
                         head_size=HD)
    engine = VllmEngine(VllmKvStorage([cache], found, BS), block_size=BS, max_running=2, max_ctx=4 * BS,
                        device="cpu")
    m = CanaryManager(backend="torch", sweep_interval=0)
    m.attach(engine)
    engine.canary = m
    a = [11, 12, 13, 14, 15, 16, 17, 18]           # fills blocks 1 and 2 this step
    b = a[:BS] + [21, 22, 23]                      # hits block 1 (cached when A was scheduled), writes block 3
    meta = StepMeta(0, (), (Scheduled("A", 0, 8, 1 * BS, 0, 0, tuple(a), (1, 2)),
                            Scheduled("B", BS, 3, 3 * BS, BS, 0, tuple(b), (3,))), (), flag)
    engine.apply(meta)
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    attn = SimpleNamespace(query_start_loc=torch.tensor([0, 8, 11], dtype=torch.int32),
                           seq_lens=torch.tensor([8, 7], dtype=torch.int32),
                           block_table=torch.tensor([[1, 2, 0, 0], [1, 3, 0, 0]], dtype=torch.int32),
                           slot_mapping=slots)
    batch = engine.batch(meta, attn, 0)
    assert batch.same_forward_reads is flag and engine.same_forward_steps == int(flag)
    m.head(batch)
    kv = torch.arange(11 * HD, dtype=torch.float32).reshape(11, 1, HD).to(torch.bfloat16)
    cpu_cache_update(kv, kv + 1, cache, slots)   # the forward
    if damage is not None:
        damage(m, cache)
    m.tail(batch)
    m.after_step(0)
    m.drain()
    return m


def test_flagged_same_forward_reads_are_verified_after_tail_and_silent():
    m = _step(True)
    assert m.stats.total == 0 and m.violations == []


def test_unflagged_head_finds_the_block_without_records():
    m = _step(False)
    first = m.violations[0]
    assert first.launch_tag == "HEAD_K_FULL" and first.slot == 1 * BS and "VERIFY_TOKEN_MISMATCH" in first.reasons


@pytest.mark.parametrize("half", ["k", "v"])
def test_the_late_verify_still_sees_a_byte_changed_after_the_fingerprint(half):
    """TAIL writes A's fingerprints, then (inside tail, before the late verify) a byte of the shared
    block changes: the late verify (a TAIL tag) reports B's read of it."""
    def damage(m, cache):
        original = m._verify_and_write

        def then_damage(phase, batch):
            original(phase, batch)
            if phase == "tail":
                view = cache.view(BLOCKS, 1, 2 * BS, HD)
                view[1, 0, (0 if half == "k" else BS) + 2, 3] += 1.0
        m._verify_and_write = then_damage
    m = _step(True, damage)
    # view[1, 0, 2, 3] of K (transposed: element 4 of token 3) is slot 7; of V (row 2, element 3) slot 6.
    slot = 1 * BS + (3 if half == "k" else 2)
    assert [(v.launch_tag, v.slot, v.reasons) for v in m.violations] == \
        [(f"TAIL_{half.upper()}_FULL", slot, ("VERIFY_REAL_KV_HASH_MISMATCH",))]
