"""Gating activations: SwiGLU's ``silu(gate) * up`` and Qwen3.5's ``x * sigmoid(gate)``.

Both compute in float32 and mirror HF's rounding in the model dtype: HF
evaluates ``act(gate)`` as its own op, so the activation is rounded to storage
before the multiply, and the product is rounded again. With the F32 codec the
rounding is the identity.

``exp`` is fed ``min(-g, 100)``: float32 ``exp`` is already inf past 88.72, so
results do not change, but the simulator's float64 ``math.exp`` would raise
OverflowError past 709 instead of returning inf.

Each thread loads UNROLL elements (strided by blockDim, so warps stay
coalesced) before its first store, as in residual.py, for bytes in flight.
When the rows are whole numbers of 16-byte-aligned chunks (``vector_aligned``),
the launchers run vector kernels that do the same per-element arithmetic on
16-byte chunks (vector.py), VECTOR_UNROLL chunks in flight per thread and
array; the scalar kernels otherwise. Both paths give the same bits.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.codec import Codec
from executor.kernels.launch import Kernel
from executor.kernels.reduce import check_max_threads, threads_for
from executor.kernels.residual import UNROLL, VECTOR_UNROLL, elementwise_grid
from executor.kernels.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

MAX_THREADS = 256


@cuda.jit(device=True, inline=True)
def sigmoid(g):
    """float32 ``1 / (1 + exp(-g))``, torch's formula."""
    return float32(1.0) / (float32(1.0) + float32(math.exp(min(-g, float32(100.0)))))


@cuda.jit(device=True, inline=True)
def silu(g):
    """float32 ``g / (1 + exp(-g))``, torch's formula."""
    return g / (float32(1.0) + float32(math.exp(min(-g, float32(100.0)))))


def build_swiglu(codec: Codec) -> Callable[..., Any]:
    """Device function ``(gate, up) -> out element``, storage in and out: ``store(round(silu(gate)) * up)``."""
    load, store = codec.load, codec.store

    @cuda.jit(device=True, inline=True)
    def swiglu(gate_bits, up_bits):
        return store(load(store(silu(load(gate_bits)))) * load(up_bits))

    return swiglu


def build_gated(codec: Codec) -> Callable[..., Any]:
    """Device function ``(x, gate) -> x element``, storage in and out: ``store(x * round(sigmoid(gate)))``."""
    load, store = codec.load, codec.store

    @cuda.jit(device=True, inline=True)
    def gated(x_bits, gate_bits):
        return store(load(x_bits) * load(store(sigmoid(load(gate_bits)))))

    return gated


def build_silu_mul_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(gate_up [T, 2I], out [T, I])``: ``out = store(round(silu(gate)) * up)``.

    ``gate = gate_up[:, :I]``, ``up = gate_up[:, I:]`` (one fused GEMM output).
    """
    swiglu = build_swiglu(codec)

    @cuda.jit
    def silu_mul(gate_up, out):
        inter = out.shape[1]
        step = cuda.blockDim.x
        tile = step * UNROLL
        for t in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            for i in range(cuda.blockIdx.y * tile + cuda.threadIdx.x, inter, cuda.gridDim.y * tile):
                # All reads of an element precede its write: out may even be gate_up[:, :I].
                if i + 3 * step < inter:  # a full tile: all loads, then all stores
                    g0, g1 = gate_up[t, i], gate_up[t, i + step]
                    g2, g3 = gate_up[t, i + 2 * step], gate_up[t, i + 3 * step]
                    u = inter + i
                    u0, u1 = gate_up[t, u], gate_up[t, u + step]
                    u2, u3 = gate_up[t, u + 2 * step], gate_up[t, u + 3 * step]
                    out[t, i] = swiglu(g0, u0)
                    out[t, i + step] = swiglu(g1, u1)
                    out[t, i + 2 * step] = swiglu(g2, u2)
                    out[t, i + 3 * step] = swiglu(g3, u3)
                else:  # the row's ragged end
                    for j in range(i, inter, step):
                        out[t, j] = swiglu(gate_up[t, j], gate_up[t, inter + j])

    return silu_mul


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


def build_silu_mul_vector_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(gate_up [T, 2I], out [T, I])`` as build_silu_mul_kernel, over 16-byte chunks.

    Every chunk of gate, up and out rows must be 16-byte aligned (the launcher checks).
    Grid: x over rows, y over tiles of VECTOR_UNROLL x blockDim.x chunks of out.
    """
    swiglu = build_swiglu(codec)
    load_vector, store_vector = build_vector_access()
    lanes = lanes_for(codec)
    get_lane, put_lane = build_lanes(codec)
    words = word_type(codec)
    buffer_words = VECTOR_UNROLL * VECTOR_WORDS

    @cuda.jit
    def silu_mul_vector(gate_up, out):
        inter = out.shape[1]
        chunks = inter // lanes
        gate = cuda.local.array(buffer_words, words)
        up = cuda.local.array(buffer_words, words)
        step = cuda.blockDim.x
        tile = step * VECTOR_UNROLL
        for t in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            for c in range(cuda.blockIdx.y * tile + cuda.threadIdx.x, chunks, cuda.gridDim.y * tile):
                # All reads of a chunk precede its write: out may even be gate_up[:, :I].
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        col = (c + u * step) * lanes
                        load_vector(gate_up, (t, col), gate, u * VECTOR_WORDS)
                        load_vector(gate_up, (t, inter + col), up, u * VECTOR_WORDS)
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        for k in range(u * lanes, (u + 1) * lanes):
                            put_lane(gate, k, swiglu(get_lane(gate, k), get_lane(up, k)))
                        store_vector(out, (t, (c + u * step) * lanes), gate, u * VECTOR_WORDS)

    return silu_mul_vector


