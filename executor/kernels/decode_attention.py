"""Paged attention for decode steps: one query row per request, bound by reading the KV cache.

A decode step reads every cached key and value once and does a few FLOPs per
byte, so the kernel is built around moving K/V rows at full bandwidth. It
serves the decode pool only, with attention.py's metadata and tile scheme
(``plan_tiles``: tile = request ``b`` and kv chunk ``c``; split tiles write
partials that attention.py's ``merge_kernel`` combines).

- Block (tile, kv head h), ``NT`` threads. A K/V row of D elements is
  ``D / E`` 16-byte chunks (E = 8 bf16 or 4 float32); a group of ``L`` lanes
  owns one key at a time, lane ``l`` its chunk(s) ``l, l + L, ...``, so a group
  reads a whole row with one 16-byte load per lane (vector.py) and the block
  has ``KPP = NT / L`` keys in flight, each group ``UNROLL_KEYS`` deep.
- q stays in registers: each lane holds its chunks' q elements of the
  G = Hq / Hkv heads that share h (scaled once). A score is the lane's partial
  dot, summed over the group with xor shuffles.
- Keys go in rounds of ``round_keys``: the round's page ids are looked up once
  into shared memory, its scores stay in shared memory, and one warp per head
  folds them into the running (max, sum) with shuffles, so the softmax rescales
  once per round and needs two barriers, not a block-wide tree per key.
- P @ V reads V the way scores read K (one 16-byte chunk per lane); each lane
  accumulates its chunks for all G heads, and the KPP groups' partial outputs
  meet once, at the end, in shared memory.

On the H200 (Qwen3-8B heads, context 512) a layer's decode attention went from
29.9 to 10.7 us at batch 1 and from 222 to 40 us at batch 32 with this design;
64 requests x 4096 tokens read their K/V at 63% of the copy bandwidth
(bench/kernels.py).

The launcher falls back to attention.py's general kernel (which handles one
row per request too) when the cache rows are not whole, aligned 16-byte chunks
or the group would not be a power of two lanes. The simulator runs the same
kernel: its vector accesses and reductions are emulated (vector.py, reduce.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.attention import NEG_INF, PagedAttention, build_kv_staging, check_heads
from executor.kernels.codec import Codec
from executor.kernels.launch import SHARED_LIMIT_BYTES, Kernel
from executor.kernels.reduce import build_group_max, build_group_sum, threads_for
from executor.kernels.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

ROUND_KEYS = 256  # scores kept per softmax round
UNROLL_KEYS = 4  # keys each lane group loads before using them: 4 x 16 bytes in flight per lane
WARP = 32


def key_lanes(codec: Codec, head_dim: int) -> int | None:
    """Lanes that read one K/V row together (a power of two <= 32), or None when the row is not a
    whole number of 16-byte chunks that such a group can split evenly."""
    elements = lanes_for(codec)
    chunks = head_dim // elements
    if head_dim % elements or chunks & (chunks - 1):
        return None
    return min(chunks, WARP)


def shared_bytes(codec: Codec, head_dim: int, group_size: int, threads: int, round_keys: int) -> int:
    """Static shared memory of one block: the round's scores, page ids and offsets, the softmax
    state, the groups' partial outputs and the simulator's reduction scratch (all 4-byte words)."""
    groups = threads // key_lanes(codec, head_dim)
    words = group_size * round_keys + 2 * round_keys + 3 * group_size + groups * group_size * head_dim + threads
    return 4 * words


def build_decode_attention(codec: Codec, head_dim: int, group_size: int, threads: int,
                           round_keys: int = ROUND_KEYS) -> tuple[Any, Any]:
    """(direct kernel, split kernel) for one codec and head shape; D, G and NT size registers and shared memory.

    Direct: ``(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
    request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale)``, every tile
    covering its whole row. Split: the same with ``partial_out, partial_lse`` after ``out``; rows of
    several chunks write those instead of ``out``. Grid (tiles, Hkv), ``threads`` threads. The K/V
    cache rows must be 16-byte aligned (the launcher checks).
    """
    load, store = codec.load, codec.store
    get_lane = build_lanes(codec)[0]
    load_vector = build_vector_access()[0]
    words = word_type(codec)
    D, G, NT, SUB = head_dim, group_size, threads, round_keys
    E = lanes_for(codec)  # elements per 16-byte chunk
    L = key_lanes(codec, D)
    assert L is not None and NT % L == 0 and NT & (NT - 1) == 0, "lane groups tile the block"
    CPL = D // E // L  # chunks per lane of a row
    KPP = NT // L  # keys in flight per pass: one per lane group
    W = min(WARP, NT)  # lanes per softmax group (a warp on the GPU)
    HPP = NT // W  # heads whose softmax state one pass updates
    LANE_ELEMENTS = CPL * E  # elements of a row a lane owns
    ACC = G * LANE_ELEMENTS  # q and accumulator registers per lane (constant extents)
    BUFFER_WORDS = UNROLL_KEYS * CPL * VECTOR_WORDS
    stage_pages = build_kv_staging(load, D, NT)[0]
    group_max, group_sum = build_group_max(), build_group_sum()

    @cuda.jit(device=True, inline=True)
    def load_rows(cache, h, base, n, gid, lane, page_sh, offset_sh, buffer):
        """The lane's chunks of keys base + u * KPP + gid (u < UNROLL_KEYS; clamped into the round)."""
        for u in range(UNROLL_KEYS):
            key = min(base + u * KPP + gid, n - 1)
            for ci in range(CPL):
                load_vector(cache, (page_sh[key], offset_sh[key], h, (lane + ci * L) * E), buffer,
                            (u * CPL + ci) * VECTOR_WORDS)

    @cuda.jit(device=True, inline=True)
    def attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
               request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale,
               s_sh, page_sh, offset_sh, state_sh, part_sh, scratch):
        """Leave the tile's normalised output of head g, element d in ``part_sh[0, g, d]`` and its
        (max, sum) in ``state_sh[0, g]``, ``state_sh[1, g]``. Returns (row, chunk index, chunks of
        the row); row -1: nothing to do (uniform per block, decided before any barrier)."""
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
        lane = tid % L
        gid = tid // L
        q_lane = cuda.local.array(ACC, float32)
        acc = cuda.local.array(ACC, float32)
        key_f = cuda.local.array(LANE_ELEMENTS, float32)
        buffer = cuda.local.array(BUFFER_WORDS, words)
        for g in range(G):
            for ci in range(CPL):
                for e in range(E):
                    q_lane[(g * CPL + ci) * E + e] = load(q[row, h * G + g, (lane + ci * L) * E + e]) * scale
                    acc[(g * CPL + ci) * E + e] = float32(0.0)
        if tid < G:
            state_sh[0, tid] = NEG_INF
            state_sh[1, tid] = float32(0.0)

        for r0 in range(k0, k1, SUB):
            n = min(SUB, k1 - r0)
            stage_pages(page_indices, page_base, page_size, r0, n, page_sh, offset_sh, tid)
            cuda.syncthreads()
            # Scores: every thread runs the same trips (the simulator's reductions have barriers).
            for base in range(0, n, KPP * UNROLL_KEYS):
                load_rows(k_cache, h, base, n, gid, lane, page_sh, offset_sh, buffer)
                for u in range(UNROLL_KEYS):
                    for i in range(LANE_ELEMENTS):
                        key_f[i] = load(get_lane(buffer, u * LANE_ELEMENTS + i))
                    key = base + u * KPP + gid
                    for g in range(G):
                        dot = float32(0.0)
                        for i in range(LANE_ELEMENTS):
                            dot += q_lane[g * LANE_ELEMENTS + i] * key_f[i]
                        dot = group_sum(scratch, dot, L)
                        if lane == 0 and key < n:
                            s_sh[g, key] = dot
            cuda.syncthreads()
            # Fold the round into each head's running (max, sum); scores become exp(s - max).
            for g0 in range(0, G, HPP):
                g = g0 + tid // W
                wl = tid % W
                top = NEG_INF
                if g < G:
                    for kk in range(wl, n, W):
                        top = max(top, s_sh[g, kk])
                top = group_max(scratch, top, W)
                old = state_sh[0, g] if g < G else NEG_INF
                new = max(old, top)
                total = float32(0.0)
                if g < G:
                    for kk in range(wl, n, W):
                        p = float32(math.exp(s_sh[g, kk] - new))
                        s_sh[g, kk] = p
                        total += p
                total = group_sum(scratch, total, W)
                if g < G and wl == 0:
                    alpha = float32(math.exp(old - new)) if old > NEG_INF else float32(0.0)
                    state_sh[0, g] = new
                    state_sh[1, g] = state_sh[1, g] * alpha + total
                    state_sh[2, g] = alpha
            cuda.syncthreads()
            # P @ V for the round.
            for g in range(G):
                alpha = state_sh[2, g]
                for i in range(LANE_ELEMENTS):
                    acc[g * LANE_ELEMENTS + i] *= alpha
            for base in range(0, n, KPP * UNROLL_KEYS):
                load_rows(v_cache, h, base, n, gid, lane, page_sh, offset_sh, buffer)
                for u in range(UNROLL_KEYS):
                    key = base + u * KPP + gid
                    if key < n:
                        for i in range(LANE_ELEMENTS):
                            key_f[i] = load(get_lane(buffer, u * LANE_ELEMENTS + i))
                        for g in range(G):
                            p = s_sh[g, key]
                            for i in range(LANE_ELEMENTS):
                                acc[g * LANE_ELEMENTS + i] += p * key_f[i]
            cuda.syncthreads()  # the next round restages pages and rewrites scores

        # The groups' partial outputs meet in shared memory; each element is then one thread's.
        for g in range(G):
            for ci in range(CPL):
                for e in range(E):
                    part_sh[gid, g, (lane + ci * L) * E + e] = acc[(g * CPL + ci) * E + e]
        cuda.syncthreads()
        for j in range(tid, G * D, NT):
            g = j // D
            d = j - g * D
            total = float32(0.0)
            for k in range(KPP):
                total += part_sh[k, g, d]
            part_sh[0, g, d] = total / state_sh[1, g]
        cuda.syncthreads()
        return row, c, last // chunk + 1

    @cuda.jit
    def direct_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                      request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale):
        s_sh = cuda.shared.array((G, SUB), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        state_sh = cuda.shared.array((3, G), float32)
        part_sh = cuda.shared.array((KPP, G, D), float32)
        scratch = cuda.shared.array(NT, float32)  # the simulator's group reductions
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, s_sh, page_sh, offset_sh, state_sh, part_sh, scratch)
        if row < 0:
            return
        h = cuda.blockIdx.y
        for j in range(cuda.threadIdx.x, G * D, NT):
            g = j // D
            d = j - g * D
            out[row, h * G + g, d] = store(part_sh[0, g, d])

    @cuda.jit
    def split_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                     request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, partial_out,
                     partial_lse, scale):
        s_sh = cuda.shared.array((G, SUB), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        state_sh = cuda.shared.array((3, G), float32)
        part_sh = cuda.shared.array((KPP, G, D), float32)
        scratch = cuda.shared.array(NT, float32)
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, s_sh, page_sh, offset_sh, state_sh, part_sh, scratch)
        if row < 0:
            return
        h = cuda.blockIdx.y
        for j in range(cuda.threadIdx.x, G * D, NT):
            g = j // D
            d = j - g * D
            head = h * G + g
            if num_chunks == 1:
                out[row, head, d] = store(part_sh[0, g, d])
            elif c < partial_out.shape[1]:
                partial_out[row, c, head, d] = part_sh[0, g, d]
                if d == 0:
                    partial_lse[row, c, head] = state_sh[0, g] + math.log(state_sh[1, g])

    return direct_kernel, split_kernel


