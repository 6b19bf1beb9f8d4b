// cuda_host_shim.h -- compile CUDA C++ kernel source with g++ and run it on the CPU.
//
// Include this header before NVRTC-style kernel text (no CUDA headers, no
// inline PTX) and the kernels become plain C++ functions.  A launch runs the
// blocks one after another on the calling OS thread; the threads of a block run
// as cooperative ucontext fibers, switched only at barriers and warp
// collectives, so the emulation is deterministic and needs no locking.
//
// Public API (namespace kvc_emu): LaunchConfig, launch(), last_error(),
// set_strict(); C exports kvc_emu_last_error() / kvc_emu_set_strict() for ctypes.
//
// Limitations (deliberate):
//  * `asm` / inline PTX is not supported: guard it with KV_CANARY_HOST_EMULATION.
//  * `__shared__` expands to `static`: works for static shared arrays declared in
//    a function body, not for `extern __shared__` (dynamic shared memory).
//  * Threads only switch at __syncthreads / warp collectives: a thread spinning
//    on a flag written by another thread of the same launch hangs.
//  * Standard headers that spell `__noinline__` (<memory>, ...) must be included
//    before this header, which includes the common ones itself.
//  * Device-side assert() aborts the process (as host assert does); use __trap().
#pragma once

#include <ucontext.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <climits>
#include <cstdarg>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#ifndef KV_CANARY_HOST_EMULATION
#define KV_CANARY_HOST_EMULATION 1
#endif

// ---------------------------------------------------------------------------
// CUDA qualifiers.  Kernels become ordinary functions; __restrict__ is already
// a GCC keyword.  __CUDACC__ / __CUDA_ARCH__ are intentionally left undefined.
// ---------------------------------------------------------------------------
#define __host__
#define __device__
#define __global__
#define __constant__
#define __forceinline__ inline
// Must come after the std includes: libstdc++ itself spells __noinline__.
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One OS thread runs a whole block and blocks run sequentially, so a
// function-local static is exactly "one copy per block, shared by its threads".
#define __shared__ static

// Everything below is hidden: several kernel libraries loaded into one Python
// process must not bind to each other's scheduler state (inline variables are
// otherwise emitted as process-wide STB_GNU_UNIQUE symbols).
#pragma GCC visibility push(hidden)

// ---------------------------------------------------------------------------
// Vector types (layout and alignment as in CUDA's vector_types.h).
// ---------------------------------------------------------------------------
#define KVC_EMU_VEC2(T, name, al)                                              \
  struct __attribute__((aligned(al))) name { T x, y; };                       \
  inline name make_##name(T x, T y) { return name{x, y}; }
#define KVC_EMU_VEC3(T, name)                                                  \
  struct name { T x, y, z; };                                                  \
  inline name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define KVC_EMU_VEC4(T, name, al)                                              \
  struct __attribute__((aligned(al))) name { T x, y, z, w; };                 \
  inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

KVC_EMU_VEC2(int, int2, 8)
KVC_EMU_VEC2(unsigned int, uint2, 8)
KVC_EMU_VEC2(float, float2, 8)
KVC_EMU_VEC2(long long, longlong2, 16)
KVC_EMU_VEC2(unsigned long long, ulonglong2, 16)
KVC_EMU_VEC2(double, double2, 16)
KVC_EMU_VEC3(int, int3)
KVC_EMU_VEC3(unsigned int, uint3)
KVC_EMU_VEC4(int, int4, 16)
KVC_EMU_VEC4(unsigned int, uint4, 16)
KVC_EMU_VEC4(float, float4, 16)
#undef KVC_EMU_VEC2
#undef KVC_EMU_VEC3
#undef KVC_EMU_VEC4

// dim3 as in CUDA: unspecified components default to 1.
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

inline constexpr int warpSize = 32;

// ---------------------------------------------------------------------------
// Public launch API.
// ---------------------------------------------------------------------------
namespace kvc_emu {

struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z;
};

int launch(const LaunchConfig& cfg, const std::function<void()>& body);
const char* last_error();
void set_strict(bool on);

