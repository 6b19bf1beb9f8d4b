"""Which KV layers the real-KV fingerprint covers: the default, the fingerprint_layers option, and
the warning when layers go uncovered."""
from __future__ import annotations

import warnings

import pytest
import torch

from kv_canary import generated
from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.manager import CanaryCoverageWarning, CanaryManager

torch.set_num_threads(1)
MAX = generated.layout.MAX_REAL_KV_SOURCES
DEEP = SimConfig(seed=7, num_pages=40, num_full_layers=MAX + 2, num_swa_layers=1, radix_cache=False)


class FlipInLayer:
    """After the forward of step `at`, flip one K byte of `layer` at a running request's first slot."""

    def __init__(self, layer: int, at: int = 6):
        self.kv_layer, self.at, self.slot = layer, at, None

    def during_forward(self, engine, batch) -> None:
        if engine.step_no != self.at:
            return
        req = next(r for r in engine.running if r.kv_len > 0)
        self.slot = engine.slot_of(req, 0)
        engine.full.slot_view(engine.full.k[self.kv_layer])[self.slot, 0] ^= 1


def _run(manager, cfg=DEEP, hooks=(), steps=10):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine(cfg, canary=manager, hooks=list(hooks))
        engine.run(steps)
        manager.drain()
    return engine, [w for w in caught if issubclass(w.category, CanaryCoverageWarning)]


def test_default_covers_the_first_layers_and_warns_once_about_the_rest():
    m = CanaryManager(mode="log")
    _, warned = _run(m)
    assert m.fingerprinted == {"full": tuple(range(MAX)), "swa": (0,)}
    assert len(warned) == 1
    text = str(warned[0].message)
    assert f"2 of {MAX + 2} full layers (layers {MAX}..{MAX + 1})" in text and "fingerprint_layers" in text
    assert "swa" not in text  # the SWA group has a single layer: fully covered


def test_no_warning_when_every_layer_fits():
    m = CanaryManager(mode="log")
    _, warned = _run(m, SimConfig(seed=7, num_pages=40, num_full_layers=MAX))
    assert warned == [] and m.fingerprinted["full"] == tuple(range(MAX))


def test_damage_in_an_uncovered_layer_goes_unseen_by_default():
    flip = FlipInLayer(MAX + 1)
    m = CanaryManager(mode="log")
    _run(m, hooks=[flip])
    assert flip.slot is not None and m.stats.total == 0


def test_chosen_layers_are_fingerprinted_and_silence_the_warning():
    flip = FlipInLayer(MAX + 1)
    m = CanaryManager(mode="log", fingerprint_layers={"full": [0, MAX + 1]})
    _, warned = _run(m, hooks=[flip])
    assert warned == [] and m.fingerprinted["full"] == (0, MAX + 1)
    first = m.violations[0]
    assert (first.step, first.launch_tag, first.slot) == (flip.at, "TAIL_K_FULL", flip.slot)
    assert first.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",)
    # A layer the choice leaves out is no longer covered.
    m2 = CanaryManager(mode="log", fingerprint_layers={"full": [0, MAX + 1]})
    _run(m2, hooks=[FlipInLayer(1)])
    assert m2.stats.total == 0


@pytest.mark.parametrize("value, match", [
    ([0, 1], "fingerprint_layers must be a mapping of group"),
    ({"MID": [0]}, "got 'MID'"),
    ({"full": []}, "got 'full': \\[\\]"),
    ({"full": [0, 0]}, "distinct layer indices"),
    ({"full": [-1]}, "layer indices >= 0"),
    ({"full": list(range(MAX + 1))}, f"1..{MAX} distinct"),
    ({"full": "01"}, "got 'full': '01'"),
])
def test_bad_fingerprint_layers_are_rejected_at_construction(value, match):
    with pytest.raises(ValueError, match=match):
        CanaryManager(fingerprint_layers=value)


@pytest.mark.parametrize("value, match", [
    ({"full": [MAX + 2]}, f"the full pool, which has {MAX + 2} layer\\(s\\); got \\[{MAX + 2}\\]"),
    ({"swa": [1]}, "the swa pool, which has 1 layer\\(s\\); got \\[1\\]"),
])
def test_layers_outside_the_pool_are_rejected_at_attach(value, match):
    with pytest.raises(ValueError, match=match):
        Engine(DEEP, canary=CanaryManager(fingerprint_layers=value))


def test_a_group_the_engine_lacks_is_rejected():
    no_swa = SimConfig(seed=7, num_pages=40, num_swa_layers=0)
    with pytest.raises(ValueError, match="the swa pool, which has 0 layer"):
        Engine(no_swa, canary=CanaryManager(fingerprint_layers={"swa": [0]}))
