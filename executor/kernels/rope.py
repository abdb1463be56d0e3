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

q and k are separate launches (different head counts, same kernel). One block
per (row, head); grid x over rows (grid-stride), y over heads. Pass 1 reads the
head for the sum of squares and ends in the reduction's barriers; in pass 2 a
thread reads the pair (j, j + r/2) or the pass-through element it alone writes,
so the in-place update has no cross-thread read-after-write.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from executor.kernels.codec import Codec
from executor.kernels.norm import SCRATCH_BYTES_PER_THREAD, block_limit, build_normalize, inv_rms_from_sum
from executor.kernels.reduce import block_sum, threads_for
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, float64  # noqa: E402  (after load_cuda's numpy fix)

# Size of the shared reduction scratch: the largest block a launcher picks.
MAX_THREADS = 256


@cuda.jit(device=True, inline=True)
def rope_inv_freq(j, rotary_dim, theta):
    """float32 ``1 / theta^(2j / rotary_dim)``; the exponent is float32 as in HF, the power correctly rounded."""
    exponent = float32(2 * j) / float32(rotary_dim)
    return float32(1.0) / float32(math.pow(float64(theta), float64(exponent)))


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


def _check_shape(name: str, a: Any, expected: tuple[int, ...]) -> None:
    if tuple(a.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {expected}")


class QkNormRopeInplace:
    """Launcher: per-head RMSNorm then partial NeoX RoPE, in place on ``x``.

    Arrays: x [T, heads, head_dim] in the codec's storage dtype (float32, or bf16
    viewed as int16), possibly a strided view; norm_weight [head_dim] (storage
    dtype); positions int32 [T]. Scalars: eps, weight_offset, theta (passed as
    float32), rotary_dim (even, 2 <= rotary_dim <= head_dim, passed as int32).
    Launch once for q and once for k.
    """

    def __init__(self, codec: Codec, round_before_weight: bool, max_threads: int = MAX_THREADS) -> None:
        self.kernel = build_qk_norm_rope_kernel(codec, round_before_weight)
        self.max_threads = min(block_limit(max_threads), MAX_THREADS)

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
        _check_shape("norm_weight", norm_weight, (head_dim,))
        _check_shape("positions", positions, (rows,))
        if rotary_dim < 2 or rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        if rows == 0 or heads == 0:
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
