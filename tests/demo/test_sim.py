"""The serving simulation on its own: determinism, K/V bytes, sharing, SWA translation, no leaks."""
from __future__ import annotations

import os

import pytest
import torch

from kv_canary.demo.sim import Engine, SimConfig, kv_bytes

torch.set_num_threads(1)
STEPS = int(os.environ.get("KV_CANARY_SIM_STEPS", "120"))


def _run(cfg, steps=STEPS):
    e = Engine(cfg)
    e.run(steps)
    return e


def test_deterministic_per_seed():
    a, b = _run(SimConfig(seed=5)), _run(SimConfig(seed=5))
    assert [r.tokens for r in a.finished] == [r.tokens for r in b.finished]
    assert torch.equal(a.full.k[0], b.full.k[0])
    assert [r.tokens for r in _run(SimConfig(seed=6)).finished] != [r.tokens for r in a.finished]


@pytest.mark.parametrize("cfg", [SimConfig(seed=1), SimConfig(seed=2, spec_draft_tokens=2, page_size=1, num_pages=200)],
                         ids=["paged", "spec"])
def test_live_slots_hold_the_model_bytes(cfg):
    e = _run(cfg)
    assert e.running
    for req in e.running:
        pos = torch.arange(req.kv_len)
        toks = torch.tensor(req.tokens[:req.kv_len])
        slots = torch.tensor([e.slot_of(req, p) for p in range(req.kv_len)])
        assert torch.equal(e.req_to_token[req.row, :req.kv_len].long(), slots)
        for layer in range(cfg.num_full_layers):
            for half in (0, 1):
                got = e.full.slot_view(e.full.halves()[half][layer])[slots]
                assert torch.equal(got, kv_bytes(toks, pos, layer, half, cfg.bytes_per_token))
        swa = e.swa_pool.full_to_swa[slots]
        assert bool((swa > 0).all()) and len(set(swa.tolist())) == len(swa)
        got = e.swa.slot_view(e.swa.k[0])[swa]
        assert torch.equal(got, kv_bytes(toks, pos, cfg.num_full_layers, 0, cfg.bytes_per_token))


def test_prefix_sharing_chunking_and_translation_happen():
    e = _run(SimConfig(seed=3, chunk_size=4))
    assert any(r.matched > 0 for r in e.finished)
    assert any(len(r.prompt) - r.matched > 4 for r in e.finished)  # needed more than one chunk
    lut = e.swa_pool.full_to_swa
    used = (lut > 0).nonzero().flatten()
    assert not torch.equal(lut[used], used)


def test_pages_are_conserved():
    cfg = SimConfig(seed=4, num_requests=12)
    e = _run(cfg, steps=400)
    assert not e.running and not e.waiting and len(e.finished) == 12
    cached = {n.page for n in e.radix.nodes()}
    assert e.alloc.num_free + len(cached) == cfg.num_pages - 1
    assert all(e.alloc.refcount[p] == 1 for p in cached)


@pytest.mark.parametrize("bad", [dict(bytes_per_token=24), dict(page_size=0), dict(prompt_len=(1, 4)),
                                 dict(num_swa_layers=1, swa_window=0)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="SimConfig"):
        SimConfig(**bad)


def test_retract_and_restore_round_trip_and_partial_transfer():
    e = _run(SimConfig(seed=8, radix_cache=False, num_swa_layers=0), steps=12)
    a, b = sorted((r for r in e.running if r.kv_len >= 4), key=lambda r: r.rid)[:2]

    def context(req):
        slots = torch.tensor([e.slot_of(req, p) for p in range(req.kv_len)])
        return e.full.slot_view(e.full.k[0])[slots].clone()
    before_a, before_b = context(a), context(b)
    e.retract(a)
    e.retract(b)
    with pytest.raises(ValueError, match="Engine.restore upto must be in"):
        e.restore(a, snapshot_of=b.rid, upto=min(a.kv_len, b.kv_len) + 1)
    e.restore(a, snapshot_of=b.rid, upto=2)
    e.restore(b)
    got_a = context(a)
    assert torch.equal(got_a[:2], before_b[:2]) and torch.equal(got_a[2:], before_a[2:])
    assert torch.equal(context(b), before_b)
