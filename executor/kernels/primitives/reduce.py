"""Block-wide reductions through shared memory, and sums over groups of lanes.

The simulator has no warp shuffles, so the block reductions here go through a
shared scratch array of blockDim.x float32 (blockDim.x a power of two). Each
call ends with a barrier, so the scratch can be reused by the next call.

``build_group_sum`` and ``build_group_max`` reduce over aligned groups of
``width`` threads (a power of two <= 32): xor shuffles on the GPU, the shared
scratch in the simulator. Both combine in the same tree order (a + b == b + a
in IEEE arithmetic), so both give the same bits, on every thread of the group.
"""

from __future__ import annotations

import math
from typing import Any, Callable

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


def build_group_sum() -> Callable[..., Any]:
    """Device function ``group_sum(scratch, value, width) -> float32``: the sum of ``value``
    over this thread's aligned group of ``width`` threads (``width`` a power of two <= 32).

    Every thread of the block must call it the same number of times (the
    simulator's version has barriers; on the GPU all 32 lanes of each warp
    take part in the shuffles), so blockDim.x must be a multiple of 32 on the GPU.
    ``scratch`` is blockDim.x float32 of shared memory (unused on the GPU).
    """
    return _build_group_reduce(_add)


def build_group_max() -> Callable[..., Any]:
    """Device function ``group_max(scratch, value, width) -> float32``: ``build_group_sum``'s
    contract, with the maximum instead of the sum."""
    return _build_group_reduce(_max)


@cuda.jit(device=True, inline=True)
def _add(a, b):
    return a + b


@cuda.jit(device=True, inline=True)
def _max(a, b):
    return max(a, b)


def _build_group_reduce(combine: Any) -> Callable[..., Any]:
    """Xor shuffles on the GPU, the shared scratch in the simulator; both combine the same pairs
    (lane i with lane i ^ offset, then ^ offset / 2, ...), so both give the same bits."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def group_reduce_shared(scratch, value, width):
            tid = cuda.threadIdx.x
            lane = tid % width
            scratch[tid] = value
            cuda.syncthreads()
            stride = width // 2
            while stride > 0:
                if lane < stride:
                    scratch[tid] = combine(scratch[tid], scratch[tid + stride])
                cuda.syncthreads()
                stride //= 2
            total = scratch[tid - lane]
            cuda.syncthreads()
            return total

        return group_reduce_shared

    @cuda.jit(device=True, inline=True)
    def group_reduce_shuffle(scratch, value, width):
        offset = width // 2
        while offset > 0:
            value = combine(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, offset))
            offset //= 2
        return value

    return group_reduce_shuffle


def check_max_threads(max_threads: int, upper: int = 1024) -> int:
    """``max_threads`` after checking it is a power of two in [32, upper] (a launcher's block cap)."""
    if max_threads < 32 or max_threads > upper or max_threads & (max_threads - 1):
        raise ValueError(f"max_threads must be a power of two in [32, {upper}], got {max_threads}")
    return max_threads


def threads_for(num_elements: int, max_threads: int = 256) -> int:
    """A power-of-two block size covering ``num_elements``, at most ``max_threads``.

    At least a warp (32) on the GPU; at least 4 in the simulator, where every
    thread is a Python thread and idle ones cost as much as busy ones.
    """
    minimum = 4 if simulator_enabled() else 32
    return max(minimum, min(max_threads, 1 << math.ceil(math.log2(max(1, num_elements)))))
