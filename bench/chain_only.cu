// The serial floor of a prefill write, for bench/bench_gpu.py: one thread folds a request's tokens
// into the schema's chain (kvc::chain_link of the generated kv_canary_layout.cuh, from HEAD, over
// every entry) and does nothing else: no slots, checks, fingerprints or stores but the final link.
// Chained words other than token and position (schema input fields) are 0, as the benchmark writes
// them. Compiled and loaded like the generated kernels (kv_canary.cuda.module.load_source_module);
// tests/trees/test_nvrtc_compile.py compiles it and tests/backends/test_chain_only.py runs it in emulation.
#include "kv_canary_layout.cuh"

namespace {
// Entries loaded one batch ahead of the mixes, so that the global loads are in flight while the
// previous batch is mixed and the loop runs at the speed of the dependent mixes alone.
constexpr int kBatch = 16;
}  // namespace

extern "C" __global__ void __launch_bounds__(32) kv_canary_chain_only(const kvc_i64* input_ids, const kvc_i64* positions,
                                                                      kvc_i64 n, kvc_i64* final_link) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  kvc_i64 rec[kvc::CANARY_FIELDS] = {};
  kvc_u64 running = kvc::CHAIN_HEAD;
  kvc_i64 token[kBatch], position[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    token[u] = u < n ? input_ids[u] : 0;
    position[u] = u < n ? positions[u] : 0;
  }
  const kvc_i64 whole = n - n % kBatch;  // entries in whole batches: mixed without a bounds check
  for (kvc_i64 base = 0; base < whole; base += kBatch) {
    kvc_i64 next_token[kBatch], next_position[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const kvc_i64 i = base + kBatch + u;
      next_token[u] = i < n ? input_ids[i] : 0;
      next_position[u] = i < n ? positions[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      rec[kvc::TOKEN_WORD] = token[u];
      rec[kvc::POSITION_WORD] = position[u];
      rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(running);
      running = kvc::chain_link(rec);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      token[u] = next_token[u];
      position[u] = next_position[u];
    }
  }
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {  // the last, partial batch (already loaded)
    if (whole + u >= n) break;
    rec[kvc::TOKEN_WORD] = token[u];
    rec[kvc::POSITION_WORD] = position[u];
    rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(running);
    running = kvc::chain_link(rec);
  }
  *final_link = static_cast<kvc_i64>(running);
}