namespace detail {

constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kMaxWarps = kMaxThreads / 32;
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackSize = 512u * 1024u;  // ASan frames carry redzones
#else
constexpr size_t kStackSize = 128u * 1024u;
#endif

enum class St : unsigned char { Ready, WaitSync, WaitWarp, Exited };
// Kinds of warp collective; strict mode rejects lanes meeting at different kinds.
enum Op : unsigned char { OpShfl = 0, OpVote = 1, OpSyncwarp = 2, kNumOps = 3 };

struct Fiber {
  ucontext_t ctx;
  void* map = nullptr;        // mmap base (guard page first)
  char* stack = nullptr;      // usable stack, above the guard page
  bool dirty = false;         // abandoned mid-run: ASan shadow may be stale
  St state = St::Exited;
  Op op = OpShfl;
  bool pred = false;
  unsigned lane = 0, warp = 0, linear = 0;
  unsigned mask = 0;          // mask passed to the pending collective
  int src = -1;               // shuffle source lane (-1: own value)
  const char* op_name = "";
  unsigned long long value = 0, result = 0;
  uint3 idx{0, 0, 0};
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
#endif
};

// All scheduler state.  One launch at a time per library (guarded by `mutex`).
struct State {
  std::mutex mutex;
  std::vector<Fiber*> pool;   // grows to the largest block seen, then reused
  ucontext_t sched_ctx;
  Fiber* cur = nullptr;
  const std::function<void()>* body = nullptr;
  bool strict = true;
  bool failed = false;
  std::string error;
  unsigned nthreads = 0, nwarps = 0, live = 0, exited = 0;
  unsigned long long block_linear = 0;
  // Per-warp lane bitmasks, kept up to date at every state change so the
  // barrier checks are O(1) per lane instead of scanning the block.
  unsigned exists[kMaxWarps], exited_m[kMaxWarps], wait_m[kMaxWarps],
      sync_m[kMaxWarps], pred_m[kMaxWarps], kind_m[kMaxWarps][kNumOps];
#if defined(__SANITIZE_ADDRESS__)
  const void* main_bottom = nullptr;
  size_t main_size = 0;
#endif
  ~State() {  // at process exit; keeps leak checkers quiet
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (Fiber* f : pool) {
      munmap(f->map, kStackSize + page);
      delete f;
    }
  }
};

inline State g;
inline uint3 g_thread_idx{0, 0, 0};
inline uint3 g_block_idx{0, 0, 0};
inline dim3 g_block_dim{1, 1, 1};
inline dim3 g_grid_dim{1, 1, 1};
inline std::atomic<bool> g_strict_setting{true};  // copied into g.strict per launch
inline thread_local std::string t_last_error;
inline thread_local bool t_in_launch = false;

// Compiler barrier: values of __shared__ statics must be re-read after any
// switch, even if the optimizer thinks swapcontext cannot reach them.
inline void clobber() { __asm__ __volatile__("" ::: "memory"); }

inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
  if (g.failed) return;  // keep the first (root-cause) message
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g.failed = true;
  g.error = buf;
}

// --- fiber <-> scheduler switching -----------------------------------------
// With ASan, every switch is announced so that it tracks the active stack.
inline void to_scheduler(Fiber& f) {
  clobber();
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&f.fake_stack, g.main_bottom, g.main_size);
  swapcontext(&f.ctx, &g.sched_ctx);
  __sanitizer_finish_switch_fiber(f.fake_stack, &g.main_bottom, &g.main_size);
#else
  swapcontext(&f.ctx, &g.sched_ctx);
#endif
  clobber();
}

inline void run_fiber(Fiber& f) {
  g.cur = &f;
  g_thread_idx = f.idx;
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackSize);
  swapcontext(&g.sched_ctx, &f.ctx);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  swapcontext(&g.sched_ctx, &f.ctx);
#endif
  g.cur = nullptr;
}

inline void set_state(Fiber& f, St s) {
  const unsigned bit = 1u << f.lane, w = f.warp;
  if (f.state == St::WaitWarp) { g.wait_m[w] &= ~bit; g.kind_m[w][f.op] &= ~bit; }
  if (f.state == St::WaitSync) g.sync_m[w] &= ~bit;
  f.state = s;
  if (s == St::WaitWarp) { g.wait_m[w] |= bit; g.kind_m[w][f.op] |= bit; }
  if (s == St::WaitSync) g.sync_m[w] |= bit;
  if (s == St::Exited) { g.exited_m[w] |= bit; --g.live; ++g.exited; }
}

