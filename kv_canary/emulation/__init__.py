"""Host emulation of the generated CUDA kernels.

g++ compiles the same generated .cu sources, after the hand-written shim cuda_host_shim.h (CUDA
built-ins, atomics, warp shuffles and barriers on cooperative fibers), together with the generated
extern "C" launchers into a shared library that ctypes loads (build.py, library.py). The
`emulated` backend (kv_canary/backends/emulated.py) runs on it.
"""
