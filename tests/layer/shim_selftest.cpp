// Self-test for cuda_host_shim.h: CUDA-style kernels compiled by g++ and run on
// CPU fibers.  Prints "PASS <name>" / "FAIL <name>: ..." lines and "ALL OK";
// exits 0 only if every check passed.  Built and run by
// tests/test_emulation_shim.py.
#include "cuda_host_shim.h"

#include <chrono>
#include <initializer_list>
#include <string>
#include <vector>

// Kernel-source style below: what NVRTC text looks like after the shim.
typedef unsigned long long u64;
typedef long long i64;

#line 1 "selftest_kernels.cu"
extern "C" __global__ void __launch_bounds__(128)
    reduce_kernel(const u64* __restrict__ in, u64* __restrict__ out, int n) {
  __shared__ u64 warp_sums[32];
  u64 v = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    v += __ldg(in + i);
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const unsigned lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const unsigned nw = blockDim.x / warpSize;
    v = lane < nw ? warp_sums[lane] : 0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) atomicAdd(out, v);
  }
}

extern "C" __global__ void count_kernel(unsigned* counter, int* slots, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    atomicAdd(counter, 1u);
    const int old = atomicAdd(&slots[0], 1);  // returns the old value
    atomicAdd(&slots[1 + old], 1);            // each old value seen once
    atomicMax(&slots[n + 1], i);
    atomicMin(&slots[n + 2], i);
  }
}

extern "C" __global__ void vote_kernel(unsigned* ballots, int* counts) {
  const int t = threadIdx.x;
  const unsigned b = __ballot_sync(0xffffffffu, t % 3 == 0);
  if (t % 32 == 0) ballots[t / 32] = b;
  const int c = __syncthreads_count(t % 5 == 0);
  if (t == 0) {
    counts[0] = c;
    counts[1] = __popc(b);
  }
  if (t % 32 == 0) {
    counts[2 + t / 32] = __any_sync(0xffffffffu, t == 64) * 10 + __all_sync(0xffffffffu, 1);
  } else {
    __any_sync(0xffffffffu, t == 64);
    __all_sync(0xffffffffu, 1);
  }
}

extern "C" __global__ void butterfly_kernel(int* sum_out, int* bcast, int* scan, u64* seg) {
  const int lane = threadIdx.x % 32;
  int v = lane + 1;
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  sum_out[threadIdx.x] = v;  // 528 everywhere
  bcast[threadIdx.x] = __shfl_sync(0xffffffffu, lane * 100, 7);
  int s = lane + 1;  // inclusive scan
  for (int d = 1; d < 32; d <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, s, d);
    if (lane >= d) s += t;
  }
  scan[threadIdx.x] = s;
  u64 w = 1ull << 40 | lane;  // 64-bit payload, 8-lane segments
  for (int m = 4; m >= 1; m >>= 1) w += __shfl_xor_sync(0xffffffffu, w, m, 8);
  seg[threadIdx.x] = w;
}

extern "C" __global__ void partial_kernel(unsigned* masks, int* sums) {
  const unsigned m = __activemask();
  const unsigned lane = threadIdx.x % 32;
  const int nl = __popc(m);
  int v = threadIdx.x;
  for (int off = 16; off > 0; off >>= 1) {
    const int t = __shfl_down_sync(m, v, off);
    if (lane + off < (unsigned)nl) v += t;
  }
  if (lane == 0) {
    masks[threadIdx.x / 32] = m;
    sums[threadIdx.x / 32] = v;
  }
}

extern "C" __global__ void full_mask_kernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
}

extern "C" __global__ void exited_lane_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane == 5) return;
  out[lane] = __shfl_down_sync(0xffffffffu, lane * 10, 1);
}

extern "C" __global__ void skip_sync_exit_kernel(int* out) {
  if (threadIdx.x == 0) return;  // never reaches the barrier
  __syncthreads();
  atomicAdd(out, 1);
}

extern "C" __global__ void skip_sync_shfl_kernel(int* out) {
  if (threadIdx.x != 0) __syncthreads();
  out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}

extern "C" __global__ void index_kernel(int* out) {
  const int bx = blockIdx.x + blockIdx.y * gridDim.x;
  const int tx = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  out[bx * nthreads + tx] = bx * 1000 + tx;
}

extern "C" __global__ void small_kernel(u64* acc) {
  __shared__ u64 s[2];
  const u64 v = __shfl_xor_sync(0xffffffffu, (u64)threadIdx.x, 1);
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(acc, s[0] + s[1] + min(blockDim.x, 64ull));
}

