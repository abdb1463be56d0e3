"""Grids of the elementwise row kernels: rows on x (grid-stride), column tiles on y.

A thread issues UNROLL independent loads (VECTOR_UNROLL 16-byte chunks in the vector kernels)
before its first store: the compiler cannot hoist loads over stores to a possibly aliased array,
so the loads are spelled out (2.7x the bandwidth of one element at a time for a bf16 add of
16384 x 4096 on the H200).
"""

from __future__ import annotations

import math

from executor.kernels.primitives.reduce import threads_for

MAX_COLUMN_BLOCKS = 65535  # CUDA's limit on gridDim.y; the column loop strides past it
UNROLL = 4  # elements per thread per tile; the kernels spell out this many loads
# 16-byte chunks per thread per tile in the vector kernels: 32 bytes in flight per array and thread.
VECTOR_UNROLL = 2


def elementwise_grid(rows: int, cols: int, max_threads: int, unroll: int = UNROLL) -> tuple[tuple[int, int], int]:
    """((rows, column tiles), threads) for a row-by-column launch of ``unroll`` columns per thread.

    A column is an element for the scalar kernels, a 16-byte chunk for the vector kernels.
    """
    threads = threads_for(math.ceil(cols / unroll), max_threads)
    return (rows, max(1, min(math.ceil(cols / (threads * unroll)), MAX_COLUMN_BLOCKS))), threads
