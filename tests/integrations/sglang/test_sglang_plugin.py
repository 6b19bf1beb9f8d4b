"""kv-canary inside SGLang: SGLang 0.5.23's own canary runtime, once on SGLang's kernels and once on
kv-canary's through the plugin (KV_CANARY_SGLANG=1 + load_plugins()), must show the same things.

Each provider runs every scenario in its own process (the hook registry patches modules
process-wide): tests/integrations/sglang/sglang_scenarios.py, over the stand-ins listed in
sglang_cpu.STUBS. One scenario also runs on kv-canary's emulated backend (the CUDA sources on the
CPU), and a run with a deliberately broken kv-canary write launcher must differ.
"""
from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("msgspec")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (make setup installs sglang==0.5.23 --no-deps)", allow_module_level=True)

import kv_canary  # noqa: E402
from kv_canary.integrations.sglang import compat, enabled  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sglang_scenarios.py"
sys.path.insert(0, str(HERE))
import sglang_cpu  # noqa: E402  (STUBS only; installing it here would change this process's sglang)

# Everything a user of SGLang's canary runtime can observe, compared provider against provider.
OBSERVED = ("logs", "errors", "counters", "buffers", "ring", "write_index", "canary_bytes", "calls")
EMULATED = ("redirected_req_to_token",)
BROKEN = ("clean", "redirected_req_to_token")


