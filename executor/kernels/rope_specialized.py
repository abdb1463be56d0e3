"""q/k RMSNorm + RoPE for prefill, specialized to its shape (bf16 only).

The math and every rounding are rope.py's (its module docstring). rope.py's launcher takes this
kernel from SPECIALIZED_MIN_ROWS rows, for a bf16 call its vector kernel would take, where the
shape fits (``specialized_launch``), and builds it once per shape: head_dim, rotary_dim, heads,
group threads GT and heads per thread NH are compile-time constants (no integer division; every
loop over a chunk unrolls into registers). On the H200 the vector kernel took 251.9 us on
Qwen3-8B's q (16384 x 32 x 128), 26% of copy bandwidth, waiting on latency and instructions;
this one drops its shared cos/sin tables and barriers:

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
(thread, head) units of rows, and at most one block per row; the launcher asks the SM count
once. That reproduces the best of a sweep on the H200 for both q shapes: Qwen3-8B
(GT 8, NH 4, 64 threads, 8 blocks an SM: 85.6 us) and Qwen3.5's strided q (GT 32, NH 2,
256 threads, 4 blocks an SM: about 255 us; NH 4 was not measured). ptxas (CUDA 13.0,
sm_90) gives those two 101 and 84 registers, no spills: 8 resident blocks an SM for
Qwen3-8B, but 2 of the 4 for Qwen3.5 (the register file), the first thing to tune there.
This kernel itself (bench/kernels.py on the H200, 2026-11-30): 80.5 us on Qwen3-8B's q (79%
of copy bandwidth) and 191.5 us on Qwen3.5's strided q.
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


def multiprocessor_count() -> int:
    """The current device's SM count (SIM_MULTIPROCESSORS in the simulator); a launcher asks once."""
    if simulator_enabled():
        return SIM_MULTIPROCESSORS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
