"""Paged attention for decode steps: one query row per request, bound by reading the KV cache.

A decode step reads every cached key and value once and does a few FLOPs per
byte, so the kernel is built around keeping K/V bytes in flight. It serves the
decode pool only, with the paged kernel's metadata and tile scheme
(executor/tiles.py's ``plan_tiles``: tile = request ``b`` and kv chunk ``c``;
split tiles write partials that merge.py's ``merge_kernel`` combines).

- Block (tile, kv head h), ``NT`` threads. A K/V row of D elements is
  ``D / E`` 16-byte chunks (E = 8 bf16 or 4 float32); a group of ``L`` lanes
  owns one key at a time, lane ``l`` its chunk(s) ``l, l + L, ...``, so a group
  reads a whole row with one 16-byte load per lane (primitives/vector.py).
- q stays in registers: each lane holds its chunks' q elements of the
  G = Hq / Hkv heads that share h, scaled once by D^-0.5 log2(e) (scores in log2
  units: every exponent is one exp2). A score is the lane's partial dot, summed
  over the group with xor shuffles, so every lane of the group holds it.
- Online softmax per lane group ("streaming"): a group takes keys gid, gid +
  KPP, ... (KPP = NT / L groups), ``UNROLL_KEYS`` at a time, and issues the K
  *and* V loads of those keys together before using any; it keeps its own
  running (max, sum) per head and its output elements in registers, and never
  waits for another group. The groups meet once, at the end, in shared memory.
  Page ids come through shared memory in rounds of ``ROUND_KEYS`` keys (one
  runtime division per key, not per lane; two barriers a round).
- Residency: the kernel wants about 160 registers a thread; held to 128 by
  ``launch_bounds`` (NT threads, 4 blocks an SM) where q and the output take
  at most 64 of them, ptxas spills nothing and an SM keeps 16 warps.

On the H200 (Qwen3-8B heads, bench-shaped calls in a CUDA graph;
docs/benchmarks.md, "CUDA-core decode attention"): 64 requests x 4096 tokens
347 us (3.09 TB/s), 32 x 4096 184 us, batch 1 at 4096 tokens 20 us and at 512
tokens 12.2 us, where a round-based kernel that keeps a round's scores in shared
memory and loads V only after a block-wide softmax takes 390, 206, 22 and 12.9.
Without the register cap the streaming kernel runs at 164 registers and takes
496 us; capping harder (5 or 6 blocks an SM) spills and is slower.

``DecodeAttention`` runs bf16 heads of at most 128 on tensor cores instead
(decode_mma.py), in four-warp blocks for calls of up to two (row,
kv head) pairs an SM (the batch-1 and small-batch steps: 11.7 / 18.6 us at
batch 1, 512 / 4096 tokens split, and 154 us at 32 x 4096, against this
kernel's 12.3 / 19.9 and 264) and in two-warp blocks past that (304 us at 64 x
4096 against 344; docs/benchmarks.md, "Decode attention kernel shapes"). This
kernel keeps float32 caches and the wider heads (Qwen3.5's 256).

The launcher falls back to paged.py's general kernel (which handles one
row per request too) when the cache rows are not whole, aligned 16-byte chunks
or the group would not be a power of two lanes. The simulator runs the same
kernel: its vector accesses and reductions are emulated (primitives/vector.py,
primitives/reduce.py).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from executor.kernels.attention.paged import NEG_INF, PagedAttention, build_kv_staging, check_heads
from executor.kernels.primitives.codec import Codec
from executor.routing import FEW_BLOCKS_PER_SM
from executor.kernels.attention.decode_mma import (MmaShape, build_decode_attention_mma,
                                                  default_mma_shapes)
from executor.kernels.attention.decode_tiles import LOG2_E, build_meet, build_tile_span
from executor.kernels.primitives.launch import SHARED_LIMIT_BYTES, WARP_THREADS, Kernel
from executor.kernels.primitives.reduce import build_group_sum
from executor.kernels.primitives.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

ROUND_KEYS = 256  # keys whose page ids a round stages in shared memory
UNROLL_KEYS = 4  # keys each lane group loads before using them: 4 x 2 x 16 bytes (K and V) in flight per lane
MIN_BLOCKS_PER_SM = 4  # launch_bounds: 128 registers a thread at 128 threads
CAPPED_REGISTER_VALUES = 64  # q and output registers a lane may hold for the cap to spill nothing


def key_lanes(codec: Codec, head_dim: int) -> int | None:
    """Lanes that read one K/V row together (a power of two <= 32), or None when the row is not a
    whole number of 16-byte chunks that such a group can split evenly."""
    elements = lanes_for(codec)
    chunks = head_dim // elements
    if head_dim % elements or chunks & (chunks - 1):
        return None
    return min(chunks, WARP_THREADS)


def shared_bytes(codec: Codec, head_dim: int, group_size: int, threads: int, round_keys: int) -> int:
    """Static shared memory of one block: the round's page ids and offsets, the groups' (max, sum)
    and partial outputs and the simulator's reduction scratch (4-byte words)."""
    groups = threads // key_lanes(codec, head_dim)
    words = 2 * round_keys + 2 * groups * group_size + groups * group_size * head_dim + threads
    return 4 * words


