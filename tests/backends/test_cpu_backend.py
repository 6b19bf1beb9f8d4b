"""The native cpu backend beyond the differential suite: its thread count, launches large enough to
be split over threads at the default grain, the default backend of CPU tensors, and what happens
where it cannot be built (one warning naming the cause, then the torch reference)."""
from __future__ import annotations

import random
import shutil
import warnings

import pytest
import torch
from support import scenarios
from support.kernel_diff import compare

import kv_canary
from kv_canary.backends import cpu as cpu_module
from kv_canary.launch import runtime as runtime_module
from kv_canary.trees import cpu_build

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


@pytest.fixture
def backend():
    b = scenarios.runtime_for(kv_canary.generated).backend("cpu")
    saved = b.threads, b.grain
    yield b
    b.set_threads(saved[0], grain=saved[1])


def test_thread_count_from_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_module.ENV_THREADS, "3")
    assert cpu_module.default_threads() == 3
    monkeypatch.delenv(cpu_module.ENV_THREADS)
    assert cpu_module.default_threads() >= 1
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(cpu_module.ENV_THREADS, bad)
        with pytest.raises(ValueError, match=rf"^kv-canary: KV_CANARY_CPU_THREADS must be a positive integer, "
                                             rf"got '{bad}'$"):
            cpu_module.default_threads()


def test_set_threads_refuses_what_is_not_a_positive_int(backend):
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="^kv-canary: the cpu backend's threads must be a positive int"):
            backend.set_threads(bad)
    with pytest.raises(ValueError, match="^kv-canary: the cpu backend's grain must be a positive int, got 0$"):
        backend.set_threads(2, grain=0)


def _big_verify_case(rng: random.Random) -> dict:
    """Verify entries over one long chain with some corruption: more entries than the default grain."""
    tree = kv_canary.generated
    n = 3 * cpu_module.DEFAULT_GRAIN + 17
    num_slots = n + 8
    sources = scenarios.make_sources(rng, tree, num_slots, count=2)
    ctx = kv_canary.allocate_context(num_slots=num_slots, ring_capacity=64, device="cpu", real_kv_sources=sources,
                                     real_kv_hash_mode=kv_canary.RealKvHashMode.ALL)
    slots = torch.randperm(num_slots - 1)[:n] + 1
    plan = kv_canary.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets[1] = n
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(1)
    kv_canary.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=torch.randint(0, 1000, (n,)),
                                         positions=torch.arange(n), out_cache_loc=slots,
                                         enable_write_input_assert=False, backend="torch")
    words = ctx.canary_buf.view(torch.int64)
    for s in rng.sample(slots.tolist(), 40):  # rows from every thread's range, and more than the ring holds
        words[s, kv_canary.CANARY_FIELD_TOKEN] += 1
    vplan = kv_canary.VerifyPlan.allocate(verify_capacity=n, device="cpu")
    vplan.verify_slot_indices.copy_(slots)
    vplan.verify_slot_indices[5] = num_slots + 3  # an out-of-range entry: its row in its place
    vplan.verify_prev_slot_indices[0] = -1
    vplan.verify_prev_slot_indices[1:] = slots[:-1]
    vplan.verify_expected_positions.copy_(torch.arange(n))
    vplan.verify_num_valid.fill_(n)
    return dict(context=ctx, plan=vplan, check_verify_expected_token=False)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_launches_split_at_the_default_grain_match_the_reference(backend, threads):
    backend.set_threads(threads)
    rng = random.Random(threads)
    compare(kv_canary.generated, "verify", _big_verify_case(rng), "cpu", ordered=True)
    case = scenarios.make_write_case(rng, kv_canary.generated, n_reqs=4, max_prefix=8,
                                     max_extend=cpu_module.DEFAULT_GRAIN)
    compare(kv_canary.generated, "write", case, "cpu", ordered=True)


