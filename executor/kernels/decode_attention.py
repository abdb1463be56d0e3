"""Paged attention for decode steps: one query row per request, memory-bound on the KV cache.

The general kernel (attention.py) packs query rows of prefill chunks and gives
each (row, key) score its own thread; with one row per request that leaves
most threads idle and re-derives page addresses per element, which made long
decode contexts 30x slower than their KV traffic. This kernel serves the
decode pool only, with the same metadata and tile scheme (``plan_tiles``:
tile = request ``b`` and kv chunk ``c``; split tiles go through the shared
``merge_kernel``):

- Block (tile, kv head h), ``NT`` threads; the G = Hq / Hkv query heads of h
  share every K/V load. q is scaled once into shared memory.
- Keys go in rounds of ``SUB`` (256): the round's page ids and in-page offsets
  are looked up once into shared memory; K rows are staged ``KB`` at a time
  into shared memory with coalesced loads (consecutive threads, consecutive
  head-dim elements) and each score is one thread's dot over D (rows padded
  to D + 1 words: no bank conflicts); the round's scores stay in shared
  memory, so the softmax rescales once per round, not per key.
- P @ V: thread ``t`` owns head-dim element ``d = t (+ NT ...)`` of all G heads
  and reads V rows straight from global memory (one coalesced row per key).

Only shared memory and barriers: the simulator runs the same code.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.attention import build_kv_staging, check_heads
from executor.kernels.codec import Codec
from executor.kernels.launch import Kernel
from executor.kernels.reduce import threads_for
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

NEG_INF = float32(-np.inf)
SHARED_BUDGET_BYTES = 46_000  # under the 48 KiB static shared-memory limit per block
ROUND_KEYS = 256  # scores kept per softmax round
UNROLL_KEYS = 8  # V rows a thread loads before using them in P @ V


def _block_keys(head_dim: int, group_size: int, threads: int, round_keys: int) -> int:
    """Largest power-of-two K rows per stage (<= threads, <= 64) whose shared arrays fit the budget."""
    fixed_words = group_size * head_dim + group_size * round_keys + 2 * round_keys + group_size * threads + 3 * group_size
    fit = (SHARED_BUDGET_BYTES // 4 - fixed_words) // (head_dim + 1)
    if fit < 1:
        raise ValueError(f"decode attention: D={head_dim}, G={group_size} exceeds shared memory")
    return min(64, threads, 1 << (fit.bit_length() - 1))


def build_decode_attention(codec: Codec, head_dim: int, group_size: int, threads: int,
                           round_keys: int = ROUND_KEYS, block_keys: int | None = None) -> tuple[Any, Any]:
    """(direct kernel, split kernel) for one codec and head shape (D, G and NT size shared memory).

    Direct: ``(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
    request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale)``, every tile
    covering its whole row. Split: the same with ``partial_out, partial_lse`` after ``out``; rows of
    several chunks write those instead of ``out``. Grid (tiles, Hkv), ``threads`` threads.
    """
    load, store = codec.load, codec.store
    D, G, NT, SUB = head_dim, group_size, threads, round_keys
    KB = block_keys or _block_keys(D, G, NT, SUB)
    assert NT % KB == 0 and SUB % KB == 0, "stages tile the round and the block"
    assert NT & (NT - 1) == 0, "the tree reductions halve the block"
    assert SUB % UNROLL_KEYS == 0, "the P @ V loop's last group of keys stays inside the round's scores"
    GROUPS = NT // KB  # thread groups of the score phase; group j scores heads j, j + GROUPS, ...
    DPT = -(-D // NT)  # head-dim elements each thread owns in P @ V
    D_PAD = D + 1
    ACC = G * DPT  # local-array extents must be plain constants
    stage_pages, stage_rows = build_kv_staging(load, D, NT)

    @cuda.jit(device=True, inline=True)
    def tree_reduce(red_sh, tid, take_max):
        """red_sh[g, 0] <- max (or sum) of red_sh[g, 0:NT] for every head g; every thread calls it."""
        stride = NT // 2
        while stride > 0:
            if tid < stride:
                for g in range(G):
                    a = red_sh[g, tid]
                    b = red_sh[g, tid + stride]
                    red_sh[g, tid] = max(a, b) if take_max else a + b
            cuda.syncthreads()
            stride //= 2

    @cuda.jit(device=True, inline=True)
    def attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
               request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale, acc, lse):
        """The tile's normalised output in ``acc`` (element d = tid + i * NT of head g at g * DPT + i)
        and each head's log-sum-exp in ``lse`` (local arrays of the calling thread). Returns (row,
        chunk index, chunks of the row); row -1: nothing to do (uniform per block)."""
        q_sh = cuda.shared.array((G, D), float32)
        k_sh = cuda.shared.array((KB, D_PAD), float32)
        s_sh = cuda.shared.array((G, SUB), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        red_sh = cuda.shared.array((G, NT), float32)
        m_sh = cuda.shared.array(G, float32)
        l_sh = cuda.shared.array(G, float32)
        alpha_sh = cuda.shared.array(G, float32)
        tile = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        b = request_indices[tile]
        if b < 0:  # padding tile (a graph's fixed grid)
            return -1, 0, 0
        row = q_indptr[b]
        if row >= int32(total_num_rows[0]):
            return -1, 0, 0
        page_size = k_cache.shape[1]
        kv_len = (page_indptr[b + 1] - page_indptr[b] - 1) * page_size + last_page_len[b]
        chunk = kv_chunk_size[b]
        c = kv_tile_indices[tile]
        last = positions[row]  # the row sees keys 0 .. last
        k0 = c * chunk
        k1 = min(k0 + chunk, last + 1, kv_len)
        if k0 >= k1:
            return -1, 0, 0
        page_base = page_indptr[b]

        for e in range(tid, G * D, NT):
            g = e // D
            d = e - g * D
            q_sh[g, d] = load(q[row, h * G + g, d]) * scale
        for g in range(tid, G, NT):
            m_sh[g] = NEG_INF
            l_sh[g] = float32(0.0)
        for i in range(ACC):
            acc[i] = float32(0.0)
        key = tid % KB
        group = tid // KB

        for r0 in range(k0, k1, SUB):
            n = min(SUB, k1 - r0)
            stage_pages(page_indices, page_base, page_size, r0, n, page_sh, offset_sh, tid)
            cuda.syncthreads()
            # Scores of the round, KB keys per stage.
            for kb in range(0, n, KB):
                nk = min(KB, n - kb)
                stage_rows(k_cache, k_sh, page_sh, offset_sh, kb, h, nk, tid)
                cuda.syncthreads()
                if key < nk:
                    for g in range(group, G, GROUPS):
                        dot = float32(0.0)
                        for d in range(D):
                            dot += q_sh[g, d] * k_sh[key, d]
                        s_sh[g, kb + key] = dot
                cuda.syncthreads()
            # Round maximum per head: per-thread partials, then a tree over the block.
            for g in range(G):
                top = NEG_INF
                for kk in range(tid, n, NT):
                    top = max(top, s_sh[g, kk])
                red_sh[g, tid] = top
            cuda.syncthreads()
            tree_reduce(red_sh, tid, True)
            for g in range(tid, G, NT):
                old = m_sh[g]
                top = max(old, red_sh[g, 0])
                alpha_sh[g] = float32(math.exp(old - top)) if old > NEG_INF else float32(0.0)
                m_sh[g] = top
            cuda.syncthreads()
            for g in range(G):
                top = m_sh[g]
                total = float32(0.0)
                for kk in range(tid, n, NT):
                    p = float32(math.exp(s_sh[g, kk] - top))
                    s_sh[g, kk] = p
                    total += p
                for kk in range(n + tid, min(SUB, n + UNROLL_KEYS - 1), NT):
                    s_sh[g, kk] = float32(0.0)  # the P @ V loop's tail reads weight 0 here
                red_sh[g, tid] = total
            cuda.syncthreads()
            tree_reduce(red_sh, tid, False)
            for g in range(tid, G, NT):
                l_sh[g] = l_sh[g] * alpha_sh[g] + red_sh[g, 0]
            # P @ V for the round (alpha_sh is stable until the next round's barrier).
            for i in range(DPT):
                d = tid + i * NT
                if d < D:
                    for g in range(G):
                        acc[g * DPT + i] *= alpha_sh[g]
                    # Eight V rows in flight per thread; keys past n reload row n - 1 with weight 0.
                    for j0 in range(0, n, UNROLL_KEYS):
                        j1 = min(j0 + 1, n - 1)
                        j2 = min(j0 + 2, n - 1)
                        j3 = min(j0 + 3, n - 1)
                        j4 = min(j0 + 4, n - 1)
                        j5 = min(j0 + 5, n - 1)
                        j6 = min(j0 + 6, n - 1)
                        j7 = min(j0 + 7, n - 1)
                        v0 = load(v_cache[page_sh[j0], offset_sh[j0], h, d])
                        v1 = load(v_cache[page_sh[j1], offset_sh[j1], h, d])
                        v2 = load(v_cache[page_sh[j2], offset_sh[j2], h, d])
                        v3 = load(v_cache[page_sh[j3], offset_sh[j3], h, d])
                        v4 = load(v_cache[page_sh[j4], offset_sh[j4], h, d])
                        v5 = load(v_cache[page_sh[j5], offset_sh[j5], h, d])
                        v6 = load(v_cache[page_sh[j6], offset_sh[j6], h, d])
                        v7 = load(v_cache[page_sh[j7], offset_sh[j7], h, d])
                        for g in range(G):
                            a = acc[g * DPT + i]
                            a += s_sh[g, j0] * v0
                            a += s_sh[g, j0 + 1] * v1
                            a += s_sh[g, j0 + 2] * v2
                            a += s_sh[g, j0 + 3] * v3
                            a += s_sh[g, j0 + 4] * v4
                            a += s_sh[g, j0 + 5] * v5
                            a += s_sh[g, j0 + 6] * v6
                            a += s_sh[g, j0 + 7] * v7
                            acc[g * DPT + i] = a
            cuda.syncthreads()
        for g in range(G):
            for i in range(DPT):
                acc[g * DPT + i] /= l_sh[g]
            lse[g] = m_sh[g] + math.log(l_sh[g])
        return row, c, last // chunk + 1

    @cuda.jit
    def direct_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                      request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale):
        acc = cuda.local.array(ACC, float32)
        lse = cuda.local.array(G, float32)
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, acc, lse)
        if row < 0:
            return
        h = cuda.blockIdx.y
        for i in range(DPT):
            d = cuda.threadIdx.x + i * NT
            if d < D:
                for g in range(G):
                    out[row, h * G + g, d] = store(acc[g * DPT + i])

    @cuda.jit
    def split_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                     request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, partial_out,
                     partial_lse, scale):
        acc = cuda.local.array(ACC, float32)
        lse = cuda.local.array(G, float32)
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, acc, lse)
        if row < 0:
            return
        h = cuda.blockIdx.y
        for i in range(DPT):
            d = cuda.threadIdx.x + i * NT
            if d < D:
                for g in range(G):
                    head = h * G + g
                    if num_chunks == 1:
                        out[row, head, d] = store(acc[g * DPT + i])
                    elif c < partial_out.shape[1]:
                        partial_out[row, c, head, d] = acc[g * DPT + i]
                        if d == 0:
                            partial_lse[row, c, head] = lse[g]

    return direct_kernel, split_kernel


class DecodeAttention:
    """Launcher for decode attention (one query row per request), built once per codec and head shape.

    Same arguments as ``PagedAttention.__call__`` (rows_per_tile 1); the merge of split tiles is
    ``merge`` (attention.py's merge kernel, passed in so both launchers share one build).
    """

    def __init__(self, codec: Codec, head_dim: int, group_size: int, merge: Any, *, threads: int | None = None,
                 round_keys: int = ROUND_KEYS, block_keys: int | None = None):
        # One thread per head-dim element in P @ V by default (D = 128 or 256 on Qwen).
        self.threads = threads or max(32, min(256, 1 << (head_dim - 1).bit_length()))
        self.head_dim, self.group_size, self.merge = head_dim, group_size, merge
        self.direct, self.split = (Kernel(kernel) for kernel in build_decode_attention(
            codec, head_dim, group_size, self.threads, round_keys, block_keys))

    def __call__(self, q: Any, k_cache: Any, v_cache: Any, page_indices: Any, page_indptr: Any, last_page_len: Any,
                 q_indptr: Any, batch_indices: Any, positions: Any, request_indices: Any, qo_tile_indices: Any,
                 kv_tile_indices: Any, kv_chunk_size: Any, total_num_rows: Any, out: Any, scale: float,
                 partial_out: Any = None, partial_lse: Any = None, stream: Any = 0) -> None:
        """Write ``out [B, Hq, D]`` for B decode rows (row b is request b's only query).

        q [B, Hq, D] (strided views allowed), k_cache/v_cache [pages, S, Hkv, D], storage dtype of the
        codec; int32 metadata as for PagedAttention (qo_tile_indices is unused: one row per request).
        Split tiles need float32 ``partial_out [B, splits, Hq, D]`` and ``partial_lse [B, splits, Hq]``;
        a merge launch (B x Hq) then follows. Without them every tile must cover its whole row.
        """
        num_rows, num_q_heads, num_kv_heads = check_heads("decode_attention", out, k_cache, self.head_dim,
                                                          self.group_size)
        num_tiles = request_indices.shape[0]
        if num_tiles == 0 or num_rows == 0:
            return
        grid, scale32 = (num_tiles, num_kv_heads), np.float32(scale)
        meta = (page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices,
                kv_chunk_size, total_num_rows)
        if partial_out is None:
            self.direct[grid, self.threads, stream](q, k_cache, v_cache, *meta, out, scale32)
            return
        self.split[grid, self.threads, stream](q, k_cache, v_cache, *meta, out, partial_out, partial_lse, scale32)
        self.merge[(num_rows, num_q_heads), threads_for(self.head_dim), stream](
            partial_out, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out
        )
