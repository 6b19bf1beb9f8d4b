// write (docs/semantics.md §5.1, §8): each request's chain is walked in entry order by one thread that
// keeps it in registers; the slot counter gets one atomicAdd per request. Only the chain is
// inherently serial (each link mixes the previous one); the fingerprints, the checks, the violation
// rows and the record stores are not, so the launch shape decides who does them:
// - per_request (SGLang's shape, kvc_write::per_request): one thread per request does everything
//   for each entry in turn;
// - block_per_request (kvc_write::block_per_request): one block per request takes its entries in
//   chunks, double-buffered in shared memory. Warp 0 is the walker's: thread 0 only folds each
//   chunk's chain, writing every entry's running hash (and the position of the previous stored
//   entry) beside it. The other warps (stagers) own one entry of every chunk each; while thread 0
//   walks chunk k they check and store chunk k-1 (walked in the previous step) and stage chunk k+1
//   (inputs, and fingerprints loaded per warp with coalesced loads by kvc::warp_real_kv_fingerprint).
//   A one-warp block has no warp to spare: its warp walks, then stages, in each step.
//
// Hand-written and schema-independent (the schema reaches it through kv_canary_layout.cuh, included
// first); the generated cuda/<kernel>.cu of each launch shape defines the entry point over this.
#pragma once

