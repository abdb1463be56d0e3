"""Paged causal attention (Qwen3 / Qwen3.5 full attention) over the paged KV cache.

One launch serves a step that mixes prefill chunks and decode rows.

Tile scheme (filled on the host by ``plan_tiles``; the kernel's grid is
``(num_tiles, Hkv)``):

- tile ``i`` = (request ``b = request_indices[i]``, query tile ``qo_tile_indices[i]``,
  kv chunk ``c = kv_tile_indices[i]``).
- The query tile covers ``R = rows_per_tile`` consecutive rows of request b,
  rows ``q_indptr[b] + qo * R`` .. (clipped to the request's rows and to
  ``total_num_rows``), and for kv head ``g = blockIdx.y`` all ``G = Hq / Hkv``
  q heads ``g*G .. g*G+G-1``: ``R * G`` packed query rows share each K/V load.
- The kv chunk covers kv positions ``[c * kv_chunk_size[b], (c+1) * kv_chunk_size[b])``
  clipped to the causal limit ``positions[last row] + 1``; each row masks keys past
  its own position. ``kv_chunk_size[b] = kv_len[b]`` means one chunk (no split).
- Tiles with ``request_indices[i] < 0`` are padding (a capacity-sized CUDA-graph
  grid) and do nothing.

Split-KV (optional: ``plan_tiles(kv_chunk=..., max_splits=...)``, then launch with
the scratch buffers): a row at position p of request b has
``n = p // kv_chunk_size[b] + 1`` chunks. If n > 1 each chunk writes its normalised
partial output and log-sum-exp into float32 scratch ``partial_out [T, max_splits, Hq, D]``
/ ``partial_lse [T, max_splits, Hq]`` and attention/merge.py (grid T x Hq) combines them
into ``out``; rows with n = 1 are written straight to ``out``. Split-KV is what gives
long-context decode enough blocks (B x Hkv alone is a few dozen).

Within a block, keys go in blocks of KB: K block -> shared, scores (one thread
per (packed row, key), dot over D), online-softmax update (one thread per packed
row) while V block -> shared, then P @ V into per-thread float32 accumulators
(one element of the ``[R*G, D]`` output each, strided by blockDim).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.attention.merge import SplitMerge
from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.indices import build_indices
from executor.kernels.primitives.launch import Kernel
from executor.numba_cuda import load_cuda
from executor.tiles import plan_tiles

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

NEG_INF = float32(-np.inf)
SHARED_BUDGET_BYTES = 45_000  # under the 48 KiB static shared-memory limit per block


def default_block_keys(head_dim: int, packed_rows: int, rows_per_tile: int) -> int:
    """Largest power-of-two key block (<= 64) whose shared arrays fit SHARED_BUDGET_BYTES."""
    fixed_words = packed_rows * head_dim + 3 * packed_rows + rows_per_tile
    per_key_words = head_dim + 1 + packed_rows + 2  # K/V row, score column, page id and offset
    fit = (SHARED_BUDGET_BYTES // 4 - fixed_words) // per_key_words
    if fit < 1:
        raise ValueError(f"attention tile of {packed_rows} packed rows x D={head_dim} exceeds shared memory")
    return min(64, 1 << (fit.bit_length() - 1))


def build_kv_staging(load: Any, head_dim: int, threads: int) -> tuple[Any, Any]:
    """The K/V staging device functions the prefill and decode attention kernels share, for blocks of
    ``threads`` threads:

    - ``stage_pages(page_indices, page_base, page_size, first_pos, n, page_sh, offset_sh, tid)``: page
      id and in-page offset of keys first_pos .. first_pos + n - 1 into page_sh / offset_sh, once per
      key (not per element: a runtime division);
    - ``stage_rows(cache, kv_sh, page_sh, offset_sh, first, kv_head, nk, tid)``: kv_sh[kk, :] <-
      float32 (``load``) of the cache row of staged key ``first + kk``, for kk < nk, four loads in
      flight per thread (issued before their stores; indices past the block repeat its last element).
    """
    D, NT = head_dim, threads

    @cuda.jit(device=True, inline=True)
    def stage_pages(page_indices, page_base, page_size, first_pos, n, page_sh, offset_sh, tid):
        for kk in range(tid, n, NT):
            pos = first_pos + kk
            logical = pos // page_size
            page_sh[kk] = page_indices[page_base + logical]
            offset_sh[kk] = pos - logical * page_size

    @cuda.jit(device=True, inline=True)
    def stage_rows(cache, kv_sh, page_sh, offset_sh, first, kv_head, nk, tid):
        top = nk * D - 1
        for e0 in range(tid, nk * D, 4 * NT):
            e1 = min(e0 + NT, top)
            e2 = min(e0 + 2 * NT, top)
            e3 = min(e0 + 3 * NT, top)
            x0 = load(cache[page_sh[first + e0 // D], offset_sh[first + e0 // D], kv_head, e0 % D])
            x1 = load(cache[page_sh[first + e1 // D], offset_sh[first + e1 // D], kv_head, e1 % D])
            x2 = load(cache[page_sh[first + e2 // D], offset_sh[first + e2 // D], kv_head, e2 % D])
            x3 = load(cache[page_sh[first + e3 // D], offset_sh[first + e3 // D], kv_head, e3 % D])
            kv_sh[e0 // D, e0 % D] = x0
            kv_sh[e1 // D, e1 % D] = x1  # clamped duplicates rewrite the same value
            kv_sh[e2 // D, e2 % D] = x2
            kv_sh[e3 // D, e3 % D] = x3

    return stage_pages, stage_rows


def build_paged_attention(
    codec: Codec,
    head_dim: int,
    group_size: int,
    rows_per_tile: int = 1,
    threads: int = 128,
    block_keys: int | None = None,
) -> tuple[Any, Any]:
    """Build (direct kernel, split kernel) for one codec and tile shape (attention/merge.py combines
    the split kernel's partials).

    ``head_dim`` D, ``group_size`` G = Hq / Hkv and ``rows_per_tile`` R are compile-time
    constants (they size shared memory); ``threads`` is the block size the launcher uses.
    """
    D, G, R, NT = head_dim, group_size, rows_per_tile, threads
    M = R * G  # packed query rows per block
    KB = block_keys or default_block_keys(D, M, R)
    ACC = -(-M * D // NT)  # output elements owned per thread
    # Shared-array shapes must be literal constants: precompute the padded extents.
    D_PAD = D + 1  # K/V rows padded by one word: conflict-free column reads in the scores
    KB_PAD = KB + 1  # score rows carry the row's rescale factor alpha in column KB
    load, store = codec.load, codec.store

    @cuda.jit(device=True, inline=True)  # inlined in Numba IR: no separate device compile
    def locate(tile, page_indptr, last_page_len, q_indptr, positions, request_indices, qo_tile_indices,
               kv_tile_indices, kv_chunk_size, total_num_rows, page_size):
        """Tile -> (b, row0, row_end, k0, k1); row0 >= row_end means nothing to do. Rows are in
        position order, so the tile's last row has the largest causal limit."""
        b = request_indices[tile]
        if b < 0:
            return 0, 0, 0, 0, 0
        row0 = q_indptr[b] + qo_tile_indices[tile] * R
        row_end = min(q_indptr[b + 1], row0 + R, int32(total_num_rows[0]))
        if row0 >= row_end:
            return b, 0, 0, 0, 0
        kv_len = (page_indptr[b + 1] - page_indptr[b] - 1) * page_size + last_page_len[b]
        chunk = kv_chunk_size[b]
        k0 = kv_tile_indices[tile] * chunk
        k1 = min(k0 + chunk, positions[row_end - 1] + 1, kv_len)
        return b, row0, row_end, k0, k1

    stage_pages, stage_rows = build_kv_staging(load, D, NT)
    thread_index, block_x, block_y = build_indices()
    # The merge's block size, a compile-time stride: with a known-non-negative start and blockDim's
    # stride, LLVM computes a strided loop's trip count with a 64-bit division.

    @cuda.jit(device=True, inline=True)  # inlined in Numba IR: no separate device compile
    def attend(q, k_cache, v_cache, page_indices, page_base, kv_head, row0, row_end, k0, k1, positions, scale,
               q_sh, kv_sh, s_sh, m_sh, l_sh, lim_sh, page_sh, offset_sh, acc):
        """Online softmax over keys [k0, k1) for the tile's packed rows. Leaves the unnormalised
        output in ``acc`` (element ``tid + i*NT`` of [M, D]), running max in m_sh, sum in l_sh."""
        tid = cuda.threadIdx.x
        page_size = k_cache.shape[1]
        for e in range(tid, M * D, NT):
            m = e // D
            d = e - m * D
            row = row0 + m // G
            q_sh[m, d] = load(q[row, kv_head * G + m % G, d]) * scale if row < row_end else float32(0.0)
        for m in range(tid, M, NT):
            m_sh[m] = NEG_INF
            l_sh[m] = float32(0.0)
        for r in range(tid, R, NT):
            # Last kv position the row may see; -1 masks every key of an absent row.
            lim_sh[r] = positions[row0 + r] if row0 + r < row_end else -1
        for i in range(ACC):
            acc[i] = float32(0.0)
        cuda.syncthreads()
        for kb0 in range(k0, k1, KB):
            nk = min(KB, k1 - kb0)
            stage_pages(page_indices, page_base, page_size, kb0, nk, page_sh, offset_sh, tid)
            cuda.syncthreads()
            stage_rows(k_cache, kv_sh, page_sh, offset_sh, 0, kv_head, nk, tid)
            cuda.syncthreads()
            for e in range(tid, M * KB, NT):
                m = e // KB
                kk = e - m * KB
                s = NEG_INF
                if kk < nk and kb0 + kk <= lim_sh[m // G]:
                    dot = float32(0.0)
                    for d in range(D):
                        dot += q_sh[m, d] * kv_sh[kk, d]
                    s = dot
                s_sh[m, kk] = s
            cuda.syncthreads()
            # Softmax update, one thread per packed row (p overwrites s); the rest load V meanwhile.
            for m in range(tid, M, NT):
                old = m_sh[m]
                new = old
                for kk in range(nk):
                    new = max(new, s_sh[m, kk])
                total = float32(0.0)
                for kk in range(nk):
                    s = s_sh[m, kk]
                    p = float32(math.exp(s - new)) if s > NEG_INF else float32(0.0)
                    s_sh[m, kk] = p
                    total += p
                # alpha rescales the old sum/accumulators; kept in s_sh's spare column KB.
                alpha = float32(math.exp(old - new)) if old > NEG_INF else float32(0.0)
                s_sh[m, KB] = alpha
                m_sh[m] = new
                l_sh[m] = l_sh[m] * alpha + total
            stage_rows(v_cache, kv_sh, page_sh, offset_sh, 0, kv_head, nk, tid)
            cuda.syncthreads()
            for i in range(ACC):
                e = tid + i * NT
                if e < M * D:
                    m = e // D
                    d = e - m * D
                    total = float32(0.0)
                    for kk in range(nk):
                        total += s_sh[m, kk] * kv_sh[kk, d]
                    acc[i] = acc[i] * s_sh[m, KB] + total
            cuda.syncthreads()

    @cuda.jit
    def direct_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                      request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale):
        """Grid (num_tiles, Hkv), NT threads; one kv chunk per row (no split). Writes ``out``."""
        q_sh = cuda.shared.array((M, D), float32)
        kv_sh = cuda.shared.array((KB, D_PAD), float32)
        s_sh = cuda.shared.array((M, KB_PAD), float32)
        m_sh = cuda.shared.array(M, float32)
        l_sh = cuda.shared.array(M, float32)
        lim_sh = cuda.shared.array(R, int32)
        page_sh = cuda.shared.array(KB, int32)
        offset_sh = cuda.shared.array(KB, int32)
        acc = cuda.local.array(ACC, float32)
        kv_head = cuda.blockIdx.y
        b, row0, row_end, k0, k1 = locate(cuda.blockIdx.x, page_indptr, last_page_len, q_indptr, positions,
                                          request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size,
                                          total_num_rows, k_cache.shape[1])
        if row0 >= row_end:
            return
        attend(q, k_cache, v_cache, page_indices, page_indptr[b], kv_head, row0, row_end, k0, k1, positions,
               scale, q_sh, kv_sh, s_sh, m_sh, l_sh, lim_sh, page_sh, offset_sh, acc)
        for i in range(ACC):
            e = cuda.threadIdx.x + i * NT
            m = e // D
            if e < M * D and row0 + m // G < row_end:
                out[row0 + m // G, kv_head * G + m % G, e - m * D] = store(acc[i] / l_sh[m])

    @cuda.jit
    def split_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                     request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out,
                     partial_out, partial_lse, scale):
        """As ``direct_kernel``, but rows with several chunks write partial_out/partial_lse instead."""
        q_sh = cuda.shared.array((M, D), float32)
        kv_sh = cuda.shared.array((KB, D_PAD), float32)
        s_sh = cuda.shared.array((M, KB_PAD), float32)
        m_sh = cuda.shared.array(M, float32)
        l_sh = cuda.shared.array(M, float32)
        lim_sh = cuda.shared.array(R, int32)
        page_sh = cuda.shared.array(KB, int32)
        offset_sh = cuda.shared.array(KB, int32)
        acc = cuda.local.array(ACC, float32)
        kv_head = cuda.blockIdx.y
        b, row0, row_end, k0, k1 = locate(cuda.blockIdx.x, page_indptr, last_page_len, q_indptr, positions,
                                          request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size,
                                          total_num_rows, k_cache.shape[1])
        if row0 >= row_end:
            return
        attend(q, k_cache, v_cache, page_indices, page_indptr[b], kv_head, row0, row_end, k0, k1, positions,
               scale, q_sh, kv_sh, s_sh, m_sh, l_sh, lim_sh, page_sh, offset_sh, acc)
        chunk_index = kv_tile_indices[cuda.blockIdx.x]
        for i in range(ACC):
            e = cuda.threadIdx.x + i * NT
            m = e // D
            if e < M * D and row0 + m // G < row_end:
                row = row0 + m // G
                head = kv_head * G + m % G
                d = e - m * D
                num_chunks = lim_sh[m // G] // kv_chunk_size[b] + 1
                # A chunk past the row's own causal limit saw no key of it: nothing to write.
                if chunk_index < num_chunks:
                    if num_chunks == 1:
                        out[row, head, d] = store(acc[i] / l_sh[m])
                    elif chunk_index < partial_out.shape[1]:
                        partial_out[row, chunk_index, head, d] = acc[i] / l_sh[m]
                        if d == 0:
                            partial_lse[row, chunk_index, head] = m_sh[m] + math.log(l_sh[m])

    return direct_kernel, split_kernel


def check_heads(kernel: str, out: Any, k_cache: Any, head_dim: int, group_size: int) -> tuple[int, int, int]:
    """(rows, q heads, kv heads) of a launch, after checking ``out [T, Hq, D]`` and the cache's kv heads
    against the head_dim and group size the kernel was built for."""
    num_rows, num_q_heads, out_head_dim = out.shape
    num_kv_heads = k_cache.shape[2]
    if out_head_dim != head_dim or num_q_heads != num_kv_heads * group_size:
        raise ValueError(f"{kernel} built for D={head_dim}, group {group_size}; got out {tuple(out.shape)}, "
                         f"{num_kv_heads} kv heads")
    return num_rows, num_q_heads, num_kv_heads


class PagedAttention:
    """Launcher for paged causal attention, built once per codec and tile shape.

    ``PagedAttention(codec, head_dim=D, group_size=Hq // Hkv, rows_per_tile=R)``; call
    ``plan_tiles`` with the same R, then launch with ``__call__``. Compiles lazily per
    argument types; allocates nothing.
    """

    def __init__(self, codec: Codec, head_dim: int, group_size: int, *, rows_per_tile: int = 1,
                 threads: int = 128, block_keys: int | None = None) -> None:
        if threads & (threads - 1) or threads < 32:
            raise ValueError(f"threads must be a power of two >= 32, got {threads}")
        self.head_dim, self.group_size, self.rows_per_tile, self.threads = head_dim, group_size, rows_per_tile, threads
        self.direct, self.split = (Kernel(kernel) for kernel in build_paged_attention(
            codec, head_dim, group_size, rows_per_tile, threads, block_keys))
        self.merge = SplitMerge(codec, head_dim)

    def plan_tiles(self, q_indptr: Any, kv_lens: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        """``plan_tiles`` with this launcher's rows_per_tile."""
        return plan_tiles(q_indptr, kv_lens, rows_per_tile=self.rows_per_tile, **kwargs)

    def __call__(self, q: Any, k_cache: Any, v_cache: Any, page_indices: Any, page_indptr: Any, last_page_len: Any,
                 q_indptr: Any, batch_indices: Any, positions: Any, request_indices: Any, qo_tile_indices: Any,
                 kv_tile_indices: Any, kv_chunk_size: Any, total_num_rows: Any, out: Any, scale: float,
                 partial_out: Any = None, partial_lse: Any = None, stream: Any = 0) -> None:
        """Write ``out [T, Hq, D]`` (not in place: q and out must not alias).

        q [T, Hq, D] (strided views allowed), k_cache/v_cache [num_pages, S, Hkv, D], out: one
        storage dtype (float32 or int16 bits of bf16). Metadata int32 (total_num_rows [1] uint32)
        as in the module docstring. Grid (num_tiles = request_indices.shape[0], Hkv). With split
        tiles (``plan_tiles(kv_chunk=...)``) pass float32 ``partial_out [T, max_splits, Hq, D]``
        and ``partial_lse [T, max_splits, Hq]``; a merge launch (T x Hq) then follows.
        """
        num_rows, num_q_heads, num_kv_heads = check_heads("paged_attention", out, k_cache, self.head_dim,
                                                          self.group_size)
        num_tiles = request_indices.shape[0]
        if num_tiles == 0 or num_rows == 0:
            return
        grid = (num_tiles, num_kv_heads)
        scale32 = np.float32(scale)
        meta = (page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices, qo_tile_indices,
                kv_tile_indices, kv_chunk_size, total_num_rows)
        if partial_out is None:
            self.direct[grid, self.threads, stream](q, k_cache, v_cache, *meta, out, scale32)
            return
        self.split[grid, self.threads, stream](q, k_cache, v_cache, *meta, out, partial_out, partial_lse, scale32)
        self.merge(partial_out, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out, stream)
