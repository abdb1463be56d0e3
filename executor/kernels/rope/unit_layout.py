"""The specialized q/k norm + RoPE kernel's unit layout: a thread owns one unit of each of its heads
(a pair unit or a pass-through chunk; specialized.py describes the layout and its launch rule).

A pair unit needs its 8 frequencies' rounded cos/sin each row. The same unit of adjacent head slots
in a warp needs the same 8, so ``cos_sin_slots`` (P) slots share them: each computes 8 / P (one
sincos each) and the unit's 8 come back by lane exchanges (rope_chunk_layout.build_lane_exchange),
bit for bit the values a thread computing all 8 would get. On Qwen3-8B's q (8-thread groups, 4 slots
a warp) that is 2 sincos a thread a row instead of 8.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import WARP_THREADS
from executor.kernels.primitives.mma import build_pack_bf16x2
from executor.kernels.rows.norm import inv_rms_from_sum
from executor.kernels.primitives.reduce import build_group_sum
from executor.kernels.rope.bf16 import BF16_LANES, NVVM_INLINE, bf16_functions
from executor.kernels.rope.chunk_layout import build_lane_exchange
from executor.kernels.rope.layout import MAX_GROUP_THREADS, rope_inv_freq
from executor.kernels.primitives.vector import VECTOR_WORDS, build_vector_access
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

UNIT_WORDS = 2 * VECTOR_WORDS  # a thread's unit of one head: two chunks (a pass-through unit uses the first)


def cos_sin_slots(slots: int, group_threads: int) -> int:
    """Head slots that share a pair unit's cos/sin (module docstring): the largest power of two whose
    slots of ``group_threads`` threads fit a warp and that divides both ``slots`` (so a sharing group
    is all real slots or all idle ones) and a chunk's BF16_LANES frequencies."""
    share = 1
    while (2 * share * group_threads <= WARP_THREADS and slots % (2 * share) == 0
           and BF16_LANES % (2 * share) == 0):
        share *= 2
    return share


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

    share = cos_sin_slots(slots, gt)
    per_slot = lanes // share  # frequencies of a pair unit a thread computes a row
    share_threads = share * gt
    sim = simulator_enabled()

    load = codec.load
    pack = build_pack_bf16x2()
    load_vector, store_vector = build_vector_access()
    group_sum = build_group_sum()
    exchange = build_lane_exchange()
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
    def unit_cos_sin(word_scratch, position, inv_freq, source, cos, sin):
        """A pair unit's 8 cos/sin at ``position``, rounded (HF casts them to the activation dtype, one
        cvt.rn.bf16x2 a pair here): this thread computes per_slot of them (its slot's in the sharing
        group), and with share > 1 frequency k comes from the group's slot k // per_slot, whose
        unit-mate is thread ``source + (k // per_slot) * gt``; then every thread of the block calls it."""
        mine = cuda.local.array(per_slot, int32)
        for i in range(per_slot):
            angle = position * inv_freq[i]
            mine[i] = pack(math.cos(angle), math.sin(angle))
        for k in range(lanes):
            word = mine[k % per_slot]
            if share > 1:
                from_thread = source + (k // per_slot) * gt
                if sim:  # an idle slot's partial group in a block of whole groups (not whole warps)
                    from_thread = min(from_thread, cuda.blockDim.x - 1)
                word = exchange(word_scratch, word, from_thread)
            cos[k], sin[k] = load(word), load(word >> 16)

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
    def finish_row(x, positions, t, scratch, word_scratch, eps, weight_offset, slot, col_lo, col_hi, active, pair, w,
                   inv_freq, cos_source, cos, sin, head0, head1, head2, head3):
        """Row t from its loaded units: cos/sin (while the loads are in flight), the heads' inv_rms,
        pass 2, the stores."""
        if share > 1 or (active and pair):  # sharing exchanges need every thread
            unit_cos_sin(word_scratch, float32(positions[t]), inv_freq, cos_source, cos, sin)
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
        scratch = cuda.shared.array(0, float32)  # group_sum's and the exchanges', in the simulator only
        word_scratch = cuda.shared.array(0, int32)  # the same memory, for the exchanges of int32 words
        unit = cuda.threadIdx.x % gt
        slot = cuda.threadIdx.x // gt  # heads slot, slot + slots, ...
        active = unit < units and slot < slots
        pair = unit < pairs
        # A pair unit: chunk `unit` of each rotary half. A pass-through unit: the chunk at
        # rotary_dim + (unit - pairs) * lanes, which is half + unit * lanes too.
        col_lo = unit * lanes if pair else half + unit * lanes
        col_hi = half + unit * lanes
        w = cuda.local.array(UNIT_WORDS, int32)
        inv_freq = cuda.local.array(per_slot, float32)  # the frequencies this thread computes
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
        # Frequencies unit * lanes + first_frequency + i: all 8 of the unit when nothing is shared.
        first_frequency = (slot % share) * per_slot
        cos_source = cuda.threadIdx.x - cuda.threadIdx.x % share_threads + unit  # the group's slot 0, this unit
        for i in range(per_slot):
            inv_freq[i] = rope_inv_freq(unit * lanes + first_frequency + i, rotary_dim, theta) if pair \
                else float32(0.0)
        if active:
            load_vector(norm_weight, (col_lo,), w, 0)
            if pair:
                load_vector(norm_weight, (col_hi,), w, VECTOR_WORDS)
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
                finish_row(x, positions, t, scratch, word_scratch, eps, weight_offset, slot, col_lo, col_hi, active,
                           pair, w, inv_freq, cos_source, cos, sin, head0, head1, head2, head3)
                if t_next >= rows:
                    break
                t = t_next + cuda.gridDim.x
                if t < rows:
                    load_row(x, t, slot, col_lo, col_hi, active, pair, head0, head1, head2, head3)
                finish_row(x, positions, t_next, scratch, word_scratch, eps, weight_offset, slot, col_lo, col_hi,
                           active, pair, w, inv_freq, cos_source, cos, sin, next0, next1, next2, next3)
        else:
            for t in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
                load_row(x, t, slot, col_lo, col_hi, active, pair, head0, head1, head2, head3)
                finish_row(x, positions, t, scratch, word_scratch, eps, weight_offset, slot, col_lo, col_hi, active,
                           pair, w, inv_freq, cos_source, cos, sin, head0, head1, head2, head3)

    return qk_norm_rope_specialized
