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
// Order: docs/semantics.md §5.2 wants a host backend's verify rows in entry order, and the reference's
// write semantics are sequential (a seed written by an earlier request of the launch is read with
// its values; of two entries storing one slot the later wins). So verify threads append to private
// rings that are appended to the launch's ring in range order afterwards, and the write stores its
// requests in order on one thread (the fingerprints, the bulk of its work, are computed first, in
// parallel: they read only the K/V sources; so are the requests' chains, when no chain starts from a
// store of the same launch: see write()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
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

// -- prefetch ------------------------------------------------------------------------------------
// Slots arrive in any order (a pool's free list), so records and K/V rows are read at random: one
// entry at a time, each of its cache (and TLB) misses would be waited for in turn. The loops ask for
// the lines of later entries (prefetch_ahead) while they hash this block's, so misses overlap.
constexpr kvc_i64 kLine = 64;

// One line. An asm statement on x86-64: g++ 12 deletes a loop whose body is only __builtin_prefetch
// (RTL sees no effect), so the lines of a multi-line row were never asked for.
template <int kWrite>
inline void prefetch_line(uintptr_t q) {
#if defined(__x86_64__)
  if (kWrite)
    asm volatile("prefetchw (%0)" : : "r"(q));
  else
    asm volatile("prefetcht0 (%0)" : : "r"(q));
#else
  __builtin_prefetch(reinterpret_cast<const void*>(q), kWrite);
#endif
}

template <int kWrite>
inline void prefetch_bytes(const unsigned char* p, kvc_i64 n) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n);
  for (uintptr_t q = reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(kLine - 1); q < end; q += kLine)
    prefetch_line<kWrite>(q);
}

// The record of `slot`, when it is one of the buffer's.
template <int kWrite>
inline void prefetch_record(const unsigned char* buf, kvc_i64 num_slots, kvc_i64 stride, kvc_i64 slot) {
  if (slot >= 0 && slot < num_slots) prefetch_bytes<kWrite>(buf + slot * stride, kvc::CANARY_RECORD_BYTES);
}

// The K/V bytes the fingerprint of `slot` reads, when it reads any.
inline void prefetch_kv(const kvc::RealKvSources& kv, kvc_i64 slot) {
  if (slot < 0 || !kvc::real_kv_active(kv) || !kvc::real_kv_in_range(kv, slot)) return;
  for (int s = 0; s < kv.num_sources && s < kvc::MAX_REAL_KV_SOURCES; ++s)
    if (kvc::real_kv_contiguous(kv, s))  // a gathered slot's bytes are not one run: nothing to prefetch ahead
      prefetch_bytes<0>(kvc::real_kv_slot(kv, s, slot), kvc::real_kv_read_len(kv, s));
}

// Every source's slot bytes are one run: what the lock-step loads below assume.
inline bool all_contiguous(const kvc::RealKvSources& kv) {
  for (int s = 0; s < kv.num_sources && s < kvc::MAX_REAL_KV_SOURCES; ++s)
    if (!kvc::real_kv_contiguous(kv, s)) return false;
  return true;
}

// -- fingerprints, kLanes slots at a time ----------------------------------------------------------
// kvc::real_kv_fingerprint of one slot is a chain of dependent multiplies (two per 8 bytes), so one
// slot at a time runs at the multiplier's latency. The same fold over kLanes slots in lock-step
// keeps kLanes independent chains in one vector (kvc::splitmix64_lanes): throughput, not latency.
// Same bytes (kvc::real_kv_slot, kvc::real_kv_read_len), same order of words, same fold as
// real_kv_fingerprint; a tail of fewer than kSlotsAtOnce slots takes real_kv_fingerprint itself.
constexpr int kLanes = 8;
typedef kvc_u64 Lanes __attribute__((vector_size(kLanes * 8)));  // word k of each of kLanes slots

// rows[j] = 8 consecutive words of slot j -> rows[k] = word k of every slot (an 8 x 8 transpose).
inline void transpose(Lanes (&r)[kLanes]) {
  static_assert(kLanes == 8, "an 8 x 8 transpose");
  const Lanes lo1 = {0, 8, 2, 10, 4, 12, 6, 14}, hi1 = {1, 9, 3, 11, 5, 13, 7, 15};
  const Lanes lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const Lanes lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  Lanes b[8], c[8];
  for (int i = 0; i < 8; i += 2) {
    b[i] = __builtin_shuffle(r[i], r[i + 1], lo1);
    b[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi1);
  }
  for (int i = 0; i < 8; i += 4)
    for (int k = 0; k < 2; ++k) {
      c[i + k] = __builtin_shuffle(b[i + k], b[i + k + 2], lo2);
      c[i + k + 2] = __builtin_shuffle(b[i + k], b[i + k + 2], hi2);
    }
  for (int k = 0; k < 4; ++k) {
    r[k] = __builtin_shuffle(c[k], c[k + 4], lo4);
    r[k + 4] = __builtin_shuffle(c[k], c[k + 4], hi4);
  }
}

