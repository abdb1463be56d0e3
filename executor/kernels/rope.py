"""Per-head q/k RMSNorm fused with NeoX (rotate_half) rotary embedding, in place.

For each token row t and head h of ``x [T, heads, head_dim]``:

    n = rms_norm(x[t, h, :]) * (weight_offset + w)        over head_dim (see norm.py)
    inv_freq[j] = 1 / theta^(2j / rotary_dim)              j < rotary_dim / 2
    angle[j]    = float32(positions[t]) * inv_freq[j]      float32, like HF
    out[j]        = n[j] cos - n[j + r/2] sin              j < r/2   (r = rotary_dim)
    out[j + r/2]  = n[j + r/2] cos + n[j] sin
    out[i]        = n[i]                                   i >= r    (pass-through)

Qwen3: rotary_dim = head_dim = 128, weight_offset 0, round_before_weight True.
Qwen3.5: rotary_dim = 64 of head_dim 256, weight_offset 1, round_before_weight
False; q is the strided view ``q_proj_out[..., :head_dim]`` of [T, heads, 2*head_dim].

Rounding mirrors HF in the storage dtype (identities for float32 storage): the
normed q/k is rounded (HF's q_norm output), cos and sin are rounded (HF casts
them to the activation dtype), each product ``q*cos`` and ``rotate_half(q)*sin``
is rounded, and so is their sum.

inv_freq: HF computes ``1.0 / (theta ** (arange(0, r, 2).float() / r))`` in
float32. Here the power is taken in float64 and rounded to float32, i.e. the
correctly rounded float32 power; torch's CPU powf is off by one ulp for a few
(theta, r, j) (e.g. theta 1e6, r 128, j 37), which moves an angle by at most
one float32 ulp of the angle.

q and k are separate launches here (different head counts, same kernel);
qk_rope_kv.py fuses both with the KV write for decode-sized steps. One block
per (row, head); grid x over rows (grid-stride), y over heads. Pass 1 reads the
head for the sum of squares and ends in the reduction's barriers; in pass 2 a
thread reads the pair (j, j + r/2) or the pass-through element it alone writes,
so the in-place update has no cross-thread read-after-write.

Vector kernel: when x's heads and the norm weight are whole numbers of
16-byte-aligned chunks and rotary_dim / 2 is too (``uses_vector``), the
launcher runs a kernel over 16-byte chunks (vector.py). A group of
``group_threads`` threads (a power of two <= 32) owns a head: thread i of the
group takes the pair units i, i + group_threads, ... (a pair unit is chunk p of
the first rotary half with chunk p of the second) and then the pass-through
chunks; the group's sum of squares is a shuffle reduction (reduce.py). A block
owns VECTOR_ROWS (two) rows at a time: its threads first compute the rows'
cos/sin (rounded as above) into shared memory once for every head, from
inv_freq computed once per block, and a thread loads its unit of both rows
before either reduction, so more bytes are in flight. A thread with one unit
keeps it in registers between the passes. Rounding is
the scalar kernel's; only the order of the float32 sum of squares differs. The
per-head passes are device functions (``build_vector_head``) that the fused
q/k norm + RoPE + KV cache write (qk_rope_kv.py) runs too, bit for bit.

Specialized kernel (bf16, prefill): from SPECIALIZED_MIN_ROWS rows, a bf16 call the
vector kernel would take runs, where the shape fits it (``specialized_launch``), a kernel
built for that shape: head_dim, rotary_dim, heads, group threads GT and heads per thread
NH are compile-time constants (no integer division; every loop over a chunk unrolls into
registers). The launcher builds it once per shape and caches it. On the H200 the vector kernel took 251.9 us on Qwen3-8B's q
(16384 x 32 x 128), 26% of copy bandwidth, waiting on latency and instructions; this one
drops its shared cos/sin tables and barriers:

- a thread owns one unit (GT is ``vector_group_threads``: one unit a thread) of NH
  heads of a row, heads ``slot + n * SLOTS`` (n < NH; SLOTS = heads / NH head slots of
  GT threads; blockDim = SLOTS * GT rounded up to whole warps, extra slots idle), and
  loads all NH heads before any reduction;
- a block takes one row at a time (grid-stride over rows); the norm weight and a pair
  unit's inv_freq go into registers once per block, and each pair unit computes its own
  rounded cos/sin per row: no shared memory and no barrier on the GPU;
- roundings go two at a time through PTX ``cvt.rn.bf16x2.f32`` (mma.build_pack_bf16x2),
  the codec store's round-to-nearest-even: every HF rounding above, no other.

Sum of squares, deliberately in build_vector_head's order: a thread sums its chunk's 8
squares in element order (a pair unit: the first-half chunk's sum plus the second-half
chunk's), then the group's GT threads add their partials by reduce.py's xor tree. With
the vector kernel's group width and the same roundings, the specialized kernel gives the
vector kernel's bits, and so the fused kernel's (qk_rope_kv.py). Another order (a pair
unit's 16 squares in one chain, say) moves some heads' inv_rms by an ulp, which flips a
rare rounding; tests/kernels/test_rope.py has inputs that show it.

Launch rule (``specialized_launch``): NH is the largest of 4, 2, 1 that divides heads,
keeps NH * GT <= 64 and leaves the block at least 64 threads (else 1); the grid is
blocks_per_sm = 2048 / (heads * GT) blocks (at most 32) per SM, an SM holding 2048
(thread, head) units of rows, and at most one block per row; the SM count is asked once
per process. That reproduces the best of a sweep on the H200 for both q shapes: Qwen3-8B
(GT 8, NH 4, 64 threads, 8 blocks an SM: 85.6 us) and Qwen3.5's strided q (GT 32, NH 2,
256 threads, 4 blocks an SM: about 255 us; NH 4 was not measured). ptxas (CUDA 13.0,
sm_90) gives those two 101 and 84 registers, no spills: 8 resident blocks an SM for
Qwen3-8B, but 2 of the 4 for Qwen3.5 (the register file), the first thing to tune there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from executor.kernels.codec import Codec
from executor.kernels.launch import Kernel
from executor.kernels.mma import build_pack_bf16x2
from executor.kernels.norm import SCRATCH_BYTES_PER_THREAD, block_limit, build_normalize, inv_rms_from_sum
from executor.kernels.reduce import block_sum, build_group_sum, threads_for
from executor.kernels.vector import (
    VECTOR_BYTES,
    VECTOR_WORDS,
    build_lanes,
    build_vector_access,
    lanes_for,
    vector_aligned,
    word_type,
)
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, float64, int32  # noqa: E402  (after load_cuda's numpy fix)

# Size of the shared reduction scratch: the largest block a launcher picks.
MAX_THREADS = 256
MAX_GROUP_THREADS = 32  # a head's threads in the vector kernel: at most a warp (shuffle reduction)
VECTOR_ROWS = 2  # rows the vector kernel's block holds in flight at once

# Specialized kernel (module docstring). Rows from which a call takes it: prefill chunks; decode
# steps (at most qk_rope_kv.MAX_FUSED_ROWS rows) take the fused kernel, and the few-row calls left
# keep the vector kernel's wider blocks (the specialized kernel was measured at 16384 rows only).
SPECIALIZED_MIN_ROWS = 256
BF16_LANES = VECTOR_BYTES // 2  # bf16 elements in a 16-byte chunk: the specialized kernel is bf16 only
UNIT_WORDS = 2 * VECTOR_WORDS  # a thread's unit of one head: two chunks (a pass-through unit uses the first)
MAX_HEADS_PER_THREAD = 4  # NH is 4, 2 or 1 (the kernel spells out four heads' buffers)
MAX_SLOT_UNITS = 64  # NH * GT at most: NH 4 for 8-thread groups (Qwen3), 2 for 32-thread ones (Qwen3.5)
MIN_SPECIALIZED_THREADS = 64  # NH shrinks before the block gets smaller than two warps
UNITS_PER_SM = 2048  # (thread, head) units an SM's blocks hold: 8 Qwen3-8B q rows, 4 Qwen3.5 q rows
MAX_BLOCKS_PER_SM = 32  # sm_90's resident blocks per SM
SIM_MULTIPROCESSORS = 2  # the simulator has no SM count; a small grid keeps its Python threads few
# The specialized kernel's device functions are inlined by NVVM (alwaysinline), as sampler.py's: Numba's
# IR inlining copies the callee's IR at every call, and the nested calls took the sm_90 compile of
# Qwen3-8B's q kernel to about a minute. Inlined somewhere they must be, for the buffers to stay in
# registers. The simulator's jit takes no forceinline.
NVVM_INLINE = {} if simulator_enabled() else {"forceinline": True}


@cuda.jit(device=True, inline=True)
def rope_inv_freq(j, rotary_dim, theta):
    """float32 ``1 / theta^(2j / rotary_dim)``; the exponent is float32 as in HF, the power correctly rounded."""
    exponent = float32(2 * j) / float32(rotary_dim)
    return float32(1.0) / float32(math.pow(float64(theta), float64(exponent)))


def build_qk_norm_rope_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(x [T,heads,D], norm_weight [D], positions int32 [T], eps f32, weight_offset f32,
    rotary_dim int32, theta f32)``, in place on ``x``; storage per ``codec``.

    Launch with ``SCRATCH_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory.
    """
    load, store = codec.load, codec.store
    normalize = build_normalize(codec, round_before_weight)

    @cuda.jit(device=True, inline=True)
    def rounded(value):
        # What HF's separate ops in the activation dtype round to.
        return load(store(value))

    @cuda.jit
    def qk_norm_rope_inplace(x, norm_weight, positions, eps, weight_offset, rotary_dim, theta):
        scratch = cuda.shared.array(0, float32)  # dynamic: see norm.py
        h = cuda.blockIdx.y
        head_dim = x.shape[2]
        half = rotary_dim // 2
        tid = cuda.threadIdx.x
        step = cuda.blockDim.x
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            partial = float32(0.0)
            for i in range(tid, head_dim, step):
                v = load(x[t, h, i])
                partial += v * v
            inv_rms = inv_rms_from_sum(block_sum(scratch, partial), head_dim, eps)
            position = float32(positions[t])
            for j in range(tid, half, step):
                lo = rounded(normalize(load(x[t, h, j]), inv_rms, load(norm_weight[j]), weight_offset))
                hi = rounded(normalize(load(x[t, h, j + half]), inv_rms, load(norm_weight[j + half]), weight_offset))
                angle = position * rope_inv_freq(j, rotary_dim, theta)
                cos = rounded(float32(math.cos(angle)))
                sin = rounded(float32(math.sin(angle)))
                x[t, h, j] = store(rounded(lo * cos) - rounded(hi * sin))
                x[t, h, j + half] = store(rounded(hi * cos) + rounded(lo * sin))
            for i in range(rotary_dim + tid, head_dim, step):
                x[t, h, i] = store(normalize(load(x[t, h, i]), inv_rms, load(norm_weight[i]), weight_offset))

    return qk_norm_rope_inplace