def min_blocks_per_sm(codec: Codec, head_dim: int, group_size: int) -> int | None:
    """The launch bound's blocks per SM: MIN_BLOCKS_PER_SM where a lane's q and output elements fit
    CAPPED_REGISTER_VALUES registers (the measured shapes), else None (no cap: it would spill)."""
    lane_elements = head_dim // key_lanes(codec, head_dim)
    return MIN_BLOCKS_PER_SM if 2 * group_size * lane_elements <= CAPPED_REGISTER_VALUES else None


def build_decode_attention(codec: Codec, head_dim: int, group_size: int, threads: int,
                           round_keys: int = ROUND_KEYS, blocks_per_sm: int | None = None,
                           unroll_keys: int = UNROLL_KEYS) -> tuple[Any, Any]:
    """(direct kernel, split kernel) for one codec and head shape; D, G and NT size registers and shared memory.
    ``blocks_per_sm``: the launch bound (None: none); ``unroll_keys``: keys a lane group loads before
    using any.

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
    LANE_ELEMENTS = CPL * E  # elements of a row a lane owns
    ACC = G * LANE_ELEMENTS  # q and accumulator registers per lane (constant extents)
    U = unroll_keys
    BUFFER_WORDS = U * CPL * VECTOR_WORDS
    SCORES = U * G  # a batch's scores, one per key and head
    GROUP_STATES = KPP * G  # (max, sum) of every lane group and head, where the groups meet
    # On the GPU the launch bound caps registers for residency.
    launch_options = launch_bounds(None if blocks_per_sm is None else (NT, blocks_per_sm))
    stage_pages = build_kv_staging(load, D, NT)[0]
    group_sum = build_group_sum()
    tile_span = build_tile_span()
    meet_out, meet_split = build_meet(G, D, NT, KPP, store)

    @cuda.jit(device=True, inline=True)
    def load_rows(cache, h, base, n, gid, lane, page_sh, offset_sh, buffer):
        """The lane's chunks of keys base + u * KPP + gid (u < U; clamped into the round)."""
        for u in range(U):
            key = min(base + u * KPP + gid, n - 1)
            for ci in range(CPL):
                load_vector(cache, (page_sh[key], offset_sh[key], h, (lane + ci * L) * E), buffer,
                            (u * CPL + ci) * VECTOR_WORDS)

    @cuda.jit(device=True, inline=True)
    def attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
               request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale,
               s_sh, page_sh, offset_sh, part_sh, scratch):
        """Leave lane group k's (max, sum) of head g in s_sh[0 / 1, k G + g] and its output in
        part_sh[k, g], behind a barrier, for decode_tiles.py's meet. Returns (row,
        chunk index, chunks of the row); row -1: nothing to do (uniform per block, decided before
        any barrier). Scores are in log2 units inside (q scaled by scale * log2(e)): every
        exponent is one exp2."""
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        page_size = k_cache.shape[1]
        row, c, k0, k1, page_base, num_chunks, _ = tile_span(
            cuda.blockIdx.x, page_size, page_indptr, last_page_len, q_indptr, positions, request_indices,
            kv_tile_indices, kv_chunk_size, total_num_rows)
        if row < 0:
            return -1, 0, 0
        lane = tid % L
        gid = tid // L
        q_lane = cuda.local.array(ACC, float32)
        acc = cuda.local.array(ACC, float32)
        row_f = cuda.local.array(LANE_ELEMENTS, float32)
        k_buffer = cuda.local.array(BUFFER_WORDS, words)
        v_buffer = cuda.local.array(BUFFER_WORDS, words)
        scores = cuda.local.array(SCORES, float32)
        # The group's running maximum (finite start: a group with no key yet keeps alpha = 1) and sum.
        top = cuda.local.array(G, float32)
        total = cuda.local.array(G, float32)
        q_scale = scale * float32(LOG2_E)
        for g in range(G):
            top[g] = float32(-1e30)
            total[g] = float32(0.0)
            for ci in range(CPL):
                for e in range(E):
                    q_lane[(g * CPL + ci) * E + e] = load(q[row, h * G + g, (lane + ci * L) * E + e]) * q_scale
                    acc[(g * CPL + ci) * E + e] = float32(0.0)

        for r0 in range(k0, k1, SUB):
            n = min(SUB, k1 - r0)
            cuda.syncthreads()  # every group is done with the last round's pages
            stage_pages(page_indices, page_base, page_size, r0, n, page_sh, offset_sh, tid)
            cuda.syncthreads()
            # Every thread runs the same trips (the simulator's reductions have barriers).
            for base in range(0, n, KPP * U):
                load_rows(k_cache, h, base, n, gid, lane, page_sh, offset_sh, k_buffer)
                load_rows(v_cache, h, base, n, gid, lane, page_sh, offset_sh, v_buffer)
                for u in range(U):
                    for i in range(LANE_ELEMENTS):
                        row_f[i] = load(get_lane(k_buffer, u * LANE_ELEMENTS + i))
                    valid = base + u * KPP + gid < n
                    for g in range(G):
                        dot = float32(0.0)
                        for i in range(LANE_ELEMENTS):
                            dot += q_lane[g * LANE_ELEMENTS + i] * row_f[i]
                        dot = group_sum(scratch, dot, L)
                        scores[u * G + g] = dot if valid else NEG_INF
                for g in range(G):
                    best = top[g]
                    for u in range(U):
                        best = max(best, scores[u * G + g])
                    alpha = float32(math.exp2(top[g] - best))
                    top[g] = best
                    part = float32(0.0)
                    for u in range(U):
                        p = float32(math.exp2(scores[u * G + g] - best))
                        scores[u * G + g] = p
                        part += p
                    total[g] = total[g] * alpha + part
                    for i in range(LANE_ELEMENTS):
                        acc[g * LANE_ELEMENTS + i] *= alpha
                for u in range(U):
                    for i in range(LANE_ELEMENTS):
                        row_f[i] = load(get_lane(v_buffer, u * LANE_ELEMENTS + i))
                    for g in range(G):
                        p = scores[u * G + g]
                        for i in range(LANE_ELEMENTS):
                            acc[g * LANE_ELEMENTS + i] += p * row_f[i]

        # The groups meet: group k's (max, sum) in s_sh[0 / 1, k * G + g], its output in part_sh[k].
        for g in range(G):
            if lane == 0:
                s_sh[0, gid * G + g] = top[g]
                s_sh[1, gid * G + g] = total[g]
            for ci in range(CPL):
                for e in range(E):
                    part_sh[gid, g, (lane + ci * L) * E + e] = acc[(g * CPL + ci) * E + e]
        cuda.syncthreads()
        return row, c, num_chunks

    @cuda.jit(**launch_options)
    def direct_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                      request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale):
        s_sh = cuda.shared.array((2, GROUP_STATES), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        part_sh = cuda.shared.array((KPP, G, D), float32)
        scratch = cuda.shared.array(NT, float32)  # the simulator's group reductions
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, s_sh, page_sh, offset_sh, part_sh, scratch)
        if row >= 0:
            meet_out(s_sh, part_sh, out, row, cuda.blockIdx.y)

    @cuda.jit(**launch_options)
    def split_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                     request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, partial_out,
                     partial_lse, scale):
        s_sh = cuda.shared.array((2, GROUP_STATES), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        part_sh = cuda.shared.array((KPP, G, D), float32)
        scratch = cuda.shared.array(NT, float32)
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, s_sh, page_sh, offset_sh, part_sh, scratch)
        if row >= 0:
            meet_split(s_sh, part_sh, out, partial_out, partial_lse, row, c, num_chunks, cuda.blockIdx.y)

    return direct_kernel, split_kernel


