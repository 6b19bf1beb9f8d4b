// Host emulation only (the generated emulation/kv_canary_launchers.cpp includes this after
// kv_canary/emulation/cuda_host_shim.h): what every generated launcher shares.
#pragma once

#include <cstring>
#include <utility>

namespace kvc_emu {

// A launcher `launch(grid, block, a0, a1, ...)` over packed arguments: parameter i's value in the
// low bytes of the 8-byte slot i (little-endian; memcpy: the slots need no alignment).
template <class A>
A slot_value(const unsigned char* slots, size_t i) {
  static_assert(sizeof(A) <= 8, "a kernel parameter fits one 8-byte slot");
  A value;
  std::memcpy(&value, slots + 8 * i, sizeof(A));
  return value;
}
template <class... A, size_t... I>
int slots_launch_at(int (*launch)(unsigned, unsigned, A...), unsigned grid, unsigned block,
                    const unsigned char* slots, std::index_sequence<I...>) {
  (void)slots;
  return launch(grid, block, slot_value<A>(slots, I)...);
}
template <class... A>
int slots_launch(int (*launch)(unsigned, unsigned, A...), unsigned grid, unsigned block, const void* slots) {
  return slots_launch_at(launch, grid, block, static_cast<const unsigned char*>(slots),
                         std::index_sequence_for<A...>{});
}

}  // namespace kvc_emu