def _worker(tmp: Path, name: str, *args: str, backend: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("KV_CANARY_SGLANG", "KV_CANARY_BACKEND",
                                                              "KV_CANARY_SGLANG_METRICS_PORT")}
    if backend:
        env["KV_CANARY_BACKEND"] = backend
    out = tmp / f"{name}.json"
    proc = subprocess.Popen([sys.executable, str(WORKER), *args, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return name, proc, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three processes at once: SGLang's kernels, the plugin, the plugin on `emulated` (which then runs
    two scenarios again with its write launcher broken on purpose)."""
    tmp = tmp_path_factory.mktemp("sglang")
    started = [_worker(tmp, "sglang", "--provider", "sglang"),
               _worker(tmp, "plugin", "--provider", "plugin"),
               _worker(tmp, "emulated", "--provider", "plugin", "--scenarios", ",".join(EMULATED),
                       "--broken", ",".join(BROKEN), backend="emulated")]
    results = {}
    for name, proc, out in started:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"the {name} worker failed:\n{log}"
        results[name] = json.loads(out.read_text())
    return results


def differences(ours: dict, theirs: dict) -> list[str]:
    """What differs between two providers' records of one scenario, observation by observation."""
    out = []
    for key in OBSERVED:
        a, b = ours[key], theirs[key]
        if a != b:
            if isinstance(a, list) and isinstance(b, list):
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                out.append(f"{key}: first difference at entry {first} of {len(a)} / {len(b)}: "
                           f"{str(a[first] if first < len(a) else None)[:300]} != "
                           f"{str(b[first] if first < len(b) else None)[:300]}")
            else:
                out.append(f"{key} differs")
    return out


SCENARIOS = ("clean", "redirected_req_to_token", "kv_bytes_changed", "mha_v", "raise", "perturb_req_to_token",
             "perturb_real_kv_used", "perturb_real_kv_post_forward", "perturb_real_kv_unused_cache",
             "perturb_next_token_swap",
             "stalled_sweep", "verify_token_assert", "write_input_assert", "swa")


def test_every_scenario_runs_on_both_providers(runs):
    assert sorted(runs["sglang"]["scenarios"]) == sorted(SCENARIOS) == sorted(runs["plugin"]["scenarios"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_plugin_shows_what_sglangs_kernels_show(runs, scenario):
    assert differences(runs["plugin"]["scenarios"][scenario], runs["sglang"]["scenarios"][scenario]) == []


@pytest.mark.parametrize("scenario", EMULATED)
def test_the_emulated_cuda_source_under_sglangs_runtime(runs, scenario):
    assert runs["emulated"]["backend"] == "emulated"
    assert "backend=emulated" in runs["emulated"]["plugin_log"][0][2]
    assert differences(runs["emulated"]["scenarios"][scenario], runs["sglang"]["scenarios"][scenario]) == []


@pytest.mark.parametrize("scenario", BROKEN)
def test_a_broken_kv_canary_launcher_is_caught(runs, scenario):
    found = differences(runs["emulated"]["broken"][scenario], runs["sglang"]["scenarios"][scenario])
    assert found and any(line.startswith(("canary_bytes", "buffers")) for line in found), found


def test_the_scenarios_see_what_they_are_about(runs):
    """Each scenario shows its own finding (so the comparisons above compare something)."""
    sc = runs["sglang"]["scenarios"]
    warnings = lambda name: [m for _, level, m in sc[name]["logs"] if level == "WARNING"]  # noqa: E731
    assert sc["clean"]["write_index"] == 0 and not sc["clean"]["errors"]
    assert any(m.startswith("[canary] step=3 protected_tokens=") for _, _, m in sc["clean"]["logs"])
    for name, reason in (("redirected_req_to_token", "verify_chain_hash"), ("kv_bytes_changed", "verify_real_kv_hash"),
                         ("mha_v", "verify_real_kv_hash"), ("perturb_req_to_token", "verify_chain_hash"),
                         ("perturb_real_kv_used", "verify_real_kv_hash"),
                         ("perturb_real_kv_post_forward", "verify_real_kv_hash"),
                         ("perturb_real_kv_unused_cache", "verify_real_kv_hash"), ("swa", "verify_chain_hash"),
                         ("verify_token_assert", "verify_token"), ("write_input_assert", "write_token"),
                         ("perturb_next_token_swap", "write_token")):
        assert any(f"fail_reason={reason}" in m or f"+{reason}" in m for m in warnings(name)), name
    assert any("launch_tag=TAIL_V_FULL" in m for m in warnings("mha_v"))
    assert any("launch_tag=SWEEP_K_FULL" in m for m in warnings("perturb_real_kv_unused_cache"))
    assert any("_SWA " in m for m in warnings("swa"))
    raised = sc["raise"]["errors"]
    assert raised and raised[0]["type"] == "RuntimeError" and raised[0]["text"].startswith("kv_canary violation: ")
    assert sc["stalled_sweep"]["errors"] == [{
        "step": 100, "type": "RuntimeError", "during": [],
        "text": "kv-canary: kernel_run_counter did not increase since previous check for tags=[SWEEP_K_FULL] at "
                "step=101; canary path is not executing"}]
    assert not [e for name in SCENARIOS if name not in ("raise", "stalled_sweep") for e in sc[name]["errors"]]


def test_sglangs_default_configuration_sends_a_lone_valid_lens(runs):
    """The call the drop-in used to refuse: the plan's valid lens without an expected-token pool."""
    plans = [c["kwargs"] for c in runs["plugin"]["scenarios"]["clean"]["calls"] if c["launcher"] == "plan"]
    assert plans and all(p["req_to_verify_expected_tokens"] is None
                         and p["req_to_verify_expected_tokens_valid_lens"]["tensor"] == "int64" for p in plans)
    calls = runs["plugin"]["scenarios"]["verify_token_assert"]["calls"]
    assert {c["launcher"] for c in calls} == {"plan", "verify", "write", "scatter"}


def test_unset_changes_nothing_and_set_replaces_every_launcher(runs):
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert points.get("kv_canary") == "kv_canary.integrations.sglang:load"
    # KV_CANARY_SGLANG unset: load_plugins() loads kv-canary's entry point, which leaves SGLang's launchers
    # (scatter: the harness's own stand-in for SGLang's Triton kernel, see sglang_cpu.STUBS).
    assert runs["sglang"]["replaced"] == {"verify": False, "write": False, "plan": False, "scatter": True}
    assert runs["sglang"]["plugin_log"] == []
    assert runs["plugin"]["entry_point"] and runs["plugin"]["replaced"] == {"verify": True, "write": True, "plan": True,
                                                                            "scatter": True}
    (line,) = [m for name, _, m in runs["plugin"]["plugin_log"] if name == "kv_canary.integrations.sglang"]
    assert line.startswith(f"kv-canary {importlib.metadata.version('kv-canary')} active inside SGLang 0.5.23: "
                           f"backend=cpu schema=abi_version {kv_canary.ABI_VERSION}, layout "
                           f"{kv_canary.LAYOUT_FINGERPRINT} (SGLang-compatible 32-byte records)")


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The plugin loaded by SGLang's own loader into SGLang 0.5.23 with one launcher removed (a fork or
    dev build that lacks it), and with its metrics port held by another socket (sglang_scenarios.probe)."""
    tmp = tmp_path_factory.mktemp("sglang_probes")
    started = [_worker(tmp, "without_write", "--provider", "plugin", "--without", "write"),
               _worker(tmp, "busy_port", "--provider", "plugin", "--busy-metrics-port")]
    results = {}
    for name, proc, out in started:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"the {name} probe failed:\n{log}"
        results[name] = json.loads(out.read_text())
    return results


def test_an_sglang_lacking_one_launcher_gets_none_replaced(probes):
    """SGLang applies hooks one by one and only logs a target it cannot find: the plugin used to leave
    4 of 5 replaced while its start-up line named all five. Every target is resolved first now."""
    probe = probes["without_write"]
    assert probe["replaced"] == {"verify": False, "write": "missing", "plan": False, "scatter": False,
                                 "use_torch_reference": False}
    assert probe["manager"] == "built"   # SGLang runs on, on its own kernels
    ours = [m for name, _, m in probe["plugin_log"] if name == "kv_canary.integrations.sglang"]
    assert ours == []                    # no "active inside SGLang" line
    (failed,) = [m for name, level, m in probe["plugin_log"] if level == "ERROR"]
    assert failed == ("Failed to execute general plugin: kv_canary\nValueError: kv-canary: this SGLang lacks what the "
                      "plugin replaces or hooks: sglang.kernels.ops.kv_canary.write.launch_canary_write_kernel "
                      "(AttributeError: module 'sglang.kernels.ops.kv_canary.write' has no attribute "
                      "'launch_canary_write_kernel'); nothing was replaced (SGLang keeps its own canary kernels). "
                      "Install a tested SGLang release as published, or unset KV_CANARY_SGLANG")


def test_a_busy_metrics_port_refuses_the_canary_manager_with_a_clear_error(probes):
    """A bare OSError [Errno 98] came out of SGLang's CanaryManager.__init__; now kv-canary's error,
    before SGLang builds the manager's device state."""
    probe = probes["busy_port"]
    port = probe["port"]
    assert probe["manager"] == (
        f"MetricsPortUnavailable: kv-canary: cannot serve /metrics on 127.0.0.1:{port}: Address already in use "
        f"(KV_CANARY_SGLANG_METRICS_PORT={port} plus this process's torch.distributed rank 0); another process is "
        f"listening there; set KV_CANARY_SGLANG_METRICS_PORT to a free port (0 picks one) or unset it to run "
        f"without the endpoint")


def test_a_prometheus_scrape_during_a_perturb_scenario_shows_the_violations(runs):
    from prometheus_client.parser import text_string_to_metric_families

    scenario = runs["plugin"]["scenarios"]["perturb_req_to_token"]
    step = 5                                    # the scrape follows the 6th forward (sglang_scenarios.SCRAPE_HOOK)
    at = scenario["counters"][step]
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ("launch_tag", "fail_reason")))): s.value
               for family in text_string_to_metric_families(scenario["scrapes"][0]) for s in family.samples}
    expected = collections.Counter()
    for row in scenario["ring"][:at["write_index"]]:
        tag = kv_canary.CanaryLaunchTag(row[kv_canary.VIOLATION_FIELD_KERNEL_KIND]).name
        for bit in kv_canary.FailReason:
            if row[kv_canary.VIOLATION_FIELD_FAIL_REASON_BITS] & int(bit):
                expected[tag, bit.name.lower().removesuffix("_mismatch")] += 1
    assert at["write_index"] > 0 and expected
    got = {(dict(k)["launch_tag"], dict(k)["fail_reason"]): v for (name, k), v in samples.items()
           if name == "kv_canary_violations_total"}
    assert got == dict(expected)
    assert samples["kv_canary_violation_rows_total", ()] == at["write_index"]
    for tag in kv_canary.CanaryLaunchTag:
        assert samples["kv_canary_kernel_runs_total", (("launch_tag", tag.name),)] == at["kernel"][int(tag)]
    assert samples["kv_canary_protected_tokens_total", ()] == sum(at["slot"])


