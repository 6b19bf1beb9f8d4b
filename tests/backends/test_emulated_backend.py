"""Emulated-backend behaviour beyond the random differential suite: multi-chunk plan scans, what
the kernels store where the host backends raise, strict warp mode, device checks, the build cache
and build errors that point at template lines."""
from __future__ import annotations

import hashlib
import random
import re
import shutil

import pytest
import torch
from support import budget, scenarios
from support.kernel_diff import compare

from kv_canary.launch import operations
from kv_canary.trees.loader import load_generated
from kv_canary.trees.sources import kernel_abi, tree_dir

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


def _kernels_only(backend, operation: str, **args) -> None:
    """The operation's kernels alone, without the host backend's value checks (as on a GPU)."""
    backend.prepare(operations.BY_NAME[operation], args).run()


def _backend(tree):
    return scenarios.runtime_for(tree).backend("emulated")


def test_plan_scans_batches_larger_than_a_block(default_tree):
    """bs above the block size: the single-block offsets kernel carries its scan across chunks."""
    assert _backend(default_tree).threads < 150
    for seed in range(6):
        case = scenarios.make_plan_case(random.Random(seed), default_tree, n_reqs=150, max_prefix=6, max_extend=4)
        compare(default_tree, "plan", case, "emulated", ordered=True)


@pytest.mark.parametrize("window", [4, 0])   # a LUT translates with or without a window (§5.3)
def test_unreadable_lut_index_is_reported_not_read(default_tree, window):
    """An index past the SWA LUT: both host backends raise (§5.3, §7); the kernel itself (what the
    cuda backend launches) cannot, so it stores PLAN_UNREADABLE_INDEX (INT64_MAX, >= every slot
    count) and verify then reports SLOT_OUT_OF_RANGE for that entry."""
    layout, alloc = default_tree.layout, default_tree.allocators
    rt = scenarios.runtime_for(default_tree)
    lut = torch.arange(8, dtype=torch.int64)  # req_to_token holds 9: outside the LUT
    args = dict(req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([2]), extend_seq_lens=torch.tensor([0]),
                req_to_token=torch.tensor([[0, 0], [5, 9]], dtype=torch.int32), swa_window_size=window,
                full_to_swa_index_mapping=lut, verify_capacity=4)
    for backend in ("torch", "emulated"):
        with pytest.raises(ValueError, match="^kv-canary: SWA slot 9 is outside full_to_swa_index_mapping length 8$"):
            rt.launch_canary_plan_kernels(verify_plan_out=alloc.VerifyPlan.allocate(verify_capacity=4, device="cpu"),
                                          write_plan_out=alloc.WritePlan.allocate(write_req_capacity=1, device="cpu"),
                                          backend=backend, **args)
    vplan = alloc.VerifyPlan.allocate(verify_capacity=4, device="cpu")
    _kernels_only(_backend(default_tree), "plan", verify_plan_out=vplan,   # the kernels, without the host checks
                       write_plan_out=alloc.WritePlan.allocate(write_req_capacity=1, device="cpu"),
                       req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
                       kv_token_id_vs_position_offset=0, extra_request_values={}, **args)
    unreadable = (1 << 63) - 1
    assert vplan.verify_slot_indices[:2].tolist() == [5, unreadable]
    assert vplan.verify_prev_slot_indices[:2].tolist() == [-1, 5]
    ctx = alloc.allocate_context(num_slots=16, ring_capacity=4, device="cpu")
    rt.launch_canary_verify_kernel(context=ctx, plan=vplan, check_verify_expected_token=False, backend="emulated")
    oor = [row for row in ctx.violation_ring[: int(ctx.violation_write_index[0])].tolist()
           if row[layout.VIOLATION_COL_FAIL_REASON] == layout.FailReason.SLOT_OUT_OF_RANGE]
    assert [(r[layout.VIOLATION_COL_SLOT], r[layout.VIOLATION_COL_EXPECTED_AUX]) for r in oor] == [(unreadable, unreadable)]


def test_strict_mode_rejects_a_partial_warp_reduction(default_tree):
    """Strict warp mode is on: the verify's full-mask warp reduction with 48 threads names lanes
    that do not exist, and the launch fails with the shim's message instead of passing."""
    from kv_canary.backends.emulated import EmulationLaunchError
    backend = _backend(default_tree)
    case = scenarios.make_verify_case(random.Random(3), default_tree, n_reqs=4)
    abi = kernel_abi(default_tree)
    kernel = abi.kernel_for_operation("verify")
    case["plan"].enable.fill_(1)
    args = kernel.bind(dict(context=case["context"], plan=case["plan"], check_verify_expected_token=False,
                            extra_slot_tables={}), None)  # None: the binding reads the real-KV sources itself
    entry = kernel.entry_point(check_verify_expected_token=False)
    with pytest.raises(EmulationLaunchError, match="strict warp check: lane .* does not exist"):
        backend.launcher(kernel, entry, blocks=1, threads=48, values=args, device=None)()
    backend.launcher(kernel, entry, blocks=1, threads=64, values=args, device=None)()  # whole warps: fine


