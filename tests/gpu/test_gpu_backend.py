"""The `cuda` backend on a real GPU: the differential suite on CUDA tensors against the torch
reference (the plan's two stages called one by one included), CUDA-graph capture and replay of
plan -> verify -> write, zero-copy and stream checks.
Skipped cleanly where CuPy or torch sees no CUDA device (CI)."""
from __future__ import annotations

import os
import random

import pytest
import torch
from support import scenarios
from support.kernel_diff import compare, run_plan_stages

import kv_canary
from kv_canary.trees.sources import kernel_abi


def _gpu_available() -> bool:
    try:
        import cupy
        return bool(cupy.is_available()) and torch.cuda.is_available()
    except Exception:  # no CuPy, or CuPy without a driver
        return False


# Skipped without a GPU, except under KV_CANARY_REQUIRE_GPU=1 (scripts/gpu_check.py sets it), where a
# missing GPU must fail the run instead of passing it with every test skipped.
pytestmark = pytest.mark.skipif(not _gpu_available() and not os.environ.get("KV_CANARY_REQUIRE_GPU"),
                                reason="no CUDA device visible to CuPy and torch")

MULTIPLIER = float(os.environ.get("KV_CANARY_CASES", "1"))


def cases_for(tree) -> int:
    return max(1, int((300 if tree is kv_canary.generated else 60) * MULTIPLIER))


def each_case(tree, kind: str, make, *, ordered: bool) -> None:
    for seed in range(cases_for(tree)):
        case = make(random.Random(seed), tree)
        try:
            compare(tree, kind, case, "cuda", ordered=ordered)
        except AssertionError as exc:
            raise AssertionError(f"{kind} case seed={seed} ({tree.__name__}): {exc}") from None


def parallel_safe_write_case(rng: random.Random, tree, *, crowded: bool = False, **shape) -> dict:
    """A write case without cross-request overlap (overlap=False), and without the one overlap it
    still allows: slot 0 written by two requests. Requests run in parallel on a GPU, so which of
    two requests writes a shared slot last is not defined there; later claims become -1 (skipped).
    `crowded`: each request's slots repeat many times (scenarios.crowd_slots)."""
    case = scenarios.make_write_case(rng, tree, overlap=False, **shape)
    if crowded:
        scenarios.crowd_slots(rng, case)
    locs = case["out_cache_loc"]
    owner: dict = {}
    for r, (lo, hi) in enumerate(scenarios.write_ranges(case)):
        for i in range(lo, hi):
            slot = int(locs[i])
            if slot >= 0 and owner.setdefault(slot, r) != r:
                locs[i] = -1
    return case


# Requests run in parallel on a GPU: ring rows in any order, and no overlapping slots/seeds.
def test_write_matches_reference(any_tree):
    each_case(any_tree, "write", parallel_safe_write_case, ordered=False)


@pytest.mark.parametrize("shape,threads", [("default", 0), ("block_per_request", 32), ("per_request", 128)])
def test_long_write_requests_match_reference(shape, threads):
    """Requests of up to 700 entries: several chunks of the block_per_request walk (kernels.yaml's
    block, and one-warp blocks), and SGLang's per_request shape from the same template."""
    from support.write_shapes import write_shape_tree
    tree = kv_canary.generated if shape == "default" else write_shape_tree(shape, threads)
    for seed in range(max(1, int(40 * MULTIPLIER))):
        rng = random.Random(seed)
        case = parallel_safe_write_case(rng, tree, n_reqs=rng.randint(1, 6), max_extend=700)
        try:
            compare(tree, "write", case, "cuda", ordered=False)
        except AssertionError as exc:
            raise AssertionError(f"write case seed={seed} ({tree.__name__}): {exc}") from None


@pytest.mark.parametrize("shape,threads", [("default", 0), ("block_per_request", 32)])
def test_duplicate_slots_in_one_request_end_with_the_later_entry(shape, threads):
    """Requests whose slots repeat many times, inside one chunk (across lanes and warps) and across
    chunks: the block's stores of a chunk run in parallel, so only the later of two entries with one
    slot may store; the buffer must be the reference's on every run, not on most."""
    from support.write_shapes import write_shape_tree
    tree = kv_canary.generated if shape == "default" else write_shape_tree(shape, threads)
    for seed in range(max(1, int(40 * MULTIPLIER))):
        rng = random.Random(seed)
        case = parallel_safe_write_case(rng, tree, crowded=True, n_reqs=rng.randint(1, 4), max_extend=700)
        try:
            compare(tree, "write", case, "cuda", ordered=False)
        except AssertionError as exc:
            raise AssertionError(f"crowded write case seed={seed} ({tree.__name__}): {exc}") from None


