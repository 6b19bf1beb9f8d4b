"""Torch reference of every canary kernel (write, verify, plan and its two stages, scatter) and of
SGLang's compute_slot_hash, docs/semantics.md §2–§8, over one generated tree's layout tables.

`Reference(layout)` binds these functions to a generated package's `layout` module (word indices,
fail-reason bits, violation columns, input fields, the chain fold); each generated package's
`reference` module is that binding (generated/reference.py). Byte-exact with the CUDA kernels of
the same schema; rows are appended in entry order. Inputs are validated by kv_canary.launch before
these functions run. Works for tensors on any device: the reference gathers what it needs, computes
on the CPU (numpy views of CPU tensors) and writes results back in place.

Rules for inputs that are valid by type but not by value (every backend implements the same):
- Slots: a verify slot (or prev) outside [0, num_slots) -- prev and seed values < 0 mean HEAD, 0
  (TOKEN_TO_KV_SLOT_PADDING) as prev means "unreachable" -- yields one SLOT_OUT_OF_RANGE row
  (tag, slot, 0, 0, expected token column, 0, bad index, bit); the bad index is the slot if it is
  out of range, else the prev. A write entry with slot >= num_slots yields the row
  (tag, slot, 0, 0, UNKNOWN, 0, slot, bit) and is skipped; a request with a nonempty range whose
  seed >= num_slots yields (tag, seed, 0, 0, UNKNOWN, 0, seed, bit) and writes nothing.
- Real-KV: when the mode is not NONE and there are sources, a slot whose row (slot // page_size)
  is >= a source tensor's dim 0 is treated like an out-of-range slot (bad index = the slot).
- Ranges: write request r owns entries [clamp(off[r], 0, T), clamp(off[r+1], 0, T)); scatter
  request r copies flat_in[clamp(off[r], 0, total) : clamp(off[r+1], 0, total)] (at most `cols`).
- Ring: row i (i = old write index + k, int32) is stored iff 0 <= i < capacity; the context's
  violation_reason_counts (if not None) gets +1 in the column of each bit of every row, stored or not.
- Plan: a request is active iff its row is not REQ_POOL_IDX_PADDING and lies in [0, req_rows);
  prefix lengths are clamped to [0, max_ctx], extend lengths to >= 0; an expected token is read
  only when 0 <= p + offset < min(valid_len, cols) and the row lies inside the pool; entries past
  the plan's total and seeds past bs are left untouched.
- Input fields: a per_request expected value of UNKNOWN (-1) disables that entry's check.
- Duplicate slots in one write (or rows in one scatter): the later entry wins, and a seed written
  by an earlier request of the same launch is read with that request's values (sequential order).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Optional, Sequence, TypeVar

import numpy as np
import torch

# The launch's data classes (VerifyOrWriteContext, VerifyPlan, WritePlan, RealKvSource) are built
# per generated tree at run time (kv_canary.launch.allocation): the reference reads their fields.
Context = Any
Plan = Any

MASK64 = (1 << 64) - 1
U64 = np.uint64

# -- hashing (docs/semantics.md §2) -----------------------------------------------------------------------
# Vector work runs on numpy arrays (zero-copy views of CPU tensors). Hashes are uint64 there: numpy
# shifts are logical and products wrap mod 2^64; stored words stay int64 and `.view()` switches
# between the two without copying. The write's serial chain runs on Python ints instead (see
# _lockstep_chains), where a product must be masked back to 64 bits.
Hash = TypeVar("Hash", int, np.ndarray)


def splitmix64(x: Hash, lanes: Optional[int] = None) -> Hash:
    """splitmix64 of every 64-bit value of `x`: a uint64 numpy array, hashed in place (lanes None),
    or a Python int of 64-bit values packed at a 128-bit stride, `lanes` the mask of their low
    halves (one value: MASK64). A lane's high half may hold junk in its top 31 bits (what the
    previous call leaves there: the shifts bring the next lane's bits into a lane's top bits, and
    31 + 30 < 64 keeps them out of the low half); masking before a product keeps a lane's product
    (< 2^128) from carrying into the next lane, masking after it clears the product's high half."""
    x ^= x >> 30
    if lanes is not None:
        x &= lanes
    x *= 0xBF58476D1CE4E5B9
    if lanes is not None:
        x &= lanes
    x ^= x >> 27
    if lanes is not None:
        x &= lanes
    x *= 0x94D049BB133111EB
    if lanes is not None:
        x &= lanes
    x ^= x >> 31
    return x


def link_values(prev_hash: np.ndarray, fold_values: Sequence[np.ndarray]) -> np.ndarray:
    """link = fold(prev_hash, fold_values) of uint64 arrays, in the schema's fold order (a new array)."""
    acc = splitmix64(prev_hash.copy())
    for v in fold_values:
        acc ^= v
        splitmix64(acc)
    return acc


