// verify (docs/semantics.md §5.2, §8): entries are independent. A persistent grid-stride loop over the
// active entries, walked by whole warps (the real-KV fingerprints of a warp's 32 entries are
// loaded cooperatively, kvc::warp_real_kv_fingerprint); visited entries are counted per thread,
// reduced per warp (one atomicAdd per warp) and violations are appended to the ring through
// atomicAdd on its write index.
//
// Hand-written and schema-independent (the schema reaches it through kv_canary_layout.cuh, included
// first); the generated cuda/<kernel>.cu defines one entry point per specialisation over kvc_verify::run.
#pragma once

namespace kvc_verify {

// The verify kernel's arguments besides the real-KV sources and the ring.
struct Args {
  const unsigned char* canary_buf;
  kvc_i64 num_slots;
  kvc_i64 slot_stride_bytes;
  const kvc_i64* __restrict__ verify_slot_indices;
  const kvc_i64* __restrict__ verify_expected_tokens;
  const kvc_i64* __restrict__ verify_expected_positions;
  const kvc_i64* __restrict__ verify_prev_slot_indices;
  const int* __restrict__ verify_num_valid;
  const int* __restrict__ verify_enable;
  kvc_i64 verify_capacity;
  kvc::PointerList<const kvc_i64, kvc::PerRequestWords::count> expected;  // verify_expected_<field>
  kvc::PointerList<const kvc_i64, kvc::PerSlotWords::count> slot_tables;  // slot_table_<field>
  kvc_u64* __restrict__ slot_run_counter;
  kvc_u64* __restrict__ kernel_run_counter;
};

// `bit` when stored != expected, except that an expected kvc::UNKNOWN disables the check
// where kUnknownDisables (per_request expectations from the plan).
template <bool kUnknownDisables>
__device__ __forceinline__ kvc_i64 check_bit(kvc_i64 stored, kvc_i64 expected, kvc_i64 bit) {
  if (kUnknownDisables && expected == kvc::UNKNOWN) return 0;
  return stored != expected ? bit : 0;
}

// The bits B of the words W of rec that differ from their tables' entry `index` (table k for the
// k-th word).
template <bool kUnknownDisables, int n, int... W, kvc_i64... B>
__device__ __forceinline__ kvc_i64 input_checks(const kvc_i64 (&rec)[kvc::CANARY_FIELDS],
                                                const kvc::PointerList<const kvc_i64, n>& tables, kvc_i64 index,
                                                kvc::Words<W...>, kvc::Bits<B...>) {
  kvc_i64 bits = 0;
  int k = 0;
  ((bits |= check_bit<kUnknownDisables>(rec[W], tables.at[k++][index], B)), ...);
  (void)k;
  (void)rec;
  (void)tables;
  (void)index;
  return bits;
}

// First half of an entry: read its plan words. Returns true when the entry is to be checked;
// padding entries (slot 0) are counted but not checked, and an index outside the buffer (or
// outside a real-KV source) is reported (§8) and never read.
template <bool kCheckExpectedToken>
__device__ __forceinline__ bool prepare_entry(const Args& a, const kvc::RealKvSources& kv, const kvc::Ring& ring,
                                              kvc_i64 e, kvc_i64& slot, kvc_i64& prev) {
  slot = a.verify_slot_indices[e];
  if (slot == kvc::TOKEN_TO_KV_SLOT_PADDING) return false;
  prev = a.verify_prev_slot_indices[e];
  const bool slot_ok = slot >= 0 && slot < a.num_slots;
  const bool prev_ok = prev < a.num_slots;  // negative prev = chain head
  if (slot_ok && prev_ok && kvc::real_kv_in_range(kv, slot)) return true;
  const kvc_i64 expected_token = kCheckExpectedToken ? a.verify_expected_tokens[e] : kvc::UNKNOWN;
  ring.append(kvc::make_row(ring.launch_tag, slot, 0, 0, expected_token, 0, (!slot_ok || prev_ok) ? slot : prev,
                            kvc::reason::kvc_member_SLOT_OUT_OF_RANGE),
              e);
  return false;
}

// Second half: the checks of §5.2 against the stored record, given the slot's fingerprint.
template <bool kCheckExpectedToken>
__device__ __forceinline__ void check_entry(const Args& a, const kvc::Ring& ring, kvc_i64 e, kvc_i64 slot,
                                            kvc_i64 prev, kvc_u64 kv_hash) {
  const kvc_i64 stride = a.slot_stride_bytes;
  const kvc_i64 expected_token = kCheckExpectedToken ? a.verify_expected_tokens[e] : kvc::UNKNOWN;
  const kvc_i64 expected_position = a.verify_expected_positions[e];

  kvc_i64 rec[kvc::CANARY_FIELDS];
  kvc::load_record(a.canary_buf, slot, stride, rec);
  const kvc_i64 stored_token = rec[kvc::TOKEN_WORD];
  const kvc_i64 stored_position = rec[kvc::POSITION_WORD];
  const kvc_i64 stored_chain = rec[kvc::CHAIN_LINK_WORD];

  const bool prev_reachable = prev != kvc::TOKEN_TO_KV_SLOT_PADDING;
  const kvc_i64 expected_chain =
      prev_reachable ? static_cast<kvc_i64>(kvc::slot_hash(a.canary_buf, prev, stride)) : stored_chain;

  kvc_i64 bits = 0;
  if (prev_reachable && stored_chain != expected_chain) bits |= kvc::reason::kvc_member_VERIFY_CHAIN_HASH_MISMATCH;
  if (kCheckExpectedToken && expected_token != kvc::UNKNOWN && stored_token != expected_token)
    bits |= kvc::reason::kvc_member_VERIFY_TOKEN_MISMATCH;
  if (stored_position != expected_position) bits |= kvc::reason::kvc_member_VERIFY_POSITION_MISMATCH;
  if (rec[kvc::KV_FINGERPRINT_WORD] != static_cast<kvc_i64>(kv_hash))
    bits |= kvc::reason::kvc_member_VERIFY_REAL_KV_HASH_MISMATCH;
  // Verified input fields: per_request expectations from the plan (kvc::UNKNOWN = no
  // check), per_slot expectations from the caller's tables.
  bits |= input_checks<true>(rec, a.expected, e, kvc::PerRequestWords{}, kvc::PerRequestReasons{});
  bits |= input_checks<false>(rec, a.slot_tables, slot, kvc::PerSlotWords{}, kvc::PerSlotReasons{});
  if (bits != 0)
    ring.append(kvc::make_row(ring.launch_tag, slot, stored_position, stored_token, expected_token, stored_chain,
                              expected_chain, bits),
                e);
}

// The kernel body. kThreads: the launch's threads (whole warps); kSliceChunks: 16-byte chunks per
// row in one staged slice of the cooperative fingerprint (codegen.model.verify_slice_chunks);
// kWarpReduction: one slot_run_counter atomicAdd per warp instead of per thread.
template <bool kCheckExpectedToken, int kThreads, int kSliceChunks, bool kWarpReduction>
__device__ __forceinline__ void run(const Args& a, const kvc::RealKvSources& kv, const kvc::Ring& ring) {
  static_assert(kThreads % 32 == 0, "the verify kernel runs whole warps");
  typedef kvc::KvWarpTile<kSliceChunks> Tile;
  __shared__ Tile tiles[kThreads / 32];  // one staging tile per warp
  Tile& tile = tiles[threadIdx.x >> 5];
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.kernel_run_counter, 1ULL);  // every launch
  if (*a.verify_enable == 0) return;  // uniform across the grid