def metric_samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, s.labels.get("launch_tag")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "fail_reason" not in s.labels}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_counters_follow_sglangs_canary_state(runs, scenario):
    """After the last step, every scenario's scrape holds SGLang's device counters and ring totals."""
    record = runs["plugin"]["scenarios"][scenario]
    samples, last = metric_samples(record["scrapes"][-1]), record["counters"][-1]
    assert samples["kv_canary_violation_rows_total", None] == last["write_index"] == record["write_index"]
    assert samples["kv_canary_ring_rows_lost_total", None] == 0
    assert samples["kv_canary_protected_tokens_total", None] == sum(last["slot"])
    assert [samples["kv_canary_kernel_runs_total", t.name] for t in kv_canary.CanaryLaunchTag] == last["kernel"]
    assert samples["kv_canary_healthy", None] == (0 if scenario == "stalled_sweep" else 1)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_plugin_writes_every_violation_as_a_json_line(runs, scenario):
    """KV_CANARY_SGLANG_VIOLATIONS_JSONL: one object per row of SGLang's ring, in ring order."""
    record = runs["plugin"]["scenarios"][scenario]
    rows = record["ring"][:min(record["write_index"], len(record["ring"]))]
    lines = [o for o in record.get("jsonl", []) if o["labels"] == {"rank": "0"}]
    assert len(lines) == len(record.get("jsonl", []))
    f = kv_canary
    assert [(o["launch_tag_value"], o["slot_idx"], o["position"], o["stored_token"]) for o in lines] == \
        [(r[f.VIOLATION_FIELD_KERNEL_KIND], r[f.VIOLATION_FIELD_SLOT_IDX], r[f.VIOLATION_FIELD_POSITION],
          r[f.VIOLATION_FIELD_STORED_TOKEN]) for r in rows]
    assert all(o["format"] == "kv-canary-violation" for o in lines)
    if scenario == "kv_bytes_changed":   # a scenario with violations: the check above is not vacuous
        assert lines and {"verify_real_kv_hash"} <= {r for o in lines for r in o["fail_reasons"]}