// Entry point of every fiber: run the kernel body for the current thread, then
// hand control back for good.  The fiber is re-made for the next block.
inline void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &g.main_bottom, &g.main_size);
#endif
  Fiber& f = *g.cur;
#if defined(__cpp_exceptions)
  try {
    (*g.body)();
  } catch (...) {  // exceptions cannot unwind across makecontext
    fail("kernel threw a C++ exception in thread %u of block %llu", f.linear,
         g.block_linear);
  }
#else
  (*g.body)();
#endif
  set_state(f, St::Exited);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(nullptr, g.main_bottom, g.main_size);
#endif
  setcontext(&g.sched_ctx);
}

inline Fiber* new_fiber() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* m = mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  // Guard page at the low end: a stack overflow faults instead of silently
  // corrupting the neighbouring fiber.
  mprotect(m, page, PROT_NONE);
  Fiber* f = new Fiber();
  f->map = m;
  f->stack = static_cast<char*>(m) + page;
  getcontext(&f->ctx);  // once; later blocks only re-run makecontext
  return f;
}

// --- warp collectives ---------------------------------------------------------
inline const char* lane_state_name(unsigned w, unsigned bit) {
  if (g.exited_m[w] & bit) return "has exited";
  if (g.sync_m[w] & bit) return "is waiting at __syncthreads";
  return "is blocked elsewhere";
}

// Called (from the scheduler) when every live fiber is blocked.  Completes all
// pending warp collectives, or releases __syncthreads, or fails the launch.
// Returns false on failure.
inline bool resolve() {
  bool progress = false;
  const char* prefix = g.strict ? "strict warp check" : "deadlock";
  for (unsigned w = 0; w < g.nwarps; ++w) {
    const unsigned wait = g.wait_m[w];
    if (!wait) continue;
    // Pass 1: validate and compute every result from the deposits, before any
    // lane is released (results depend on which lanes are waiting).
    for (unsigned m = wait; m; m &= m - 1) {
      Fiber& f = *g.pool[w * 32 + __builtin_ctz(m)];
      unsigned named = f.mask;
      if (g.strict && !(named & (1u << f.lane))) {
        fail("strict warp check: lane %u of warp %u block %llu calls %s with mask "
             "0x%08x that does not include itself", f.lane, w, g.block_linear,
             f.op_name, f.mask);
        return false;
      }
      if (g.strict && (named & ~g.exists[w])) {
        fail("strict warp check: lane %d of warp %u block %llu named in mask 0x%08x "
             "does not exist (block has %u threads; %s called by lane %u)",
             __builtin_ctz(named & ~g.exists[w]), w, g.block_linear, f.mask,
             g.nthreads, f.op_name, f.lane);
        return false;
      }
      named &= g.exists[w];
      // Exited lanes are fatal only in strict mode; a lane parked at
      // __syncthreads can never come here, so that is fatal in both modes.
      const unsigned bad = (g.strict ? named & ~wait : named & g.sync_m[w]);
      if (bad) {
        const unsigned bit = bad & (0u - bad);
        fail("%s: lane %d of warp %u block %llu named in mask 0x%08x %s (%s called "
             "by lane %u)", prefix, __builtin_ctz(bad), w, g.block_linear, f.mask,
             lane_state_name(w, bit), f.op_name, f.lane);
        return false;
      }
      if (g.strict && (named & ~g.kind_m[w][f.op])) {
        const int l = __builtin_ctz(named & ~g.kind_m[w][f.op]);
        fail("strict warp check: lane %d of warp %u block %llu named in mask 0x%08x "
             "is waiting at %s, not at %s called by lane %u", l, w, g.block_linear,
             f.mask, g.pool[w * 32 + l]->op_name, f.op_name, f.lane);
        return false;
      }
      switch (f.op) {
        case OpShfl:
          f.result = (f.src >= 0 && (wait >> f.src) & 1)
                         ? g.pool[w * 32 + f.src]->value : f.value;
          break;
        case OpVote: f.result = named & wait & g.pred_m[w]; break;
        default: f.result = 0; break;
      }
    }
    // Pass 2: release.
    for (unsigned m = wait; m; m &= m - 1)
      set_state(*g.pool[w * 32 + __builtin_ctz(m)], St::Ready);
    progress = true;
  }
  if (progress) return true;
  // No warp collective pending, so every live thread is at __syncthreads.
  if (g.live == 0) return true;
  if (g.strict && g.exited) {
    fail("__syncthreads with exited threads: %u of %u threads of block %llu "
         "returned while %u wait at __syncthreads (strict mode)", g.exited,
         g.nthreads, g.block_linear, g.live);
    return false;
  }
  unsigned count = 0;
  for (unsigned i = 0; i < g.nthreads; ++i)
    if (g.pool[i]->state == St::WaitSync) count += g.pool[i]->pred;
  for (unsigned i = 0; i < g.nthreads; ++i) {
    Fiber& f = *g.pool[i];
    if (f.state != St::WaitSync) continue;
    f.result = count;
    set_state(f, St::Ready);
    progress = true;
  }
  if (!progress)
    fail("deadlock in block %llu: %u live threads, none can proceed",
         g.block_linear, g.live);
  return progress;
}

