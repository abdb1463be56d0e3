"""q/k per-head RMSNorm + NeoX RoPE in place, fused with the paged KV cache write of k and v.

Unfused, a full-attention layer launches ``qk_norm_rope`` on q, again on k, then ``write_kv``
(rows/kv_cache.py). At decode those are latency-bound launches: on the H200, Qwen3-8B at batch 1
spends about 5.0 us in each qk_norm_rope and 2.3 us in write_kv per layer. This kernel does
all three in one launch, and reads k once instead of twice:

    q[t, h]      <- rope(rms_norm(q[t, h]) * (weight_offset + q_weight))     in place
    k[t, h]      <- rope(rms_norm(k[t, h]) * (weight_offset + k_weight))     in place
    k_cache[page, slot, h] <- the new k[t, h];   v_cache[page, slot, h] <- v[t, h]

with (page, slot) of row t from ``kv_cache.cache_slot`` (as write_kv). The results are bit-identical
to the three separate launches (qk_norm_rope.py's vector kernel on q, then on k, then write_kv; from
256 rows its launcher takes the specialized kernel, which sums squares in the same order): the q and
k heads run qk_norm_rope.py's very device functions (``build_vector_head``) with the same threads
per head, so the same sum-of-squares order and roundings; the cache receives the chunks stored into
k and the bits of v.

Layout: grid (rows, head blocks); block (t, y) takes row t (grid-stride over rows) and the walk
heads y * groups .. of 0 .. Hq + 2 Hkv - 1 (q heads, k heads, then v heads), one head a group of
``group_threads`` threads, striding by the grid's head blocks. The launcher (``fused_launch``) gives
a block FUSED_BLOCK_THREADS threads and a row enough blocks that every head has its group in one
round (Qwen3-8B: 6 blocks of 8 heads x 8 threads; Qwen3.5-9B: 12 of 2 x 32). Each block computes the
row's cos/sin into shared memory (qk_norm_rope.py's store_inv_freq and store_cos_sin, in
block_setup's layout), once for its q and k heads alike. Barriers per row on the GPU: one after
cos/sin, plus one at the row's end only when the block has another row (never with the launcher's
grid); the group reductions are warp shuffles.

At decode a warp of this kernel has an SM scheduler to itself, so it takes about as long as the
dependent latencies of its instructions and loads (ncu on the H200, Qwen3-8B batch 1: 12 warps
issuing about 1,200-1,450 instructions each at about 7 cycles apiece; docs/benchmarks.md, "Decode
attention instructions"). Hence the order inside a row: a thread issues its head's chunk loads and
its norm weight chunks (qk_norm_rope.py's ``touch_weights``: into L1 for pass 2) first, computes the
row's cos/sin while they are in flight, and, for k and v heads only, looks up the cache slot
(``kv_cache.cache_slot``'s two dependent loads) after the barrier, while the reduction runs. A v
thread holds its head's chunks in registers from the start (up to two a thread) and stores them once
the slot is known. Strided loops are while loops: a strided ``range`` computes its trip count with a
64-bit division.

Decode steps of full-rotary bf16 heads that the tensor-core decode kernel serves (Qwen3) do this
work inside that kernel instead (decode_prologue.py, through attention/decode_rope.py), with this
kernel's device functions and bits; prefill steps and the other heads launch this kernel.

The launcher runs this kernel when every array is 16-byte vector aligned and rotary_dim / 2
is a whole number of chunks (``uses_vector``); otherwise it makes the three separate
launches, which give the same results.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.rows.kv_cache import WriteKv
from executor.kernels.primitives.launch import Kernel
from executor.kernels.rows.norm import inv_rms_from_sum
from executor.kernels.primitives.reduce import build_group_sum, check_max_threads
from executor.kernels.rope.qk_norm_rope import (
    QkNormRopeInplace,
    build_vector_head,
    check_rotary_dim,
    check_shape,
    store_inv_freq,
    vector_shared_bytes,
)
from executor.kernels.rope.layout import MAX_THREADS as ROPE_MAX_THREADS
from executor.kernels.rope.layout import vector_group_threads
from executor.kernels.primitives.vector import VECTOR_WORDS, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled
from executor.routing import FUSED_ROPE_KV_MAX_ROWS

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

# Largest block a caller may ask for, and the GPU build's launch bound: 512 threads x at most 128
# registers fit an SM's 64K (ptxas gives a one-block-a-row build 98-111 registers; the H200's
# ptxas gives this one 64). The launcher's blocks are FUSED_BLOCK_THREADS.
MAX_FUSED_THREADS = 512

# A block's threads on the GPU: a row's heads spread over several small blocks (Qwen3-8B: 6 of 8
# heads, Qwen3.5-9B: 12 of 2), so a one-row decode call runs on as many SMs, each issuing a few
# warps' instructions, where one block of 384 threads issues all 12 warps' on one SM. With the
# loads in the order the module docstring gives, Qwen3-8B's batch-1 call takes 5.6-5.8 us in
# bench/profile_decode.py on the H200, against 6.4-6.5 with one block of 384 threads a row.
FUSED_BLOCK_THREADS = 64



def build_qk_norm_rope_write_kv_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], q_weight [D], k_weight [D], positions int32 [T],
    eps f32, weight_offset f32, rotary_dim int32, theta f32, group_threads int32,
    k_cache [pages,S,Hkv,D], v_cache [pages,S,Hkv,D], batch_indices int32 [T], page_indices int32 [P],
    page_indptr int32 [B+1])``; q, k in place, this step's K/V rows into the caches. Storage per codec.

    Every chunk of every array must be 16-byte aligned and rotary_dim / 2 a whole number of
    chunks (the launcher checks). blockDim.x is a multiple of group_threads (a power of two
    <= 32, layout.vector_group_threads for bit-identity with qk_norm_rope.py's vector kernel) and of 32
    on the GPU. Launch with ``qk_norm_rope.vector_shared_bytes(blockDim.x, rotary_dim)`` bytes of dynamic
    shared memory, on any grid: x strides over rows, y over rounds of blockDim.x / group_threads
    heads (``fused_launch`` sizes y to one round a block).
    """
    load_vector, store_vector = build_vector_access()

    @cuda.jit(device=True, inline=True)
    def put_k_chunk(k, t, h, col, words, k_cache, page, slot):
        # In place, as qk_norm_rope on k does, and into the cache slot, as write_kv then copies it.
        store_vector(k, (t, h, col), words, 0)
        store_vector(k_cache, (page, slot, h, col), words, 0)

    head = build_vector_head(codec, round_before_weight)
    store_cos_sin, head_squares, q_norm_rope = head.store_cos_sin, head.head_squares, head.head_norm_rope
    unit_load, unit_squares, touch_weights = head.unit_load, head.unit_squares, head.touch_weights
    k_norm_rope = build_vector_head(codec, round_before_weight, put_k_chunk).head_norm_rope
    group_sum = build_group_sum()
    lanes = lanes_for(codec)
    words = word_type(codec)

    launch_options = launch_bounds(MAX_FUSED_THREADS)

    @cuda.jit(**launch_options)
    def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, eps, weight_offset, rotary_dim, theta,
                              group_threads, k_cache, v_cache, batch_indices, page_indices, page_indptr):
        shared = cuda.shared.array(0, float32)  # dynamic: see norm.py
        lo = cuda.local.array(VECTOR_WORDS, words)  # a pair unit's first-half chunk, a pass-through or v chunk
        hi = cuda.local.array(VECTOR_WORDS, words)  # a pair unit's second-half chunk, or a second v chunk
        w_lo = cuda.local.array(VECTOR_WORDS, words)
        w_hi = cuda.local.array(VECTOR_WORDS, words)
        rows = q.shape[0]
        q_heads = q.shape[1]
        head_dim = q.shape[2]
        norm_heads = q_heads + k.shape[1]
        walk_heads = norm_heads + v.shape[1]  # q heads, k heads, then v heads (copied)
        v_chunks = head_dim // lanes
        page_size = int32(k_cache.shape[1])  # the positions' type
        half = rotary_dim // 2
        pairs = half // lanes
        units = pairs + (head_dim - rotary_dim) // lanes
        one_unit = units <= group_threads
        lane = cuda.threadIdx.x % group_threads
        groups = cuda.blockDim.x // group_threads
        v_in_registers = v_chunks <= 2 * group_threads  # a v thread's chunks fit lo and hi
        inv_freq_at = cuda.blockDim.x  # block_setup's layout: after the reduction scratch
        cos_at = inv_freq_at + half
        sin_at = cos_at + half
        first_round = cuda.blockIdx.y * groups
        # Strided loops are while loops: a strided range() divides (64-bit) for its trip count, and a
        # warp here runs alone on its scheduler, so it pays every instruction's latency.
        t = cuda.blockIdx.x
        while t < rows:
            # Latency, not bandwidth, bounds a decode step's call: every load that does not depend on
            # another goes out first (the row's metadata, this thread's head and norm weight chunks),
            # and the cache slot's dependent lookups overlap the cos/sin and the reduction.
            b = batch_indices[t]
            position = positions[t]
            base = 0
            page = 0
            slot = 0
            # blockIdx.y's head slice; every thread runs every round (group_sum needs the whole block / warp).
            first_head = first_round
            while first_head < walk_heads:
                h = first_head + cuda.threadIdx.x // group_threads
                partial = float32(0.0)
                if h < q_heads:
                    touch_weights(q_weight, lane, half, pairs, units, w_lo, w_hi)
                    if one_unit:
                        if lane < units:
                            unit_load(q, t, h, lane, half, pairs, lo, hi)
                    else:
                        partial = head_squares(q, t, h, lane, group_threads, half, pairs, units, lo, hi)
                elif h < norm_heads:
                    touch_weights(k_weight, lane, half, pairs, units, w_lo, w_hi)
                    if one_unit:
                        if lane < units:
                            unit_load(k, t, h - q_heads, lane, half, pairs, lo, hi)
                    else:
                        partial = head_squares(k, t, h - q_heads, lane, group_threads, half, pairs, units, lo, hi)
                elif h < walk_heads and v_in_registers:
                    if lane < v_chunks:
                        load_vector(v, (t, h - norm_heads, lane * lanes), lo, 0)
                    if lane + group_threads < v_chunks:
                        load_vector(v, (t, h - norm_heads, (lane + group_threads) * lanes), hi, 0)
                if first_head == first_round:  # the row's first round (uniform)
                    # The powers and sincos run while this thread's loads are in flight (each thread
                    # reads back only the inv_freq entries it wrote: no barrier between the two).
                    store_inv_freq(shared, inv_freq_at, half, rotary_dim, theta)
                    store_cos_sin(shared, inv_freq_at, cos_at, sin_at, half, float32(position))
                    cuda.syncthreads()
                if h >= q_heads:  # k and v heads write the cache: kv_cache.cache_slot's lookups
                    base = page_indptr[b]
                if one_unit and h < norm_heads and lane < units:
                    partial += unit_squares(lane, pairs, lo, hi)
                inv_rms = inv_rms_from_sum(group_sum(shared, partial, group_threads), head_dim, eps)
                if h >= q_heads:
                    logical = position // page_size
                    page = page_indices[base + logical]
                    slot = position - logical * page_size
                if h < q_heads:
                    # q has no cache: q_norm_rope's put_chunk ignores the (q, 0, 0) passed as cache, page, slot.
                    q_norm_rope(q, q_weight, t, h, lane, group_threads, half, pairs, units, one_unit, inv_rms,
                                weight_offset, shared, cos_at, sin_at, lo, hi, w_lo, w_hi, q, 0, 0)
                elif h < norm_heads:
                    k_norm_rope(k, k_weight, t, h - q_heads, lane, group_threads, half, pairs, units, one_unit,
                                inv_rms, weight_offset, shared, cos_at, sin_at, lo, hi, w_lo, w_hi, k_cache, page,
                                slot)
                elif h < walk_heads:  # a v head: a plain copy
                    if v_in_registers:
                        if lane < v_chunks:
                            store_vector(v_cache, (page, slot, h - norm_heads, lane * lanes), lo, 0)
                        if lane + group_threads < v_chunks:
                            store_vector(v_cache, (page, slot, h - norm_heads, (lane + group_threads) * lanes), hi, 0)
                    else:
                        chunk = lane
                        while chunk < v_chunks:
                            load_vector(v, (t, h - norm_heads, chunk * lanes), lo, 0)
                            store_vector(v_cache, (page, slot, h - norm_heads, chunk * lanes), lo, 0)
                            chunk += group_threads
                first_head += cuda.gridDim.y * groups
            if t + cuda.gridDim.x < rows:  # the same for the whole block
                cuda.syncthreads()  # every head has read this row's cos/sin before the next row's overwrite them
            t += cuda.gridDim.x

    return qk_norm_rope_write_kv


