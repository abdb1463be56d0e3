"""Decode attention that does the q/k norm, the RoPE and the KV write itself: one launch, not two.

A full-attention layer's decode step ran ``qk_norm_rope_write_kv`` (qk_rope_kv.py), then decode
attention (decode_attention.py). At batch 1 both are latency-bound: on the H200 the first took
6.4 us of Qwen3-8B's 121 us a layer for 48 rows of 256 bytes. Here the attention kernel's
prologue does its work for the rows it reads:

- every block (tile, kv head h) takes the raw q rows of its G heads, RMS-normalizes and rotates
  them in registers (no store: nothing else reads q), and scales them for the scores;
- the block whose kv chunk holds the row's own position (the last) also normalizes and rotates
  the row's k of head h and writes it, and the row's v, to the cache slot; the key loop's first
  barrier publishes them to the block, and no other block reads that key.

The results are the bits of the two launches (tests hold them to it): a lane of a key-row group
owns 16-byte chunk ``lane``, the rope pair unit u is chunks (u, u + L/2), and the lane loads both
chunks of its unit, so the sum of squares is qk_rope_kv's (unit partial squares(lo) +
squares(hi), then the same xor tree over L/2 lanes) and every element gets rope.py's roundings,
with cos/sin from its formula (``rope_inv_freq``, one table per block in shared memory).

The layout needs full rotary (rotary_dim = head_dim) and a K/V row of at most 32 chunks (one
chunk a lane): Qwen3 (D 128). Other shapes, prefill steps and unaligned arrays take the two
launches (``DecodeRopeAttention.fuses``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from executor.kernels.codec import Codec
from executor.kernels.decode_attention import (
    LOG2_E, DecodeAttention, DecodeParts, build_decode_attention, shared_bytes,
)
from executor.kernels.launch import SHARED_LIMIT_BYTES, Kernel
from executor.kernels.norm import build_normalize, inv_rms_from_sum
from executor.kernels.qk_rope_kv import QkNormRopeWriteKv
from executor.kernels.reduce import build_group_sum
from executor.kernels.rope_layout import rope_inv_freq
from executor.kernels.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)


@dataclass(frozen=True)
class RopeNorm:
    """How the prologue normalizes: NormStyle's rounding (True: Qwen3, norm(x) rounded before the weight)."""

    round_before_weight: bool


