// The native cpu backend's kernels: the schema's write, verify, plan and scatter as host loops over
// the rows and entries a GPU grid would cover, calling the same device functions as the CUDA
// kernels (kvc_device.cuh: hashing, the chain, the ring, the real-KV fingerprint; kvc_write.cuh,
// kvc_verify.cuh, kvc_plan.cuh, kvc_scatter.cuh: one entry's or one request's work), compiled as
// host code with the system compiler (kv_canary/trees/cpu_build.py).
//
// The generated cpu/kv_canary_cpu.cpp includes this first (it includes the schema's layout header
// itself, after the host qualifiers) and defines one extern "C" function per kernel entry point,
// taking the kernel's own parameters and building the same argument structs as the CUDA entry point.
//
// Threads: a launch splits its entries (verify, plan entries) or, for the write's fingerprints, its
// tokens into contiguous ranges, one per std::thread, at most Team::threads of them and never less
// than Team::grain items each (a small launch runs on the calling thread alone). Threads are started
// per launch: nothing spins between launches and a forked process inherits no pool. (A pool kept
// between launches was tried: woken by a condition variable it was no faster on a loaded 2-core
// machine, 8,192-entry verify on 2 threads 149-183 us against 103-181 us; spinning for the next
// launch was slower still, 190-200 us, as the spinning threads take the cores others need.)
//
// Order: docs/semantics.md §5.2 wants a host backend's verify rows in entry order, and the reference's
// write semantics are sequential (a seed written by an earlier request of the launch is read with
// its values; of two entries storing one slot the later wins). So verify threads append to private
// rings that are appended to the launch's ring in range order afterwards. The write computes its
// fingerprints first, in parallel (the bulk of its work: they read only the K/V sources), and so the
// requests' chains when no chain starts from a store of the same launch; its stores then go in
// request order, either each thread storing a share of the requests through a private ring, or,
// where two shares store one slot or the chains depend on the launch's own stores, on one thread
// (see write()).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// -- the real-KV sources as the host loops read them -------------------------------------------------
// kvc::real_kv_in_range and kvc::real_kv_slot divide a slot by each source's page size, and g++ folds
// their `page == 1 ? slot : slot / page` into the division alone (x / 1 == x): every call costs a
// 64-bit idiv per source, tens of cycles (measured: most of the write's token loop, and a large part
// of each fingerprint). The host loops read the sources through this view, made once per launch: the
// range check as one comparison, and a slot's bytes by a shift and a mask where the page size is a
// power of two and the row keeps no token groups. Same slots in range, same addresses.
// Where a source whose slot bytes are not one run (heads apart, chunks apart: vLLM's CPU caches) is
// read: kvc::load_logical_u64x2 finds each 16 logical bytes by dividing their offset by the head's
// bytes and each chunk's index by its chunk group, tens of cycles per chunk of 2 or 4 bytes. The host
// loops take the offset of every load from the slot's first byte (kvc::real_kv_slot) from this list,
// made once per launch by the same arithmetic (the same bytes, in the same order), and fold kLanes
// slots in lock-step (piece_fingerprints). Measured on a 2-core Xeon, vLLM's AMX K and V of 256
// bytes a slot each, 8,192 slots at random, one thread: write 1,837 -> 241 ns a slot, verify 1,835 ->
// 233 (packed rows of the same size: 57 and 68); vLLM CPU's canary time per step (bench_vllm.py,
// cpu backend) 3.2 -> 1.2 ms.
struct Pieces {
  int words[kvc::MAX_REAL_KV_SOURCES];     // 16-byte logical words of a slot's read
  int per_word[kvc::MAX_REAL_KV_SOURCES];  // loads per word: 1 (16 bytes) or 16 / chunk bytes
  size_t first[kvc::MAX_REAL_KV_SOURCES];  // the source's first load in `offset`
  std::vector<kvc_i64> offset;
};

struct HostKv {
  const kvc::RealKvSources* kv;
  int sources;       // the sources a fingerprint reads: 0 when it reads none (kvc::real_kv_active)
  bool bounded;      // every source's page size is positive: in_range is one comparison
  bool contiguous;   // every source's slot bytes are one run (kvc::real_kv_contiguous)
  kvc_i64 limit;     // bounded: a slot >= 0 is in every source iff slot < limit
  int len[kvc::MAX_REAL_KV_SOURCES];  // kvc::real_kv_read_len
  const unsigned char* ptr[kvc::MAX_REAL_KV_SOURCES];
  kvc_i64 row_stride[kvc::MAX_REAL_KV_SOURCES];
  kvc_i64 token_stride[kvc::MAX_REAL_KV_SOURCES];
  int shift[kvc::MAX_REAL_KV_SOURCES];  // log2 of the page size, or -1 when it is no power of two
  kvc_i64 mask[kvc::MAX_REAL_KV_SOURCES];
  Pieces pieces;  // every source's loads, when some source is not one run (!contiguous)

  // kvc::real_kv_in_range(kv, slot), slot >= 0.
  inline bool in_range(kvc_i64 slot) const { return bounded ? slot < limit : kvc::real_kv_in_range(*kv, slot); }
  // kvc::real_kv_slot(kv, s, slot), slot >= 0 and in range.
  inline const unsigned char* row(int s, kvc_i64 slot) const {
    if (shift[s] < 0) return kvc::real_kv_slot(*kv, s, slot);
    return ptr[s] + (slot >> shift[s]) * row_stride[s] + (slot & mask[s]) * token_stride[s];
  }
};

// Source s's loads for n logical bytes (kvc::real_kv_fingerprint's and kvc::load_logical_u64x2's
// addresses, less the slot's first byte).
inline void add_pieces(const kvc::RealKvSources& kv, int s, int n, Pieces& g) {
  constexpr int kWord = kvc::REAL_KV_LOAD_ALIGN_BYTES;
  const bool run = kvc::real_kv_contiguous(kv, s);
  const int cb = run ? 0 : kv.chunk_bytes[s];
  g.first[s] = g.offset.size();
  g.words[s] = (n + kWord - 1) / kWord;
  g.per_word[s] = cb == 0 || cb >= kWord ? 1 : kWord / cb;
  for (int b = 0; b < n; b += kWord) {
    if (run) {
      g.offset.push_back(b);
      continue;
    }
    const int head_bytes = kv.num_bytes_per_token[s] / kv.num_heads[s];
    const int h = b / head_bytes;
    const int o = b - h * head_bytes;
    const kvc_i64 q = h * kv.head_stride_bytes[s];
    if (cb == 0) {
      g.offset.push_back(q + o);
    } else if (cb >= kWord) {
      const int c = o / cb;
      g.offset.push_back(q + kvc::real_kv_chunk_offset(kv, s, c) + (o - c * cb));
    } else {
      for (int k = 0; k < kWord / cb; ++k) g.offset.push_back(q + kvc::real_kv_chunk_offset(kv, s, o / cb + k));
    }
  }
}

