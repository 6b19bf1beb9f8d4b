// scatter_req_token_ids (docs/semantics.md §5.4): one thread per request copies its tokens into its pool
// row; reads stay inside flat_in, writes inside pool_out. A request row outside pool_out is skipped
// here (a kernel cannot raise); the host backends reject it instead (HostChecks in kv_canary/launch/operations.py).
// Hand-written; the generated cuda/<kernel>.cu defines the entry point over kvc_scatter::run.
#pragma once

namespace kvc_scatter {

struct Args {
  const kvc_i64* __restrict__ flat_in;
  kvc_i64 flat_len;
  const kvc_i64* __restrict__ offsets;
  const kvc_i64* __restrict__ req_pool_indices;
  kvc_i64 batch_size;
  int* __restrict__ pool_out;
  kvc_i64 pool_rows, pool_cols, pool_row_stride;
};

// Request r (< batch_size): its tokens into its pool row.
__device__ __forceinline__ void copy_request(const Args& a, kvc_i64 r) {
  const kvc_i64 row = a.req_pool_indices[r];
  if (row < 0 || row >= a.pool_rows) return;
  // Request r copies flat_in[lo, hi) with both ends clamped to the flat input, at most pool_cols.
  kvc_i64 lo = a.offsets[r], hi = a.offsets[r + 1];
  lo = lo < 0 ? 0 : (lo > a.flat_len ? a.flat_len : lo);
  hi = hi < 0 ? 0 : (hi > a.flat_len ? a.flat_len : hi);
  kvc_i64 n = hi - lo;
  if (n > a.pool_cols) n = a.pool_cols;
  int* dst = a.pool_out + row * a.pool_row_stride;
  for (kvc_i64 j = 0; j < n; ++j) dst[j] = static_cast<int>(a.flat_in[lo + j]);  // int64 -> int32 wraps, as the reference's astype
}

__device__ __forceinline__ void run(const Args& a) {
  const kvc_i64 r = static_cast<kvc_i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < a.batch_size) copy_request(a, r);
}

}  // namespace kvc_scatter