// kGroups x kLanes slots: kGroups independent vectors, so that one vector's dependent mixes overlap
// with the others'.
constexpr int kGroups = 2;
constexpr int kSlotsAtOnce = kGroups * kLanes;

inline void fingerprint_lanes(const kvc::RealKvSources& kv, const kvc_i64* slots, kvc_u64* out) {
  Lanes total[kGroups] = {};
  for (int s = 0; s < kv.num_sources && s < kvc::MAX_REAL_KV_SOURCES; ++s) {
    const unsigned char* p[kSlotsAtOnce];
    for (int j = 0; j < kSlotsAtOnce; ++j) p[j] = kvc::real_kv_slot(kv, s, slots[j]);
    const int n = kvc::real_kv_read_len(kv, s);
    Lanes h[kGroups] = {};
    int b = 0;
    for (; b + 64 <= n; b += 64) {  // 64 bytes (4 chunks) of every slot: loads, a transpose, 8 mixes per group
      Lanes w[kGroups][kLanes];
      for (int g = 0; g < kGroups; ++g) {
        for (int j = 0; j < kLanes; ++j) __builtin_memcpy(&w[g][j], p[g * kLanes + j] + b, sizeof(Lanes));
        transpose(w[g]);
      }
      for (int k = 0; k < kLanes; ++k)
        for (int g = 0; g < kGroups; ++g) h[g] = kvc::splitmix64_lanes(h[g] ^ w[g][k]);
    }
    for (; b < n; b += kvc::REAL_KV_LOAD_ALIGN_BYTES) {  // the chunks past a multiple of 64 bytes
      for (int g = 0; g < kGroups; ++g) {
        Lanes lo, hi;
        for (int j = 0; j < kLanes; ++j) {
          kvc_u64 l, u;
          kvc::load_u64x2(p[g * kLanes + j] + b, l, u);
          lo[j] = l;
          hi[j] = u;
        }
        h[g] = kvc::splitmix64_lanes(h[g] ^ lo);
        h[g] = kvc::splitmix64_lanes(h[g] ^ hi);
      }
    }
    for (int g = 0; g < kGroups; ++g) total[g] = kvc::splitmix64_lanes(total[g] ^ h[g]);
  }
  __builtin_memcpy(out, total, sizeof(total));
}

// out[k] = kvc::real_kv_fingerprint(kv, slots[k]) for k < n (every slot in range: real_kv_in_range).
inline void fingerprints(const kvc::RealKvSources& kv, const kvc_i64* slots, kvc_i64 n, kvc_u64* out) {
  if (!kvc::real_kv_active(kv)) {
    for (kvc_i64 k = 0; k < n; ++k) out[k] = 0;
    return;
  }
  kvc_i64 k = 0;
  if (all_contiguous(kv))  // strided sources (heads or chunks apart) take real_kv_fingerprint's gather per slot
    for (; k + kSlotsAtOnce <= n; k += kSlotsAtOnce) fingerprint_lanes(kv, slots + k, out + k);
  for (; k < n; ++k) out[k] = kvc::real_kv_fingerprint(kv, slots[k]);
}

// Entries a loop classifies, hashes and finishes together (a multiple of kSlotsAtOnce).
constexpr kvc_i64 kBlock = kSlotsAtOnce;

// How far ahead (in entries) the loops ask for lines: about kLinesAhead lines in flight. Measured on
// a 2-core AMD EPYC (2 x 128 B or 2 x 16 B of 256 B rows; 16, 32 and 48 entries ahead tried): 16
// entries of 5 lines and 32 entries of 3 lines ran fastest. Rows that follow each other are asked for
// too: reading 16 or 128 B of every 256 B row is a stride the hardware prefetcher covers badly
// (measured: verify ALL 3.9 -> 2.6 ms over consecutive slots with the prefetches).
constexpr kvc_i64 kLinesAhead = 96;
inline kvc_i64 prefetch_ahead(const kvc::RealKvSources& kv) {
  kvc_i64 lines = 1;  // the record
  if (kvc::real_kv_active(kv))
    for (int s = 0; s < kv.num_sources && s < kvc::MAX_REAL_KV_SOURCES; ++s)
      lines += (kvc::real_kv_read_len(kv, s) + kLine - 1) / kLine;
  const kvc_i64 ahead = kLinesAhead / lines;
  return ahead < kBlock ? kBlock : ahead > 4 * kBlock ? 4 * kBlock : ahead;
}