inline HostKv host_kv(const kvc::RealKvSources& kv) {
  HostKv h{};
  h.kv = &kv;
  h.sources = kvc::real_kv_active(kv) ? std::min(kv.num_sources, kvc::MAX_REAL_KV_SOURCES) : 0;
  h.bounded = h.contiguous = true;
  h.limit = INT64_MAX;
  for (int s = 0; s < h.sources; ++s) {
    const kvc_i64 page = kv.page_size[s], rows = kv.num_rows[s];
    h.len[s] = std::max(kvc::real_kv_read_len(kv, s), 0);
    h.ptr[s] = kv.ptr[s];
    h.row_stride[s] = kv.row_stride_bytes[s];
    h.token_stride[s] = kv.token_stride_bytes[s];
    h.contiguous = h.contiguous && kvc::real_kv_contiguous(kv, s);
    h.shift[s] = -1;
    if (page <= 0) {  // refused by the launch's validation; the device functions decide
      h.bounded = false;
      continue;
    }
    // slot / page >= rows  <=>  slot >= rows * page, for slot >= 0 and page > 0
    const kvc_i64 last = rows <= 0 ? 0 : rows > INT64_MAX / page ? INT64_MAX : rows * page;
    h.limit = std::min(h.limit, last);
    if ((page & (page - 1)) == 0 && kv.token_group_size[s] == 0) {  // token groups: kvc::real_kv_slot
      h.shift[s] = __builtin_ctzll(static_cast<unsigned long long>(page));
      h.mask[s] = page - 1;
    }
  }
  if (!h.contiguous)
    for (int s = 0; s < h.sources; ++s) add_pieces(kv, s, h.len[s], h.pieces);
  return h;
}

// -- prefetch ------------------------------------------------------------------------------------
// Slots arrive in any order (a pool's free list), so records and K/V rows are read at random: one
// entry at a time, each of its cache (and TLB) misses would be waited for in turn. The loops ask for
// the lines of later entries while they hash this block's, so misses overlap.
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

// Lines asked for a few at a time. A burst of prefetches stalls the core once the line fill buffers
// are full (each further prefetch waits for one), so the lines of later entries asked for at the
// start of a block kept that block's hashing from overlapping them; spread between the hash's mixes
// (fingerprint_block), they overlap (measured on a 2-core Xeon, sequential slots: verify ALL 1.94 ->
// 1.80 ms, write ALL 2.07 -> 1.86 ms). The queue holds runs, not lines: filling it line by line cost
// a fifth of a cache-resident verify (measured: verify ALL 31.6 -> 26.0 ns per entry, 4,096 entries).
struct LineQueue {
  // A block's later entries: each a record, a prev's record and a run per source (static_assert below).
  static constexpr int kMax = 32 * (2 + kvc::MAX_REAL_KV_SOURCES);
  const unsigned char* at[kMax];  // runs of bytes, their lines asked for when the run's turn comes
  kvc_i64 bytes[kMax];
  int size = 0, next = 0;
  inline void add(const unsigned char* p, kvc_i64 n) {
    if (size == kMax) return;
    at[size] = p;
    bytes[size++] = n;
  }
  inline void add_record(const unsigned char* buf, kvc_i64 num_slots, kvc_i64 stride, kvc_i64 slot) {
    if (slot >= 0 && slot < num_slots) add(buf + slot * stride, kvc::CANARY_RECORD_BYTES);
  }
  inline void add_kv(const HostKv& hk, kvc_i64 slot) {
    if (!hk.contiguous || slot < 0 || !hk.in_range(slot)) return;
    for (int s = 0; s < hk.sources; ++s) add(hk.row(s, slot), hk.len[s]);
  }
  // The lines of about 1/steps of the runs not yet asked for.
  inline void some(int steps) {
    const int end = std::min(size, next + (size - next + steps - 1) / steps);
    for (; next < end; ++next) prefetch_bytes<0>(at[next], bytes[next]);
  }
  inline void rest() { some(1); }
};

// -- fingerprints, a block of slots at a time -------------------------------------------------------
// kvc::real_kv_fingerprint of one slot is a chain of dependent mixes (two multiplies each, per 8
// bytes), so one slot at a time runs at the multiplier's latency. The same fold over kLanes slots in
// lock-step keeps kLanes chains in one vector (kvc::splitmix64_lanes), and a block folds kGroups
// vectors of every source at once: a vector mix's latency (measured: ~14 ns with vpmullq) is
// covered only by about 8 independent vectors in flight (measured: 2 vectors ~8 ns per mix, 8
// vectors ~2.4 ns). Same bytes (real_kv_slot, real_kv_read_len), same order of words, same fold as
// real_kv_fingerprint.
constexpr int kLanes = 8;
typedef kvc_u64 Lanes __attribute__((vector_size(kLanes * 8)));  // word k of each of kLanes slots
typedef kvc_i64 LaneMask __attribute__((vector_size(kLanes * 8)));  // a comparison's result: -1 or 0
constexpr int kGroups = 4;
constexpr int kBlock = kGroups * kLanes;  // slots a block fingerprints; entries a loop classifies at once
static_assert(LineQueue::kMax >= kBlock * (2 + kvc::MAX_REAL_KV_SOURCES), "a block's lines fit the queue");

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

// The 16 bytes at rows[j] + b of kLanes rows as two words each: lo[j], hi[j] (kvc::load_u64x2).
inline void load_pairs(const unsigned char* const* rows, int b, Lanes& lo, Lanes& hi) {
  Lanes first, second;  // rows 0-3, rows 4-7: 16 bytes each
#if defined(__AVX512F__)
  // 128-bit inserts: the portable form below stores 16-byte halves and reloads them as one vector,
  // which store forwarding cannot serve (measured: the reload stalls every PARTIAL chain)
  auto four = [&](int j) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + b)));
    v = _mm512_inserti64x2(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 1] + b)), 1);
    v = _mm512_inserti64x2(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 2] + b)), 2);
    return reinterpret_cast<Lanes>(_mm512_inserti64x2(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 3] + b)), 3));
  };
  first = four(0);
  second = four(4);
