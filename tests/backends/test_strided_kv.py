"""Real-K/V fingerprints read where the engines keep K and V (RealKvSource's layout fields,
kv_canary.engine.contract.KvLayout), on the torch reference and the emulated kernels.

The same logical K/V (blocks of `block_size` slots, each slot `heads` x `head_dim` elements) is stored
the way vLLM's CPU backend (V per head, K element-transposed or in 16-byte x-chunks), FlashAttention
and FlashInfer's HND layout store it, each read in place through its layout; its fingerprints must
equal those of the same bytes packed in SGLang's rows, and the scalar oracle's (which gathers the
layout byte by byte). Which stored element holds a logical one is said here by torch's own indexing
of each layout's tensor (`stored_index`), never by the layout formula.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from support import scenarios
from support.oracle import Oracle
from support.write_shapes import write_shape_tree

import kv_canary
from kv_canary.engine.contract import KvLayout

P = "kv-canary: "
L = kv_canary.generated.layout
MODES = {"ALL": L.RealKvHashMode.ALL, "PARTIAL": L.RealKvHashMode.PARTIAL}
LAYOUTS = ("vllm_v", "vllm_k_elements", "vllm_k_x", "vllm_k_amx", "tiled_rows", "flash_attn_k", "flash_attn_v",
           "flashinfer_hnd_k", "flashinfer_hnd_v")
# vLLM CPU's K on AMX keeps a block's tokens in tiles (16 tokens there; 2 in these 4-slot blocks) of
# 4-byte runs of a head's elements.
AMX_TILE_TOKENS, AMX_RUN_BYTES = 2, 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_OF = {2: torch.int16, 4: torch.int32}
NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 4, 16
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
# The emulated kernels: the default write (per-warp cooperative fingerprint, as the verify's) and
# the per_request write (one thread per fingerprint).
BACKENDS = ("torch", pytest.param("emulated", marks=needs_gxx), pytest.param("emulated-per-request", marks=needs_gxx),
            pytest.param("cpu", marks=needs_gxx))


def make_kv(dtype: torch.dtype, heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical K and V, [blocks, block_size, heads, head_dim], random bits."""
    g = torch.Generator().manual_seed(seed)
    es = torch.empty(0, dtype=dtype).element_size()
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, heads, HEAD_DIM * es)
    k, v = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype).unbind(0)
    return k, v


