// kv-canary device code shared by every kernel: integer arithmetic, hashing (docs/semantics.md §2), the
// chain fold, record access, the violation ring and the real-KV fingerprint (docs/semantics.md §4).
//
// Hand-written and schema-independent: the generated layout header (kv_canary_layout.cuh) includes
// this after it has defined, in namespace kvc, the schema's record constants (CANARY_FIELDS, the
// *_WORD indices, CHAIN_HEAD), the chain fold order (ChainFoldWords), the violation row
// (VIOLATION_FIELDS, VIOLATION_COL_*), the per-reason count order (ReasonCountBits), the flag and
// enum sets (kvc_set_<set>) and the schema constants (kvc_const_<name>). g++ sees the same text
// through kv_canary/emulation/cuda_host_shim.h, which defines KV_CANARY_HOST_EMULATION.
#pragma once

namespace kvc {

// The sets and constants the kernels use, under fixed names (the schema must define them:
// codegen/model.py REQUIRED_FLAGS, REQUIRED_ENUMS, REQUIRED_CONSTANTS).
namespace reason = kvc_set_FailReason;
namespace hash_mode = kvc_set_RealKvHashMode;
constexpr kvc_i64 REQ_POOL_IDX_PADDING = kvc_const_REQ_POOL_IDX_PADDING;
constexpr kvc_i64 TOKEN_TO_KV_SLOT_PADDING = kvc_const_TOKEN_TO_KV_SLOT_PADDING;
constexpr int MAX_REAL_KV_SOURCES = kvc_const_MAX_REAL_KV_SOURCES;
constexpr int REAL_KV_LOAD_ALIGN_BYTES = kvc_const_REAL_KV_LOAD_ALIGN_BYTES;
constexpr int REAL_KV_PARTIAL_READ_BYTES = kvc_const_REAL_KV_PARTIAL_READ_BYTES;

// -- static checks: the generated numbers agree with each other and with this code -------------
static_assert(sizeof(kvc_u64) == 8 && sizeof(kvc_i64) == 8 && sizeof(int) == 4, "word sizes");
static_assert(CANARY_WORD_BYTES == 8, "canary words are int64");
static_assert(CANARY_RECORD_BYTES == CANARY_FIELDS * CANARY_WORD_BYTES, "record size");
static_assert(CANARY_SLOT_STRIDE_BYTES >= CANARY_RECORD_BYTES, "stride holds the record");
static_assert(CANARY_SLOT_STRIDE_BYTES % CANARY_WORD_BYTES == 0, "stride is word aligned");
static_assert(ReasonCountBits::count == VIOLATION_REASON_COUNT_COLUMNS, "one count column per FailReason member");
static_assert(ReasonCountBits::each_one_bit, "every FailReason member is one bit");
static_assert(REAL_KV_LOAD_ALIGN_BYTES == 16, "real-KV loads are 16-byte vectors");
static_assert(REAL_KV_PARTIAL_READ_BYTES > 0 && REAL_KV_PARTIAL_READ_BYTES % REAL_KV_LOAD_ALIGN_BYTES == 0,
              "partial read size");
static_assert(MAX_REAL_KV_SOURCES > 0, "at least one real-KV source");

// -- integer arithmetic on values from device memory ------------------------------------------
// a + b modulo 2^64, as CUDA's hardware, numpy's int64 and the torch reference compute it: signed
// overflow is undefined behaviour in C++, and stored positions or offsets may be anything.
__device__ __forceinline__ kvc_i64 wrapping_add(kvc_i64 a, kvc_i64 b) {
  return static_cast<kvc_i64>(static_cast<kvc_u64>(a) + static_cast<kvc_u64>(b));
}

// -- hashing (docs/semantics.md §2) --------------------------------------------------------------
// The mixer on any type of 64-bit unsigned lanes: kvc_u64, or the cpu backend's vectors of them
// (kvc_cpu.h hashes several slots at once).
template <class T>
__device__ __forceinline__ T splitmix64_lanes(T x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}
__device__ __forceinline__ kvc_u64 splitmix64(kvc_u64 x) { return splitmix64_lanes(x); }

// acc folded with the words W of rec, in order.
template <int... W>
__device__ __forceinline__ kvc_u64 fold_words(kvc_u64 acc, const kvc_i64 (&rec)[CANARY_FIELDS], Words<W...>) {
  (void)rec;
  ((acc = splitmix64(acc ^ static_cast<kvc_u64>(rec[W]))), ...);
  return acc;
}

// dst[w] = src[w] for the words W.
template <int... W>
__device__ __forceinline__ void copy_words(kvc_i64* dst, const kvc_i64* src, Words<W...>) {
  (void)dst;
  (void)src;
  ((dst[W] = src[W]), ...);
}

// link(r) = fold(r.chain_link, [r.f for f in the schema's chain fold]).
__device__ __forceinline__ kvc_u64 chain_link(const kvc_i64 (&rec)[CANARY_FIELDS]) {
  return fold_words(splitmix64(static_cast<kvc_u64>(rec[CHAIN_LINK_WORD])), rec, ChainFoldWords{});
}

// -- canary buffer access (field f of slot s = int64 at s * stride + 8 * f) -----------------
__device__ __forceinline__ const kvc_i64* record_at(const unsigned char* buf, kvc_i64 slot, kvc_i64 stride) {
  return reinterpret_cast<const kvc_i64*>(buf + slot * stride);
}
__device__ __forceinline__ kvc_i64* record_at(unsigned char* buf, kvc_i64 slot, kvc_i64 stride) {
  return reinterpret_cast<kvc_i64*>(buf + slot * stride);
}

__device__ __forceinline__ void load_record(const unsigned char* buf, kvc_i64 slot, kvc_i64 stride,
                                            kvc_i64 (&rec)[CANARY_FIELDS]) {
  const kvc_i64* p = record_at(buf, slot, stride);
#pragma unroll
  for (int w = 0; w < CANARY_FIELDS; ++w) rec[w] = p[w];
}

// The words link() reads, from the buffer (the others stay 0).
__device__ __forceinline__ kvc_u64 stored_link(const unsigned char* buf, kvc_i64 slot, kvc_i64 stride) {
  const kvc_i64* p = record_at(buf, slot, stride);
  kvc_i64 rec[CANARY_FIELDS] = {};
  rec[CHAIN_LINK_WORD] = p[CHAIN_LINK_WORD];
  copy_words(rec, p, ChainFoldWords{});
  return chain_link(rec);
}

// slot_hash(buf, s) = HEAD if s < 0 else link(buf[s]); callers check s < num_slots first.
__device__ __forceinline__ kvc_u64 slot_hash(const unsigned char* buf, kvc_i64 slot, kvc_i64 stride) {
  return slot < 0 ? CHAIN_HEAD : stored_link(buf, slot, stride);
}

// -- violation ring -------------------------------------------------------------------------
struct ViolationRow {
  kvc_i64 col[VIOLATION_FIELDS];
};

__device__ __forceinline__ ViolationRow make_row(kvc_i64 launch_tag, kvc_i64 slot, kvc_i64 stored_position,
                                                 kvc_i64 stored_token, kvc_i64 expected_token,
                                                 kvc_i64 stored_chain_hash, kvc_i64 expected_aux,
                                                 kvc_i64 fail_reason) {
  ViolationRow r;
  r.col[VIOLATION_COL_LAUNCH_TAG] = launch_tag;
  r.col[VIOLATION_COL_SLOT] = slot;
  r.col[VIOLATION_COL_STORED_POSITION] = stored_position;
  r.col[VIOLATION_COL_STORED_TOKEN] = stored_token;
  r.col[VIOLATION_COL_EXPECTED_TOKEN] = expected_token;
  r.col[VIOLATION_COL_STORED_CHAIN_HASH] = stored_chain_hash;
  r.col[VIOLATION_COL_EXPECTED_AUX] = expected_aux;
  r.col[VIOLATION_COL_FAIL_REASON] = fail_reason;
  return r;
}

// [extension] Per-reason totals: column i counts the rows carrying FailReason member i (schema
// order). Every row is counted, also one dropped past the ring's capacity, so the totals stay
// exact after an overflow; a null pointer counts nothing. Rows are rare: the atomics cost nothing.
template <kvc_i64... B>
__device__ __forceinline__ void count_bits(kvc_u64* counts, kvc_i64 bits, Bits<B...>) {
  int column = 0;
  ((((bits & B) != 0 ? (void)atomicAdd(counts + column, 1ULL) : (void)0), ++column), ...);
}
__device__ __forceinline__ void count_reasons(kvc_u64* counts, kvc_i64 bits) {
  if (counts != nullptr) count_bits(counts, bits, ReasonCountBits{});
}

#if defined(KV_CANARY_HOST_EMULATION)
// Host emulation only. docs/semantics.md §5.2 wants a host backend's verify rows in entry order, but
// emulated threads append in the order the fibers happen to run. While a launcher keeps a log
// (EntryOrderLog, emulation/kv_canary_launchers.cpp), every appended row is also recorded with its
// entry index; after the launch the launcher stores the rows again, sorted by entry, into exactly
// the ring positions the launch claimed. The atomic append below still runs as on a GPU.
struct LoggedRow {
  kvc_i64 order;
  ViolationRow row;
};
namespace {
thread_local std::vector<LoggedRow>* g_row_log = nullptr;  // the launching thread's log, if any
}  // namespace

// Logs the rows of one launch on this thread (construct before the launch), then commit().
class EntryOrderLog {
 public:
  EntryOrderLog(kvc_i64* ring, kvc_i64 capacity, const int* write_index)
      : ring_(ring), capacity_(capacity), start_(static_cast<unsigned>(*write_index)) {
    g_row_log = &rows_;
  }
  ~EntryOrderLog() { g_row_log = nullptr; }
  EntryOrderLog(const EntryOrderLog&) = delete;
  EntryOrderLog& operator=(const EntryOrderLog&) = delete;

