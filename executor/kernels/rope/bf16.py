"""bf16 device functions the specialized q/k norm + RoPE kernel's two layouts share
(specialized.py: the math, the layouts and why the sums go in this order)."""

from __future__ import annotations

from typing import Any, Callable

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.mma import build_pack_bf16x2
from executor.kernels.primitives.vector import VECTOR_BYTES
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

BF16_LANES = VECTOR_BYTES // 2  # bf16 elements in a 16-byte chunk: the specialized kernel is bf16 only
SIGN_BIT = -(1 << 31)  # 0x80000000 as an int32: the sign bit of a word's upper bf16
# The specialized kernel's device functions are inlined by NVVM (alwaysinline), as sampling/sampler.py's: Numba's
# IR inlining copies the callee's IR at every call, and the nested calls took the sm_90 compile of
# Qwen3-8B's q kernel to about a minute. Inlined somewhere they must be, for the buffers to stay in
# registers. The simulator's jit takes no forceinline.
NVVM_INLINE = {} if simulator_enabled() else {"forceinline": True}


def bf16_functions(codec: Codec, round_before_weight: bool) -> tuple[Callable[..., Any], ...]:
    """Device functions both layouts use: ``(element, rounded_pair, chunk_squares, normalized_pair)``
    (each documented below)."""
    load = codec.load
    pack = build_pack_bf16x2()
    lanes = BF16_LANES

    @cuda.jit(device=True, **NVVM_INLINE)
    def element(words, k):
        """Element k of a buffer of chunks as float32: k < 8 in the first chunk (words 0-3), 8 <= k < 16
        in the second (words 4-7), ...; the element at the lower address is a word's low half."""
        word = words[k // 2]
        return load(word >> 16) if k % 2 else load(word)

    @cuda.jit(device=True, **NVVM_INLINE)
    def rounded_pair(a, b):
        """a and b rounded to bf16 and back, as HF's separate ops round them: one cvt.rn.bf16x2."""
        word = pack(a, b)
        return load(word), load(word >> 16)

    @cuda.jit(device=True, **NVVM_INLINE)
    def chunk_squares(words, first):
        """Sum of the squares of the chunk's 8 elements from element ``first``, in element order
        (build_vector_head's squares)."""
        total = float32(0.0)
        for k in range(lanes):
            v = element(words, first + k)
            total += v * v
        return total

    @cuda.jit(device=True, **NVVM_INLINE)
    def normalized_pair(x0, x1, w0, w1, inv_rms, weight_offset):
        """Two norm outputs before their final rounding: norm.build_normalize two at a time (with
        round_before_weight, norm(x) rounded in between, one cvt for both)."""
        if round_before_weight:
            n0, n1 = rounded_pair(x0 * inv_rms, x1 * inv_rms)
            return n0 * (weight_offset + w0), n1 * (weight_offset + w1)
        return x0 * inv_rms * (weight_offset + w0), x1 * inv_rms * (weight_offset + w1)

    return element, rounded_pair, chunk_squares, normalized_pair
