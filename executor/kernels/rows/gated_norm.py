"""Gated RMSNorm of the Gated DeltaNet output: ``norm(x) * w * silu(z)`` per (token row, value head).

HF's ``Qwen3_5RMSNormGated.forward`` (transformers 5.x), with input dtype D
(the delta-rule output's storage dtype) and a weight stored in D::

    n   = x.float() * rsqrt(mean(x.float()^2) + eps)     float32
    n   = weight * n.to(D)                               rounded to D, then a D product (rounded)
    out = (n * silu(z.float())).to(D)                    float32 product, rounded once

The kernel makes the same two intermediate roundings through the codec
(``load(store(.))``), which are identities for float32 storage. The weight is
plain ``w`` (initialised to ones), not Qwen3.5's zero-centred ``1 + w``.

Two kernels, the same per-element arithmetic:

- vector (every (row, head) a whole number of 16-byte chunks, a power of two of them up to 32, and
  16-byte aligned rows; Qwen3.5's bf16 dv of 128 is 16 chunks): a group of lanes per (row, head),
  a lane per chunk, holding its chunk of x, z and the weight in registers; the sum of squares is a
  shuffle reduction within the group, so no block-wide barrier or shared memory is on the path.
  Blocks of 256 threads take 256 / (chunks a head) (row, head) pairs a round, grid-stride over the
  step's pairs, about four blocks an SM.
- scalar (any other view): one block per (row, head), threads stride over dv.

Each thread reads and writes only its own columns of its (row, head), after the reduction, so
``out`` may share memory with ``x`` or ``z`` (same element order: out[t, h*dv + i] is x[t, h, i]
and z[t, h*dv + i]): both kernels are aliasing-safe in place. The two sum the squares in different
orders, so their outputs may differ in the last bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import WARP_THREADS, Kernel, multiprocessor_count
from executor.kernels.primitives.reduce import block_sum, build_group_sum, threads_for
from executor.kernels.primitives.vector import (VECTOR_WORDS, build_lanes, build_vector_access, lanes_for,
                                                vector_aligned, word_type)
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

MAX_THREADS = 128  # shared reduction scratch; dv is 128 on every Qwen3.5 size
VECTOR_THREADS = 256  # the vector kernel's block
VECTOR_BLOCKS_PER_SM = 4  # its grid: enough resident warps to keep each SM's loads in flight


def build_gated_rms_norm(codec: Codec) -> Any:
    """Kernel ``(x [T,Hv,dv], z [T,Hv*dv], weight [dv], out [T,Hv*dv], eps f32)``, storage dtype.

    Grid (T, Hv); blockDim a power of two <= MAX_THREADS.
    """
    load, store = codec.load, codec.store

    @cuda.jit
    def gated_rms_norm_kernel(x, z, weight, out, eps):
        scratch = cuda.shared.array(MAX_THREADS, float32)
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        step = cuda.blockDim.x
        dv = x.shape[2]
        base = h * dv
        partial = float32(0.0)
        for i in range(tid, dv, step):
            v = load(x[t, h, i])
            partial += v * v
        variance = block_sum(scratch, partial) / float32(dv)
        rstd = float32(1.0) / float32(math.sqrt(variance + eps))
        for i in range(tid, dv, step):
            normed = load(store(load(x[t, h, i]) * rstd))  # HF: hidden_states.to(input_dtype)
            weighted = load(store(load(weight[i]) * normed))  # HF: weight * (...) in the input dtype
            gate = load(z[t, base + i])
            silu = gate / (float32(1.0) + float32(math.exp(-gate)))
            out[t, base + i] = store(weighted * silu)

    return gated_rms_norm_kernel


def build_gated_rms_norm_vector(codec: Codec, head_dim: int) -> Any:
    """Kernel ``(x [T,Hv,dv], z [T,Hv*dv], weight [dv], out [T,Hv*dv], eps f32)``, storage dtype, dv =
    ``head_dim`` of whole 16-byte chunks, a power of two of them <= 32; rows 16-byte aligned.

    Grid any (grid-stride over the T x Hv pairs), VECTOR_THREADS threads.
    """
    load, store = codec.load, codec.store
    lanes = lanes_for(codec)
    chunks = head_dim // lanes  # the lanes of a (row, head)'s group
    assert head_dim % lanes == 0 and chunks & (chunks - 1) == 0 and chunks <= WARP_THREADS, head_dim
    pairs_a_block = VECTOR_THREADS // chunks
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(codec)
    group_sum = build_group_sum()
    words_type = word_type(codec)

    @cuda.jit
    def gated_rms_norm_vector(x, z, weight, out, eps):
        scratch = cuda.shared.array(VECTOR_THREADS, float32)  # the simulator's reduction scratch
        xs = cuda.local.array(VECTOR_WORDS, words_type)
        zs = cuda.local.array(VECTOR_WORDS, words_type)
        ws = cuda.local.array(VECTOR_WORDS, words_type)
        tid = cuda.threadIdx.x
        column = (tid % chunks) * lanes
        heads = x.shape[1]
        pairs = x.shape[0] * heads
        load_vector(weight, (column,), ws, 0)
        step = cuda.gridDim.x * pairs_a_block
        # Every thread takes every round (the reduction is the whole group's): pairs past the end
        # load nothing and store nothing.
        for first in range(cuda.blockIdx.x * pairs_a_block, pairs, step):
            pair = first + tid // chunks
            active = pair < pairs
            t = pair // heads
            h = pair - t * heads
            partial = float32(0.0)
            if active:
                load_vector(x, (t, h, column), xs, 0)
                load_vector(z, (t, h * head_dim + column), zs, 0)
                for k in range(lanes):
                    v = load(get_lane(xs, k))
                    partial += v * v
            variance = group_sum(scratch, partial, chunks) / float32(head_dim)
            if active:
                rstd = float32(1.0) / float32(math.sqrt(variance + eps))
                for k in range(lanes):
                    normed = load(store(load(get_lane(xs, k)) * rstd))  # HF: hidden_states.to(input_dtype)
                    weighted = load(store(load(get_lane(ws, k)) * normed))  # HF: weight * (...) in the input dtype
                    gate = load(get_lane(zs, k))
                    silu = gate / (float32(1.0) + float32(math.exp(-gate)))
                    put_lane(xs, k, store(weighted * silu))
                store_vector(out, (t, h * head_dim + column), xs, 0)

    return gated_rms_norm_vector


def vector_head_dim(codec: Codec, head_dim: int) -> bool:
    """Whether the vector kernel takes heads of ``head_dim`` in ``codec``'s storage."""
    lanes = lanes_for(codec)
    chunks = head_dim // lanes
    return head_dim % lanes == 0 and chunks & (chunks - 1) == 0 and chunks <= WARP_THREADS