def build_sigmoid_mul_inplace_vector_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(x [T, heads, D], gate [T, heads, D])`` as build_sigmoid_mul_inplace_kernel, in 16-byte chunks.

    Every chunk of every (row, head) of x and gate must be 16-byte aligned (the
    launcher checks). The heads' chunks of a row form one column range, so a
    block is not limited to one head's D / lanes chunks: grid x over rows, y
    over tiles of VECTOR_UNROLL x blockDim.x chunks of the row.
    """
    gated = build_gated(codec)
    load_vector, store_vector = build_vector_access()
    lanes = lanes_for(codec)
    get_lane, put_lane = build_lanes(codec)
    words = word_type(codec)
    buffer_words = VECTOR_UNROLL * VECTOR_WORDS

    @cuda.jit
    def sigmoid_mul_inplace_vector(x, gate):
        per_head = x.shape[2] // lanes
        chunks = x.shape[1] * per_head
        xs = cuda.local.array(buffer_words, words)
        gs = cuda.local.array(buffer_words, words)
        step = cuda.blockDim.x
        tile = step * VECTOR_UNROLL
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            for c in range(cuda.blockIdx.y * tile + cuda.threadIdx.x, chunks, cuda.gridDim.y * tile):
                # Each chunk is read and written by this thread alone.
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        h = (c + u * step) // per_head
                        d = (c + u * step - h * per_head) * lanes
                        load_vector(x, (t, h, d), xs, u * VECTOR_WORDS)
                        load_vector(gate, (t, h, d), gs, u * VECTOR_WORDS)
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        for k in range(u * lanes, (u + 1) * lanes):
                            put_lane(xs, k, gated(get_lane(xs, k), get_lane(gs, k)))
                        h = (c + u * step) // per_head
                        store_vector(x, (t, h, (c + u * step - h * per_head) * lanes), xs, u * VECTOR_WORDS)

    return sigmoid_mul_inplace_vector


class SiluMul:
    """Launcher for SwiGLU's ``out = silu(gate) * up`` (not in place).

    Arrays: gate_up [T, 2I] = [gate | up], out [T, I]; codec storage dtype
    (float32, or bf16 viewed as int16); row-sliced views allowed.
    ``vectorize=False`` always runs the scalar kernel (tests, benchmarks).
    """

    def __init__(self, codec: Codec, max_threads: int = MAX_THREADS, vectorize: bool = True) -> None:
        self.kernel = Kernel(build_silu_mul_kernel(codec))
        self.vector_kernel = Kernel(build_silu_mul_vector_kernel(codec)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = check_max_threads(max_threads)

    def uses_vector(self, gate_up: Any, out: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel.

        out's rows being whole chunks makes I a whole number of chunks, so up = gate_up[:, I:] is aligned too.
        """
        return self.vector_kernel is not None and vector_aligned(gate_up, out)

    def __call__(self, gate_up: Any, out: Any, stream: Any = 0) -> None:
        rows, inter = out.shape
        if tuple(gate_up.shape) != (rows, 2 * inter):
            raise ValueError(f"gate_up has shape {tuple(gate_up.shape)}, expected {(rows, 2 * inter)}")
        if rows == 0 or inter == 0:
            return
        if self.uses_vector(gate_up, out):
            grid, threads = elementwise_grid(rows, inter // self.lanes, self.max_threads, VECTOR_UNROLL)
            self.vector_kernel[grid, threads, stream](gate_up, out)
            return
        grid, threads = elementwise_grid(rows, inter, self.max_threads)
        self.kernel[grid, threads, stream](gate_up, out)


class SigmoidMulInplace:
    """Launcher for Qwen3.5's output gate ``x <- x * sigmoid(gate)`` (in place on ``x``).

    Arrays: x, gate [T, heads, D], possibly strided views (the gate is
    ``q_proj_out[..., D:]`` of a [T, heads, 2D] buffer); codec storage dtype.
    ``vectorize=False`` always runs the scalar kernel (tests, benchmarks).
    """

    def __init__(self, codec: Codec, max_threads: int = MAX_THREADS, vectorize: bool = True) -> None:
        self.kernel = Kernel(build_sigmoid_mul_inplace_kernel(codec))
        self.vector_kernel = Kernel(build_sigmoid_mul_inplace_vector_kernel(codec)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = check_max_threads(max_threads)

    def uses_vector(self, x: Any, gate: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel."""
        return self.vector_kernel is not None and vector_aligned(x, gate)

    def __call__(self, x: Any, gate: Any, stream: Any = 0) -> None:
        rows, heads, head_dim = x.shape
        if tuple(gate.shape) != (rows, heads, head_dim):
            raise ValueError(f"gate has shape {tuple(gate.shape)}, expected {(rows, heads, head_dim)}")
        if rows == 0 or heads == 0 or head_dim == 0:
            return
        if self.uses_vector(x, gate):
            grid, threads = elementwise_grid(rows, heads * head_dim // self.lanes, self.max_threads, VECTOR_UNROLL)
            self.vector_kernel[grid, threads, stream](x, gate)
            return
        threads = threads_for(math.ceil(head_dim / UNROLL), self.max_threads)
        self.kernel[(rows, heads), threads, stream](x, gate)
