"""[extension] PARTIAL mode reads the first REAL_KV_PARTIAL_READ_BYTES bytes of a slot (issue 32,
finding 1). SGLang's constant (16) never exceeds a valid source's bytes per slot (a positive
multiple of 16); a schema may choose more, and then a source with fewer bytes per slot is refused
before any launch, naming the source: the kernels would read past the slot (and past the tensor for
its last slot: ASan's heap-buffer-overflow in the emulated fingerprint, an IndexError in the torch
reference). A source at the limit reads exactly its slot."""
from __future__ import annotations

import dataclasses
import functools
import shutil
from types import SimpleNamespace

import pytest
import torch
from support import scenarios
from support.trees import default_schema_text, generate_tree, scratch_dir

PARTIAL = 64
BACKENDS = ("torch", pytest.param("emulated", marks=pytest.mark.skipif(shutil.which("g++") is None,
                                                                       reason="g++ not installed")))


@functools.cache
def wide_partial_tree():
    old = "REAL_KV_PARTIAL_READ_BYTES: {type: i32, value: 16,"
    text = default_schema_text()
    assert text.count(old) == 1, "kernels.yaml must declare REAL_KV_PARTIAL_READ_BYTES = 16 once"
    path = scratch_dir("kv_canary_partial_") / "partial64.yaml"
    path.write_text(text.replace(old, f"REAL_KV_PARTIAL_READ_BYTES: {{type: i32, value: {PARTIAL},"), encoding="utf-8")
    return generate_tree(path)


def write(rt, ctx, n: int, backend: str) -> None:
    plan = rt.allocators.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets[:2] = torch.tensor([0, n])
    plan.write_seed_slot_indices[0] = -1
    plan.write_num_valid_reqs[0] = 1
    ids = torch.arange(n, dtype=torch.int64)
    rt.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=ids, positions=ids.clone(), out_cache_loc=ids.clone(),
                                  enable_write_input_assert=False, expected_input_tokens=None,
                                  expected_input_positions=None, backend=backend)


def refusal(i: int, n: int) -> str:
    return (f"kv-canary: real_kv_hash_mode PARTIAL reads the first {PARTIAL} bytes of a slot, but "
            f"real_kv_sources[{i}].num_bytes_per_token is {n}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_source_with_fewer_bytes_per_slot_than_partial_reads_is_refused(backend):
    tree = wide_partial_tree()
    rt, A = scenarios.runtime_for(tree), scenarios.runtime_for(tree).allocators
    mode = tree.layout.RealKvHashMode
    ok = A.RealKvSource(tensor=torch.zeros((8, 64), dtype=torch.uint8), page_size=1, num_bytes_per_token=64, read_bytes=64)
    short = A.RealKvSource(tensor=torch.zeros((8, 16), dtype=torch.uint8), page_size=1, num_bytes_per_token=16,
                           read_bytes=16)
    with pytest.raises(ValueError) as exc:  # allocate_context checks its sources before allocating
        A.allocate_context(num_slots=8, ring_capacity=4, device="cpu", real_kv_sources=(ok, short),
                           real_kv_hash_mode=mode.PARTIAL)
    assert str(exc.value) == refusal(1, 16)
    ctx = A.allocate_context(num_slots=8, ring_capacity=4, device="cpu", real_kv_sources=(ok, short),
                             real_kv_hash_mode=mode.ALL)  # ALL reads read_bytes: fine
    for context in (dataclasses.replace(ctx, real_kv_hash_mode=mode.PARTIAL),  # a frozen context, built unchecked
                    SimpleNamespace(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)} |
                                    dict(real_kv_hash_mode=int(mode.PARTIAL))),
                    dataclasses.replace(ctx, real_kv_hash_mode=mode.PARTIAL, real_kv_sources=(SimpleNamespace(
                        tensor=short.tensor, page_size=1, num_bytes_per_token=16, read_bytes=16),))):
        with pytest.raises(ValueError) as exc:
            write(rt, context, 8, backend)
        assert str(exc.value) == refusal(len(context.real_kv_sources) - 1, 16)
    assert int(ctx.kernel_run_counter[0]) == 0  # nothing was launched


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_source_at_the_partial_limit_reads_exactly_its_slot(backend):
    """num_bytes_per_token == REAL_KV_PARTIAL_READ_BYTES: PARTIAL reads every byte of the slot, up to
    the tensor's last byte, and fingerprints like ALL with read_bytes = 64."""
    tree = wide_partial_tree()
    rt = scenarios.runtime_for(tree)
    A, mode = rt.allocators, tree.layout.RealKvHashMode
    data = torch.randint(0, 256, (8, PARTIAL), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src = A.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=PARTIAL, read_bytes=16)
    words = []
    for m, s in ((mode.PARTIAL, src), (mode.ALL, dataclasses.replace(src, read_bytes=PARTIAL)),
                 (mode.ALL, src)):
        ctx = A.allocate_context(num_slots=8, ring_capacity=4, device="cpu", real_kv_sources=(s,), real_kv_hash_mode=m)
        write(rt, ctx, 8, backend)
        words.append(ctx.canary_buf.view(torch.int64)[:, tree.layout.CANARY_KV_FINGERPRINT_WORD].tolist())
    assert words[0] == words[1] != words[2]