  // Row k of the launch (in entry order; one entry's rows keep their order) goes where the k-th
  // append went: index start + k as the int32 write index counts (wrapping like atomicAdd).
  void commit() {
    g_row_log = nullptr;
    std::stable_sort(rows_.begin(), rows_.end(),
                     [](const LoggedRow& a, const LoggedRow& b) { return a.order < b.order; });
    for (size_t k = 0; k < rows_.size(); ++k) {
      const int i = static_cast<int>(start_ + static_cast<unsigned>(k));
      if (i < 0 || static_cast<kvc_i64>(i) >= capacity_) continue;
      kvc_i64* dst = ring_ + static_cast<kvc_i64>(i) * VIOLATION_FIELDS;
      for (int c = 0; c < VIOLATION_FIELDS; ++c) dst[c] = rows_[k].row.col[c];
    }
  }

 private:
  kvc_i64* ring_;
  kvc_i64 capacity_;
  unsigned start_;
  std::vector<LoggedRow> rows_;
};
#endif

// i = write_index++; rows at or past the capacity are dropped, the index keeps counting.
// `order` is the entry the row belongs to (only host emulation reads it: see LoggedRow).
__device__ __forceinline__ void ring_append(kvc_i64* ring, kvc_i64 capacity, int* write_index, kvc_u64* reason_counts,
                                           const ViolationRow& row, kvc_i64 order = 0) {
#if defined(KV_CANARY_HOST_EMULATION)
  if (g_row_log != nullptr) g_row_log->push_back(LoggedRow{order, row});
#else
  (void)order;
#endif
  const int i = atomicAdd(write_index, 1);
  if (i >= 0 && static_cast<kvc_i64>(i) < capacity) {
    kvc_i64* dst = ring + static_cast<kvc_i64>(i) * VIOLATION_FIELDS;
#pragma unroll
    for (int c = 0; c < VIOLATION_FIELDS; ++c) dst[c] = row.col[c];
  }
  count_reasons(reason_counts, row.col[VIOLATION_COL_FAIL_REASON]);
}

// The violation ring of a launch, with the tag every row carries.
struct Ring {
  kvc_i64 launch_tag;
  kvc_i64* rows;
  kvc_i64 capacity;
  int* write_index;
  kvc_u64* reason_counts;  // [extension] per-reason totals, or null

