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
/ ``partial_lse [T, max_splits, Hq]`` and ``merge_kernel`` (grid T x Hq) combines them
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
import torch

from executor.kernels.codec import Codec
from executor.kernels.indices import build_indices
from executor.kernels.launch import Kernel
from executor.kernels.reduce import threads_for
from executor.numba_cuda import load_cuda
from planner.capacity import MAX_DECODE_KV_SPLITS

cuda = load_cuda()
from numba import float32, int32, uint64  # noqa: E402  (after load_cuda's numpy fix)

NEG_INF = float32(-np.inf)
NO_SPLIT_CHUNK = np.iinfo(np.int32).max  # kv_chunk_size of padding requests: never splits
# Query rows per tile of prefill steps: the rows of a tile share every K/V load (the kv traffic of
# a long prefill falls by this factor); decode steps use decode_attention.py.
PREFILL_ROWS_PER_TILE = 4
SHARED_BUDGET_BYTES = 45_000  # under the 48 KiB static shared-memory limit per block
MERGE_UNROLL = 16  # chunk partials a merge thread loads before adding any (512 tokens in chunks of 64: one trip)
MAX_MERGE_CHUNKS = MAX_DECODE_KV_SPLITS  # deepest split scratch the merge takes: the plan's decode_kv_splits bound
# Launches of at most this many rows load a row's first partials before they know the row is split:
# 4 rows x Hq x D x MERGE_UNROLL floats (1 MiB at Qwen3-8B) cost less HBM time than the dependent round
# they save (0.7 us at batch 1), where batch 64's 16 MiB made its merge 3.8 us slower (H200).
MERGE_SPECULATE_MAX_ROWS = 4


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
) -> tuple[Any, Any, Any]:
    """Build (direct kernel, split kernel, merge kernel) for one codec and tile shape.

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
    MERGE_THREADS = merge_threads(D)

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

    @cuda.jit(device=True, inline=True)
    def stage_first_round(partial_flat, partial_lse, t, head, num_chunks, row_base, chunk_stride, values, lse_sh):
        """A thread's first MERGE_UNROLL chunk partials (those < num_chunks: guarded, not clamped) into
        ``values`` and the log-sum-exps of chunks < num_chunks into ``lse_sh``; partial_flat[row_base +
        c chunk_stride + d] is element d of chunk c's partial (merge_kernel)."""
        first_d = thread_index()
        if first_d < D:
            for u in range(MERGE_UNROLL):
                if u < num_chunks:
                    values[u] = partial_flat[row_base + uint64(first_d) + uint64(u) * chunk_stride]
        c = thread_index()  # strided loops as while loops: a strided range() divides (64-bit) for its trip count
        while c < num_chunks:
            lse_sh[c] = partial_lse[t, c, head]
            c += MERGE_THREADS

    @cuda.jit
    def merge_kernel(partial_flat, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out):
        """Grid (T, Hq), threads over D: out[t, h] = sum_c w_c partial_out[t, c, h] for split rows,
        w_c = exp(lse_c - max lse) / sum. Rows with one chunk were written by split_kernel.

        ``partial_flat`` is partial_out [T, depth, Hq, D] as one flat float32 array (the launcher's
        view): a thread's chunk partials then lie a constant stride apart from one base offset, one
        multiply-add a load, where 4-d indexing recomputes every load's whole offset from the runtime
        shapes (about 25 instructions a load, ahead of the loads).

        At decode sizes a warp of this kernel has an SM scheduler to itself: it takes about as long
        as its instructions' dependent latencies, so each thread does as little as it can. In a launch
        of at most MERGE_SPECULATE_MAX_ROWS rows every load of the first round goes out together,
        before the row's chunk count is known: the row's metadata (t < T, so its entries are valid
        addresses even past the step's rows), a thread's first MERGE_UNROLL chunk partials and the
        log-sum-exps of every chunk the scratch holds (its whole depth; only chunks < num_chunks are
        used): one dependent round where waiting for the chunk count takes two. A larger launch
        waits: most of its rows are not split, and their blocks would load bytes nobody uses.
        Either way the chunk size of request t goes out with the metadata: at decode it is the row's
        own (a row a request), and a row of another request looks its request's up again.
        Chunk c's weight exp(lse_c - max) is computed once, by thread c, into shared memory (every
        thread used to compute every weight twice); a thread then adds MERGE_UNROLL partials at a time.
        Sums run in chunk order, and a thread multiplies by the reciprocal of the weight sum once
        computed: a division per output can take the division's slow path (as decode_tiles.py's meet
        did on an all-zero V)."""
        lse_sh = cuda.shared.array(MAX_MERGE_CHUNKS, float32)
        weight_sh = cuda.shared.array(MAX_MERGE_CHUNKS, float32)
        values = cuda.local.array(MERGE_UNROLL, float32)
        t = block_x()
        head = block_y()
        depth = partial_lse.shape[1]
        num_heads = out.shape[1]
        # Unsigned flat indices: Numba wraps a signed index that might be negative (a compare and a
        # select on 64 bits a load), and no product of the shapes is known to be >= 0.
        chunk_stride = uint64(num_heads * D)
        row_base = uint64((t * depth * num_heads + head) * D)
        speculate = cuda.gridDim.x <= MERGE_SPECULATE_MAX_ROWS
        step_rows = int32(total_num_rows[0])
        position = positions[t]
        b = batch_indices[t]
        chunk = kv_chunk_size[min(t, kv_chunk_size.shape[0] - 1)]
        if speculate:
            stage_first_round(partial_flat, partial_lse, t, head, depth, row_base, chunk_stride, values, lse_sh)
        if t >= step_rows:
            return
        if b != t:
            chunk = kv_chunk_size[b]
        num_chunks = min(position // chunk + 1, depth)
        if num_chunks <= 1:
            return
        if not speculate:
            stage_first_round(partial_flat, partial_lse, t, head, num_chunks, row_base, chunk_stride, values,
                              lse_sh)
        cuda.syncthreads()
        top = NEG_INF
        for c in range(num_chunks):
            top = max(top, lse_sh[c])
        c = thread_index()
        while c < num_chunks:
            weight_sh[c] = float32(math.exp(lse_sh[c] - top))
            c += MERGE_THREADS
        cuda.syncthreads()
        weight_sum = float32(0.0)
        for c in range(num_chunks):
            weight_sum += weight_sh[c]
        inv_weight_sum = float32(1.0) / weight_sum  # >= 1: the largest weight is 1
        first_d = thread_index()
        d = first_d
        while d < D:
            total = float32(0.0)
            for c0 in range(0, num_chunks, MERGE_UNROLL):
                if d != first_d or c0 > 0:
                    for u in range(MERGE_UNROLL):
                        if c0 + u < num_chunks:
                            values[u] = partial_flat[row_base + uint64(d) + uint64(c0 + u) * chunk_stride]
                for u in range(MERGE_UNROLL):
                    if c0 + u < num_chunks:
                        total += weight_sh[c0 + u] * values[u]
            out[t, head, d] = store(total * inv_weight_sum)
            d += MERGE_THREADS

    return direct_kernel, split_kernel, merge_kernel


def merge_threads(head_dim: int) -> int:
    """Threads a block of the merge kernel: one output element of a head a thread."""
    return threads_for(head_dim)


def check_heads(kernel: str, out: Any, k_cache: Any, head_dim: int, group_size: int) -> tuple[int, int, int]:
    """(rows, q heads, kv heads) of a launch, after checking ``out [T, Hq, D]`` and the cache's kv heads
    against the head_dim and group size the kernel was built for."""
    num_rows, num_q_heads, out_head_dim = out.shape
    num_kv_heads = k_cache.shape[2]
    if out_head_dim != head_dim or num_q_heads != num_kv_heads * group_size:
        raise ValueError(f"{kernel} built for D={head_dim}, group {group_size}; got out {tuple(out.shape)}, "
                         f"{num_kv_heads} kv heads")
    return num_rows, num_q_heads, num_kv_heads


def plan_tiles(
    q_indptr: Any,
    kv_lens: Any,
    *,
    rows_per_tile: int = 1,
    kv_chunk: int | None = None,
    max_splits: int = 1,
    out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fill the work tiles of one step (host side, numpy).

    q_indptr [B+1] (rows of request b are q_indptr[b]..q_indptr[b+1]-1, the last n_b
    positions of its kv_len), kv_lens [B] (tokens after this step). ``kv_chunk``: kv
    tokens per kv tile (None: the whole kv_len, no split); a row then has
    ``p // chunk + 1`` chunks, which must be <= ``max_splits`` (the split scratch depth).
    Returns int32 ``(request_indices [N], qo_tile_indices [N], kv_tile_indices [N],
    kv_chunk_size [B])`` ordered request-major, then query tile, then kv chunk. With
    ``out`` (four capacity-sized int32 buffers) the tiles are written there, the unused
    tail of request_indices is set to -1 (padding tiles) and of kv_chunk_size to
    INT32_MAX (never split), and views of the active parts are returned.
    """
    q_indptr = np.asarray(q_indptr, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    num_requests = kv_lens.shape[0]
    if q_indptr.shape != (num_requests + 1,):
        raise ValueError(f"plan_tiles: q_indptr has shape {q_indptr.shape}, expected ({num_requests + 1},)")
    rows = np.diff(q_indptr)
    if (rows < 0).any() or (kv_lens < rows).any() or ((rows > 0) & (kv_lens < 1)).any():
        raise ValueError("plan_tiles: need 0 <= rows of request b <= kv_lens[b] (and kv_len >= 1 with rows)")
    chunk = np.maximum(kv_lens, 1) if kv_chunk is None else np.minimum(np.int64(kv_chunk), np.maximum(kv_lens, 1))
    if (chunk < 1).any():
        raise ValueError(f"plan_tiles: kv_chunk must be >= 1, got {kv_chunk}")
    splits = np.where(rows > 0, (kv_lens - 1) // chunk + 1, 1)
    _check_splits(splits, max_splits)
    # Query tiles: per request ceil(n_b / R); the last row of tile qo has position
    # kv_len - n_b + min((qo + 1) R, n_b) - 1, which bounds the tile's kv chunks.
    qo_per_request = -(-rows // rows_per_tile)
    qo_request = np.repeat(np.arange(num_requests), qo_per_request)
    qo_start = np.repeat(np.cumsum(qo_per_request) - qo_per_request, qo_per_request)
    qo_index = np.arange(qo_request.shape[0]) - qo_start
    n_b = rows[qo_request]
    last_pos = kv_lens[qo_request] - n_b + np.minimum((qo_index + 1) * rows_per_tile, n_b) - 1
    kv_per_qo = last_pos // chunk[qo_request] + 1
    tile_start = np.repeat(np.cumsum(kv_per_qo) - kv_per_qo, kv_per_qo)
    tiles = (
        np.repeat(qo_request, kv_per_qo).astype(np.int32),
        np.repeat(qo_index, kv_per_qo).astype(np.int32),
        (np.arange(tile_start.shape[0]) - tile_start).astype(np.int32),
    )
    chunk32 = chunk.astype(np.int32)
    if out is None:
        return tiles[0], tiles[1], tiles[2], chunk32
    num_tiles = tiles[0].shape[0]
    if num_tiles > out[0].shape[0]:
        raise ValueError(f"attention tiles: need {num_tiles}, planned {out[0].shape[0]}")
    if num_requests > out[3].shape[0]:
        raise ValueError(f"attention kv_chunk_size: need {num_requests} requests, planned {out[3].shape[0]}")
    for buffer, values in zip(out[:3], tiles):
        buffer[:num_tiles] = values
    out[0][num_tiles:] = -1
    out[3][:num_requests] = chunk32
    out[3][num_requests:] = NO_SPLIT_CHUNK
    return out[0][:num_tiles], out[1][:num_tiles], out[2][:num_tiles], out[3][:num_requests]


def plan_decode_tiles(kv_lens: np.ndarray, kv_chunk: int,
                      max_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``plan_tiles`` for a decode step (one row per request, at position kv_len - 1), in the few
    numpy calls that case needs: the decode host path runs every step, and the general planner's
    checks and query-tile bookkeeping cost ~0.1 ms of it at batch 1. kv_lens int64 [B] >= 1."""
    chunk = np.minimum(np.int64(kv_chunk), kv_lens)
    splits = (kv_lens - 1) // chunk + 1
    _check_splits(splits, max_splits)
    num_tiles = int(splits.sum())
    request_indices = np.repeat(np.arange(kv_lens.shape[0], dtype=np.int32), splits)
    starts = np.repeat(np.cumsum(splits) - splits, splits)
    kv_tile_indices = (np.arange(num_tiles) - starts).astype(np.int32)
    return request_indices, np.zeros(num_tiles, np.int32), kv_tile_indices, chunk.astype(np.int32)


def _check_splits(splits: np.ndarray, max_splits: int) -> None:
    """Each request's kv chunks [B] fit the split scratch depth, or a ValueError naming the request."""
    if splits.size and splits.max() > max_splits:
        raise ValueError(
            f"attention kv splits: need {int(splits.max())}, planned {max_splits} (request {int(splits.argmax())})"
        )


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
        self.direct, self.split, self.merge = (Kernel(kernel) for kernel in build_paged_attention(
            codec, head_dim, group_size, rows_per_tile, threads, block_keys))

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
        self.merge_splits(partial_out, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out,
                          stream)

    def merge_splits(self, partial_out: Any, partial_lse: Any, batch_indices: Any, positions: Any,
                     kv_chunk_size: Any, total_num_rows: Any, out: Any, stream: Any = 0) -> None:
        """Combine split rows' partials into ``out [T, Hq, D]`` (one launch, grid T x Hq); the split
        kernel wrote rows of one chunk straight to ``out``."""
        num_rows, num_q_heads = out.shape[0], out.shape[1]
        if partial_out.shape[1] > MAX_MERGE_CHUNKS:
            raise ValueError(f"attention merge: split scratch of {partial_out.shape[1]} kv chunks, the merge takes "
                             f"at most {MAX_MERGE_CHUNKS}")
        # The merge reads the partials flat. A view, never a copy (the planned scratch is contiguous, and
        # torch's view refuses otherwise); the tests' host arrays reshape.
        flat = partial_out.view(-1) if isinstance(partial_out, torch.Tensor) else partial_out.reshape(-1)
        self.merge[(num_rows, num_q_heads), merge_threads(self.head_dim), stream](
            flat, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out
        )