# -- moving data between torch and numpy ----------------------------------------------------------------
def _np(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (a view of a CPU tensor: never written to). Through DLPack:
    Tensor.numpy() would leave the caller's storage non-resizable for good."""
    return np.from_dlpack(t.detach().cpu())


def _scalar(t: torch.Tensor) -> int:
    return int(t.detach().cpu()[0])


def _take(t: torch.Tensor, index: np.ndarray) -> np.ndarray:
    """t[index] along dim 0, for `t` on any device: only the selected rows leave the device."""
    return _np(t.index_select(0, torch.from_numpy(index).to(t.device)))


def _gather_records(buf: torch.Tensor, slots: np.ndarray) -> np.ndarray:
    """Records of in-range `slots` as int64 [n, words]."""
    return _take(buf.view(torch.int64), slots)


def _excl_cumsum(lens: np.ndarray) -> np.ndarray:
    return np.cumsum(lens) - lens


def _segments(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, rank): for every element of the concatenated segments, its segment and its index in it."""
    owner = np.repeat(np.arange(lens.size), lens)
    rank = np.arange(owner.size) - _excl_cumsum(lens)[owner]
    return owner, rank


def _keep_last(keys: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each key (sequential last-write-wins for a scatter)."""
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(keys)                   # not stable (several times faster): take the max index
    sk = keys[order]
    group = np.flatnonzero(np.concatenate(([True], sk[1:] != sk[:-1])))
    return np.maximum.reduceat(order, group)


def _table(req_to_token: torch.Tensor, r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """req_to_token[r, c] as int64 (one flat gather)."""
    return _take(req_to_token.view(-1), r * int(req_to_token.shape[1]) + c).astype(np.int64)


# -- real-KV fingerprint (docs/semantics.md §4) ------------------------------------------------------------
def _storage_words(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as int64 words (16-byte alignment is validated)."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return raw[: raw.numel() // 8 * 8].view(torch.int64)


# Slots hashed per gather: the gathered window block [chunk, words] and the hash state stay in
# cache while the word loop runs over them (one 8 MB block for 65k slots would not).
_FP_CHUNK = 8192
_GATHER_UNITS = 1 << 20     # units gathered per block by a strided source (an 8-byte index each)


def _source_hash(t: torch.Tensor, start: np.ndarray, nwords: int) -> np.ndarray:
    """h of one source (uint64 [n]) from the storage word index `start` of every slot's read window."""
    n = start.size
    flat = _storage_words(t)
    # Overlapping windows (row i = words i..i+nwords-1): one contiguous row copy per slot.
    windows = flat.as_strided((flat.numel() - nwords + 1, nwords), (1, 1))
    start_t = torch.from_numpy(start).to(t.device)
    block = torch.empty((min(n, _FP_CHUNK), nwords), dtype=torch.int64, device=t.device)
    h = np.zeros(n, dtype=U64)
    for lo in range(0, n, _FP_CHUNK):
        hi = min(lo + _FP_CHUNK, n)
        words = _np(torch.index_select(windows, 0, start_t[lo:hi], out=block[: hi - lo])).view(U64)
        part = h[lo:hi]
        for w in range(nwords):              # h = splitmix64(h ^ word), word by word
            part ^= words[:, w]
            splitmix64(part)
    return h


def _layout(src: Any) -> tuple[int, ...]:
    """(token stride, heads, head stride, chunk bytes, chunk stride, token group size, token group
    stride, chunk group size, chunk group stride) of a validated source; a source without the layout fields (SGLang's) has packed rows."""
    ts = getattr(src, "token_stride_bytes", None)
    return (int(src.num_bytes_per_token if ts is None else ts), int(getattr(src, "num_heads", 1)),
            int(getattr(src, "head_stride_bytes", 0)), int(getattr(src, "chunk_bytes", 0)),
            int(getattr(src, "chunk_stride_bytes", 0)), int(getattr(src, "token_group_size", 0)),
            int(getattr(src, "token_group_stride_bytes", 0)), int(getattr(src, "chunk_group_size", 0)),
            int(getattr(src, "chunk_group_stride_bytes", 0)))


def _token_offsets(in_page: np.ndarray, layout: tuple) -> np.ndarray:
    """Byte offset of each slot's first byte from its row's (token groups: vLLM's AMX K cache)."""
    ts, group, group_stride = layout[0], layout[5], layout[6]
    if not group:
        return in_page * ts
    g, t = np.divmod(in_page, group)
    return g * group_stride + t * ts


def _logical_offsets(num_bytes_per_token: int, layout: tuple, nbytes: int, unit: int) -> np.ndarray:
    """Byte offset, from a slot's first byte, of every `unit`-th of its first `nbytes` logical bytes
    (head by head, each head's bytes in order, chunk by chunk); `unit` divides a head's chunks."""
    _, heads, head_stride, chunk, chunk_stride, _, _, chunk_group, chunk_group_stride = layout
    b = np.arange(0, nbytes, unit, dtype=np.int64)
    h, o = np.divmod(b, num_bytes_per_token // heads)
    if chunk:
        c, o = np.divmod(o, chunk)
        if chunk_group:
            g, c = np.divmod(c, chunk_group)
            o = g * chunk_group_stride + c * chunk_stride + o
        else:
            o = c * chunk_stride + o
    return h * head_stride + o


_UNIT_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _gathered_hash(t: torch.Tensor, start: np.ndarray, num_bytes_per_token: int, layout: tuple,
                   nbytes: int) -> np.ndarray:
    """h of one source (uint64 [n]) whose slots' logical bytes are gathered from the storage byte
    `start` of each slot's first byte, a chunk (or 8 bytes of a longer run) at a time."""
    chunk = layout[3]
    unit = chunk if chunk in (2, 4) else 8
    offsets = _logical_offsets(num_bytes_per_token, layout, nbytes, unit)
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    units = raw[: raw.numel() // unit * unit].view(_UNIT_DTYPES[unit])  # every offset is a multiple of unit
    offs = torch.from_numpy(offsets // unit).to(t.device)
    start_t = torch.from_numpy(start // unit).to(t.device)
    n, per_slot = start.size, offsets.size
    h = np.zeros(n, dtype=U64)
    step = max(1, min(_FP_CHUNK, _GATHER_UNITS // per_slot))  # the int64 index of a block stays ~8 MB
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        gathered = units[start_t[lo:hi, None] + offs[None, :]]  # [slots, logical units], in logical order
        words = np.ascontiguousarray(_np(gathered)).view("<u8")  # little-endian: the units' bytes in order
        part = h[lo:hi]
        for w in range(nbytes // 8):
            part ^= words[:, w]
            splitmix64(part)
    return h


# -- the write's serial chain ---------------------------------------------------------------------------
def serial_chain(run: int, fold_values: Sequence[list[int]]) -> list[int]:
    """One chain in plain ints from link `run` (u64): the prev_hash (u64) each entry stores."""
    sm, mask = splitmix64, MASK64   # locals: the loop below runs once per entry
    out = []
    for values in zip(*fold_values):
        out.append(run)
        run = sm(run, mask)
        for v in values:
            run = sm(run ^ v, mask)
    return out


def _lockstep_chains(firsts: np.ndarray, lens: np.ndarray, seeds: np.ndarray, fold_values: Sequence[np.ndarray],
                     out: np.ndarray) -> None:
    """Chains of independent requests (first entry, length, seed link u64): out[entry] = prev_hash.

    All requests advance in lock-step (step k hashes entry k of every live request), packed into
    one Python int as 128-bit lanes: each big-int operation then hashes every lane at C speed.
    A lane's value is its low 64 bits; its high 64 bits are zero or junk (see splitmix64). Once a
    single lane is live, plain ints are cheaper than packing.
    """
    order = np.argsort(-lens, kind="stable")     # longest first: the live lanes are the lowest ones
    firsts, lens, seeds = firsts[order], lens[order], seeds[order]
    packed_steps = int(lens[1]) if lens.size > 1 else 0   # steps with at least two live lanes
    # live[k]: lanes live at step k (non-increasing); entries in step-major order (step k, lane j < live[k]).
    ended = np.cumsum(np.bincount(np.minimum(lens, packed_steps), minlength=packed_steps + 1))
    live = lens.size - ended[:packed_steps]
    step, lane = _segments(live)
    entries = firsts[lane] + step
    values = []
    for v in fold_values:                        # 16 bytes per (step, lane): value, then zero
        packed = np.zeros((entries.size, 2), dtype=U64)
        packed[:, 0] = v[entries]
        values.append(packed.tobytes())
    lane_words = np.zeros((lens.size, 2), dtype=U64)
    lane_words[:, 0] = seeds
    x = int.from_bytes(lane_words.tobytes(), "little")
    sm, from_bytes = splitmix64, int.from_bytes
    stored = []
    at = 0
    for m in np.unique(live)[::-1].tolist():     # runs of steps with m live lanes
        nb = 16 * m
        lanes = from_bytes((b"\xff" * 8 + b"\x00" * 8) * m, "little")  # the low half of every lane
        x &= (1 << (8 * nb)) - 1                 # drop the finished lanes
        for _ in range(int((live == m).sum())):
            stored.append(x.to_bytes(nb, "little"))
            x = sm(x, lanes)
            for b in values:
                x = sm(x ^ from_bytes(b[at:at + nb], "little"), lanes)
            at += nb
    out[entries] = np.frombuffer(b"".join(stored), dtype=U64)[0::2]
    # The longest chain's steps past the second longest.
    run = x & MASK64 if packed_steps else int(seeds[0])
    lo, hi = int(firsts[0]) + packed_steps, int(firsts[0] + lens[0])
    out[lo:hi] = serial_chain(run, [v[lo:hi].tolist() for v in fold_values])


def run_chains(lens: np.ndarray, seed_links: np.ndarray, deps: np.ndarray,
               fold_values: Sequence[np.ndarray]) -> np.ndarray:
    """The serial part of the write: every request's chain over its stored entries.

    Request r owns the next lens[r] stored entries; its chain starts from seed_links[r] (u64) or,
    if deps[r] >= 0, from the link of that stored entry of an earlier request. fold_values: the
    chained values (u64) of every stored entry, in fold order. Returns the prev_hash (u64) of every
    stored entry. Requests run in waves: a dependent request after the one it depends on.
    """
    firsts = _excl_cumsum(lens)
    prev_hash = np.zeros(int(lens.sum()), dtype=U64)
    owner = np.repeat(np.arange(lens.size), lens)
    wave = np.zeros(lens.size, dtype=np.int64)
    for r in np.flatnonzero(deps >= 0).tolist():
        wave[r] = wave[owner[deps[r]]] + 1
    links = seed_links.copy()
    for w in range(int(wave.max()) + 1 if lens.size else 0):
        members = np.flatnonzero((wave == w) & (lens > 0))
        if members.size == 0:
            continue
        dep = deps[members]
        seeded = members[dep >= 0]               # their seeds' links are known from earlier waves
        links[seeded] = link_values(prev_hash[dep[dep >= 0]], [v[dep[dep >= 0]] for v in fold_values])
        _lockstep_chains(firsts[members], lens[members], links[members], fold_values, prev_hash)
    return prev_hash


def _store_entries(entries: dict[str, np.ndarray], outputs: dict[str, torch.Tensor]) -> None:
    for name, values in entries.items():
        if values.size:
            outputs[name][: values.size].copy_(torch.from_numpy(values))


def _store_offsets_stage(*, offsets: np.ndarray, seeds: np.ndarray, verify_offsets: np.ndarray, verify_capacity: int,
                         out_write_offsets: torch.Tensor, out_write_seed_slot_indices: torch.Tensor,
                         out_write_num_valid_reqs: torch.Tensor, out_verify_num_valid: torch.Tensor,
                         out_verify_enable: torch.Tensor,
                         out_verify_offsets_scratch: Optional[torch.Tensor] = None) -> None:
    """Store the plan's first stage; an overflowing plan (total > capacity) is disabled."""
    bs = seeds.size
    out_write_offsets.copy_(torch.from_numpy(offsets))
    if bs:
        out_write_seed_slot_indices[:bs].copy_(torch.from_numpy(seeds))
    out_write_num_valid_reqs.fill_(bs)
    total = int(verify_offsets[-1])
    overflow = total > int(verify_capacity)
    out_verify_enable.fill_(0 if overflow else 1)
    out_verify_num_valid.fill_(int(verify_capacity) if overflow else total)
    if out_verify_offsets_scratch is not None:
        out_verify_offsets_scratch[: bs + 1].copy_(torch.from_numpy(verify_offsets))


def scatter(*, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
            pool_out: torch.Tensor) -> None:
    """scatter_req_token_ids (docs/semantics.md §5.4): each request's ids into its row of pool_out."""
    total = int(flat_in.shape[0])
    rows, cols = int(pool_out.shape[0]), int(pool_out.shape[1])
    offs = _np(offsets)
    rp = _np(req_pool_indices)
    start = np.clip(offs[:-1], 0, total)
    lens = np.clip(np.clip(offs[1:], 0, total) - start, 0, cols)
    lens = np.where((rp >= 0) & (rp < rows), lens, 0)
    req, col = _segments(lens)
    if req.size == 0:
        return
    vals = _np(flat_in)[start[req] + col].astype(np.int32)
    keep = _keep_last(rp[req] * cols + col)   # one write per cell: the last
    dev = pool_out.device
    index = (torch.from_numpy(rp[req][keep]).to(dev), torch.from_numpy(col[keep]).to(dev))
    pool_out[index] = torch.from_numpy(vals[keep]).to(dev)   # by (row, col): pool_out may have padded rows


def splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of an int64 tensor of u64 bit patterns (a new tensor on x's device)."""
    a = _np(x).astype(np.int64).view(U64)
    return torch.from_numpy(splitmix64(a).view(np.int64)).to(x.device)


class Reference:
    """The reference bound to one generated tree's `layout` module: its public methods are the
    tree's `reference` functions (write, verify, plan, plan_offsets, plan_entries, scatter,
    fingerprint, compute_slot_hash, link_t, splitmix64_t)."""

    scatter = staticmethod(scatter)
    splitmix64_t = staticmethod(splitmix64_t)

    def __init__(self, layout: ModuleType):
        L = layout
        self._fail = L.fail
        self._word_bytes = L.CANARY_WORD_BYTES
        self._token, self._position = L.CANARY_TOKEN_WORD, L.CANARY_POSITION_WORD
        self._link, self._kv = L.CANARY_CHAIN_LINK_WORD, L.CANARY_KV_FINGERPRINT_WORD
        self._fold_words = tuple(L.CANARY_CHAIN_FOLD_WORDS)
        self._head_u64 = L.CANARY_CHAIN_HEAD
        self._head = L.to_signed64(L.CANARY_CHAIN_HEAD)
        self._pad_slot = L.TOKEN_TO_KV_SLOT_PADDING
        self._pad_req = L.REQ_POOL_IDX_PADDING
        self._unknown = L.UNKNOWN  # an expected value not checked; a prev or seed that is the chain head
        self._partial_bytes = L.REAL_KV_PARTIAL_READ_BYTES
        self._mode_none, self._mode_partial = int(L.RealKvHashMode.NONE), int(L.RealKvHashMode.PARTIAL)
        reason = L.FailReason
        self._bit_chain = int(reason.VERIFY_CHAIN_HASH_MISMATCH)
        self._bit_position = int(reason.VERIFY_POSITION_MISMATCH)
        self._bit_real_kv = int(reason.VERIFY_REAL_KV_HASH_MISMATCH)
        self._bit_write_token = int(reason.WRITE_TOKEN_MISMATCH)
        self._bit_write_position = int(reason.WRITE_POSITION_MISMATCH)
        self._bit_token = int(reason.VERIFY_TOKEN_MISMATCH)
        self._bit_oor = int(reason.SLOT_OUT_OF_RANGE)
        # violation_reason_counts column i counts the rows with bit VIOLATION_REASON_COUNT_BITS[i].
        self._reason_count_bits = np.array(L.VIOLATION_REASON_COUNT_BITS, dtype=np.int64)
        self._ncols = L.VIOLATION_FIELDS
        self._col_tag, self._col_slot = L.VIOLATION_COL_LAUNCH_TAG, L.VIOLATION_COL_SLOT
        self._col_position, self._col_token = L.VIOLATION_COL_STORED_POSITION, L.VIOLATION_COL_STORED_TOKEN
        self._col_expected_token = L.VIOLATION_COL_EXPECTED_TOKEN
        self._col_chain, self._col_aux = L.VIOLATION_COL_STORED_CHAIN_HASH, L.VIOLATION_COL_EXPECTED_AUX
        self._col_bits = L.VIOLATION_COL_FAIL_REASON
        # Input fields (docs/semantics.md §8): (name, word); the verified ones with their FailReason bit.
        self._input_words = tuple((f.name, f.word) for f in L.INPUT_FIELDS)
        self._per_request = tuple((f.name, f.word, int(reason[f.fail_reason]))
                                  for f in L.INPUT_FIELDS if f.verify_expected == "per_request")
        self._per_slot = tuple((f.name, f.word, int(reason[f.fail_reason]))
                               for f in L.INPUT_FIELDS if f.verify_expected == "per_slot")

    # -- chain links ------------------------------------------------------------------------------------
    def _link_records(self, rec: np.ndarray) -> np.ndarray:
        """link(r) (as int64) of int64 records rec [n, words]."""
        r = rec.view(U64)
        return link_values(r[:, self._link], [r[:, w] for w in self._fold_words]).view(np.int64)

    def link_t(self, rec: torch.Tensor) -> torch.Tensor:
        """link(r) of records rec [n, words] (int64): the schema's chain fold."""
        return torch.from_numpy(self._link_records(np.ascontiguousarray(_np(rec)))).to(rec.device)

    def compute_slot_hash(self, *, buf_i64: torch.Tensor, source_slot_idx: int) -> int:
        """slot_hash(buf, s) (docs/semantics.md §2) as an unsigned int: HEAD for s < 0, else link(buf[s]).
        `buf_i64`: the canary buffer as int64 [num_slots, words], any device and strides."""
        if source_slot_idx < 0:
            return self._head_u64
        rec = np.ascontiguousarray(_np(buf_i64[source_slot_idx: source_slot_idx + 1]))
        return int(self._link_records(rec).view(U64)[0])

    # -- violation rows -----------------------------------------------------------------------------------
    def _rows(self, n: int, tag: int) -> np.ndarray:
        rows = np.zeros((n, self._ncols), dtype=np.int64)
        rows[:, self._col_tag] = tag
        return rows

    def _oor_rows(self, tag: int, slot: np.ndarray) -> np.ndarray:
        """SLOT_OUT_OF_RANGE rows of write entries or seeds: (tag, slot, 0, 0, UNKNOWN, 0, slot, bit)."""
        rows = self._rows(slot.size, tag)
        rows[:, self._col_slot] = slot
        rows[:, self._col_expected_token] = self._unknown
        rows[:, self._col_aux] = slot
        rows[:, self._col_bits] = self._bit_oor
        return rows

    def _append_rows(self, context: Context, rows: np.ndarray, keys: np.ndarray) -> None:
        """Append rows in `keys` order (keys are unique) to the shared ring; the index keeps counting past
        capacity and the per-reason totals (if the context has them) count every row."""
        if rows.shape[0] == 0:
            return
        rows = rows[np.argsort(keys)]
        k = rows.shape[0]
        index = context.violation_write_index
        first = _scalar(index)
        new = (first + k + (1 << 31)) % (1 << 32) - (1 << 31)  # int32 arithmetic, like atomicAdd
        index.fill_(new)
        ring = context.violation_ring
        lo, hi = max(first, 0), min(first + k, int(ring.shape[0]))
        if hi > lo:
            ring[lo:hi].copy_(torch.from_numpy(rows[lo - first:hi - first]))
        counts = getattr(context, "violation_reason_counts", None)
        if counts is not None:  # every row, stored or dropped: one column per FailReason bit
            per_reason = ((rows[:, self._col_bits, None] & self._reason_count_bits[None, :]) != 0).sum(axis=0)
            counts.add_(torch.from_numpy(per_reason.astype(np.int64)).to(counts.device))

    # -- real-KV fingerprint (docs/semantics.md §4) --------------------------------------------------------
    def _fingerprint(self, slots: np.ndarray, sources: Sequence[Any], mode: int) -> tuple[np.ndarray, np.ndarray]:
        """(fingerprint int64 [n], row-out-of-range bool [n]) of in-range canary `slots` (int64)."""
        n = slots.size
        oor = np.zeros(n, dtype=bool)
        if int(mode) == self._mode_none or not sources or n == 0:
            return np.zeros(n, dtype=np.int64), oor
        total = np.zeros(n, dtype=U64)
        for src in sources:
            t = src.tensor
            es = t.element_size()
            rows = slots // src.page_size
            in_page = slots - rows * src.page_size    # slots % page_size (numpy's % is several times slower)
            bad = rows >= int(t.shape[0])
            oor |= bad
            nbytes = self._partial_bytes if int(mode) == self._mode_partial else src.read_bytes
            layout = _layout(src)
            if int(t.shape[0]) > 0:
                # First byte of each slot; out-of-range rows read row 0 (result discarded).
                first = t.storage_offset() * es + np.where(bad, 0, rows) * (t.stride(0) * es) + _token_offsets(in_page, layout)
                if layout[1] == 1 and layout[3] == 0:  # one run per slot (SGLang's packed rows among them)
                    total ^= _source_hash(t, first // self._word_bytes, nbytes // self._word_bytes)
                else:
                    total ^= _gathered_hash(t, first, int(src.num_bytes_per_token), layout, nbytes)
            splitmix64(total)
        total[oor] = 0
        return total.view(np.int64), oor

    def fingerprint(self, slots: torch.Tensor, sources: Sequence[Any], mode: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fingerprint int64 [n], row-out-of-range bool [n]) of in-range canary `slots` (int64 tensor)."""
        fp, oor = self._fingerprint(_np(slots), sources, mode)
        return torch.from_numpy(fp), torch.from_numpy(oor)

    # -- verify (docs/semantics.md §5.2) -----------------------------------------------------------------------
    def verify(self, *, context: Context, plan: Plan, check_verify_expected_token: bool,
               extra_slot_tables: dict[str, torch.Tensor]) -> None:
        context.kernel_run_counter.add_(1)
        if _scalar(plan.enable) == 0:
            return
        cap = int(plan.verify_slot_indices.shape[0])
        n = min(max(_scalar(plan.verify_num_valid), 0), cap)
        context.slot_run_counter.add_(n)
        if n == 0:
            return
        buf = context.canary_buf
        num_slots = int(buf.shape[0])
        tag = int(context.kernel_kind)
        slots = _np(plan.verify_slot_indices[:n])
        prevs = _np(plan.verify_prev_slot_indices[:n])
        exp_pos = _np(plan.verify_expected_positions[:n])
        exp_tok = (_np(plan.verify_expected_tokens[:n]) if check_verify_expected_token
                   else np.full(n, self._unknown, dtype=np.int64))

        live = slots != self._pad_slot
        slot_oor = live & ((slots < 0) | (slots >= num_slots))
        prev_oor = live & ~slot_oor & (prevs >= num_slots)
        ok = live & ~slot_oor & ~prev_oor
        fp_ok, kv_oor_ok = self._fingerprint(slots[ok], context.real_kv_sources, context.real_kv_hash_mode)
        kv_oor = np.zeros(n, dtype=bool)
        kv_oor[ok] = kv_oor_ok
        oor = slot_oor | prev_oor | kv_oor
        sel = np.flatnonzero(ok & ~kv_oor)       # the entries that get checked
        fp = fp_ok[~kv_oor_ok]

        rec = _gather_records(buf, slots[sel])
        p = prevs[sel]
        reachable = p != self._pad_slot
        from_buf = reachable & (p >= 0)
        link = rec[:, self._link]
        expected_chain = np.where(reachable, self._head, link)
        expected_chain[from_buf] = self._link_records(_gather_records(buf, p[from_buf]))
        et = exp_tok[sel]
        bits = np.where(reachable & (link != expected_chain), self._bit_chain, 0)
        bits |= np.where((et != self._unknown) & (rec[:, self._token] != et), self._bit_token, 0)
        bits |= np.where(rec[:, self._position] != exp_pos[sel], self._bit_position, 0)
        bits |= np.where(rec[:, self._kv] != fp, self._bit_real_kv, 0)
        for name, word, bit in self._per_request:   # per request, UNKNOWN: no check
            want = _np(getattr(plan, "verify_expected_" + name)[:n])[sel]
            bits |= np.where((want != self._unknown) & (rec[:, word] != want), bit, 0)
        for name, word, bit in self._per_slot:
            want = _take(extra_slot_tables[name], slots[sel])
            bits |= np.where(rec[:, word] != want, bit, 0)

        hit = bits != 0
        e_hit = sel[hit]
        e_oor = np.flatnonzero(oor)
        rows = self._rows(e_hit.size + e_oor.size, tag)
        h = e_hit.size
        rows[:h, self._col_slot] = slots[e_hit]
        rows[:h, self._col_position] = rec[hit, self._position]
        rows[:h, self._col_token] = rec[hit, self._token]
        rows[:h, self._col_expected_token] = exp_tok[e_hit]
        rows[:h, self._col_chain] = link[hit]
        rows[:h, self._col_aux] = expected_chain[hit]
        rows[:h, self._col_bits] = bits[hit]
        rows[h:, self._col_slot] = slots[e_oor]
        rows[h:, self._col_expected_token] = exp_tok[e_oor]
        rows[h:, self._col_aux] = np.where(prev_oor[e_oor], prevs[e_oor], slots[e_oor])  # the bad index
        rows[h:, self._col_bits] = self._bit_oor
        self._append_rows(context, rows, np.concatenate([e_hit, e_oor]))

    # -- write (docs/semantics.md §5.1) ------------------------------------------------------------------------
    def write(self, *, context: Context, plan: Plan, input_ids: torch.Tensor, positions: torch.Tensor,
              out_cache_loc: torch.Tensor, enable_write_input_assert: bool,
              expected_input_tokens: Optional[torch.Tensor], expected_input_positions: Optional[torch.Tensor],
              extra_inputs: dict[str, torch.Tensor]) -> None:
        context.kernel_run_counter.add_(1)
        cap = int(plan.write_seed_slot_indices.shape[0])
        reqs = min(max(_scalar(plan.write_num_valid_reqs), 0), cap)
        total = int(input_ids.shape[0])
        if reqs == 0 or total == 0:
            return
        buf = context.canary_buf
        num_slots = int(buf.shape[0])
        tag = int(context.kernel_kind)
        offs = _np(plan.write_offsets[: reqs + 1])
        seeds = _np(plan.write_seed_slot_indices[:reqs])
        start = np.clip(offs[:-1], 0, total)
        lens = np.maximum(np.clip(offs[1:], 0, total) - start, 0)
        req, rank = _segments(lens)                 # one job per (request, entry), request by request
        if req.size == 0:
            return
        entry = start[req] + rank
        loc = _np(out_cache_loc)[entry]
        seed_oor = (seeds >= num_slots) & (lens > 0)
        valid = ~seed_oor[req] & (loc >= 0)
        slot_oor = valid & (loc >= num_slots)
        cand = valid & ~slot_oor
        fp_c, kv_oor_c = self._fingerprint(loc[cand], context.real_kv_sources, context.real_kv_hash_mode)
        job_oor = slot_oor.copy()
        job_oor[cand] = kv_oor_c
        stored = cand.copy()
        stored[cand] = ~kv_oor_c
        fp = fp_c[~kv_oor_c]

        # Stored entries, in order; `words`: the record words each one stores but its prev_hash.
        sj = np.flatnonzero(stored)
        s_req, s_entry, s_slot = req[sj], entry[sj], loc[sj]
        s_tok = _np(input_ids)[s_entry]
        s_pos = _np(positions)[s_entry]
        words = {self._token: s_tok, self._position: s_pos, self._kv: fp}
        for name, word in self._input_words:
            words[word] = _np(extra_inputs[name])[s_entry]
        count = sj.size

        # Seeds: HEAD (< 0), a record in the buffer, or an entry stored earlier in this launch.
        seed_ok = (seeds >= 0) & (seeds < num_slots)
        seed_link = np.full(reqs, self._head, dtype=np.int64)
        seed_pos = np.zeros(reqs, dtype=np.int64)
        if seed_ok.any():
            seed_rec = _gather_records(buf, seeds[seed_ok])
            seed_link[seed_ok] = self._link_records(seed_rec)
            seed_pos[seed_ok] = seed_rec[:, self._position]
        per_req = np.bincount(s_req, minlength=reqs)
        deps = np.full(reqs, -1, dtype=np.int64)
        if count and seed_ok.any():
            # The last stored entry before request r's first one with slot == seed: stored entries run
            # request by request, so (slot, entry) keys order them by slot, then request, then entry.
            key = np.sort(s_slot * count + np.arange(count))
            at = np.searchsorted(key, np.maximum(seeds, 0) * count + _excl_cumsum(per_req)) - 1
            cand_dep = key[np.maximum(at, 0)] % count
            has = seed_ok & (at >= 0) & (s_slot[cand_dep] == seeds)
            deps = np.where(has, cand_dep, -1)
            seed_pos = np.where(has, s_pos[cand_dep], seed_pos)

        # The serial chain.
        fold_values = [words[w].view(U64) for w in self._fold_words]
        s_prev = run_chains(per_req, seed_link.view(U64), deps, fold_values).view(np.int64)

        # Violation rows, keyed by (job, step) so they land in entry order: seed, range, input, position.
        parts, keys = [], []
        job_base = _excl_cumsum(lens)
        r_bad = np.flatnonzero(seed_oor & (lens > 0))
        if r_bad.size:
            parts.append(self._oor_rows(tag, seeds[r_bad]))
            keys.append(job_base[r_bad] * 4)
        j_bad = np.flatnonzero(job_oor)
        if j_bad.size:
            parts.append(self._oor_rows(tag, loc[j_bad]))
            keys.append(j_bad * 4 + 1)
        if enable_write_input_assert and count:
            assert expected_input_tokens is not None and expected_input_positions is not None  # validated
            want_tok = _np(expected_input_tokens)[s_entry]
            want_pos = _np(expected_input_positions)[s_entry]
            bits = (np.where(s_tok != want_tok, self._bit_write_token, 0)
                    | np.where(s_pos != want_pos, self._bit_write_position, 0))
            hit = bits != 0
            parts.append(self._write_rows(tag, hit, s_slot, s_pos, s_tok, want_tok, s_prev, want_pos, bits[hit]))
            keys.append(sj[hit] * 4 + 2)
        if count and _scalar(context.enable_chain_position_assert) != 0:
            first = np.ones(count, dtype=bool)
            first[1:] = s_req[1:] != s_req[:-1]
            prev_pos = np.empty(count, dtype=np.int64)
            prev_pos[1:] = s_pos[:-1]
            prev_pos[first] = seed_pos[s_req[first]]
            want = prev_pos + 1
            hit = (seeds[s_req] >= 0) & (s_pos != want)
            parts.append(self._write_rows(tag, hit, s_slot, s_pos, s_tok, s_tok, s_prev, want, self._bit_write_position))
            keys.append(sj[hit] * 4 + 3)
        if parts:
            self._append_rows(context, np.concatenate(parts), np.concatenate(keys))

        # Store the records (last write to a slot wins) and count them.
        if count:
            keep = _keep_last(s_slot)
            words[self._link] = s_prev
            index = np.array(list(words), dtype=np.int64)
            vals = np.stack(list(words.values()), 1)[keep]
            dev = buf.device
            rows_t = torch.from_numpy(s_slot[keep]).to(dev)
            buf.view(torch.int64)[rows_t[:, None], torch.from_numpy(index).to(dev)[None, :]] = torch.from_numpy(vals).to(dev)
        context.slot_run_counter.add_(count)

    def _write_rows(self, tag: int, hit: np.ndarray, slot: np.ndarray, pos: np.ndarray, tok: np.ndarray,
                    want_tok: np.ndarray, prev: np.ndarray, want_pos: np.ndarray, bits: Any) -> np.ndarray:
        """Rows of the stored entries `hit` that failed a write check."""
        rows = self._rows(int(hit.sum()), tag)
        rows[:, self._col_slot] = slot[hit]
        rows[:, self._col_position] = pos[hit]
        rows[:, self._col_token] = tok[hit]
        rows[:, self._col_expected_token] = want_tok[hit]
        rows[:, self._col_chain] = prev[hit]
        rows[:, self._col_aux] = want_pos[hit]
        rows[:, self._col_bits] = bits
        return rows

    # -- plan (docs/semantics.md §5.3) -------------------------------------------------------------------------
    # Two stages, as the kernels run it: offsets (the write plan, the per-request verify entry offsets
    # and the overflow decision), then entries (from those offsets). `plan` computes both before it
    # stores anything, so an error leaves every output untouched; the stages alone store what they compute.
    def _translate(self, values: np.ndarray, lut: Optional[torch.Tensor]) -> np.ndarray:
        """SWA LUT: negative values pass through; an index outside the LUT is an error (§7)."""
        if lut is None or values.size == 0:
            return values
        n = int(lut.shape[0])
        bad = values >= n
        if bad.any():
            raise self._fail("swa_index", s=int(values[bad][0]), n=n)
        out = values.copy()
        pos = values >= 0
        out[pos] = _take(lut, values[pos])
        return out

    def _verify_ranges(self, rp: np.ndarray, pre: np.ndarray, req_to_token: torch.Tensor,
                       swa_window_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(active, window start, verify count) per request: positions [start, clamped prefix) are verified."""
        rows, max_ctx = int(req_to_token.shape[0]), int(req_to_token.shape[1])
        window = int(swa_window_size)
        active = (rp != self._pad_req) & (rp >= 0) & (rp < rows)
        pre_c = np.clip(pre, 0, max_ctx)
        start = np.maximum(pre_c - window, 0) if window > 0 else np.zeros(rp.size, dtype=np.int64)
        return active, start, np.where(active, pre_c - start, 0)

    def _offsets_stage(self, *, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                       extend_seq_lens: torch.Tensor, req_to_token: torch.Tensor, lut: Optional[torch.Tensor],
                       swa_window_size: int, write_req_capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(write offsets [cap + 1], seeds [bs], verify offsets [bs + 1]) of a batch."""
        rp, pre, ext = _np(req_pool_indices), _np(prefix_lens), _np(extend_seq_lens)
        bs, max_ctx = rp.size, int(req_to_token.shape[1])
        active, _, counts = self._verify_ranges(rp, pre, req_to_token, swa_window_size)
        # Write plan: offsets over active extends, seeds at the last prefix slot.
        offsets = np.zeros(write_req_capacity + 1, dtype=np.int64)
        offsets[1: bs + 1] = np.cumsum(np.where(active, np.maximum(ext, 0), 0))
        seeded = active & (pre > 0) & (ext > 0)
        seeds = np.full(bs, self._unknown, dtype=np.int64)
        last = np.minimum(pre[seeded] - 1, max_ctx - 1)
        seeds[seeded] = self._translate(_table(req_to_token, rp[seeded], last), lut)
        return offsets, seeds, np.concatenate(([0], np.cumsum(counts))).astype(np.int64)

    def _entries_stage(self, *, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                       req_to_token: torch.Tensor, lut: Optional[torch.Tensor], swa_window_size: int,
                       verify_offsets: np.ndarray, limit: int, req_to_verify_expected_tokens: Optional[torch.Tensor],
                       req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor],
                       kv_token_id_vs_position_offset: int,
                       extra_request_values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """The first `limit` verify entries, request r owning [verify_offsets[r], verify_offsets[r + 1]):
        VerifyPlan array name -> int64 values."""
        rp = _np(req_pool_indices)
        _, start, _ = self._verify_ranges(rp, _np(prefix_lens), req_to_token, swa_window_size)
        req, rank = _segments(np.diff(verify_offsets))
        req, rank = req[:limit], rank[:limit]
        row = rp[req]
        pos = start[req] + rank
        slot = self._translate(_table(req_to_token, row, pos), lut)
        has_prev = pos > 0
        prev = np.where(has_prev, _table(req_to_token, row, np.maximum(pos - 1, 0)), self._unknown)
        if lut is not None:
            prev[has_prev] = self._translate(prev[has_prev], lut)
        tok = np.full(req.size, self._unknown, dtype=np.int64)
        if req_to_verify_expected_tokens is not None:
            assert req_to_verify_expected_tokens_valid_lens is not None  # validated: given with the tokens
            pool = req_to_verify_expected_tokens
            col = pos + int(kv_token_id_vs_position_offset)
            limit_col = np.minimum(_np(req_to_verify_expected_tokens_valid_lens)[req], int(pool.shape[1]))
            readable = (col >= 0) & (col < limit_col) & (row < int(pool.shape[0]))
            tok[readable] = _take(pool.view(-1), row[readable] * int(pool.shape[1]) + col[readable])
        entries = {"verify_slot_indices": slot, "verify_prev_slot_indices": prev,
                   "verify_expected_positions": pos, "verify_expected_tokens": tok}
        for name, _, _ in self._per_request:
            entries["verify_expected_" + name] = _np(extra_request_values[name])[req]
        return entries

    def plan(self, *, verify_plan_out: Plan, write_plan_out: Plan, req_pool_indices: torch.Tensor,
             prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, req_to_token: torch.Tensor,
             swa_window_size: int, full_to_swa_index_mapping: Optional[torch.Tensor], verify_capacity: int,
             req_to_verify_expected_tokens: Optional[torch.Tensor],
             req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor], kv_token_id_vs_position_offset: int,
             extra_request_values: dict[str, torch.Tensor]) -> None:
        lut = full_to_swa_index_mapping  # translates whenever given, window or not (§5.3)
        offsets, seeds, verify_offsets = self._offsets_stage(
            req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
            req_to_token=req_to_token, lut=lut, swa_window_size=swa_window_size,
            write_req_capacity=int(write_plan_out.write_seed_slot_indices.shape[0]))
        total, cap = int(verify_offsets[-1]), int(verify_capacity)
        entries = {}
        if 0 < total <= cap:
            entries = self._entries_stage(
                req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, req_to_token=req_to_token, lut=lut,
                swa_window_size=swa_window_size, verify_offsets=verify_offsets, limit=total,
                req_to_verify_expected_tokens=req_to_verify_expected_tokens,
                req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
                kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
                extra_request_values=extra_request_values)

        # Everything is computed (errors raised); now write the outputs in place.
        _store_offsets_stage(offsets=offsets, seeds=seeds, verify_offsets=verify_offsets, verify_capacity=cap,
                             out_write_offsets=write_plan_out.write_offsets,
                             out_write_seed_slot_indices=write_plan_out.write_seed_slot_indices,
                             out_write_num_valid_reqs=write_plan_out.write_num_valid_reqs,
                             out_verify_num_valid=verify_plan_out.verify_num_valid,
                             out_verify_enable=verify_plan_out.enable)
        _store_entries(entries, {name: getattr(verify_plan_out, name) for name in entries})

    def plan_offsets(self, *, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_seq_lens: torch.Tensor, req_to_token: torch.Tensor,
                     full_to_swa_index_mapping: Optional[torch.Tensor], out_verify_offsets_scratch: torch.Tensor,
                     out_write_offsets: torch.Tensor, out_write_seed_slot_indices: torch.Tensor,
                     out_verify_num_valid: torch.Tensor, out_verify_enable: torch.Tensor,
                     out_write_num_valid_reqs: torch.Tensor, swa_window_size: int, verify_capacity: int) -> None:
        """The plan's first stage; the scratch gets the verify offsets [bs + 1] (entries past them untouched)."""
        offsets, seeds, verify_offsets = self._offsets_stage(
            req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
            req_to_token=req_to_token, lut=full_to_swa_index_mapping,
            swa_window_size=swa_window_size, write_req_capacity=int(out_write_seed_slot_indices.shape[0]))
        _store_offsets_stage(offsets=offsets, seeds=seeds, verify_offsets=verify_offsets,
                             verify_capacity=verify_capacity, out_write_offsets=out_write_offsets,
                             out_write_seed_slot_indices=out_write_seed_slot_indices,
                             out_write_num_valid_reqs=out_write_num_valid_reqs,
                             out_verify_num_valid=out_verify_num_valid, out_verify_enable=out_verify_enable,
                             out_verify_offsets_scratch=out_verify_offsets_scratch)

    def plan_entries(self, *, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, req_to_token: torch.Tensor,
                     full_to_swa_index_mapping: Optional[torch.Tensor], verify_offsets_scratch: torch.Tensor,
                     verify_enable: torch.Tensor, req_to_verify_expected_tokens: Optional[torch.Tensor],
                     req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor],
                     out_verify_slot_indices: torch.Tensor, out_verify_expected_tokens: torch.Tensor,
                     out_verify_expected_positions: torch.Tensor, out_verify_prev_slot_indices: torch.Tensor,
                     kv_token_id_vs_position_offset: int, swa_window_size: int,
                     extra_request_values: dict[str, torch.Tensor],
                     out_extra_verify_expected: dict[str, torch.Tensor]) -> None:
        """The plan's second stage: nothing when the first disabled the plan, else the scratch's total
        (clamped to the capacity) entries from the offsets in the scratch."""
        if _scalar(verify_enable) == 0:
            return
        bs = int(req_pool_indices.shape[0])
        verify_offsets = _np(verify_offsets_scratch[: bs + 1]).astype(np.int64)
        limit = min(max(int(verify_offsets[-1]), 0), int(out_verify_slot_indices.shape[0]))
        if limit == 0:
            return
        entries = self._entries_stage(
            req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, req_to_token=req_to_token,
            lut=full_to_swa_index_mapping, swa_window_size=swa_window_size,
            verify_offsets=verify_offsets, limit=limit, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, extra_request_values=extra_request_values)
        outputs = {"verify_slot_indices": out_verify_slot_indices,
                   "verify_expected_tokens": out_verify_expected_tokens,
                   "verify_expected_positions": out_verify_expected_positions,
                   "verify_prev_slot_indices": out_verify_prev_slot_indices}
        for name, _, _ in self._per_request:
            outputs["verify_expected_" + name] = out_extra_verify_expected[name]
        _store_entries(entries, outputs)
