// Host emulation only (the generated emulation/kv_canary_launchers.cpp includes this after
// kv_canary/emulation/cuda_host_shim.h): what every generated launcher shares.
#pragma once

#include <utility>

namespace kvc_emu {

// cuLaunchKernel's convention for a launcher `launch(grid, block, a0, a1, ...)`: params[i] points to
// the value of parameter i.
template <class... A, size_t... I>
int params_launch_at(int (*launch)(unsigned, unsigned, A...), unsigned grid, unsigned block, void** params,
                     std::index_sequence<I...>) {
  (void)params;
  return launch(grid, block, *static_cast<A*>(params[I])...);
}
template <class... A>
int params_launch(int (*launch)(unsigned, unsigned, A...), unsigned grid, unsigned block, void** params) {
  return params_launch_at(launch, grid, block, params, std::index_sequence_for<A...>{});
}

}  // namespace kvc_emu
