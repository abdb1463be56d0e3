"""Gated RMSNorm of the Gated DeltaNet output: ``norm(x) * w * silu(z)`` per (token row, value head).

HF's ``Qwen3_5RMSNormGated.forward`` (transformers 5.x), with input dtype D
(the delta-rule output's storage dtype) and a weight stored in D::

    n   = x.float() * rsqrt(mean(x.float()^2) + eps)     float32
    n   = weight * n.to(D)                               rounded to D, then a D product (rounded)
    out = (n * silu(z.float())).to(D)                    float32 product, rounded once

The kernel makes the same two intermediate roundings through the codec
(``load(store(.))``), which are identities for float32 storage. The weight is
plain ``w`` (initialised to ones), not Qwen3.5's zero-centred ``1 + w``.

Layout: one block per (row, head), threads stride over dv. Each thread reads
and writes only its own columns ``tid, tid + blockDim, ...`` of its (row, head),
and the second pass starts after the reduction's barriers, so ``out`` may share
memory with ``x`` or ``z`` (same element order: out[t, h*dv + i] is x[t, h, i]
and z[t, h*dv + i]): the kernel is aliasing-safe in place.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import block_sum, threads_for
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

MAX_THREADS = 128  # shared reduction scratch; dv is 128 on every Qwen3.5 size


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


class GatedRmsNorm:
    """Launcher: ``out = rmsnorm(x) * weight * silu(z)`` over dv, per (row, value head).

    - x [T, Hv, dv]: the delta-rule output, storage dtype.
    - z [T, Hv*dv]: ``in_proj_z`` output, storage dtype.
    - weight [dv]: ``norm.weight``, storage dtype.
    - out [T, Hv*dv]: storage dtype, the ``out_proj`` input; may share memory with x or z.
    - eps: ``rms_norm_eps`` (passed as float32).

    Every row is computed (padding rows too). No scratch.
    """

    def __init__(self, codec: Codec) -> None:
        self.kernel = Kernel(build_gated_rms_norm(codec))

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
        threads = threads_for(dv, MAX_THREADS)
        self.kernel[(rows, heads), threads, stream](x, z, weight, out, np.float32(eps))
