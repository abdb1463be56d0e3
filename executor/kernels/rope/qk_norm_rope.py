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
fused_kv_write.py fuses both with the KV write for decode-sized steps. One block
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
q/k norm + RoPE + KV cache write (fused_kv_write.py) runs too, bit for bit.

Specialized kernel (specialized.py): from routing.SPECIALIZED_ROPE_MIN_ROWS rows, a bf16 call the
vector kernel would take runs a kernel built for its shape, which sums squares in the vector
kernel's order and so gives its bits. layout.py holds what the two share: the thread
units of a head and the rotary frequencies.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel, multiprocessor_count
from executor.kernels.rows.norm import SCRATCH_BYTES_PER_THREAD, block_limit, build_normalize, inv_rms_from_sum
from executor.kernels.primitives.reduce import block_sum, build_group_sum, threads_for
from executor.kernels.rope.layout import MAX_THREADS, rope_inv_freq, vector_group_threads
from executor.kernels.rope.specialized import (
    SpecializedLaunch,
    build_qk_norm_rope_specialized_kernel,
    specialized_launch,
)
from executor.kernels.primitives.vector import (
    VECTOR_WORDS,
    build_lanes,
    build_vector_access,
    lanes_for,
    vector_aligned,
    word_type,
)
from executor.numba_cuda import load_cuda, simulator_enabled
from executor.routing import SPECIALIZED_ROPE_MIN_ROWS

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

VECTOR_ROWS = 2  # rows the vector kernel's block holds in flight at once


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
    j = cuda.threadIdx.x  # a while loop: a strided range() divides (64-bit) for its trip count
    while j < half:
        shared[inv_freq_at + j] = rope_inv_freq(j, rotary_dim, theta)
        j += cuda.blockDim.x


class VectorHead(NamedTuple):
    """build_vector_head's device functions (its docstring)."""

    block_setup: Callable[..., Any]
    store_cos_sin: Callable[..., Any]
    head_squares: Callable[..., Any]
    head_norm_rope: Callable[..., Any]
    unit_load: Callable[..., Any]
    unit_squares: Callable[..., Any]
    touch_weights: Callable[..., Any]


def build_vector_head(
    codec: Codec, round_before_weight: bool, put_chunk: Callable[..., Any] | None = None
) -> VectorHead:
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
        ignoring cache/page/slot), the hook the fused KV-cache kernel (fused_kv_write.py) uses
    unit_load(x, t, h, unit, half, pairs, lo, hi); unit_squares(unit, pairs, lo, hi) -> float32
        head_squares' two halves for one unit (unit < units): its chunks into ``lo``/``hi``, then
        their sum of squares, for a caller that issues other work between the loads and their use
    touch_weights(norm_weight, lane, half, pairs, units, w_lo, w_hi)
        the norm weight chunks of unit ``lane`` into ``w_lo``/``w_hi`` (nothing past ``units``), which
        head_norm_rope loads again after the reduction: issued before it, they are in L1 by then
        instead of a memory round trip

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
        j = cuda.threadIdx.x  # strided loops as while loops: a strided range() divides (64-bit) for its trip count
        while j < half:
            angle = position * shared[inv_freq_at + j]
            shared[cos_at + j] = rounded(float32(math.cos(angle)))
            shared[sin_at + j] = rounded(float32(math.sin(angle)))
            j += cuda.blockDim.x

    @cuda.jit(device=True, inline=True)
    def unit_load(x, t, h, unit, half, pairs, lo, hi):
        if unit < pairs:
            load_vector(x, (t, h, unit * lanes), lo, 0)
            load_vector(x, (t, h, half + unit * lanes), hi, 0)
        else:
            load_vector(x, (t, h, half + unit * lanes), lo, 0)  # rotary_dim + (unit - pairs) * lanes

    @cuda.jit(device=True, inline=True)
    def unit_squares(unit, pairs, lo, hi):
        if unit < pairs:
            return squares(lo) + squares(hi)
        return squares(lo)

    @cuda.jit(device=True, inline=True)
    def head_squares(x, t, h, lane, group_threads, half, pairs, units, lo, hi):
        partial = float32(0.0)
        unit = lane
        while unit < units:
            unit_load(x, t, h, unit, half, pairs, lo, hi)
            partial += unit_squares(unit, pairs, lo, hi)
            unit += group_threads
        return partial

    @cuda.jit(device=True, inline=True)
    def head_norm_rope(x, norm_weight, t, h, lane, group_threads, half, pairs, units, one_unit, inv_rms,
                       weight_offset, shared, cos_at, sin_at, lo, hi, w_lo, w_hi, cache, page, slot):
        unit = lane
        while unit < units:
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
            unit += group_threads

    @cuda.jit(device=True, inline=True)
    def touch_weights(norm_weight, lane, half, pairs, units, w_lo, w_hi):
        if lane < units:
            if lane < pairs:
                load_vector(norm_weight, (lane * lanes,), w_lo, 0)
            load_vector(norm_weight, (half + lane * lanes,), w_hi, 0)

    return VectorHead(block_setup, store_cos_sin, head_squares, head_norm_rope, unit_load, unit_squares,
                      touch_weights)


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
    block_setup, store_cos_sin, head_squares, head_norm_rope = build_vector_head(codec, round_before_weight)[:4]
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