def fused_launch(group_threads: int, walk_heads: int, max_threads: int) -> tuple[int, int]:
    """``(threads, head_blocks)``: blocks of ``group_threads`` per head, whole warps on the GPU (the
    shuffles need them), at most FUSED_BLOCK_THREADS (and ``max_threads``); ``head_blocks`` blocks a
    row cover its ``walk_heads`` q, k and v heads in one round each."""
    granule = group_threads if simulator_enabled() else max(group_threads, 32)
    limit = min(max_threads, FUSED_BLOCK_THREADS)
    wanted = -(-group_threads * walk_heads // granule) * granule
    threads = max(granule, min(wanted, limit // granule * granule))
    heads_per_block = threads // group_threads
    return threads, -(-walk_heads // heads_per_block)


class QkNormRopeWriteKv:
    """Launcher: per-head RMSNorm + partial NeoX RoPE in place on q and k, then this step's k (as
    normed and rotated) and v rows into the paged KV cache, in one launch (module docstring).

    Arrays, in the codec's storage dtype (float32, or bf16 viewed as int16) unless said:
    q [T, Hq, D] (possibly strided, e.g. Qwen3.5's q of a per-head [q | gate] buffer),
    k, v [T, Hkv, D] (views of the fused qkv output), q_weight, k_weight [D],
    positions, batch_indices int32 [T], k_cache, v_cache [pages, S, Hkv, D] (a layer's
    strided views of the pool), page_indices int32 [P], page_indptr int32 [B + 1].
    Scalars: eps, weight_offset, theta (passed as float32), rotary_dim (even, in [2, D]).
    T is q.shape[0]: padding rows of a graph slot point at the reserved page 0.

    The fused kernel needs every array 16-byte vector aligned and rotary_dim / 2 a whole
    number of chunks (``uses_vector``); otherwise, or with ``vectorize=False``, the call makes
    the separate launches (``qk_norm_rope`` on q, then on k, then ``write_kv``) with the same
    results.
    """

    def __init__(
        self, codec: Codec, round_before_weight: bool, max_threads: int = MAX_FUSED_THREADS, vectorize: bool = True
    ) -> None:
        self.max_threads = check_max_threads(max_threads, MAX_FUSED_THREADS)
        self.qk_norm_rope = QkNormRopeInplace(codec, round_before_weight, min(max_threads, ROPE_MAX_THREADS),
                                              vectorize=vectorize)
        self.write_kv = WriteKv()
        self.kernel = Kernel(build_qk_norm_rope_write_kv_kernel(codec, round_before_weight)) if vectorize else None
        self.lanes = lanes_for(codec)

    @staticmethod
    def separate(rows: int) -> bool:
        """Whether a call of ``rows`` rows makes the separate launches whatever its arrays
        (routing.FUSED_ROPE_KV_MAX_ROWS): then its q/k norm + RoPE (``norm_rope``) depends on its rows
        alone and may run apart from the KV write (``write_kv``), as a prefill graph piece does."""
        return rows > FUSED_ROPE_KV_MAX_ROWS

    def norm_rope(self, q: Any, k: Any, q_weight: Any, k_weight: Any, positions: Any, eps: float,
                  weight_offset: float, rotary_dim: int, theta: float, stream: Any = 0) -> None:
        """The separate launches' q/k norm + RoPE, in place (the KV write not included)."""
        for x, weight in ((q, q_weight), (k, k_weight)):
            self.qk_norm_rope(x, weight, positions, eps, weight_offset, rotary_dim, theta, stream=stream)

    def uses_vector(self, q: Any, k: Any, v: Any, q_weight: Any, k_weight: Any, k_cache: Any, v_cache: Any,
                    rotary_dim: int) -> bool:
        """Whether a call with these arrays and rotary_dim runs the fused kernel."""
        return (
            self.kernel is not None
            and (rotary_dim // 2) % self.lanes == 0
            and vector_aligned(q, k, v, q_weight, k_weight, k_cache, v_cache)
        )

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        q_weight: Any,
        k_weight: Any,
        positions: Any,
        eps: float,
        weight_offset: float,
        rotary_dim: int,
        theta: float,
        k_cache: Any,
        v_cache: Any,
        batch_indices: Any,
        page_indices: Any,
        page_indptr: Any,
        stream: Any = 0,
    ) -> None:
        rows, q_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        check_shape("k", k, (rows, kv_heads, head_dim))
        check_shape("v", v, (rows, kv_heads, head_dim))
        check_shape("q_weight", q_weight, (head_dim,))
        check_shape("k_weight", k_weight, (head_dim,))
        check_shape("positions", positions, (rows,))
        check_shape("batch_indices", batch_indices, (rows,))
        if len(k_cache.shape) != 4:
            raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}, expected [pages, S, {kv_heads}, {head_dim}]")
        check_shape("k_cache", k_cache, (*tuple(k_cache.shape[:2]), kv_heads, head_dim))
        check_shape("v_cache", v_cache, tuple(k_cache.shape))
        for name, a in (("page_indices", page_indices), ("page_indptr", page_indptr)):
            if len(a.shape) != 1:
                raise ValueError(f"{name} has shape {tuple(a.shape)}, expected one axis")
        check_rotary_dim(rotary_dim, head_dim)
        if rows == 0:
            return
        if self.separate(rows) or not self.uses_vector(q, k, v, q_weight, k_weight, k_cache, v_cache, rotary_dim):
            self.norm_rope(q, k, q_weight, k_weight, positions, eps, weight_offset, rotary_dim, theta, stream=stream)
            self.write_kv(k, v, k_cache, v_cache, batch_indices, positions, page_indices, page_indptr, stream=stream)
            return
        group = vector_group_threads(head_dim, rotary_dim, self.lanes)
        threads, head_blocks = fused_launch(group, q_heads + 2 * kv_heads, self.max_threads)
        self.kernel[(rows, head_blocks), threads, stream, vector_shared_bytes(threads, rotary_dim)](
            q,
            k,
            v,
            q_weight,
            k_weight,
            positions,
            np.float32(eps),
            np.float32(weight_offset),
            np.int32(rotary_dim),
            np.float32(theta),
            np.int32(group),
            k_cache,
            v_cache,
            batch_indices,
            page_indices,
            page_indptr,
        )