  kvc_i64 active = *a.verify_num_valid;
  if (active > a.verify_capacity) active = a.verify_capacity;
  if (active < 0) active = 0;

  // Thread t visits entries t, t + step, ... as in any grid-stride loop, but the loop runs per
  // warp (base = the entry of lane 0) so that all 32 lanes reach the cooperative fingerprint.
  const unsigned lane = threadIdx.x & 31u;
  const kvc_i64 step = static_cast<kvc_i64>(gridDim.x) * blockDim.x;
  unsigned long long visited = 0;
  for (kvc_i64 base = static_cast<kvc_i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane); base < active;
       base += step) {
    const kvc_i64 e = base + lane;
    kvc_i64 slot = 0, prev = 0;
    bool check = false;
    if (e < active) {
      ++visited;
      check = prepare_entry<kCheckExpectedToken>(a, kv, ring, e, slot, prev);
    }
    const kvc_u64 kv_hash = kvc::warp_real_kv_fingerprint(kv, check, slot, tile);
    if (check) check_entry<kCheckExpectedToken>(a, ring, e, slot, prev, kv_hash);
  }

  if (kWarpReduction) {
    // slot_run_counter += active: every lane reaches this point, one atomicAdd per warp.
    for (int offset = 16; offset > 0; offset >>= 1) visited += __shfl_xor_sync(0xFFFFFFFFu, visited, offset);
    if (lane == 0 && visited != 0) atomicAdd(a.slot_run_counter, visited);
  } else if (visited != 0) {
    atomicAdd(a.slot_run_counter, visited);
  }
}

}  // namespace kvc_verify
