"""The steps both decode attention kernels share: where a tile's keys are, how a block's groups meet,
and where the tile's output goes.

decode.py (CUDA cores, lane groups) and decode_mma.py (tensor cores, warps)
differ in how a block attends to its keys, not in what a tile is (executor/tiles.py's ``plan_tiles``:
tile = request ``b`` and kv chunk ``c``, one query row per request) nor in how a block's partial
softmaxes combine. Each builder here returns inline device functions for one head shape:

    tile_span(tile, page_size, page_indptr, last_page_len, q_indptr, positions, request_indices,
              kv_tile_indices, kv_chunk_size, total_num_rows) -> (row, c, k0, k1, page_base, num_chunks, last)
        the tile's query row, chunk index, keys k0 .. k1 - 1, first page-table entry, the row's
        chunks and its position (the key it adds); row -1 when the block has nothing to do (a
        graph's padding tile, a row past the step's rows, or a chunk past the row's keys), decided
        before any barrier. It is the three steps below in turn; a kernel that has loads of its own
        to issue while the lookups land calls them itself:
    tile_entries(tile, request_indices, kv_tile_indices, total_num_rows) -> (b, c, step_rows)
        the tile's entries (one round of loads); b < 0 for a padding tile.
    tile_request(b, c, step_rows, page_size, page_indptr, last_page_len, q_indptr, kv_chunk_size)
            -> (row, k0, bound, page_base, chunk)
        its request's entries (a second round; b >= 0): the chunk's first key k0 and ``bound`` =
        min(k0 + chunk, the request's cached keys), which page lookups may clamp to before the row's
        position lands; row -1 past the step's rows or the cached keys.
    tile_keys(positions, row, k0, bound, chunk) -> (k1, num_chunks, last)
        the row's position (a third round): the chunk ends at k1 = min(bound, last + 1); nothing to
        do when k0 >= k1.
    meet_out(s_sh, part_sh, out, row, h)
        after each of the block's ``groups`` groups k wrote its running (max, sum) of head g to
        s_sh[0 / 1, k * G + g] (max in log2 units) and its output to part_sh[k, g, :], and a
        barrier: out[row, h * G + g, :] <- the groups' combined, normalised output of head g, in
        the storage codec.
    meet_split(s_sh, part_sh, out, partial_out, partial_lse, row, c, num_chunks, h)
        a split kernel's output, from the same shared arrays: ``meet_out`` for a row of one chunk,
        else the chunk's float32 partial output and natural-log log-sum-exp for the merge launch
        (chunks past the scratch depth write nothing).

The meet writes straight from the combination to global memory, without a barrier or a second pass
over shared memory. At batch 1 a block's warps each issue alone, so its tail after the key loop is
the length of these instruction chains (docs/benchmarks.md, "Decode attention instructions"): a
thread's elements are compile-time trips (a strided ``range`` computes its trip count with a 64-bit
division), and it multiplies by the reciprocal of its head's weight sum (>= 1: the best group's
weight is 1 and its sum at least 1) instead of dividing each output: with the benchmarks' all-zero
V, ncu saw the division's slow path run for nearly every output.
"""

from __future__ import annotations

import math
from typing import Any

from executor.kernels.primitives.fast_math import build_exp2_scaled
from executor.kernels.primitives.indices import build_indices
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

LOG2_E = 1.4426950408889634  # the kernels' scores are in log2 units: every exponent is one exp2
LN_2 = 0.6931471805599453


def build_tile_span() -> Any:
    """``tile_span`` (module docstring)."""
    tile_entries, tile_request, tile_keys = build_tile_lookups()

    @cuda.jit(device=True, inline=True)
    def tile_span(tile, page_size, page_indptr, last_page_len, q_indptr, positions, request_indices,
                  kv_tile_indices, kv_chunk_size, total_num_rows):
        b, c, step_rows = tile_entries(tile, request_indices, kv_tile_indices, total_num_rows)
        if b < 0:  # padding tile (a graph's fixed grid)
            return -1, 0, 0, 0, 0, 0, 0
        row, k0, bound, page_base, chunk = tile_request(b, c, step_rows, page_size, page_indptr, last_page_len,
                                                        q_indptr, kv_chunk_size)
        if row < 0:
            return -1, 0, 0, 0, 0, 0, 0
        k1, num_chunks, last = tile_keys(positions, row, k0, bound, chunk)
        if k0 >= k1:
            return -1, 0, 0, 0, 0, 0, 0
        return row, c, k0, k1, page_base, num_chunks, last

    return tile_span