#else
  for (int j = 0; j < 4; ++j) {
    __builtin_memcpy(reinterpret_cast<unsigned char*>(&first) + 16 * j, rows[j] + b, 16);
    __builtin_memcpy(reinterpret_cast<unsigned char*>(&second) + 16 * j, rows[4 + j] + b, 16);
  }
#endif
  lo = __builtin_shuffle(first, second, Lanes{0, 2, 4, 6, 8, 10, 12, 14});
  hi = __builtin_shuffle(first, second, Lanes{1, 3, 5, 7, 9, 11, 13, 15});
}

// out[j] = kvc::real_kv_fingerprint(kv, slots[j]) for the kBlock slots (in range; every source
// contiguous; kS == hk.sources).
template <int kS>
inline void fingerprint_block(const HostKv& hk, const kvc_i64* slots, kvc_u64* out, LineQueue& ahead) {
  const unsigned char* p[kS][kBlock];
  int columns = 0, chunks = 0;  // 64-byte columns, then 16-byte chunks: the most of any source
  for (int s = 0; s < kS; ++s) {
    for (int j = 0; j < kBlock; ++j) p[s][j] = hk.row(s, slots[j]);
    columns = std::max(columns, hk.len[s] / 64);
    chunks = std::max(chunks, (hk.len[s] % 64 + kvc::REAL_KV_LOAD_ALIGN_BYTES - 1) / kvc::REAL_KV_LOAD_ALIGN_BYTES);
  }
  Lanes h[kS][kGroups] = {};
  int steps = columns * kLanes + 2 * chunks;  // mixes of each vector, between which lines are asked for
  for (int c = 0; c < columns; ++c) {  // 64 bytes of every slot: loads and a transpose per vector, 8 mixes
    const int b = 64 * c;
    Lanes w[kS][kGroups][kLanes];
    for (int s = 0; s < kS; ++s)
      if (b + 64 <= hk.len[s])
        for (int g = 0; g < kGroups; ++g) {
          for (int j = 0; j < kLanes; ++j) __builtin_memcpy(&w[s][g][j], p[s][g * kLanes + j] + b, sizeof(Lanes));
          transpose(w[s][g]);
        }
    for (int k = 0; k < kLanes; ++k) {
      ahead.some(steps--);
      for (int s = 0; s < kS; ++s)
        if (b + 64 <= hk.len[s])
          for (int g = 0; g < kGroups; ++g) h[s][g] = kvc::splitmix64_lanes(h[s][g] ^ w[s][g][k]);
    }
  }
  for (int c = 0; c < chunks; ++c) {  // the 16-byte chunks past each source's columns
    ahead.some(steps);
    steps -= 2;
    for (int s = 0; s < kS; ++s) {
      const int b = hk.len[s] / 64 * 64 + c * kvc::REAL_KV_LOAD_ALIGN_BYTES;
      if (b >= hk.len[s]) continue;
      for (int g = 0; g < kGroups; ++g) {
        Lanes lo, hi;
        load_pairs(&p[s][g * kLanes], b, lo, hi);
        h[s][g] = kvc::splitmix64_lanes(h[s][g] ^ lo);
        h[s][g] = kvc::splitmix64_lanes(h[s][g] ^ hi);
      }
    }
  }
  Lanes total[kGroups] = {};
  for (int s = 0; s < kS; ++s)
    for (int g = 0; g < kGroups; ++g) total[g] = kvc::splitmix64_lanes(total[g] ^ h[s][g]);
  __builtin_memcpy(out, total, sizeof(total));
}

template <int kS>
inline void fingerprint_blocks(const HostKv& hk, const kvc_i64* slots, kvc_i64 n, kvc_u64* out, LineQueue& ahead) {
  kvc_i64 k = 0;
  for (; k + kBlock <= n; k += kBlock) fingerprint_block<kS>(hk, slots + k, out + k, ahead);
  if (k == n) return;
  kvc_i64 last[kBlock];  // the last slots, then the first of them again (its fingerprint is dropped)
  kvc_u64 got[kBlock];
  for (int j = 0; j < kBlock; ++j) last[j] = slots[k + j < n ? k + j : k];
  fingerprint_block<kS>(hk, last, got, ahead);
  for (kvc_i64 j = 0; k + j < n; ++j) out[k + j] = got[j];
}

// The 16 logical bytes of word `w` (loads `off`) of kLanes slots (first bytes p) as two words each.
template <int kPerWord>
inline void load_piece_words(const unsigned char* const* p, const kvc_i64* off, Lanes& lo, Lanes& hi) {
  for (int j = 0; j < kLanes; ++j) {
    if (kPerWord == 1) {
      kvc_u64 a, b;
      kvc::load_u64x2(p[j] + off[0], a, b);
      lo[j] = a;
      hi[j] = b;
      continue;
    }
    constexpr int kBytes = kvc::REAL_KV_LOAD_ALIGN_BYTES / kPerWord, kHalf = kPerWord / 2;
    kvc_u64 w[2] = {0, 0};  // kvc::load_logical_u64x2's assembly: the first half of the chunks into lo
    for (int k = 0; k < kPerWord; ++k) w[k / kHalf] |= kvc::load_chunk(p[j] + off[k], kBytes) << (8 * kBytes * (k % kHalf));
    lo[j] = w[0];
    hi[j] = w[1];
  }
}

// out[k] = kvc::real_kv_fingerprint(kv, slots[k]) for k < n (every slot >= 0 and in range) through
// hk.pieces, kLanes slots in lock-step (each slot's fold is a chain of dependent mixes).
inline void piece_fingerprints(const HostKv& hk, const kvc_i64* slots, kvc_i64 n, kvc_u64* out) {
  const Pieces& g = hk.pieces;
  for (kvc_i64 k0 = 0; k0 < n; k0 += kLanes) {
    kvc_i64 slot[kLanes];  // the last ones padded with a copy (their fingerprints are dropped)
    for (int j = 0; j < kLanes; ++j) slot[j] = slots[k0 + j < n ? k0 + j : n - 1];
    Lanes total = {};
    for (int s = 0; s < hk.sources; ++s) {
      const unsigned char* p[kLanes];
      for (int j = 0; j < kLanes; ++j) p[j] = hk.row(s, slot[j]);
      const kvc_i64* off = g.offset.data() + g.first[s];
      const int per = g.per_word[s];
      Lanes h = {};
      for (int w = 0; w < g.words[s]; ++w, off += per) {
        Lanes lo, hi;
        switch (per) {
          case 1: load_piece_words<1>(p, off, lo, hi); break;
          case 2: load_piece_words<2>(p, off, lo, hi); break;
          case 4: load_piece_words<4>(p, off, lo, hi); break;
          default: load_piece_words<8>(p, off, lo, hi); break;
        }
        h = kvc::splitmix64_lanes(h ^ lo);
        h = kvc::splitmix64_lanes(h ^ hi);
      }
      total = kvc::splitmix64_lanes(total ^ h);
    }
    for (int j = 0; j < kLanes && k0 + j < n; ++j) out[k0 + j] = total[j];
  }
}