// Deposit this lane's value, wait until the collective completes, read result.
inline unsigned long long collective(Op op, const char* name, unsigned mask,
                                     unsigned long long value, int src, bool pred) {
  Fiber* f = g.cur;
  if (!f) return op == OpVote ? (pred ? 1u : 0u) : value;  // host call: 1 thread
  f->op = op;
  f->op_name = name;
  f->mask = mask;
  f->value = value;
  f->src = src;
  f->pred = pred;
  const unsigned bit = 1u << f->lane;
  g.pred_m[f->warp] = pred ? (g.pred_m[f->warp] | bit) : (g.pred_m[f->warp] & ~bit);
  set_state(*f, St::WaitWarp);
  to_scheduler(*f);
  return f->result;
}

inline unsigned long long sync_block(bool pred) {
  Fiber* f = g.cur;
  if (!f) return pred;
  f->pred = pred;
  set_state(*f, St::WaitSync);
  to_scheduler(*f);
  return f->result;
}

inline unsigned valid_width(int width) {
  return (width >= 1 && width <= 32 && (width & (width - 1)) == 0) ? unsigned(width)
                                                                   : 32u;
}
inline unsigned cur_lane() { return g.cur ? g.cur->lane : 0; }

template <class T>
inline T shfl(const char* name, unsigned mask, T var, int src) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                "warp shuffles move at most 8 bytes");
  unsigned long long bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = collective(OpShfl, name, mask, bits, src, false);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline int run_block() {
  for (unsigned i = 0; i < g.nwarps; ++i) {
    const unsigned n = std::min(32u, g.nthreads - i * 32);
    g.exists[i] = n == 32 ? 0xffffffffu : ((1u << n) - 1);
    g.exited_m[i] = g.wait_m[i] = g.sync_m[i] = g.pred_m[i] = 0;
    for (unsigned k = 0; k < kNumOps; ++k) g.kind_m[i][k] = 0;
  }
  const unsigned bx = g_block_dim.x, by = g_block_dim.y;
  for (unsigned i = 0; i < g.nthreads; ++i) {
    Fiber& f = *g.pool[i];
#if defined(__SANITIZE_ADDRESS__)
    if (f.dirty) ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackSize);
#endif
    f.dirty = false;
    f.state = St::Ready;
    f.linear = i;
    f.lane = i % 32;
    f.warp = i / 32;
    f.idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackSize;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, &fiber_main, 0);
    // Only makecontext reads uc_stack.  Clearing it stops ASan's swapcontext
    // interceptor from wiping the fiber's shadow (live redzones) at each switch.
    f.ctx.uc_stack.ss_sp = nullptr;
    f.ctx.uc_stack.ss_size = 0;
  }
  g.live = g.nthreads;
  g.exited = 0;
  for (;;) {
    // Run every ready fiber until it blocks or exits (deterministic order).
    for (unsigned i = 0; i < g.nthreads; ++i) {
      Fiber& f = *g.pool[i];
      if (f.state != St::Ready) continue;
      run_fiber(f);
      if (g.failed) break;
    }
    if (g.failed || g.live == 0 || !resolve()) break;
  }
  if (g.failed) {
    // Abandon the blocked fibers: kernels own no resources, and the next block
    // re-makes every context from scratch.
    for (unsigned i = 0; i < g.nthreads; ++i)
      if (g.pool[i]->state != St::Exited) g.pool[i]->dirty = true;
    return 1;
  }
  return 0;
}

}  // namespace detail