def vector_shared_bytes(threads: int, rotary_dim: int, rows: int = 1) -> int:
    """Dynamic shared memory of a vector kernel's block: the simulator's float32 reduction scratch
    (a word a thread), then inv_freq, then cos and sin for each of ``rows`` rows (rotary_dim / 2
    float32 each)."""
    return (threads + (1 + 2 * rows) * (rotary_dim // 2)) * 4


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
        specialized_min_rows: int | None = SPECIALIZED_ROPE_MIN_ROWS,
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
        self._num_sms: int | None = None  # the device's, asked at the first specialized launch

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
                kernel = build_qk_norm_rope_specialized_kernel(
                    self.codec, self.round_before_weight, head_dim, rotary_dim, heads, launch.group_threads,
                    launch.heads_per_thread, chunks_per_thread=launch.chunks_per_thread, pipelined=launch.pipelined)
                entry = (launch, Kernel(kernel))
            self._specialized[key] = entry
        return self._specialized[key]

    def uses_specialized(self, x: Any, norm_weight: Any, rotary_dim: int) -> bool:
        """Whether a call with these arrays and rotary_dim runs the specialized kernel."""
        return self._specialized_for(x, rotary_dim, self.uses_vector(x, norm_weight, rotary_dim)) is not None

    def _specialized_for(self, x: Any, rotary_dim: int, vector: bool) -> tuple[SpecializedLaunch, Kernel] | None:
        """The specialized kernel a call on ``x`` runs, given whether it may run a 16-byte kernel, or None."""
        rows, heads, head_dim = x.shape
        if not vector or self.specialized_min_rows is None or rows < self.specialized_min_rows:
            return None
        return self.specialized(heads, head_dim, rotary_dim)

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
        vector = self.uses_vector(x, norm_weight, rotary_dim)
        specialized = self._specialized_for(x, rotary_dim, vector)
        if specialized is not None:
            launch, kernel = specialized
            if self._num_sms is None:
                self._num_sms = multiprocessor_count()
            blocks = min(rows, self._num_sms * launch.blocks_per_sm)
            # Dynamic shared memory only for the simulator's group_sum (the GPU's shuffles need none).
            scratch = launch.threads * SCRATCH_BYTES_PER_THREAD if self.simulated else 0
            kernel[blocks, launch.threads, stream, scratch](
                x, norm_weight, positions, np.float32(eps), np.float32(weight_offset), np.float32(theta)
            )
            return
        if vector:
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
