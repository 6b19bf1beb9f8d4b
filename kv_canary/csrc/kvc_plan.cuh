// plan (docs/semantics.md §5.3): two kernels turn a batch's requests into verify entries and a write
// plan. kvc_plan::offsets (one block) scans the requests in chunks of blockDim (so any batch size
// works) and writes the verify entry offsets (scratch for entries), the write plan and the overflow
// decision: total > capacity -> enable = 0, num_valid = capacity, and entries leaves the entry
// arrays untouched. kvc_plan::entries (one thread per verify entry, grid-stride) finds each entry's
// request by binary search over those offsets and fills the entry arrays.
//
// Reads stay inside req_to_token, the SWA LUT and the expected-token pool: an index that cannot be
// read without leaving either becomes kvc::PLAN_UNREADABLE_INDEX, which verify and write report as
// SLOT_OUT_OF_RANGE, and a request row outside req_to_token is inactive: a kernel cannot raise. The
// host backends (torch, emulated, cpu) raise a ValueError for both before launching
// (HostChecks, kv_canary/launch/operations.py).
//
// Hand-written and schema-independent (the schema reaches it through kv_canary_layout.cuh, included
// first); the generated cuda/<kernel>.cu of each plan kernel defines its entry point over this.
#pragma once

namespace kvc_plan {

// req_to_token: int32 [rows, cols] with a row stride in elements.
struct ReqToToken {
  const int* __restrict__ data;
  kvc_i64 rows, cols, row_stride;
};

// The SWA LUT (full index -> SWA index), or a null pointer for none.
struct SwaLut {
  const kvc_i64* __restrict__ data;
  kvc_i64 len;
};

// req_to_token[row, col] as int64, or PLAN_UNREADABLE_INDEX outside the tensor.
__device__ __forceinline__ kvc_i64 read_req_to_token(const ReqToToken& t, kvc_i64 row, kvc_i64 col) {
  if (row < 0 || row >= t.rows || col < 0 || col >= t.cols) return kvc::PLAN_UNREADABLE_INDEX;
  return static_cast<kvc_i64>(t.data[row * t.row_stride + col]);
}

// LUT translation when a LUT is given: negative values pass through, indices past it are unreadable.
__device__ __forceinline__ kvc_i64 translate(const SwaLut& lut, kvc_i64 slot) {
  if (lut.data == nullptr || slot < 0) return slot;
  if (slot >= lut.len) return kvc::PLAN_UNREADABLE_INDEX;
  return lut.data[slot];
}

// A request takes part iff its pool row is not the padding row and lies inside req_to_token.
__device__ __forceinline__ bool active_request(kvc_i64 row, kvc_i64 rows) {
  return row != kvc::REQ_POOL_IDX_PADDING && row >= 0 && row < rows;
}

// Verify positions of a request: [window_start, prefix) with prefix clamped to [0, cols].
__device__ __forceinline__ kvc_i64 clamp_prefix(kvc_i64 prefix, kvc_i64 cols) {
  return prefix < 0 ? 0 : (prefix > cols ? cols : prefix);
}

__device__ __forceinline__ kvc_i64 window_start(kvc_i64 prefix, kvc_i64 window) {
  if (window <= 0) return 0;
  return prefix > window ? prefix - window : 0;
}

// The batch both kernels plan: each request's pool row and prefix length, and where its tokens' slots are.
struct Batch {
  const kvc_i64* __restrict__ req_pool_indices;
  const kvc_i64* __restrict__ prefix_lens;
  kvc_i64 batch_size;
  ReqToToken req_to_token;
  kvc_i64 swa_window_size;
  SwaLut swa_lut;
};

// -- offsets: the first kernel ---------------------------------------------------------------------
struct OffsetsArgs {
  Batch batch;
  const kvc_i64* __restrict__ extend_seq_lens;
  kvc_i64 verify_capacity;
  kvc_i64* __restrict__ verify_offsets;
  kvc_i64* __restrict__ write_offsets;
  kvc_i64* __restrict__ write_seed_slot_indices;
  int* __restrict__ write_num_valid_reqs;
  kvc_i64 write_req_capacity;
  int* __restrict__ verify_num_valid;
  int* __restrict__ verify_enable;
};

// Exclusive block-wide prefix sum of v; every thread of the block must call it. *total = sum.
// Sums wrap modulo 2^64 (unsigned: no overflow UB), as the reference's int64 cumsum does; the
// validators bound the verify counts' sum (batch size x req_to_token columns) below 2^63, only
// the write plan's extend lengths are arbitrary device values.
__device__ __forceinline__ kvc_u64 block_scan(kvc_u64 v, kvc_u64* warp_sums, kvc_u64* total) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const unsigned num_warps = blockDim.x >> 5;
  kvc_u64 incl = v;
  for (unsigned d = 1; d < 32; d <<= 1) {
    const kvc_u64 up = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    kvc_u64 w = lane < num_warps ? warp_sums[lane] : 0;
    for (unsigned d = 1; d < 32; d <<= 1) {
      const kvc_u64 up = __shfl_up_sync(0xFFFFFFFFu, w, d);
      if (lane >= d) w += up;
    }
    if (lane < num_warps) warp_sums[lane] = w;  // inclusive warp prefixes
  }
  __syncthreads();
  const kvc_u64 before = (warp == 0 ? 0 : warp_sums[warp - 1]) + incl - v;
  *total = warp_sums[num_warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// Request r's part of the plan: its verify entries, its write entries and its write seed.
struct RequestPlan {
  kvc_i64 verify_count, write_count, seed;
};
__device__ __forceinline__ RequestPlan plan_request(const OffsetsArgs& a, kvc_i64 r) {
  const Batch& b = a.batch;
  RequestPlan p{0, 0, kvc::UNKNOWN};
  const kvc_i64 row = b.req_pool_indices[r];
  const kvc_i64 prefix = b.prefix_lens[r];
  const kvc_i64 extend = a.extend_seq_lens[r];
  if (active_request(row, b.req_to_token.rows)) {
    const kvc_i64 cols = b.req_to_token.cols;
    const kvc_i64 verified = clamp_prefix(prefix, cols);
    p.verify_count = verified - window_start(verified, b.swa_window_size);
    p.write_count = extend > 0 ? extend : 0;
    if (prefix > 0 && extend > 0) {
      const kvc_i64 col = prefix - 1 < cols - 1 ? prefix - 1 : cols - 1;
      p.seed = translate(b.swa_lut, read_req_to_token(b.req_to_token, row, col));
    }
  }
  return p;
}

// Request r's outputs, given the entries of the requests before it.
__device__ __forceinline__ void store_request(const OffsetsArgs& a, kvc_i64 r, kvc_u64 verify_before,
                                              kvc_u64 write_before, kvc_i64 seed) {
  a.verify_offsets[r] = static_cast<kvc_i64>(verify_before);
  if (r <= a.write_req_capacity) a.write_offsets[r] = static_cast<kvc_i64>(write_before);
  if (r < a.write_req_capacity) a.write_seed_slot_indices[r] = seed;
}

// The batch's totals and the overflow decision (one thread; write_offsets past bs + 1 zeroed already).
__device__ __forceinline__ void store_totals(const OffsetsArgs& a, kvc_u64 verify_total, kvc_u64 write_total) {
  const kvc_i64 batch_size = a.batch.batch_size;
  const kvc_i64 verify_sum = static_cast<kvc_i64>(verify_total);
  a.verify_offsets[batch_size] = verify_sum;
  if (batch_size <= a.write_req_capacity) a.write_offsets[batch_size] = static_cast<kvc_i64>(write_total);
  *a.write_num_valid_reqs = static_cast<int>(batch_size);  // <= write_req_capacity <= INT_MAX (validated)
  const bool overflow = verify_sum > a.verify_capacity;
  *a.verify_enable = overflow ? 0 : 1;
  *a.verify_num_valid = static_cast<int>(overflow ? a.verify_capacity : verify_sum);  // capacity <= INT_MAX
}

template <int kThreads>
__device__ __forceinline__ void offsets(const OffsetsArgs& a) {
  static_assert(kThreads % 32 == 0, "the offsets kernel scans with whole warps");
  __shared__ kvc_u64 warp_sums[32];
  const kvc_i64 batch_size = a.batch.batch_size;
  kvc_u64 verify_carry = 0, write_carry = 0;  // identical in every thread
  for (kvc_i64 base = 0; base < batch_size; base += blockDim.x) {
    const kvc_i64 r = base + threadIdx.x;
    const RequestPlan p = r < batch_size ? plan_request(a, r) : RequestPlan{0, 0, kvc::UNKNOWN};
    kvc_u64 verify_total, write_total;
    const kvc_u64 verify_before = block_scan(static_cast<kvc_u64>(p.verify_count), warp_sums, &verify_total);
    const kvc_u64 write_before = block_scan(static_cast<kvc_u64>(p.write_count), warp_sums, &write_total);
    if (r < batch_size) store_request(a, r, verify_carry + verify_before, write_carry + write_before, p.seed);
    verify_carry += verify_total;
    write_carry += write_total;
  }
  // Entries past bs + 1 of write_offsets are zeroed.
  for (kvc_i64 i = batch_size + 1 + threadIdx.x; i <= a.write_req_capacity; i += blockDim.x) a.write_offsets[i] = 0;
  if (threadIdx.x == 0) store_totals(a, verify_carry, write_carry);
}

// -- entries: the second kernel --------------------------------------------------------------------
// Takes SGLang's launch_plan_entries_kernel arguments, which carry no num_valid: the entry count is
// the offsets' total (verify_offsets[bs]), clamped to the capacity.
struct EntriesArgs {
  Batch batch;
  const kvc_i64* __restrict__ verify_offsets;
  const int* __restrict__ verify_enable;
  kvc_i64 verify_capacity;
  const int* __restrict__ req_to_verify_expected_tokens;  // [rows, cols] with a row stride, or null
  kvc_i64 expected_tokens_rows, expected_tokens_cols, expected_tokens_row_stride;
  const kvc_i64* __restrict__ req_to_verify_expected_tokens_valid_lens;
  kvc_i64 kv_token_id_vs_position_offset;
  kvc_i64* __restrict__ verify_slot_indices;
  kvc_i64* __restrict__ verify_expected_tokens;
  kvc_i64* __restrict__ verify_expected_positions;
  kvc_i64* __restrict__ verify_prev_slot_indices;
  // per_request verified input fields, in PerRequestWords order: request_value_<field> (one value
  // per request) copied into verify_expected_<field> (one per entry).
  kvc::PointerList<const kvc_i64, kvc::PerRequestWords::count> request_values;
  kvc::PointerList<kvc_i64, kvc::PerRequestWords::count> expected;
};

// The entries the second kernel fills: the offsets' total clamped to the capacity, 0 when disabled.
__device__ __forceinline__ kvc_i64 active_entries(const EntriesArgs& a) {
  if (*a.verify_enable == 0) return 0;  // overflow: entry arrays stay untouched
  const kvc_i64 batch_size = a.batch.batch_size;
  // No request owns an entry when there is none (a caller's scratch may claim otherwise).
  kvc_i64 active = batch_size > 0 ? a.verify_offsets[batch_size] : 0;
  if (active > a.verify_capacity) active = a.verify_capacity;
  return active;
}

// Entry e (< active_entries(a)) of the verify plan.
__device__ __forceinline__ void fill_entry(const EntriesArgs& a, kvc_i64 e) {
  const Batch& b = a.batch;
  // The request r with verify_offsets[r] <= e < verify_offsets[r + 1].
  kvc_i64 lo = 0, hi = b.batch_size;  // invariant: offsets[lo] <= e < offsets[hi]
  while (hi - lo > 1) {
    const kvc_i64 mid = lo + (hi - lo) / 2;
    if (a.verify_offsets[mid] <= e) lo = mid; else hi = mid;
  }
  const kvc_i64 r = lo;
  const kvc_i64 row = b.req_pool_indices[r];
  const kvc_i64 prefix = clamp_prefix(b.prefix_lens[r], b.req_to_token.cols);
  const kvc_i64 p = window_start(prefix, b.swa_window_size) + (e - a.verify_offsets[r]);

  a.verify_slot_indices[e] = translate(b.swa_lut, read_req_to_token(b.req_to_token, row, p));
  a.verify_prev_slot_indices[e] =
      p > 0 ? translate(b.swa_lut, read_req_to_token(b.req_to_token, row, p - 1)) : kvc::UNKNOWN;
  a.verify_expected_positions[e] = p;

  kvc_i64 expected_token = kvc::UNKNOWN;
  if (a.req_to_verify_expected_tokens != nullptr) {
    // p + offset wraps like the reference's int64 sum (the offset is any int64).
    const kvc_i64 col = kvc::wrapping_add(p, a.kv_token_id_vs_position_offset);
    if (col >= 0 && col < a.req_to_verify_expected_tokens_valid_lens[r] && col < a.expected_tokens_cols &&
        row >= 0 && row < a.expected_tokens_rows)
      expected_token =
          static_cast<kvc_i64>(a.req_to_verify_expected_tokens[row * a.expected_tokens_row_stride + col]);
  }
  a.verify_expected_tokens[e] = expected_token;
#pragma unroll
  for (int k = 0; k < kvc::PerRequestWords::count; ++k)
    a.expected.at[k][e] = a.request_values.at[k][r];  // entries exist only for active requests
}

__device__ __forceinline__ void entries(const EntriesArgs& a) {
  const kvc_i64 active = active_entries(a);
  const kvc_i64 step = static_cast<kvc_i64>(gridDim.x) * blockDim.x;
  for (kvc_i64 e = static_cast<kvc_i64>(blockIdx.x) * blockDim.x + threadIdx.x; e < active; e += step)
    fill_entry(a, e);
}

}  // namespace kvc_plan