// out[k] = kvc::real_kv_fingerprint(kv, slots[k]) for k < n (every slot >= 0 and in range), asking for
// the lines queued in `ahead` meanwhile.
inline void fingerprints(const HostKv& hk, const kvc_i64* slots, kvc_i64 n, kvc_u64* out, LineQueue& ahead) {
  if (hk.sources == 0) {
    for (kvc_i64 k = 0; k < n; ++k) out[k] = 0;
    return;
  }
  if (hk.contiguous) {  // else some source's bytes are not one run (heads or chunks apart): hk.pieces
    switch (hk.sources) {
      case 1: return fingerprint_blocks<1>(hk, slots, n, out, ahead);
      case 2: if constexpr (kvc::MAX_REAL_KV_SOURCES >= 2) return fingerprint_blocks<2>(hk, slots, n, out, ahead); break;
      case 3: if constexpr (kvc::MAX_REAL_KV_SOURCES >= 3) return fingerprint_blocks<3>(hk, slots, n, out, ahead); break;
      case 4: if constexpr (kvc::MAX_REAL_KV_SOURCES >= 4) return fingerprint_blocks<4>(hk, slots, n, out, ahead); break;
      default: break;
    }
  }
  piece_fingerprints(hk, slots, n, out);
}

// How far ahead (in entries) the loops ask for lines: about kLinesAhead lines in flight, at least a
// block; 0 (nothing asked for) when no source reads more than one line of a slot. Rows that follow
// each other are asked for too: reading 128 B of every 256 B row is a stride the hardware prefetcher
// covers badly (measured on a 2-core AMD EPYC: verify ALL 3.9 -> 2.6 ms over consecutive slots with
// the prefetches). One line per slot (PARTIAL) needs none: a block's loads are all independent and
// in flight at once, and the prefetches only cost (measured on a 2-core Xeon: verify PARTIAL 1.42 ms
// without, 1.73-1.78 ms with 5 to 32 entries ahead; verify ALL 2.44 ms without, 2.16-2.32 with).
// Also tried for PARTIAL (issue 31), none clearly better over 65,536 entries, before and after
// alternated on one loaded 2-core Xeon, best of 300: a PARTIAL block form (16 bytes per source per
// slot loaded with no pointer table, then hashed) asking for the next block's lines a group of 8
// slots at a time (verify in order 1.46-1.62 -> 1.49-1.61 ms, at random 1.63-1.67 -> 1.75-2.20 ms;
// write in order 1.72-2.30 -> 1.76-1.82 ms, at random 1.86-2.59 -> 1.79-1.89 ms), the same with
// prefetcht2 (verify in order 1.69-2.01 ms), and a whole block's lines 32 to 256 entries ahead at a
// block's start (1.66-1.90 ms, 1.44 without). The same verify with every slot's K/V rows in cache
// takes 0.86 ms (write 1.19 ms): PARTIAL's remaining time is the line misses of 2 rows per entry,
// which the loops' compute does not hide.
constexpr kvc_i64 kLinesAhead = 96;
inline kvc_i64 prefetch_ahead(const HostKv& hk) {
  kvc_i64 lines = 1;  // the record
  bool long_rows = false;
  for (int s = 0; s < hk.sources; ++s) {
    lines += (hk.len[s] + kLine - 1) / kLine;
    long_rows = long_rows || hk.len[s] > kLine;
  }
  if (!long_rows || !hk.contiguous) return 0;
  const kvc_i64 ahead = kLinesAhead / lines;
  return ahead < kBlock ? kBlock : ahead > 4 * kBlock ? 4 * kBlock : ahead;
}

// -- vector helpers ----------------------------------------------------------------------------------
// The 8-byte words at base + off[j].
inline Lanes gather(const unsigned char* base, const Lanes& off) {
#if defined(__AVX512F__)
  // the masked form: the plain one starts from _mm512_undefined, which g++ 12 warns of (-Werror)
  return reinterpret_cast<Lanes>(
      _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFF, reinterpret_cast<__m512i>(off), base, 1));
#else
  Lanes v;
  for (int j = 0; j < kLanes; ++j) __builtin_memcpy(&v[j], base + off[j], 8);
  return v;
#endif
}

// acc[v] folded with the words W of the records at base + off[v] for v < vectors (kvc::fold_words,
// kLanes records per vector), the vectors in lock-step (one vector's mixes are a dependent chain).
template <int... W>
inline void fold_words_lanes(Lanes* acc, int vectors, const unsigned char* base, const Lanes* off, kvc::Words<W...>) {
  ((void)[&] {
    Lanes word[kBlock / kLanes];
    for (int v = 0; v < vectors; ++v) word[v] = gather(base, off[v] + static_cast<kvc_u64>(8 * W));
    for (int v = 0; v < vectors; ++v) acc[v] = kvc::splitmix64_lanes(acc[v] ^ word[v]);
  }(), ...);
}

// -- verify (docs/semantics.md §5.2) ------------------------------------------------------------------
// Whether the schema verifies input fields too (kvc_verify::input_checks of per_request and per_slot words).
constexpr bool kInputChecks = kvc::PerRequestWords::count + kvc::PerSlotWords::count > 0;