class GatedRmsNorm:
    """Launcher: ``out = rmsnorm(x) * weight * silu(z)`` over dv, per (row, value head).

    - x [T, Hv, dv]: the delta-rule output, storage dtype.
    - z [T, Hv*dv]: ``in_proj_z`` output, storage dtype.
    - weight [dv]: ``norm.weight``, storage dtype.
    - out [T, Hv*dv]: storage dtype, the ``out_proj`` input; may share memory with x or z.
    - eps: ``rms_norm_eps`` (passed as float32).

    Every row is computed (padding rows too). No scratch. Views the vector kernel takes (module
    docstring) run it, others the scalar kernel.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.kernel = Kernel(build_gated_rms_norm(codec))
        self.vector_kernels: dict[int, Kernel] = {}  # dv -> the vector kernel
        self.vector_grid_cap: int | None = None  # VECTOR_BLOCKS_PER_SM x the SM count, asked on first use

    def __call__(self, x: Any, z: Any, weight: Any, out: Any, eps: float, stream: Any = 0) -> None:
        if len(x.shape) != 3:
            raise ValueError(f"gated_rms_norm: x must be [T, Hv, dv], got {tuple(x.shape)}")
        rows, heads, dv = (int(n) for n in x.shape)
        for name, arr in (("z", z), ("out", out)):
            if tuple(arr.shape) != (rows, heads * dv):
                raise ValueError(f"gated_rms_norm: {name} must be [{rows}, {heads * dv}], got {tuple(arr.shape)}")
        if tuple(weight.shape) != (dv,):
            raise ValueError(f"gated_rms_norm: weight must be [{dv}], got {tuple(weight.shape)}")
        if rows == 0 or heads == 0:
            return
        if vector_head_dim(self.codec, dv) and vector_aligned(x, z, weight, out):
            kernel = self.vector_kernels.get(dv)
            if kernel is None:
                kernel = self.vector_kernels[dv] = Kernel(build_gated_rms_norm_vector(self.codec, dv))
            if self.vector_grid_cap is None:
                self.vector_grid_cap = VECTOR_BLOCKS_PER_SM * multiprocessor_count()
            pairs_a_block = VECTOR_THREADS // (dv // lanes_for(self.codec))
            blocks = min(-(-rows * heads // pairs_a_block), self.vector_grid_cap)
            kernel[blocks, VECTOR_THREADS, stream](x, z, weight, out, np.float32(eps))
            return
        threads = threads_for(dv, MAX_THREADS)
        self.kernel[(rows, heads), threads, stream](x, z, weight, out, np.float32(eps))