inline int launch(const LaunchConfig& c, const std::function<void()>& body) {
  using namespace detail;
  if (t_in_launch) {
    t_last_error = "kvc_emu::launch called from inside a kernel";
    return 1;
  }
  std::lock_guard<std::mutex> lock(g.mutex);
  const unsigned long long threads =
      1ull * c.block_x * c.block_y * c.block_z;
  char buf[256];
  if (threads == 0 || threads > kMaxThreads || c.block_z > 64 || c.grid_x == 0 ||
      c.grid_y == 0 || c.grid_z == 0 || c.grid_x > 0x7fffffffu ||
      c.grid_y > 65535 || c.grid_z > 65535 || !body) {
    snprintf(buf, sizeof buf, "invalid launch configuration: grid (%u,%u,%u) "
             "block (%u,%u,%u)", c.grid_x, c.grid_y, c.grid_z, c.block_x,
             c.block_y, c.block_z);
    t_last_error = buf;
    return 1;
  }
  while (g.pool.size() < threads) {
    Fiber* f = new_fiber();
    if (!f) {
      t_last_error = "kvc_emu: cannot allocate fiber stacks (mmap failed)";
      return 1;
    }
    g.pool.push_back(f);
  }
  g.failed = false;
  g.error.clear();
  g.strict = g_strict_setting.load();
  g.body = &body;
  g.nthreads = static_cast<unsigned>(threads);
  g.nwarps = (g.nthreads + 31) / 32;
  g_block_dim = dim3(c.block_x, c.block_y, c.block_z);
  g_grid_dim = dim3(c.grid_x, c.grid_y, c.grid_z);
  t_in_launch = true;
  int rc = 0;
  for (unsigned z = 0; z < c.grid_z && !rc; ++z)
    for (unsigned y = 0; y < c.grid_y && !rc; ++y)
      for (unsigned x = 0; x < c.grid_x && !rc; ++x) {
        g_block_idx = uint3{x, y, z};
        g.block_linear = x + 1ull * c.grid_x * (y + 1ull * c.grid_y * z);
        rc = run_block();
      }
  t_in_launch = false;
  g.body = nullptr;
  g_thread_idx = uint3{0, 0, 0};
  t_last_error = rc ? g.error : std::string();
  return rc;
}

inline const char* last_error() { return detail::t_last_error.c_str(); }
// Takes effect at the next launch (safe to call from any thread, even a kernel).
inline void set_strict(bool on) { detail::g_strict_setting.store(on); }

}  // namespace kvc_emu

// C entry points for ctypes.  `used` forces emission although they are inline
// (so the header can be included by several translation units of one .so).
extern "C" __attribute__((used, visibility("default"))) inline const char*
kvc_emu_last_error() { return kvc_emu::last_error(); }
extern "C" __attribute__((used, visibility("default"))) inline void
kvc_emu_set_strict(int on) { kvc_emu::set_strict(on != 0); }

// ---------------------------------------------------------------------------
// Built-in variables: always the values of the fiber currently running (const references
// to the scheduler's state, not macros: a macro would rewrite any token of the same name).
// ---------------------------------------------------------------------------
inline const uint3& threadIdx = kvc_emu::detail::g_thread_idx;
inline const uint3& blockIdx = kvc_emu::detail::g_block_idx;
inline const dim3& blockDim = kvc_emu::detail::g_block_dim;
inline const dim3& gridDim = kvc_emu::detail::g_grid_dim;