// clean[k] for k < n of a block's checked entries (ent[k], slot[k], prev[k], fingerprint fp[k]; the
// arrays hold whole vectors, padded with copies): true where kvc_verify::check_entry finds nothing
// in the record, the chain, the position, the fingerprint and the expected token (not the input
// fields: kInputChecks). kLanes entries per vector: the records' words gathered, the prevs' chain
// links (kvc::slot_hash) folded in lanes.
template <bool kCheckExpectedToken>
inline void clean_entries(const kvc_verify::Args& a, const kvc_i64* ent, const kvc_i64* slot, const kvc_i64* prev,
                          const kvc_u64* fp, int n, bool* clean) {
  constexpr int kVectors = kBlock / kLanes;
  const kvc_u64 stride = static_cast<kvc_u64>(a.slot_stride_bytes);
  const unsigned char* buf = a.canary_buf;
  const int vectors = (n + kLanes - 1) / kLanes;
  Lanes prev_at[kVectors] = {}, link[kVectors] = {};  // initialised: g++ -O1 (the sanitizer build) warns otherwise
  for (int v = 0; v < vectors; ++v) {  // the prevs' chain links (kvc::slot_hash), every vector in lock-step
    Lanes sl, pv;
    __builtin_memcpy(&sl, slot + v * kLanes, sizeof(Lanes));
    __builtin_memcpy(&pv, prev + v * kLanes, sizeof(Lanes));
    prev_at[v] = reinterpret_cast<LaneMask>(pv) < 0 ? sl * stride : pv * stride;  // a head reads nothing of its own
    link[v] = gather(buf, prev_at[v] + static_cast<kvc_u64>(8 * kvc::CHAIN_LINK_WORD));
  }
  for (int v = 0; v < vectors; ++v) link[v] = kvc::splitmix64_lanes(link[v]);
  fold_words_lanes(link, vectors, buf, prev_at, kvc::ChainFoldWords{});
  for (int v = 0; v < vectors; ++v) {
    const int k = v * kLanes;
    Lanes sl, pv, en, kv_hash;
    __builtin_memcpy(&sl, slot + k, sizeof(Lanes));
    __builtin_memcpy(&pv, prev + k, sizeof(Lanes));
    __builtin_memcpy(&en, ent + k, sizeof(Lanes));
    __builtin_memcpy(&kv_hash, fp + k, sizeof(Lanes));
    const Lanes at = sl * stride;
    const Lanes expected_chain = reinterpret_cast<LaneMask>(pv) < 0 ? Lanes{} + kvc::CHAIN_HEAD : link[v];
    const LaneMask reachable = pv != static_cast<kvc_u64>(kvc::TOKEN_TO_KV_SLOT_PADDING);
    LaneMask bad = reachable & (gather(buf, at + static_cast<kvc_u64>(8 * kvc::CHAIN_LINK_WORD)) != expected_chain);
    bad |= gather(buf, at + static_cast<kvc_u64>(8 * kvc::POSITION_WORD)) !=
           gather(reinterpret_cast<const unsigned char*>(a.verify_expected_positions), en * 8);
    bad |= gather(buf, at + static_cast<kvc_u64>(8 * kvc::KV_FINGERPRINT_WORD)) != kv_hash;
    if (kCheckExpectedToken) {
      const Lanes expected = gather(reinterpret_cast<const unsigned char*>(a.verify_expected_tokens), en * 8);
      bad |= (expected != static_cast<kvc_u64>(kvc::UNKNOWN)) &
             (gather(buf, at + static_cast<kvc_u64>(8 * kvc::TOKEN_WORD)) != expected);
    }
    for (int j = 0; j < kLanes && k + j < n; ++j) clean[k + j] = bad[j] == 0;
  }
}

// The input-field checks of kvc_verify::check_entry alone, for entry e at slot.
inline kvc_i64 input_bits(const kvc_verify::Args& a, kvc_i64 e, kvc_i64 slot) {
  kvc_i64 rec[kvc::CANARY_FIELDS];
  kvc::load_record(a.canary_buf, slot, a.slot_stride_bytes, rec);
  return kvc_verify::input_checks<true>(rec, a.expected, e, kvc::PerRequestWords{}, kvc::PerRequestReasons{}) |
         kvc_verify::input_checks<false>(rec, a.slot_tables, slot, kvc::PerSlotWords{}, kvc::PerSlotReasons{});
}

// Entries [lo, hi) in blocks of kBlock: each block's entries are sorted (those prepare_entry would
// check: a slot in the buffer and in every source, a prev in the buffer), the checked ones'
// fingerprints hashed a block at a time and their checks run kLanes at a time (clean_entries); then
// the block's entries are finished in order: nothing for a clean one, check_entry for one that is
// not, prepare_entry on the launch's ring for one that is not checked (its out-of-range row, or
// nothing for padding). A block of clean entries appends nothing and is done.
template <bool kCheckExpectedToken>
inline void verify_range(const kvc_verify::Args& a, const HostKv& hk, const kvc::Ring& ring, kvc_i64 lo,
                         kvc_i64 hi) {
  const kvc::RealKvSources& kv = *hk.kv;
  kvc_i64 ent[kBlock], slot[kBlock], prev[kBlock];
  kvc_u64 fp[kBlock];
  bool clean[kBlock];
  const kvc_i64 ahead = prefetch_ahead(hk);
  for (kvc_i64 b = lo; b < hi; b += kBlock) {
    const kvc_i64 end = hi - b < kBlock ? hi : b + kBlock;
    LineQueue lines;
    for (kvc_i64 e = b; ahead > 0 && e < end && e + ahead < hi; ++e) {  // lines for later entries
      const kvc_i64 later = a.verify_slot_indices[e + ahead], later_prev = a.verify_prev_slot_indices[e + ahead];
      lines.add_record(a.canary_buf, a.num_slots, a.slot_stride_bytes, later);
      lines.add_kv(hk, later);
      if (later_prev != a.verify_slot_indices[e + ahead - 1])  // else the record asked for just before
        lines.add_record(a.canary_buf, a.num_slots, a.slot_stride_bytes, later_prev);
    }
    int n = 0;
    for (kvc_i64 e = b; e < end; ++e) {  // prepare_entry's test, without its report
      const kvc_i64 s = a.verify_slot_indices[e], p = a.verify_prev_slot_indices[e];
      if (s == kvc::TOKEN_TO_KV_SLOT_PADDING || s < 0 || s >= a.num_slots || p >= a.num_slots || !hk.in_range(s))
        continue;
      ent[n] = e;
      slot[n] = s;
      prev[n++] = p;
    }
    if (n > 0) {
      const int padded = (n + kLanes - 1) / kLanes * kLanes;
      for (int k = n; k < padded; ++k) {
        ent[k] = ent[0];
        slot[k] = slot[0];
        prev[k] = prev[0];
      }
      fingerprints(hk, slot, padded, fp, lines);
      clean_entries<kCheckExpectedToken>(a, ent, slot, prev, fp, n, clean);
    }
    lines.rest();
    bool done = n == end - b;
    for (int k = 0; k < n && done; ++k) done = clean[k] && (!kInputChecks || input_bits(a, ent[k], slot[k]) == 0);
    if (done) continue;
    for (kvc_i64 e = b, k = 0; e < end; ++e) {
      if (k < n && ent[k] == e) {
        if (!clean[k] || kInputChecks)
          kvc_verify::check_entry<kCheckExpectedToken>(a, ring, e, slot[k], prev[k], fp[k]);
        ++k;
      } else {
        kvc_i64 s = 0, p = 0;
        kvc_verify::prepare_entry<kCheckExpectedToken>(a, kv, ring, e, s, p);
      }
    }
  }
}

