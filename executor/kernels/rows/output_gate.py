"""Qwen3.5's output gate, ``x <- x * sigmoid(gate)`` in place on the attention output.

It computes in float32 and mirrors HF's rounding in the model dtype, as activation.py's SwiGLU
does: the sigmoid is rounded to storage before the multiply, and the product is rounded again
(the identity with the F32 codec). ``exp`` is fed ``min(-g, 100)`` for the simulator's float64
``math.exp`` (activation.py). The scalar kernel is the fallback for views whose chunks are not
16-byte aligned; the vector kernel does the same per-element arithmetic on 16-byte chunks
(vector.py). Both give the same bits.

In SwiGLU's layout (activation.py: a block per row tile, VECTOR_UNROLL chunks in flight per
thread and array, 85% of copy bandwidth on the H200) this kernel took 143.4 us at Qwen3.5-9B's
prefill shape (16384 x 16 x 256, strided gate; bench/kernels.py, 69%): the same bytes and
per-element arithmetic as SwiGLU's kernel, but each block lives for one row and 2 chunks a thread,
and each thread divides (64-bit, with a 32-bit fast path) for both range loops and twice for each
chunk's head (``chunk // per_head``). The fast path of that loop is about 290 SASS instructions a
chunk against SwiGLU's 235 (static count, ptxas 13.0, sm_90), and the exact sigmoid makes these the
busiest of the row kernels: each short block's loads are too few to cover the time its warps spend
issuing that arithmetic (a reading, not profiled).

So the vector kernel (``build_sigmoid_mul_inplace_vector_kernel``) is
persistent: a thread owns one 16-byte column of a row (its head and offset
divided out once) and walks rows grid-stride, loading ``rows_unroll`` rows'
chunks of x and of the gate (2 x rows_unroll independent 16-byte loads) before
its first store. The grid is ``blocks_per_sm`` blocks an SM (the launcher asks
the SM count once) and the kernel's launch bounds make ptxas fit them all in the
register file: one wave, no division in the row loop. Its fast path is 230-245
SASS instructions a bf16 chunk.

Swept on the H200 (CUDA-graph timing, the shape above, copy bandwidth 4,149 GB/s;
docs/benchmarks.md, "Row kernel sweeps"), threads x blocks an SM x rows: 256 x 4 x 2
105.8 us (92%), 128 x 8 x 2 106.9, 256 x 3 x 4 108.1, 128 x 6 x 4 109.6, 256 x 4 x 1
113.4, 256 x 4 x 4 118.8 (spills), 256 x 2 x 4 127.7, 512 x 2 x 2 141.8. The defaults
below are the first; with them, bench/kernels.py measures 105.0 us (91% of 4,223 GB/s;
docs/benchmarks.md, "Memory-bound kernels").
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import (
    BLOCK_THREADS, SM_BLOCKS, SM_THREADS, WARP_THREADS, Kernel, multiprocessor_count,
)
from executor.kernels.primitives.reduce import check_max_threads, threads_for
from executor.kernels.primitives.grid import MAX_COLUMN_BLOCKS, UNROLL
from executor.kernels.primitives.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import launch_bounds as jit_launch_bounds, load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

MAX_THREADS = 256  # the scalar kernel's block
# The vector kernel's defaults (module docstring): threads per block,
# blocks per SM (grid size and launch bounds) and rows a thread loads before its first store. ptxas 13.0
# (sm_90) fits 256 x 4 x 2 in 64 registers without spills (256 x 3 x 4 in 80; 256 x 4 x 4 spills).
GATE_THREADS = 256
GATE_BLOCKS_PER_SM = 4
GATE_ROWS_UNROLL = 2
# At 6 and 8 rows the chunk buffers' loops stayed rolled and the buffers went to local memory.
MAX_GATE_ROWS_UNROLL = 4


@cuda.jit(device=True, inline=True)
def sigmoid(g):
    """float32 ``1 / (1 + exp(-g))``, torch's formula."""
    return float32(1.0) / (float32(1.0) + float32(math.exp(min(-g, float32(100.0)))))


def build_gated(codec: Codec) -> Callable[..., Any]:
    """Device function ``(x, gate) -> x element``, storage in and out: ``store(x * round(sigmoid(gate)))``."""
    load, store = codec.load, codec.store

    @cuda.jit(device=True, inline=True)
    def gated(x_bits, gate_bits):
        return store(load(x_bits) * load(store(sigmoid(load(gate_bits)))))

    return gated