  __device__ __forceinline__ void append(const ViolationRow& row, kvc_i64 order = 0) const {
    ring_append(rows, capacity, write_index, reason_counts, row, order);
  }
};

// -- real-KV fingerprint (docs/semantics.md §4) --------------------------------------------------
// 16 bytes as two little-endian words. The PTX variant is a non-coherent 128-bit load (the K/V
// bytes are read-only while a canary kernel runs); the host variant (emulation and the native cpu
// backend, kv_canary/csrc/kvc_cpu.h) is plain C++.
__device__ __forceinline__ void load_u64x2(const unsigned char* p, kvc_u64& lo, kvc_u64& hi) {
#if defined(KV_CANARY_HOST_EMULATION) || defined(KV_CANARY_HOST_NATIVE)
  __builtin_memcpy(&lo, p, 8);
  __builtin_memcpy(&hi, p + 8, 8);
#else
  // cvta: torch hands out generic addresses; ld.global wants a global-space one.
  asm("{ .reg .u64 g; cvta.to.global.u64 g, %2; ld.global.nc.v2.u64 { %0, %1 }, [g]; }"
      : "=l"(lo), "=l"(hi) : "l"(p));
#endif
}

// One 2-, 4- or 8-byte chunk as a little-endian word (the validators align it to its size).
__device__ __forceinline__ kvc_u64 load_chunk(const unsigned char* p, int bytes) {
#if defined(KV_CANARY_HOST_EMULATION)
  kvc_u64 v = 0;
  __builtin_memcpy(&v, p, static_cast<unsigned long>(bytes));
  return v;
#else
  switch (bytes) {
    case 2: return *reinterpret_cast<const unsigned short*>(p);
    case 4: return *reinterpret_cast<const unsigned int*>(p);
    default: return *reinterpret_cast<const kvc_u64*>(p);
  }
#endif
}

// The real-KV sources of a launch, from the kernel's real_kv_* scalar parameters (in their ABI
// order: codegen/kernel_abi.py REAL_KV_SOURCE_PARAMS). Slot s's head h, chunk c of source i starts
// at ptr + (s / page_size) * row_stride_bytes + token(s % page_size) + h * head_stride_bytes
// + c * chunk_stride_bytes, where token(t) = t * token_stride_bytes, or with token groups
// (token_group_size > 0: a row keeps its tokens in groups, as vLLM's AMX CPU cache keeps K)
// (t / token_group_size) * token_group_stride_bytes + (t % token_group_size) * token_stride_bytes;
// a head is num_bytes_per_token / num_heads bytes, contiguous when chunk_bytes is 0; chunks in groups
// likewise (chunk_group_size > 0, vLLM's AMX V: chunk c at (c / chunk_group_size) *
// chunk_group_stride_bytes + (c % chunk_group_size) * chunk_stride_bytes). SGLang's packed rows:
// token_stride_bytes = num_bytes_per_token, one head, no chunks, no groups.
struct RealKvSources {
  const unsigned char* ptr[MAX_REAL_KV_SOURCES];
  kvc_i64 row_stride_bytes[MAX_REAL_KV_SOURCES];
  kvc_i64 num_rows[MAX_REAL_KV_SOURCES];
  int page_size[MAX_REAL_KV_SOURCES];
  int num_bytes_per_token[MAX_REAL_KV_SOURCES];
  int read_bytes[MAX_REAL_KV_SOURCES];
  kvc_i64 token_stride_bytes[MAX_REAL_KV_SOURCES];
  int num_heads[MAX_REAL_KV_SOURCES];
  kvc_i64 head_stride_bytes[MAX_REAL_KV_SOURCES];
  int chunk_bytes[MAX_REAL_KV_SOURCES];
  kvc_i64 chunk_stride_bytes[MAX_REAL_KV_SOURCES];
  int token_group_size[MAX_REAL_KV_SOURCES];
  kvc_i64 token_group_stride_bytes[MAX_REAL_KV_SOURCES];
  int chunk_group_size[MAX_REAL_KV_SOURCES];
  kvc_i64 chunk_group_stride_bytes[MAX_REAL_KV_SOURCES];
  int num_sources;
  int hash_mode;
};

// A slot's bytes in source s are one run (one head, no chunks; any token stride).
__device__ __forceinline__ bool real_kv_contiguous(const RealKvSources& kv, int s) {
  return kv.num_heads[s] == 1 && kv.chunk_bytes[s] == 0;
}

// The first byte of slot's head 0 in source s (slot in range: real_kv_in_range). A page of one
// token (SGLang's MHA pools) needs no 64-bit division, which costs tens of cycles.
__device__ __forceinline__ const unsigned char* real_kv_slot(const RealKvSources& kv, int s, kvc_i64 slot) {
  const kvc_i64 page = kv.page_size[s];
  if (page == 1) return kv.ptr[s] + slot * kv.row_stride_bytes[s];
  const unsigned char* row = kv.ptr[s] + (slot / page) * kv.row_stride_bytes[s];
  const kvc_i64 t = slot % page;
  const kvc_i64 group = kv.token_group_size[s];
  if (group == 0) return row + t * kv.token_stride_bytes[s];
  return row + (t / group) * kv.token_group_stride_bytes[s] + (t % group) * kv.token_stride_bytes[s];
}

// How many logical bytes of a slot the fingerprint reads in source s.
__device__ __forceinline__ int real_kv_read_len(const RealKvSources& kv, int s) {
  return kv.hash_mode == hash_mode::kvc_member_PARTIAL ? REAL_KV_PARTIAL_READ_BYTES : kv.read_bytes[s];
}

// Byte offset of chunk c of a head from the head's first byte in source s.
__device__ __forceinline__ kvc_i64 real_kv_chunk_offset(const RealKvSources& kv, int s, int c) {
  const int group = kv.chunk_group_size[s];
  if (group == 0) return c * kv.chunk_stride_bytes[s];
  return (kvc_i64)(c / group) * kv.chunk_group_stride_bytes[s] + (kvc_i64)(c % group) * kv.chunk_stride_bytes[s];
}

// Logical bytes [b, b + 16) of the slot at p (b a multiple of 16: a head's bytes are too, so the 16
// bytes lie in one head), gathered from the head's chunks into two little-endian words.
__device__ __forceinline__ void load_logical_u64x2(const RealKvSources& kv, int s, const unsigned char* p, int b,
                                                   kvc_u64& lo, kvc_u64& hi) {
  const int head_bytes = kv.num_bytes_per_token[s] / kv.num_heads[s];
  const int h = b / head_bytes;
  const int o = b - h * head_bytes;  // offset in the head's logical bytes
  const unsigned char* q = p + h * kv.head_stride_bytes[s];
  const int cb = kv.chunk_bytes[s];
  if (cb == 0) {
    load_u64x2(q + o, lo, hi);
    return;
  }
  const kvc_i64 cs = kv.chunk_stride_bytes[s];
  if (cb >= REAL_KV_LOAD_ALIGN_BYTES) {  // a multiple of 16: the 16 bytes lie in one chunk
    const int c = o / cb;
    load_u64x2(q + real_kv_chunk_offset(kv, s, c) + (o - c * cb), lo, hi);
    return;
  }
  // 2-, 4- or 8-byte chunks: 16 / cb consecutive ones, the first 8 bytes into lo, the next into hi.
  const int per_word = 8 / cb;
  kvc_u64 w[2] = {0, 0};
  if (kv.chunk_group_size[s] == 0) {
    const unsigned char* c0 = q + (o / cb) * cs;
    for (int k = 0; k < REAL_KV_LOAD_ALIGN_BYTES / cb; ++k)
      w[k / per_word] |= load_chunk(c0 + k * cs, cb) << (8 * cb * (k % per_word));
  } else {
    for (int k = 0; k < REAL_KV_LOAD_ALIGN_BYTES / cb; ++k)
      w[k / per_word] |= load_chunk(q + real_kv_chunk_offset(kv, s, o / cb + k), cb) << (8 * cb * (k % per_word));
  }
  lo = w[0];
  hi = w[1];
}

// h of source s for a slot whose bytes are not one run: n logical bytes, 16 at a time.
__device__ __forceinline__ kvc_u64 gathered_source_hash(const RealKvSources& kv, int s, kvc_i64 slot, int n) {
  const unsigned char* p = real_kv_slot(kv, s, slot);
  kvc_u64 h = 0;
  for (int b = 0; b < n; b += REAL_KV_LOAD_ALIGN_BYTES) {
    kvc_u64 lo, hi;
    load_logical_u64x2(kv, s, p, b, lo, hi);
    h = splitmix64(h ^ lo);
    h = splitmix64(h ^ hi);
  }
  return h;
}

__device__ __forceinline__ bool real_kv_active(const RealKvSources& kv) {
  return kv.hash_mode != hash_mode::kvc_member_NONE && kv.num_sources > 0;
}

// False when slot's row lies outside some source tensor: the caller reports SLOT_OUT_OF_RANGE
// and reads nothing. slot must be >= 0.
__device__ __forceinline__ bool real_kv_in_range(const RealKvSources& kv, kvc_i64 slot) {
  if (!real_kv_active(kv)) return true;
  bool ok = true;
#pragma unroll
  for (int s = 0; s < MAX_REAL_KV_SOURCES; ++s)
    if (s < kv.num_sources && (kv.page_size[s] == 1 ? slot : slot / kv.page_size[s]) >= kv.num_rows[s]) ok = false;
  return ok;
}

// fingerprint(slot): per source h = fold of its effective bytes, total = fold of the h's.
__device__ __forceinline__ kvc_u64 real_kv_fingerprint(const RealKvSources& kv, kvc_i64 slot) {
  if (!real_kv_active(kv)) return 0;
  kvc_u64 total = 0;
#pragma unroll
  for (int s = 0; s < MAX_REAL_KV_SOURCES; ++s) {
    if (s >= kv.num_sources) break;
    const int n = real_kv_read_len(kv, s);
    if (!real_kv_contiguous(kv, s)) {
      total = splitmix64(total ^ gathered_source_hash(kv, s, slot, n));
      continue;
    }
    const unsigned char* p = real_kv_slot(kv, s, slot);
    kvc_u64 h = 0;
#pragma unroll 4
    for (int b = 0; b < n; b += REAL_KV_LOAD_ALIGN_BYTES) {
      kvc_u64 lo, hi;
      load_u64x2(p + b, lo, hi);
      h = splitmix64(h ^ lo);
      h = splitmix64(h ^ hi);
    }
    total = splitmix64(total ^ h);
  }
  return total;
}

// The same fingerprint for the 32 lanes of a warp at once, with coalesced loads. One thread
// reading its own row makes every warp-wide 16-byte load touch 32 different cache lines; here
// consecutive lanes load consecutive 16-byte chunks of a few rows (kSliceChunks chunks of each of
// 32 / kSliceChunks rows per pass), stage one slice of every lane's row in shared memory, and
// then each lane folds its own row's words in order. The +1 chunk of padding per row keeps the
// lane-per-row reads free of bank conflicts.
struct alignas(16) KvChunk {
  kvc_u64 lo, hi;
};
template <int kSliceChunks>
struct KvWarpTile {
  static_assert(kSliceChunks > 0 && 32 % kSliceChunks == 0, "a pass covers whole rows");
  KvChunk row[32][kSliceChunks + 1];
};

// Every lane of the warp must call this with the same kv (warp-uniform loops, shuffles and
// __syncwarp). Lanes with need == false take part in the loads of the others, read nothing of
// their own and get 0; `slot` is only used where need is true (then it is in range).
template <int kSliceChunks>
__device__ __forceinline__ kvc_u64 warp_real_kv_fingerprint(const RealKvSources& kv, bool need, kvc_i64 slot,
                                                            KvWarpTile<kSliceChunks>& tile) {
  if (!real_kv_active(kv)) return 0;
  constexpr int kRowsPerPass = 32 / kSliceChunks;
  constexpr int kSliceBytes = kSliceChunks * REAL_KV_LOAD_ALIGN_BYTES;
  const unsigned lane = threadIdx.x & 31u;
  const int chunk = static_cast<int>(lane % kSliceChunks);  // this lane's chunk in every pass
  kvc_u64 total = 0;
  for (int s = 0; s < MAX_REAL_KV_SOURCES; ++s) {
    if (s >= kv.num_sources) break;
    const int n = real_kv_read_len(kv, s);
    // A slot whose bytes are not one run (heads or chunks apart) is gathered by its own lane: the
    // staged slices below assume one run per row. The branch is warp-uniform (kv is).
    if (!real_kv_contiguous(kv, s)) {
      total = splitmix64(total ^ (need ? gathered_source_hash(kv, s, slot, n) : 0));
      continue;
    }
    const unsigned char* mine = need ? real_kv_slot(kv, s, slot) : nullptr;
    kvc_u64 h = 0;
    for (int b = 0; b < n; b += kSliceBytes) {
      const int chunks = n - b < kSliceBytes ? (n - b) / REAL_KV_LOAD_ALIGN_BYTES : kSliceChunks;
#pragma unroll
      for (int pass = 0; pass < kSliceChunks; ++pass) {
        const unsigned r = pass * kRowsPerPass + lane / kSliceChunks;
        const unsigned char* row = reinterpret_cast<const unsigned char*>(
            __shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(mine), static_cast<int>(r)));
        if (row != nullptr && chunk < chunks)
          load_u64x2(row + b + chunk * REAL_KV_LOAD_ALIGN_BYTES, tile.row[r][chunk].lo, tile.row[r][chunk].hi);
      }
      __syncwarp();
      if (need) {
        for (int c = 0; c < chunks; ++c) {
          h = splitmix64(h ^ tile.row[lane][c].lo);
          h = splitmix64(h ^ tile.row[lane][c].hi);
        }
      }
      __syncwarp();  // the next slice overwrites the tile
    }
    total = splitmix64(total ^ h);
  }
  return need ? total : 0;
}

}  // namespace kvc