class DecodeAttention:
    """Launcher for decode attention (one query row per request), built once per codec and head shape.

    Same arguments as ``PagedAttention.__call__`` (rows_per_tile 1). ``fallback`` is the step's
    general attention launcher: it runs calls this kernel cannot (unaligned cache rows, a row that
    no power-of-two lane group splits evenly), and its merge kernel combines split tiles.

    The launch configuration defaults to the measured one (module docstring; bench/launch_sweep.py
    sweeps it): ``threads`` a block, ``round_keys`` page ids staged a round, ``unroll_keys`` keys a
    lane group loads before using any, ``blocks_per_sm`` the launch bound ("auto":
    ``min_blocks_per_sm``'s rule, None: no bound).

    bf16 heads that decode_mma.py serves by default (``default_mma_shapes``) run its
    tensor-core kernel instead, in one shape for calls of at most FEW_BLOCKS_PER_SM x ``num_sms``
    (row, kv head) pairs, which a decode step splits into kv chunks up to that many blocks
    (step.decode_kv_chunk, one wave), and in another for larger calls (without ``num_sms``: the
    first throughout); ``mma_shape`` runs one shape throughout, ``tensor_cores=False`` none (the
    CUDA-core kernel). ``blocks_per_sm`` an int is then that kernel's launch bound, and ``threads``,
    ``round_keys`` and ``unroll_keys`` do not apply. docs/benchmarks.md has the measurements.
    """

    def __init__(self, codec: Codec, head_dim: int, group_size: int, fallback: PagedAttention, *,
                 threads: int | None = None, round_keys: int = ROUND_KEYS, unroll_keys: int = UNROLL_KEYS,
                 blocks_per_sm: int | None | Literal["auto"] = "auto", num_sms: int | None = None,
                 tensor_cores: bool = True, mma_shape: MmaShape | None = None, page_size: int | None = None):
        self.head_dim, self.group_size, self.fallback = head_dim, group_size, fallback
        self.merge = fallback.merge  # the split rows' merge: one SplitMerge for the step's launchers
        self.page_size = page_size
        self.kernels: tuple[Kernel, Kernel] | None = None
        # Tensor-core (kernels, threads, shape) for calls of few (row, kv head) pairs and for many.
        self.mma_few: tuple[tuple[Kernel, Kernel], int, MmaShape] | None = None
        self.mma_many: tuple[tuple[Kernel, Kernel], int, MmaShape] | None = None
        self.mma_max_pairs: int | None = None  # (row, kv head) pairs of a call in mma_few; None: any
        bf16 = np.dtype(codec.storage_numpy_dtype) == np.int16
        shapes = None
        if tensor_cores and bf16:
            shapes = (mma_shape, mma_shape) if mma_shape else default_mma_shapes(head_dim, group_size)
        self.mma_blocks_per_sm: int | None = None  # the tensor-core kernels' launch bound
        if shapes is not None:
            bound = self.mma_blocks_per_sm = None if blocks_per_sm == "auto" else blocks_per_sm

            def build(shape: MmaShape) -> tuple[tuple[Kernel, Kernel], int, MmaShape]:
                direct, split = build_decode_attention_mma(head_dim, group_size, shape.warps, shape.slots, bound,
                                                           page_size=page_size)
                return (Kernel(direct), Kernel(split)), WARP_THREADS * shape.warps, shape

            few, many = shapes
            self.mma_few = build(few)
            self.mma_many = self.mma_few if many == few else build(many)
            if num_sms is not None:
                self.mma_max_pairs = FEW_BLOCKS_PER_SM * num_sms
            return  # every call of these heads runs on tensor cores
        self.threads = threads or (32 if simulator_enabled() else 128)
        lanes = key_lanes(codec, head_dim)
        if lanes is not None and self.threads % lanes == 0:
            needed = shared_bytes(codec, head_dim, group_size, self.threads, round_keys)
            if needed > SHARED_LIMIT_BYTES:
                raise ValueError(f"decode attention: D={head_dim}, G={group_size}, {self.threads} threads, "
                                 f"rounds of {round_keys} keys need {needed} bytes of shared memory, "
                                 f"limit {SHARED_LIMIT_BYTES}")
            bound = min_blocks_per_sm(codec, head_dim, group_size) if blocks_per_sm == "auto" else blocks_per_sm
            direct, split = build_decode_attention(codec, head_dim, group_size, self.threads, round_keys,
                                                   blocks_per_sm=bound, unroll_keys=unroll_keys)
            self.kernels = (Kernel(direct), Kernel(split))

    def mma_launch(self, num_rows: int, num_kv_heads: int) -> tuple[tuple[Kernel, Kernel], int, MmaShape] | None:
        """(kernels, threads a block, shape) of the tensor-core kernel for a call of ``num_rows`` rows
        over ``num_kv_heads`` kv heads, or None where the CUDA-core kernel runs it."""
        if self.mma_max_pairs is None or num_rows * num_kv_heads <= self.mma_max_pairs:
            return self.mma_few
        return self.mma_many

    def check_page_size(self, k_cache: Any) -> None:
        """The tensor-core kernels were compiled for ``page_size`` tokens a page: a cache of other pages
        is refused (ValueError naming both)."""
        if self.page_size is not None and k_cache.shape[1] != self.page_size:
            raise ValueError(f"decode attention: built for KV pages of {self.page_size} tokens, "
                             f"got a cache of {k_cache.shape[1]}")

    def uses_vector(self, k_cache: Any, v_cache: Any) -> bool:
        """Whether a call with these caches runs this module's kernel (else the fallback's)."""
        return (self.kernels is not None or self.mma_few is not None) and vector_aligned(k_cache, v_cache)

    def __call__(self, q: Any, k_cache: Any, v_cache: Any, page_indices: Any, page_indptr: Any, last_page_len: Any,
                 q_indptr: Any, batch_indices: Any, positions: Any, request_indices: Any, qo_tile_indices: Any,
                 kv_tile_indices: Any, kv_chunk_size: Any, total_num_rows: Any, out: Any, scale: float,
                 partial_out: Any = None, partial_lse: Any = None, stream: Any = 0,
                 shape_rows: int | None = None) -> None:
        """Write the decode rows of ``out [T, Hq, D]``: row ``q_indptr[b]`` for each request b the tiles
        name (a decode step: every request, row b; a prefill step: its one-row chunks' tiles).

        q [T, Hq, D] (strided views allowed), k_cache/v_cache [pages, S, Hkv, D], storage dtype of the
        codec; int32 metadata as for PagedAttention (qo_tile_indices is unused: one row per request).
        Split tiles need float32 ``partial_out [B, splits, Hq, D]`` and ``partial_lse [B, splits, Hq]``;
        a merge launch (B x Hq) then follows. Without them every tile must cover its whole row.
        ``shape_rows``: the rows the tensor-core kernel's block shape is chosen for (default T).
        """
        if not self.uses_vector(k_cache, v_cache):
            self.fallback(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, batch_indices,
                          positions, request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size,
                          total_num_rows, out, scale, partial_out, partial_lse, stream=stream)
            return
        num_rows, _, num_kv_heads = check_heads("decode_attention", out, k_cache, self.head_dim, self.group_size)
        num_tiles = request_indices.shape[0]
        if num_tiles == 0 or num_rows == 0:
            return
        mma = self.mma_launch(num_rows if shape_rows is None else shape_rows, num_kv_heads)
        if mma is not None:  # grid (Hkv, tiles): decode_mma.py
            self.check_page_size(k_cache)
            (direct, split), threads, _ = mma
            grid = (num_kv_heads, num_tiles)
        else:
            (direct, split), threads, grid = self.kernels, self.threads, (num_tiles, num_kv_heads)
        scale32 = np.float32(scale)
        meta = (page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices,
                kv_chunk_size, total_num_rows)
        if partial_out is None:
            direct[grid, threads, stream](q, k_cache, v_cache, *meta, out, scale32)
            return
        split[grid, threads, stream](q, k_cache, v_cache, *meta, out, partial_out, partial_lse, scale32)
        self.merge(partial_out, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows,
                                   out, stream)
