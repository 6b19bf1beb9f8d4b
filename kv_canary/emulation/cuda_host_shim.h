// cuda_host_shim.h -- compile kv-canary's CUDA kernel source with g++ and run it on the CPU.
//
// Include this header before NVRTC-style kernel text (no CUDA headers, no inline PTX) and the
// kernels become plain C++ functions.  A launch runs the blocks one after another on the calling
// OS thread; the threads of a block run as cooperative ucontext fibers, switched only at barriers
// and warp collectives, so the emulation is deterministic and needs no locking.
//
// It provides what kv-canary's kernels (kv_canary/csrc/ and the rendered entry points) use, and
// nothing else, so a kernel that starts using more fails to compile here instead of running wrong:
//  * the qualifiers __global__, __device__, __forceinline__, __launch_bounds__ and __shared__
//    (__restrict__ is a GCC keyword already);
//  * threadIdx, blockIdx, blockDim, gridDim;
//  * __syncthreads(), __syncwarp(mask), and __shfl_sync / __shfl_up_sync / __shfl_xor_sync on
//    unsigned long long values, without the `width` argument;
//  * atomicAdd on int (wrapping modulo 2^32, as on the GPU) and on unsigned long long;
//  * <vector> and <algorithm>, which the host-emulation branches of kv_canary/csrc use.
//
// Public API (namespace kvc_emu): LaunchConfig, launch(), last_error(), set_strict(); C exports
// kvc_emu_last_error() / kvc_emu_set_strict() for ctypes.  Strict mode (the default) fails a
// launch whose warp collective has a mask without the caller, or names a lane that does not
// exist, has returned, or waits at another kind of collective, and a launch whose __syncthreads
// waits for a thread that has returned.  Either mode fails a warp collective that names a lane
// waiting at __syncthreads (a deadlock on the GPU).
//
// Limitations (deliberate):
//  * 1-D launches only (grid and block y and z are 1), of at most 1024 threads per block.
//  * `asm` / inline PTX is not supported: guard it with KV_CANARY_HOST_EMULATION.
//  * `__shared__` expands to `static`: works for static shared arrays declared in a function
//    body, not for `extern __shared__` (dynamic shared memory).
//  * Threads only switch at __syncthreads / warp collectives: a thread spinning on a flag written
//    by another thread of the same launch hangs.
//  * __syncthreads and the warp collectives may only be called from inside a launch.
#pragma once

#include <ucontext.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#ifndef KV_CANARY_HOST_EMULATION
#define KV_CANARY_HOST_EMULATION 1
#endif

// ---------------------------------------------------------------------------
// CUDA qualifiers.  Kernels become ordinary functions.  __CUDACC__ / __CUDA_ARCH__ are
// intentionally left undefined.
// ---------------------------------------------------------------------------
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One OS thread runs a whole block and blocks run sequentially, so a
// function-local static is exactly "one copy per block, shared by its threads".
#define __shared__ static

// Everything below is hidden: several kernel libraries loaded into one Python
// process must not bind to each other's scheduler state (inline variables are
// otherwise emitted as process-wide STB_GNU_UNIQUE symbols).
#pragma GCC visibility push(hidden)

// The types of the built-in variables (plain aggregates: kernels only read them).
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
};

namespace kvc_emu {

// A launch's shape as CUDA spells it; only 1-D shapes run (y and z are 1).
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z;
};

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
enum Op : unsigned char { OpShfl = 0, OpSyncwarp = 1, kNumOps = 2 };

