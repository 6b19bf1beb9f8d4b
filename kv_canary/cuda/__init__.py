"""Running the generated CUDA kernels: NVRTC compilation with a project-owned cache, CuPy module
loading with the ABI identity check, and the backend logic shared by the `cuda` and `emulated`
backends (argument packing from the generated kernel ABI, launch shapes).

Importing this package needs neither CuPy nor a GPU; the modules that do import CuPy lazily.
"""