def build_tile_lookups() -> tuple[Any, Any, Any]:
    """``(tile_entries, tile_request, tile_keys)`` (module docstring).

    A decode call waits on these lookups, not on bandwidth: loads that do not depend on each other go
    out together, three rounds in all (the tile's, its request's, its row's position). The tile and
    request entries exist for every tile of the grid and every request of the bucket, so the loads
    before each early return read valid addresses."""

    @cuda.jit(device=True, inline=True)
    def tile_entries(tile, request_indices, kv_tile_indices, total_num_rows):
        return request_indices[tile], kv_tile_indices[tile], int32(total_num_rows[0])

    @cuda.jit(device=True, inline=True)
    def tile_request(b, c, step_rows, page_size, page_indptr, last_page_len, q_indptr, kv_chunk_size):
        row = q_indptr[b]
        page_base = page_indptr[b]
        page_end = page_indptr[b + 1]
        tail = last_page_len[b]
        chunk = kv_chunk_size[b]
        kv_len = (page_end - page_base - 1) * page_size + tail
        k0 = c * chunk
        bound = min(k0 + chunk, kv_len)
        if row >= step_rows or k0 >= bound:
            return -1, 0, 0, 0, 0
        return row, k0, bound, page_base, chunk

    @cuda.jit(device=True, inline=True)
    def tile_keys(positions, row, k0, bound, chunk):
        last = positions[row]  # the row sees keys 0 .. last
        return min(bound, last + 1), last // chunk + 1, last

    return tile_entries, tile_request, tile_keys


def build_meet(group_size: int, head_dim: int, threads: int, groups: int, store: Any) -> tuple[Any, Any]:
    """``(meet_out, meet_split)`` (module docstring) for blocks of ``threads`` threads in ``groups``
    groups; ``store`` is the codec's float32 -> storage."""
    G, D, NT, K = group_size, head_dim, threads, groups
    ELEMENTS = G * D
    TRIPS = -(-ELEMENTS // NT)
    EVEN = ELEMENTS % NT == 0  # every trip of every thread has an element
    thread_index = build_indices()[0]
    exp2_scaled = build_exp2_scaled()  # 2^(x - best) as an FMA and ex2.approx.ftz
    ONE = float32(1.0)

    @cuda.jit(device=True, inline=True)
    def combine(s_sh, part_sh, j):
        """(head g, element d, the normalised output, the log2 maximum and the weight sum under it)
        of element j = g D + d."""
        g = j // D
        d = j - g * D
        best = float32(-1e30)
        for k in range(K):
            best = max(best, s_sh[0, k * G + g])
        out_sum = float32(0.0)
        weight_sum = float32(0.0)
        for k in range(K):
            w = exp2_scaled(s_sh[0, k * G + g], ONE, best)
            out_sum += w * part_sh[k, g, d]
            weight_sum += w * s_sh[1, k * G + g]
        return g, d, out_sum * (float32(1.0) / weight_sum), best, weight_sum

    @cuda.jit(device=True, inline=True)
    def meet_out(s_sh, part_sh, out, row, h):
        tid = thread_index()
        for i in range(TRIPS):
            j = tid + i * NT
            if EVEN or j < ELEMENTS:
                g, d, value, _, _ = combine(s_sh, part_sh, j)
                out[row, h * G + g, d] = store(value)

    @cuda.jit(device=True, inline=True)
    def meet_split(s_sh, part_sh, out, partial_out, partial_lse, row, c, num_chunks, h):
        if num_chunks == 1:
            meet_out(s_sh, part_sh, out, row, h)
            return
        if c >= partial_out.shape[1]:
            return
        tid = thread_index()
        for i in range(TRIPS):
            j = tid + i * NT
            if EVEN or j < ELEMENTS:
                g, d, value, best, weight_sum = combine(s_sh, part_sh, j)
                partial_out[row, c, h * G + g, d] = value
                if d == 0:
                    partial_lse[row, c, h * G + g] = best * float32(LN_2) + math.log(weight_sum)

    return meet_out, meet_split