struct Fiber {
  ucontext_t ctx;
  void* map = nullptr;        // mmap base (guard page first)
  char* stack = nullptr;      // usable stack, above the guard page
  bool dirty = false;         // abandoned mid-run: ASan shadow may be stale
  St state = St::Exited;
  Op op = OpShfl;
  unsigned lane = 0, warp = 0, linear = 0;
  unsigned mask = 0;          // mask passed to the pending collective
  int src = -1;               // shuffle source lane (-1: own value)
  const char* op_name = "";
  unsigned long long value = 0, result = 0;
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
  // Per-warp lane bitmasks, kept up to date at every state change so the
  // barrier checks are O(1) per lane instead of scanning the block.
  unsigned exists[kMaxWarps], exited_m[kMaxWarps], wait_m[kMaxWarps], sync_m[kMaxWarps],
      kind_m[kMaxWarps][kNumOps];
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
  g_thread_idx = uint3{f.linear, 0, 0};
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
    fail("kernel threw a C++ exception in thread %u of block %u", f.linear, g_block_idx.x);
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

// --- barriers and warp collectives ---------------------------------------------
// Called (from the scheduler) when every live fiber is blocked.  Completes all pending warp
// collectives or, when there are none, releases __syncthreads.  Returns false after failing
// the launch.
inline bool resolve() {
  bool progress = false;
  const char* prefix = g.strict ? "strict warp check" : "deadlock";
  const unsigned block = g_block_idx.x;
  for (unsigned w = 0; w < g.nwarps; ++w) {
    const unsigned wait = g.wait_m[w];
    if (!wait) continue;
    // Pass 1: validate every lane and compute its result before any lane is released (the
    // checks read the bitmasks that releasing clears).
    for (unsigned m = wait; m; m &= m - 1) {
      Fiber& f = *g.pool[w * 32 + __builtin_ctz(m)];
      unsigned named = f.mask;
      if (g.strict && !(named & (1u << f.lane))) {
        fail("strict warp check: lane %u of warp %u block %u calls %s with mask "
             "0x%08x that does not include itself", f.lane, w, block, f.op_name, f.mask);
        return false;
      }
      if (g.strict && (named & ~g.exists[w])) {
        fail("strict warp check: lane %d of warp %u block %u named in mask 0x%08x "
             "does not exist (block has %u threads; %s called by lane %u)",
             __builtin_ctz(named & ~g.exists[w]), w, block, f.mask, g.nthreads, f.op_name, f.lane);
        return false;
      }
      named &= g.exists[w];
      // Exited lanes are fatal only in strict mode; a lane parked at
      // __syncthreads can never come here, so that is fatal in both modes.
      const unsigned bad = (g.strict ? named & ~wait : named & g.sync_m[w]);
      if (bad) {
        const int l = __builtin_ctz(bad);
        fail("%s: lane %d of warp %u block %u named in mask 0x%08x %s (%s called "
             "by lane %u)", prefix, l, w, block, f.mask,
             (g.exited_m[w] >> l) & 1 ? "has exited" : "is waiting at __syncthreads", f.op_name, f.lane);
        return false;
      }
      if (g.strict && (named & ~g.kind_m[w][f.op])) {
        const int l = __builtin_ctz(named & ~g.kind_m[w][f.op]);
        fail("strict warp check: lane %d of warp %u block %u named in mask 0x%08x "
             "is waiting at %s, not at %s called by lane %u", l, w, block,
             f.mask, g.pool[w * 32 + l]->op_name, f.op_name, f.lane);
        return false;
      }
      // A shuffle reads its source lane's value if that lane takes part, else its own.
      f.result = (f.src >= 0 && (wait >> f.src) & 1) ? g.pool[w * 32 + f.src]->value : f.value;
    }
    // Pass 2: release.
    for (unsigned m = wait; m; m &= m - 1)
      set_state(*g.pool[w * 32 + __builtin_ctz(m)], St::Ready);
    progress = true;
  }
  if (progress) return true;
  // No warp collective pending, so every live thread is at __syncthreads.
  if (g.strict && g.exited) {
    fail("__syncthreads with exited threads: %u of %u threads of block %u "
         "returned while %u wait at __syncthreads (strict mode)", g.exited,
         g.nthreads, block, g.live);
    return false;
  }
  for (unsigned i = 0; i < g.nthreads; ++i)
    if (g.pool[i]->state == St::WaitSync) set_state(*g.pool[i], St::Ready);
  return true;
}

// Deposit this lane's value, wait until the collective completes, return the result.
inline unsigned long long collective(Op op, const char* name, unsigned mask,
                                     unsigned long long value, int src) {
  Fiber& f = *g.cur;
  f.op = op;
  f.op_name = name;
  f.mask = mask;
  f.value = value;
  f.src = src;
  set_state(f, St::WaitWarp);
  to_scheduler(f);
  return f.result;
}

inline int run_block() {
  for (unsigned i = 0; i < g.nwarps; ++i) {
    const unsigned n = std::min(32u, g.nthreads - i * 32);
    g.exists[i] = n == 32 ? 0xffffffffu : ((1u << n) - 1);
    g.exited_m[i] = g.wait_m[i] = g.sync_m[i] = 0;
    for (unsigned k = 0; k < kNumOps; ++k) g.kind_m[i][k] = 0;
  }
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
  if (c.block_x == 0 || c.block_x > kMaxThreads || c.block_y != 1 || c.block_z != 1 || c.grid_x == 0 ||
      c.grid_x > 0x7fffffffu || c.grid_y != 1 || c.grid_z != 1 || !body) {
    char buf[256];
    snprintf(buf, sizeof buf, "invalid launch configuration: grid (%u,%u,%u) block (%u,%u,%u) "
             "(the emulation runs 1-D launches of 1 to %u threads per block)", c.grid_x, c.grid_y,
             c.grid_z, c.block_x, c.block_y, c.block_z, kMaxThreads);
    t_last_error = buf;
    return 1;
  }
  while (g.pool.size() < c.block_x) {
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
  g.nthreads = c.block_x;
  g.nwarps = (g.nthreads + 31) / 32;
  g_block_dim = dim3{c.block_x, 1, 1};
  g_grid_dim = dim3{c.grid_x, 1, 1};
  t_in_launch = true;
  int rc = 0;
  for (unsigned x = 0; x < c.grid_x && !rc; ++x) {
    g_block_idx = uint3{x, 0, 0};
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
// Barriers and warp collectives.
// ---------------------------------------------------------------------------
inline void __syncthreads() {
  using kvc_emu::detail::g;
  kvc_emu::detail::set_state(*g.cur, kvc_emu::detail::St::WaitSync);
  kvc_emu::detail::to_scheduler(*g.cur);
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  kvc_emu::detail::collective(kvc_emu::detail::OpSyncwarp, "__syncwarp", mask, 0, -1);
}

// The shuffles move unsigned long long, the only type our kernels shuffle; the deleted templates
// make a shuffle of any other type a compile error instead of a silent conversion.
inline unsigned long long __shfl_sync(unsigned mask, unsigned long long var, int src_lane) {
  return kvc_emu::detail::collective(kvc_emu::detail::OpShfl, "__shfl_sync", mask, var, src_lane & 31);
}
inline unsigned long long __shfl_up_sync(unsigned mask, unsigned long long var, unsigned delta) {
  const unsigned lane = kvc_emu::detail::g.cur->lane;
  const int src = lane >= delta ? static_cast<int>(lane - delta) : -1;
  return kvc_emu::detail::collective(kvc_emu::detail::OpShfl, "__shfl_up_sync", mask, var, src);
}
inline unsigned long long __shfl_xor_sync(unsigned mask, unsigned long long var, int lane_mask) {
  const unsigned lane = kvc_emu::detail::g.cur->lane;
  const int src = static_cast<int>((lane ^ static_cast<unsigned>(lane_mask)) & 31u);
  return kvc_emu::detail::collective(kvc_emu::detail::OpShfl, "__shfl_xor_sync", mask, var, src);
}
template <class T> T __shfl_sync(unsigned, T, int) = delete;
template <class T> T __shfl_up_sync(unsigned, T, unsigned) = delete;
template <class T> T __shfl_xor_sync(unsigned, T, int) = delete;

// ---------------------------------------------------------------------------
// Atomics.  One OS thread runs the launch, and fibers never switch inside these, so a plain
// read-modify-write is atomic here.  Overloads (not a template) so that another type fails to
// compile.
// ---------------------------------------------------------------------------
inline int atomicAdd(int* addr, int val) {
  const int old = *addr;
  // Wraps modulo 2^32 as the GPU's does (signed overflow would be UB).
  *addr = static_cast<int>(static_cast<unsigned>(old) + static_cast<unsigned>(val));
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* addr, unsigned long long val) {
  const unsigned long long old = *addr;
  *addr = old + val;
  return old;
}

#pragma GCC visibility pop