def test_the_plugin_refuses_a_tree_that_is_not_sglangs_bytes(runs):
    checks = runs["plugin"]["tree_checks"]
    assert checks["default"] == "accepted"
    for name in ("wide_stride", "owner_epoch"):
        assert checks[name].startswith("kv-canary: the generated tree is not byte-compatible with SGLang's 32-byte "
                                       "canary records, so SGLang's runtime cannot run on it: record bytes"), name
    assert "input fields (docs/semantics.md §8): tree ('request_id', 'epoch'), SGLang ()" in checks["owner_epoch"]


def test_the_plugin_refuses_sglang_data_classes_without_kv_canarys_fields():
    import dataclasses

    @dataclasses.dataclass
    class WritePlan:            # an SGLang whose WritePlan lost a field
        write_offsets: object
        write_num_valid_reqs: object

    ours = {"WritePlan": kv_canary.WritePlan, "VerifyOrWriteContext": kv_canary.VerifyOrWriteContext}
    assert compat.data_class_differences(ours, {"WritePlan": WritePlan, "VerifyOrWriteContext": ours[
        "VerifyOrWriteContext"]}) == ["SGLang's WritePlan lacks write_seed_slot_indices"]


def test_the_plugin_refuses_an_untested_sglang():
    assert compat.check_sglang_version("0.5.23") == "0.5.23"
    with pytest.raises(ValueError, match=r"^kv-canary: the SGLang plugin is tested with sglang 0\.5\.23, got sglang "
                                         r"0\.5\.22; install a tested release"):
        compat.check_sglang_version("0.5.22")


