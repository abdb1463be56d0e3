"""Thread and block indices the compiler knows are non-negative.

Numba types ``cuda.threadIdx.x`` and ``cuda.blockIdx.x`` as signed int32 and sign-extends them, so
LLVM cannot tell that they are >= 0. Every index derived from them then pays for it: a floor
division or modulo by a power of two gets sign fix-ups instead of one shift or mask, and an array
index gets Numba's negative-index wraparound (a compare, an add and a select on 64 bits). Read
through ``uint32`` and widened to int64, the same registers are zero-extended: LLVM drops both, and
the arithmetic stays in int64 (Numba types a mix of uint64 and int64 as float64, so the indices are
not left unsigned).
"""

from __future__ import annotations

from typing import Any

from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import int64, uint32  # noqa: E402  (after load_cuda's numpy fix)


def build_indices() -> tuple[Any, Any, Any]:
    """``(thread_index, block_x, block_y)``: device functions of no arguments returning threadIdx.x,
    blockIdx.x and blockIdx.y as int64 values known to be >= 0."""

    @cuda.jit(device=True, inline=True)
    def thread_index():
        return int64(uint32(cuda.threadIdx.x))

    @cuda.jit(device=True, inline=True)
    def block_x():
        return int64(uint32(cuda.blockIdx.x))

    @cuda.jit(device=True, inline=True)
    def block_y():
        return int64(uint32(cuda.blockIdx.y))

    return thread_index, block_x, block_y