extern "C" __global__ void trap_kernel(int* out) {
  if (threadIdx.x == 3) __trap();
  __syncthreads();
  out[threadIdx.x] = 1;
}
#line 150 "shim_selftest.cpp"

// ---------------------------------------------------------------------------
static int g_failures = 0;

static void check(bool ok, const std::string& name, const std::string& detail = "") {
  if (ok) {
    std::printf("PASS %s\n", name.c_str());
  } else {
    ++g_failures;
    std::printf("FAIL %s: %s\n", name.c_str(), detail.c_str());
  }
}

// A launch that must fail with each of `needles` in its error (shown with `show`).
static void check_fails(int rc, const std::string& name, std::initializer_list<const char*> needles,
                        bool show = false) {
  const std::string e = kvc_emu::last_error();
  bool ok = rc != 0;
  for (const char* needle : needles) ok = ok && e.find(needle) != std::string::npos;
  check(ok, name, "rc=" + std::to_string(rc) + " " + e);
  if (show) std::printf("  message: %s\n", e.c_str());
}

static kvc_emu::LaunchConfig cfg1(unsigned grid, unsigned block) {
  return {grid, 1, 1, block, 1, 1};
}

int main() {
  using kvc_emu::launch;
  {  // block reduction: shfl_down + __shared__ + __syncthreads + atomicAdd
    const int n = 100000;
    std::vector<u64> in(n);
    u64 expect = 0;
    for (int i = 0; i < n; ++i) expect += (in[i] = 3ull * i + 1);
    u64 out = 0;
    int rc = launch(cfg1(7, 128), [&] { reduce_kernel(in.data(), &out, n); });
    check(rc == 0 && out == expect, "reduction",
          "rc=" + std::to_string(rc) + " got " + std::to_string(out) + " want " +
              std::to_string(expect) + " " + kvc_emu::last_error());
  }
  {  // grid-stride loop with atomics returning old values
    const int n = 5000;
    unsigned counter = 0;
    std::vector<int> slots(n + 3, 0);
    slots[n + 1] = -1;
    slots[n + 2] = 1 << 30;
    int rc = launch(cfg1(5, 96), [&] { count_kernel(&counter, slots.data(), n); });
    bool ok = rc == 0 && counter == (unsigned)n && slots[0] == n &&
              slots[n + 1] == n - 1 && slots[n + 2] == 0;
    for (int i = 1; i <= n; ++i) ok = ok && slots[i] == 1;
    unsigned x = 5;
    ok = ok && atomicCAS(&x, 5u, 9u) == 5u && x == 9u && atomicCAS(&x, 5u, 1u) == 9u &&
         x == 9u && atomicExch(&x, 2u) == 9u && atomicSub(&x, 1u) == 2u && x == 1u;
    u64 y = 7;
    ok = ok && atomicOr(&y, 8ull) == 7 && y == 15 && atomicCAS(&y, 15ull, 1ull) == 15 && y == 1;
    check(ok, "atomics", std::string("counter=") + std::to_string(counter));
  }
  {  // ballot / popc / any / all / __syncthreads_count
    unsigned ballots[4] = {};
    int counts[6] = {};
    int rc = launch(cfg1(1, 128), [&] { vote_kernel(ballots, counts); });
    bool ok = rc == 0;
    for (int w = 0; w < 4; ++w) {
      unsigned want = 0;
      for (int l = 0; l < 32; ++l)
        if ((w * 32 + l) % 3 == 0) want |= 1u << l;
      ok = ok && ballots[w] == want;
    }
    ok = ok && counts[0] == 26 && counts[1] == __popc(ballots[0]) && counts[2] == 1 &&
         counts[3] == 1 && counts[4] == 11 && counts[5] == 1;
    check(ok, "ballot_popc", kvc_emu::last_error());
  }
  {  // xor butterfly, broadcast, up-scan, width-8 segments with 64-bit values
    int sum[64], bc[64], scan[64];
    u64 seg[64];
    int rc = launch(cfg1(1, 64), [&] { butterfly_kernel(sum, bc, scan, seg); });
    bool ok = rc == 0;
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32, base = lane & ~7;
      u64 want_seg = 8ull << 40;
      for (int k = 0; k < 8; ++k) want_seg += base + k;
      ok = ok && sum[t] == 528 && bc[t] == 700 && scan[t] == (lane + 1) * (lane + 2) / 2 &&
           seg[t] == want_seg;
    }
    check(ok, "shfl_xor_butterfly", kvc_emu::last_error());
  }
  {  // partial last warp (block 48): the second warp has 16 lanes
    unsigned masks[2] = {};
    int sums[2] = {};
    int rc = launch(cfg1(2, 48), [&] { partial_kernel(masks, sums); });
    check(rc == 0 && masks[0] == 0xffffffffu && masks[1] == 0xffffu && sums[0] == 496 &&
              sums[1] == 632,
          "partial_warp", kvc_emu::last_error());
    int out[48];
    rc = launch(cfg1(1, 48), [&] { full_mask_kernel(out); });
    check_fails(rc, "partial_warp_strict_full_mask", {"does not exist"});
  }
  {  // strict mode: a shuffle whose mask names an exited lane
    int out[32] = {};
    int rc = launch(cfg1(4, 32), [&] { exited_lane_kernel(out); });
    check_fails(rc, "strict_exited_lane", {"strict warp check: lane 5 of warp 0 block 0", "has exited"}, true);
    kvc_emu::set_strict(false);
    for (int& v : out) v = -1;
    rc = launch(cfg1(1, 32), [&] { exited_lane_kernel(out); });
    bool ok = rc == 0 && out[5] == -1 && out[4] == 40 && out[31] == 310;
    for (int l = 0; l < 32; ++l)
      if (l != 4 && l != 5 && l != 31) ok = ok && out[l] == (l + 1) * 10;
    check(ok, "nonstrict_exited_lane", kvc_emu::last_error());
    kvc_emu::set_strict(true);
  }
  {  // deadlocks / barrier misuse fail the launch instead of hanging
    int counter = 0;
    int rc = launch(cfg1(1, 64), [&] { skip_sync_exit_kernel(&counter); });
    check_fails(rc, "strict_sync_exited", {"__syncthreads with exited threads"}, true);
    kvc_emu::set_strict(false);
    counter = 0;
    rc = launch(cfg1(1, 64), [&] { skip_sync_exit_kernel(&counter); });
    check(rc == 0 && counter == 63, "nonstrict_sync_exited", kvc_emu::last_error());
    int out[64];
    rc = launch(cfg1(1, 64), [&] { skip_sync_shfl_kernel(out); });
    check_fails(rc, "nonstrict_deadlock", {"deadlock", "is waiting at __syncthreads"});
    kvc_emu::set_strict(true);
    rc = launch(cfg1(1, 64), [&] { skip_sync_shfl_kernel(out); });
    check_fails(rc, "strict_deadlock", {"strict warp check: lane 1 of warp 0", "is waiting at __syncthreads"}, true);
  }
  {  // multi-dimensional grid and block indices
    std::vector<int> out(6 * 32, -1);
    int rc = launch({2, 3, 1, 8, 2, 2}, [&] { index_kernel(out.data()); });
    bool ok = rc == 0;
    for (int b = 0; b < 6; ++b)
      for (int t = 0; t < 32; ++t) ok = ok && out[b * 32 + t] == b * 1000 + t;
    check(ok, "dims_2d", kvc_emu::last_error());
  }
  {  // __trap and invalid configurations fail the launch, not the process
    int out[32] = {};
    int rc = launch(cfg1(1, 32), [&] { trap_kernel(out); });
    check_fails(rc, "trap", {"__trap"});
    rc = launch(cfg1(1, 2048), [&] { trap_kernel(out); });
    check_fails(rc, "invalid_config", {"invalid launch"});
  }
  {  // repeated launches reuse the fiber pool (and recover after failures)
    u64 acc = 0;
    int bad = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 1000; ++i)
      bad += launch(cfg1(1, 64), [&] { small_kernel(&acc); }) != 0;
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - t0).count();
    // per launch: s[0] = shfl_xor(lane 0) = 1, s[1] = lane 1 of warp 1 = 33, +64
    check(bad == 0 && acc == 1000ull * (1 + 33 + 64), "repeated_launches",
          "bad=" + std::to_string(bad) + " acc=" + std::to_string(acc));
    std::printf("  1000 launches of 64 threads: %.1f ms\n", ms);
  }
  // Host-side helpers behave like CUDA's.
  check(min(3, 5u) == 3u && max(-1ll, 2ull) == ~0ull && min(2ll, 7) == 2ll &&
            __clz(0) == 32 && __clzll(1) == 63 && __ffs(8) == 4 && __ffsll(0) == 0 &&
            __popcll(~0ull) == 64 && __brev(1u) == 0x80000000u &&
            __umul64hi(~0ull, 2ull) == 1ull && make_uint4(1, 2, 3, 4).w == 4u &&
            alignof(ulonglong2) == 16 && sizeof(int2) == 8,
        "host_helpers");

  if (g_failures == 0) std::printf("ALL OK\n");
  return g_failures == 0 ? 0 : 1;
}