// One thread's entries [lo, hi) into `rows`, in entry order, through a private ring emptied every kRowBlock entries.
template <bool kCheckExpectedToken>
inline void verify_rows(const kvc_verify::Args& a, const HostKv& hk, kvc_i64 launch_tag, kvc_i64 lo, kvc_i64 hi,
                        std::vector<kvc::ViolationRow>& rows) {
  std::vector<kvc::ViolationRow> block(kRowBlock);
  int count = 0;
  const kvc::Ring local{launch_tag, &block[0].col[0], kRowBlock, &count, nullptr};
  for (kvc_i64 b = lo; b < hi; b += kRowBlock) {
    verify_range<kCheckExpectedToken>(a, hk, local, b, hi - b < kRowBlock ? hi : b + kRowBlock);
    rows.insert(rows.end(), block.begin(), block.begin() + count);  // count <= kRowBlock: one row per entry at most
    count = 0;
  }
}

template <bool kCheckExpectedToken>
void verify(const Team& threads, const kvc_verify::Args& a, const kvc::RealKvSources& kv, const kvc::Ring& ring) {
  static_assert(sizeof(kvc::ViolationRow) == sizeof(kvc_i64) * kvc::VIOLATION_FIELDS, "a row is its columns");
  static_assert(kRowBlock % kBlock == 0, "a private ring is emptied between blocks");
  atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  if (*a.verify_enable == 0) return;
  kvc_i64 active = *a.verify_num_valid;
  if (active > a.verify_capacity) active = a.verify_capacity;
  if (active <= 0) return;
  const HostKv hk = host_kv(kv);
  const int team = team_size(threads, active);
  if (team == 1) {
    verify_range<kCheckExpectedToken>(a, hk, ring, 0, active);
  } else {
    std::vector<std::vector<kvc::ViolationRow>> rows(team);
    parallel_ranges(team, active, [&](int t, kvc_i64 lo, kvc_i64 hi) {
      verify_rows<kCheckExpectedToken>(a, hk, ring.launch_tag, lo, hi, rows[t]);
    });
    for (const auto& part : rows)
      for (const auto& row : part) ring.append(row);
  }
  atomicAdd(a.slot_run_counter, static_cast<unsigned long long>(active));  // every visited entry
}

// -- write (docs/semantics.md §5.1) -------------------------------------------------------------------
// kvc_write::load_entry, with the range check through hk: load_entry is given sources that read
// nothing (every slot in their range), and the entry is stored only where hk also has the slot.
inline void load_entry(const kvc_write::Inputs& in, const HostKv& hk, kvc_i64 i, kvc_write::Entry& e) {
  static const kvc::RealKvSources none{};  // num_sources 0: kvc::real_kv_active is false
  kvc_write::load_entry(in, none, i, e);
  if (e.stored && !hk.in_range(e.slot)) e.stored = 0;
}

