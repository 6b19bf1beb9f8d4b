// Self-test for cuda_host_shim.h: CUDA-style kernels compiled by g++ and run on
// CPU fibers.  Prints "PASS <name>" / "FAIL <name>: ..." lines and "ALL OK";
// exits 0 only if every check passed.  Built and run by
// tests/trees/test_emulation_shim.py.
#include "cuda_host_shim.h"

#include <chrono>
#include <climits>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

// Kernel-source style below: what NVRTC text looks like after the shim.
typedef unsigned long long u64;

#line 1 "selftest_kernels.cu"
extern "C" __global__ void __launch_bounds__(128)
    reduce_kernel(const u64* __restrict__ in, u64* __restrict__ out, int n) {
  __shared__ u64 warp_sums[32];
  u64 v = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) v += in[i];
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? warp_sums[lane] : 0;
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    if (lane == 0) atomicAdd(out, v);
  }
}

extern "C" __global__ void count_kernel(int* slots, int* wrap, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    const int old = atomicAdd(&slots[0], 1);  // returns the old value
    atomicAdd(&slots[1 + old], 1);            // each old value seen once
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) wrap[1] = atomicAdd(&wrap[0], 1);  // INT_MAX + 1
}

extern "C" __global__ void shuffle_kernel(u64* bcast, u64* scan) {
  const unsigned lane = threadIdx.x % 32;
  bcast[threadIdx.x] = __shfl_sync(0xffffffffu, (1ull << 40) * lane + lane, 7);
  u64 s = (1ull << 36) + lane;  // inclusive scan of 64-bit values
  for (unsigned d = 1; d < 32; d <<= 1) {
    const u64 t = __shfl_up_sync(0xffffffffu, s, d);
    if (lane >= d) s += t;
  }
  scan[threadIdx.x] = s;
}

extern "C" __global__ void syncwarp_kernel(int* out) {
  __shared__ int buf[64];
  buf[threadIdx.x] = blockIdx.x * 1000 + threadIdx.x;
  __syncwarp();  // every lane's store lands before any lane reads its neighbour's
  out[blockIdx.x * blockDim.x + threadIdx.x] = buf[threadIdx.x ^ 1];
}

extern "C" __global__ void partial_kernel(u64* sums) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned mask = threadIdx.x < 32 ? 0xffffffffu : 0xffffu;  // block of 48: 16 lanes in warp 1
  u64 v = threadIdx.x;
  for (int m = (threadIdx.x < 32 ? 16 : 8); m > 0; m >>= 1) v += __shfl_xor_sync(mask, v, m);
  if (lane == 0) sums[threadIdx.x / 32] = v;
}

extern "C" __global__ void full_mask_kernel(u64* out) {
  out[threadIdx.x] = __shfl_sync(0xffffffffu, (u64)threadIdx.x, 0);
}

extern "C" __global__ void mask_without_self_kernel(u64* out) {
  out[threadIdx.x] = __shfl_sync(0xfffffffeu, (u64)threadIdx.x, 1);
}

extern "C" __global__ void divergent_kinds_kernel(u64* out) {
  if (threadIdx.x < 16)
    __syncwarp();
  else
    out[threadIdx.x] = __shfl_sync(0xffffffffu, (u64)threadIdx.x, 0);
}

extern "C" __global__ void exited_lane_kernel(u64* out) {
  const unsigned lane = threadIdx.x % 32;
  if (lane == 5) return;
  out[lane] = __shfl_up_sync(0xffffffffu, lane * 10ull, 1);
}

extern "C" __global__ void skip_sync_exit_kernel(int* out) {
  if (threadIdx.x == 0) return;  // never reaches the barrier
  __syncthreads();
  atomicAdd(out, 1);
}

extern "C" __global__ void skip_sync_shfl_kernel(u64* out) {
  if (threadIdx.x != 0) __syncthreads();
  out[threadIdx.x] = __shfl_sync(0xffffffffu, 1ull, 0);
}

extern "C" __global__ void index_kernel(int* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = gridDim.x * 1000000 + blockIdx.x * 1000 + threadIdx.x;
}

extern "C" __global__ void throw_kernel(int* out) {
  if (threadIdx.x == 3) throw std::runtime_error("kernel bug");
  __syncthreads();
  out[threadIdx.x] = 1;
}