def build_rope_kernels(codec: Codec, rope: RopeNorm, parts: DecodeParts) -> tuple[Any, Any]:
    """(direct kernel, split kernel) around decode_attention's parts. Both take
    ``(q [B,Hq,D], k [B,Hkv,D], v [B,Hkv,D], q_weight [D], k_weight [D], eps f32, weight_offset f32,
    theta f32, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
    request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, [partial_out, partial_lse,]
    scale f32)``: decode attention's arguments after the raw q, k, v of the step's rows and the norm
    and rope parameters. Full rotary; one 16-byte chunk of a K/V row a lane (the launcher checks)."""
    load, store = codec.load, codec.store
    normalize = build_normalize(codec, rope.round_before_weight)
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(codec)
    group_sum = build_group_sum()
    words = word_type(codec)
    E = lanes_for(codec)
    D, G, NT, L = parts.head_dim, parts.group_size, parts.threads, parts.lanes
    assert L * E == D and L % 2 == 0, "one chunk a lane, whole pair units"
    HALF, UNITS = D // 2, L // 2  # rope pairs (j, j + HALF); pair unit u = chunks (u, u + UNITS)
    SUB, KPP, GROUP_STATES, ACC = parts.round_keys, parts.groups, parts.groups * G, G * E
    locate, attend, store_direct, store_split = parts.locate, parts.attend, parts.store_direct, parts.store_split

    @cuda.jit(device=True, inline=True)
    def rounded(value):
        return load(store(value))

    @cuda.jit(device=True, inline=True)
    def squares(chunk):
        total = float32(0.0)
        for e in range(E):
            value = load(get_lane(chunk, e))
            total += value * value
        return total

    @cuda.jit(device=True, inline=True)
    def norm_rope_chunk(x, t, head, weight, eps, weight_offset, cos_sh, sin_sh, scratch, lo, hi, w_lo, w_hi, result):
        """Chunk ``lane`` of x[t, head], normalized and rotated, into ``result`` (storage words): qk_rope_kv's
        bits. Every thread of the block calls it (the group sum)."""
        lane = cuda.threadIdx.x % L
        u = lane % UNITS
        load_vector(x, (t, head, u * E), lo, 0)
        load_vector(x, (t, head, (u + UNITS) * E), hi, 0)
        load_vector(weight, (u * E,), w_lo, 0)
        load_vector(weight, ((u + UNITS) * E,), w_hi, 0)
        inv_rms = inv_rms_from_sum(group_sum(scratch, squares(lo) + squares(hi), UNITS), D, eps)
        for e in range(E):
            j = u * E + e
            a = rounded(normalize(load(get_lane(lo, e)), inv_rms, load(get_lane(w_lo, e)), weight_offset))
            b = rounded(normalize(load(get_lane(hi, e)), inv_rms, load(get_lane(w_hi, e)), weight_offset))
            if lane < UNITS:
                put_lane(result, e, store(rounded(a * cos_sh[j]) - rounded(b * sin_sh[j])))
            else:
                put_lane(result, e, store(rounded(b * cos_sh[j]) + rounded(a * sin_sh[j])))

    @cuda.jit(device=True, inline=True)
    def prologue(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices, page_indptr,
                 row, b, last, owner, scale, cos_sh, sin_sh, scratch, q_lane):
        """q_lane <- the lane's chunk of the G heads' q rows, normed, rotated and scaled for the scores;
        the owner block writes the row's new k (normed, rotated) and v of head h to the cache."""
        h = cuda.blockIdx.y
        lane = cuda.threadIdx.x % L
        position = float32(last)
        for j in range(cuda.threadIdx.x, HALF, NT):  # rope.py's store_inv_freq + store_cos_sin
            angle = position * rope_inv_freq(j, D, theta)
            cos_sh[j] = rounded(float32(math.cos(angle)))
            sin_sh[j] = rounded(float32(math.sin(angle)))
        cuda.syncthreads()
        lo = cuda.local.array(VECTOR_WORDS, words)
        hi = cuda.local.array(VECTOR_WORDS, words)
        w_lo = cuda.local.array(VECTOR_WORDS, words)
        w_hi = cuda.local.array(VECTOR_WORDS, words)
        result = cuda.local.array(VECTOR_WORDS, words)
        q_scale = scale * float32(LOG2_E)
        for g in range(G):
            norm_rope_chunk(q, row, h * G + g, q_weight, eps, weight_offset, cos_sh, sin_sh, scratch, lo, hi, w_lo,
                            w_hi, result)
            for e in range(E):
                q_lane[g * E + e] = load(get_lane(result, e)) * q_scale
        if owner:  # uniform per block
            norm_rope_chunk(k, row, h, k_weight, eps, weight_offset, cos_sh, sin_sh, scratch, lo, hi, w_lo, w_hi,
                            result)
            if cuda.threadIdx.x < L:  # one lane group writes the row (attend's first barrier publishes it)
                page_size = k_cache.shape[1]
                logical = last // page_size
                page = page_indices[page_indptr[b] + logical]
                slot = last - logical * page_size
                store_vector(k_cache, (page, slot, h, lane * E), result, 0)
                load_vector(v, (row, h, lane * E), lo, 0)
                store_vector(v_cache, (page, slot, h, lane * E), lo, 0)

    @cuda.jit(**parts.launch_options)
    def direct_kernel(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices,
                      page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices, kv_chunk_size,
                      total_num_rows, out, scale):
        s_sh = cuda.shared.array((2, GROUP_STATES), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        state_sh = cuda.shared.array((3, G), float32)
        part_sh = cuda.shared.array((KPP, G, D), float32)
        scratch = cuda.shared.array(NT, float32)
        cos_sh = cuda.shared.array(HALF, float32)
        sin_sh = cuda.shared.array(HALF, float32)
        q_lane = cuda.local.array(ACC, float32)
        row, b, c, last, k0, k1, num_chunks = locate(page_indptr, last_page_len, q_indptr, positions, request_indices,
                                                     kv_tile_indices, kv_chunk_size, total_num_rows, k_cache.shape[1])
        if row < 0:
            return
        prologue(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices, page_indptr,
                 row, b, last, c == num_chunks - 1, scale, cos_sh, sin_sh, scratch, q_lane)
        attend(q_lane, k_cache, v_cache, page_indices, page_indptr[b], k0, k1, s_sh, page_sh, offset_sh, state_sh,
               part_sh, scratch)
        store_direct(out, row, part_sh)

    @cuda.jit(**parts.launch_options)
    def split_kernel(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices,
                     page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices, kv_chunk_size,
                     total_num_rows, out, partial_out, partial_lse, scale):
        s_sh = cuda.shared.array((2, GROUP_STATES), float32)
        page_sh = cuda.shared.array(SUB, int32)
        offset_sh = cuda.shared.array(SUB, int32)
        state_sh = cuda.shared.array((3, G), float32)
        part_sh = cuda.shared.array((KPP, G, D), float32)
        scratch = cuda.shared.array(NT, float32)
        cos_sh = cuda.shared.array(HALF, float32)
        sin_sh = cuda.shared.array(HALF, float32)
        q_lane = cuda.local.array(ACC, float32)
        row, b, c, last, k0, k1, num_chunks = locate(page_indptr, last_page_len, q_indptr, positions, request_indices,
                                                     kv_tile_indices, kv_chunk_size, total_num_rows, k_cache.shape[1])
        if row < 0:
            return
        prologue(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices, page_indptr,
                 row, b, last, c == num_chunks - 1, scale, cos_sh, sin_sh, scratch, q_lane)
        attend(q_lane, k_cache, v_cache, page_indices, page_indptr[b], k0, k1, s_sh, page_sh, offset_sh, state_sh,
               part_sh, scratch)
        store_split(out, partial_out, partial_lse, row, c, num_chunks, part_sh, state_sh)

    return direct_kernel, split_kernel


class DecodeRopeAttention:
    """Launcher: a decode step's q/k norm + RoPE + KV write and its attention, in one launch where the
    layout allows (``fuses``), else ``qk_rope`` (qk_rope_kv.py) then ``attention``: the same bits.

    Arrays as ``QkNormRopeWriteKv`` takes them (q [B, Hq, D] strided, k and v [B, Hkv, D] views of
    the qkv buffer, the norm weights [D], the caches), then decode attention's metadata, ``out
    [B, Hq, D]`` and split scratch (decode_attention.py). q and k are left as they were when fused
    (only the cache receives the rotated k); the separate launches rotate them in place.
    """

    def __init__(self, codec: Codec, round_before_weight: bool, attention: DecodeAttention,
                 qk_rope: QkNormRopeWriteKv) -> None:
        self.attention, self.qk_rope = attention, qk_rope
        self.head_dim = attention.head_dim
        self.kernels: tuple[Kernel, Kernel] | None = None
        lanes, d = attention.lanes, attention.head_dim
        fits = attention.kernels is not None and lanes * lanes_for(codec) == d and lanes % 2 == 0 and (
            shared_bytes(codec, d, attention.group_size, attention.threads, attention.round_keys) + 4 * d  # cos, sin
            <= SHARED_LIMIT_BYTES)
        if fits:
            direct, split = build_decode_attention(
                codec, attention.head_dim, attention.group_size, attention.threads, attention.round_keys,
                blocks_per_sm=attention.blocks_per_sm, unroll_keys=attention.unroll_keys,
                finish=lambda parts: build_rope_kernels(codec, RopeNorm(round_before_weight), parts))
            self.kernels = (Kernel(direct), Kernel(split))

    def fuses(self, q: Any, k: Any, v: Any, q_weight: Any, k_weight: Any, k_cache: Any, v_cache: Any,
              rotary_dim: int) -> bool:
        """Whether a call with these arrays runs the one launch."""
        return (self.kernels is not None and rotary_dim == self.head_dim and self.attention.uses_vector(k_cache, v_cache)
                and vector_aligned(q, k, v, q_weight, k_weight))

    def __call__(self, q: Any, k: Any, v: Any, q_weight: Any, k_weight: Any, eps: float, weight_offset: float,
                 rotary_dim: int, theta: float, k_cache: Any, v_cache: Any, page_indices: Any, page_indptr: Any,
                 last_page_len: Any, q_indptr: Any, batch_indices: Any, positions: Any, request_indices: Any,
                 qo_tile_indices: Any, kv_tile_indices: Any, kv_chunk_size: Any, total_num_rows: Any, out: Any,
                 scale: float, partial_out: Any = None, partial_lse: Any = None, stream: Any = 0) -> None:
        meta = (page_indices, page_indptr, last_page_len, q_indptr, batch_indices, positions, request_indices,
                qo_tile_indices, kv_tile_indices, kv_chunk_size, total_num_rows)
        num_tiles = request_indices.shape[0]
        if num_tiles == 0 or not self.fuses(q, k, v, q_weight, k_weight, k_cache, v_cache, rotary_dim):
            self.qk_rope(q, k, v, q_weight, k_weight, positions, eps, weight_offset, rotary_dim, theta, k_cache,
                         v_cache, batch_indices, page_indices, page_indptr, stream=stream)
            self.attention(q, k_cache, v_cache, *meta, out, scale, partial_out, partial_lse, stream=stream)
            return
        rows = out.shape[0]
        for name, a, shape in (("q", q, tuple(out.shape)), ("k", k, (rows, *k_cache.shape[2:])),
                               ("v", v, (rows, *k_cache.shape[2:]))):
            if tuple(a.shape) != shape:
                raise ValueError(f"decode rope attention: {name} has shape {tuple(a.shape)}, expected {shape}")
        direct, split = self.kernels
        grid, threads = (num_tiles, k_cache.shape[2]), self.attention.threads
        head = (q, k, v, q_weight, k_weight, np.float32(eps), np.float32(weight_offset), np.float32(theta), k_cache,
                v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices,
                kv_tile_indices, kv_chunk_size, total_num_rows, out)
        if partial_out is None:
            direct[grid, threads, stream](*head, np.float32(scale))
            return
        split[grid, threads, stream](*head, partial_out, partial_lse, np.float32(scale))
        self.attention.fallback.merge_splits(partial_out, partial_lse, batch_indices, positions, kv_chunk_size,
                                             total_num_rows, out, stream)
