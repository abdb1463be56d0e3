"""The packed requests of a long-prefill launch: which step requests one GatherKv + FlashAttention pair
serves, and where each one's keys lie in the gather scratch.

A launch serves the step's requests ``first_request .. first_request + n - 1`` (grid z over them). Of
those, the ones whose chunk has at least ``min_rows`` rows (serving gemm_attention_min_tokens) are
*packed*: the gather copies their keys and values into the ``[Hkv, C, D]`` scratch one after another,
in request order, and FlashAttention reads each request's run there. The others (one-row decode rows,
chunks short of the threshold, which the paged kernels serve) are skipped. Everything a block needs
comes from the step's device metadata:

    q_start   = q_indptr[r]                rows = q_indptr[r + 1] - q_start
    kv_len    = positions[q_start + rows - 1] + 1      (the chunk's rows are its last rows)
    kv_offset = sum of kv_len over the packed requests first_request .. r - 1

The host (executor.step ``LongPrefillGroup``) picks ranges whose packed kv_len sum fits C.
"""

from __future__ import annotations

from typing import Any

from executor.numba_cuda import load_cuda

cuda = load_cuda()


def build_packed_request() -> tuple[Any, Any]:
    """``(chunk_of, kv_offset_of)`` device functions (module docstring):

    - ``chunk_of(q_indptr, positions, request)`` -> ``(q_start, rows, kv_len)``;
    - ``kv_offset_of(q_indptr, positions, first_request, request, min_rows)`` -> the request's first key
      row in the scratch (a loop over the requests before it in the launch: a handful per step).
    """

    @cuda.jit(device=True, inline=True)
    def chunk_of(q_indptr, positions, request):
        q_start = q_indptr[request]
        rows = q_indptr[request + 1] - q_start
        return q_start, rows, positions[q_start + rows - 1] + 1

    @cuda.jit(device=True, inline=True)
    def kv_offset_of(q_indptr, positions, first_request, request, min_rows):
        offset = 0
        for earlier in range(first_request, request):
            _, rows, kv_len = chunk_of(q_indptr, positions, earlier)
            if rows >= min_rows:
                offset += kv_len
        return offset

    return chunk_of, kv_offset_of


def build_block_request(rows_per_block: int) -> Any:
    """``block_request(q_indptr, positions, first_request, min_rows) -> (active, q_start, rows, kv_len,
    first_row, kv_offset)``: the packed chunk a FlashAttention block of ``rows_per_block`` query rows
    serves (grid z: the request of the launch's range, grid x: the row block) and its first row in it.
    Row blocks run last rows first, so that the blocks with the most keys under the causal mask start
    first and the short ones fill the grid's tail. ``active`` is false for a request the launch skips
    (fewer than min_rows rows) or a row block past a shorter chunk's rows: the whole block returns."""
    chunk_of, kv_offset_of = build_packed_request()

    @cuda.jit(device=True, inline=True)
    def block_request(q_indptr, positions, first_request, min_rows):
        request = first_request + cuda.blockIdx.z
        q_start, rows, kv_len = chunk_of(q_indptr, positions, request)
        first_row = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * rows_per_block
        active = rows >= min_rows and first_row < rows
        kv_offset = kv_offset_of(q_indptr, positions, first_request, request, min_rows) if active else 0
        return active, q_start, rows, kv_len, first_row, kv_offset

    return block_request
