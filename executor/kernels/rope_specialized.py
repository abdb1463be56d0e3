"""q/k RMSNorm + RoPE for prefill, specialized to its shape (bf16 only).

The math and every rounding are rope.py's (its module docstring). rope.py's launcher takes this
kernel from SPECIALIZED_MIN_ROWS rows, for a bf16 call its vector kernel would take, where the
shape fits (``specialized_launch``), and builds it once per shape: head_dim, rotary_dim, heads, the
layout and its thread counts are compile-time constants (no integer division; every loop over
chunks, heads and rows' buffers unrolls into registers). On the H200 the vector kernel took 251.9
us on Qwen3-8B's q (16384 x 32 x 128), 26% of copy bandwidth, waiting on latency and instructions;
this one drops its shared cos/sin tables and barriers. Both layouts below:

- a head's G threads (``group_threads``, GT) own it, and a thread holds its part of NH heads of a
  row, heads ``slot + n * SLOTS`` (n < NH; SLOTS = heads / NH head slots of G threads; blockDim =
  SLOTS * G rounded up to whole warps, extra slots idle), all loaded before any reduction;
- a block takes one row at a time (grid-stride over rows), or, pipelined, two rows a trip: it
  issues the loads of its next row into a second set of buffers before it reduces, computes and
  stores the current one, so one row's loads are in flight while the other row computes (a
  buffer set's loads land a whole row's work after they are issued; the row index is the
  block's, so every branch of the loop is uniform);
- the norm weight and the rotary frequencies go into registers once per block: no shared memory
  and no barrier on the GPU (the simulator's shuffles go through a shared scratch);
- roundings go two at a time through PTX ``cvt.rn.bf16x2.f32`` (mma.build_pack_bf16x2), the codec
  store's round-to-nearest-even: every HF rounding above, no other.

Unit layout (``chunks_per_thread`` 0): a thread owns one unit of each of its heads, a pair unit
(chunk j of the rotary first half with chunk j of the second) or a pass-through chunk
(rope_layout.py); G is ``vector_group_threads`` (one unit a thread), and a pair unit computes its
own 8 rounded cos/sin a row. On Qwen3-8B's q (8 pair units on 8 threads) every lane does the same
work. On Qwen3.5's strided q (4 pair units and 24 pass-through chunks on 32 threads, 4 idle) a warp
is one head, and it issues the pair units' norm, rotation and 8 sincos for 4 lanes, then the
pass-through path for 24: about 330-360 instructions a head in the loop's SASS (ptxas, slow paths
left out), against about 77 a head on Qwen3-8B's q; at 262,144 heads that is most of the time
measured below.

Chunk layout (``chunks_per_thread`` K = 1, 2 or 4): a head's 16-byte chunks in memory order, lane u
of its G-lane group holding chunks u + m G (chunk slot m < K; G K = SPAN, the head's chunks rounded
up to a power of two; slots past the head hold zeros). Every chunk is normed alike (a pass-through
chunk's output, a rotary chunk's HF q_norm output); the rotary chunks, 2 P of them for P pair units,
all on slot 0 (2 P <= G), then take the partner chunk's normed words from lane u + P or u - P (4
shuffles) and rotate: out = round(n cos) + round(partner * (-sin or +sin)), the sin negated for a
first-half chunk (a - b sin is a + b (-sin) in IEEE arithmetic, its rounding included). The row's
cos/sin: warp lane j < rotary_dim / 2 computes frequency j's rounded (cos, sin) as one word, and a
rotary lane gathers its 8 (8 shuffles): one sincos a lane a row, where the unit layout has 8 a pair
unit. With K = 4 on Qwen3.5's q (G = 8: lanes 0-3 hold first-half chunks, lanes 4-7 the second-half
ones, slots 1-3 pass-through chunks) no lane diverges, and the loop's SASS issues about 100-112
instructions a head.

Sum of squares, deliberately in build_vector_head's order: a thread sums its chunk's 8 squares in
element order (a pair unit: the first-half chunk's sum plus the second-half chunk's), then the
group's GT threads add their partials by reduce.py's xor tree. With the vector kernel's group width
and the same roundings, the specialized kernel gives the vector kernel's bits, and so the fused
kernel's (qk_rope_kv.py). Another order (a pair unit's 16 squares in one chain, say) moves some
heads' inv_rms by an ulp, which flips a rare rounding; tests/kernels/test_rope.py has inputs that
show it. The chunk layout builds the same sums: each chunk's 8-square chain S, then unit v = u + m
G's partial on lane u's slot m, S(chunk v) + S(chunk v + P) for a pair unit, S(chunk v + P) for a
pass-through one and zero past the units, chunk v + P's S taken from lane (u + P) mod G, slot m or
m + 1 (K shuffles); then the vector kernel's xor tree over SPAN unit lanes, whose first log2 K
levels (offsets SPAN / 2 down to G) are the thread's own adds over its slots, slots m and m + K / 2
first, and its last levels the group's shuffles over its G lanes. Where SPAN is wider than the
vector kernel's GT, the tree's top levels add zeros, which change no sum. (Adding adjacent slots
first would be another order; the tests have inputs that show that one too.)

Launch rule (``specialized_launch``): the chunk layout where its group is narrower than the unit
layout's: G = max(2 P, SPAN / 4) < ``vector_group_threads`` and ``chunk_layout_fits`` (at most 32
units, rotary_dim / 2 at most a warp's lanes); K = SPAN / G, NH the largest of 4, 2, 1 that divides
heads, keeps NH * K <= 4 (a row's 64 bytes, 16 registers, a thread; 32 with both buffers) and
leaves the block at least 64 threads; pipelined; the grid is REGISTERS_PER_SM / (128 * blockDim)
blocks an SM (``chunk_blocks_per_sm``), which the kernel's launch bounds also hold ptxas to (128
registers a thread). Else the unit layout: NH the largest of 4, 2, 1 that divides heads, keeps NH
* GT <= 64 and leaves the block at least 64 threads (else 1); one row at a time, no launch bounds;
the grid is blocks_per_sm = 2048 / (heads * GT) blocks (at most 32) per SM, an SM holding 2048
(thread, head) units of rows. Both: at most one block per row; the launcher asks the SM count once.
Qwen3-8B's q and k get the unit layout (64 frequencies: more than a warp's lanes; G would be 16,
wider than the unit layout's 8), built exactly as before (ptxas's SASS is the same instruction for
instruction); Qwen3.5's q and k the chunk layout with K 4, G 8, NH 1 (q: 128 threads, 4 blocks an
SM; k: 32 threads, 16 blocks an SM).

Measured on the H200 (16384 rows; bytes = read + write of x; copy bandwidth 4.2 TB/s):

- Qwen3-8B q, unit layout, GT 8, NH 4, 64 threads, 8 blocks an SM (the rule's pick, unchanged):
  80.5 us, 79% of copy bandwidth (bench/kernels.py, 2026-11-30).
- Qwen3.5 strided q, unit layout, GT 32 (the rule's pick before the chunk layout: NH 2, 256
  threads, 4 blocks an SM): 191.5-211 us, about 33%. A sweep of NH and blocks an SM (events around
  one launch; the same bits from every configuration): NH 1 (512 threads, 72 registers) 293-304
  us; NH 2 (256 threads, 84 registers) 205 us at 2 blocks an SM, 242 at 3, 212 at 4, 216 at 6,
  223 at 8; NH 4 (128 threads, 118 registers) 276 at 2, 206 at 3, 176 at 4, 206 at 6, 185 at 8,
  190 at 12, 196 at 16. Best: NH 4 at 4 blocks an SM, 176 us (36%).
- Qwen3.5 strided q, the chunk layout (the rule's K 4, G 8, NH 1, pipelined, 128 threads, 4 blocks
  an SM; 127 registers, 32 bytes of local memory: the sincos slow path): 70.9 us, 90% of copy
  bandwidth (bench/kernels.py, 2026-11-30, 4,223 GB/s), and bit for bit the vector kernel's output
  at 16384 rows on the GPU (tests/kernels/test_rope.py). The other builds of SPECIALIZED_VARIANTS
  passed the same GPU test; their times are not measured (ptxas, CUDA 13.0, sm_90, Qwen3.5's q: K 4
  one row at a time 110 registers, K 2 NH 2 pipelined 113, K 2 NH 1 89, K 1 NH 4 128, K 1 NH 2 86;
  the pipelined unit layout on Qwen3-8B's q 130, 7 blocks of 64 threads an SM instead of 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from executor.kernels.codec import Codec
from executor.kernels.mma import build_pack_bf16x2
from executor.kernels.norm import inv_rms_from_sum
from executor.kernels.reduce import build_group_sum
from executor.kernels.rope_layout import MAX_GROUP_THREADS, MAX_THREADS, rope_inv_freq, vector_group_threads
from executor.kernels.vector import VECTOR_BYTES, VECTOR_WORDS, build_vector_access
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

# Specialized kernel (module docstring). Rows from which a call takes it: prefill chunks; decode
# steps (at most qk_rope_kv.MAX_FUSED_ROWS rows) take the fused kernel, and the few-row calls left
# keep the vector kernel's wider blocks (the specialized kernel was measured at 16384 rows only).
SPECIALIZED_MIN_ROWS = 256
BF16_LANES = VECTOR_BYTES // 2  # bf16 elements in a 16-byte chunk: the specialized kernel is bf16 only
UNIT_WORDS = 2 * VECTOR_WORDS  # a thread's unit of one head: two chunks (a pass-through unit uses the first)
MAX_HEADS_PER_THREAD = 4  # NH is 4, 2 or 1 (the unit layout spells out four heads' buffers)
MIN_SPECIALIZED_THREADS = 64  # NH shrinks before the block gets smaller than two warps
MAX_SLOT_UNITS = 64  # unit layout: NH * GT at most (NH 4 for Qwen3's 8-thread groups)
UNITS_PER_SM = 2048  # unit layout: (thread, head) units an SM's blocks hold, 8 Qwen3-8B q rows
MAX_CHUNKS_PER_THREAD = 4  # chunk layout: K is 4, 2 or 1
MAX_SLOT_CHUNKS = 4  # chunk layout: NH * K at most, a row's 64 bytes (16 registers) a thread, 32 pipelined
CHUNK_THREAD_REGISTERS = 128  # chunk layout: registers a thread (launch bounds), 4 blocks of 128 threads an SM
REGISTERS_PER_SM = 65536  # sm_90's register file
MAX_BLOCKS_PER_SM = 32  # sm_90's resident blocks per SM
WARP = 32
SIGN_BIT = -(1 << 31)  # 0x80000000 as an int32: the sign bit of a word's upper bf16
SIM_MULTIPROCESSORS = 2  # the simulator has no SM count; a small grid keeps its Python threads few
# The specialized kernel's device functions are inlined by NVVM (alwaysinline), as sampler.py's: Numba's
# IR inlining copies the callee's IR at every call, and the nested calls took the sm_90 compile of
# Qwen3-8B's q kernel to about a minute. Inlined somewhere they must be, for the buffers to stay in
# registers. The simulator's jit takes no forceinline.
NVVM_INLINE = {} if simulator_enabled() else {"forceinline": True}


def build_qk_norm_rope_specialized_kernel(
    codec: Codec,
    round_before_weight: bool,
    head_dim: int,
    rotary_dim: int,
    heads: int,
    group_threads: int,
    heads_per_thread: int,
    chunks_per_thread: int | None = None,
    pipelined: bool | None = None,
    min_blocks_per_sm: int | None = None,
) -> Callable[..., Any]:
    """Kernel ``(x [T,heads,head_dim], norm_weight [head_dim], positions int32 [T], eps f32,
    weight_offset f32, theta f32)`` as build_qk_norm_rope_kernel, bf16 only, for this one shape
    (module docstring: "Specialized kernel").

    Every chunk of x's heads and of norm_weight must be 16-byte aligned and rotary_dim / 2 a whole
    number of chunks (the launcher checks); ``heads_per_thread`` (1, 2 or 4) must divide heads.
    ``chunks_per_thread`` picks the layout: 0 the unit layout (a head's units, rotary_dim / 16 pair
    units plus (head_dim - rotary_dim) / 8 pass-through chunks, must fit its ``group_threads``
    threads, a power of two <= 32), 1, 2 or 4 the chunk layout (``group_threads`` *
    chunks_per_thread must be ``chunk_span(head_dim)``; ``chunk_layout_fits``); None: the unit
    layout where the units fit ``group_threads`` threads, else the chunk layout
    (``default_chunks_per_thread``), which is what ``specialized_launch``'s configuration builds.
    ``pipelined`` (None: the chunk layout pipelines, the unit layout does not) loads a block's next
    row before it finishes the current one. ``min_blocks_per_sm``: the GPU build's launch bounds,
    (that many blocks an SM, of ``block_threads(heads / heads_per_thread * group_threads)``
    threads), which cap ptxas's registers; 0 none; None: the chunk layout's
    ``chunk_blocks_per_sm`` of that block, none for the unit layout.

    blockDim.x must cover the heads / heads_per_thread head slots of group_threads threads
    (threads past them idle) and be a multiple of 32 on the GPU (the shuffles), at most the launch
    bounds' block; in the simulator the chunk layout's block must also be whole groups and cover
    its first ``rotary_dim / 2`` threads (the frequency lanes), or be whole warps. Launch with
    ``SCRATCH_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory in the simulator
    (group_sum's and the lane exchanges' scratch), none on the GPU.
    """
    if np.dtype(codec.storage_numpy_dtype) != np.int16:
        raise ValueError(f"the specialized q/k norm + RoPE kernel is bf16 only, got codec {codec.name}")
    lanes = BF16_LANES
    half = rotary_dim // 2
    if half % lanes or head_dim % lanes or not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"head_dim {head_dim}, rotary_dim {rotary_dim}: not whole 16-byte chunks of a head")
    nh = heads_per_thread
    if nh not in (1, 2, MAX_HEADS_PER_THREAD) or heads % nh:
        raise ValueError(f"heads_per_thread {nh} must be 1, 2 or 4 and divide heads {heads}")
    if chunks_per_thread is None:
        chunks_per_thread = default_chunks_per_thread(head_dim, rotary_dim, group_threads)
    if pipelined is None:
        pipelined = chunks_per_thread > 0
    threads = block_threads(heads // nh * group_threads)
    if min_blocks_per_sm is None:
        min_blocks_per_sm = chunk_blocks_per_sm(threads) if chunks_per_thread else 0
    # The simulator's jit takes no launch_bounds (and has no registers to bound).
    launch_options = {} if simulator_enabled() or not min_blocks_per_sm else {
        "launch_bounds": (threads, min_blocks_per_sm)}
    if chunks_per_thread == 0:
        return _build_unit_kernel(codec, round_before_weight, head_dim, rotary_dim, heads, group_threads, nh,
                                  pipelined, launch_options)
    if not chunk_layout_fits(head_dim, rotary_dim, chunks_per_thread):
        raise ValueError(f"head_dim {head_dim}, rotary_dim {rotary_dim}: no chunk layout with "
                         f"{chunks_per_thread} chunks a thread")
    if group_threads * chunks_per_thread != chunk_span(head_dim):
        raise ValueError(f"group_threads {group_threads} x chunks_per_thread {chunks_per_thread} must be "
                         f"{chunk_span(head_dim)}")
    return _build_chunk_kernel(codec, round_before_weight, head_dim, rotary_dim, heads, group_threads, nh,
                               chunks_per_thread, pipelined, launch_options)


def _bf16_functions(codec: Codec, round_before_weight: bool) -> tuple[Callable[..., Any], ...]:
    """Device functions both layouts use: ``(element, rounded_pair, chunk_squares, normalized_pair)``
    (each documented below)."""
    load = codec.load
    pack = build_pack_bf16x2()
    lanes = BF16_LANES

    @cuda.jit(device=True, **NVVM_INLINE)
    def element(words, k):
        """Element k of a buffer of chunks as float32: k < 8 in the first chunk (words 0-3), 8 <= k < 16
        in the second (words 4-7), ...; the element at the lower address is a word's low half."""
        word = words[k // 2]
        return load(word >> 16) if k % 2 else load(word)

    @cuda.jit(device=True, **NVVM_INLINE)
    def rounded_pair(a, b):
        """a and b rounded to bf16 and back, as HF's separate ops round them: one cvt.rn.bf16x2."""
        word = pack(a, b)
        return load(word), load(word >> 16)

    @cuda.jit(device=True, **NVVM_INLINE)
    def chunk_squares(words, first):
        """Sum of the squares of the chunk's 8 elements from element ``first``, in element order
        (build_vector_head's squares)."""
        total = float32(0.0)
        for k in range(lanes):
            v = element(words, first + k)
            total += v * v
        return total

    @cuda.jit(device=True, **NVVM_INLINE)
    def normalized_pair(x0, x1, w0, w1, inv_rms, weight_offset):
        """Two norm outputs before their final rounding: norm.build_normalize two at a time (with
        round_before_weight, norm(x) rounded in between, one cvt for both)."""
        if round_before_weight:
            n0, n1 = rounded_pair(x0 * inv_rms, x1 * inv_rms)
            return n0 * (weight_offset + w0), n1 * (weight_offset + w1)
        return x0 * inv_rms * (weight_offset + w0), x1 * inv_rms * (weight_offset + w1)

    return element, rounded_pair, chunk_squares, normalized_pair


def _build_unit_kernel(
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
    element, rounded_pair, chunk_squares, normalized_pair = _bf16_functions(codec, round_before_weight)

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
        return cuda.shfl_sync(0xFFFFFFFF, value, source & (WARP - 1))

    return exchange_shuffle


def _build_chunk_kernel(
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
    element, rounded_pair, chunk_squares, normalized_pair = _bf16_functions(codec, round_before_weight)

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
        warp_lane = tid % WARP
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


def block_threads(threads: int) -> int:
    """A block of ``threads`` threads rounded up to whole warps (the GPU's shuffles)."""
    return -(-threads // WARP) * WARP


def chunk_blocks_per_sm(threads: int) -> int:
    """The chunk layout's blocks an SM for a block of ``threads`` (whole warps): the register file
    at CHUNK_THREAD_REGISTERS a thread, at most MAX_BLOCKS_PER_SM. The grid's blocks an SM, and the
    launch bound's minimum that holds ptxas to those registers."""
    return max(1, min(MAX_BLOCKS_PER_SM, REGISTERS_PER_SM // (CHUNK_THREAD_REGISTERS * threads)))


def chunk_span(head_dim: int) -> int:
    """A head's 16-byte chunks rounded up to a power of two: the chunk layout's lanes times chunks a thread."""
    return 1 << max(0, math.ceil(math.log2(head_dim // BF16_LANES)))


def chunk_layout_fits(head_dim: int, rotary_dim: int, chunks_per_thread: int) -> bool:
    """Whether the chunk layout takes this head with ``chunks_per_thread`` (1, 2 or 4) chunks a thread:
    the rotary chunks on the first lanes' slot 0 (2 * pairs <= group), the rotary half's frequencies
    on a warp's lanes (rotary_dim / 2 <= 32), the group at most a warp, and at most 32 units (the
    vector kernel's one-unit-a-lane order)."""
    half = rotary_dim // 2
    pairs = half // BF16_LANES
    units = head_dim // BF16_LANES - pairs
    span = chunk_span(head_dim)
    if chunks_per_thread not in (1, 2, MAX_CHUNKS_PER_THREAD) or span % chunks_per_thread:
        return False
    group = span // chunks_per_thread
    return 2 * pairs <= group <= WARP and half <= WARP and units <= MAX_GROUP_THREADS


def default_chunks_per_thread(head_dim: int, rotary_dim: int, group_threads: int) -> int:
    """The layout a builder call without chunks_per_thread gets: 0 (the unit layout) where a head's
    units fit ``group_threads`` threads, else the chunk layout over ``group_threads`` lanes."""
    units = head_dim // BF16_LANES - rotary_dim // 2 // BF16_LANES
    if units <= group_threads:
        return 0
    return max(1, chunk_span(head_dim) // group_threads)


@dataclass(frozen=True)
class SpecializedLaunch:
    """The specialized kernel's configuration for one shape (``specialized_launch``)."""

    group_threads: int  # GT: threads per head (unit layout: one unit each; chunk layout: its lanes)
    heads_per_thread: int  # NH
    threads: int  # blockDim.x: heads / NH slots of GT threads, whole warps on the GPU
    blocks_per_sm: int  # the grid is this many blocks per SM (at most the row count)
    chunks_per_thread: int = 0  # K: 0 the unit layout, else the chunk layout's chunks a thread
    pipelined: bool = False  # a block loads its next row before it finishes the current one


def specialized_launch(
    heads: int, head_dim: int, rotary_dim: int, max_threads: int = MAX_THREADS, whole_warps: bool = True
) -> SpecializedLaunch | None:
    """The launch rule of the module docstring for a bf16 shape whose heads and rotary half are whole
    16-byte chunks, or None where the specialized kernel does not fit: a head with more than
    MAX_GROUP_THREADS units, or a block over ``max_threads``. ``whole_warps``: round the block up to
    a multiple of 32 (the GPU's shuffles; the simulator's launcher passes False)."""
    half = rotary_dim // 2
    pairs = half // BF16_LANES
    units = pairs + (head_dim - rotary_dim) // BF16_LANES
    if units > MAX_GROUP_THREADS:
        return None
    unit_group = vector_group_threads(head_dim, rotary_dim, BF16_LANES)
    span = chunk_span(head_dim)
    chunk_group = max(2 * pairs, span // MAX_CHUNKS_PER_THREAD)
    if chunk_group < unit_group and chunk_layout_fits(head_dim, rotary_dim, span // chunk_group):
        per_chunk = span // chunk_group
        per_thread = _heads_per_thread(heads, chunk_group, lambda n: n * per_chunk <= MAX_SLOT_CHUNKS)
        threads = heads // per_thread * chunk_group
        if whole_warps or threads > WARP:
            threads = block_threads(threads)
        else:  # the simulator: whole groups covering the frequency lanes
            threads = -(-max(threads, half) // chunk_group) * chunk_group
        if threads > max_threads:
            return None
        blocks_per_sm = chunk_blocks_per_sm(block_threads(threads))
        return SpecializedLaunch(chunk_group, per_thread, threads, blocks_per_sm, per_chunk, True)
    per_thread = _heads_per_thread(heads, unit_group, lambda n: n * unit_group <= MAX_SLOT_UNITS)
    threads = heads // per_thread * unit_group
    if whole_warps:
        threads = block_threads(threads)
    if threads > max_threads:
        return None
    blocks_per_sm = max(1, min(MAX_BLOCKS_PER_SM, UNITS_PER_SM // (heads * unit_group)))
    return SpecializedLaunch(unit_group, per_thread, threads, blocks_per_sm)


def _heads_per_thread(heads: int, group: int, fits: Callable[[int], bool]) -> int:
    """NH: the largest of 4, 2 that divides heads, ``fits`` and leaves the block at least
    MIN_SPECIALIZED_THREADS threads of ``group``-thread slots, else 1."""
    for n in (MAX_HEADS_PER_THREAD, 2):
        if heads % n == 0 and fits(n) and heads // n * group >= MIN_SPECIALIZED_THREADS:
            return n
    return 1


def multiprocessor_count() -> int:
    """The current device's SM count (SIM_MULTIPROCESSORS in the simulator); a launcher asks once."""
    if simulator_enabled():
        return SIM_MULTIPROCESSORS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
