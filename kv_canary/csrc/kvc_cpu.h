// The native cpu backend's kernels: the schema's write, verify, plan and scatter as host loops over
// the rows and entries a GPU grid would cover, calling the same device functions as the CUDA
// kernels (kvc_device.cuh: hashing, the chain, the ring, the real-KV fingerprint; kvc_write.cuh,
// kvc_verify.cuh, kvc_plan.cuh, kvc_scatter.cuh: one entry's or one request's work), compiled as
// host code with the system compiler (kv_canary/layer/cpu_build.py).
//
// The generated cpu/kv_canary_cpu.cpp includes this first (it includes the schema's layout header
// itself, after the host qualifiers) and defines one extern "C" function per kernel entry point,
// taking the kernel's own parameters and building the same argument structs as the CUDA entry point.
//
// Threads: a launch splits its entries (verify, plan entries) or, for the write's fingerprints, its
// tokens into contiguous ranges, one per std::thread, at most Team::threads of them and never less
// than Team::grain items each (a small launch runs on the calling thread alone). Threads are started
// per launch: nothing spins between launches and a forked process inherits no pool.
//
// Order: SEMANTICS.md §5.2 wants a host backend's verify rows in entry order, and the reference's
// write semantics are sequential (a seed written by an earlier request of the launch is read with
// its values; of two entries storing one slot the later wins). So verify threads append to private
// rings that are appended to the launch's ring in range order afterwards, and the write walks its
// requests in order on one thread (the fingerprints, the bulk of its work, are computed first, in
// parallel: they read only the K/V sources).
#pragma once

#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#define KV_CANARY_HOST_NATIVE 1

// CUDA qualifiers: device functions become ordinary inline functions.
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static

// The GPU-only built-ins the device headers' grid-level code names (the block and warp bodies these
// loops never call): declared so that the headers compile, never defined, so a host loop that
// reached one would fail to link instead of running wrong.
struct kvc_cpu_dim3 {
  unsigned x, y, z;
};
extern const kvc_cpu_dim3 threadIdx, blockIdx, blockDim, gridDim;
void __syncthreads();
void __syncwarp(unsigned mask = 0xFFFFFFFFu);
unsigned long long __shfl_sync(unsigned mask, unsigned long long var, int src_lane);
unsigned long long __shfl_up_sync(unsigned mask, unsigned long long var, unsigned delta);
unsigned long long __shfl_xor_sync(unsigned mask, unsigned long long var, int lane_mask);

