"""Random but valid launch cases for differential tests (any backend against any other).

`make_*_case(rng, tree, ...)` return a dict of keyword arguments ready for the launch functions of
`kv_canary.runtime_for(tree)` (every key is a launch keyword). `clone_case` deep-copies a case so
two backends get identical inputs; `case_to(case, device)` moves one; `compare_state(a, b, ...)`
asserts that two cases ended in the same state. `rng` is a `random.Random`.

Shapes: 0-16 requests, prefixes 0-64, extends 0-32, page sizes 1/4/16, 0-4
real-KV sources of 16-256 read bytes (with `layouts=True`, some stored as engines store K/V), every hash mode, SWA on/off (and a LUT without a window),
expected-token pools on/off, small rings that overflow, and corruptions (flipped bits in any field,
swapped slots, shifted positions, flipped real-KV bytes). Write cases keep slots distinct across requests and seeds
outside the batch unless `overlap=True` (a GPU runs requests in parallel, so only then is the
sequential host order observable).
"""
from __future__ import annotations

import dataclasses
import importlib
import random

import torch

import kv_canary

PAGE_SIZES = (1, 4, 16)
LUT_WITHOUT_WINDOW_ODDS = 0.3     # of the full-attention plan cases (2 in 3 of all plan cases)
SOURCE_DTYPES = (torch.uint8, torch.int32, torch.bfloat16, torch.float16, torch.float32)
# A schema's REAL_KV_PARTIAL_READ_BYTES up to this sizes the sources' slots (PARTIAL must not read
# past a slot); a larger one (a fuzzed schema) gets small slots, and then its cases use ALL for PARTIAL.
PARTIAL_SLOT_CAP = 1024


def _mods(tree):
    return (tree.layout, tree.allocators,
            importlib.import_module(tree.__name__ + ".reference"))


