"""Every fault scenario fires its documented check at its documented step; controls stay silent."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kv_canary import generated
from kv_canary.demo import faults
from kv_canary.demo.sim import Engine
from kv_canary.engine.manager import CanaryManager

torch.set_num_threads(1)  # tiny tensors: thread fan-out only costs time on 2 cores

SCENARIOS = {sc.name: sc for sc in faults.scenarios()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    sc = SCENARIOS[name]
    r = faults.run_scenario(sc, stop_after_detection=True)  # the demo runs every step; the verdict is the same
    assert r.damage_step is not None, f"{name}: the fault never fired"
    if sc.expect.launch is None:
        assert r.violations == 0 and r.first is None, f"{name}: control saw {r.violations} violation(s)"
        return
    assert r.first is not None, f"{name}: not detected ({r.detail})"
    assert r.first.launch_tag == r.expected_tag
    assert sc.expect.reason in r.first_launch_reasons
    assert r.first.step == r.damage_step + sc.expect.delay
    assert sum(n for s, n in r.per_step.items() if s < r.damage_step) == 0  # silent before the damage
    assert r.ok, r.why


def test_every_issue_scenario_has_a_detection_and_the_two_controls():
    detected = [s for s in SCENARIOS.values() if s.expect.launch is not None]
    assert len(detected) >= 12
    controls = {s.name for s in SCENARIOS.values() if s.expect.launch is None}
    assert {"late_write/bytes_past_16/control", "stale_transfer/default_schema"} <= controls


def test_owner_epoch_tree_is_generated_at_run_time(tmp_path):
    tree = faults.owner_epoch_tree(tmp_path)
    names = {f.name: f.verify_expected for f in tree.layout.INPUT_FIELDS}
    assert names == {"request_id": "per_request", "epoch": "per_slot"}
    assert (tmp_path / next(p.name for p in tmp_path.iterdir()) / "__init__.py").is_file()


def _canary_state(engine, manager) -> dict:
    """Every canary record and K/V byte the run left behind."""
    state = {f"canary:{g.name}/{half}": buf.clone() for g in manager.groups for half, buf in g.bufs.items()}
    for name, store in (("full", engine.full), ("swa", engine.swa)):
        if store is not None:
            for half, tensors in zip("KV", store.halves()):
                state.update({f"{name}/{half}{i}": t.clone() for i, t in enumerate(tensors)})
    return state


class _CorrectRestore(faults.StaleTransfer):
    """The same retract/restore sequence, but every request gets its own host copy back."""

    def before_schedule(self, engine) -> None:
        real = engine.restore
        engine.restore = lambda req, snapshot_of=None, upto=None: real(req)
        try:
            super().before_schedule(engine)
        finally:
            del engine.restore


def _run_with(sc, fault, tree=None, until_damage=False):
    manager = CanaryManager(tree=tree, mode="log", sweep_interval=faults.SWEEP, **sc.manager)
    engine = Engine(sc.sim, canary=manager, hooks=[fault])
    while engine.step_no < sc.steps and not (until_damage and fault.damage_step is not None):
        engine.step()
    manager.drain()
    return engine, manager


@pytest.mark.parametrize("tree_name", ["default", "owner_epoch"])
def test_shared_prompt_transfer_leaves_the_default_record_byte_identical(tree_name):
    sc = SCENARIOS["stale_transfer/default_schema"]
    tree = faults.owner_epoch_tree() if tree_name == "owner_epoch" else None
    bad, good = faults.StaleTransfer(10, shared_prompt=True), _CorrectRestore(10, shared_prompt=True)
    # Compare right after the damage step (later steps reuse the pages and erase the difference).
    (e1, m1), (e2, m2) = _run_with(sc, bad, tree, until_damage=True), _run_with(sc, good, tree, until_damage=True)
    assert bad.damage_step == good.damage_step is not None and bad.transfer == good.transfer
    victim, source, k = bad.transfer
    assert victim != source and k >= 2
    s1, s2 = _canary_state(e1, m1), _canary_state(e2, m2)
    differs = sorted(name for name in s1 if not torch.equal(s1[name], s2[name]))
    if tree_name == "default":
        # Records and K/V bytes are exactly what a correct restore leaves: nothing can be detected.
        assert differs == [] and m1.stats.total == 0
    else:
        # Only the owner field (and the chain that folds it) differs, in the canary records only.
        assert differs and all(name.startswith("canary:") for name in differs)


def test_stale_transfer_control_runs_with_every_default_check_on():
    r = faults.run_scenario(SCENARIOS["stale_transfer/default_schema"])
    assert r.settings == {"schema": "kernels.yaml", "check_verify_expected_token": True,
                          "real_kv_hash_mode": "ALL", "sweep_interval": faults.SWEEP}
    assert r.fault.transfer is not None and r.violations == 0 and r.ok
    assert "expected-token check on" in r.describe_settings()


def test_owner_epoch_catches_the_stale_transfer_by_owner_exactly():
    sc = SCENARIOS["stale_transfer/owner_epoch"]
    fault = sc.make_fault()
    _, m = _run_with(sc, fault, faults.owner_epoch_tree())
    assert m.check_verify_expected_token is True
    _, _, k = fault.transfer
    first = m.violations[0]
    assert (first.step, first.launch_tag) == (fault.damage_step, "HEAD_K_FULL")
    assert first.reasons == ("VERIFY_OWNER_MISMATCH",) and first.position == 0
    assert first.stored_token == first.expected_token  # the tokens are right: only the owner is not
    launch = [v for v in m.violations if (v.step, v.launch_tag) == (first.step, first.launch_tag)]
    # Every transferred position fails the owner check, and only those; the request's own record
    # right after them follows a record with another owner folded in: a chain break.
    assert sorted(v.position for v in launch if v.has("VERIFY_OWNER_MISMATCH")) == list(range(k))
    assert {v.reasons for v in launch} == {("VERIFY_OWNER_MISMATCH",), ("VERIFY_CHAIN_HASH_MISMATCH",)}
    assert [v.position for v in launch if v.has("VERIFY_CHAIN_HASH_MISMATCH")] == [k]


def test_other_tokens_transfer_is_caught_by_the_default_token_check():
    sc = SCENARIOS["stale_transfer/other_tokens"]
    r = faults.run_scenario(sc)
    assert r.first_launch_reasons == ("VERIFY_TOKEN_MISMATCH",) and r.ok
    off = faults.run_scenario(replace(sc, manager={"check_verify_expected_token": False}))
    assert off.damage_step is not None and off.violations == 0  # tokens are all it changes


def test_cold_page_bit_flip_lands_inside_the_partial_read():
    sc = SCENARIOS["cold_page_bit_flip"]
    byte = generated.layout.REAL_KV_PARTIAL_READ_BYTES - 1
    partial = faults.run_scenario(replace(sc, manager={**sc.manager, "real_kv_hash_mode": "PARTIAL"}))
    assert f"K byte {byte} " in partial.detail
    assert partial.ok and partial.first.launch_tag == "SWEEP_K_FULL"


@pytest.mark.parametrize("real_kv_data", ["none", "partial"])
@pytest.mark.parametrize("name", [n for n, sc in SCENARIOS.items() if sc.expect.reason in faults.CHECKS])
def test_check_off_says_exactly_when_sglangs_defaults_miss_the_fault(name, real_kv_data):
    """What the fleet demo reports as not detectable (SGLang's defaults: expected-token check off) is not detected."""
    from kv_canary.engine.config import CanaryConfig
    sc = SCENARIOS[name]
    options = {**CanaryConfig(mode="log", real_kv_data=real_kv_data).manager_options(), **sc.manager}
    r = faults.run_scenario(sc, stop_after_detection=True, **options)
    assert r.damage_step is not None, f"{name}: the fault never fired"
    if sc.expect.check_off(options) is None:
        assert r.ok, f"{name}: {r.why}"
    else:
        assert r.violations == 0, f"{name}: {r.violations} violation(s) with its check off"