@cuda.jit(device=True, inline=True)
def store_inv_freq(shared, inv_freq_at, half, rotary_dim, theta):
    """The vector kernels' inv_freq table, ``shared[inv_freq_at + j]`` for j < half, once per block.

    Thread tid writes j = tid, tid + blockDim.x, ..., the entries store_cos_sin (build_vector_head)
    reads back on that thread: no barrier between the two.
    """
    for j in range(cuda.threadIdx.x, half, cuda.blockDim.x):
        shared[inv_freq_at + j] = rope_inv_freq(j, rotary_dim, theta)


def build_vector_head(
    codec: Codec, round_before_weight: bool, put_chunk: Callable[..., Any] | None = None
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """Device functions for the 16-byte vector kernels, each run by every thread of a block or of a
    head's group of ``group_threads`` threads (see the module docstring):

    block_setup(shared, head_dim, rotary_dim, theta, group_threads)
        -> (half, pairs, units, lane, groups, one_unit, inv_freq_at, cos_at, sin_at)
        once per block (all threads): a head's units, this thread's lane and the block's head
        groups, whether a thread's unit stays in registers between the passes, and the shared
        memory layout after the simulator's reduction scratch (inv_freq, stored here, then cos
        and sin: ``vector_shared_bytes``)
    store_cos_sin(shared, inv_freq_at, cos_at, sin_at, half, position)
        this row's rounded cos/sin from the block's inv_freq table (all threads; the caller's
        barrier publishes them)
    head_squares(x, t, h, lane, group_threads, half, pairs, units, lo, hi) -> float32
        pass 1: this thread's part of head (t, h)'s sum of squares; with one unit per thread the
        unit stays in ``lo``/``hi`` for pass 2
    head_norm_rope(x, norm_weight, t, h, lane, group_threads, half, pairs, units, one_unit, inv_rms,
                   weight_offset, shared, cos_at, sin_at, lo, hi, w_lo, w_hi, cache, page, slot)
        pass 2: this thread's units normed and rotated; each finished chunk goes out through
        ``put_chunk(x, t, h, col, words, cache, page, slot)`` (default: in place in x only,
        ignoring cache/page/slot), the hook the fused KV-cache kernel (qk_rope_kv.py) uses

    ``half`` = rotary_dim / 2, ``pairs`` = half / lanes and ``units`` = pairs plus the
    pass-through chunks; lo, hi, w_lo, w_hi are VECTOR_WORDS-word local buffers.
    """
    load, store = codec.load, codec.store
    normalize = build_normalize(codec, round_before_weight)
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(codec)
    lanes = lanes_for(codec)

    if put_chunk is None:

        @cuda.jit(device=True, inline=True)
        def put_in_place(x, t, h, col, words, cache, page, slot):
            store_vector(x, (t, h, col), words, 0)

        put_chunk = put_in_place

    @cuda.jit(device=True, inline=True)
    def block_setup(shared, head_dim, rotary_dim, theta, group_threads):
        half = rotary_dim // 2
        pairs = half // lanes
        units = pairs + (head_dim - rotary_dim) // lanes
        inv_freq_at = cuda.blockDim.x
        store_inv_freq(shared, inv_freq_at, half, rotary_dim, theta)
        one_unit = units <= group_threads
        return (half, pairs, units, cuda.threadIdx.x % group_threads, cuda.blockDim.x // group_threads, one_unit,
                inv_freq_at, inv_freq_at + half, inv_freq_at + 2 * half)

    @cuda.jit(device=True, inline=True)
    def rounded(value):
        return load(store(value))

    @cuda.jit(device=True, inline=True)
    def normed(x_bits, w_bits, inv_rms, weight_offset):
        # HF's q_norm output, rounded to the activation dtype.
        return rounded(normalize(load(x_bits), inv_rms, load(w_bits), weight_offset))

    @cuda.jit(device=True, inline=True)
    def squares(chunk):
        total = float32(0.0)
        for k in range(lanes):
            v = load(get_lane(chunk, k))
            total += v * v
        return total

    @cuda.jit(device=True, inline=True)
    def store_cos_sin(shared, inv_freq_at, cos_at, sin_at, half, position):
        for j in range(cuda.threadIdx.x, half, cuda.blockDim.x):
            angle = position * shared[inv_freq_at + j]
            shared[cos_at + j] = rounded(float32(math.cos(angle)))
            shared[sin_at + j] = rounded(float32(math.sin(angle)))

    @cuda.jit(device=True, inline=True)
    def head_squares(x, t, h, lane, group_threads, half, pairs, units, lo, hi):
        partial = float32(0.0)
        for unit in range(lane, units, group_threads):
            if unit < pairs:
                load_vector(x, (t, h, unit * lanes), lo, 0)
                load_vector(x, (t, h, half + unit * lanes), hi, 0)
                partial += squares(lo) + squares(hi)
            else:
                load_vector(x, (t, h, half + unit * lanes), lo, 0)  # rotary_dim + (unit - pairs) * lanes
                partial += squares(lo)
        return partial

    @cuda.jit(device=True, inline=True)
    def head_norm_rope(x, norm_weight, t, h, lane, group_threads, half, pairs, units, one_unit, inv_rms,
                       weight_offset, shared, cos_at, sin_at, lo, hi, w_lo, w_hi, cache, page, slot):
        for unit in range(lane, units, group_threads):
            if unit < pairs:
                if not one_unit:
                    load_vector(x, (t, h, unit * lanes), lo, 0)
                    load_vector(x, (t, h, half + unit * lanes), hi, 0)
                load_vector(norm_weight, (unit * lanes,), w_lo, 0)
                load_vector(norm_weight, (half + unit * lanes,), w_hi, 0)
                for k in range(lanes):
                    j = unit * lanes + k
                    a = normed(get_lane(lo, k), get_lane(w_lo, k), inv_rms, weight_offset)
                    b = normed(get_lane(hi, k), get_lane(w_hi, k), inv_rms, weight_offset)
                    cos = shared[cos_at + j]
                    sin = shared[sin_at + j]
                    put_lane(lo, k, store(rounded(a * cos) - rounded(b * sin)))
                    put_lane(hi, k, store(rounded(b * cos) + rounded(a * sin)))
                put_chunk(x, t, h, unit * lanes, lo, cache, page, slot)
                put_chunk(x, t, h, half + unit * lanes, hi, cache, page, slot)
            else:
                if not one_unit:
                    load_vector(x, (t, h, half + unit * lanes), lo, 0)
                load_vector(norm_weight, (half + unit * lanes,), w_lo, 0)
                for k in range(lanes):
                    v = normalize(load(get_lane(lo, k)), inv_rms, load(get_lane(w_lo, k)), weight_offset)
                    put_lane(lo, k, store(v))
                put_chunk(x, t, h, half + unit * lanes, lo, cache, page, slot)

    return block_setup, store_cos_sin, head_squares, head_norm_rope


def build_qk_norm_rope_vector_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(x [T,heads,D], norm_weight [D], positions int32 [T], eps f32, weight_offset f32,
    rotary_dim int32, theta f32, group_threads int32)`` as build_qk_norm_rope_kernel, over 16-byte chunks.

    A block takes VECTOR_ROWS rows at a time (grid-stride over row pairs): a thread loads its
    unit of both rows before reducing either, so twice the bytes are in flight per thread (the
    kernel waits on memory latency, not bandwidth, with one row).

    Every chunk of x's heads and of norm_weight must be 16-byte aligned and rotary_dim / 2 a whole
    number of chunks (the launcher checks). blockDim.x is a multiple of group_threads (a power of
    two <= 32) and of 32 on the GPU. Launch with ``vector_shared_bytes(blockDim.x, rotary_dim,
    VECTOR_ROWS)`` bytes of dynamic shared memory.
    """
    block_setup, store_cos_sin, head_squares, head_norm_rope = build_vector_head(codec, round_before_weight)
    group_sum = build_group_sum()
    words = word_type(codec)

    @cuda.jit
    def qk_norm_rope_inplace_vector(x, norm_weight, positions, eps, weight_offset, rotary_dim, theta, group_threads):
        shared = cuda.shared.array(0, float32)  # dynamic: see norm.py
        lo = cuda.local.array(VECTOR_WORDS, words)  # a pair unit's first-half chunk, or a pass-through chunk
        hi = cuda.local.array(VECTOR_WORDS, words)  # a pair unit's second-half chunk
        lo_next = cuda.local.array(VECTOR_WORDS, words)  # the same for the block's second row
        hi_next = cuda.local.array(VECTOR_WORDS, words)
        w_lo = cuda.local.array(VECTOR_WORDS, words)
        w_hi = cuda.local.array(VECTOR_WORDS, words)
        rows = x.shape[0]
        heads = x.shape[1]
        head_dim = x.shape[2]
        half, pairs, units, lane, groups, one_unit, inv_freq_at, cos_at, sin_at = block_setup(
            shared, head_dim, rotary_dim, theta, group_threads)
        # The second row's cos/sin follow the first's (vector_shared_bytes with 2 rows).
        next_cos_at = sin_at + half
        next_sin_at = next_cos_at + half
        for t in range(VECTOR_ROWS * cuda.blockIdx.x, rows, VECTOR_ROWS * cuda.gridDim.x):
            t_next = t + 1
            has_next = t_next < rows
            store_cos_sin(shared, inv_freq_at, cos_at, sin_at, half, float32(positions[t]))
            if has_next:
                store_cos_sin(shared, inv_freq_at, next_cos_at, next_sin_at, half, float32(positions[t_next]))
            cuda.syncthreads()
            # Every thread runs every head round (group_sum needs the whole block / warp).
            for first_head in range(0, heads, groups):
                h = first_head + cuda.threadIdx.x // group_threads
                active = h < heads
                partial = float32(0.0)
                partial_next = float32(0.0)
                if active:
                    partial = head_squares(x, t, h, lane, group_threads, half, pairs, units, lo, hi)
                    if has_next:
                        partial_next = head_squares(x, t_next, h, lane, group_threads, half, pairs, units,
                                                    lo_next, hi_next)
                inv_rms = inv_rms_from_sum(group_sum(shared, partial, group_threads), head_dim, eps)
                inv_rms_next = inv_rms_from_sum(group_sum(shared, partial_next, group_threads), head_dim, eps)
                if active:
                    # No KV cache here: put_chunk ignores the (x, 0, 0) passed as cache, page, slot.
                    head_norm_rope(x, norm_weight, t, h, lane, group_threads, half, pairs, units, one_unit, inv_rms,
                                   weight_offset, shared, cos_at, sin_at, lo, hi, w_lo, w_hi, x, 0, 0)
                    if has_next:
                        head_norm_rope(x, norm_weight, t_next, h, lane, group_threads, half, pairs, units, one_unit,
                                       inv_rms_next, weight_offset, shared, next_cos_at, next_sin_at, lo_next,
                                       hi_next, w_lo, w_hi, x, 0, 0)
            cuda.syncthreads()  # every head has read these rows' cos/sin before the next rows' overwrite them

    return qk_norm_rope_inplace_vector


def vector_group_threads(head_dim: int, rotary_dim: int, lanes: int) -> int:
    """Threads per head in the vector kernel: one per unit (pair unit or pass-through chunk), at most a warp."""
    units = rotary_dim // 2 // lanes + (head_dim - rotary_dim) // lanes
    return min(MAX_GROUP_THREADS, 1 << max(0, math.ceil(math.log2(units))))


def vector_shared_bytes(threads: int, rotary_dim: int, rows: int = 1) -> int:
    """Dynamic shared memory of a vector kernel's block: the simulator's float32 reduction scratch
    (a word a thread), then inv_freq, then cos and sin for each of ``rows`` rows (rotary_dim / 2
    float32 each)."""
    return (threads + (1 + 2 * rows) * (rotary_dim // 2)) * 4


def build_qk_norm_rope_specialized_kernel(
    codec: Codec,
    round_before_weight: bool,
    head_dim: int,
    rotary_dim: int,
    heads: int,
    group_threads: int,
    heads_per_thread: int,
) -> Callable[..., Any]:
    """Kernel ``(x [T,heads,head_dim], norm_weight [head_dim], positions int32 [T], eps f32,
    weight_offset f32, theta f32)`` as build_qk_norm_rope_kernel, bf16 only, for this one shape
    (module docstring: "Specialized kernel").

    Every chunk of x's heads and of norm_weight must be 16-byte aligned and rotary_dim / 2 a whole
    number of chunks (the launcher checks); a head's units (rotary_dim / 16 pair units plus
    (head_dim - rotary_dim) / 8 pass-through chunks) must fit its ``group_threads`` threads (a power
    of two <= 32) and ``heads_per_thread`` (1, 2 or 4) divide heads. blockDim.x must cover the
    heads / heads_per_thread head slots of group_threads threads (threads past them idle) and be a
    multiple of 32 on the GPU (the shuffles). Launch with ``SCRATCH_BYTES_PER_THREAD * blockDim.x``
    bytes of dynamic shared memory in the simulator (group_sum's scratch), none on the GPU.
    """
    if np.dtype(codec.storage_numpy_dtype) != np.int16:
        raise ValueError(f"the specialized q/k norm + RoPE kernel is bf16 only, got codec {codec.name}")
    lanes = BF16_LANES
    half = rotary_dim // 2
    pairs = half // lanes
    units = pairs + (head_dim - rotary_dim) // lanes
    nh = heads_per_thread
    slots = heads // nh
    gt = group_threads
    if half % lanes or head_dim % lanes or not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"head_dim {head_dim}, rotary_dim {rotary_dim}: not whole 16-byte chunks of a head")
    if not units <= gt <= MAX_GROUP_THREADS or gt & (gt - 1):
        raise ValueError(f"group_threads {gt} must be a power of two in [{units} units, {MAX_GROUP_THREADS}]")
    if nh not in (1, 2, MAX_HEADS_PER_THREAD) or heads % nh:
        raise ValueError(f"heads_per_thread {nh} must be 1, 2 or 4 and divide heads {heads}")

    load = codec.load
    pack = build_pack_bf16x2()
    load_vector, store_vector = build_vector_access()
    group_sum = build_group_sum()

    @cuda.jit(device=True, **NVVM_INLINE)
    def element(words, k):
        """Element k of a unit buffer as float32: k < 8 in the first chunk (words 0-3), 8 <= k < 16
        in the second (words 4-7); the element at the lower address is a word's low half."""
        word = words[k // 2]
        return load(word >> 16) if k % 2 else load(word)

    @cuda.jit(device=True, **NVVM_INLINE)
    def rounded_pair(a, b):
        """a and b rounded to bf16 and back, as HF's separate ops round them: one cvt.rn.bf16x2."""
        word = pack(a, b)
        return load(word), load(word >> 16)

    @cuda.jit(device=True, **NVVM_INLINE)
    def chunk_squares(words, first):
        """Sum of the squares of the chunk's 8 elements, in element order (build_vector_head's squares)."""
        total = float32(0.0)
        for k in range(lanes):
            v = element(words, first + k)
            total += v * v
        return total

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
    def normalized_pair(x0, x1, w0, w1, inv_rms, weight_offset):
        """Two norm outputs before their final rounding: norm.build_normalize two at a time (with
        round_before_weight, norm(x) rounded in between, one cvt for both)."""
        if round_before_weight:
            n0, n1 = rounded_pair(x0 * inv_rms, x1 * inv_rms)
            return n0 * (weight_offset + w0), n1 * (weight_offset + w1)
        return x0 * inv_rms * (weight_offset + w0), x1 * inv_rms * (weight_offset + w1)

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

    @cuda.jit
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
        if active:
            load_vector(norm_weight, (col_lo,), w, 0)
            if pair:
                load_vector(norm_weight, (col_hi,), w, VECTOR_WORDS)
                for k in range(lanes):
                    inv_freq[k] = rope_inv_freq(unit * lanes + k, rotary_dim, theta)
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            # Every load of the row before any reduction; cos/sin while they are in flight.
            if active:
                load_unit(x, t, slot, col_lo, col_hi, pair, head0)
                if nh > 1:
                    load_unit(x, t, slot + slots, col_lo, col_hi, pair, head1)
                if nh > 2:
                    load_unit(x, t, slot + 2 * slots, col_lo, col_hi, pair, head2)
                    load_unit(x, t, slot + 3 * slots, col_lo, col_hi, pair, head3)
                if pair:
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

    return qk_norm_rope_specialized


@dataclass(frozen=True)
class SpecializedLaunch:
    """The specialized kernel's configuration for one shape (``specialized_launch``)."""

    group_threads: int  # GT: threads per head, one unit each
    heads_per_thread: int  # NH
    threads: int  # blockDim.x: heads / NH slots of GT threads, whole warps on the GPU
    blocks_per_sm: int  # the grid is this many blocks per SM (at most the row count)


def specialized_launch(
    heads: int, head_dim: int, rotary_dim: int, max_threads: int = MAX_THREADS, whole_warps: bool = True
) -> SpecializedLaunch | None:
    """The launch rule of the module docstring for a bf16 shape whose heads and rotary half are whole
    16-byte chunks, or None where the specialized kernel does not fit: a head with more than
    MAX_GROUP_THREADS units, or a block over ``max_threads``. ``whole_warps``: round the block up to
    a multiple of 32 (the GPU's shuffles; the simulator's launcher passes False)."""
    units = rotary_dim // 2 // BF16_LANES + (head_dim - rotary_dim) // BF16_LANES
    if units > MAX_GROUP_THREADS:
        return None
    group = vector_group_threads(head_dim, rotary_dim, BF16_LANES)
    per_thread = 1
    for n in (MAX_HEADS_PER_THREAD, 2):
        if heads % n == 0 and n * group <= MAX_SLOT_UNITS and heads // n * group >= MIN_SPECIALIZED_THREADS:
            per_thread = n
            break
    threads = heads // per_thread * group
    if whole_warps:
        threads = -(-threads // 32) * 32
    if threads > max_threads:
        return None
    blocks_per_sm = max(1, min(MAX_BLOCKS_PER_SM, UNITS_PER_SM // (heads * group)))
    return SpecializedLaunch(group, per_thread, threads, blocks_per_sm)


@functools.cache
def multiprocessor_count() -> int:
    """The current device's SM count, asked once per process (SIM_MULTIPROCESSORS in the simulator)."""
    if simulator_enabled():
        return SIM_MULTIPROCESSORS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def check_shape(name: str, a: Any, expected: tuple[int, ...]) -> None:
    """A launcher's shape check: ValueError naming the array, its shape and the expected one."""
    if tuple(a.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {expected}")


def check_rotary_dim(rotary_dim: int, head_dim: int) -> None:
    """ValueError unless rotary_dim is even and in [2, head_dim]."""
    if rotary_dim < 2 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")


class QkNormRopeInplace:
    """Launcher: per-head RMSNorm then partial NeoX RoPE, in place on ``x``.

    Arrays: x [T, heads, head_dim] in the codec's storage dtype (float32, or bf16
    viewed as int16), possibly a strided view; norm_weight [head_dim] (storage
    dtype); positions int32 [T]. Scalars: eps, weight_offset, theta (passed as
    float32), rotary_dim (even, 2 <= rotary_dim <= head_dim, passed as int32).
    Launch once for q and once for k. Kernels: the specialized one for its shape
    when ``uses_specialized`` (bf16, from ``specialized_min_rows`` rows: None
    never), else the 16-byte vector kernel when ``uses_vector``, else the scalar
    one; ``vectorize=False`` always runs the scalar one.
    """

    def __init__(
        self,
        codec: Codec,
        round_before_weight: bool,
        max_threads: int = MAX_THREADS,
        vectorize: bool = True,
        specialized_min_rows: int | None = SPECIALIZED_MIN_ROWS,
    ) -> None:
        self.codec = codec
        self.round_before_weight = round_before_weight
        self.kernel = Kernel(build_qk_norm_rope_kernel(codec, round_before_weight))
        self.vector_kernel = Kernel(build_qk_norm_rope_vector_kernel(codec, round_before_weight)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = min(block_limit(max_threads), MAX_THREADS)
        bf16 = np.dtype(codec.storage_numpy_dtype) == np.int16
        self.specialized_min_rows = specialized_min_rows if vectorize and bf16 else None
        self.simulated = simulator_enabled()
        # (heads, head_dim, rotary_dim) -> (launch, kernel) or None (the shape does not fit): built once.
        self._specialized: dict[tuple[int, int, int], tuple[SpecializedLaunch, Kernel] | None] = {}

    def uses_vector(self, x: Any, norm_weight: Any, rotary_dim: int) -> bool:
        """Whether a call with these arrays and rotary_dim runs a 16-byte kernel (vector or specialized)."""
        return (
            self.vector_kernel is not None
            and (rotary_dim // 2) % self.lanes == 0
            and vector_aligned(x, norm_weight)
        )

    def specialized(self, heads: int, head_dim: int, rotary_dim: int) -> tuple[SpecializedLaunch, Kernel] | None:
        """The specialized kernel for this shape and its launch (built on first use), or None where the
        shape does not fit it (``specialized_launch``). The caller checks 16-byte alignment."""
        key = (heads, head_dim, rotary_dim)
        if key not in self._specialized:
            launch = specialized_launch(heads, head_dim, rotary_dim, self.max_threads, not self.simulated)
            entry = None
            if launch is not None:
                kernel = build_qk_norm_rope_specialized_kernel(self.codec, self.round_before_weight, head_dim,
                                                               rotary_dim, heads, launch.group_threads,
                                                               launch.heads_per_thread)
                entry = (launch, Kernel(kernel))
            self._specialized[key] = entry
        return self._specialized[key]

    def uses_specialized(self, x: Any, norm_weight: Any, rotary_dim: int) -> bool:
        """Whether a call with these arrays and rotary_dim runs the specialized kernel."""
        rows, heads, head_dim = x.shape
        return (
            self.specialized_min_rows is not None
            and rows >= self.specialized_min_rows
            and self.uses_vector(x, norm_weight, rotary_dim)
            and self.specialized(heads, head_dim, rotary_dim) is not None
        )

    def __call__(
        self,
        x: Any,
        norm_weight: Any,
        positions: Any,
        eps: float,
        weight_offset: float,
        rotary_dim: int,
        theta: float,
        stream: Any = 0,
    ) -> None:
        rows, heads, head_dim = x.shape
        check_shape("norm_weight", norm_weight, (head_dim,))
        check_shape("positions", positions, (rows,))
        check_rotary_dim(rotary_dim, head_dim)
        if rows == 0 or heads == 0:
            return
        if self.uses_specialized(x, norm_weight, rotary_dim):
            launch, kernel = self.specialized(heads, head_dim, rotary_dim)
            blocks = min(rows, multiprocessor_count() * launch.blocks_per_sm)
            # Dynamic shared memory only for the simulator's group_sum (the GPU's shuffles need none).
            scratch = launch.threads * SCRATCH_BYTES_PER_THREAD if self.simulated else 0
            kernel[blocks, launch.threads, stream, scratch](
                x, norm_weight, positions, np.float32(eps), np.float32(weight_offset), np.float32(theta)
            )
            return
        if self.uses_vector(x, norm_weight, rotary_dim):
            group = vector_group_threads(head_dim, rotary_dim, self.lanes)
            threads = max(group, threads_for(group * heads, self.max_threads))
            blocks = -(-rows // VECTOR_ROWS)
            self.vector_kernel[blocks, threads, stream, vector_shared_bytes(threads, rotary_dim, VECTOR_ROWS)](
                x,
                norm_weight,
                positions,
                np.float32(eps),
                np.float32(weight_offset),
                np.int32(rotary_dim),
                np.float32(theta),
                np.int32(group),
            )
            return
        threads = threads_for(head_dim // 2, self.max_threads)
        shared = threads * SCRATCH_BYTES_PER_THREAD
        self.kernel[(rows, heads), threads, stream, shared](
            x,
            norm_weight,
            positions,
            np.float32(eps),
            np.float32(weight_offset),
            np.int32(rotary_dim),
            np.float32(theta),
        )
