"""The specialized q/k norm + RoPE kernel's chunk layout: a head's 16-byte chunks in memory order
over G lanes, K a thread (specialized.py describes the layout, its sums and its launch rule)."""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import WARP_THREADS
from executor.kernels.primitives.mma import build_pack_bf16x2
from executor.kernels.rows.norm import inv_rms_from_sum
from executor.kernels.primitives.reduce import build_group_sum
from executor.kernels.rope.bf16 import BF16_LANES, NVVM_INLINE, SIGN_BIT, bf16_functions
from executor.kernels.rope.layout import rope_inv_freq
from executor.kernels.primitives.vector import VECTOR_WORDS, build_vector_access
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)


def build_lane_exchange() -> Callable[..., Any]:
    """Device function ``exchange(scratch, value, source) -> value``: the ``value`` of thread ``source``
    of the block (in this thread's warp on the GPU), every thread of the block calling it. GPU: one
    ``shfl.sync.idx`` (int32 or float32). Simulator: through ``scratch`` (blockDim.x words of shared
    memory of value's type) between two barriers."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def exchange_shared(scratch, value, source):
            scratch[cuda.threadIdx.x] = value
            cuda.syncthreads()
            got = scratch[source]
            cuda.syncthreads()
            return got

        return exchange_shared

    @cuda.jit(device=True, **NVVM_INLINE)
    def exchange_shuffle(scratch, value, source):
        return cuda.shfl_sync(0xFFFFFFFF, value, source & (WARP_THREADS - 1))

    return exchange_shuffle


def build_chunk_kernel(
    codec: Codec,
    round_before_weight: bool,
    head_dim: int,
    rotary_dim: int,
    heads: int,
    group: int,
    nh: int,
    per_thread: int,
    pipelined: bool,
    launch_options: dict,
) -> Callable[..., Any]:
    """The chunk layout's kernel (module docstring); arguments as build_qk_norm_rope_specialized_kernel's,
    ``group`` its group_threads and ``per_thread`` its chunks_per_thread."""
    lanes = BF16_LANES
    half = rotary_dim // 2
    pairs = half // lanes
    chunks = head_dim // lanes
    units = chunks - pairs  # the vector kernel's: pair units, then pass-through chunks
    slots = heads // nh
    # Local array sizes (numba wants each a constant, not an expression).
    stage_words = nh * per_thread * VECTOR_WORDS  # a row's chunks of this thread
    weight_words = per_thread * VECTOR_WORDS
    head_chunks = nh * per_thread
    heads_words = nh * VECTOR_WORDS
    rotary_everywhere = 2 * pairs == group  # every lane's slot-0 chunk is a rotary one

    load = codec.load
    pack = build_pack_bf16x2()
    load_vector, store_vector = build_vector_access()
    group_sum = build_group_sum()
    exchange = build_lane_exchange()
    element, rounded_pair, chunk_squares, normalized_pair = bf16_functions(codec, round_before_weight)

    @cuda.jit(device=True, **NVVM_INLINE)
    def chunk_valid(active, lane, m):
        """Whether this thread's chunk slot m (chunk lane + m * group of a head) is one of the head's."""
        return active and lane + m * group < chunks

    @cuda.jit(device=True, **NVVM_INLINE)
    def load_stage(x, positions, t, slot, lane, active, buf):
        """This thread's chunks of its heads of row t into ``buf`` (chunk slot m of head n at words
        (n * per_thread + m) * 4), and the row's position as float32."""
        for n in range(nh):
            for m in range(per_thread):
                if chunk_valid(active, lane, m):
                    load_vector(x, (t, slot + n * slots, (lane + m * group) * lanes), buf,
                                (n * per_thread + m) * VECTOR_WORDS)
        return float32(positions[t])

    @cuda.jit(device=True, **NVVM_INLINE)
    def finish_stage(x, t, position, buf, w, inv_freq, scratch, word_scratch, eps, weight_offset, slot, lane,
                     active, frequency_lane, cos_sin_source, sin_sign, partner, sum_source, carry, rotary):
        """Row t from its loaded chunks in ``buf``: cos/sin, the heads' inv_rms, pass 2, the stores."""
        # The row's rounded (cos, sin) of frequency j in one word (cos the low half), computed on the
        # warp's lane j < rotary_dim / 2; a rotary lane gathers its chunk's 8, the sin negated for a
        # first-half chunk (a - b sin is a + b (-sin), bit for bit).
        word = int32(0)
        if frequency_lane:
            angle = position * inv_freq
            word = pack(math.cos(angle), math.sin(angle))
        cos_sin = cuda.local.array(BF16_LANES, int32)
        for k in range(lanes):
            cos_sin[k] = exchange(word_scratch, word, cos_sin_source + k) ^ sin_sign
        # Sums of squares in the vector kernel's order (module docstring): each chunk's 8 squares,
        # then unit v's partial on chunk slot m (v = lane + m * group): chunk v's sum plus chunk
        # v + pairs's for a pair unit, chunk v + pairs's for a pass-through one (gathered from lane
        # (lane + pairs) % group, its slot m or m + 1), zero past the units; then the xor tree's
        # first levels over the slots here, its last over the group's lanes.
        squares = cuda.local.array(head_chunks, float32)
        for n in range(nh):
            for m in range(per_thread):
                s = chunk_squares(buf, (n * per_thread + m) * lanes)
                squares[n * per_thread + m] = s if chunk_valid(active, lane, m) else float32(0.0)
        inv_rms = cuda.local.array(nh, float32)
        received = cuda.local.array(per_thread, float32)
        partial = cuda.local.array(per_thread, float32)
        for n in range(nh):
            for m in range(per_thread):
                received[m] = exchange(scratch, squares[n * per_thread + m], sum_source)
            for m in range(per_thread):
                moved = received[m]
                if m + 1 < per_thread:
                    if carry:
                        moved = received[m + 1]
                elif carry:
                    moved = float32(0.0)  # chunk v + pairs is past the head
                v = lane + m * group
                own = squares[n * per_thread + m]
                unit_sum = own + moved if v < pairs else moved
                partial[m] = unit_sum if v < units else float32(0.0)
            width = per_thread // 2
            while width > 0:
                for m in range(width):
                    partial[m] = partial[m] + partial[m + width]
                width //= 2
            inv_rms[n] = inv_rms_from_sum(group_sum(scratch, partial[0], group), head_dim, eps)
        # Pass 2: every chunk normed and rounded in place (a pass-through chunk's output, a rotary
        # chunk's HF q_norm output).
        for n in range(nh):
            for m in range(per_thread):
                first = (n * per_thread + m) * lanes
                for k in range(0, lanes, 2):
                    v0, v1 = normalized_pair(element(buf, first + k), element(buf, first + k + 1),
                                             element(w, m * lanes + k), element(w, m * lanes + k + 1),
                                             inv_rms[n], weight_offset)
                    buf[(first + k) // 2] = pack(v0, v1)
        # Rotary chunks (chunk slot 0 of lanes < 2 pairs): out = round(n cos) + round(partner (+-sin)),
        # the partner chunk (the other rotary half of the pair unit) from its lane.
        partner_words = cuda.local.array(heads_words, int32)
        for n in range(nh):
            for k in range(VECTOR_WORDS):
                partner_words[n * VECTOR_WORDS + k] = exchange(word_scratch, buf[n * per_thread * VECTOR_WORDS + k],
                                                               partner)
        if rotary:
            for n in range(nh):
                first = n * per_thread * lanes
                for k in range(0, lanes, 2):
                    n_cos0, n_cos1 = rounded_pair(element(buf, first + k) * load(cos_sin[k]),
                                                  element(buf, first + k + 1) * load(cos_sin[k + 1]))
                    p_sin0, p_sin1 = rounded_pair(element(partner_words, n * lanes + k) * load(cos_sin[k] >> 16),
                                                  element(partner_words, n * lanes + k + 1)
                                                  * load(cos_sin[k + 1] >> 16))
                    buf[(first + k) // 2] = pack(n_cos0 + p_sin0, n_cos1 + p_sin1)
        for n in range(nh):
            for m in range(per_thread):
                if chunk_valid(active, lane, m):
                    store_vector(x, (t, slot + n * slots, (lane + m * group) * lanes), buf,
                                 (n * per_thread + m) * VECTOR_WORDS)

    @cuda.jit(**launch_options)
    def qk_norm_rope_specialized_chunks(x, norm_weight, positions, eps, weight_offset, theta):
        scratch = cuda.shared.array(0, float32)  # the simulator's group_sum and exchanges (float32 values)
        word_scratch = cuda.shared.array(0, int32)  # the same memory, for the exchanges of int32 words
        tid = cuda.threadIdx.x
        lane = tid % group
        slot = tid // group  # heads slot, slot + slots, ...
        active = slot < slots
        group_first = tid - lane
        warp_lane = tid % WARP_THREADS
        frequency_lane = warp_lane < half
        inv_freq = rope_inv_freq(warp_lane, rotary_dim, theta) if frequency_lane else float32(0.0)
        rotary = rotary_everywhere or lane < 2 * pairs
        first_half = lane < pairs
        pair_unit = lane if first_half else lane - pairs  # a rotary lane's pair unit
        cos_sin_source = tid - warp_lane + (pair_unit * lanes if rotary else 0)  # + k: frequency j of the chunk
        sin_sign = int32(SIGN_BIT) if first_half else int32(0)
        partner = group_first + (lane + pairs if first_half else lane - pairs) if rotary else tid
        sum_source = group_first + (lane + pairs) % group
        carry = lane + pairs >= group
        # Chunk slots past a head (or an idle slot's) are never loaded: zeros, finite in pass 2.
        w = cuda.local.array(weight_words, int32)
        buf = cuda.local.array(stage_words, int32)
        buf_next = cuda.local.array(stage_words, int32)  # the block's next row (pipelined)
        for k in range(weight_words):
            w[k] = 0
        for k in range(stage_words):
            buf[k] = 0
            buf_next[k] = 0
        for m in range(per_thread):
            if chunk_valid(active, lane, m):
                load_vector(norm_weight, ((lane + m * group) * lanes,), w, m * VECTOR_WORDS)
        rows = x.shape[0]
        if pipelined:
            # As the unit layout's: two rows a trip, each buffer loaded a row ahead of its finish.
            t = cuda.blockIdx.x
            position = float32(0.0)
            if t < rows:
                position = load_stage(x, positions, t, slot, lane, active, buf)
            while t < rows:
                t_next = t + cuda.gridDim.x
                position_next = float32(0.0)
                if t_next < rows:
                    position_next = load_stage(x, positions, t_next, slot, lane, active, buf_next)
                finish_stage(x, t, position, buf, w, inv_freq, scratch, word_scratch, eps, weight_offset, slot,
                             lane, active, frequency_lane, cos_sin_source, sin_sign, partner, sum_source, carry,
                             rotary)
                if t_next >= rows:
                    break
                t = t_next + cuda.gridDim.x
                if t < rows:
                    position = load_stage(x, positions, t, slot, lane, active, buf)
                finish_stage(x, t_next, position_next, buf_next, w, inv_freq, scratch, word_scratch, eps,
                             weight_offset, slot, lane, active, frequency_lane, cos_sin_source, sin_sign, partner,
                             sum_source, carry, rotary)
        else:
            for t in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
                position = load_stage(x, positions, t, slot, lane, active, buf)
                finish_stage(x, t, position, buf, w, inv_freq, scratch, word_scratch, eps, weight_offset, slot,
                             lane, active, frequency_lane, cos_sin_source, sin_sign, partner, sum_source, carry,
                             rotary)

    return qk_norm_rope_specialized_chunks