def stored(name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, KvLayout, torch.Tensor]:
    """(the tensor an engine keeps, its layout, the logical tensor it holds) for layout `name`."""
    nb, bs, heads, hd = k.shape
    es = k.element_size()
    if name == "vllm_v":        # vLLM CPU V per layer: [num_blocks, kv_heads, block_size, head_dim]
        return v.permute(0, 2, 1, 3).contiguous(), KvLayout.heads_major(block_size=bs, num_heads=heads,
                                                                         head_bytes=hd * es), v
    if name == "vllm_k_elements":  # K transposed per (block, head): [head_dim, block_size]
        return k.permute(0, 2, 3, 1).contiguous(), KvLayout.transposed(block_size=bs, num_heads=heads, head_dim=hd,
                                                                       element_size=es), k
    if name == "vllm_k_x":      # paged-attention K: [head_dim / x, block_size, x], x = 16 bytes / element
        x = 16 // es
        t = k.reshape(nb, bs, heads, hd // x, x).permute(0, 2, 3, 1, 4).contiguous()
        return t, KvLayout.paged_x(block_size=bs, num_heads=heads, head_dim=hd, element_size=es), k
    if name == "vllm_k_amx":    # [heads, block_size / T, head_dim / r, T, r]: T tokens per tile, r elements per run
        tt, r = AMX_TILE_TOKENS, AMX_RUN_BYTES // es
        t = k.reshape(nb, bs // tt, tt, heads, hd // r, r).permute(0, 3, 1, 4, 2, 5).contiguous()
        return t, KvLayout.token_tiles(block_size=bs, num_heads=heads, head_dim=hd, element_size=es,
                                       tile_tokens=tt, run_bytes=AMX_RUN_BYTES), k
    if name == "tiled_rows":    # [blocks, block_size / T, T slots + a 16-byte gap]: whole slots in token groups
        tt, gap = AMX_TILE_TOKENS, 16 // es
        t = torch.zeros((nb, bs // tt, tt * heads * hd + gap), dtype=k.dtype)
        t[:, :, :tt * heads * hd] = k.reshape(nb, bs // tt, tt * heads * hd)
        return t, KvLayout(token_stride_bytes=heads * hd * es, num_heads=heads,
                           head_stride_bytes=hd * es if heads > 1 else 0, token_group_size=tt,
                           token_group_stride_bytes=(tt * heads * hd + gap) * es), k
    if name.startswith("flash_attn"):  # [2, num_blocks, block_size, heads, head_dim]
        kv = torch.stack([k, v])
        return (kv[0], KvLayout.rows(heads * hd * es), k) if name.endswith("k") else \
            (kv[1], KvLayout.rows(heads * hd * es), v)
    if name.startswith("flashinfer_hnd"):  # [num_blocks, 2, heads, block_size, head_dim]
        kv = torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=1)
        half = 0 if name.endswith("k") else 1
        return kv[:, half], KvLayout.heads_major(block_size=bs, num_heads=heads, head_bytes=hd * es), \
            (k if half == 0 else v)
    raise AssertionError(name)


def stored_index(name: str, blk: int, tok: int, head: int, i: int, es: int, heads: int = 2) -> tuple:
    """The index of logical element (block, slot in block, head, element) in layout `name`'s tensor
    (`heads` per slot)."""
    if name == "tiled_rows":
        return blk, tok // AMX_TILE_TOKENS, (tok % AMX_TILE_TOKENS * heads + head) * HEAD_DIM + i
    if name in ("vllm_v", "flashinfer_hnd_k", "flashinfer_hnd_v"):
        return blk, head, tok, i
    if name == "vllm_k_elements":
        return blk, head, i, tok
    if name == "vllm_k_x":
        x = 16 // es
        return blk, head, i // x, tok, i % x
    if name == "vllm_k_amx":
        r = AMX_RUN_BYTES // es
        return blk, head, tok // AMX_TILE_TOKENS, i // r, tok % AMX_TILE_TOKENS, i % r
    return blk, tok, head, i


def tree_of(backend: str):
    return write_shape_tree("per_request", 256) if backend == "emulated-per-request" else kv_canary.generated


def source(tensor: torch.Tensor, layout: KvLayout | None, nbpt: int, read_bytes: int | None = None, *,
           backend: str = "torch"):
    """A RealKvSource of the backend's tree (None layout: SGLang's packed rows)."""
    fields = {} if layout is None else dataclasses.asdict(layout)
    return scenarios.runtime_for(tree_of(backend)).allocators.RealKvSource(
        tensor=tensor, page_size=BLOCK_SIZE, num_bytes_per_token=nbpt,
        read_bytes=nbpt if read_bytes is None else read_bytes, **fields)


def rows_of(logical: torch.Tensor) -> torch.Tensor:
    """The same logical bytes in SGLang's packed rows: [blocks, block_size x slot bytes]."""
    return logical.reshape(logical.shape[0], -1).contiguous()


def fingerprints(src, mode, backend: str) -> list[int]:
    """The real_kv_hash a write of every slot stores (one request), through the public launch."""
    tree = tree_of(backend)
    rt = scenarios.runtime_for(tree)
    A = rt.allocators
    n = NUM_BLOCKS * BLOCK_SIZE
    ctx = A.allocate_context(num_slots=n, ring_capacity=4, device="cpu", real_kv_sources=(src,), real_kv_hash_mode=mode)
    plan = A.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets[:2] = torch.tensor([0, n])
    plan.write_seed_slot_indices[0] = -1
    plan.write_num_valid_reqs[0] = 1
    ids = torch.arange(n, dtype=torch.int64)
    rt.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=ids, positions=ids.clone(),
                                  out_cache_loc=ids.clone(), enable_write_input_assert=False,
                                  expected_input_tokens=None, expected_input_positions=None,
                                  backend=backend.split("-")[0])
    assert int(ctx.violation_write_index[0]) == 0
    return ctx.canary_buf.view(torch.int64)[:, tree.layout.CANARY_KV_FINGERPRINT_WORD].tolist()


def oracle_fingerprints(src, mode) -> list[int]:
    oracle, cache = Oracle(kv_canary.generated), {}
    out = []
    for slot in range(NUM_BLOCKS * BLOCK_SIZE):
        fp, bad = oracle.fingerprint((src,), mode, slot, cache)
        assert not bad
        out.append(fp - (1 << 64) if fp >= 1 << 63 else fp)
    return out


# -- the same logical bytes, any storage: the same fingerprints -------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads", (1, 3))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_fingerprints_like_the_same_bytes_in_rows(name, dtype, heads, mode, backend):
    k, v = make_kv(dtype, heads)
    t, layout, logical = stored(name, k, v)
    nbpt = heads * HEAD_DIM * k.element_size()
    strided = source(t, layout, nbpt, backend=backend)
    want = fingerprints(source(rows_of(logical), None, nbpt, backend=backend), MODES[mode], backend)
    assert fingerprints(strided, MODES[mode], backend) == want
    assert oracle_fingerprints(strided, MODES[mode]) == want
    assert len(set(want)) == len(want)  # every slot's bytes differ: a wrong slot would show


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_read_bytes_below_a_slot_reads_its_first_logical_bytes(name, backend):
    """ALL with read_bytes < num_bytes_per_token: the first read_bytes logical bytes (here head 0
    and half of head 1), whatever the storage."""
    k, v = make_kv(torch.bfloat16, 3, seed=1)
    t, layout, logical = stored(name, k, v)
    nbpt, read = 3 * HEAD_DIM * 2, HEAD_DIM * 2 + 16
    want = fingerprints(source(rows_of(logical), None, nbpt, read, backend=backend), MODES["ALL"], backend)
    assert fingerprints(source(t, layout, nbpt, read, backend=backend), MODES["ALL"], backend) == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_flipped_byte_in_any_head_or_chunk_changes_that_slot_only(name, backend):
    heads, dtype = 2, torch.float16
    k, v = make_kv(dtype, heads, seed=2)
    t, layout, logical = stored(name, k, v)
    es = k.element_size()
    nbpt = heads * HEAD_DIM * es
    src = source(t, layout, nbpt, backend=backend)
    before = fingerprints(src, MODES["ALL"], backend)
    ints = t.view(INT_OF[es])
    x = 16 // es
    blk, tok = 2, 3
    slot = blk * BLOCK_SIZE + tok
    for head in range(heads):
        for i in (0, x - 1, x, HEAD_DIM - 1):  # the first and last element of a 16-byte chunk, the next chunk, the last
            for bit in (0, 8 * es - 1):         # the element's first and last byte
                at = stored_index(name, blk, tok, head, i, es)
                ints[at] ^= torch.tensor(1 << bit, dtype=torch.int64).to(ints.dtype)
                after = fingerprints(src, MODES["ALL"], backend)
                assert [j for j in range(len(after)) if after[j] != before[j]] == [slot], (head, i, bit)
                flipped = logical.clone()
                flipped.view(INT_OF[es])[blk, tok, head, i] ^= torch.tensor(1 << bit, dtype=torch.int64).to(ints.dtype)
                assert after == fingerprints(source(rows_of(flipped), None, nbpt, backend=backend), MODES["ALL"],
                                             backend)
                ints[at] ^= torch.tensor(1 << bit, dtype=torch.int64).to(ints.dtype)
    assert fingerprints(src, MODES["ALL"], backend) == before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ("vllm_k_elements", "vllm_k_x", "vllm_k_amx", "tiled_rows", "flashinfer_hnd_v"))
def test_verify_reads_the_layout_as_the_write_stored_it(name, backend):
    """A verify of every slot after the write: silent; after one flipped element: that slot's
    VERIFY_REAL_KV_HASH_MISMATCH row (the verify kernel's own, per-warp, fingerprint path)."""
    tree = tree_of(backend)
    rt = scenarios.runtime_for(tree)
    A, n = rt.allocators, NUM_BLOCKS * BLOCK_SIZE
    k, v = make_kv(torch.float32, 2, seed=3)
    t, layout, _ = stored(name, k, v)
    src = source(t, layout, 2 * HEAD_DIM * 4, backend=backend)
    ctx = A.allocate_context(num_slots=n, ring_capacity=8, device="cpu", real_kv_sources=(src,),
                             real_kv_hash_mode=MODES["ALL"])
    wplan = A.WritePlan.allocate(write_req_capacity=1, device="cpu")
    wplan.write_offsets[:2] = torch.tensor([0, n])
    wplan.write_seed_slot_indices[0] = -1
    wplan.write_num_valid_reqs[0] = 1
    ids = torch.arange(n, dtype=torch.int64)
    rt.launch_canary_write_kernel(context=ctx, plan=wplan, input_ids=ids, positions=ids.clone(), out_cache_loc=ids.clone(),
                                  enable_write_input_assert=False, expected_input_tokens=None,
                                  expected_input_positions=None, backend=backend.split("-")[0])
    vplan = A.VerifyPlan.allocate(verify_capacity=n - 1, device="cpu")
    vplan.verify_slot_indices.copy_(ids[1:])
    vplan.verify_expected_positions.copy_(ids[1:])
    vplan.verify_prev_slot_indices.copy_(ids[:-1])  # slot 1's prev is slot 0: unreachable, no chain check
    vplan.verify_num_valid[0] = n - 1

    def verify() -> list:
        before = int(ctx.violation_write_index[0])
        rt.launch_canary_verify_kernel(context=ctx, plan=vplan, check_verify_expected_token=False,
                                       backend=backend.split("-")[0])
        rows = ctx.violation_ring[before:int(ctx.violation_write_index[0])]
        return [(int(r[L.VIOLATION_COL_SLOT]), int(r[L.VIOLATION_COL_FAIL_REASON])) for r in rows]

    assert verify() == []
    ints = t.view(torch.int32)
    ints[stored_index(name, 1, 2, 1, HEAD_DIM - 1, 4)] ^= 1 << 30
    assert verify() == [(1 * BLOCK_SIZE + 2, int(L.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))]


# -- configurations no kernel can read are refused, naming the field -------------------------------
def layout_error(field: str, expected: str, got) -> str:
    return P + L.MESSAGES["real_kv_layout"].format(field=field, expected=expected, got=got)


@pytest.mark.parametrize("change, field, expected, got", [
    (dict(num_heads=0), "num_heads", ">= 1 and split num_bytes_per_token=64 into heads of a multiple of 16 bytes", 0),
    (dict(num_heads=3), "num_heads", ">= 1 and split num_bytes_per_token=64 into heads of a multiple of 16 bytes", 3),
    (dict(num_heads=8, head_stride_bytes=16), "num_heads",
     ">= 1 and split num_bytes_per_token=64 into heads of a multiple of 16 bytes", 8),
    (dict(head_stride_bytes=0), "head_stride_bytes", "a positive multiple of 2 (num_heads=2)", 0),
    (dict(head_stride_bytes=-2), "head_stride_bytes", "a positive multiple of 2 (num_heads=2)", -2),
    (dict(head_stride_bytes=3), "head_stride_bytes", "a positive multiple of 2 (num_heads=2)", 3),
    (dict(chunk_bytes=3), "chunk_bytes", "0 (a head's bytes contiguous), 2, 4, 8 or a positive multiple of 16", 3),
    (dict(chunk_bytes=24), "chunk_bytes", "0 (a head's bytes contiguous), 2, 4, 8 or a positive multiple of 16", 24),
    (dict(chunk_bytes=64, token_stride_bytes=16, chunk_stride_bytes=0), "chunk_bytes",
     "a divisor of a head's 32 bytes (num_bytes_per_token / num_heads)", 64),
    (dict(chunk_stride_bytes=1), "chunk_stride_bytes", "a multiple of 2 and >= chunk_bytes=2", 1),
    (dict(chunk_stride_bytes=0), "chunk_stride_bytes", "a multiple of 2 and >= chunk_bytes=2", 0),
    (dict(chunk_bytes=0, chunk_stride_bytes=8, token_stride_bytes=16), "chunk_stride_bytes",
     "0 when chunk_bytes is 0 (a head's bytes contiguous)", 8),
    (dict(token_stride_bytes=0), "token_stride_bytes", "a positive multiple of 2 (the bytes the kernels load at once)", 0),
    (dict(token_stride_bytes=3), "token_stride_bytes", "a positive multiple of 2 (the bytes the kernels load at once)", 3),
    (dict(chunk_bytes=0, chunk_stride_bytes=0, token_stride_bytes=8), "token_stride_bytes",
     "a positive multiple of 16 (the bytes the kernels load at once)", 8),
    (dict(token_group_size=-1), "token_group_size", "0 (no token groups) or a positive number of tokens", -1),
    (dict(token_group_stride_bytes=64), "token_group_stride_bytes", "0 when token_group_size is 0 (no token groups)",
     64),
    (dict(token_group_size=2, token_group_stride_bytes=3), "token_group_stride_bytes", "a non-negative multiple of 2",
     3),
    (dict(chunk_group_size=-2), "chunk_group_size",
     "0 (no chunk groups), or a positive number of chunks when chunk_bytes > 0", -2),
    (dict(chunk_bytes=0, chunk_stride_bytes=0, token_stride_bytes=16, chunk_group_size=2), "chunk_group_size",
     "0 (no chunk groups), or a positive number of chunks when chunk_bytes > 0", 2),
    (dict(chunk_group_stride_bytes=8), "chunk_group_stride_bytes", "0 when chunk_group_size is 0 (no chunk groups)", 8),
    (dict(chunk_group_size=4, chunk_group_stride_bytes=-2), "chunk_group_stride_bytes", "a non-negative multiple of 2",
     -2),
])
def test_a_layout_no_kernel_can_read_is_refused_naming_its_field(change, field, expected, got):
    k, v = make_kv(torch.float16, 2)
    t, layout, _ = stored("vllm_k_elements", k, v)
    with pytest.raises(ValueError) as exc:
        source(t, dataclasses.replace(layout, **change), 2 * HEAD_DIM * 2)
    assert str(exc.value) == layout_error(field, expected, got)


@pytest.mark.parametrize("field, value, text", [
    ("token_stride_bytes", 2**63, "<= 2**63-1 = 9223372036854775807 (the kernels hold it in a C long long)"),
    ("num_heads", 2**31, "<= 2**31-1 = 2147483647 (the kernels hold it in a C int)"),
    ("chunk_bytes", -2**31 - 1, ">= -2**31 = -2147483648 (the kernels hold it in a C int)"),
])
def test_layout_fields_must_fit_the_kernels_c_integers(field, value, text):
    k, v = make_kv(torch.float16, 1)
    with pytest.raises(ValueError) as exc:
        source(rows_of(k), KvLayout(**{"token_stride_bytes": 32, field: value}), HEAD_DIM * 2)
    assert str(exc.value) == P + f"RealKvSource.{field} must be {text}, got {value}"


def test_layout_fields_must_be_ints():
    k, _ = make_kv(torch.float16, 1)
    with pytest.raises(TypeError, match=r"^kv-canary: RealKvSource\.num_heads must be an int, got float$"):
        source(rows_of(k), KvLayout(token_stride_bytes=32, num_heads=1.0), HEAD_DIM * 2)


def test_a_layout_reading_past_the_storage_is_refused():
    """The farthest byte any slot of any row reads, against the tensor's storage: a view of the
    first blocks of a bigger pool may read into the next blocks (inside the storage), a layout whose
    last head lies past the storage may not."""
    k, v = make_kv(torch.float16, 2)
    t, layout, _ = stored("vllm_v", k, v)
    nbpt = 2 * HEAD_DIM * 2
    source(t[:1], dataclasses.replace(layout, head_stride_bytes=layout.head_stride_bytes * 2), nbpt)  # reads block 1
    far = dataclasses.replace(layout, head_stride_bytes=layout.head_stride_bytes * 5)
    with pytest.raises(ValueError) as exc:
        source(t, far, nbpt)
    end = 2 * t.stride(0) * 2 + 3 * layout.token_stride_bytes + far.head_stride_bytes + HEAD_DIM * 2
    assert str(exc.value) == P + L.MESSAGES["real_kv_extent"].format(
        end=end, have=t.numel() * 2, shape=tuple(t.shape), strides=tuple(t.stride()), dtype=t.dtype)
    with pytest.raises(ValueError, match="farthest byte"):
        source(t[1:], dataclasses.replace(layout, head_stride_bytes=layout.head_stride_bytes * 2), nbpt)


def test_the_farthest_byte_of_token_and_chunk_groups_is_checked():
    """With groups, a row's farthest byte is in its last group (or the last full group before a
    short one): the AMX K tiles of this file's blocks fit exactly; one more group stride does not."""
    k, v = make_kv(torch.bfloat16, 2)
    t, layout, _ = stored("vllm_k_amx", k, v)
    nbpt = 2 * HEAD_DIM * 2
    source(t, layout, nbpt)                     # the exact fit: last block, last head, last tile's last run
    wide = dataclasses.replace(layout, token_group_stride_bytes=layout.token_group_stride_bytes * 2)
    with pytest.raises(ValueError, match="farthest byte"):
        source(t, wide, nbpt)
    grouped = dataclasses.replace(layout, chunk_group_size=2, chunk_group_stride_bytes=layout.head_stride_bytes)
    with pytest.raises(ValueError, match="farthest byte"):
        source(t, grouped, nbpt)


def test_a_strided_row_or_address_off_the_load_width_is_refused():
    k, v = make_kv(torch.float16, 2)
    t, layout, _ = stored("vllm_v", k, v)
    raw = torch.zeros(t.numel() * 2 + 8, dtype=torch.uint8)
    odd = raw[8:8 + t.numel() * 2].view(torch.float16).view(t.shape)  # 8-byte aligned, not 16
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource\.tensor data must be 16-byte aligned"):
        source(odd, layout, 2 * HEAD_DIM * 2)
    rows = torch.zeros((NUM_BLOCKS, 2 * BLOCK_SIZE * HEAD_DIM * 2 + 2), dtype=torch.uint8)[:, :-2]
    with pytest.raises(ValueError) as exc:
        source(rows, layout, 2 * HEAD_DIM * 2)
    assert str(exc.value) == layout_error("tensor row stride (stride(0) x element size)", "a multiple of 16 bytes",
                                          rows.stride(0))


def test_a_source_without_layout_fields_reads_packed_rows():
    """A source assembled by hand with SGLang's four fields only (as SGLang's own class): its rows are
    packed, like a RealKvSource built without the layout fields."""
    from types import SimpleNamespace

    k, _ = make_kv(torch.float16, 2)
    nbpt = 2 * HEAD_DIM * 2
    ours = source(rows_of(k), None, nbpt)
    assert (ours.token_stride_bytes, ours.num_heads, ours.head_stride_bytes, ours.chunk_bytes,
            ours.chunk_stride_bytes) == (nbpt, 1, 0, 0, 0)
    bare = SimpleNamespace(tensor=ours.tensor, page_size=BLOCK_SIZE, num_bytes_per_token=nbpt, read_bytes=nbpt)
    for backend in ("torch", *(("emulated",) if shutil.which("g++") else ())):
        assert fingerprints(bare, MODES["ALL"], backend) == fingerprints(ours, MODES["ALL"], backend)


# -- random layouts through the differential cases ----------------------------------------------------
@pytest.mark.parametrize("kind", ("write", "verify"))
def test_random_layouts_match_the_oracle_and_the_host_kernels(kind):
    """Random batches over sources of which about half keep their bytes another way
    (scenarios.layout_source): the torch reference against the scalar oracle, the emulated and the
    cpu kernels against the reference."""
    import random

    from support import budget, kernel_diff, scenarios

    make = getattr(scenarios, f"make_{kind}_case")
    rt = scenarios.runtime_for(kv_canary.generated)
    launch = getattr(rt, f"launch_canary_{kind}_kernel")
    small = dict(n_reqs=4, max_prefix=16, **({"max_extend": 8} if kind == "write" else {}))  # the oracle is slow
    for seed in range(budget.cases(12)):
        case = make(random.Random(seed), kv_canary.generated, layouts=True, **small)
        ref, oracle = scenarios.clone_case(case), scenarios.clone_case(case)
        launch(**ref, backend="torch")
        getattr(Oracle(kv_canary.generated), kind)(**oracle)
        scenarios.compare_state(ref, oracle)
        if shutil.which("g++"):
            kernel_diff.compare(kv_canary.generated, kind, case, "emulated", ordered=kind == "write")
            kernel_diff.compare(kv_canary.generated, kind, case, "cpu", ordered=True)


@needs_gxx
@pytest.mark.parametrize("kind", ("write", "verify"))
def test_random_layouts_on_the_cpu_backend_match_the_reference(kind):
    """More of those batches, larger, for the cpu backend alone (it reads a source that is not one run
    through a list of offsets made per launch, kvc_cpu.h Pieces; kLanes slots at a time)."""
    import random

    from support import budget, kernel_diff, scenarios

    make = getattr(scenarios, f"make_{kind}_case")
    for seed in range(budget.cases(60)):
        case = make(random.Random(1000 + seed), kv_canary.generated, layouts=True)
        kernel_diff.compare(kv_canary.generated, kind, case, "cpu", ordered=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layout_reading_up_to_the_last_byte_of_its_storage(backend):
    """A view of head 0 of a vLLM V pool, read with both heads: the second head lies outside the view,
    inside the storage, up to its last byte (under `make sanitize` any read past it is a finding);
    16 bytes less of storage and the source is refused."""
    k, v = make_kv(torch.float16, 2, seed=4)
    t, layout, logical = stored("vllm_v", k, v)
    nbpt = 2 * HEAD_DIM * 2
    head0 = t[:, :1]                                   # [blocks, 1 head, block_size, head_dim]
    want = fingerprints(source(rows_of(logical), None, nbpt, backend=backend), MODES["ALL"], backend)
    assert fingerprints(source(head0, layout, nbpt, backend=backend), MODES["ALL"], backend) == want
    short = torch.empty(t.numel() - 8, dtype=t.dtype)  # 16 bytes short of the last head's end
    view = short.as_strided(head0.shape, head0.stride())
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource\.tensor is too small for its slot layout"):
        source(view, layout, nbpt, backend=backend)
