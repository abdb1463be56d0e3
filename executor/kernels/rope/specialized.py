"""q/k RMSNorm + RoPE for prefill, specialized to its shape (bf16 only).

The math and every rounding are qk_norm_rope.py's (its module docstring). Its launcher takes this
kernel from routing.SPECIALIZED_ROPE_MIN_ROWS rows, for a bf16 call its vector kernel would take, where the
shape fits (``specialized_launch``), and builds it once per shape: head_dim, rotary_dim, heads, the
layout and its thread counts are compile-time constants (no integer division; every loop over
chunks, heads and rows' buffers unrolls into registers). On the H200 the vector kernel takes 251.9
us on Qwen3-8B's q (16384 x 32 x 128), 26% of copy bandwidth, waiting on latency and instructions;
this one drops its shared cos/sin tables and barriers. This module holds the entry point
(``build_qk_norm_rope_specialized_kernel``) and the launch rule; the two layouts' kernels are
unit_layout.py's and chunk_layout.py's, their shared bf16 functions bf16.py's.
Both layouts:

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
(layout.py); G is ``vector_group_threads`` (one unit a thread). A pair unit needs 8 rounded
cos/sin a row; the same unit of P adjacent head slots in a warp shares them (unit_layout's
``cos_sin_slots``: each computes 8 / P and gathers the rest by lane exchanges). On Qwen3-8B's q (8
pair units on 8 threads, P 4) every lane does the same work, 2 sincos a row. On Qwen3.5's strided
q (4 pair units and 24 pass-through chunks on 32 threads, 4 idle) a warp is one head, and it issues
the pair units' norm, rotation and 8 sincos for 4 lanes, then the pass-through path for 24: about
330-360 instructions a head in the loop's SASS (ptxas, slow paths left out), against about 77 a head
on Qwen3-8B's q (without the sharing); at 262,144 heads that is most of the time measured below.

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
group's GT threads add their partials by primitives/reduce.py's xor tree. With the vector kernel's group width
and the same roundings, the specialized kernel gives the vector kernel's bits, and so the fused
kernel's (fused_kv_write.py). Another order (a pair unit's 16 squares in one chain, say) moves some
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
heads, keeps NH * K <= 4 (a row's 64 bytes, 16 registers, a thread; 32 with both buffers) and leaves
the block at least 64 threads; pipelined; the grid is SM_REGISTERS / (128 * blockDim) blocks an SM
(``chunk_blocks_per_sm``), which the kernel's launch bounds also hold ptxas to (128 registers a
thread). Else the unit layout: NH the largest of 4, 2, 1 that divides heads, keeps NH * GT <= 64 and
leaves the block at least 64 threads (else 1); one row at a time, no launch bounds; the grid is
blocks_per_sm = 2048 / (heads * GT) blocks (at most 32) per SM, an SM holding 2048 (thread, head)
units of rows. Both: at most one block per row; the launcher asks the SM count once. Qwen3-8B's q
and k get the unit layout (64 frequencies: more than a warp's lanes; G would be 16, wider than the
unit layout's 8); Qwen3.5's q and k the chunk layout with K 4, G 8, NH 1 (q: 128 threads, 4 blocks
an SM; k: 32 threads, 16 blocks an SM).

Measured on the H200 (16384 rows; bytes = read + write of x; copy bandwidth 4.2 TB/s;
docs/benchmarks.md, "Memory-bound kernels"):

- Qwen3-8B q, unit layout, GT 8, NH 4, 64 threads, 8 blocks an SM (the rule's pick): 77.5 us, 82%
  (4,233 GB/s), with the 4 slots of a warp sharing cos/sin (2 sincos a thread; 96 registers, local
  ptxas), bit for bit the vector kernel's output on the GPU; 80.5 us, 79%, with 8 sincos a pair
  unit a row (101 registers; bench/kernels.py).
- Qwen3.5 strided q in the unit layout, GT 32 (NH 2, 256 threads, 4 blocks an SM): 191.5-211 us,
  about 33%. A sweep of NH and blocks an SM (events around one launch; the same bits from every
  configuration): NH 1 (512 threads, 72 registers) 293-304 us; NH 2 (256 threads, 84 registers) 205
  us at 2 blocks an SM, 242 at 3, 212 at 4, 216 at 6, 223 at 8; NH 4 (128 threads, 118 registers)
  276 at 2, 206 at 3, 176 at 4, 206 at 6, 185 at 8, 190 at 12, 196 at 16. Best: NH 4 at 4 blocks an
  SM, 176 us (36%).
- Qwen3.5 strided q, the chunk layout (the rule's K 4, G 8, NH 1, pipelined, 128 threads, 4 blocks
  an SM; 127 registers, 32 bytes of local memory: the sincos slow path): 70.1-70.9 us, 90% of copy
  bandwidth (bench/kernels.py, 4,223-4,233 GB/s), and bit for bit the vector kernel's output at
  16384 rows on the GPU (tests/kernels/test_rope.py). The other builds of SPECIALIZED_VARIANTS
  pass the same GPU test; their times are not measured (ptxas, CUDA 13.0, sm_90, Qwen3.5's q: K 4
  one row at a time 110 registers, K 2 NH 2 pipelined 113, K 2 NH 1 89, K 1 NH 4 128, K 1 NH 2 86;
  the pipelined unit layout on Qwen3-8B's q 130, 7 blocks of 64 threads an SM instead of 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import SM_BLOCKS, SM_REGISTERS, WARP_THREADS
from executor.kernels.rope.bf16 import BF16_LANES
from executor.kernels.rope.chunk_layout import build_chunk_kernel
from executor.kernels.rope.layout import MAX_GROUP_THREADS, MAX_THREADS, vector_group_threads
from executor.kernels.rope.unit_layout import build_unit_kernel
from executor.numba_cuda import launch_bounds

MAX_HEADS_PER_THREAD = 4  # NH is 4, 2 or 1 (the unit layout spells out four heads' buffers)
MIN_SPECIALIZED_THREADS = 64  # NH shrinks before the block gets smaller than two warps
MAX_SLOT_UNITS = 64  # unit layout: NH * GT at most (NH 4 for Qwen3's 8-thread groups)
UNITS_PER_SM = 2048  # unit layout: (thread, head) units an SM's blocks hold, 8 Qwen3-8B q rows
MAX_CHUNKS_PER_THREAD = 4  # chunk layout: K is 4, 2 or 1
MAX_SLOT_CHUNKS = 4  # chunk layout: NH * K at most, a row's 64 bytes (16 registers) a thread, 32 pipelined
CHUNK_THREAD_REGISTERS = 128  # chunk layout: registers a thread (launch bounds), 4 blocks of 128 threads an SM


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
    launch_options = launch_bounds((threads, min_blocks_per_sm) if min_blocks_per_sm else None)
    if chunks_per_thread == 0:
        return build_unit_kernel(codec, round_before_weight, head_dim, rotary_dim, heads, group_threads, nh,
                              pipelined, launch_options)
    if not chunk_layout_fits(head_dim, rotary_dim, chunks_per_thread):
        raise ValueError(f"head_dim {head_dim}, rotary_dim {rotary_dim}: no chunk layout with "
                         f"{chunks_per_thread} chunks a thread")
    if group_threads * chunks_per_thread != chunk_span(head_dim):
        raise ValueError(f"group_threads {group_threads} x chunks_per_thread {chunks_per_thread} must be "
                         f"{chunk_span(head_dim)}")
    return build_chunk_kernel(codec, round_before_weight, head_dim, rotary_dim, heads, group_threads, nh,
                              chunks_per_thread, pipelined, launch_options)


def block_threads(threads: int) -> int:
    """A block of ``threads`` threads rounded up to whole warps (the GPU's shuffles)."""
    return -(-threads // WARP_THREADS) * WARP_THREADS


def chunk_blocks_per_sm(threads: int) -> int:
    """The chunk layout's blocks an SM for a block of ``threads`` (whole warps): the register file
    at CHUNK_THREAD_REGISTERS a thread, at most SM_BLOCKS. The grid's blocks an SM, and the
    launch bound's minimum that holds ptxas to those registers."""
    return max(1, min(SM_BLOCKS, SM_REGISTERS // (CHUNK_THREAD_REGISTERS * threads)))


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
    return 2 * pairs <= group <= WARP_THREADS and half <= WARP_THREADS and units <= MAX_GROUP_THREADS


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
        if whole_warps or threads > WARP_THREADS:
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
    blocks_per_sm = max(1, min(SM_BLOCKS, UNITS_PER_SM // (heads * unit_group)))
    return SpecializedLaunch(unit_group, per_thread, threads, blocks_per_sm)


def _heads_per_thread(heads: int, group: int, fits: Callable[[int], bool]) -> int:
    """NH: the largest of 4, 2 that divides heads, ``fits`` and leaves the block at least
    MIN_SPECIALIZED_THREADS threads of ``group``-thread slots, else 1."""
    for n in (MAX_HEADS_PER_THREAD, 2):
        if heads % n == 0 and fits(n) and heads // n * group >= MIN_SPECIALIZED_THREADS:
            return n
    return 1
