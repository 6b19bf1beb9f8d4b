"""Independent scalar oracle of the kernels (docs/semantics.md §2-§8): write, verify, plan and its two
stages (SGLang's launch_plan_offsets_kernel / launch_plan_entries_kernel), scatter, in plain Python ints.

It reads only numbers from the generated tree (word indices, fold order, bits, columns,
constants), never its logic: hashing, record access and every kernel are written out here as
scalar loops over bytes. It mutates the tensors of a case exactly like a backend would, so the
same `compare_state` applies. Slow by design; it is the check of the vectorised reference.
"""
from __future__ import annotations

import torch

M64 = (1 << 64) - 1


def sm64(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return x


def s64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >= (1 << 63) else x


def s32(x: int) -> int:
    x &= (1 << 32) - 1
    return x - (1 << 32) if x >= (1 << 31) else x


class Canary:
    """The canary buffer as bytes; field f of slot s is the little-endian int64 at s*stride + 8*f."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.stride = int(tensor.shape[1])
        self.num_slots = int(tensor.shape[0])
        self.data = bytearray(tensor.detach().cpu().contiguous().numpy().tobytes())

    def get(self, slot: int, word: int) -> int:
        at = slot * self.stride + 8 * word
        return int.from_bytes(self.data[at:at + 8], "little", signed=True)

    def put(self, slot: int, word: int, value: int) -> None:
        at = slot * self.stride + 8 * word
        self.data[at:at + 8] = s64(value).to_bytes(8, "little", signed=True)

    def flush(self) -> None:
        if self.data:
            self.tensor.copy_(torch.frombuffer(self.data, dtype=torch.uint8).view(self.tensor.shape))


class Ring:
    """The shared ring, its write index and (extension) the per-reason totals of every appended row."""

    def __init__(self, context, bits_column: int, reason_bits: tuple):
        self.context = context
        self.index = int(context.violation_write_index[0])
        self.cap = int(context.violation_ring.shape[0])
        self.stored: list[tuple[int, list[int]]] = []
        self.bits_column = bits_column
        self.reason_bits = reason_bits
        counts = getattr(context, "violation_reason_counts", None)
        self.counts = counts.tolist() if counts is not None else None

    def append(self, row: list[int]) -> None:
        i = self.index
        self.index = s32(self.index + 1)
        if 0 <= i < self.cap:
            self.stored.append((i, row))
        if self.counts is not None:          # counted whether the row was stored or dropped
            for column, bit in enumerate(self.reason_bits):
                if row[self.bits_column] & bit:
                    self.counts[column] += 1

    def flush(self) -> None:
        self.context.violation_write_index.fill_(self.index)
        for i, row in self.stored:
            self.context.violation_ring[i] = torch.tensor(row, dtype=torch.int64)
        if self.counts is not None:
            self.context.violation_reason_counts.copy_(torch.tensor(self.counts, dtype=torch.int64))


class Oracle:
    """Scalar kernels for one generated tree."""

    def __init__(self, tree):
        lay = tree.layout
        self.lay = lay
        self.token, self.position = lay.CANARY_TOKEN_WORD, lay.CANARY_POSITION_WORD
        self.link_word, self.kv_word = lay.CANARY_CHAIN_LINK_WORD, lay.CANARY_KV_FINGERPRINT_WORD
        self.fold = tuple(lay.CANARY_CHAIN_FOLD_WORDS)
        self.head = lay.CANARY_CHAIN_HEAD
        self.fr = lay.FailReason
        self.ncols = lay.VIOLATION_FIELDS
        self.inputs = tuple(lay.INPUT_FIELDS)
        self.pad_slot = lay.TOKEN_TO_KV_SLOT_PADDING
        self.pad_req = lay.REQ_POOL_IDX_PADDING
        self.partial = lay.REAL_KV_PARTIAL_READ_BYTES
        self.modes = lay.RealKvHashMode
        # Column i of the per-reason totals counts FailReason member i, in declaration order.
        self.reason_bits = tuple(int(m) for m in lay.FailReason)
        self.bits_column = lay.VIOLATION_COL_FAIL_REASON

    def ring(self, context) -> Ring:
        return Ring(context, self.bits_column, self.reason_bits)

    # -- shared pieces --------------------------------------------------------------------------
    def link(self, prev_hash: int, values: list[int]) -> int:
        acc = sm64(prev_hash)
        for v in values:
            acc = sm64(acc ^ (v & M64))
        return acc

    def slot_hash(self, buf: Canary, s: int) -> int:
        if s < 0:
            return self.head
        return self.link(buf.get(s, self.link_word), [buf.get(s, w) for w in self.fold])

    def row(self, **cols) -> list[int]:
        lay = self.lay
        out = [0] * self.ncols
        for meaning, value in cols.items():
            out[getattr(lay, "VIOLATION_COL_" + meaning.upper())] = s64(value)
        return out

    def oor_row(self, tag: int, slot: int, expected_token: int, bad: int) -> list[int]:
        return self.row(launch_tag=tag, slot=slot, expected_token=expected_token, expected_aux=bad,
                        fail_reason=int(self.fr.SLOT_OUT_OF_RANGE))

    def fingerprint(self, sources, mode: int, slot: int, cache: dict) -> tuple[int, bool]:
        """(fingerprint, out of range) of one slot, reading each source's row bytes."""
        if int(mode) == int(self.modes.NONE) or not sources:
            return 0, False
        total = 0
        for k, src in enumerate(sources):
            row = slot // src.page_size
            if row >= src.tensor.shape[0]:
                return 0, True
            n = self.partial if int(mode) == int(self.modes.PARTIAL) else src.read_bytes
            if getattr(src, "num_heads", 1) == 1 and getattr(src, "chunk_bytes", 0) == 0 and \
                    getattr(src, "token_group_size", 0) == 0 and \
                    getattr(src, "token_stride_bytes", src.num_bytes_per_token) == src.num_bytes_per_token:
                key = (k, row)
                if key not in cache:
                    cache[key] = src.tensor[row].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                data = cache[key]
                at = (slot % src.page_size) * src.num_bytes_per_token
                logical = data[at:at + n]
            else:
                logical = self.strided_bytes(src, slot, n, cache, k)
            h = 0
            for off in range(0, n, 8):
                h = sm64(h ^ int.from_bytes(logical[off:off + 8], "little"))
            total = sm64(total ^ h)
        return total, False

    @staticmethod
    def strided_bytes(src, slot: int, n: int, cache: dict, k: int) -> bytes:
        """The first n logical bytes of `slot` in a source with a layout (docs/semantics.md §4 as RealKvSource
        documents it), byte by byte from the tensor's storage: logical byte b is byte b % head of head
        b // head (head = num_bytes_per_token / num_heads), which is byte i % chunk_bytes of the head's
        chunk i // chunk_bytes (one chunk when chunk_bytes is 0); token t of a row starts t token strides
        in, or with token groups t // group group strides plus t % group token strides in; chunks in
        groups likewise."""
        key = ("storage", k)
        if key not in cache:
            t = src.tensor
            raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()) if t.is_cpu else \
                torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()
            cache[key] = (raw.numpy().tobytes(), t.storage_offset() * t.element_size())
        data, first = cache[key]
        head = src.num_bytes_per_token // src.num_heads
        row_stride = src.tensor.stride(0) * src.tensor.element_size()
        t, group = slot % src.page_size, getattr(src, "token_group_size", 0)
        token = t * src.token_stride_bytes if not group else \
            (t // group) * src.token_group_stride_bytes + (t % group) * src.token_stride_bytes
        base = first + (slot // src.page_size) * row_stride + token
        out = bytearray()
        for b in range(n):
            h, i = b // head, b % head
            chunk = src.chunk_bytes or head
            c, group = i // chunk, getattr(src, "chunk_group_size", 0)
            at_chunk = c * src.chunk_stride_bytes if not group else \
                (c // group) * src.chunk_group_stride_bytes + (c % group) * src.chunk_stride_bytes
            at = base + h * src.head_stride_bytes + at_chunk + i % chunk
            out.append(data[at])
        return bytes(out)

    # -- verify ---------------------------------------------------------------------------------
    def verify(self, *, context, plan, check_verify_expected_token, extra_slot_tables=None) -> None:
        context.kernel_run_counter.add_(1)
        if int(plan.enable[0]) == 0:
            return
        cap = plan.verify_slot_indices.shape[0]
        n = min(max(int(plan.verify_num_valid[0]), 0), cap)
        context.slot_run_counter.add_(n)
        buf, ring, cache = Canary(context.canary_buf), self.ring(context), {}
        tag = int(context.kernel_kind)
        slots = plan.verify_slot_indices.tolist()
        prevs = plan.verify_prev_slot_indices.tolist()
        exp_toks = plan.verify_expected_tokens.tolist()
        exp_pos = plan.verify_expected_positions.tolist()
        per_req = {f.name: getattr(plan, "verify_expected_" + f.name).tolist()
                   for f in self.inputs if f.verify_expected == "per_request"}
        tables = {name: t.tolist() for name, t in (extra_slot_tables or {}).items()}
        for i in range(n):
            slot, prev = slots[i], prevs[i]
            if slot == self.pad_slot:
                continue
            exp_tok = exp_toks[i] if check_verify_expected_token else -1
            if slot < 0 or slot >= buf.num_slots:
                ring.append(self.oor_row(tag, slot, exp_tok, slot))
                continue
            if prev >= buf.num_slots:
                ring.append(self.oor_row(tag, slot, exp_tok, prev))
                continue
            fp, bad = self.fingerprint(context.real_kv_sources, context.real_kv_hash_mode, slot, cache)
            if bad:
                ring.append(self.oor_row(tag, slot, exp_tok, slot))
                continue
            stored_tok, stored_pos = buf.get(slot, self.token), buf.get(slot, self.position)
            stored_chain, stored_kv = buf.get(slot, self.link_word), buf.get(slot, self.kv_word)
            bits = 0
            reachable = prev != self.pad_slot
            expected_chain = s64(self.slot_hash(buf, prev)) if reachable else stored_chain
            if reachable and stored_chain != expected_chain:
                bits |= int(self.fr.VERIFY_CHAIN_HASH_MISMATCH)
            if exp_tok != -1 and stored_tok != exp_tok:
                bits |= int(self.fr.VERIFY_TOKEN_MISMATCH)
            if stored_pos != exp_pos[i]:
                bits |= int(self.fr.VERIFY_POSITION_MISMATCH)
            if stored_kv != s64(fp):
                bits |= int(self.fr.VERIFY_REAL_KV_HASH_MISMATCH)
            for f in self.inputs:
                stored = buf.get(slot, f.word)
                if f.verify_expected == "per_request":
                    want = per_req[f.name][i]
                    if want != -1 and stored != want:
                        bits |= int(self.fr[f.fail_reason])
                elif f.verify_expected == "per_slot" and stored != tables[f.name][slot]:
                    bits |= int(self.fr[f.fail_reason])
            if bits:
                ring.append(self.row(launch_tag=tag, slot=slot, stored_position=stored_pos, stored_token=stored_tok,
                                     expected_token=exp_tok, stored_chain_hash=stored_chain,
                                     expected_aux=expected_chain, fail_reason=bits))
        ring.flush()

    # -- write ----------------------------------------------------------------------------------
    def write(self, *, context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
              expected_input_tokens=None, expected_input_positions=None, extra_inputs=None) -> None:
        context.kernel_run_counter.add_(1)
        cap = plan.write_seed_slot_indices.shape[0]
        reqs = min(max(int(plan.write_num_valid_reqs[0]), 0), cap)
        buf, ring, cache = Canary(context.canary_buf), self.ring(context), {}
        tag = int(context.kernel_kind)
        offs, seeds = plan.write_offsets.tolist(), plan.write_seed_slot_indices.tolist()
        toks, poss, locs = input_ids.tolist(), positions.tolist(), out_cache_loc.tolist()
        extras = {name: t.tolist() for name, t in (extra_inputs or {}).items()}
        if enable_write_input_assert:
            want_toks, want_poss = expected_input_tokens.tolist(), expected_input_positions.tolist()
        flag = int(context.enable_chain_position_assert[0])
        total = len(toks)
        stored_count = 0
        for r in range(reqs):
            lo = min(max(offs[r], 0), total)
            hi = min(max(offs[r + 1], 0), total)
            if hi <= lo:
                continue
            seed = seeds[r]
            if seed >= buf.num_slots:
                ring.append(self.oor_row(tag, seed, -1, seed))
                continue
            running = self.slot_hash(buf, seed)
            assert_pos = seed >= 0 and flag != 0
            prev_pos = buf.get(seed, self.position) if seed >= 0 else 0
            for i in range(lo, hi):
                slot = locs[i]
                if slot < 0:
                    continue
                if slot >= buf.num_slots:
                    ring.append(self.oor_row(tag, slot, -1, slot))
                    continue
                fp, bad = self.fingerprint(context.real_kv_sources, context.real_kv_hash_mode, slot, cache)
                if bad:
                    ring.append(self.oor_row(tag, slot, -1, slot))
                    continue
                tok, pos = toks[i], poss[i]
                if enable_write_input_assert:
                    bits = 0
                    if tok != want_toks[i]:
                        bits |= int(self.fr.WRITE_TOKEN_MISMATCH)
                    if pos != want_poss[i]:
                        bits |= int(self.fr.WRITE_POSITION_MISMATCH)
                    if bits:
                        ring.append(self.row(launch_tag=tag, slot=slot, stored_position=pos, stored_token=tok,
                                             expected_token=want_toks[i], stored_chain_hash=running,
                                             expected_aux=want_poss[i], fail_reason=bits))
                if assert_pos:
                    want = s64(prev_pos + 1)
                    if pos != want:
                        ring.append(self.row(launch_tag=tag, slot=slot, stored_position=pos, stored_token=tok,
                                             expected_token=tok, stored_chain_hash=running, expected_aux=want,
                                             fail_reason=int(self.fr.WRITE_POSITION_MISMATCH)))
                    prev_pos = pos
                buf.put(slot, self.token, tok)
                buf.put(slot, self.position, pos)
                buf.put(slot, self.link_word, running)
                buf.put(slot, self.kv_word, fp)
                for f in self.inputs:
                    buf.put(slot, f.word, extras[f.name][i])
                running = self.slot_hash(buf, slot)
                stored_count += 1
        context.slot_run_counter.add_(stored_count)
        buf.flush()
        ring.flush()

    # -- plan -----------------------------------------------------------------------------------
    def plan(self, *, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
             swa_window_size, full_to_swa_index_mapping, verify_capacity, req_to_verify_expected_tokens=None,
             req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
             extra_request_values=None) -> None:
        rps, pres, exts = req_pool_indices.tolist(), prefix_lens.tolist(), extend_seq_lens.tolist()
        r2t = req_to_token.tolist()
        rows = len(r2t)
        max_ctx = req_to_token.shape[1]
        # A given LUT translates every slot, window or not (docs/semantics.md §5.3).
        lut = full_to_swa_index_mapping.tolist() if full_to_swa_index_mapping is not None else None
        pool = req_to_verify_expected_tokens.tolist() if req_to_verify_expected_tokens is not None else None
        valid = req_to_verify_expected_tokens_valid_lens.tolist() if pool is not None else None
        extras = {name: t.tolist() for name, t in (extra_request_values or {}).items()}
        per_req = [f.name for f in self.inputs if f.verify_expected == "per_request"]

        def lut_of(x):
            if lut is None or x < 0:
                return x
            if x >= len(lut):
                raise ValueError(f"kv-canary: SWA slot {x} is outside full_to_swa_index_mapping length {len(lut)}")
            return lut[x]

        bs = len(rps)
        wcap = write_plan_out.write_seed_slot_indices.shape[0]
        offsets = [0] * (wcap + 1)
        seeds = []
        entries = []
        acc = 0
        for r in range(bs):
            row = rps[r]
            active = row != self.pad_req and 0 <= row < rows
            pre = min(max(pres[r], 0), max_ctx)
            if active:
                acc += max(exts[r], 0)
            offsets[r + 1] = acc
            if active and pres[r] > 0 and exts[r] > 0:
                seeds.append(lut_of(r2t[row][min(pres[r] - 1, max_ctx - 1)]))
            else:
                seeds.append(-1)
            if not active:
                continue
            start = max(0, pre - swa_window_size) if swa_window_size > 0 else 0
            for p in range(start, pre):
                entries.append((r, row, p))
        total = len(entries)
        out = []
        if total <= verify_capacity:
            for r, row, p in entries:
                slot = lut_of(r2t[row][p])
                prev = lut_of(r2t[row][p - 1]) if p > 0 else -1
                tok = -1
                if pool is not None:
                    col = p + kv_token_id_vs_position_offset
                    if 0 <= col < min(valid[r], len(pool[0]) if pool else 0) and row < len(pool):
                        tok = pool[row][col]
                out.append((slot, prev, p, tok, [extras[name][r] for name in per_req]))
        write_plan_out.write_offsets.copy_(torch.tensor(offsets, dtype=torch.int64))
        for r, s in enumerate(seeds):
            write_plan_out.write_seed_slot_indices[r] = s
        write_plan_out.write_num_valid_reqs[0] = bs
        if total > verify_capacity:
            verify_plan_out.enable[0] = 0
            verify_plan_out.verify_num_valid[0] = verify_capacity
            return
        verify_plan_out.enable[0] = 1
        verify_plan_out.verify_num_valid[0] = total
        if not total:
            return
        columns = list(zip(*[(slot, prev, p, tok, *vals) for slot, prev, p, tok, vals in out]))
        names = ["verify_slot_indices", "verify_prev_slot_indices", "verify_expected_positions",
                 "verify_expected_tokens", *("verify_expected_" + name for name in per_req)]
        for name, column in zip(names, columns):
            getattr(verify_plan_out, name)[:total] = torch.tensor(column, dtype=torch.int64)

    # -- the plan's two stages, from SGLang's flat arguments ----------------------------------------
    def _verify_positions(self, rps, pres, req_to_token, window) -> list:
        """Per request: (pool row, active, the positions its verify entries cover)."""
        rows, max_ctx = req_to_token.shape
        out = []
        for row, pre in zip(rps, pres):
            active = row != self.pad_req and 0 <= row < rows
            pre = min(max(pre, 0), max_ctx)
            start = max(0, pre - window) if window > 0 else 0
            out.append((row, active, list(range(start, pre)) if active else []))
        return out

    @staticmethod
    def _lut_of(lut, x: int) -> int:
        if lut is None or x < 0:
            return x
        if x >= len(lut):
            raise ValueError(f"kv-canary: SWA slot {x} is outside full_to_swa_index_mapping length {len(lut)}")
        return lut[x]

    def plan_offsets(self, *, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, full_to_swa_index_mapping,
                     out_verify_offsets_scratch, out_write_offsets, out_write_seed_slot_indices, out_verify_num_valid,
                     out_verify_enable, out_write_num_valid_reqs, swa_window_size, verify_capacity) -> None:
        rps, pres, exts = req_pool_indices.tolist(), prefix_lens.tolist(), extend_seq_lens.tolist()
        r2t = req_to_token.tolist()
        max_ctx = req_to_token.shape[1]
        lut = full_to_swa_index_mapping.tolist() if full_to_swa_index_mapping is not None else None
        reqs = self._verify_positions(rps, pres, req_to_token, swa_window_size)
        bs = len(rps)
        writes = 0
        verifies = 0
        out_write_offsets.zero_()
        for r, (row, active, positions) in enumerate(reqs):
            out_write_offsets[r] = writes
            out_verify_offsets_scratch[r] = verifies
            seed = -1
            if active and pres[r] > 0 and exts[r] > 0:
                seed = self._lut_of(lut, r2t[row][min(pres[r] - 1, max_ctx - 1)])
            out_write_seed_slot_indices[r] = seed
            writes += max(exts[r], 0) if active else 0
            verifies += len(positions)
        out_write_offsets[bs] = writes
        out_verify_offsets_scratch[bs] = verifies
        out_write_num_valid_reqs[0] = bs
        out_verify_enable[0] = 0 if verifies > verify_capacity else 1
        out_verify_num_valid[0] = min(verifies, verify_capacity)

    def plan_entries(self, *, req_pool_indices, prefix_lens, req_to_token, full_to_swa_index_mapping,
                     verify_offsets_scratch, verify_enable, req_to_verify_expected_tokens,
                     req_to_verify_expected_tokens_valid_lens, out_verify_slot_indices, out_verify_expected_tokens,
                     out_verify_expected_positions, out_verify_prev_slot_indices, kv_token_id_vs_position_offset,
                     swa_window_size, extra_request_values=None, out_extra_verify_expected=None) -> None:
        if int(verify_enable[0]) == 0:
            return
        rps = req_pool_indices.tolist()
        r2t = req_to_token.tolist()
        lut = full_to_swa_index_mapping.tolist() if full_to_swa_index_mapping is not None else None
        pool = req_to_verify_expected_tokens.tolist() if req_to_verify_expected_tokens is not None else None
        valid = req_to_verify_expected_tokens_valid_lens.tolist() if pool is not None else None
        scratch = verify_offsets_scratch.tolist()
        limit = min(scratch[len(rps)], out_verify_slot_indices.shape[0])
        for r, (row, _, positions) in enumerate(self._verify_positions(rps, prefix_lens.tolist(), req_to_token,
                                                                       swa_window_size)):
            for k, p in enumerate(positions):
                e = scratch[r] + k
                if e >= limit:
                    break
                out_verify_slot_indices[e] = self._lut_of(lut, r2t[row][p])
                out_verify_prev_slot_indices[e] = self._lut_of(lut, r2t[row][p - 1]) if p > 0 else -1
                out_verify_expected_positions[e] = p
                tok = -1
                if pool is not None:
                    col = p + kv_token_id_vs_position_offset
                    if 0 <= col < min(valid[r], len(pool[0]) if pool else 0) and row < len(pool):
                        tok = pool[row][col]
                out_verify_expected_tokens[e] = tok
                for name, values in (extra_request_values or {}).items():
                    out_extra_verify_expected[name][e] = int(values[r])

    # -- scatter --------------------------------------------------------------------------------
    def scatter(self, *, flat_in, offsets, req_pool_indices, pool_out) -> None:
        flat, offs, rps = flat_in.tolist(), offsets.tolist(), req_pool_indices.tolist()
        pool = pool_out.tolist()
        rows, cols = pool_out.shape
        for r, row in enumerate(rps):
            lo = min(max(offs[r], 0), len(flat))
            hi = min(max(offs[r + 1], 0), len(flat))
            if not 0 <= row < rows:
                continue
            for c in range(max(0, min(hi - lo, cols))):
                pool[row][c] = s32(flat[lo + c])
        if rows and cols:
            pool_out.copy_(torch.tensor(pool, dtype=torch.int32))
