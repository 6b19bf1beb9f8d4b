"""A pool's storage may say where its slots' bytes lie (`layouts`: a KvLayout per K/V half): the
manager reads them in place (RealKvSource's layout fields), with the fingerprints of packed rows for
the same bytes, and refuses a layout no kernel can read, naming the pool, half, layer and field."""
from __future__ import annotations

import pytest
import torch

from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.contract import KvLayout
from kv_canary.engine.manager import CanaryManager

torch.set_num_threads(1)
CFG = SimConfig(seed=3, num_pages=40, num_full_layers=2, num_swa_layers=0, radix_cache=False)
BYTES = CFG.bytes_per_token
# The sim keeps packed rows; these layouts read the very same logical bytes another way: K as two
# heads (head 1 starts half a slot in), V as 2-byte chunks one after the other (each gathered).
SAME_BYTES = (KvLayout(token_stride_bytes=BYTES, num_heads=2, head_stride_bytes=BYTES // 2),
              KvLayout(token_stride_bytes=BYTES, chunk_bytes=2, chunk_stride_bytes=2))


class LaidOutEngine(Engine):
    """The sim engine whose full pool's storage carries `layouts`."""

    layouts = None

    def canary_pools(self) -> dict:
        self.full.layouts = self.layouts
        return super().canary_pools()


def run(layouts, hooks=(), steps=8) -> tuple[CanaryManager, Engine]:
    manager = CanaryManager(mode="log", real_kv_hash_mode="all")
    engine_type = type("E", (LaidOutEngine,), {"layouts": layouts})
    engine = engine_type(CFG, canary=manager, hooks=list(hooks))
    engine.run(steps)
    manager.drain()
    return manager, engine


class FlipV:
    """After the forward of step `at`, flip one V byte of layer 1 at a running request's first slot."""

    def __init__(self, at: int = 5):
        self.at, self.slot = at, None

    def during_forward(self, engine, batch) -> None:
        if engine.step_no == self.at:
            req = next(r for r in engine.running if r.kv_len > 0)
            self.slot = engine.slot_of(req, 0)
            engine.full.slot_view(engine.full.v[1])[self.slot, BYTES - 1] ^= 0x80


def test_layouts_that_read_the_same_bytes_store_the_same_fingerprints():
    packed, _ = run(None)
    laid_out, _ = run(SAME_BYTES)
    assert packed.stats.total == laid_out.stats.total == 0
    for a, b in zip(packed.groups, laid_out.groups, strict=True):
        for half in a.bufs:
            assert torch.equal(a.bufs[half], b.bufs[half])
    fp_word = laid_out.L.CANARY_KV_FINGERPRINT_WORD
    assert laid_out.groups[0].bufs["k"].view(torch.int64)[:, fp_word].count_nonzero() > 0  # fingerprints were stored


def test_damage_read_through_a_layout_is_caught():
    flip = FlipV()
    manager, _ = run(SAME_BYTES, hooks=[flip])
    first = manager.violations[0]
    assert (first.step, first.launch_tag, first.slot) == (flip.at, "TAIL_V_FULL", flip.slot)
    assert first.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",)


@pytest.mark.parametrize("layouts, text", [
    ([SAME_BYTES[0], SAME_BYTES[1]], "the 'full' pool's storage.layouts must be None or a (k, v) tuple of two "
                                     "KvLayout, got list"),
    ((SAME_BYTES[0],), "the 'full' pool's storage.layouts must be None or a (k, v) tuple of two KvLayout, got a "
                       "1-tuple of KvLayout"),
    ((SAME_BYTES[0], {"token_stride_bytes": BYTES}), "the 'full' pool's storage.layouts must be None or a (k, v) "
                                                     "tuple of two KvLayout, got a 2-tuple of KvLayout, dict"),
    ((SAME_BYTES[0], KvLayout(token_stride_bytes=BYTES, num_heads=2)),
     "the 'full' pool's V layer 0: RealKvSource.head_stride_bytes must be a positive multiple of 16 (num_heads=2), got 0"),
    ((KvLayout(token_stride_bytes=BYTES * 2), SAME_BYTES[1]),
     "the 'full' pool's K layer 0: RealKvSource.tensor is too small for its slot layout"),
])
def test_a_layout_the_kernels_cannot_read_is_refused_at_attach(layouts, text):
    with pytest.raises(ValueError) as exc:
        run(layouts, steps=0)
    assert str(exc.value).startswith("kv-canary: " + text)