extern "C" __global__ void small_kernel(u64* acc) {
  __shared__ u64 s[2];
  const u64 v = __shfl_xor_sync(0xffffffffu, (u64)threadIdx.x, 1);
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(acc, s[0] + s[1] + blockDim.x);
}
#line 118 "shim_selftest.cpp"

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
  {  // block reduction of 64-bit values: shfl_xor + __shared__ + __syncthreads + atomicAdd
    const int n = 100000;
    std::vector<u64> in(n);
    u64 expect = 0;
    for (int i = 0; i < n; ++i) expect += (in[i] = 3ull * i + (1ull << 33));
    u64 out = 0;
    int rc = launch(cfg1(7, 128), [&] { reduce_kernel(in.data(), &out, n); });
    check(rc == 0 && out == expect, "reduction",
          "rc=" + std::to_string(rc) + " got " + std::to_string(out) + " want " +
              std::to_string(expect) + " " + kvc_emu::last_error());
  }
  {  // grid-stride loop with int atomics returning old values, wrapping past INT_MAX
    const int n = 5000;
    std::vector<int> slots(n + 1, 0);
    int wrap[2] = {INT_MAX, 0};
    int rc = launch(cfg1(5, 96), [&] { count_kernel(slots.data(), wrap, n); });
    bool ok = rc == 0 && slots[0] == n && wrap[0] == INT_MIN && wrap[1] == INT_MAX;
    for (int i = 1; i <= n; ++i) ok = ok && slots[i] == 1;
    check(ok, "atomics", "rc=" + std::to_string(rc) + " wrap=" + std::to_string(wrap[0]));
  }
  {  // broadcast and up-scan with 64-bit values, in two warps
    u64 bc[64], scan[64];
    int rc = launch(cfg1(1, 64), [&] { shuffle_kernel(bc, scan); });
    bool ok = rc == 0;
    for (int t = 0; t < 64; ++t) {
      const u64 lane = t % 32;
      ok = ok && bc[t] == (1ull << 40) * 7 + 7 && scan[t] == (lane + 1) * (1ull << 36) + lane * (lane + 1) / 2;
    }
    check(ok, "shuffles", kvc_emu::last_error());
  }
  {  // __syncwarp orders the shared-memory stores of a warp before its loads
    std::vector<int> out(3 * 64, -1);
    int rc = launch(cfg1(3, 64), [&] { syncwarp_kernel(out.data()); });
    bool ok = rc == 0;
    for (int b = 0; b < 3; ++b)
      for (int t = 0; t < 64; ++t) ok = ok && out[b * 64 + t] == b * 1000 + (t ^ 1);
    check(ok, "syncwarp", kvc_emu::last_error());
  }
  {  // partial last warp (block 48): the second warp has 16 lanes
    u64 sums[2] = {};
    int rc = launch(cfg1(2, 48), [&] { partial_kernel(sums); });
    check(rc == 0 && sums[0] == 496 && sums[1] == 632, "partial_warp", kvc_emu::last_error());
    u64 out[48];
    rc = launch(cfg1(1, 48), [&] { full_mask_kernel(out); });
    check_fails(rc, "partial_warp_strict_full_mask", {"lane 16 of warp 1 block 0", "does not exist"});
  }
  {  // strict mode: masks and collectives the lanes do not agree on
    u64 out[32] = {};
    int rc = launch(cfg1(1, 32), [&] { mask_without_self_kernel(out); });
    check_fails(rc, "strict_mask_without_self",
                {"lane 0 of warp 0 block 0 calls __shfl_sync with mask 0xfffffffe that does not include itself"});
    rc = launch(cfg1(1, 32), [&] { divergent_kinds_kernel(out); });
    check_fails(rc, "strict_divergent_kinds",
                {"lane 16 of warp 0 block 0 named in mask 0xffffffff is waiting at __shfl_sync, "
                 "not at __syncwarp called by lane 0"}, true);
  }
  {  // strict mode: a shuffle whose mask names an exited lane
    u64 out[32] = {};
    int rc = launch(cfg1(4, 32), [&] { exited_lane_kernel(out); });
    check_fails(rc, "strict_exited_lane", {"strict warp check: lane 5 of warp 0 block 0", "has exited"}, true);
    kvc_emu::set_strict(false);
    for (u64& v : out) v = ~0ull;
    rc = launch(cfg1(1, 32), [&] { exited_lane_kernel(out); });
    // Lane 6 reads the exited lane 5 and so keeps its own value, as lane 0 (no source) does.
    bool ok = rc == 0 && out[5] == ~0ull && out[0] == 0 && out[6] == 60;
    for (int l = 1; l < 32; ++l)
      if (l != 5 && l != 6) ok = ok && out[l] == (l - 1) * 10ull;
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
    u64 out[64];
    rc = launch(cfg1(1, 64), [&] { skip_sync_shfl_kernel(out); });
    check_fails(rc, "nonstrict_deadlock", {"deadlock", "is waiting at __syncthreads"});
    kvc_emu::set_strict(true);
    rc = launch(cfg1(1, 64), [&] { skip_sync_shfl_kernel(out); });
    check_fails(rc, "strict_deadlock", {"strict warp check: lane 1 of warp 0", "is waiting at __syncthreads"}, true);
  }
  {  // the built-in variables of a 1-D launch
    std::vector<int> out(6 * 40, -1);
    int rc = launch(cfg1(6, 40), [&] { index_kernel(out.data()); });
    bool ok = rc == 0;
    for (int b = 0; b < 6; ++b)
      for (int t = 0; t < 40; ++t) ok = ok && out[b * 40 + t] == 6000000 + b * 1000 + t;
    check(ok, "indices", kvc_emu::last_error());
  }
  {  // an exception, a nested launch and invalid shapes fail the launch, not the process
    int out[32] = {};
    int rc = launch(cfg1(1, 32), [&] { throw_kernel(out); });
    check_fails(rc, "exception", {"kernel threw a C++ exception in thread 3 of block 0"});
    std::string inner;
    rc = launch(cfg1(1, 1), [&] {
      if (launch(cfg1(1, 1), [] {}) != 0) inner = kvc_emu::last_error();
    });
    check(rc == 0 && inner == "kvc_emu::launch called from inside a kernel", "nested_launch", inner);
    const kvc_emu::LaunchConfig bad[] = {cfg1(1, 2048), cfg1(1, 0), cfg1(0, 32), {1, 1, 1, 8, 2, 1},
                                         {1, 2, 1, 32, 1, 1}};
    for (const kvc_emu::LaunchConfig& c : bad) {
      rc = launch(c, [&] { index_kernel(out); });
      check_fails(rc, "invalid_config", {"invalid launch configuration", "1-D launches of 1 to 1024 threads"});
    }
  }
  {  // repeated launches reuse the fiber pool (and recover after the failures above)
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

  if (g_failures == 0) std::printf("ALL OK\n");
  return g_failures == 0 ? 0 : 1;
}
