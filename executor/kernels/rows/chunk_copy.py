"""Copies between two strided views of the same shape, 16 bytes at a time.

GEMM prefill attention (executor.models.prefill_attention) packs a request's
query rows by kv head before its GEMMs and unpacks the outputs after them: a
copy between ``[rows, Hq, D]`` row views of the fused qkv / attn_out buffers and
the contiguous ``[Hkv, rows, group, D]`` scratch. torch runs such a permuted
copy one element per thread through index arithmetic; on the H200 its copies of
a 4096-token Qwen3-8B prefill's 512-row tiles took 6.9 us each (4 MB each way,
~1.2 TB/s), this kernel's 4.0 and 2.9 us. Here each thread moves ``UNROLL``
16-byte chunks, all loads before any store.

The launcher takes the 16-byte kernel when every chunk of both views is
16-byte aligned (vector.py's ``vector_aligned``: the last axis contiguous and
whole chunks long, the other axes stepping by multiples of 16 bytes) and
otherwise hands the copy to torch (``dst.copy_(src)``), which is where a copy
that no kernel here can do belongs.
"""

from __future__ import annotations

from typing import Any

import torch

from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.vector import VECTOR_BYTES, VECTOR_WORDS, build_vector_access, vector_aligned
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import int32  # noqa: E402  (after load_cuda's numpy fix)

#: 16-byte chunks a thread has in flight (loads issued before the stores).
UNROLL = 4


def build_strided_copy_kernel() -> Any:
    """Kernel ``(src, dst)``: ``dst[a, b, c, :] = src[a, b, c, :]`` for 4-D uint8 views of one shape whose
    last axis is whole 16-byte chunks.

    Grid (row tiles, d1, d0): block (x, b, a) copies rows c of its tile; threads (tx, ty): thread
    (i, j) takes chunks i, i + tx, ... of rows j, j + ty, ... (UNROLL of them). Indices come from the
    grid, not from dividing a flat index: the divisions make a flat copy instruction-bound (9.9 us
    for a 4 MB copy on the H200).
    """
    load_vector, store_vector = build_vector_access()
    buffer_words = UNROLL * VECTOR_WORDS  # a compile-time constant for the local array

    @cuda.jit
    def chunk_copy_kernel(src, dst):
        a, b = cuda.blockIdx.z, cuda.blockIdx.y
        rows = dst.shape[2]
        chunks_per_row = dst.shape[3] // VECTOR_BYTES
        words = cuda.local.array(buffer_words, int32)
        first = cuda.blockIdx.x * cuda.blockDim.y * UNROLL + cuda.threadIdx.y
        for k in range(cuda.threadIdx.x, chunks_per_row, cuda.blockDim.x):
            for u in range(UNROLL):  # every load before any store: UNROLL chunks in flight
                c = first + u * cuda.blockDim.y
                if c < rows:
                    load_vector(src, (a, b, c, k * VECTOR_BYTES), words, u * VECTOR_WORDS)
            for u in range(UNROLL):
                c = first + u * cuda.blockDim.y
                if c < rows:
                    store_vector(dst, (a, b, c, k * VECTOR_BYTES), words, u * VECTOR_WORDS)

    return chunk_copy_kernel


class ChunkCopy:
    """Launcher: ``dst[...] = src[...]`` for two 4-D torch views of the same shape and dtype (any
    dtype: the kernel moves their bytes); allocates nothing."""

    def __init__(self) -> None:
        self.kernel = Kernel(build_strided_copy_kernel())
        self.threads = 32 if simulator_enabled() else 256

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, stream: Any = 0) -> None:
        if tuple(src.shape) != tuple(dst.shape) or len(dst.shape) != 4 or src.dtype != dst.dtype:
            raise ValueError(f"chunk_copy: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                             f"{dst.dtype} must be 4-D views of one shape and dtype")
        if not vector_aligned(src, dst):
            dst.copy_(src)
            return
        # As bytes, a chunk is 16 elements whatever the dtype: one kernel build serves every dtype.
        src_bytes, dst_bytes = src.view(torch.uint8), dst.view(torch.uint8)
        chunks_per_row = dst_bytes.shape[3] // VECTOR_BYTES
        d0, d1, rows = dst.shape[:3]
        if d0 * d1 * rows * chunks_per_row == 0:
            return
        tx = min(chunks_per_row, self.threads)
        ty = max(1, self.threads // tx)
        grid = (-(-rows // (ty * UNROLL)), d1, d0)
        self.kernel[grid, (tx, ty), stream](src_bytes, dst_bytes)