// -- verify (docs/semantics.md §5.2) ------------------------------------------------------------------
// Entries [lo, hi) in blocks: kvc_verify::prepare_entry sorts each block's entries (rows it would
// append go to a ring that keeps none), the checked ones' fingerprints are hashed kLanes at a time,
// then every entry is finished in order: check_entry, or prepare_entry again on the launch's ring
// for one that is not checked (its out-of-range row, in its place).
template <bool kCheckExpectedToken>
inline void verify_range(const kvc_verify::Args& a, const kvc::RealKvSources& kv, const kvc::Ring& ring, kvc_i64 lo,
                         kvc_i64 hi) {
  int discarded = 0;
  const kvc::Ring none{ring.launch_tag, nullptr, 0, &discarded, nullptr};
  kvc_i64 slot[kBlock], prev[kBlock];
  kvc_u64 fp[kBlock];
  int at[kBlock];
  const kvc_i64 ahead = prefetch_ahead(kv);
  for (kvc_i64 b = lo; b < hi; b += kBlock) {
    const kvc_i64 end = hi - b < kBlock ? hi : b + kBlock;
    int n = 0;
    for (kvc_i64 e = b; e < end; ++e) {
      if (e + ahead < hi) {  // lines for later entries (records also when one entry's prev is the entry before)
        const kvc_i64 later = a.verify_slot_indices[e + ahead], later_prev = a.verify_prev_slot_indices[e + ahead];
        prefetch_record<0>(a.canary_buf, a.num_slots, a.slot_stride_bytes, later);
        prefetch_kv(kv, later);
        if (later_prev != a.verify_slot_indices[e + ahead - 1])
          prefetch_record<0>(a.canary_buf, a.num_slots, a.slot_stride_bytes, later_prev);
      }
      kvc_i64 s = 0, p = 0;
      at[e - b] = -1;
      if (kvc_verify::prepare_entry<kCheckExpectedToken>(a, kv, none, e, s, p)) {
        at[e - b] = n;
        slot[n] = s;
        prev[n++] = p;
      }
    }
    fingerprints(kv, slot, n, fp);
    for (kvc_i64 e = b; e < end; ++e) {
      const int k = at[e - b];
      if (k >= 0) {
        kvc_verify::check_entry<kCheckExpectedToken>(a, ring, e, slot[k], prev[k], fp[k]);
      } else {
        kvc_i64 s = 0, p = 0;
        kvc_verify::prepare_entry<kCheckExpectedToken>(a, kv, ring, e, s, p);
      }
    }
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

// -- write (docs/semantics.md §5.1) -------------------------------------------------------------------
// The fingerprints of tokens [lo, hi) where the walk would store them (a slot in the buffer and in
// every source), into fp (the others are never read).
inline void token_fingerprints(const kvc_write::Inputs& in, const kvc::RealKvSources& kv, kvc_i64 lo, kvc_i64 hi,
                               kvc_u64* fp) {
  kvc_i64 slot[kBlock], token[kBlock];
  kvc_u64 got[kBlock];
  const kvc_i64 ahead = prefetch_ahead(kv);
  for (kvc_i64 b = lo; b < hi; b += kBlock) {
    const kvc_i64 end = hi - b < kBlock ? hi : b + kBlock;
    int n = 0;
    for (kvc_i64 i = b; i < end; ++i) {
      if (i + ahead < hi) prefetch_kv(kv, in.out_cache_loc[i + ahead]);  // a later entry's rows
      const kvc_i64 s = in.out_cache_loc[i];
      if (s >= 0 && s < in.num_slots && kvc::real_kv_in_range(kv, s)) {
        slot[n] = s;
        token[n++] = i;
      }
    }
    fingerprints(kv, slot, n, got);
    for (int k = 0; k < n; ++k) fp[token[k]] = got[k];
  }
}

// The fingerprints computed before the walk (entry i's at [i]); the walk asks for the record lines
// it will store kBlock entries ahead.
struct KnownFingerprint {
  const kvc_u64* values;
  const kvc_write::Args& a;
  const kvc_write::Inputs& in;
  inline kvc_u64 operator()(kvc_i64 i, kvc_i64 /*slot*/) const {
    if (i + kBlock < a.num_tokens)
      prefetch_record<1>(a.canary_buf, a.num_slots, a.slot_stride_bytes, in.out_cache_loc[i + kBlock]);
    return values[i];
  }
};

// Scratch words for a launch, kept by the launching thread from one launch to the next: a fresh
// allocation of this size is an mmap whose pages fault in again on every launch (measured: a quarter
// of the write's own time without K/V). Grows, never shrinks; words are uninitialised (every word
// read is written first).
inline kvc_u64* scratch(size_t words) {
  static thread_local std::unique_ptr<kvc_u64[]> held;
  static thread_local size_t size = 0;
  if (words > size) {
    held.reset();
    held.reset(new kvc_u64[words]);
    size = words;
  }
  return held.get();
}

// Whether the requests' chains can be folded apart from the stores: the active requests' entry ranges
// follow each other without overlap (each entry belongs to one chain), and no request's seed is a slot
// that an earlier request of the launch stores (its chain would start from that store). Then every
// chain depends only on the launch's inputs and the records as they were before it.
inline bool chains_independent(const kvc_write::Args& a, const kvc_write::Inputs& in, const kvc::RealKvSources& kv,
                               const kvc::Ring& ring, std::vector<kvc_write::Request>& reqs) {
  kvc_i64 covered = 0;
  std::vector<std::pair<kvc_i64, size_t>> seeds;  // (seed slot, index in reqs), sorted by slot
  for (kvc_i64 r = 0; r < a.write_req_capacity; ++r) {
    kvc_write::Request q;
    if (!kvc_write::begin_request(a, ring, r, false, q)) continue;
    if (q.lo < covered) return false;
    covered = q.hi;
    if (q.seed >= 0) seeds.emplace_back(q.seed, reqs.size());
    reqs.push_back(q);
  }
  if (seeds.empty()) return true;
  std::sort(seeds.begin(), seeds.end());  // of requests seeded by one slot, the last one sorts last
  for (size_t j = 0; j < reqs.size(); ++j)
    for (kvc_i64 i = reqs[j].lo; i < reqs[j].hi; ++i) {
      const kvc_i64 slot = in.out_cache_loc[i];
      if (slot < 0 || slot >= in.num_slots || !kvc::real_kv_in_range(kv, slot)) continue;  // not stored
      auto it = std::upper_bound(seeds.begin(), seeds.end(), std::pair<kvc_i64, size_t>(slot, SIZE_MAX));
      if (it != seeds.begin() && (it - 1)->first == slot && (it - 1)->second > j) return false;
    }
  return true;
}

// The chains of requests [lo, hi) of reqs: entry i's chain link (the running hash before it) into
// link[i] and, where the request asserts positions, the previous stored entry's position into
// prev_pos[i]. kChains requests are folded in lock-step: each chain is a series of dependent mixes,
// so one at a time runs at the multiplier's latency. Same entries, same fold as walk_request.
constexpr int kChains = 2;  // measured: 4 or 8 ran slower (more input streams than the L1 keeps apart)
inline void fold_chains(const kvc_write::Args& a, const kvc_write::Inputs& in, const kvc::RealKvSources& kv,
                        const kvc_u64* fp, const kvc_write::Request* reqs, kvc_i64 lo, kvc_i64 hi, kvc_u64* link,
                        kvc_u64* prev_pos) {
  const bool with_fp = kvc::real_kv_active(kv);
  for (kvc_i64 g = lo; g < hi; g += kChains) {
    const int n = hi - g < kChains ? static_cast<int>(hi - g) : kChains;
    kvc_i64 at[kChains], end[kChains];
    kvc_write::Chain c[kChains];
    for (int u = 0; u < n; ++u) {
      const kvc_write::Request& q = reqs[g + u];
      at[u] = q.lo;
      end[u] = q.hi;
      c[u] = kvc_write::start_chain(a.canary_buf, a.slot_stride_bytes, q.seed);
    }
    for (bool any = true; any;) {
      any = false;
      for (int u = 0; u < n; ++u) {
        const kvc_i64 i = at[u];
        if (i >= end[u]) continue;
        any = true;
        at[u] = i + 1;
        kvc_write::Entry e;
        kvc_write::load_entry(in, kv, i, e);
        link[i] = c[u].running;
        prev_pos[i] = static_cast<kvc_u64>(c[u].prev_pos);
        if (!e.stored) continue;  // skipped and out-of-range entries do not advance the chain
        e.rec[kvc::KV_FINGERPRINT_WORD] = with_fp ? static_cast<kvc_i64>(fp[i]) : 0;
        e.rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(c[u].running);
        c[u].prev_pos = e.rec[kvc::POSITION_WORD];
        c[u].running = kvc::chain_link(e.rec);  // §5.1 d
      }
    }
  }
}

// The requests in order, with their chains known: checks, violation rows and stores as walk_request
// does them. Returns the entries stored.
inline unsigned long long store_requests(const kvc_write::Args& a, const kvc_write::Inputs& in,
                                         const kvc::RealKvSources& kv, const kvc::Ring& ring, const kvc_u64* fp,
                                         const kvc_u64* link, const kvc_u64* prev_pos) {
  const bool with_fp = kvc::real_kv_active(kv);
  unsigned long long stored = 0;
  for (kvc_i64 r = 0; r < a.write_req_capacity; ++r) {
    kvc_write::Request q;
    if (!kvc_write::begin_request(a, ring, r, true, q)) continue;  // reports an out-of-range seed, in order
    for (kvc_i64 i = q.lo; i < q.hi; ++i) {
      if (i + kBlock < q.hi)
        prefetch_record<1>(a.canary_buf, a.num_slots, a.slot_stride_bytes, in.out_cache_loc[i + kBlock]);
      kvc_write::Entry e;
      kvc_write::load_entry(in, kv, i, e);
      if (e.stored) e.rec[kvc::KV_FINGERPRINT_WORD] = with_fp ? static_cast<kvc_i64>(fp[i]) : 0;
      e.rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(link[i]);
      if (kvc_write::finish_entry(in, i, e, static_cast<kvc_i64>(prev_pos[i]), q.position_assert, true, ring,
                                  a.canary_buf, a.slot_stride_bytes))
        ++stored;
    }
  }
  return stored;
}

// The write in passes: every token's fingerprint (the bulk of the work: the K/V bytes; it reads
// nothing the walk writes, so its tokens are split over the team); then, when the chains do not
// depend on the launch's own stores (chains_independent), every request's chain folded apart (split
// over the team by requests) and the checks and stores in request order on this thread (in-batch
// duplicate slots and the ring want request order); else the requests walked in order on this thread.
inline void write(const Team& threads, const kvc_write::Args& a, const kvc_write::Inputs& in,
                  const kvc::RealKvSources& kv, const kvc::Ring& ring) {
  atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  const size_t tokens = static_cast<size_t>(a.num_tokens > 0 ? a.num_tokens : 0);
  kvc_u64* const fp = scratch(3 * tokens);
  kvc_u64* const link = fp + tokens;
  kvc_u64* const prev_pos = link + tokens;
  if (kvc::real_kv_active(kv))
    parallel_ranges(team_size(threads, a.num_tokens), a.num_tokens,
                    [&](int, kvc_i64 lo, kvc_i64 hi) { token_fingerprints(in, kv, lo, hi, fp); });
  unsigned long long stored = 0;
  std::vector<kvc_write::Request> reqs;
  if (chains_independent(a, in, kv, ring, reqs)) {
    const kvc_i64 count = static_cast<kvc_i64>(reqs.size());
    // Requests, not tokens, are split: a team member takes kChains requests at least.
    const kvc_i64 groups = (count + kChains - 1) / kChains;
    const int team = team_size(threads, a.num_tokens);
    parallel_ranges(team < groups ? team : static_cast<int>(groups), count, [&](int, kvc_i64 lo, kvc_i64 hi) {
      fold_chains(a, in, kv, fp, reqs.data(), lo, hi, link, prev_pos);
    });
    stored = store_requests(a, in, kv, ring, fp, link, prev_pos);
  } else {
    if (!kvc::real_kv_active(kv))
      for (size_t i = 0; i < tokens; ++i) fp[i] = 0;
    const KnownFingerprint known{fp, a, in};
    for (kvc_i64 r = 0; r < a.write_req_capacity; ++r) {
      kvc_write::Request q;
      if (kvc_write::begin_request(a, ring, r, true, q)) stored += kvc_write::walk_request(a, in, kv, ring, q, known);
    }
  }
  if (stored != 0) atomicAdd(a.slot_run_counter, stored);
}

// -- plan (docs/semantics.md §5.3) --------------------------------------------------------------------
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

// -- scatter (docs/semantics.md §5.4): in request order (of two requests with one row, the later wins) --
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
