"""A kernel's arguments packed the way cuLaunchKernel reads them, built once per bound launch.

`kernelParams` is an array of pointers, one per parameter, each pointing to that parameter's value;
the driver reads each value's size from the compiled kernel. KernelParams keeps one 8-byte slot per
parameter (a 32-bit `int` is read from the slot's low four bytes: the platforms CUDA runs on are
little-endian) and the pointer array to them, so a launch passes one address instead of converting
every argument again. The `cuda` backend hands `address` to cuLaunchKernel and the `emulated`
backend to the generated kvc_emu_params_launch_* entry points, which read it with the same
convention: emulation runs the exact buffer a GPU launch would.

Values arrive range-checked by the generated binding (`_int`); a slot stores the value's two's
complement bits (masked to the kind's width). The driver copies the values at launch, so a slot may
be rewritten (`set`) as soon as a launch returns.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import sys

if sys.byteorder != "little":  # the slot layout above: a 32-bit value sits in the slot's first bytes
    raise ImportError("kv-canary: packed kernel arguments assume a little-endian host")

# Bits of a parameter kind (generated kernel_abi KernelAbi.kinds) kept in its slot.
KIND_MASKS = {"ptr": (1 << 64) - 1, "i64": (1 << 64) - 1, "i32": (1 << 32) - 1}
SLOT_BYTES = 8


# How struct packs each kind into its 8-byte slot (little-endian; an int in the low four bytes,
# zeros above it): the same bits as the value masked to the kind's width.
SLOT_FORMATS = {"ptr": "Q", "i64": "q", "i32": "i4x"}


@functools.lru_cache(maxsize=None)
def _masks(kinds: tuple) -> tuple:
    return tuple(KIND_MASKS[k] for k in kinds)


@functools.lru_cache(maxsize=None)
def _packer(kinds: tuple) -> struct.Struct:
    return struct.Struct("<" + "".join(SLOT_FORMATS[k] for k in kinds))


@functools.lru_cache(maxsize=None)
def _pointer_table(n: int) -> tuple[int, int]:
    """(sum of 1 << 64 i, sum of 8 i << 64 i) for i < n: base * ones + steps holds base + 8 i in its
    i-th 64-bit lane (no lane carries into the next: every address is below 2**64)."""
    return (sum(1 << (64 * i) for i in range(n)), sum((SLOT_BYTES * i) << (64 * i) for i in range(n)))


class KernelParams:
    """The packed arguments of one launch (`kinds`: the kernel's parameter kinds in ABI order)."""

    def __init__(self, kinds: tuple, values) -> None:
        if len(values) != len(kinds):
            raise ValueError(f"kv-canary: {len(kinds)} kernel parameters need {len(kinds)} values, got {len(values)}")
        self.kinds = kinds = tuple(kinds)
        n = max(1, len(kinds))
        # Packed by struct, then copied into ctypes: a ctypes array built from n Python ints costs
        # tens of microseconds, this a few (it runs at every binding of a launch).
        self._slots = (ctypes.c_uint64 * n).from_buffer_copy(_packer(kinds).pack(*values) if kinds
                                                             else bytes(SLOT_BYTES))
        ones, steps = _pointer_table(n)
        # Slot i's address is base + 8 i: all n of them as one integer's little-endian 8-byte lanes.
        self._pointers = (ctypes.c_void_p * n).from_buffer_copy(
            (ctypes.addressof(self._slots) * ones + steps).to_bytes(SLOT_BYTES * n, "little"))
        self.address = ctypes.addressof(self._pointers)  # the `void**` a launch takes
        self.values = list(values)                         # as given (Python ints), for a re-launch by value

    def set(self, index: int, value: int) -> None:
        """Rewrite one parameter (e.g. a per-launch scratch pointer)."""
        self._slots[index] = value & _masks(self.kinds)[index]
        self.values[index] = value

    def slot(self, index: int) -> int:
        """The raw 64-bit slot of parameter `index` (what the pointer array points to)."""
        return ctypes.c_uint64.from_address(self._pointers[index]).value