// ---------------------------------------------------------------------------
// Barriers and warp intrinsics.
// ---------------------------------------------------------------------------
inline void __syncthreads() { kvc_emu::detail::sync_block(false); }
inline int __syncthreads_count(int p) {
  return static_cast<int>(kvc_emu::detail::sync_block(p != 0));
}
inline int __syncthreads_and(int p) {
  // count of false predicates == 0  <=>  all true
  return kvc_emu::detail::sync_block(p == 0) == 0;
}
inline int __syncthreads_or(int p) { return kvc_emu::detail::sync_block(p != 0) != 0; }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  kvc_emu::detail::collective(kvc_emu::detail::OpSyncwarp, "__syncwarp", mask, 0, -1,
                              false);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(kvc_emu::detail::collective(
      kvc_emu::detail::OpVote, "__ballot_sync", mask, 0, -1, pred != 0));
}
inline int __any_sync(unsigned mask, int pred) {
  return kvc_emu::detail::collective(kvc_emu::detail::OpVote, "__any_sync", mask, 0,
                                     -1, pred != 0) != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  // all true  <=>  nobody votes "false"
  return kvc_emu::detail::collective(kvc_emu::detail::OpVote, "__all_sync", mask, 0,
                                     -1, pred == 0) == 0;
}

// Lanes of the caller's warp that exist and have not returned.
inline unsigned __activemask() {
  using kvc_emu::detail::g;
  if (!g.cur) return 1u;
  return g.exists[g.cur->warp] & ~g.exited_m[g.cur->warp];
}

// Source lanes follow the PTX rules for sub-warp `width` segments.
template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  const unsigned w = kvc_emu::detail::valid_width(width);
  const unsigned base = kvc_emu::detail::cur_lane() & ~(w - 1);
  const int src = static_cast<int>(base + (static_cast<unsigned>(src_lane) & (w - 1)));
  return kvc_emu::detail::shfl("__shfl_sync", mask, var, src);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const unsigned w = kvc_emu::detail::valid_width(width);
  const unsigned lane = kvc_emu::detail::cur_lane();
  const unsigned base = lane & ~(w - 1);
  const int src = (lane >= base + delta) ? static_cast<int>(lane - delta) : -1;
  return kvc_emu::detail::shfl("__shfl_up_sync", mask, var, src);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const unsigned w = kvc_emu::detail::valid_width(width);
  const unsigned lane = kvc_emu::detail::cur_lane();
  const unsigned base = lane & ~(w - 1);
  const int src = (delta < w && lane + delta < base + w) ? static_cast<int>(lane + delta)
                                                         : -1;
  return kvc_emu::detail::shfl("__shfl_down_sync", mask, var, src);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const unsigned w = kvc_emu::detail::valid_width(width);
  const unsigned lane = kvc_emu::detail::cur_lane();
  const unsigned base = lane & ~(w - 1);
  // Lanes may read earlier segments but get their own value from later ones.
  const unsigned s = (lane ^ static_cast<unsigned>(lane_mask)) & 31u;
  const int src = (s < base + w) ? static_cast<int>(s) : -1;
  return kvc_emu::detail::shfl("__shfl_xor_sync", mask, var, src);
}