def test_kv_canary_sglang_is_read_strictly(monkeypatch):
    for raw, want in (("", False), ("0", False), ("off", False), ("1", True), ("true", True)):
        monkeypatch.setenv("KV_CANARY_SGLANG", raw)
        assert enabled() is want
    monkeypatch.setenv("KV_CANARY_SGLANG", "maybe")
    with pytest.raises(ValueError, match=r"^kv-canary: KV_CANARY_SGLANG must be 1 .* or 0, got 'maybe'$"):
        enabled()
    with pytest.raises(ValueError, match=r"KV_CANARY_SGLANG_METRICS_PORT must be a port in \[0, 65535\]"):
        compat.metrics_port("http")


def test_every_stand_in_is_listed_with_its_reason():
    assert all(len(reason) > 40 for reason in sglang_cpu.STUBS.values())
    names = " ".join(sglang_cpu.STUBS)
    for replaced in ("triton", "sglang.kernels.jit.utils", "sglang.srt.utils", "_phase_check_kernel", "pinned",
                     "UnifiedRadixCache", "ForwardBatch", "ModelRunner", "ServerArgs", "launch_scatter_req_token_ids"):
        assert replaced in names


def test_sglangs_data_classes_are_rewrapped_over_the_same_tensors():
    """The plugin hands kv-canary SGLang's own tensors (no copy): what a launch writes, SGLang sees."""
    import enum
    from types import SimpleNamespace

    import torch

    from kv_canary.integrations.sglang import hooks

    class Tag(enum.IntEnum):      # SGLang's enums are its own classes; the values are what cross over
        TAIL_V_SWA = 9

    source = SimpleNamespace(tensor=torch.zeros(8, 32, dtype=torch.uint8), page_size=1, num_bytes_per_token=32,
                             read_bytes=16)
    counters = torch.zeros(12, dtype=torch.int64)
    context = SimpleNamespace(canary_buf=torch.zeros(8, 32, dtype=torch.uint8), kernel_kind=Tag.TAIL_V_SWA,
                              violation_ring=torch.zeros(4, 8, dtype=torch.int64),
                              violation_write_index=torch.zeros(1, dtype=torch.int32),
                              slot_run_counter=counters[9:10], kernel_run_counter=counters[3:4],
                              real_kv_sources=(source,), real_kv_hash_mode=2,
                              enable_chain_position_assert=torch.ones(1, dtype=torch.int32))
    ours = hooks.as_context(context)
    assert type(ours) is kv_canary.VerifyOrWriteContext
    assert ours.kernel_kind is kv_canary.CanaryLaunchTag.TAIL_V_SWA
    assert ours.real_kv_hash_mode is kv_canary.RealKvHashMode.ALL
    for name in ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
                 "enable_chain_position_assert"):
        assert getattr(ours, name) is getattr(context, name), name
    assert type(ours.real_kv_sources[0]) is kv_canary.RealKvSource
    assert ours.real_kv_sources[0].tensor is source.tensor
    plan = kv_canary.VerifyPlan.allocate(verify_capacity=4, device="cpu")
    mirror = hooks.as_verify_plan(SimpleNamespace(**{f: getattr(plan, f) for f in plan.__dataclass_fields__}))
    assert all(getattr(mirror, f) is getattr(plan, f) for f in plan.__dataclass_fields__)
    kv_canary.launch_canary_verify_kernel(context=ours, plan=mirror, check_verify_expected_token=False)
    assert counters.tolist()[3] == 1       # SGLang's counter view, advanced in place