def test_emulated_backend_needs_cpu_tensors(default_tree):
    with pytest.raises(ValueError, match="backend 'emulated' runs the kernels on the host and needs CPU tensors"):
        _backend(default_tree).check_device(torch.device("cuda", 0))


def test_library_is_built_once_per_content(default_tree, tmp_path, monkeypatch):
    from kv_canary.trees.emulation_build import build_library
    monkeypatch.setenv("KV_CANARY_CACHE_DIR", str(tmp_path))
    path = build_library(default_tree)
    assert path.parent == tmp_path / "emulation"
    stamp = path.stat().st_mtime_ns
    assert build_library(default_tree) == path and path.stat().st_mtime_ns == stamp


def test_library_inputs_cover_the_csrc_headers(default_tree, tmp_path, monkeypatch):
    """The library's cache key covers every kv_canary/csrc/ header: editing one rebuilds it."""
    from kv_canary.trees import csrc
    from kv_canary.trees.emulation_build import library_inputs
    names = [name for name, _ in library_inputs(default_tree)]
    assert set(csrc.csrc_headers()) <= set(names) and "kvc_device.cuh" in names
    copy = tmp_path / "csrc"
    shutil.copytree(csrc.CSRC_DIR, copy)
    monkeypatch.setattr(csrc, "CSRC_DIR", copy)
    before = dict(library_inputs(default_tree))
    (copy / "kvc_write.cuh").write_text(before["kvc_write.cuh"] + "// edited\n", encoding="utf-8")
    after = dict(library_inputs(default_tree))
    assert after["kvc_write.cuh"] != before["kvc_write.cuh"]
    assert {k: v for k, v in after.items() if k != "kvc_write.cuh"} == {k: v for k, v in before.items() if k != "kvc_write.cuh"}


def test_build_error_quotes_gxx_at_the_template_line(default_tree, tmp_path, monkeypatch):
    """A broken generated source fails the build with g++'s diagnostics naming the template line."""
    from kv_canary.trees.emulation_build import EmulationBuildError, build_library
    monkeypatch.setenv("KV_CANARY_CACHE_DIR", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    shutil.copytree(tree_dir(default_tree), tree, ignore=shutil.ignore_patterns("__pycache__"))
    scatter = tree / "cuda" / "canary_scatter_req_token_ids.cu"
    text = scatter.read_text()
    m = list(re.finditer(r'#line (\d+) "(codegen/templates/cuda/scatter\.cu\.j2)"\n', text))[-1]
    broken_text = text[:m.end()] + "  undeclared_identifier = 1;\n" + text[m.end():]
    scatter.write_text(broken_text)
    # As a generator whose template rendered it so lists it (else the tree refuses it before the build).
    init = tree / "__init__.py"
    init.write_text(init.read_text().replace(hashlib.sha256(text.encode()).hexdigest(),
                                             hashlib.sha256(broken_text.encode()).hexdigest()))
    broken = load_generated(tree, "kv_canary_test_broken_tree")
    with pytest.raises(EmulationBuildError) as err:
        build_library(broken)
    assert f"{m.group(2)}:{m.group(1)}" in str(err.value) and "undeclared_identifier" in str(err.value)


@pytest.mark.parametrize("threads", [1024, pytest.param(512, marks=pytest.mark.skipif(not budget.FULL, reason="under make test-full (KV_CANARY_FULL=1)"))])
def test_verify_on_a_pinned_fixed_grid_matches_reference(tmp_path, threads):
    """kernels.yaml pinning the verify to a fixed grid with bigger blocks (SGLang's 64 x 512, and
    1024 threads): the cooperative fingerprint then stages fewer chunks per row (4, 2) in its
    shared-memory tiles, which the default 256-thread verify never does."""
    import yaml
    from support.trees import DEFAULT_SCHEMA, generate_tree
    data = yaml.safe_load(DEFAULT_SCHEMA.read_text())
    for k in data["kernels"]:
        if k["operation"] == "verify":
            k["launch"] = {"shape": "fixed_grid", "threads": threads, "blocks": 3}
    schema = tmp_path / f"fixed_grid_{threads}.yaml"
    schema.write_text(yaml.safe_dump(data, sort_keys=False))
    tree = generate_tree(schema)
    assert f"kvc::KvWarpTile<{256 * 8 // threads}>" in (tree_dir(tree) / "cuda" / "canary_verify.cu").read_text()
    for seed in range(30):
        compare(tree, "verify", scenarios.make_verify_case(random.Random(seed), tree), "emulated", ordered=True)