def test_verify_matches_reference(any_tree):
    each_case(any_tree, "verify", scenarios.make_verify_case, ordered=False)


def test_plan_matches_reference(any_tree):
    tally = scenarios.PlanCaseTally()
    each_case(any_tree, "plan", tally.make, ordered=True)
    tally.report(f"cuda vs reference ({any_tree.__name__})")


def test_scatter_matches_reference(any_tree):
    each_case(any_tree, "scatter", scenarios.make_scatter_case, ordered=True)


def test_plan_stages_match_reference(any_tree):
    """launch_plan_offsets_kernel then launch_plan_entries_kernel on CUDA tensors: the plans and the
    scratch the reference's stages produce, and the plans of one launch_canary_plan_kernels call."""
    for seed in range(max(1, cases_for(any_tree) // 3)):
        rng = random.Random(seed)
        case = scenarios.make_plan_case(rng, any_tree)
        scratch = scenarios.make_plan_scratch(rng, case)
        ref_scratch, got_scratch = scratch.clone(), scratch.to("cuda")
        ref = run_plan_stages(any_tree, scenarios.clone_case(case), ref_scratch, "torch")
        whole_case = scenarios.clone_case(case)
        scenarios.runtime_for(any_tree).launch_canary_plan_kernels(**whole_case, backend="torch")
        got = run_plan_stages(any_tree, scenarios.case_to(scenarios.clone_case(case), "cuda"), got_scratch, "cuda")
        try:
            scenarios.compare_state(scenarios.case_to(got, "cpu"), ref)
            scenarios.compare_state({"scratch": got_scratch.cpu()}, {"scratch": ref_scratch})
            scenarios.compare_state(ref, whole_case)
        except AssertionError as exc:
            raise AssertionError(f"plan stages seed={seed} ({any_tree.__name__}): {exc}") from None


def test_default_backend_for_cuda_tensors_is_cuda(default_tree):
    from kv_canary.launch.runtime import choose_backend
    assert choose_backend(None, torch.device("cuda", 0)) in ("cuda", os.environ.get("KV_CANARY_BACKEND"))


# -- one forward step: plan -> verify -> write, on fixed-size device buffers -------------------------
class Step:
    """Device buffers of one forward step (fixed shapes, refilled in place between replays)."""

    def __init__(self, tree, device, *, bs=4, max_ctx=48, num_slots=512, tokens=12):
        alloc = tree.allocators
        self.tree, self.bs, self.tokens = tree, bs, tokens
        src = alloc.RealKvSource(tensor=torch.randint(0, 256, (num_slots, 64), dtype=torch.uint8, device=device),
                                 page_size=1, num_bytes_per_token=64, read_bytes=32)
        self.ctx = alloc.allocate_context(num_slots=num_slots, ring_capacity=1024, device=device,
                                          real_kv_sources=(src,),
                                          real_kv_hash_mode=tree.layout.RealKvHashMode.ALL)
        self.vplan = alloc.VerifyPlan.allocate(verify_capacity=bs * max_ctx, device=device)
        self.wplan = alloc.WritePlan.allocate(write_req_capacity=bs, device=device)
        self.req_to_token = torch.zeros((bs + 1, max_ctx), dtype=torch.int32, device=device)
        z = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.req_pool_indices, self.prefix_lens, self.extend_seq_lens = z(bs), z(bs), z(bs)
        self.input_ids, self.positions, self.out_cache_loc = z(tokens), z(tokens), z(tokens)
        self.extra = {f.name: z(tokens) for f in tree.layout.INPUT_FIELDS}
        self.request_values = {f.name: z(bs) for f in tree.layout.INPUT_FIELDS if f.verify_expected == "per_request"}
        self.slot_tables = {f.name: z(num_slots) for f in tree.layout.INPUT_FIELDS if f.verify_expected == "per_slot"}

    def refill(self, rng: random.Random) -> None:
        """A new batch in the same buffers: prefixes already written, extends appended now."""
        bs, max_ctx, num_slots = self.bs, self.req_to_token.shape[1], self.ctx.canary_buf.shape[0]
        slots = torch.tensor(rng.sample(range(1, num_slots), (bs + 1) * max_ctx), dtype=torch.int32).view(bs + 1, max_ctx)
        cut = sorted(rng.sample(range(1, self.tokens), bs - 1))
        extends = [b - a for a, b in zip([0] + cut, cut + [self.tokens])]
        prefixes = [rng.randint(0, max_ctx - e) for e in extends]
        self.req_to_token.copy_(slots)
        self.req_pool_indices.copy_(torch.arange(1, bs + 1))
        self.prefix_lens.copy_(torch.tensor(prefixes))
        self.extend_seq_lens.copy_(torch.tensor(extends))
        loc = [int(slots[r + 1, p]) for r in range(bs) for p in range(prefixes[r], prefixes[r] + extends[r])]
        pos = [p for r in range(bs) for p in range(prefixes[r], prefixes[r] + extends[r])]
        self.out_cache_loc.copy_(torch.tensor(loc))
        self.positions.copy_(torch.tensor(pos))
        self.input_ids.copy_(torch.tensor([rng.randrange(50_000) for _ in loc]))
        self.ctx.violation_write_index.zero_()  # each step's rows fit the ring: comparable as multisets
        for t in (*self.extra.values(), *self.request_values.values(), *self.slot_tables.values()):
            t.copy_(torch.randint(0, 5, t.shape))

    def run(self, rt, backend=None) -> None:
        rt.launch_canary_plan_kernels(
            verify_plan_out=self.vplan, write_plan_out=self.wplan, req_pool_indices=self.req_pool_indices,
            prefix_lens=self.prefix_lens, extend_seq_lens=self.extend_seq_lens, req_to_token=self.req_to_token,
            swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=self.vplan.verify_slot_indices.shape[0],
            req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0, extra_request_values=self.request_values, backend=backend)
        rt.launch_canary_verify_kernel(context=self.ctx, plan=self.vplan, check_verify_expected_token=False,
                                       extra_slot_tables=self.slot_tables, backend=backend)
        rt.launch_canary_write_kernel(context=self.ctx, plan=self.wplan, input_ids=self.input_ids,
                                      positions=self.positions, out_cache_loc=self.out_cache_loc,
                                      enable_write_input_assert=False, extra_inputs=self.extra, backend=backend)

    def cpu_copy(self) -> "Step":
        """The same step on CPU copies of every buffer (for the reference)."""
        other = Step.__new__(Step)
        other.__dict__.update(scenarios.case_to({k: v for k, v in self.__dict__.items() if k != "tree"}, "cpu"))
        other.tree = self.tree
        return other

    def state(self) -> dict:
        return {"ctx": self.ctx, "vplan": self.vplan, "wplan": self.wplan}


def test_cuda_graph_capture_and_replay(any_tree):
    rt = scenarios.runtime_for(any_tree)
    step = Step(any_tree, "cuda")
    rng = random.Random(7)
    step.refill(rng)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads the modules outside capture
        step.run(rt, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(rt, backend="cuda")
    for _ in range(3):
        step.refill(rng)
        expected = step.cpu_copy()
        expected.run(rt, backend="torch")
        graph.replay()
        torch.cuda.synchronize()
        scenarios.compare_state(expected.state(), scenarios.case_to(step.state(), "cpu"), ring_as_multiset=True)
    assert int(step.ctx.kernel_run_counter[0]) > 0


def test_launches_are_zero_copy_sync_free_and_on_the_current_stream(default_tree):
    rt = scenarios.runtime_for(default_tree)
    step = Step(default_tree, "cuda")
    rng = random.Random(11)
    step.refill(rng)
    step.run(rt, backend="cuda")  # warm-up (module load reads the ABI identity back: a sync)
    torch.cuda.synchronize()
    step.refill(rng)
    expected = step.cpu_copy()
    expected.run(rt, backend="torch")
    pointers = {k: t.data_ptr() for k, t in scenarios._tensors(step.state(), "", {}).items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")  # any synchronising torch call in a launch path raises
    try:
        with torch.cuda.stream(stream):
            step.run(rt, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream.synchronize()
    after = scenarios._tensors(step.state(), "", {})
    assert {k: t.data_ptr() for k, t in after.items()} == pointers  # results landed in the caller's tensors
    scenarios.compare_state(expected.state(), scenarios.case_to(step.state(), "cpu"), ring_as_multiset=True)


def test_loaded_modules_carry_the_trees_identity(default_tree):
    from kv_canary.trees.identity import AbiMismatchError, check_identity
    mods = scenarios.runtime_for(default_tree).backend("cuda").warm_up("cuda")
    assert set(mods.binaries) == set(kernel_abi(default_tree).KERNELS)
    import cupy
    import numpy as np
    for path in mods.binaries.values():
        module = cupy.RawModule(path=str(path))
        fp = int(cupy.ndarray((1,), dtype=np.uint64, memptr=module.get_global("kv_canary_layout_fingerprint")).get()[0])
        assert fp == int(default_tree.layout.LAYOUT_FINGERPRINT, 16)
        with pytest.raises(AbiMismatchError):
            check_identity(default_tree, module_abi_version=default_tree.layout.ABI_VERSION + 1,
                           module_fingerprint=fp, module_desc=str(path))
