"""Block-wide reductions through shared memory.

The simulator has no warp shuffles, so every reduction here goes through a
shared scratch array of blockDim.x float32 (blockDim.x a power of two). Each
call ends with a barrier, so the scratch can be reused by the next call.
"""

from __future__ import annotations

import math

from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()


@cuda.jit(device=True)
def block_sum(scratch, value):
    """Sum of ``value`` over the block; every thread gets the total."""
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = scratch[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_max(scratch, value):
    """Maximum of ``value`` over the block; every thread gets it."""
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] = max(scratch[tid], scratch[tid + stride])
        cuda.syncthreads()
        stride //= 2
    total = scratch[0]
    cuda.syncthreads()
    return total


def threads_for(num_elements: int, max_threads: int = 256) -> int:
    """A power-of-two block size covering ``num_elements``, at most ``max_threads``.

    At least a warp (32) on the GPU; at least 4 in the simulator, where every
    thread is a Python thread and idle ones cost as much as busy ones.
    """
    minimum = 4 if simulator_enabled() else 32
    return max(minimum, min(max_threads, 1 << math.ceil(math.log2(max(1, num_elements)))))
