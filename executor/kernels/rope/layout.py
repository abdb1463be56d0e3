"""How a q/k head's RoPE is cut into thread units, and its rotary frequencies: shared by
qk_norm_rope.py's vector kernel and specialized.py's kernel, which must agree on both for the same
bits.

A head's unit is one 16-byte chunk of its rotary low half with the matching chunk of the high
half (a pair unit), or one chunk past rotary_dim (a pass-through unit). A head gets one thread
per unit, rounded up to a power of two, at most a warp (its sum of squares is a shuffle
reduction).
"""

from __future__ import annotations

import math

from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, float64  # noqa: E402  (after load_cuda's numpy fix)

# Size of the shared reduction scratch: the largest block a launcher picks.
MAX_THREADS = 256
MAX_GROUP_THREADS = 32  # a head's threads: at most a warp (shuffle reduction)


@cuda.jit(device=True, inline=True)
def rope_inv_freq(j, rotary_dim, theta):
    """float32 ``1 / theta^(2j / rotary_dim)``; the exponent is float32 as in HF, the power correctly rounded."""
    exponent = float32(2 * j) / float32(rotary_dim)
    return float32(1.0) / float32(math.pow(float64(theta), float64(exponent)))


def vector_group_threads(head_dim: int, rotary_dim: int, lanes: int) -> int:
    """Threads per head in the vector kernel: one per unit (pair unit or pass-through chunk), at most a warp."""
    units = rotary_dim // 2 // lanes + (head_dim - rotary_dim) // lanes
    return min(MAX_GROUP_THREADS, 1 << max(0, math.ceil(math.log2(units))))