class DecodeAttention:
    """Launcher for decode attention (one query row per request), built once per codec and head shape.

    Same arguments as ``PagedAttention.__call__`` (rows_per_tile 1). ``fallback`` is the step's
    general attention launcher: it runs calls this kernel cannot (unaligned cache rows, a row that
    no power-of-two lane group splits evenly), and its merge kernel combines split tiles.
    """

    def __init__(self, codec: Codec, head_dim: int, group_size: int, fallback: PagedAttention, *,
                 threads: int | None = None, round_keys: int = ROUND_KEYS):
        self.head_dim, self.group_size, self.fallback = head_dim, group_size, fallback
        self.threads = threads or (32 if simulator_enabled() else 128)
        self.kernels: tuple[Kernel, Kernel] | None = None
        lanes = key_lanes(codec, head_dim)
        if lanes is not None and self.threads % lanes == 0:
            needed = shared_bytes(codec, head_dim, group_size, self.threads, round_keys)
            if needed > SHARED_LIMIT_BYTES:
                raise ValueError(f"decode attention: D={head_dim}, G={group_size}, {self.threads} threads, "
                                 f"rounds of {round_keys} keys need {needed} bytes of shared memory, "
                                 f"limit {SHARED_LIMIT_BYTES}")
            direct, split = build_decode_attention(codec, head_dim, group_size, self.threads, round_keys)
            self.kernels = (Kernel(direct), Kernel(split))

    def uses_vector(self, k_cache: Any, v_cache: Any) -> bool:
        """Whether a call with these caches runs this module's kernel (else the fallback's)."""
        return self.kernels is not None and vector_aligned(k_cache, v_cache)

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
        if not self.uses_vector(k_cache, v_cache):
            self.fallback(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, batch_indices,
                          positions, request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size,
                          total_num_rows, out, scale, partial_out, partial_lse, stream=stream)
            return
        num_rows, num_q_heads, num_kv_heads = check_heads("decode_attention", out, k_cache, self.head_dim,
                                                          self.group_size)
        num_tiles = request_indices.shape[0]
        if num_tiles == 0 or num_rows == 0:
            return
        direct, split = self.kernels
        grid, scale32 = (num_tiles, num_kv_heads), np.float32(scale)
        meta = (page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices,
                kv_chunk_size, total_num_rows)
        if partial_out is None:
            direct[grid, self.threads, stream](q, k_cache, v_cache, *meta, out, scale32)
            return
        split[grid, self.threads, stream](q, k_cache, v_cache, *meta, out, partial_out, partial_lse, scale32)
        self.fallback.merge[(num_rows, num_q_heads), threads_for(self.head_dim), stream](
            partial_out, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out
        )
