"""Host backends (torch, emulated) reject indices that a bug detector must not hide (docs/semantics.md
§5.3, §7): request rows outside req_to_token / pool_out and SWA indices outside the LUT raise a
ValueError before anything is written. The kernels (what the cuda backend launches) cannot raise:
they treat such a row as inactive or skipped and store PLAN_UNREADABLE_INDEX for such an index."""
from __future__ import annotations

import random
import re
import shutil

import pytest
import torch
from support import scenarios
from support.oracle import Oracle

import kv_canary
from kv_canary.launch import operations

_NEEDS_GXX = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
HOST_BACKENDS = ["torch", pytest.param("cpu", marks=_NEEDS_GXX), pytest.param("emulated", marks=_NEEDS_GXX)]
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


def _kernels_only(backend, operation: str, **args) -> None:
    """The operation's kernels alone, without the host backend's value checks (as on a GPU)."""
    backend.prepare(operations.BY_NAME[operation], args).run()


def _plan_case(tree, seed: int, **kw) -> dict:
    return scenarios.make_plan_case(random.Random(seed), tree, n_reqs=3, **kw)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("bad", ["past_the_end", "negative"])
def test_plan_rejects_a_row_outside_req_to_token(any_tree, backend, bad):
    case = _plan_case(any_tree, 1)
    rows = int(case["req_to_token"].shape[0])
    value = rows + 4 if bad == "past_the_end" else -3
    case["req_pool_indices"][1] = value
    before = scenarios.clone_case(case)
    msg = f"kv-canary: req_pool_indices[1] = {value} is outside req_to_token rows [0, {rows})"
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        scenarios.runtime_for(any_tree).launch_canary_plan_kernels(**case, backend=backend)
    scenarios.compare_state(case, before)   # nothing written


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_scatter_rejects_a_row_outside_the_pool(backend):
    case = scenarios.make_scatter_case(random.Random(2), kv_canary.generated, n_reqs=4)
    rows = int(case["pool_out"].shape[0])
    case["req_pool_indices"][2] = rows
    before = scenarios.clone_case(case)
    msg = f"kv-canary: req_pool_indices[2] = {rows} is outside pool_out rows [0, {rows})"
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        kv_canary.scatter_req_token_ids(**case, backend=backend)
    scenarios.compare_state(case, before)


@needs_gxx
def test_kernels_treat_bad_rows_as_inactive(default_tree):
    """What the cuda backend does (it cannot raise): the same kernels without the host checks end
    where the oracle does, which leaves such a plan row inactive and skips such a scatter row."""
    emulated = scenarios.runtime_for(default_tree).backend("emulated")
    for seed in range(4):
        case = _plan_case(default_tree, seed)
        case["req_pool_indices"][seed % 3] = int(case["req_to_token"].shape[0]) + seed
        got, want = scenarios.clone_case(case), scenarios.clone_case(case)
        _kernels_only(emulated, "plan", **got)
        Oracle(default_tree).plan(**want)
        scenarios.compare_state(got, want)
        scatter = scenarios.make_scatter_case(random.Random(seed), default_tree, n_reqs=3)
        scatter["req_pool_indices"][seed % 3] = -1 - seed
        got, want = scenarios.clone_case(scatter), scenarios.clone_case(scatter)
        _kernels_only(emulated, "scatter", **got)
        Oracle(default_tree).scatter(**want)
        scenarios.compare_state(got, want)


@needs_gxx
def test_swa_index_outside_the_lut_raises_the_same_text_in_both_host_backends(default_tree):
    """Random plans with a truncated LUT (with or without a window): torch and emulated both raise the
    §7 text with the same index, or (when nothing read is outside, e.g. an overflowing verify plan)
    both end equal."""
    rt = scenarios.runtime_for(default_tree)
    raised = passed = 0
    for seed in range(150):
        rng = random.Random(seed)
        case = scenarios.make_plan_case(rng, default_tree, n_reqs=rng.randint(1, 6), max_prefix=12)
        if case["full_to_swa_index_mapping"] is None:
            continue
        lut = case["full_to_swa_index_mapping"]
        case["full_to_swa_index_mapping"] = lut[: rng.randint(1, lut.shape[0])].clone()
        outcomes = []
        for backend in ("torch", "emulated", "cpu"):
            run = scenarios.clone_case(case)
            try:
                rt.launch_canary_plan_kernels(**run, backend=backend)
                outcomes.append(run)
            except ValueError as exc:
                assert re.fullmatch(r"kv-canary: SWA slot \d+ is outside full_to_swa_index_mapping length \d+",
                                    str(exc)), exc
                scenarios.compare_state(run, case)   # nothing written
                outcomes.append(str(exc))
        torch_out, *kernel_outs = outcomes
        for kernel_out in kernel_outs:  # emulated, cpu
            if isinstance(torch_out, str):
                assert kernel_out == torch_out, f"seed {seed}"
            else:
                assert not isinstance(kernel_out, str), f"seed {seed}: a kernel backend raised {kernel_out}"
                scenarios.compare_state(kernel_out, torch_out)
        raised += isinstance(torch_out, str)
        passed += not isinstance(torch_out, str)
    assert raised >= 5 and passed >= 1, (raised, passed)


def test_swa_error_names_the_first_index_the_plan_reads():
    """Seeds first (request order), then the verify entries' slots, then their predecessors."""
    lut = torch.arange(10, dtype=torch.int64)
    r2t = torch.tensor([[0, 0, 0], [1, 2, 3], [4, 12, 11]], dtype=torch.int32)
    kw = dict(req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 3]),
              extend_seq_lens=torch.tensor([0, 1]), req_to_token=r2t, swa_window_size=2,
              full_to_swa_index_mapping=lut, verify_capacity=8)
    # Row 2's window [1, 3) reads slots 12, 11 and predecessors 4, 12; with an extend its seed is 11.
    for extend, first in ((1, 11), (0, 12)):
        kw["extend_seq_lens"] = torch.tensor([0, extend])
        for backend in ("torch", *(["emulated", "cpu"] if shutil.which("g++") else [])):
            with pytest.raises(ValueError, match=rf"^kv-canary: SWA slot {first} is outside "
                                                 rf"full_to_swa_index_mapping length 10$"):
                kv_canary.launch_canary_plan_kernels(
                    verify_plan_out=kv_canary.VerifyPlan.allocate(verify_capacity=8, device="cpu"),
                    write_plan_out=kv_canary.WritePlan.allocate(write_req_capacity=2, device="cpu"),
                    backend=backend, **kw)
