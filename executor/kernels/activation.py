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
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.kernels.codec import Codec
from executor.kernels.reduce import threads_for
from executor.kernels.residual import UNROLL, elementwise_grid
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

MAX_THREADS = 256


def _check_max_threads(max_threads: int) -> int:
    if max_threads < 32 or max_threads > 1024 or max_threads & (max_threads - 1):
        raise ValueError(f"max_threads must be a power of two in [32, 1024], got {max_threads}")
    return max_threads


@cuda.jit(device=True, inline=True)
def sigmoid(g):
    """float32 ``1 / (1 + exp(-g))``, torch's formula."""
    return float32(1.0) / (float32(1.0) + float32(math.exp(min(-g, float32(100.0)))))


@cuda.jit(device=True, inline=True)
def silu(g):
    """float32 ``g / (1 + exp(-g))``, torch's formula."""
    return g / (float32(1.0) + float32(math.exp(min(-g, float32(100.0)))))


def build_silu_mul_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(gate_up [T, 2I], out [T, I])``: ``out = store(round(silu(gate)) * up)``.

    ``gate = gate_up[:, :I]``, ``up = gate_up[:, I:]`` (one fused GEMM output).
    """
    load, store = codec.load, codec.store

    @cuda.jit(device=True, inline=True)
    def swiglu(gate_bits, up_bits):
        return store(load(store(silu(load(gate_bits)))) * load(up_bits))

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
    load, store = codec.load, codec.store

    @cuda.jit(device=True, inline=True)
    def gated(x_bits, gate_bits):
        return store(load(x_bits) * load(store(sigmoid(load(gate_bits)))))

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


class SiluMul:
    """Launcher for SwiGLU's ``out = silu(gate) * up`` (not in place).

    Arrays: gate_up [T, 2I] = [gate | up], out [T, I]; codec storage dtype
    (float32, or bf16 viewed as int16); row-sliced views allowed.
    """

    def __init__(self, codec: Codec, max_threads: int = MAX_THREADS) -> None:
        self.kernel = build_silu_mul_kernel(codec)
        self.max_threads = _check_max_threads(max_threads)

    def __call__(self, gate_up: Any, out: Any, stream: Any = 0) -> None:
        rows, inter = out.shape
        if tuple(gate_up.shape) != (rows, 2 * inter):
            raise ValueError(f"gate_up has shape {tuple(gate_up.shape)}, expected {(rows, 2 * inter)}")
        if rows == 0 or inter == 0:
            return
        grid, threads = elementwise_grid(rows, inter, self.max_threads)
        self.kernel[grid, threads, stream](gate_up, out)


class SigmoidMulInplace:
    """Launcher for Qwen3.5's output gate ``x <- x * sigmoid(gate)`` (in place on ``x``).

    Arrays: x, gate [T, heads, D], possibly strided views (the gate is
    ``q_proj_out[..., D:]`` of a [T, heads, 2D] buffer); codec storage dtype.
    """

    def __init__(self, codec: Codec, max_threads: int = MAX_THREADS) -> None:
        self.kernel = build_sigmoid_mul_inplace_kernel(codec)
        self.max_threads = _check_max_threads(max_threads)

    def __call__(self, x: Any, gate: Any, stream: Any = 0) -> None:
        rows, heads, head_dim = x.shape
        if tuple(gate.shape) != (rows, heads, head_dim):
            raise ValueError(f"gate has shape {tuple(gate.shape)}, expected {(rows, heads, head_dim)}")
        if rows == 0 or heads == 0 or head_dim == 0:
            return
        threads = threads_for(math.ceil(head_dim / UNROLL), self.max_threads)
        self.kernel[(rows, heads), threads, stream](x, gate)