def build_sigmoid_mul_inplace_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(x [T, heads, D], gate [T, heads, D])``: ``x = store(x * round(sigmoid(gate)))``.

    Grid x over rows (grid-stride), y over heads; threads stride over D.
    """
    gated = build_gated(codec)

    @cuda.jit
    def sigmoid_mul_inplace(x, gate):
        h = cuda.blockIdx.y
        head_dim = x.shape[2]
        step = cuda.blockDim.x
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            # Each element is read and written by this thread alone.
            for d in range(cuda.threadIdx.x, head_dim, step * UNROLL):
                if d + 3 * step < head_dim:  # a full tile: all loads, then all stores
                    x0, x1 = x[t, h, d], x[t, h, d + step]
                    x2, x3 = x[t, h, d + 2 * step], x[t, h, d + 3 * step]
                    g0, g1 = gate[t, h, d], gate[t, h, d + step]
                    g2, g3 = gate[t, h, d + 2 * step], gate[t, h, d + 3 * step]
                    x[t, h, d] = gated(x0, g0)
                    x[t, h, d + step] = gated(x1, g1)
                    x[t, h, d + 2 * step] = gated(x2, g2)
                    x[t, h, d + 3 * step] = gated(x3, g3)
                else:  # the head's ragged end
                    for j in range(d, head_dim, step):
                        x[t, h, j] = gated(x[t, h, j], gate[t, h, j])

    return sigmoid_mul_inplace


def check_rows_unroll(rows_unroll: int) -> int:
    """``rows_unroll`` after checking it is in [1, MAX_GATE_ROWS_UNROLL]."""
    if not 1 <= rows_unroll <= MAX_GATE_ROWS_UNROLL:
        raise ValueError(f"rows_unroll must be in [1, {MAX_GATE_ROWS_UNROLL}], got {rows_unroll}")
    return rows_unroll


def build_chunk_gate(codec: Codec) -> Callable[..., Any]:
    """Device function ``chunk_gate(xs, gs, u)``: chunk ``u`` of word buffer xs <- ``gated`` lane by lane with gs.

    (A bf16 variant rounding two lanes at a time through PTX ``cvt.rn.bf16x2.f32``
    saved at most 4 of some 240 SASS instructions a chunk: ptxas already packs the
    per-lane roundings into F2FP.PACK_AB pairs.)
    """
    gated = build_gated(codec)
    get_lane, put_lane = build_lanes(codec)
    lanes = lanes_for(codec)

    @cuda.jit(device=True, inline=True)
    def chunk_gate(xs, gs, u):
        for k in range(u * lanes, (u + 1) * lanes):
            put_lane(xs, k, gated(get_lane(xs, k), get_lane(gs, k)))

    return chunk_gate


def build_sigmoid_mul_inplace_vector_kernel(
    codec: Codec, rows_unroll: int = GATE_ROWS_UNROLL, launch_bounds: tuple[int, int] | None = None
) -> Callable[..., Any]:
    """Kernel ``(x [T, heads, D], gate [T, heads, D])`` as build_sigmoid_mul_inplace_kernel, in 16-byte chunks.

    Every chunk of every (row, head) of x and gate must be 16-byte aligned (the
    launcher checks). A row's heads' chunks form one column range of ``heads * D /
    lanes`` chunks. A thread owns one column ``c`` (its head and offset computed
    once) and walks rows: grid x and the block's row slots over rows (grid-stride),
    grid y over column tiles of ``min(columns, blockDim.x)``; a block narrower than
    a row covers one tile, a wider one ``blockDim.x // columns`` rows side by side
    (threads past them idle). Each turn of the row loop loads ``rows_unroll`` rows'
    chunks of x and of the gate (rows ``row_step`` apart) before the first store.
    Correct for any grid and block; ``launch_bounds`` (``(threads, blocks per SM)``,
    GPU only) asks ptxas for registers that let that many blocks reside.
    """
    check_rows_unroll(rows_unroll)
    chunk_gate = build_chunk_gate(codec)
    load_vector, store_vector = build_vector_access()
    lanes = lanes_for(codec)
    words = word_type(codec)
    buffer_words = rows_unroll * VECTOR_WORDS
    options = jit_launch_bounds(launch_bounds)

    @cuda.jit(**options)
    def sigmoid_mul_inplace_vector(x, gate):
        rows = x.shape[0]
        per_head = x.shape[2] // lanes
        columns = x.shape[1] * per_head
        xs = cuda.local.array(buffer_words, words)
        gs = cuda.local.array(buffer_words, words)
        threads = cuda.blockDim.x
        tile = min(columns, threads)
        slots = threads // tile
        slot = cuda.threadIdx.x // tile
        if slot >= slots:  # past the block's whole rows
            return
        row_step = cuda.gridDim.x * slots
        first_row = cuda.blockIdx.x * slots + slot
        # Divisions by runtime values happen here, once per column (once per thread when the
        # grid covers a row): the row loop below only adds.
        for c in range(cuda.blockIdx.y * tile + cuda.threadIdx.x - slot * tile, columns, cuda.gridDim.y * tile):
            h = c // per_head
            d = (c - h * per_head) * lanes
            for t in range(first_row, rows, row_step * rows_unroll):
                # Each chunk is read and written by this thread alone: all loads, then all stores.
                for u in range(rows_unroll):
                    if t + u * row_step < rows:
                        load_vector(x, (t + u * row_step, h, d), xs, u * VECTOR_WORDS)
                        load_vector(gate, (t + u * row_step, h, d), gs, u * VECTOR_WORDS)
                for u in range(rows_unroll):
                    if t + u * row_step < rows:
                        chunk_gate(xs, gs, u)
                        store_vector(x, (t + u * row_step, h, d), xs, u * VECTOR_WORDS)

    return sigmoid_mul_inplace_vector


def check_gate_threads(vector_threads: int) -> int:
    """``vector_threads`` after checking it is a power of two in [WARP_THREADS, BLOCK_THREADS]."""
    if vector_threads < WARP_THREADS or vector_threads > BLOCK_THREADS or vector_threads & (vector_threads - 1):
        raise ValueError(f"vector_threads must be a power of two in [{WARP_THREADS}, {BLOCK_THREADS}], got {vector_threads}")
    return vector_threads


def check_gate_blocks_per_sm(blocks_per_sm: int, threads: int) -> int:
    """``blocks_per_sm`` after checking that that many blocks of ``threads`` fit an SM's thread and block limits."""
    limit = min(SM_BLOCKS, SM_THREADS // threads)
    if not 1 <= blocks_per_sm <= limit:
        raise ValueError(f"blocks_per_sm must be in [1, {limit}] for {threads}-thread blocks, got {blocks_per_sm}")
    return blocks_per_sm


def gate_grid(rows: int, columns: int, threads: int, blocks: int) -> tuple[int, int]:
    """(row blocks, column tiles) for the gate's vector kernel: at most ``blocks`` blocks of ``threads``
    threads over ``rows`` rows of ``columns`` 16-byte chunks (see build_sigmoid_mul_inplace_vector_kernel).

    A column tile is ``min(columns, threads)`` chunks; every tile of a row gets a block (a row wider than
    MAX_COLUMN_BLOCKS tiles is walked by the kernel's column loop), and the row blocks share what is
    left of ``blocks``, but no more than the rows need.
    """
    tile = min(columns, threads)
    row_slots = threads // tile
    column_tiles = min(-(-columns // tile), MAX_COLUMN_BLOCKS)
    return max(1, min(-(-rows // row_slots), blocks // column_tiles)), column_tiles


class SigmoidMulInplace:
    """Launcher for Qwen3.5's output gate ``x <- x * sigmoid(gate)`` (in place on ``x``).

    Arrays: x, gate [T, heads, D], possibly strided views (the gate is
    ``q_proj_out[..., D:]`` of a [T, heads, 2D] buffer); codec storage dtype.
    ``vectorize=False`` always runs the scalar kernel (tests, benchmarks).

    The vector kernel's knobs (module docstring; GATE_* are the defaults):
    ``vector_threads`` per block (capped by ``max_threads``), ``blocks_per_sm``
    (the grid is that many blocks per SM, and the kernel's launch bounds hold ptxas
    to 65536 / (threads x blocks_per_sm) registers a thread so they all reside; too
    few and it spills) and ``rows_unroll``, the rows whose chunks a thread loads
    before its first store. The SM count is asked at the first vector launch and kept.
    """

    def __init__(
        self,
        codec: Codec,
        max_threads: int = MAX_THREADS,
        vectorize: bool = True,
        *,
        vector_threads: int = GATE_THREADS,
        blocks_per_sm: int = GATE_BLOCKS_PER_SM,
        rows_unroll: int = GATE_ROWS_UNROLL,
    ) -> None:
        self.kernel = Kernel(build_sigmoid_mul_inplace_kernel(codec))
        self.max_threads = check_max_threads(max_threads)
        self.vector_threads = min(check_gate_threads(vector_threads), self.max_threads)
        self.blocks_per_sm = check_gate_blocks_per_sm(blocks_per_sm, self.vector_threads)
        self.rows_unroll = check_rows_unroll(rows_unroll)
        self.vector_kernel = (
            Kernel(build_sigmoid_mul_inplace_vector_kernel(codec, rows_unroll, (self.vector_threads, blocks_per_sm)))
            if vectorize
            else None
        )
        self.lanes = lanes_for(codec)
        self._num_sms: int | None = None  # the device's, asked at the first vector launch

    def uses_vector(self, x: Any, gate: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel."""
        return self.vector_kernel is not None and vector_aligned(x, gate)

    def vector_grid(self, rows: int, heads: int, head_dim: int) -> tuple[int, int]:
        """The vector kernel's grid for x [rows, heads, head_dim] (asks the SM count the first time)."""
        if self._num_sms is None:
            self._num_sms = multiprocessor_count()
        columns = heads * head_dim // self.lanes
        return gate_grid(rows, columns, self.vector_threads, self._num_sms * self.blocks_per_sm)

    def __call__(self, x: Any, gate: Any, stream: Any = 0) -> None:
        rows, heads, head_dim = x.shape
        if tuple(gate.shape) != (rows, heads, head_dim):
            raise ValueError(f"gate has shape {tuple(gate.shape)}, expected {(rows, heads, head_dim)}")
        if rows == 0 or heads == 0 or head_dim == 0:
            return
        if self.uses_vector(x, gate):
            self.vector_kernel[self.vector_grid(rows, heads, head_dim), self.vector_threads, stream](x, gate)
            return
        threads = threads_for(math.ceil(head_dim / UNROLL), self.max_threads)
        self.kernel[(rows, heads), threads, stream](x, gate)