def _i64(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _noise(rng: random.Random, lo: int, hi: int, n: int) -> list[int]:
    """n arbitrary values in [lo, hi) from ONE draw of rng: when hypothesis drives rng
    (st.randoms), it then shrinks a case's structure rather than every noise value (and fast)."""
    r = random.Random(rng.getrandbits(64))
    return [r.randrange(lo, hi) for _ in range(n)]


def _rand_i64(rng: random.Random) -> int:
    return rng.choice((rng.randrange(0, 50_000), rng.randrange(-(1 << 63), 1 << 63), -1, 0))


# -- real-KV sources ------------------------------------------------------------------------------------
def make_sources(rng: random.Random, tree, num_slots: int, *, count: int | None = None, short: bool = False,
                 layouts: bool = False) -> tuple:
    """0-4 sources with random dtypes, ranks, page sizes and padded rows; `short` drops the last rows;
    `layouts`: about half of them keep their slots' bytes another way (layout_source). A slot holds
    at least REAL_KV_PARTIAL_READ_BYTES (what PARTIAL reads) where that is at most PARTIAL_SLOT_CAP."""
    _, alloc, _ = _mods(tree)
    align = tree.layout.REAL_KV_LOAD_ALIGN_BYTES
    partial = tree.layout.REAL_KV_PARTIAL_READ_BYTES
    partial = partial if partial <= PARTIAL_SLOT_CAP else align
    count = rng.randint(0, tree.layout.MAX_REAL_KV_SOURCES) if count is None else count
    out = []
    for _ in range(count):
        page = rng.choice(PAGE_SIZES)
        if layouts and rng.random() < 0.5:
            rows = -(-num_slots // page)
            out.append(layout_source(rng, alloc, page, rng.randint(1, rows - 1) if short and rows > 1 else rows,
                                     align, partial))
            continue
        read = align * rng.randint(1, 256 // align)
        nbpt = max(read + align * rng.choice((0, 0, 1, 4)), partial)
        dtype = rng.choice(SOURCE_DTYPES)
        es = torch.empty(0, dtype=dtype).element_size()
        width = page * nbpt + align * rng.choice((0, 0, 1))      # bytes of a row the canary may read
        pitch = width + align * rng.choice((0, 0, 2))            # row stride in bytes (gap after the row)
        rows = -(-num_slots // page)
        if short and rows > 1:
            rows = rng.randint(1, rows - 1)
        raw = torch.randint(0, 256, (rows, pitch), dtype=torch.uint8)
        base = raw.view(dtype)[:, : width // es]
        if rng.random() < 0.5 and (width // es) % page == 0:
            base = base.view(rows, page, width // es // page)     # a [pages, page, ...] pool view
        out.append(alloc.RealKvSource(tensor=base, page_size=page, num_bytes_per_token=nbpt, read_bytes=read))
    return tuple(out)


def layout_source(rng: random.Random, alloc, page: int, rows: int, align: int, min_bytes: int):
    """A source whose slots' bytes lie as an engine keeps them (RealKvSource's layout fields), over rows
    of random bytes: one run per slot with a gap after it, heads a block apart (vLLM's V, FlashInfer's
    HND), element-strided heads (vLLM's K), 16- or 32-byte chunks (vLLM's paged-attention K), token
    groups of small chunks (vLLM's CPU K on AMX: 16 tokens of 2 elements per 64 bytes), whole slots in
    token groups with a gap after each group, and both token
    and chunk groups (vLLM's CPU V on AMX: token pairs, 16 elements per 1 KiB group)."""
    heads = rng.choice((1, 2, 3))
    form = rng.choice(("gap", "heads", "elements", "chunks", "groups", "vnni", "tiles"))
    chunk = {"gap": 0, "heads": 0, "tiles": 0, "elements": rng.choice((2, 4, 8)), "chunks": rng.choice((16, 32)),
             "groups": rng.choice((2, 4)), "vnni": rng.choice((2, 4))}[form]
    group = gs = cgroup = cgs = 0
    unit = max(align, chunk)
    head = unit * rng.randint(1, 3)
    while heads * head < min_bytes:
        head += unit
    nbpt = heads * head
    read = align * rng.randint(1, nbpt // align)
    if form == "gap":    # [block, slot (+ gap), heads, head]
        ts, hs, cs = nbpt + align * rng.choice((0, 1, 2)), head if heads > 1 else 0, 0
        block = page * ts
    elif form == "heads":  # [block, heads, slot, head] (+ a gap after each head's slots)
        ts, cs = head, 0
        hs = page * head + align * rng.choice((0, 1))
        block = heads * hs
    elif form == "tiles":  # [block, token group, slot of the group (+ gap), heads, head] (+ a gap after each group)
        group = rng.choice((1, 2, 3, 4))
        ts, hs, cs = nbpt + align * rng.choice((0, 1)), head if heads > 1 else 0, 0
        gs = group * ts + align * rng.choice((0, 1, 2))
        block = -(-page // group) * gs
    elif form == "groups":  # [block, heads, token group, chunk, slot of the group, chunk bytes]
        group = rng.choice((1, 2, 3, 4))
        ts, cs = chunk, group * chunk
        gs = head // chunk * cs + align * rng.choice((0, 1))
        hs = -(-page // group) * gs
        block = heads * hs
    elif form == "vnni":    # [block, heads, chunk group, token group, chunk of the group, slot of the group, chunk bytes]
        group, cgroup = rng.choice((1, 2, 3)), rng.choice((1, 2, 4))
        ts, cs = chunk, group * chunk
        gs = cgroup * cs
        cgs = -(-page // group) * gs + align * rng.choice((0, 1))
        hs = -(-(head // chunk) // cgroup) * cgs
        block = heads * hs
    else:                  # [block, heads, chunk, slot, chunk bytes]
        ts, cs = chunk, page * chunk
        hs = head // chunk * cs
        block = heads * hs
    pitch = -(-block // align) * align + align * rng.choice((0, 0, 2))
    dtype = rng.choice(SOURCE_DTYPES)
    raw = torch.randint(0, 256, (rows * pitch,), dtype=torch.uint8)
    tensor = raw.view(dtype).view(rows, pitch // raw.view(dtype).element_size())
    return alloc.RealKvSource(tensor=tensor, page_size=page, num_bytes_per_token=nbpt, read_bytes=read,
                              token_stride_bytes=ts, num_heads=heads, head_stride_bytes=hs, chunk_bytes=chunk,
                              chunk_stride_bytes=cs, token_group_size=group, token_group_stride_bytes=gs,
                              chunk_group_size=cgroup, chunk_group_stride_bytes=cgs)


def flip_source_byte(rng: random.Random, sources: tuple, slot: int) -> bool:
    """Flip one byte that the fingerprint of `slot` reads (in every mode: the first 16 bytes)."""
    if not sources:
        return False
    src = rng.choice(sources)
    row = slot // src.page_size
    if row >= src.tensor.shape[0]:
        return False
    flat = src.tensor[row].reshape(-1).view(torch.uint8)
    b = rng.randrange(16)  # a byte of head 0's first 16 (within one chunk of 16 or more, or a small chunk's)
    chunk = src.chunk_bytes or 16
    t = slot % src.page_size
    token = (t // src.token_group_size * src.token_group_stride_bytes + t % src.token_group_size * src.token_stride_bytes
             if src.token_group_size else t * src.token_stride_bytes)
    c = b // chunk
    at_chunk = (c // src.chunk_group_size * src.chunk_group_stride_bytes + c % src.chunk_group_size * src.chunk_stride_bytes
                if src.chunk_group_size else c * src.chunk_stride_bytes)
    at = token + at_chunk + b % chunk
    flat[at] ^= 1 << rng.randrange(8)
    return True


# -- contexts -------------------------------------------------------------------------------------------
def make_context(rng: random.Random, tree, num_slots: int, *, sources=None, mode=None, short_sources=False,
                 layouts=False):
    lay, alloc, _ = _mods(tree)
    stride = lay.CANARY_SLOT_STRIDE_BYTES + lay.CANARY_WORD_BYTES * rng.choice((0, 0, 0, 1, 3))
    ring_cap = rng.choice((0, 1, 3, 8, 64, 256))
    if sources is None:
        sources = make_sources(rng, tree, num_slots, short=short_sources, layouts=layouts)
    mode = rng.choice(list(lay.RealKvHashMode)) if mode is None else mode
    if mode == lay.RealKvHashMode.PARTIAL and any(s.num_bytes_per_token < lay.REAL_KV_PARTIAL_READ_BYTES
                                                  for s in sources):
        mode = lay.RealKvHashMode.ALL  # a source that small is refused in PARTIAL (its slots are too short)
    ctx = alloc.allocate_context(num_slots=num_slots, ring_capacity=ring_cap, device="cpu",
                                 kernel_kind=rng.choice(list(lay.CanaryLaunchTag)), real_kv_sources=sources,
                                 real_kv_hash_mode=mode, enable_chain_position_assert=rng.random() < 0.8,
                                 slot_stride_bytes=stride)
    # Trailing bytes of a wider stride must survive untouched; fill them with noise.
    if stride > lay.CANARY_RECORD_BYTES:
        ctx.canary_buf[:, lay.CANARY_RECORD_BYTES:] = torch.randint(0, 256, (num_slots, stride - lay.CANARY_RECORD_BYTES),
                                                                    dtype=torch.uint8)
    ctx.violation_write_index.fill_(rng.choice((0, 0, 0, 1, 5)))
    ctx.slot_run_counter.fill_(rng.randrange(100))
    ctx.kernel_run_counter.fill_(rng.randrange(100))
    # Per-reason totals [extension]: usually counting from earlier launches, sometimes absent (null pointer).
    if rng.random() < 0.15:
        return dataclasses.replace(ctx, violation_reason_counts=None)
    ctx.violation_reason_counts.copy_(_i64(rng.choice((0, rng.randrange(100))) for _ in ctx.violation_reason_counts))
    return ctx


def _extra_token_values(rng, tree, n: int, owners: list[int], owner_ids: list[int]) -> dict:
    """Per-token values of every input field: a per-request id for some, random values for others."""
    out = {}
    for f in tree.layout.INPUT_FIELDS:
        if rng.random() < 0.5:
            out[f.name] = _i64(owner_ids[o] for o in owners)
        else:
            out[f.name] = _i64(_noise(rng, 0, 1000, n))
    return out


def populate(tree, context, chains: list[list[int]], *, rng: random.Random, values: dict | None = None) -> dict:
    """Write each chain (slots at positions 0..len-1 from HEAD) through the reference; returns what was written."""
    lay, alloc, ref = _mods(tree)
    total = sum(len(c) for c in chains)
    tokens = _noise(rng, 0, 50_000, total)
    owners = [i for i, c in enumerate(chains) for _ in c]
    owner_ids = values["owner_ids"] if values else [rng.randrange(1, 1 << 20) for _ in chains]
    extra = _extra_token_values(rng, tree, total, owners, owner_ids)
    plan = alloc.WritePlan.allocate(write_req_capacity=max(len(chains), 1), device="cpu")
    offs = [0]
    for c in chains:
        offs.append(offs[-1] + len(c))
    plan.write_offsets[: len(chains) + 1] = _i64(offs)
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(len(chains))
    counters = [context.violation_write_index, context.violation_ring, context.slot_run_counter,
                context.kernel_run_counter]
    if context.violation_reason_counts is not None:
        counters.append(context.violation_reason_counts)
    saved = [t.clone() for t in counters]
    ref.write(context=context, plan=plan, input_ids=_i64(tokens),
              positions=_i64(p for c in chains for p in range(len(c))),
              out_cache_loc=_i64(s for c in chains for s in c), enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None, extra_inputs=extra)
    for t, v in zip(counters, saved):
        t.copy_(v)
    return {"tokens": tokens, "owners": owners, "owner_ids": owner_ids, "extra": extra}


def corrupt(rng: random.Random, tree, context, slots: list[int]) -> None:
    """One random corruption among slots: a flipped bit in any field, swapped records, a shifted position
    or a flipped real-KV byte."""
    lay = tree.layout
    if not slots:
        return
    words = context.canary_buf.view(torch.int64)
    kind = rng.choice(("bit", "swap", "shift", "kv"))
    s = rng.choice(slots)
    if kind == "bit":
        w = rng.randrange(lay.CANARY_FIELDS_PER_SLOT)
        words[s, w] ^= 1 << rng.randrange(63)
    elif kind == "swap":
        t = rng.choice(slots)
        rec = words[s, : lay.CANARY_FIELDS_PER_SLOT].clone()
        words[s, : lay.CANARY_FIELDS_PER_SLOT] = words[t, : lay.CANARY_FIELDS_PER_SLOT]
        words[t, : lay.CANARY_FIELDS_PER_SLOT] = rec
    elif kind == "shift":
        words[s, lay.CANARY_POSITION_WORD] += rng.choice((-1, 1, 7))
    else:
        flip_source_byte(rng, context.real_kv_sources, s)


def _layout_requests(rng: random.Random, n_reqs: int, *, max_prefix=64, max_extend=32):
    prefixes = [rng.choice((0, rng.randint(0, max_prefix), rng.randint(0, 8))) for _ in range(n_reqs)]
    extends = [rng.choice((0, 1, rng.randint(0, max_extend))) for _ in range(n_reqs)]
    return prefixes, extends


# -- write ----------------------------------------------------------------------------------------------
def make_write_case(rng: random.Random, tree, *, n_reqs: int | None = None, overlap: bool = False,
                    max_prefix: int = 64, max_extend: int = 32, layouts: bool = False) -> dict:
    lay, alloc, _ = _mods(tree)
    n_reqs = rng.randint(0, 16) if n_reqs is None else n_reqs
    prefixes, extends = _layout_requests(rng, n_reqs, max_prefix=max_prefix, max_extend=max_extend)
    need = sum(prefixes) + sum(extends)
    num_slots = need + 1 + rng.randint(0, 16)
    perm = rng.sample(range(1, num_slots), need)
    prefix_slots, extend_slots, at = [], [], 0
    for p, e in zip(prefixes, extends):
        prefix_slots.append(perm[at:at + p])
        extend_slots.append(perm[at + p:at + p + e])
        at += p + e
    ctx = make_context(rng, tree, num_slots, short_sources=rng.random() < 0.05, layouts=layouts)
    written = populate(tree, ctx, prefix_slots, rng=rng)
    if rng.random() < 0.3:
        corrupt(rng, tree, ctx, [s for c in prefix_slots for s in c])

    cap = n_reqs + rng.choice((0, 0, 1, 3)) or 1
    plan = alloc.WritePlan.allocate(write_req_capacity=cap, device="cpu")
    plan.write_offsets.copy_(_i64(_noise(rng, -5, 50, cap + 1)))  # garbage past the batch
    plan.write_seed_slot_indices.copy_(_i64(_noise(rng, -1, num_slots, cap)))
    offs = [0]
    for e in extends:
        offs.append(offs[-1] + e)
    plan.write_offsets[: n_reqs + 1] = _i64(offs)
    seeds = [c[-1] if c and rng.random() < 0.95 else -1 for c in prefix_slots]
    if seeds and rng.random() < 0.05:
        seeds[rng.randrange(len(seeds))] = num_slots + rng.randrange(5)      # out-of-range seed (§8)
    plan.write_seed_slot_indices[:n_reqs] = _i64(seeds)
    plan.write_num_valid_reqs.fill_(rng.choice((n_reqs, n_reqs, n_reqs, max(n_reqs - 1, 0), cap + 2, -1)))

    total = offs[-1]
    locs = [s for c in extend_slots for s in c]
    positions, tokens = [], []
    for p, e in zip(prefixes, extends):
        positions += list(range(p, p + e))
        tokens += _noise(rng, 0, 50_000, e)
    for i in range(total):
        r = rng.random()
        if r < 0.05:
            locs[i] = -1                                     # padded token: skipped
        elif r < 0.07:
            locs[i] = num_slots + rng.randrange(3)           # out of range (§8)
        elif r < 0.09:
            positions[i] += rng.choice((-1, 1, 5))           # breaks the chain-position assert
        elif r < 0.10:
            locs[i] = 0                                      # slot 0 is written like any other
    if overlap and locs and rng.random() < 0.7:
        for _ in range(rng.randint(1, 3)):                   # duplicates and seeds inside the batch
            locs[rng.randrange(total)] = rng.choice(locs)
        if n_reqs > 1:
            r = rng.randrange(1, n_reqs)
            earlier = [s for c in extend_slots[:r] for s in c]
            if earlier:
                plan.write_seed_slot_indices[r] = rng.choice(earlier)
    owners = [r for r, e in enumerate(extends) for _ in range(e)]
    extra = _extra_token_values(rng, tree, total, owners, written["owner_ids"])
    assert_inputs = rng.random() < 0.5
    exp_tok = exp_pos = None
    if assert_inputs:
        exp_tok = _i64(t if rng.random() < 0.9 else t + 1 for t in tokens)
        exp_pos = _i64(p if rng.random() < 0.9 else p - 1 for p in positions)
    return dict(context=ctx, plan=plan, input_ids=_i64(tokens), positions=_i64(positions), out_cache_loc=_i64(locs),
                enable_write_input_assert=assert_inputs, expected_input_tokens=exp_tok,
                expected_input_positions=exp_pos, extra_inputs=extra)


def write_ranges(case: dict) -> list[tuple[int, int]]:
    """[lo, hi) of every request the write kernel runs (the plan's active rows, clamped as it clamps them)."""
    plan, total = case["plan"], int(case["out_cache_loc"].shape[0])
    n = max(0, min(int(plan.write_num_valid_reqs[0]), int(plan.write_seed_slot_indices.shape[0])))
    return [(min(max(int(plan.write_offsets[r]), 0), total), min(max(int(plan.write_offsets[r + 1]), 0), total))
            for r in range(n)]


def crowd_slots(rng: random.Random, case: dict, *, distinct: int = 3) -> dict:
    """Every request's in-range slots redrawn from `distinct` of its own: many duplicate slots inside
    one request, next to each other and far apart (in one chunk of a block's walk and across chunks),
    where the later entry must win. Each request draws from its own slots (requests whose ranges
    overlap, e.g. the plan's garbage rows past the batch, may then share some)."""
    locs, num_slots = case["out_cache_loc"].tolist(), int(case["context"].canary_buf.shape[0])
    for lo, hi in write_ranges(case):
        own = sorted({s for s in locs[lo:hi] if 0 <= s < num_slots})
        if own:
            pool = rng.sample(own, min(distinct, len(own)))
            locs[lo:hi] = [rng.choice(pool) if 0 <= s < num_slots else s for s in locs[lo:hi]]
    case["out_cache_loc"].copy_(_i64(locs))
    return case


# -- verify ---------------------------------------------------------------------------------------------
def make_verify_case(rng: random.Random, tree, *, n_reqs: int | None = None, max_prefix: int = 64,
                     layouts: bool = False) -> dict:
    lay, alloc, _ = _mods(tree)
    n_reqs = rng.randint(0, 16) if n_reqs is None else n_reqs
    prefixes = [rng.choice((0, rng.randint(0, max_prefix), rng.randint(0, 8))) for _ in range(n_reqs)]
    need = sum(prefixes)
    num_slots = need + 1 + rng.randint(0, 16)
    perm = rng.sample(range(1, num_slots), need)
    chains, at = [], 0
    for p in prefixes:
        chains.append(perm[at:at + p])
        at += p
    ctx = make_context(rng, tree, num_slots, short_sources=rng.random() < 0.05, layouts=layouts)
    written = populate(tree, ctx, chains, rng=rng)
    all_slots = [s for c in chains for s in c]
    for _ in range(rng.choice((0, 0, 1, 2, 4))):
        corrupt(rng, tree, ctx, all_slots)

    entries = []   # (slot, prev, position, expected token, owner)
    k = 0
    for r, c in enumerate(chains):
        window = rng.choice((0, 0, rng.randint(1, 8)))
        start = max(0, len(c) - window) if window else 0
        for p in range(start, len(c)):
            tok = written["tokens"][k + p] if rng.random() < 0.7 else rng.choice((-1, rng.randrange(50_000)))
            entries.append((c[p], c[p - 1] if p else -1, p, tok, r))
        k += len(c)
    for _ in range(rng.choice((0, 0, 1, 3))):                # sentinels and §8 cases
        r = rng.random()
        s = rng.choice(all_slots) if all_slots else 1 % num_slots
        if r < 0.3:
            entries.insert(rng.randint(0, len(entries)), (0, rng.randrange(-1, num_slots), 0, -1, -1))
        elif r < 0.5:
            entries.insert(rng.randint(0, len(entries)), (s, 0, rng.randrange(64), -1, -1))
        elif r < 0.7:
            entries.insert(rng.randint(0, len(entries)), (rng.choice((num_slots, -3, num_slots + 9)), -1, 0, 5, -1))
        else:
            entries.insert(rng.randint(0, len(entries)), (s, num_slots + rng.randrange(4), 1, -1, -1))
    cap = max(1, len(entries) + rng.choice((0, 0, 2, 7)))
    plan = alloc.VerifyPlan.allocate(verify_capacity=cap, device="cpu")
    for name in plan.ARRAY_FIELDS:                           # garbage past num_valid must be ignored
        getattr(plan, name).copy_(_i64(_noise(rng, -2, num_slots, cap)))
    n = len(entries)
    if n:
        plan.verify_slot_indices[:n] = _i64(e[0] for e in entries)
        plan.verify_prev_slot_indices[:n] = _i64(e[1] for e in entries)
        plan.verify_expected_positions[:n] = _i64(e[2] for e in entries)
        plan.verify_expected_tokens[:n] = _i64(e[3] for e in entries)
    ids = written["owner_ids"]
    for f in lay.INPUT_FIELDS:
        if f.verify_expected == "per_request" and n:
            want = [ids[e[4]] if e[4] >= 0 and rng.random() < 0.95 else rng.choice((-1, 7)) for e in entries]
            getattr(plan, "verify_expected_" + f.name)[:n] = _i64(want)
    plan.verify_num_valid.fill_(rng.choice((n, n, n, n, max(n - 2, 0), cap + 3, -4)))
    plan.enable.fill_(0 if rng.random() < 0.05 else 1)
    tables = {}
    for f in lay.INPUT_FIELDS:
        if f.verify_expected == "per_slot":
            table = ctx.canary_buf.view(torch.int64)[:, f.word].clone()
            for _ in range(rng.choice((0, 0, 1, 3))):
                table[rng.randrange(num_slots)] += 1
            tables[f.name] = table
    return dict(context=ctx, plan=plan, check_verify_expected_token=rng.random() < 0.5, extra_slot_tables=tables)


# -- plan -----------------------------------------------------------------------------------------------
def make_plan_case(rng: random.Random, tree, *, n_reqs: int | None = None, max_prefix: int = 64,
                   max_extend: int = 32) -> dict:
    lay, alloc, _ = _mods(tree)
    bs = rng.randint(0, 16) if n_reqs is None else n_reqs
    prefixes, extends = _layout_requests(rng, bs, max_prefix=max_prefix, max_extend=max_extend)
    req_rows = bs + 1 + rng.randint(0, 4)
    max_ctx = max([p + e for p, e in zip(prefixes, extends)] + [1]) + rng.randint(0, 4)
    num_slots = req_rows * max_ctx + 1
    r2t = torch.randint(1, num_slots, (req_rows, max_ctx), dtype=torch.int32)
    rows = rng.sample(range(1, req_rows), bs)
    for i in range(bs):
        if rng.random() < 0.15:
            rows[i] = lay.REQ_POOL_IDX_PADDING                  # CUDA-graph padding row
    window = rng.choice((0, 0, rng.randint(1, 16)))
    lut = None
    # Every SWA plan has a LUT, and so do 30% of the full-attention ones (about 1 plan case in 5):
    # a given LUT translates every slot, window or not (docs/semantics.md §5.3).
    if window or rng.random() < LUT_WITHOUT_WINDOW_ODDS:
        lut = _i64(rng.randrange(-1, num_slots) if rng.random() < 0.05 else rng.randrange(1, num_slots)
                   for _ in range(num_slots))
    pool = valid = None
    if rng.random() < 0.5:
        pool_cols = max_ctx + rng.choice((-2, 0, 1)) if max_ctx > 2 else max_ctx
        pool = torch.randint(0, 50_000, (req_rows, pool_cols), dtype=torch.int32)
        valid = _i64(rng.randint(0, pool_cols + 2) for _ in range(bs))
    total = sum(max(0, p - (max(0, p - window) if window else 0)) for p, r in zip(prefixes, rows) if r != lay.REQ_POOL_IDX_PADDING)
    cap = max(1, total + rng.choice((0, 0, 3, -1, -5)))
    vplan = alloc.VerifyPlan.allocate(verify_capacity=cap, device="cpu")
    for name in vplan.ARRAY_FIELDS:                          # garbage that overflow must leave untouched
        getattr(vplan, name).copy_(_i64(_noise(rng, -9, 9, cap)))
    vplan.verify_num_valid.fill_(rng.randrange(-3, 3))
    vplan.enable.fill_(rng.randrange(0, 2))
    wcap = max(1, bs + rng.choice((0, 0, 2)))
    wplan = alloc.WritePlan.allocate(write_req_capacity=wcap, device="cpu")
    wplan.write_offsets.copy_(_i64(_noise(rng, -9, 9, wcap + 1)))
    wplan.write_seed_slot_indices.copy_(_i64(_noise(rng, -9, 9, wcap)))
    extra = {f.name: _i64(_noise(rng, 1, 1 << 20, bs))
             for f in lay.INPUT_FIELDS if f.verify_expected == "per_request"}
    return dict(verify_plan_out=vplan, write_plan_out=wplan, req_pool_indices=_i64(rows), prefix_lens=_i64(prefixes),
                extend_seq_lens=_i64(extends), req_to_token=r2t, swa_window_size=window, full_to_swa_index_mapping=lut,
                verify_capacity=cap, req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=valid,
                kv_token_id_vs_position_offset=rng.choice((0, 0, 1)), extra_request_values=extra)


def lut_without_window(case: dict) -> bool:
    """A plan case whose LUT translates without a window (docs/semantics.md §5.3)."""
    return case["full_to_swa_index_mapping"] is not None and case["swa_window_size"] <= 0


class PlanCaseTally:
    """Counts the plan cases a differential suite draws, and those with a LUT but no window.

    `make` wraps make_plan_case; `report` prints the counts (visible with `pytest -s`) and, for a
    run of at least MIN_CASES, asserts that the LUT-without-window share has not silently vanished.
    """

    MIN_CASES = 50
    MIN_SHARE = 0.08   # well below the generator's 1 in 5, well above 0

    def __init__(self):
        self.cases = self.lut_without_window = 0

    def make(self, rng: random.Random, tree, **kw) -> dict:
        case = make_plan_case(rng, tree, **kw)
        self.cases += 1
        self.lut_without_window += lut_without_window(case)
        return case

    def report(self, suite: str) -> None:
        share = self.lut_without_window / self.cases if self.cases else 0.0
        print(f"\n{suite}: {self.lut_without_window} of {self.cases} plan cases have a LUT and no window ({share:.1%})")
        if self.cases >= self.MIN_CASES:
            assert share >= self.MIN_SHARE, (f"{suite}: only {self.lut_without_window} of {self.cases} plan cases "
                                             f"have a LUT and no window")


def plan_stages(tree, case: dict, scratch: torch.Tensor) -> tuple[dict, dict]:
    """A plan case of `tree` as SGLang's launch_canary_plan_kernels hands it to its two stages: the
    keywords of launch_plan_offsets_kernel and of launch_plan_entries_kernel, over the case's own plan
    arrays and `scratch` (the verify offsets, at least bs + 1 int64). The mapping is the kernel
    backends' own (the tree's kernel_abi.PLAN.args); the per-request field keywords only where
    the schema has such fields, as in the public stage signatures (docs/semantics.md §8)."""
    from kv_canary.trees.sources import kernel_abi
    extra = case.get("extra_request_values") or {}
    offsets, entries = kernel_abi(tree).PLAN.args(dict(case, extra_request_values=extra), scratch)
    if not extra:
        del entries["extra_request_values"], entries["out_extra_verify_expected"]
    return offsets, entries


def make_plan_scratch(rng: random.Random, case: dict) -> torch.Tensor:
    """Noise for the verify offsets scratch: bs + 1 entries, sometimes more (SGLang allocates 4097)."""
    n = int(case["req_pool_indices"].shape[0]) + 1 + rng.choice((0, 0, 3))
    return _i64(_noise(rng, -9, 9, n)).to(case["req_to_token"].device)


# -- scatter --------------------------------------------------------------------------------------------
def make_scatter_case(rng: random.Random, tree, *, n_reqs: int | None = None) -> dict:
    bs = rng.randint(0, 16) if n_reqs is None else n_reqs
    lens = [rng.randint(0, 40) for _ in range(bs)]
    rows_n = bs + 1 + rng.randint(0, 3)
    cols = rng.randint(1, 48)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    # Only rows of the pool: host backends reject any other (test_host_checks.py), kernels skip it.
    rows = rng.sample(range(rows_n), bs)
    return dict(flat_in=_i64(_noise(rng, -5, 1 << 33, offs[-1])), offsets=_i64(offs),
                req_pool_indices=_i64(rows), pool_out=torch.randint(-9, 9, (rows_n, cols), dtype=torch.int32))


# -- copying, moving and comparing cases --------------------------------------------------------------
def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value)}
        if hasattr(value, "page_size"):                      # RealKvSource: keep its byte layout
            return type(value)(**changes)
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _clone_keep_strides(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) if t.is_contiguous() else None
    if out is None:       # a padded view: copy its whole storage so the byte layout stays identical
        base = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage().clone())
        return base.as_strided(t.shape, t.stride(), t.storage_offset())
    return out.copy_(t)


def clone_case(case: dict) -> dict:
    """Deep copy: every tensor (also inside contexts, plans and sources) is copied."""
    return _map_tensors(case, _clone_keep_strides)


def case_to(case: dict, device) -> dict:
    """The case with every tensor on `device` (padded source views become dense; their bytes read the same)."""
    return _map_tensors(case, lambda t: t.to(device))


def _tensors(value, prefix: str, out: dict) -> dict:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _tensors(getattr(value, f.name), f"{prefix}.{f.name}", out)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _tensors(v, f"{prefix}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensors(v, f"{prefix}[{k!r}]" if prefix else str(k), out)
    return out


def compare_state(a: dict, b: dict, ring_as_multiset: bool = False) -> None:
    """Assert that every tensor of two cases is equal; ring rows as a multiset if asked (GPU order)."""
    ta, tb = _tensors(a, "", {}), _tensors(b, "", {})
    assert ta.keys() == tb.keys(), f"cases differ in structure: {sorted(ta.keys() ^ tb.keys())}"
    for name in ta:
        x, y = _bits(ta[name]), _bits(tb[name])
        if ring_as_multiset and name.endswith(".violation_ring"):
            x, y = _sorted_rows(x), _sorted_rows(y)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            diff = (x != y).nonzero()[:5].tolist() if x.shape == y.shape and x.dtype == y.dtype else "shape/dtype"
            raise AssertionError(f"{name} differs (first differing indices {diff}):\n{x}\n--- vs ---\n{y}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare floating tensors by bit pattern (random bytes make NaNs)."""
    t = t.detach().cpu()
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _sorted_rows(ring: torch.Tensor) -> torch.Tensor:
    rows = ring.tolist()
    return torch.tensor(sorted(rows), dtype=ring.dtype).view(ring.shape) if rows else ring


class CaseLaunches:
    """A tree's runtime, plus its public launches by name taking a case of this module (keywords of
    every schema: an input-field mapping the schema does not declare may be given empty, as the
    operation's own keywords allow) and `backend=`. Each runs the launch's operation object
    (kv_canary/launch/operations.py) as the generated api does; `<name>_torch_reference` pins torch.
    Anything else is the runtime's (backend, bind, allocators, validators)."""

    def __init__(self, tree, runtime=None):
        self.tree = tree
        self.runtime = kv_canary.runtime_for(tree) if runtime is None else runtime

    def __getattr__(self, name: str):
        from kv_canary.launch import operations

        base, pinned = (name[: -len("_torch_reference")], "torch") if name.endswith("_torch_reference") else (name, None)
        if base not in self.tree.api.LAUNCHES:
            return getattr(self.runtime, name)
        operation, runtime = operations.BY_NAME[self.tree.api.LAUNCHES[base]], self.runtime

        def launch(backend=None, **case) -> None:
            operation.launch(runtime, pinned or backend, case)
        return launch


def runtime_for(tree) -> CaseLaunches:
    """`tree`'s runtime with its launches by name over cases (CaseLaunches)."""
    return CaseLaunches(tree)
