"""The specialized q/k norm + RoPE kernel's unit layout: a thread owns one unit of each of its heads
(a pair unit or a pass-through chunk; rope_specialized.py describes the layout and its launch rule)."""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.codec import Codec
from executor.kernels.norm import inv_rms_from_sum
from executor.kernels.reduce import build_group_sum
from executor.kernels.rope_bf16 import BF16_LANES, NVVM_INLINE, bf16_functions
from executor.kernels.rope_layout import MAX_GROUP_THREADS, rope_inv_freq
from executor.kernels.vector import VECTOR_WORDS, build_vector_access
from executor.kernels.mma import build_pack_bf16x2
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

UNIT_WORDS = 2 * VECTOR_WORDS  # a thread's unit of one head: two chunks (a pass-through unit uses the first)


def build_unit_kernel(
    codec: Codec,
    round_before_weight: bool,
    head_dim: int,
    rotary_dim: int,
    heads: int,
    group_threads: int,
    nh: int,
    pipelined: bool,
    launch_options: dict,
) -> Callable[..., Any]:
    """The unit layout's kernel (module docstring); arguments as build_qk_norm_rope_specialized_kernel's."""
    lanes = BF16_LANES
    half = rotary_dim // 2
    pairs = half // lanes
    units = pairs + (head_dim - rotary_dim) // lanes
    slots = heads // nh
    gt = group_threads
    if not units <= gt <= MAX_GROUP_THREADS or gt & (gt - 1):
        raise ValueError(f"group_threads {gt} must be a power of two in [{units} units, {MAX_GROUP_THREADS}]")

    pack = build_pack_bf16x2()
    load_vector, store_vector = build_vector_access()
    group_sum = build_group_sum()
    element, rounded_pair, chunk_squares, normalized_pair = bf16_functions(codec, round_before_weight)

    @cuda.jit(device=True, **NVVM_INLINE)
    def head_inv_rms(scratch, words, active, pair, eps):
        """The head's inv_rms on every thread of its group, from each thread's unit in ``words``;
        the partial sum is build_vector_head's: first-half chunk, plus second-half chunk."""
        partial = float32(0.0)
        if active:
            partial = chunk_squares(words, 0)
            if pair:
                partial = partial + chunk_squares(words, lanes)
        return inv_rms_from_sum(group_sum(scratch, partial, gt), head_dim, eps)

    @cuda.jit(device=True, **NVVM_INLINE)
    def normed_pair(words, w, k, inv_rms, weight_offset):
        """Unit elements k, k + 1 of HF's q_norm output (rounded) from ``words`` and the weights ``w``."""
        v0, v1 = normalized_pair(element(words, k), element(words, k + 1), element(w, k), element(w, k + 1),
                                 inv_rms, weight_offset)
        return rounded_pair(v0, v1)

    @cuda.jit(device=True, **NVVM_INLINE)
    def rotated(a, b, cos, sin):
        """(a cos - b sin, b cos + a sin) for a = n[j], b = n[j + r/2], each product rounded (HF); the
        caller's store rounds the sums."""
        a_cos, b_sin = rounded_pair(a * cos, b * sin)
        b_cos, a_sin = rounded_pair(b * cos, a * sin)
        return a_cos - b_sin, b_cos + a_sin

    @cuda.jit(device=True, **NVVM_INLINE)
    def unit_cos_sin(position, inv_freq, cos, sin):
        """A pair unit's 8 cos/sin at ``position``, rounded (HF casts them to the activation dtype)."""
        for k in range(lanes):
            angle = position * inv_freq[k]
            cos[k], sin[k] = rounded_pair(math.cos(angle), math.sin(angle))

    @cuda.jit(device=True, **NVVM_INLINE)
    def unit_norm_rope(words, w, pair, cos, sin, inv_rms, weight_offset):
        """Pass 2 on a unit, in place in its buffer: normed, rotated for a pair unit, rounded. Each
        step reads word k / 2 of a chunk before it writes it."""
        if pair:
            for k in range(0, lanes, 2):
                a0, a1 = normed_pair(words, w, k, inv_rms, weight_offset)  # n[j], n[j + 1]
                b0, b1 = normed_pair(words, w, lanes + k, inv_rms, weight_offset)  # n[j + r/2], n[j + 1 + r/2]
                lo0, hi0 = rotated(a0, b0, cos[k], sin[k])
                lo1, hi1 = rotated(a1, b1, cos[k + 1], sin[k + 1])
                words[k // 2] = pack(lo0, lo1)
                words[VECTOR_WORDS + k // 2] = pack(hi0, hi1)
        else:
            for k in range(0, lanes, 2):
                v0, v1 = normalized_pair(element(words, k), element(words, k + 1), element(w, k),
                                         element(w, k + 1), inv_rms, weight_offset)
                words[k // 2] = pack(v0, v1)

    @cuda.jit(device=True, **NVVM_INLINE)
    def load_unit(x, t, h, col_lo, col_hi, pair, words):
        load_vector(x, (t, h, col_lo), words, 0)
        if pair:
            load_vector(x, (t, h, col_hi), words, VECTOR_WORDS)

    @cuda.jit(device=True, **NVVM_INLINE)
    def store_unit(x, t, h, col_lo, col_hi, pair, words):
        store_vector(x, (t, h, col_lo), words, 0)
        if pair:
            store_vector(x, (t, h, col_hi), words, VECTOR_WORDS)

    @cuda.jit(device=True, **NVVM_INLINE)
    def load_row(x, t, slot, col_lo, col_hi, active, pair, head0, head1, head2, head3):
        """This thread's unit of each of its heads of row t: every load before any reduction."""
        if active:
            load_unit(x, t, slot, col_lo, col_hi, pair, head0)
            if nh > 1:
                load_unit(x, t, slot + slots, col_lo, col_hi, pair, head1)
            if nh > 2:
                load_unit(x, t, slot + 2 * slots, col_lo, col_hi, pair, head2)
                load_unit(x, t, slot + 3 * slots, col_lo, col_hi, pair, head3)

    @cuda.jit(device=True, **NVVM_INLINE)
    def finish_row(x, positions, t, scratch, eps, weight_offset, slot, col_lo, col_hi, active, pair, w, inv_freq,
                   cos, sin, head0, head1, head2, head3):
        """Row t from its loaded units: cos/sin (while the loads are in flight), the heads' inv_rms,
        pass 2, the stores."""
        if active and pair:
            unit_cos_sin(float32(positions[t]), inv_freq, cos, sin)
        # Every thread reduces nh times (whole warps on the GPU, the block's barriers in the simulator).
        inv_rms0 = head_inv_rms(scratch, head0, active, pair, eps)
        inv_rms1 = head_inv_rms(scratch, head1, active, pair, eps) if nh > 1 else inv_rms0
        inv_rms2 = head_inv_rms(scratch, head2, active, pair, eps) if nh > 2 else inv_rms0
        inv_rms3 = head_inv_rms(scratch, head3, active, pair, eps) if nh > 2 else inv_rms0
        if active:
            unit_norm_rope(head0, w, pair, cos, sin, inv_rms0, weight_offset)
            store_unit(x, t, slot, col_lo, col_hi, pair, head0)
            if nh > 1:
                unit_norm_rope(head1, w, pair, cos, sin, inv_rms1, weight_offset)
                store_unit(x, t, slot + slots, col_lo, col_hi, pair, head1)
            if nh > 2:
                unit_norm_rope(head2, w, pair, cos, sin, inv_rms2, weight_offset)
                store_unit(x, t, slot + 2 * slots, col_lo, col_hi, pair, head2)
                unit_norm_rope(head3, w, pair, cos, sin, inv_rms3, weight_offset)
                store_unit(x, t, slot + 3 * slots, col_lo, col_hi, pair, head3)

    @cuda.jit(**launch_options)
    def qk_norm_rope_specialized(x, norm_weight, positions, eps, weight_offset, theta):
        scratch = cuda.shared.array(0, float32)  # group_sum's, in the simulator only
        unit = cuda.threadIdx.x % gt
        slot = cuda.threadIdx.x // gt  # heads slot, slot + slots, ...
        active = unit < units and slot < slots
        pair = unit < pairs
        # A pair unit: chunk `unit` of each rotary half. A pass-through unit: the chunk at
        # rotary_dim + (unit - pairs) * lanes, which is half + unit * lanes too.
        col_lo = unit * lanes if pair else half + unit * lanes
        col_hi = half + unit * lanes
        w = cuda.local.array(UNIT_WORDS, int32)
        inv_freq = cuda.local.array(lanes, float32)
        cos = cuda.local.array(lanes, float32)
        sin = cuda.local.array(lanes, float32)
        head0 = cuda.local.array(UNIT_WORDS, int32)  # this thread's unit of head slot + n * slots
        head1 = cuda.local.array(UNIT_WORDS, int32)
        head2 = cuda.local.array(UNIT_WORDS, int32)
        head3 = cuda.local.array(UNIT_WORDS, int32)
        next0 = cuda.local.array(UNIT_WORDS, int32)  # the same for the block's next row (pipelined)
        next1 = cuda.local.array(UNIT_WORDS, int32)
        next2 = cuda.local.array(UNIT_WORDS, int32)
        next3 = cuda.local.array(UNIT_WORDS, int32)
        if active:
            load_vector(norm_weight, (col_lo,), w, 0)
            if pair:
                load_vector(norm_weight, (col_hi,), w, VECTOR_WORDS)
                for k in range(lanes):
                    inv_freq[k] = rope_inv_freq(unit * lanes + k, rotary_dim, theta)
        rows = x.shape[0]
        if pipelined:
            # Two rows a trip, each buffer set loaded a row ahead of its finish: one row's loads are
            # in flight while the other row computes (the row index is the block's, so every branch
            # here is uniform over the block).
            t = cuda.blockIdx.x
            if t < rows:
                load_row(x, t, slot, col_lo, col_hi, active, pair, head0, head1, head2, head3)
            while t < rows:
                t_next = t + cuda.gridDim.x
                if t_next < rows:
                    load_row(x, t_next, slot, col_lo, col_hi, active, pair, next0, next1, next2, next3)
                finish_row(x, positions, t, scratch, eps, weight_offset, slot, col_lo, col_hi, active, pair, w,
                           inv_freq, cos, sin, head0, head1, head2, head3)
                if t_next >= rows:
                    break
                t = t_next + cuda.gridDim.x
                if t < rows:
                    load_row(x, t, slot, col_lo, col_hi, active, pair, head0, head1, head2, head3)
                finish_row(x, positions, t_next, scratch, eps, weight_offset, slot, col_lo, col_hi, active, pair,
                           w, inv_freq, cos, sin, next0, next1, next2, next3)
        else:
            for t in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
                load_row(x, t, slot, col_lo, col_hi, active, pair, head0, head1, head2, head3)
                finish_row(x, positions, t, scratch, eps, weight_offset, slot, col_lo, col_hi, active, pair, w,
                           inv_freq, cos, sin, head0, head1, head2, head3)

    return qk_norm_rope_specialized