// Atomic adds as on the GPU: the int one wraps modulo 2^32 (the GCC builtins define the wrap).
inline int atomicAdd(int* addr, int val) { return __atomic_fetch_add(addr, val, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* addr, unsigned long long val) {
  return __atomic_fetch_add(addr, val, __ATOMIC_RELAXED);
}

#include "kv_canary_layout.cuh"
#include "kvc_plan.cuh"
#include "kvc_scatter.cuh"
#include "kvc_verify.cuh"
#include "kvc_write.cuh"

namespace kvc_cpu {

// What a launch may use: at most `threads` threads, each taking at least `grain` items (entries,
// tokens; kv_canary/backends/cpu.py: below some thousands, starting a thread costs more than it saves).
struct Team {
  int threads;
  kvc_i64 grain;
};
// Entries a verify thread checks between two moves of its private ring's rows (at most one row each).
constexpr kvc_i64 kRowBlock = 1024;

inline std::string& last_error() {
  static thread_local std::string message;
  return message;
}

// How many threads a launch of `work` items uses.
inline int team_size(const Team& team, kvc_i64 work) {
  const kvc_i64 most = work / (team.grain > 0 ? team.grain : 1);
  if (team.threads <= 1 || most <= 1) return 1;
  return static_cast<int>(most < team.threads ? most : team.threads);
}

// fn(t, lo, hi) for the team's contiguous ranges of [0, work), range t on thread t (range 0 on the
// calling thread). A thread that cannot be started leaves its range to the calling thread.
template <class Fn>
void parallel_ranges(int team, kvc_i64 work, const Fn& fn) {
  if (team <= 1) {
    fn(0, kvc_i64{0}, work);
    return;
  }
  const kvc_i64 per = work / team, extra = work % team;
  auto bounds = [&](int t) {
    const kvc_i64 lo = t * per + (t < extra ? t : extra);
    return std::pair<kvc_i64, kvc_i64>(lo, lo + per + (t < extra ? 1 : 0));
  };
  std::vector<std::exception_ptr> errors(team);  // a worker's exception, rethrown on the calling thread
  auto guarded = [&](int t) {
    try {
      const auto r = bounds(t);
      fn(t, r.first, r.second);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  std::vector<int> left;  // ranges whose thread could not be started
  workers.reserve(team - 1);
  for (int t = 1; t < team; ++t) {
    try {
      workers.emplace_back(guarded, t);
    } catch (const std::exception&) {
      left.push_back(t);
    }
  }
  guarded(0);
  for (int t : left) guarded(t);
  for (auto& w : workers) w.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// -- verify (SEMANTICS.md §5.2) ------------------------------------------------------------------
template <bool kCheckExpectedToken>
inline void verify_range(const kvc_verify::Args& a, const kvc::RealKvSources& kv, const kvc::Ring& ring, kvc_i64 lo,
                         kvc_i64 hi) {
  for (kvc_i64 e = lo; e < hi; ++e) {
    kvc_i64 slot = 0, prev = 0;
    if (!kvc_verify::prepare_entry<kCheckExpectedToken>(a, kv, ring, e, slot, prev)) continue;
    kvc_verify::check_entry<kCheckExpectedToken>(a, ring, e, slot, prev, kvc::real_kv_fingerprint(kv, slot));
  }
}

// One thread's entries [lo, hi) into `rows`, in entry order, through a private ring emptied every kRowBlock entries.
template <bool kCheckExpectedToken>
inline void verify_rows(const kvc_verify::Args& a, const kvc::RealKvSources& kv, kvc_i64 launch_tag, kvc_i64 lo,
                        kvc_i64 hi, std::vector<kvc::ViolationRow>& rows) {
  std::vector<kvc::ViolationRow> block(kRowBlock);
  int count = 0;
  const kvc::Ring local{launch_tag, &block[0].col[0], kRowBlock, &count, nullptr};
  for (kvc_i64 b = lo; b < hi; b += kRowBlock) {
    verify_range<kCheckExpectedToken>(a, kv, local, b, hi - b < kRowBlock ? hi : b + kRowBlock);
    rows.insert(rows.end(), block.begin(), block.begin() + count);  // count <= kRowBlock: one row per entry at most
    count = 0;
  }
}

template <bool kCheckExpectedToken>
void verify(const Team& threads, const kvc_verify::Args& a, const kvc::RealKvSources& kv, const kvc::Ring& ring) {
  static_assert(sizeof(kvc::ViolationRow) == sizeof(kvc_i64) * kvc::VIOLATION_FIELDS, "a row is its columns");
  atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  if (*a.verify_enable == 0) return;
  kvc_i64 active = *a.verify_num_valid;
  if (active > a.verify_capacity) active = a.verify_capacity;
  if (active <= 0) return;
  const int team = team_size(threads, active);
  if (team == 1) {
    verify_range<kCheckExpectedToken>(a, kv, ring, 0, active);
  } else {
    std::vector<std::vector<kvc::ViolationRow>> rows(team);
    parallel_ranges(team, active, [&](int t, kvc_i64 lo, kvc_i64 hi) {
      verify_rows<kCheckExpectedToken>(a, kv, ring.launch_tag, lo, hi, rows[t]);
    });
    for (const auto& part : rows)
      for (const auto& row : part) ring.append(row);
  }
  atomicAdd(a.slot_run_counter, static_cast<unsigned long long>(active));  // every visited entry
}

// -- write (SEMANTICS.md §5.1) -------------------------------------------------------------------
// The fingerprints computed before the walk (entry i's at [i]).
struct KnownFingerprint {
  const kvc_u64* values;
  inline kvc_u64 operator()(kvc_i64 entry, kvc_i64 /*slot*/) const { return values[entry]; }
};

// Token i's fingerprint where the walk would store it (its slot in the buffer and in every source),
// else 0 (never read).
inline kvc_u64 token_fingerprint(const kvc_write::Inputs& in, const kvc::RealKvSources& kv, kvc_i64 i) {
  const kvc_i64 slot = in.out_cache_loc[i];
  if (slot < 0 || slot >= in.num_slots || !kvc::real_kv_in_range(kv, slot)) return 0;
  return kvc::real_kv_fingerprint(kv, slot);
}

inline void write(const Team& threads, const kvc_write::Args& a, const kvc_write::Inputs& in, const kvc::RealKvSources& kv,
                  const kvc::Ring& ring) {
  atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  const int team = kvc::real_kv_active(kv) ? team_size(threads, a.num_tokens) : 1;
  std::vector<kvc_u64> fingerprints;
  if (team > 1) {
    fingerprints.resize(static_cast<size_t>(a.num_tokens));
    parallel_ranges(team, a.num_tokens, [&](int, kvc_i64 lo, kvc_i64 hi) {
      for (kvc_i64 i = lo; i < hi; ++i) fingerprints[i] = token_fingerprint(in, kv, i);
    });
  }
  unsigned long long stored = 0;
  for (kvc_i64 r = 0; r < a.write_req_capacity; ++r) {
    kvc_write::Request q;
    if (!kvc_write::begin_request(a, ring, r, true, q)) continue;
    stored += team > 1 ? kvc_write::walk_request(a, in, kv, ring, q, KnownFingerprint{fingerprints.data()})
                       : kvc_write::walk_request(a, in, kv, ring, q, kvc_write::ReadFingerprint{kv});
  }
  if (stored != 0) atomicAdd(a.slot_run_counter, stored);
}

// -- plan (SEMANTICS.md §5.3) --------------------------------------------------------------------
inline void plan_offsets(const Team& /*threads*/, const kvc_plan::OffsetsArgs& a) {
  const kvc_i64 batch_size = a.batch.batch_size;
  kvc_u64 verify_total = 0, write_total = 0;  // wrap modulo 2^64, as the kernel's scan
  for (kvc_i64 r = 0; r < batch_size; ++r) {
    const kvc_plan::RequestPlan p = kvc_plan::plan_request(a, r);
    kvc_plan::store_request(a, r, verify_total, write_total, p.seed);
    verify_total += static_cast<kvc_u64>(p.verify_count);
    write_total += static_cast<kvc_u64>(p.write_count);
  }
  for (kvc_i64 i = batch_size + 1; i <= a.write_req_capacity; ++i) a.write_offsets[i] = 0;
  kvc_plan::store_totals(a, verify_total, write_total);
}

inline void plan_entries(const Team& threads, const kvc_plan::EntriesArgs& a) {
  const kvc_i64 active = kvc_plan::active_entries(a);
  if (active <= 0) return;
  parallel_ranges(team_size(threads, active), active, [&](int, kvc_i64 lo, kvc_i64 hi) {
    for (kvc_i64 e = lo; e < hi; ++e) kvc_plan::fill_entry(a, e);
  });
}

// -- scatter (SEMANTICS.md §5.4): in request order (of two requests with one row, the later wins) --
inline void scatter(const Team& /*threads*/, const kvc_scatter::Args& a) {
  for (kvc_i64 r = 0; r < a.batch_size; ++r) kvc_scatter::copy_request(a, r);
}

// A launcher's body: 0, or non-zero with the reason in last_error() (nothing a kernel does throws
// but allocating its scratch).
template <class Body>
int run(const char* entry_point, const Body& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& exc) {
    last_error() = std::string(entry_point) + ": " + exc.what();
    return 1;
  }
}

// A launcher over packed arguments: parameter i's value in the low bytes of the 8-byte slot i.
template <class A>
A slot_value(const unsigned char* slots, size_t i) {
  static_assert(sizeof(A) <= 8, "a kernel parameter fits one 8-byte slot");
  A value;
  std::memcpy(&value, slots + 8 * i, sizeof(A));
  return value;
}
template <class... A, size_t... I>
int slots_launch_at(int (*launch)(int, long long, A...), int threads, long long grain, const unsigned char* slots,
                    std::index_sequence<I...>) {
  (void)slots;
  return launch(threads, grain, slot_value<A>(slots, I)...);
}
template <class... A>
int slots_launch(int (*launch)(int, long long, A...), int threads, long long grain, const void* slots) {
  return slots_launch_at(launch, threads, grain, static_cast<const unsigned char*>(slots),
                         std::index_sequence_for<A...>{});
}

}  // namespace kvc_cpu