namespace kvc_write {

// The write kernel's arguments besides the inputs, the real-KV sources and the ring.
struct Args {
  unsigned char* canary_buf;
  kvc_i64 num_slots;
  kvc_i64 slot_stride_bytes;
  const kvc_i64* __restrict__ write_offsets;
  const kvc_i64* __restrict__ write_seed_slot_indices;
  const int* __restrict__ write_num_valid_reqs;
  kvc_i64 write_req_capacity;
  kvc_i64 num_tokens;
  const int* __restrict__ enable_chain_position_assert;
  kvc_u64* __restrict__ slot_run_counter;
  kvc_u64* __restrict__ kernel_run_counter;
};

// The per-token inputs of the launch (flat arrays of num_tokens entries).
struct Inputs {
  const kvc_i64* input_ids;
  const kvc_i64* positions;
  const kvc_i64* out_cache_loc;
  const kvc_i64* expected_tokens;     // read only when input_assert
  const kvc_i64* expected_positions;  // read only when input_assert
  kvc::PointerList<const kvc_i64, kvc::InputWords::count> extra;  // extra_input_<field>, in InputWords order
  kvc_i64 num_slots;
  bool input_assert;
};

// §8: an index that cannot be dereferenced (a seed, or an entry's slot) is reported, never read.
__device__ __forceinline__ void out_of_range(const kvc::Ring& ring, kvc_i64 index) {
  ring.append(
      kvc::make_row(ring.launch_tag, index, 0, 0, kvc::UNKNOWN, 0, index, kvc::reason::kvc_member_SLOT_OUT_OF_RANGE));
}

// One entry: the record to store, complete once its chain link (the running hash before it) is set
// by whoever walks the chain. The last three fields are the block shape's, in shared memory.
struct Entry {
  kvc_i64 rec[kvc::CANARY_FIELDS];
  kvc_i64 slot;      // < 0: a skipped token
  kvc_i64 prev_pos;  // set by the walk: the position of the previous stored entry (or of the seed)
  int stored;        // slot >= 0 and in range: stored, and the chain advances over it
  int superseded;    // a later entry of the same chunk stores the same slot
};

// A request's chain, in the registers of the thread that walks it.
struct Chain {
  kvc_u64 running;
  kvc_i64 prev_pos;
  unsigned long long stored;
};

// Request r of the launch: its entries [lo, hi), clamped so that no read leaves the per-token
// arrays, and its seed. begin_request is false when the request does nothing: past the active
// requests, no entries, or a seed outside the buffer (§8: reported when `report`, and none of the
// request's entries is written).
struct Request {
  kvc_i64 lo, hi, seed;
  bool position_assert;
};
__device__ __forceinline__ bool begin_request(const Args& a, const kvc::Ring& ring, kvc_i64 r, bool report,
                                              Request& q) {
  kvc_i64 active = *a.write_num_valid_reqs;
  if (active > a.write_req_capacity) active = a.write_req_capacity;
  if (r >= active) return false;  // also covers active < 0
  q.lo = a.write_offsets[r];
  q.hi = a.write_offsets[r + 1];
  if (q.lo < 0) q.lo = 0;
  if (q.hi > a.num_tokens) q.hi = a.num_tokens;
  if (q.lo >= q.hi) return false;
  q.seed = a.write_seed_slot_indices[r];
  if (q.seed >= a.num_slots) {
    if (report) out_of_range(ring, q.seed);
    return false;
  }
  q.position_assert = q.seed >= 0 && *a.enable_chain_position_assert != 0;
  return true;
}

// The chain continues the seed's (seed < num_slots; a negative seed starts at the head).
__device__ __forceinline__ Chain start_chain(const unsigned char* canary_buf, kvc_i64 stride, kvc_i64 seed) {
  Chain c;
  c.running = kvc::slot_hash(canary_buf, seed, stride);
  c.prev_pos = seed >= 0 ? kvc::record_at(canary_buf, seed, stride)[kvc::POSITION_WORD] : 0;
  c.stored = 0;
  return c;
}

// rec[w] = extra[k][i] for the k-th input field's word w.
template <int... W>
__device__ __forceinline__ void load_inputs(kvc_i64 (&rec)[kvc::CANARY_FIELDS],
                                            const kvc::PointerList<const kvc_i64, kvc::InputWords::count>& extra,
                                            kvc_i64 i, kvc::Words<W...>) {
  int k = 0;
  ((rec[W] = extra.at[k++][i]), ...);
  (void)k;
  (void)rec;
  (void)extra;
  (void)i;
}

// Entry i's inputs; the fingerprint word is left 0 for the caller to fill where stored.
__device__ __forceinline__ void load_entry(const Inputs& in, const kvc::RealKvSources& kv, kvc_i64 i, Entry& e) {
#pragma unroll
  for (int w = 0; w < kvc::CANARY_FIELDS; ++w) e.rec[w] = 0;
  e.slot = in.out_cache_loc[i];
  e.stored = 0;
  if (e.slot < 0) return;  // skipped: nothing else is read
  e.stored = e.slot < in.num_slots && kvc::real_kv_in_range(kv, e.slot);
  e.rec[kvc::TOKEN_WORD] = in.input_ids[i];
  e.rec[kvc::POSITION_WORD] = in.positions[i];
  load_inputs(e.rec, in.extra, i, kvc::InputWords{});
}

// §5.1 step 4 for entry i, whose chain link is set, except the chain's advance: the skip rules,
// a. the input assert, b. the chain position assert (prev_pos: the previous stored entry's
// position), c. the store (unless `store` is false: a later entry overwrites the slot anyway).
// True when the entry counts as stored, so that the chain advances over it.
__device__ __forceinline__ bool finish_entry(const Inputs& in, kvc_i64 i, const Entry& e, kvc_i64 prev_pos,
                                             bool position_assert, bool store, const kvc::Ring& ring,
                                             unsigned char* canary_buf, kvc_i64 stride) {
  if (e.slot < 0) return false;  // skipped token: not stored, not counted
  if (!e.stored) {               // §8: reported, then skipped like a negative slot
    out_of_range(ring, e.slot);
    return false;
  }
  const kvc_i64 token = e.rec[kvc::TOKEN_WORD];
  const kvc_i64 pos = e.rec[kvc::POSITION_WORD];
  const kvc_i64 running = e.rec[kvc::CHAIN_LINK_WORD];
  if (in.input_assert) {
    const kvc_i64 expected_token = in.expected_tokens[i];
    const kvc_i64 expected_pos = in.expected_positions[i];
    kvc_i64 bits = 0;
    if (token != expected_token) bits |= kvc::reason::kvc_member_WRITE_TOKEN_MISMATCH;
    if (pos != expected_pos) bits |= kvc::reason::kvc_member_WRITE_POSITION_MISMATCH;
    if (bits != 0)
      ring.append(kvc::make_row(ring.launch_tag, e.slot, pos, token, expected_token, running, expected_pos, bits));
  }
  const kvc_i64 want = kvc::wrapping_add(prev_pos, 1);  // a stored position may be INT64_MAX
  if (position_assert && pos != want)
    ring.append(kvc::make_row(ring.launch_tag, e.slot, pos, token, token, running, want,
                              kvc::reason::kvc_member_WRITE_POSITION_MISMATCH));
  if (store) kvc::copy_words(kvc::record_at(canary_buf, e.slot, stride), e.rec, kvc::StoredWords{});
  return true;
}

// -- per_request: one thread per request ---------------------------------------------------------
// The real-KV fingerprint of a stored entry's slot, read from the sources as the entry is walked.
struct ReadFingerprint {
  const kvc::RealKvSources& kv;
  __device__ __forceinline__ kvc_u64 operator()(kvc_i64 /*entry*/, kvc_i64 slot) const {
    return kvc::real_kv_fingerprint(kv, slot);
  }
};

// Request q's entries in order, each checked, stored and chained by the calling thread; `fingerprint`
// (entry, slot) gives a stored entry's real-KV fingerprint (the host backend passes precomputed
// ones). Returns the entries stored.
template <class Fingerprint>
__device__ __forceinline__ unsigned long long walk_request(const Args& a, const Inputs& in,
                                                           const kvc::RealKvSources& kv, const kvc::Ring& ring,
                                                           const Request& q, const Fingerprint& fingerprint) {
  Chain chain = start_chain(a.canary_buf, a.slot_stride_bytes, q.seed);
  for (kvc_i64 i = q.lo; i < q.hi; ++i) {
    Entry e;
    load_entry(in, kv, i, e);
    if (e.stored) e.rec[kvc::KV_FINGERPRINT_WORD] = static_cast<kvc_i64>(fingerprint(i, e.slot));
    e.rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(chain.running);
    if (finish_entry(in, i, e, chain.prev_pos, q.position_assert, true, ring, a.canary_buf, a.slot_stride_bytes)) {
      chain.prev_pos = e.rec[kvc::POSITION_WORD];
      chain.running = kvc::chain_link(e.rec);  // §5.1 d: advance on the values just stored
      ++chain.stored;
    }
  }
  return chain.stored;
}

__device__ __forceinline__ void per_request(const Args& a, const Inputs& in, const kvc::RealKvSources& kv,
                                            const kvc::Ring& ring) {
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  const kvc_i64 r = static_cast<kvc_i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  Request q;
  if (!begin_request(a, ring, r, true, q)) return;
  const unsigned long long stored = walk_request(a, in, kv, ring, q, ReadFingerprint{kv});
  if (stored != 0) atomicAdd(a.slot_run_counter, stored);
}

// -- block_per_request: one block per request ------------------------------------------------------
// kThreads: the launch's threads; kSliceChunks: 16-byte chunks per row in one slice of the stagers'
// cooperative fingerprint (codegen.model.block_per_request_shared_memory sizes both, and the
// generated source pins these structs to it).
template <int kThreads, int kSliceChunks>
struct BlockShape {
  static_assert(kThreads % 32 == 0, "the block_per_request write runs whole warps");
  // Entries per chunk at most: one per stager thread (every warp but the walker's; a one-warp
  // block's warp does both). A launch with fewer threads uses fewer of them.
  static constexpr int kStaged = kThreads > 32 ? kThreads - 32 : 32;
  static constexpr int kStagerWarps = kStaged / 32;
  static constexpr int kBuffers = 2;  // chunk k walked while chunk k+1 is staged
  typedef kvc::KvWarpTile<kSliceChunks> Tile;
};

// Entries the walk loads before it mixes them: their loads do not depend on the chain, so they
// are all in flight while the previous batch is mixed.
constexpr int kWalkBatch = 8;

// Thread 0: the chain over the n staged entries of one chunk. It sets each entry's chain link (the
// running hash, which is also what its violation rows report) and the position of the previous
// stored entry, and advances over the stored entries; nothing else, so only the dependent mixes
// are serial.
__device__ __forceinline__ void walk_chunk(Entry* chunk, int n, Chain& c) {
  kvc_u64 running = c.running;
  kvc_i64 prev_pos = c.prev_pos;
  unsigned long long stored = c.stored;
  for (int j0 = 0; j0 < n; j0 += kWalkBatch) {
    kvc_i64 rec[kWalkBatch][kvc::CANARY_FIELDS];  // the words chain_link does not read are never loaded
    bool take[kWalkBatch];
#pragma unroll
    for (int u = 0; u < kWalkBatch; ++u) {
      take[u] = j0 + u < n && chunk[j0 + u].stored != 0;
#pragma unroll
      for (int w = 0; w < kvc::CANARY_FIELDS; ++w) rec[u][w] = chunk[j0 + u].rec[w];
    }
#pragma unroll
    for (int u = 0; u < kWalkBatch; ++u) {
      if (j0 + u < n) {
        chunk[j0 + u].rec[kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(running);
        chunk[j0 + u].prev_pos = prev_pos;
      }
      rec[u][kvc::CHAIN_LINK_WORD] = static_cast<kvc_i64>(running);
      const kvc_u64 next = kvc::chain_link(rec[u]);
      if (take[u]) {  // skipped and out-of-range entries do not advance the chain
        running = next;
        prev_pos = rec[u][kvc::POSITION_WORD];
        ++stored;
      }
    }
  }
  c.running = running;
  c.prev_pos = prev_pos;
  c.stored = stored;
}

// A stager: entry i (nothing when i >= hi) into e. Every lane of the warp calls this with the same
// warp_loads (the fingerprint loads are cooperative), false when none of the warp's entries is < hi.
template <class Tile>
__device__ __forceinline__ void stage_entry(const Inputs& in, const kvc::RealKvSources& kv, kvc_i64 i, kvc_i64 hi,
                                            bool warp_loads, Entry& e, Tile& tile) {
  const bool mine = i < hi;
  if (mine) load_entry(in, kv, i, e);
  const bool need = mine && e.stored != 0;
  if (warp_loads) {
    const kvc_u64 fingerprint = kvc::warp_real_kv_fingerprint(kv, need, need ? e.slot : 0, tile);
    if (need) e.rec[kvc::KV_FINGERPRINT_WORD] = static_cast<kvc_i64>(fingerprint);
  }
}

// A stager, for entry t of a chunk of n: whether a later entry of the chunk stores the same slot.
// The stores of one chunk run in parallel, so of two entries with one slot only the later one
// stores (the reference's "the later entry wins"); chunks are ordered by the block barrier. Slots in
// and out of range depend on the slot alone, so the later entry is stored exactly when this one is.
__device__ __forceinline__ void mark_superseded(Entry* chunk, int n, int t) {
  if (t >= n) return;
  Entry& mine = chunk[t];
  int later = 0;
  if (mine.stored) {
    const kvc_i64 slot = mine.slot;
    // A warp-uniform start: the lanes read the same entry in each step (a shared-memory broadcast).
#pragma unroll 8
    for (int k = t & ~31; k < n; ++k) later |= (k > t) & (chunk[k].slot == slot);
  }
  mine.superseded = later;
}

template <int kThreads, int kSliceChunks>
__device__ __forceinline__ void block_per_request(const Args& a, const Inputs& in, const kvc::RealKvSources& kv,
                                                  const kvc::Ring& ring) {
  typedef BlockShape<kThreads, kSliceChunks> Shape;
  static_assert(Shape::kStaged % kWalkBatch == 0, "a walk batch never reads past the staged entries");
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  // One block per request: every return below is uniform across the block.
  Request q;
  if (!begin_request(a, ring, blockIdx.x, threadIdx.x == 0, q)) return;
  const kvc_i64 lo = q.lo, hi = q.hi;

  __shared__ Entry staged[Shape::kBuffers][Shape::kStaged];  // chunk k in staged[k % 2], entry base + t at t
  __shared__ typename Shape::Tile tiles[Shape::kStagerWarps];  // one staging tile per stager warp
  const int lead = blockDim.x > 32 ? 32 : 0;               // the first stager thread
  const int chunk = static_cast<int>(blockDim.x) - lead;  // entries per chunk
  const bool stager = static_cast<int>(threadIdx.x) >= lead;
  const int t = static_cast<int>(threadIdx.x) - lead;  // a stager's entry of every chunk
  Chain chain{};                                       // thread 0's: only it walks
  if (threadIdx.x == 0) chain = start_chain(a.canary_buf, a.slot_stride_bytes, q.seed);

  const kvc_i64 chunks = (hi - lo + chunk - 1) / chunk;
  if (stager) stage_entry(in, kv, lo + t, hi, lo + (t & ~31) < hi, staged[0][t], tiles[t >> 5]);
  __syncthreads();  // chunk 0 is staged
  // Step k: thread 0 walks chunk k while the stagers mark chunk k's superseded entries, check and
  // store chunk k-1 and stage chunk k+1 (into chunk k-1's buffer, each stager over its own entry).
  for (kvc_i64 k = 0; k <= chunks; ++k) {
    const kvc_i64 base = lo + k * chunk;                                    // chunk k's first entry
    const int n = hi - base < chunk ? static_cast<int>(hi - base) : chunk;  // its size, where k < chunks
    Entry* walked = staged[k & 1];
    Entry* other = staged[(k + 1) & 1];  // chunk k-1, then chunk k+1
    if (threadIdx.x == 0 && k < chunks) walk_chunk(walked, n, chain);
    if (stager) {
      if (k < chunks) mark_superseded(walked, n, t);
      const kvc_i64 done = base - chunk + t;  // this stager's entry of chunk k-1
      if (k > 0 && done < hi) {
        const Entry& e = other[t];
        finish_entry(in, done, e, e.prev_pos, q.position_assert, e.superseded == 0, ring, a.canary_buf,
                     a.slot_stride_bytes);
      }
      const kvc_i64 next = base + chunk;  // chunk k+1's first entry
      if (k + 1 < chunks) stage_entry(in, kv, next + t, hi, next + (t & ~31) < hi, other[t], tiles[t >> 5]);
    }
    __syncthreads();  // chunk k is walked, chunk k+1 staged, chunk k-1's buffer free again
  }
  if (threadIdx.x == 0 && chain.stored != 0) atomicAdd(a.slot_run_counter, chain.stored);
}

}  // namespace kvc_write
