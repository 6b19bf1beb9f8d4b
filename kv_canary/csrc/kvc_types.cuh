// kv-canary device code: the word types and the compile-time tables the generated layout header
// (generated/cuda/kv_canary_layout.cuh) fills in. Hand-written, schema-independent: the header
// includes this first, defines the schema's constants and tables with these types, then includes
// kvc_device.cuh. NVRTC has no standard headers, so nothing here includes one.
#pragma once

// 64-bit words: NVRTC has no <cstdint>.
typedef unsigned long long kvc_u64;
typedef long long kvc_i64;

namespace kvc {

// A list of canary word indices (a record's fields in schema order), as a type: generic code walks
// it with a fold, so each schema's list unrolls at compile time into the code a hand-written list
// would give.
template <int... W>
struct Words {
  static constexpr int count = static_cast<int>(sizeof...(W));
};

// A list of FailReason bits (or any int64 values), as a type.
template <kvc_i64... B>
struct Bits {
  static constexpr int count = static_cast<int>(sizeof...(B));
  static constexpr bool each_one_bit = ((B > 0 && (B & (B - 1)) == 0) && ...);
};

// An array of n pointers: a zero-length C array is ill-formed, and schemas may have no input field.
template <class T, int n>
struct PointerList {
  T* at[n > 0 ? n : 1];
};

}  // namespace kvc
