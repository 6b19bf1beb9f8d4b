"""Every fault scenario fires its documented check at its documented step; controls stay silent."""
from __future__ import annotations

import pytest
import torch

from kv_canary import faults

torch.set_num_threads(1)  # tiny tensors: thread fan-out only costs time on 2 cores

SCENARIOS = {sc.name: sc for sc in faults.scenarios()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    sc = SCENARIOS[name]
    r = faults.run_scenario(sc)
    assert r.damage_step is not None, f"{name}: the fault never fired"
    if sc.expect.tag is None:
        assert r.violations == 0 and r.first is None, f"{name}: control saw {r.violations} violation(s)"
        return
    assert r.first is not None, f"{name}: not detected ({r.detail})"
    assert r.first.launch_tag == sc.expect.tag
    assert sc.expect.reason in r.first_launch_reasons
    assert r.first.step == r.damage_step + sc.expect.delay
    assert sum(n for s, n in r.per_step.items() if s < r.damage_step) == 0  # silent before the damage
    assert r.ok, r.why


def test_every_issue_scenario_has_a_detection_and_the_two_controls():
    detected = [s for s in SCENARIOS.values() if s.expect.tag is not None]
    assert len(detected) >= 12
    controls = {s.name for s in SCENARIOS.values() if s.expect.tag is None}
    assert {"late_write/bytes_past_16/control", "stale_transfer/default_schema"} <= controls


def test_owner_epoch_layer_is_generated_at_run_time(tmp_path):
    layer = faults.owner_epoch_layer(tmp_path)
    names = {f.name: f.verify_expected for f in layer.layout.INPUT_FIELDS}
    assert names == {"request_id": "per_request", "epoch": "per_slot"}
    assert (tmp_path / next(p.name for p in tmp_path.iterdir()) / "__init__.py").is_file()