def _paged_sources(rng: random.Random, num_slots: int, pages: tuple) -> tuple:
    """Packed-row sources of the given page sizes (a power of two or not) and random read lengths; the
    last one lacks its last rows (the slots past them are out of its range)."""
    out = []
    for k, page in enumerate(pages):
        read = 16 * rng.randint(1, 12)
        nbpt = read + 16 * rng.choice((0, 1, 4))
        rows = -(-num_slots // page) - (2 if k == len(pages) - 1 else 0)
        raw = torch.randint(0, 256, (rows, page * nbpt + 16 * rng.choice((0, 2))), dtype=torch.uint8)
        out.append(kv_canary.RealKvSource(tensor=raw[:, : page * nbpt], page_size=page, num_bytes_per_token=nbpt,
                                          read_bytes=read))
    return tuple(out)


@pytest.mark.parametrize("pages", [(1,), (3,), (4, 16), (1, 5, 2), (8, 1, 3, 2)])
@pytest.mark.parametrize("mode", ["ALL", "PARTIAL"])
def test_block_paths_match_the_reference(backend, pages, mode):
    """kvc_cpu.h hashes and checks whole blocks of entries at once (32 slots' fingerprints, 8 entries'
    checks in vector lanes) and reads the sources through a view computed per launch (a comparison
    for the range, a shift where the page size is a power of two): long launches over 1-4 sources of
    any page size, clean blocks and blocks with every kind of finding, on one and on two threads."""
    rng = random.Random(f"{pages} {mode}")  # a str seed: the same case in every process
    backend.set_threads(rng.choice((1, 2)), grain=256)
    tree = kv_canary.generated
    n = 700 + rng.randrange(64)
    num_slots = n + 40
    sources = _paged_sources(rng, num_slots, pages)
    ctx = kv_canary.allocate_context(num_slots=num_slots, ring_capacity=256, device="cpu", real_kv_sources=sources,
                                     real_kv_hash_mode=getattr(kv_canary.RealKvHashMode, mode))
    slots = torch.randperm(num_slots - 1)[:n] + 1
    reqs = 7
    plan = kv_canary.WritePlan.allocate(write_req_capacity=reqs, device="cpu")
    plan.write_offsets.copy_(torch.tensor([0] + sorted(rng.sample(range(1, n), reqs - 1)) + [n]))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(reqs)
    locs = slots.clone()
    for i in rng.sample(range(n), 30):  # skipped tokens and slots past the buffer or a source
        locs[i] = rng.choice((-1, num_slots, num_slots + 7, -5))
    write = dict(context=ctx, plan=plan, input_ids=torch.randint(0, 1000, (n,)), positions=torch.arange(n),
                 out_cache_loc=locs, enable_write_input_assert=False, expected_input_tokens=None,
                 expected_input_positions=None)
    compare(tree, "write", write, "cpu", ordered=True)
    kv_canary.launch_canary_write_kernel(**write, backend="torch")
    words = ctx.canary_buf.view(torch.int64)
    for s in rng.sample(slots.tolist(), 25):  # findings in some blocks, none in others
        field = rng.choice((kv_canary.CANARY_FIELD_TOKEN, kv_canary.CANARY_FIELD_POSITION,
                            kv_canary.CANARY_FIELD_PREV_HASH, kv_canary.CANARY_FIELD_REAL_KV_HASH))
        words[s, field] += 1
    for _ in range(10):
        scenarios.flip_source_byte(rng, sources, rng.choice(slots.tolist()))
    vplan = kv_canary.VerifyPlan.allocate(verify_capacity=n, device="cpu")
    vplan.verify_slot_indices.copy_(slots)
    vplan.verify_prev_slot_indices[0] = -1
    vplan.verify_prev_slot_indices[1:] = slots[:-1]
    for i in rng.sample(range(n), 20):  # padding, slots and prevs out of range, chain heads
        vplan.verify_slot_indices[i] = rng.choice((0, num_slots, -3))
        vplan.verify_prev_slot_indices[rng.randrange(n)] = rng.choice((0, -1, num_slots + 1))
    vplan.verify_expected_positions.copy_(torch.arange(n))
    vplan.verify_expected_tokens.copy_(torch.where(torch.rand(n) < 0.5, write["input_ids"], torch.full((n,), -1)))
    vplan.verify_num_valid.fill_(n)
    for check_token in (False, True):
        compare(tree, "verify", dict(context=ctx, plan=vplan, check_verify_expected_token=check_token), "cpu",
                ordered=True)


def test_cpu_tensors_run_the_cpu_backend_by_default(monkeypatch):
    monkeypatch.delenv(runtime_module.ENV_BACKEND, raising=False)
    rt = scenarios.runtime_for(kv_canary.generated)
    assert rt.backend_for(None, torch.device("cpu")).name == "cpu"
    assert rt.backend_for("torch", torch.device("cpu")).name == "torch"
    monkeypatch.setenv(runtime_module.ENV_BACKEND, "torch")
    assert rt.backend_for(None, torch.device("cpu")).name == "torch"


def test_without_a_compiler_the_reference_runs_after_one_warning(monkeypatch):
    """A runtime whose cpu backend cannot be built warns once, naming the cause, and runs the torch
    reference (its results are the reference's); naming backend='cpu' is an error that says why."""
    monkeypatch.delenv(runtime_module.ENV_BACKEND, raising=False)
    real = runtime_module.get_backend

    def no_cpu(name, tree):
        if name == "cpu":
            raise ValueError("kv-canary: backend 'cpu' is not available: kv-canary: the cpu backend needs a C++ "
                             "compiler (CXX or g++ on PATH), found no 'g++'")
        return real(name, tree)
    monkeypatch.setattr(runtime_module, "get_backend", no_cpu)
    rt = scenarios.CaseLaunches(kv_canary.generated, runtime_module.Runtime(kv_canary.generated))  # nothing decided yet
    case = scenarios.make_verify_case(random.Random(3), kv_canary.generated)
    want = scenarios.clone_case(case)
    scenarios.runtime_for(kv_canary.generated).launch_canary_verify_kernel(**want, backend="torch")
    got = scenarios.clone_case(case)
    with pytest.warns(RuntimeWarning, match=r"^kv-canary: backend 'cpu' is not available: .*found no 'g\+\+'; "
                                            r"CPU tensors run on the torch reference instead"):
        rt.launch_canary_verify_kernel(**got)
    scenarios.compare_state(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        rt.launch_canary_verify_kernel(**scenarios.clone_case(case))
        assert rt.use_torch_reference("cpu") is True
    with pytest.raises(ValueError, match="^kv-canary: backend 'cpu' is not available"):
        rt.launch_canary_verify_kernel(**scenarios.clone_case(case), backend="cpu")


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv(cpu_build.ENV_CXX, "kv-canary-no-such-compiler")
    cpu_build.compiler.cache_clear()
    try:
        with pytest.raises(cpu_build.CpuBuildError, match="^kv-canary: the cpu backend needs a C\\+\\+ compiler "
                                                          "\\(CXX or g\\+\\+ on PATH\\), found no "
                                                          "'kv-canary-no-such-compiler'$"):
            cpu_build.build_library(kv_canary.generated)
    finally:
        monkeypatch.undo()
        cpu_build.compiler.cache_clear()


def test_an_operation_whose_kernel_has_no_cpu_loop_runs_the_torch_reference(backend, monkeypatch):
    """A kernel the cpu library does not hold (its operation has no kvc_cpu.h loop yet:
    codegen/operations.py KernelTemplateSpec.cpu) is not launched: every operation that launches it
    runs the torch reference, with the same end state; the other operations stay native."""
    from kv_canary.launch.operations import PLAN, SCATTER, WRITE
    tree, rt = kv_canary.generated, scenarios.runtime_for(kv_canary.generated).runtime
    rng = random.Random(11)
    scatter = scenarios.make_scatter_case(rng, tree, n_reqs=3)
    plan = scenarios.make_plan_case(rng, tree, n_reqs=3)
    write = scenarios.make_write_case(rng, tree, n_reqs=2)
    assert SCATTER.prepare(rt, "cpu", scenarios.clone_case(scatter)).launches  # held: its kernel runs
    monkeypatch.setattr(backend, "native", backend.native - {"scatter", "plan_entries"})
    assert SCATTER.prepare(rt, "cpu", scenarios.clone_case(scatter)).launches == ()  # the torch reference
    assert PLAN.prepare(rt, "cpu", scenarios.clone_case(plan)).launches == ()  # one of its two stages is missing
    assert WRITE.prepare(rt, "cpu", scenarios.clone_case(write)).launches
    compare(tree, "scatter", scatter, "cpu", ordered=True)
    compare(tree, "plan", plan, "cpu", ordered=True)
    compare(tree, "write", write, "cpu", ordered=True)


def _continuing_write(rng: random.Random, fault: str, threads: int) -> dict:
    """A large write continuing chains an earlier launch wrote (seeds, the position assert on), with
    requests of 1 to thousands of tokens, seeds that the next request of the launch stores, and
    `fault`: none (the position assert on or off), or what the write must report or order: a slot
    stored twice (by one request, or by the two requests where two of `threads` threads' shares meet,
    the later one's store first in time), a position or an input not as expected, one or every seed
    out of range, a slot out of range."""
    tree = kv_canary.generated
    reqs = 2500 if fault == "every seed out of range" else 40  # a row per request: more than a block of rows
    # long requests where a thread's share must outlast the start of the next thread, or rows must fill a block
    long = {"slots twice far apart": (8000, 16000), "every position": (2000, 3000)}.get(fault, (100, 300))
    lengths = [1 if reqs > 40 else rng.choice((1, 1, 2, rng.randint(3, 40), rng.randint(*long)))
               for _ in range(reqs)]
    n = sum(lengths)
    num_slots = 2 * n + reqs + 64
    sources = scenarios.make_sources(rng, tree, num_slots, count=2)
    ctx = kv_canary.allocate_context(num_slots=num_slots, ring_capacity=64, device="cpu", real_kv_sources=sources,
                                     real_kv_hash_mode=kv_canary.RealKvHashMode.ALL)
    ctx.enable_chain_position_assert.fill_(int(fault != "none, no position assert"))
    order = (torch.randperm(num_slots - 1) + 1).tolist()
    seeds, fresh = order[:reqs], order[reqs:reqs + n]
    first = kv_canary.WritePlan.allocate(write_req_capacity=reqs, device="cpu")  # one token per request
    first.write_offsets.copy_(torch.arange(reqs + 1))
    first.write_seed_slot_indices.fill_(-1)
    first.write_num_valid_reqs.fill_(reqs)
    kv_canary.launch_canary_write_kernel(context=ctx, plan=first, input_ids=torch.randint(0, 1000, (reqs,)),
                                         positions=torch.zeros(reqs, dtype=torch.int64),
                                         out_cache_loc=torch.tensor(seeds), enable_write_input_assert=False,
                                         backend="torch")
    plan = kv_canary.WritePlan.allocate(write_req_capacity=reqs, device="cpu")
    plan.write_offsets.copy_(torch.tensor([0] + lengths).cumsum(0))
    plan.write_seed_slot_indices.copy_(torch.tensor(seeds))
    plan.write_num_valid_reqs.fill_(reqs)
    locs = torch.tensor(fresh)
    starts = plan.write_offsets.tolist()
    for k in range(reqs - 1):  # request k+1's first token stores request k's seed, after request k read it
        locs[starts[k + 1]] = seeds[k]
    positions = torch.cat([torch.arange(1, k + 1) for k in lengths])
    tokens = torch.randint(0, 1000, (n,))
    expected_tokens, expected_positions = tokens.clone(), positions.clone()
    i = rng.randrange(1, n - 1)
    if fault == "slot twice in a request":
        j = rng.choice([k for k in range(1, n) if k not in starts])
        locs[j] = locs[j - 1]
    elif fault == "slots twice far apart":  # by the two requests where the threads' shares meet
        for part in ([n * t // threads for t in range(1, threads)] or [n // 2]):
            b = next(k for k in starts if k >= part)  # the first request of a share
            locs[b - 1] = locs[b]
    elif fault == "position":
        positions[i] += 5
    elif fault == "every position":  # a row for every token of the longest request: more than a block of rows
        r = max(range(reqs), key=lambda k: lengths[k])
        positions[starts[r]:starts[r + 1]] = 1
    elif fault == "input":
        expected_tokens[i] += 1
    elif fault == "seed out of range":
        plan.write_seed_slot_indices[rng.randrange(reqs)] = num_slots + 2
    elif fault == "every seed out of range":
        plan.write_seed_slot_indices.copy_(num_slots + 2 + torch.arange(reqs))  # rows that differ: in order
    elif fault == "slot out of range":
        locs[i] = num_slots
    asserted = fault in ("none", "input")  # the input assert on, clean or not
    return dict(context=ctx, plan=plan, input_ids=tokens, positions=positions, out_cache_loc=locs,
                enable_write_input_assert=asserted, expected_input_tokens=expected_tokens if asserted else None,
                expected_input_positions=expected_positions if asserted else None)


@pytest.mark.parametrize("fault", ["none", "none, no position assert", "slot twice in a request",
                                   "slots twice far apart", "position", "every position", "input",
                                   "seed out of range", "every seed out of range", "slot out of range"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_writes_split_over_threads_match_the_reference(backend, threads, fault):
    """kvc_cpu.h's write of independent chains (chains_independent) folds them apart and stores its
    requests on every thread (store_in_order): each thread a share of the requests, its rows through a
    private ring appended in share order, a slot two shares store making the launch store again in
    order on one thread. The reference's end state with each fault, on one, two and three threads."""
    backend.set_threads(threads, grain=64)
    rng = random.Random(f"{threads} {fault}")  # a str seed: the same case in every process
    compare(kv_canary.generated, "write", _continuing_write(rng, fault, threads), "cpu", ordered=True)
