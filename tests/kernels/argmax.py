"""Greedy sampling: the index of the maximum logit of each row.

Logits are always float32 (the lm_head GEMM writes them in fp32), so there is
no storage codec here. The tie rule is torch.argmax's: the first (lowest) index
of the maximum wins, and a NaN counts as larger than every number (the first
NaN wins), so a poisoned row shows up instead of a plausible token.

One block per row: each thread scans a strided slice of the row keeping its
best (value, index), then a shared-memory tree combines the candidates with
the same rule. No warp shuffles (the simulator lacks them).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import check_max_threads, threads_for
from executor.kernels.sampling.argmax_rule import beats, better
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

# The largest block a launcher picks.
MAX_THREADS = 1024
# Candidates live in dynamic shared memory, blockDim.x float32 values then
# blockDim.x int32 indices: the simulator's static cuda.shared.array allocation
# is racy (norm.py says how).
SHARED_BYTES_PER_THREAD = 8
UNROLL = 4  # logits loaded per thread before comparing; the scan spells out this many


def build_argmax_kernel() -> Callable[..., Any]:
    """Kernel ``(logits float32 [B, V], out_ids int32 [B])``: ``out_ids[b] = argmax(logits[b])``.

    Launch with ``SHARED_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory.
    """

    @cuda.jit
    def argmax(logits, out_ids):
        values = cuda.shared.array(0, float32)
        indices = cuda.shared.array(0, int32)[cuda.blockDim.x :]  # after the values
        vocab = logits.shape[1]
        tid = cuda.threadIdx.x
        for b in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):
            # Sentinel: -inf at index V loses to every element, -inf ones included.
            best_value = float32(-math.inf)
            best_index = int32(vocab)
            step = cuda.blockDim.x
            for i in range(tid, vocab, step * UNROLL):
                if i + 3 * step < vocab:
                    # Four independent loads in flight, then the compares in index order:
                    # a one-row decode argmax is load-latency bound (V=151936 on an H200: 52 -> 32 us).
                    v0, v1 = float32(logits[b, i]), float32(logits[b, i + step])
                    v2, v3 = float32(logits[b, i + 2 * step]), float32(logits[b, i + 3 * step])
                    best_value, best_index = better(v0, int32(i), best_value, best_index)
                    best_value, best_index = better(v1, int32(i + step), best_value, best_index)
                    best_value, best_index = better(v2, int32(i + 2 * step), best_value, best_index)
                    best_value, best_index = better(v3, int32(i + 3 * step), best_value, best_index)
                else:
                    for j in range(i, vocab, step):
                        best_value, best_index = better(float32(logits[b, j]), int32(j), best_value, best_index)
            values[tid] = best_value
            indices[tid] = best_index
            cuda.syncthreads()
            stride = cuda.blockDim.x // 2
            while stride > 0:
                if tid < stride and beats(values[tid + stride], indices[tid + stride], values[tid], indices[tid]):
                    values[tid] = values[tid + stride]
                    indices[tid] = indices[tid + stride]
                cuda.syncthreads()
                stride //= 2
            if tid == 0:
                out_ids[b] = indices[0]
            # The next row reuses the shared arrays: thread 0 must have read them first.
            cuda.syncthreads()

    return argmax


class Argmax:
    """Launcher: ``out_ids[b] = first index of max(logits[b, :])``.

    Arrays: logits float32 [B, V] (a row-sliced view is fine), out_ids int32 [B].
    One block per row of ``threads_for(V, max_threads)`` threads.
    """

    def __init__(self, max_threads: int = MAX_THREADS) -> None:
        self.kernel = Kernel(build_argmax_kernel())
        self.max_threads = check_max_threads(max_threads, MAX_THREADS)

    def __call__(self, logits: Any, out_ids: Any, stream: Any = 0) -> None:
        rows, vocab = logits.shape
        if tuple(out_ids.shape) != (rows,):
            raise ValueError(f"out_ids has shape {tuple(out_ids.shape)}, expected ({rows},)")
        if vocab == 0:
            raise ValueError("argmax over an empty vocabulary")
        if rows == 0:
            return
        threads = threads_for(math.ceil(vocab / UNROLL), self.max_threads)
        self.kernel[rows, threads, stream, threads * SHARED_BYTES_PER_THREAD](logits, out_ids)