// ---------------------------------------------------------------------------
// Bit intrinsics.
// ---------------------------------------------------------------------------
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned>(x)) : 32; }
inline int __clzll(long long x) {
  return x ? __builtin_clzll(static_cast<unsigned long long>(x)) : 64;
}
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(static_cast<unsigned>(x))) << 32) |
         __brev(static_cast<unsigned>(x >> 32));
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((1ull * a * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  __extension__ typedef unsigned __int128 u128;
  return static_cast<unsigned long long>((static_cast<u128>(a) * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) {
  __extension__ typedef __int128 i128;
  return static_cast<long long>((static_cast<i128>(a) * b) >> 64);
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  const unsigned long long v = (1ull * hi << 32) | lo;
  return static_cast<unsigned>((v << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const unsigned long long v = (1ull * hi << 32) | lo;
  return static_cast<unsigned>(v >> (s & 31));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = (1ull * y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i)
    r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

// ---------------------------------------------------------------------------
// Memory: loads, fences, atomics.  One OS thread runs the launch, and fibers
// never switch inside these, so plain read-modify-write is atomic here.
// ---------------------------------------------------------------------------
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

namespace kvc_emu {
namespace detail {
// int arithmetic of the atomics wraps modulo 2^32 as the GPU's does; signed overflow would be UB.
inline int wrap_int(unsigned v) { return static_cast<int>(v); }
}  // namespace detail
}  // namespace kvc_emu

// Overloads (not templates) so that unsupported types, e.g. atomicAdd on
// long long, fail to compile exactly as they do with nvcc. The helper macro
// is undefined again right below.
#define KVC_EMU_ATOMIC(name, T, expr)                                          \
  inline T name(T* addr, T val) { T old = *addr; *addr = (expr); return old; }
KVC_EMU_ATOMIC(atomicAdd, int, kvc_emu::detail::wrap_int(static_cast<unsigned>(old) + static_cast<unsigned>(val)))
KVC_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
KVC_EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
KVC_EMU_ATOMIC(atomicAdd, float, old + val)
KVC_EMU_ATOMIC(atomicAdd, double, old + val)
KVC_EMU_ATOMIC(atomicSub, int, kvc_emu::detail::wrap_int(static_cast<unsigned>(old) - static_cast<unsigned>(val)))
KVC_EMU_ATOMIC(atomicSub, unsigned int, old - val)
KVC_EMU_ATOMIC(atomicExch, int, val)
KVC_EMU_ATOMIC(atomicExch, unsigned int, val)
KVC_EMU_ATOMIC(atomicExch, unsigned long long, val)
KVC_EMU_ATOMIC(atomicExch, float, val)
KVC_EMU_ATOMIC(atomicMax, int, old < val ? val : old)
KVC_EMU_ATOMIC(atomicMax, unsigned int, old < val ? val : old)
KVC_EMU_ATOMIC(atomicMax, long long, old < val ? val : old)
KVC_EMU_ATOMIC(atomicMax, unsigned long long, old < val ? val : old)
KVC_EMU_ATOMIC(atomicMin, int, val < old ? val : old)
KVC_EMU_ATOMIC(atomicMin, unsigned int, val < old ? val : old)
KVC_EMU_ATOMIC(atomicMin, long long, val < old ? val : old)
KVC_EMU_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
KVC_EMU_ATOMIC(atomicAnd, int, old & val)
KVC_EMU_ATOMIC(atomicAnd, unsigned int, old & val)
KVC_EMU_ATOMIC(atomicAnd, unsigned long long, old & val)
KVC_EMU_ATOMIC(atomicOr, int, old | val)
KVC_EMU_ATOMIC(atomicOr, unsigned int, old | val)
KVC_EMU_ATOMIC(atomicOr, unsigned long long, old | val)
KVC_EMU_ATOMIC(atomicXor, int, old ^ val)
KVC_EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
KVC_EMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
KVC_EMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
KVC_EMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef KVC_EMU_ATOMIC

#define KVC_EMU_CAS(T)                                                         \
  inline T atomicCAS(T* addr, T compare, T val) {                              \
    T old = *addr;                                                             \
    if (old == compare) *addr = val;                                           \
    return old;                                                                \
  }
KVC_EMU_CAS(int)
KVC_EMU_CAS(unsigned int)
KVC_EMU_CAS(unsigned long long)
#undef KVC_EMU_CAS

// Abort the launch (not the process) like a device-side trap.
inline void __trap() {
  using kvc_emu::detail::g;
  if (!g.cur) std::abort();  // host code: nothing to unwind to
  kvc_emu::detail::fail("__trap() in thread %u of block %llu", g.cur->linear,
                        g.block_linear);
  for (;;) kvc_emu::detail::to_scheduler(*g.cur);  // never rescheduled
}

// ---------------------------------------------------------------------------
// min / max.  CUDA overloads them for every integer pair, with the usual
// arithmetic conversions (min(int, unsigned) is unsigned).  A constrained
// template reproduces that without clashing with std::min/std::max.
// ---------------------------------------------------------------------------
template <class A, class B,
          class = std::enable_if_t<std::is_arithmetic<A>::value &&
                                   std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  const C x = static_cast<C>(a), y = static_cast<C>(b);
  return y < x ? y : x;
}
template <class A, class B,
          class = std::enable_if_t<std::is_arithmetic<A>::value &&
                                   std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  const C x = static_cast<C>(a), y = static_cast<C>(b);
  return x < y ? y : x;
}
inline unsigned umin(unsigned a, unsigned b) { return b < a ? b : a; }
inline unsigned umax(unsigned a, unsigned b) { return a < b ? b : a; }
inline long long llmin(long long a, long long b) { return b < a ? b : a; }
inline long long llmax(long long a, long long b) { return a < b ? b : a; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) {
  return b < a ? b : a;
}
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) {
  return a < b ? b : a;
}

#pragma GCC visibility pop
