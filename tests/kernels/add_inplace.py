"""A test and benchmark kernel: residual accumulate ``acc <- acc + x`` over token rows, in place on
``acc`` (the model fuses its residual adds into the norms and GEMV epilogues; this kernel is the
reference of the elementwise grid and the in-place aliasing rule).

The sum is float32 and rounded once to storage, as HF's ``residual +
hidden_states`` in the model dtype. Each element is read and written by one
thread and no thread touches another's element, so ``acc`` and ``x`` may be
the same array (or overlapping row views) without a race.

Grid: x over rows (grid-stride; no 65535 limit on that axis), y over column
tiles of UNROLL x blockDim.x; threads stride over columns so warps load
contiguous runs. Each thread issues UNROLL independent loads before its first
store (the compiler cannot hoist loads over stores to a possibly aliased
array): 2.7x the bandwidth of one element at a time on an H200 (bf16 add,
16384 x 4096: 0.67 -> 1.85 TB/s).

When every row of both arrays is a whole number of 16-byte-aligned chunks
(``vector_aligned``), the launcher runs the vector kernel instead: the same
layout over 16-byte chunks (vector.py), VECTOR_UNROLL chunks in flight per
thread. Otherwise (odd widths, misaligned views) it runs the scalar kernel.
Both round each sum the same way, so they give the same bits.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.grid import UNROLL, VECTOR_UNROLL, elementwise_grid
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import check_max_threads, threads_for
from executor.kernels.primitives.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import load_cuda

cuda = load_cuda()

MAX_THREADS = 256


def build_add_inplace_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(acc [T, H], x [T, H])``: ``acc[t, i] = store(load(acc[t, i]) + load(x[t, i]))``."""
    load, store = codec.load, codec.store

    @cuda.jit
    def add_inplace(acc, x):
        cols = acc.shape[1]
        step = cuda.blockDim.x
        tile = step * UNROLL
        for t in range(cuda.blockIdx.x, acc.shape[0], cuda.gridDim.x):
            for i in range(cuda.blockIdx.y * tile + cuda.threadIdx.x, cols, cuda.gridDim.y * tile):
                if i + 3 * step < cols:  # a full tile: all loads, then all stores
                    a0, a1, a2, a3 = acc[t, i], acc[t, i + step], acc[t, i + 2 * step], acc[t, i + 3 * step]
                    x0, x1, x2, x3 = x[t, i], x[t, i + step], x[t, i + 2 * step], x[t, i + 3 * step]
                    acc[t, i] = store(load(a0) + load(x0))
                    acc[t, i + step] = store(load(a1) + load(x1))
                    acc[t, i + 2 * step] = store(load(a2) + load(x2))
                    acc[t, i + 3 * step] = store(load(a3) + load(x3))
                else:  # the row's ragged end
                    for j in range(i, cols, step):
                        acc[t, j] = store(load(acc[t, j]) + load(x[t, j]))

    return add_inplace


def build_add_inplace_vector_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(acc [T, H], x [T, H])`` as build_add_inplace_kernel, over 16-byte chunks.

    Every chunk of every row must be 16-byte aligned (the launcher checks).
    Grid: x over rows, y over tiles of VECTOR_UNROLL x blockDim.x chunks.
    """
    load, store = codec.load, codec.store
    load_vector, store_vector = build_vector_access()
    lanes = lanes_for(codec)
    get_lane, put_lane = build_lanes(codec)
    words = word_type(codec)
    buffer_words = VECTOR_UNROLL * VECTOR_WORDS

    @cuda.jit
    def add_inplace_vector(acc, x):
        chunks = acc.shape[1] // lanes
        a = cuda.local.array(buffer_words, words)
        b = cuda.local.array(buffer_words, words)
        step = cuda.blockDim.x
        tile = step * VECTOR_UNROLL
        for t in range(cuda.blockIdx.x, acc.shape[0], cuda.gridDim.x):
            for c in range(cuda.blockIdx.y * tile + cuda.threadIdx.x, chunks, cuda.gridDim.y * tile):
                for u in range(VECTOR_UNROLL):  # all loads of the tile, then all stores
                    if c + u * step < chunks:
                        load_vector(acc, (t, (c + u * step) * lanes), a, u * VECTOR_WORDS)
                        load_vector(x, (t, (c + u * step) * lanes), b, u * VECTOR_WORDS)
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        for k in range(u * lanes, (u + 1) * lanes):
                            put_lane(a, k, store(load(get_lane(a, k)) + load(get_lane(b, k))))
                        store_vector(acc, (t, (c + u * step) * lanes), a, u * VECTOR_WORDS)

    return add_inplace_vector


class AddInplace:
    """Launcher for ``acc <- acc + x`` (in place on ``acc``).

    Arrays: acc, x [T, H] in the codec's storage dtype (float32, or bf16 viewed
    as int16); row-sliced views allowed; ``x`` may be ``acc``.
    ``vectorize=False`` always runs the scalar kernel (tests, benchmarks).
    """

    def __init__(self, codec: Codec, max_threads: int = MAX_THREADS, vectorize: bool = True) -> None:
        self.kernel = Kernel(build_add_inplace_kernel(codec))
        self.vector_kernel = Kernel(build_add_inplace_vector_kernel(codec)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = check_max_threads(max_threads)

    def uses_vector(self, acc: Any, x: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel."""
        return self.vector_kernel is not None and vector_aligned(acc, x)

    def __call__(self, acc: Any, x: Any, stream: Any = 0) -> None:
        rows, cols = acc.shape
        if tuple(x.shape) != (rows, cols):
            raise ValueError(f"x has shape {tuple(x.shape)}, expected {(rows, cols)}")
        if rows == 0 or cols == 0:
            return
        if self.uses_vector(acc, x):
            grid, threads = elementwise_grid(rows, cols // self.lanes, self.max_threads, VECTOR_UNROLL)
            self.vector_kernel[grid, threads, stream](acc, x)
            return
        grid, threads = elementwise_grid(rows, cols, self.max_threads)
        self.kernel[grid, threads, stream](acc, x)