// The fingerprints of tokens [lo, hi) where the walk would store them (a slot in the buffer and in
// every source), into fp (the others are never read); between() after each block of them.
template <class Between>
inline void token_fingerprints(const kvc_write::Inputs& in, const HostKv& hk, kvc_i64 lo, kvc_i64 hi, kvc_u64* fp,
                               const Between& between) {
  kvc_i64 slot[kBlock], token[kBlock];
  kvc_u64 got[kBlock];
  const kvc_i64 ahead = prefetch_ahead(hk);
  for (kvc_i64 b = lo; b < hi; b += kBlock) {
    const kvc_i64 end = hi - b < kBlock ? hi : b + kBlock;
    LineQueue lines;
    for (kvc_i64 i = b; ahead > 0 && i < end && i + ahead < hi; ++i) lines.add_kv(hk, in.out_cache_loc[i + ahead]);
    int n = 0;
    for (kvc_i64 i = b; i < end; ++i) {
      const kvc_i64 s = in.out_cache_loc[i];
      if (s >= 0 && s < in.num_slots && hk.in_range(s)) {
        slot[n] = s;
        token[n++] = i;
      }
    }
    if (n == end - b) {  // every token stored: fingerprints straight into place
      fingerprints(hk, slot, n, fp + b, lines);
    } else {
      fingerprints(hk, slot, n, got, lines);
      for (int k = 0; k < n; ++k) fp[token[k]] = got[k];
    }
    lines.rest();
    between();
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
inline bool chains_independent(const kvc_write::Args& a, const kvc_write::Inputs& in, const HostKv& hk,
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
      if (slot < 0 || slot >= in.num_slots || !hk.in_range(slot)) continue;  // not stored
      auto it = std::upper_bound(seeds.begin(), seeds.end(), std::pair<kvc_i64, size_t>(slot, SIZE_MAX));
      if (it != seeds.begin() && (it - 1)->first == slot && (it - 1)->second > j) return false;
    }
  return true;
}

// The chains of requests [lo, hi) of reqs: entry i's chain link (the running hash before it) into
// link[i] and, where the request asserts positions, the previous stored entry's position into
// prev_pos[i]. kChains requests are folded in lock-step: each chain is a series of dependent mixes,
// so one at a time runs at the multiplier's latency. Same entries, same fold as walk_request. The
// fold goes on a few entries at a time (step), so that it can run between the blocks of a memory-bound
// loop (write()).
// Measured on a 2-core Xeon (write PARTIAL, 32 requests): 2 chains 1.59 ms, 4 1.46, 8 1.90 (more
// input streams than the L1 keeps apart).
constexpr int kChains = 4;
class ChainFold {
 public:
  ChainFold(const kvc_write::Args& a, const kvc_write::Inputs& in, const HostKv& hk, const kvc_u64* fp,
            const kvc_write::Request* reqs, kvc_i64 lo, kvc_i64 hi, kvc_u64* link, kvc_u64* prev_pos)
      : a_(a), in_(in), hk_(hk), fp_(fp), reqs_(reqs), next_(lo), hi_(hi), link_(link), prev_pos_(prev_pos) {}

  // About `entries` more entries (whole lock-step rounds); the rest of the fold when it is negative.
  void step(kvc_i64 entries) {
    const bool with_fp = hk_.sources > 0;
    while (entries != 0) {
      if (n_ == 0 && !start()) return;
      bool any = false;
      for (int u = 0; u < n_; ++u) {
        const kvc_i64 i = at_[u];
        if (i >= end_[u]) continue;
        any = true;
        at_[u] = i + 1;
        --entries;
        kvc_write::Entry e;
        load_entry(in_, hk_, i, e);
        link_[i] = c_[u].running;
        prev_pos_[i] = static_cast<kvc_u64>(c_[u].prev_pos);
        if (!e.stored) continue;  // skipped and out-of-range entries do not advance the chain
        e.rec[kvc::KV_FINGERPRINT_WORD] = with_fp ? static_cast<kvc_i64>(fp_[i]) : 0;
        e.rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(c_[u].running);
        c_[u].prev_pos = e.rec[kvc::POSITION_WORD];
        c_[u].running = kvc::chain_link(e.rec);  // §5.1 d
      }
      if (!any) n_ = 0;
    }
  }

 private:
  // The next kChains requests; false when none is left.
  bool start() {
    if (next_ >= hi_) return false;
    n_ = hi_ - next_ < kChains ? static_cast<int>(hi_ - next_) : kChains;
    for (int u = 0; u < n_; ++u) {
      const kvc_write::Request& q = reqs_[next_ + u];
      at_[u] = q.lo;
      end_[u] = q.hi;
      c_[u] = kvc_write::start_chain(a_.canary_buf, a_.slot_stride_bytes, q.seed);
    }
    next_ += n_;
    return true;
  }

  const kvc_write::Args& a_;
  const kvc_write::Inputs& in_;
  const HostKv& hk_;
  const kvc_u64* fp_;
  const kvc_write::Request* reqs_;
  kvc_i64 next_, hi_;
  kvc_u64* link_;
  kvc_u64* prev_pos_;
  int n_ = 0;
  kvc_i64 at_[kChains], end_[kChains];
  kvc_write::Chain c_[kChains];
};

// Whether the chain fold reads the fingerprints (the schema folds the fingerprint word): then it
// must wait for them, else it runs between the fingerprints' blocks.
template <int... W>
constexpr bool folds_fingerprint(kvc::Words<W...>) {
  return ((W == kvc::KV_FINGERPRINT_WORD) || ...);
}

// The slots one team member stores, a bit each: a slot two members store is seen when their marks
// are compared (a member stores its own in order).
class SlotMarks {
 public:
  explicit SlotMarks(size_t words) : bits_(words, 0) {}
  inline void mark(kvc_i64 slot) { bits_[static_cast<size_t>(slot) >> 6] |= kvc_u64{1} << (slot & 63); }
  // Whether two members marked one slot.
  static bool overlap(const std::vector<SlotMarks>& members) {
    for (size_t w = 0; members.size() > 1 && w < members[0].bits_.size(); ++w) {
      kvc_u64 seen = 0;
      for (const SlotMarks& m : members) {
        if (seen & m.bits_[w]) return true;
        seen |= m.bits_[w];
      }
    }
    return false;
  }

 private:
  std::vector<kvc_u64> bits_;
};

// Requests [rlo, rhi) in order, with their chains known: checks, violation rows and stores as
// walk_request does them, each stored slot marked in `marks` when there are any. after_step() runs
// after each request's start and each entry: each appends 2 rows at most.
template <class AfterStep>
inline unsigned long long store_requests(const kvc_write::Args& a, const kvc_write::Inputs& in, const HostKv& hk,
                                         const kvc::Ring& ring, const kvc_u64* fp, const kvc_u64* link,
                                         const kvc_u64* prev_pos, kvc_i64 rlo, kvc_i64 rhi, SlotMarks* marks,
                                         const AfterStep& after_step) {
  const bool with_fp = hk.sources > 0;
  unsigned long long stored = 0;
  for (kvc_i64 r = rlo; r < rhi; ++r) {
    kvc_write::Request q;
    const bool begun = kvc_write::begin_request(a, ring, r, true, q);  // reports an out-of-range seed, in order
    after_step();
    if (!begun) continue;
    for (kvc_i64 i = q.lo; i < q.hi; ++i) {
      if (i + kBlock < q.hi)
        prefetch_record<1>(a.canary_buf, a.num_slots, a.slot_stride_bytes, in.out_cache_loc[i + kBlock]);
      kvc_write::Entry e;
      load_entry(in, hk, i, e);
      if (e.stored) e.rec[kvc::KV_FINGERPRINT_WORD] = with_fp ? static_cast<kvc_i64>(fp[i]) : 0;
      e.rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(link[i]);
      if (kvc_write::finish_entry(in, i, e, static_cast<kvc_i64>(prev_pos[i]), q.position_assert, true, ring,
                                  a.canary_buf, a.slot_stride_bytes)) {
        ++stored;
        if (marks != nullptr) marks->mark(e.slot);
      }
      after_step();
    }
  }
  return stored;
}

// The stores of store_requests over every request, on up to `team` threads: each takes a contiguous
// share of the requests (about as many tokens each) and appends its rows to a private ring, whose rows
// go to the launch's ring in share order afterwards (request order, as on one thread). A slot stored
// by two requests must hold the later one's record: a member stores its own requests in order, and a
// slot two members store (their marks overlap: a launch that stores a slot twice, which the engine
// does not do) has every request stored again in order on this thread, before any row is appended.
// One thread, or a pool too large for the marks (more words of them than tokens): in order on this
// thread. (Measured on a 2-core Xeon, 65,536 tokens in 32 requests: 228 us of stores on one thread,
// 191 us on two, a thread's start included: ~40-70 us.)
inline unsigned long long store_in_order(int team, const kvc_write::Args& a, const kvc_write::Inputs& in,
                                         const HostKv& hk, const kvc::Ring& ring, const kvc_u64* fp,
                                         const kvc_u64* link, const kvc_u64* prev_pos) {
  kvc_i64 active = *a.write_num_valid_reqs;
  if (active > a.write_req_capacity) active = a.write_req_capacity;
  if (active < 0) active = 0;
  const size_t words = static_cast<size_t>(a.num_slots / 64 + 1);
  auto in_order = [&] { return store_requests(a, in, hk, ring, fp, link, prev_pos, 0, active, nullptr, [] {}); };
  if (team <= 1 || active < team || words > static_cast<size_t>(a.num_tokens)) return in_order();
  std::vector<kvc_i64> share(static_cast<size_t>(team) + 1, active);  // member t: requests [share[t], share[t + 1])
  share[0] = 0;
  {
    auto tokens = [&](kvc_i64 r) {
      const kvc_i64 lo = std::max<kvc_i64>(a.write_offsets[r], 0), hi = std::min(a.write_offsets[r + 1], a.num_tokens);
      return hi > lo ? hi - lo : 0;
    };
    kvc_i64 total = 0, seen = 0;
    for (kvc_i64 r = 0; r < active; ++r) total += tokens(r);
    int t = 1;
    for (kvc_i64 r = 0; r < active && t < team; ++r) {
      while (t < team && seen >= total / team * t + total % team * t / team) share[t++] = r;
      seen += tokens(r);
    }
  }
  std::vector<SlotMarks> marks(static_cast<size_t>(team), SlotMarks(words));
  std::vector<std::vector<kvc::ViolationRow>> rows(static_cast<size_t>(team));
  std::vector<unsigned long long> stored(static_cast<size_t>(team), 0);
  parallel_ranges(team, team, [&](int t, kvc_i64, kvc_i64) {
    std::vector<kvc::ViolationRow> block(kRowBlock);
    int count = 0;
    const kvc::Ring local{ring.launch_tag, &block[0].col[0], kRowBlock, &count, nullptr};
    auto keep = [&] {  // a step appends 2 rows at most: the block is emptied before it can fill
      if (count <= kRowBlock - 2) return;
      rows[t].insert(rows[t].end(), block.begin(), block.begin() + count);
      count = 0;
    };
    stored[t] = store_requests(a, in, hk, local, fp, link, prev_pos, share[t], share[t + 1], &marks[t], keep);
    rows[t].insert(rows[t].end(), block.begin(), block.begin() + count);
  });
  if (SlotMarks::overlap(marks)) return in_order();
  unsigned long long total = 0;
  for (int t = 0; t < team; ++t) {
    for (const auto& row : rows[t]) ring.append(row);
    total += stored[t];
  }
  return total;
}

// The write in passes: every token's fingerprint (the bulk of the work: the K/V bytes; it reads
// nothing the walk writes, so its tokens are split over the team); when the chains do not depend on
// the launch's own stores (chains_independent), every request's chain folded apart (split over the
// team by requests; between the fingerprints' blocks where the fold does not read them), then the
// checks and stores in request order (store_in_order: shares of the requests over the team); else
// the requests walked in order on this thread.
inline void write(const Team& threads, const kvc_write::Args& a, const kvc_write::Inputs& in,
                  const kvc::RealKvSources& kv, const kvc::Ring& ring) {
  atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  const HostKv hk = host_kv(kv);
  const size_t tokens = static_cast<size_t>(a.num_tokens > 0 ? a.num_tokens : 0);
  kvc_u64* const fp = scratch(3 * tokens);
  kvc_u64* const link = fp + tokens;
  kvc_u64* const prev_pos = link + tokens;
  const int team = team_size(threads, a.num_tokens);
  std::vector<kvc_write::Request> reqs;
  const bool independent = chains_independent(a, in, hk, ring, reqs);
  const kvc_i64 count = static_cast<kvc_i64>(reqs.size());
  // With fingerprints to compute and chains that do not read them, each team member folds its share
  // of the requests between the blocks of its share of the tokens: the fingerprints wait on memory,
  // the fold on the multiplier (measured on a 2-core Xeon, sequential slots: write PARTIAL 1.38 -> 1.28
  // ms, write ALL 1.85 -> 1.70 ms).
  // (Tried for issue 31 and not kept, alternated against this form on a loaded 2-core Xeon, one thread,
  // 65,536 tokens, best of each run: the stores trailing the fold between the fingerprints' blocks,
  // slower: write PARTIAL in order 1.65-1.68 -> 1.87-1.97 ms, write ALL 2.01-2.10 -> 2.26-2.29 ms; the
  // whole write in one pass, kChains requests' blocks of entries fingerprinted, folded, checked and
  // stored at once (a slot stored twice or a row to report: stored again in order), slower too: 0.083
  // -> 0.107 ms for 4,096 tokens in cache, write PARTIAL in order 1.72 -> 2.2 ms.)
  const bool between = independent && hk.sources > 0 && !folds_fingerprint(kvc::ChainFoldWords{});
  if (hk.sources > 0)
    parallel_ranges(team, a.num_tokens, [&](int t, kvc_i64 lo, kvc_i64 hi) {
      if (!between) return token_fingerprints(in, hk, lo, hi, fp, [] {});
      const kvc_i64 rlo = count * t / team, rhi = count * (t + 1) / team;  // this member's requests
      ChainFold fold(a, in, hk, fp, reqs.data(), rlo, rhi, link, prev_pos);
      kvc_i64 entries = 0;
      for (kvc_i64 r = rlo; r < rhi; ++r) entries += reqs[r].hi - reqs[r].lo;
      const kvc_i64 per_block = entries / ((hi - lo + kBlock - 1) / kBlock + 1) + 1;  // the fold spread evenly
      token_fingerprints(in, hk, lo, hi, fp, [&] { fold.step(per_block); });
      fold.step(-1);
    });
  unsigned long long stored = 0;
  if (independent) {
    if (!between) {  // requests, not tokens, are split: a team member takes kChains requests at least
      const kvc_i64 groups = (count + kChains - 1) / kChains;
      parallel_ranges(team < groups ? team : static_cast<int>(groups), count, [&](int, kvc_i64 lo, kvc_i64 hi) {
        ChainFold(a, in, hk, fp, reqs.data(), lo, hi, link, prev_pos).step(-1);
      });
    }
    stored = store_in_order(team, a, in, hk, ring, fp, link, prev_pos);
  } else {
    if (hk.sources == 0)
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
