"""SwiGLU's gating activation, ``silu(gate) * up``.

Both compute in float32 and mirror HF's rounding in the model dtype: HF
evaluates ``act(gate)`` as its own op, so the activation is rounded to storage
before the multiply, and the product is rounded again. With the F32 codec the
rounding is the identity.

``exp`` is fed ``min(-g, 100)``: float32 ``exp`` is already inf past 88.72, so
results do not change, but the simulator's float64 ``math.exp`` would raise
OverflowError past 709 instead of returning inf.

Each thread loads UNROLL elements (strided by blockDim, so warps stay
coalesced) before its first store, as in primitives/grid.py, for bytes in flight.
When the rows are whole numbers of 16-byte-aligned chunks (``vector_aligned``),
the launchers run vector kernels that do the same per-element arithmetic on
16-byte chunks (vector.py); the scalar kernels otherwise. Both paths give the
same bits.

SwiGLU's vector kernel keeps primitives/grid.py's layout (a block per row tile,
VECTOR_UNROLL chunks in flight per thread and array): 85% of copy bandwidth on
the H200. Qwen3.5's output gate, ``x * sigmoid(gate)``, is output_gate.py's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import check_max_threads
from executor.kernels.primitives.grid import UNROLL, VECTOR_UNROLL, elementwise_grid
from executor.kernels.primitives.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

MAX_THREADS = 256


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


