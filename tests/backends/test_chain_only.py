"""bench/chain_only.cu, the chain-only kernel the GPU benchmark times a prefill write against, run in
emulation (g++ and the host shim, like the generated kernels): its final link is the reference
write's last link for the same tokens and positions (chained input fields 0)."""
from __future__ import annotations

import ctypes
import importlib
import shutil
import subprocess

import pytest
import torch
from kv_canary.codegen.load import load_schema
from support import scenarios
from support.trees import DEFAULT_SCHEMA, EXAMPLE_SCHEMAS, ROOT, generate_tree

import kv_canary
from kv_canary.trees.emulation_build import CXX_FLAGS, INCLUDE_DIRS, compiler
from kv_canary.trees.sources import tree_dir

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

SOURCE = ROOT / "bench" / "chain_only.cu"
KERNEL = "kv_canary_chain_only"
# One block of one warp, as the benchmark launches it; returns the shim's status (0: ran).
LAUNCHER = f"""#include "cuda_host_shim.h"
#include "{SOURCE.name}"
extern "C" __attribute__((visibility("default"))) int run(const long long* ids, const long long* pos, long long n,
                                                          long long* out) {{
  return kvc_emu::launch(kvc_emu::LaunchConfig{{1, 1, 1, 32, 1, 1}}, [&] {{ {KERNEL}(ids, pos, n, out); }});
}}
"""


def _folds_more_than_token_and_position(schema_path) -> bool:
    return len(load_schema(schema_path).canary.chain.fold) > 2


# The default schema, and the example schemas whose chain folds an input field (0 here) too.
SCHEMAS = [DEFAULT_SCHEMA, *(p for p in EXAMPLE_SCHEMAS if _folds_more_than_token_and_position(p))]


@pytest.fixture(scope="module", params=SCHEMAS, ids=lambda p: p.stem)
def tree(request):
    return kv_canary.generated if request.param == DEFAULT_SCHEMA else generate_tree(request.param)


@pytest.fixture(scope="module")
def chain_only(tree, tmp_path_factory):
    """The chain-only kernel built against the tree's generated header, as a Python callable."""
    out = tmp_path_factory.mktemp("chain_only")
    (out / "launcher.cpp").write_text(LAUNCHER, encoding="utf-8")
    cmd = [compiler()[0], *CXX_FLAGS, *(f"-I{d}" for d in INCLUDE_DIRS), f"-I{SOURCE.parent}", f"-I{tree_dir(tree) / 'cuda'}",
           str(out / "launcher.cpp"), "-o", str(out / "chain_only.so")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"g++ could not build {SOURCE.name}:\n{proc.stderr}"
    run = ctypes.CDLL(str(out / "chain_only.so")).run
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]

    def final_link(ids: torch.Tensor, pos: torch.Tensor) -> int:
        result = torch.zeros(1, dtype=torch.int64)
        assert run(ids.data_ptr(), pos.data_ptr(), ids.numel(), result.data_ptr()) == 0
        return int(result[0])
    return final_link


def reference_final_link(tree, ids: torch.Tensor, pos: torch.Tensor) -> int:
    """The torch reference writes one request of these entries from the chain head to slots
    1..n; the link of slot n's record is the chain's final link (the head when n == 0)."""
    n = ids.numel()
    if n == 0:
        return tree.layout.to_signed64(tree.layout.CANARY_CHAIN_HEAD)
    alloc = tree.allocators
    ref = importlib.import_module(tree.__name__ + ".reference")
    ctx = alloc.allocate_context(num_slots=n + 1, ring_capacity=4, device="cpu")
    plan = alloc.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets.copy_(torch.tensor([0, n]))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(1)
    scenarios.runtime_for(tree).launch_canary_write_kernel(
        context=ctx, plan=plan, input_ids=ids, positions=pos, out_cache_loc=torch.arange(1, n + 1),
        enable_write_input_assert=False,
        extra_inputs={f.name: torch.zeros(n, dtype=torch.int64) for f in tree.layout.INPUT_FIELDS}, backend="torch")
    records = ctx.canary_buf.view(torch.int64)[:, :tree.layout.CANARY_FIELDS_PER_SLOT]
    return int(ref.link_t(records[n:n + 1])[0])


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 48, 1000])
def test_final_link_is_the_reference_writes(tree, chain_only, n):
    """Lengths around the kernel's 16-entry load batches: none, a partial one, whole ones, both."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(-(1 << 63), (1 << 63) - 1, (n,), dtype=torch.int64, generator=gen)  # any u64 bit pattern
    pos = torch.randint(-5, 1 << 20, (n,), dtype=torch.int64, generator=gen)
    assert chain_only(ids, pos) == reference_final_link(tree, ids, pos)
