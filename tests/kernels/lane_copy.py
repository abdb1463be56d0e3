"""A probe kernel for vector.py's device side, importable without torch (the sm_90 compile
subprocess imports it): ``lane_copy(src [R, C], dst [R, C])`` copies each 16-byte chunk through
load_vector, get_lane / put_lane into a second word buffer, and store_vector."""

from __future__ import annotations

import math
from typing import Any

from executor.kernels.primitives.codec import build_codec
from executor.kernels.primitives.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, word_type
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)


def build_lane_copy(dtype_name: str) -> Any:
    """Grid: one block per row, one thread per chunk. A lane that differs from the element it
    should hold (a wrong lane order) is written as NaN."""
    store = build_codec(dtype_name).store
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(build_codec(dtype_name))
    lanes = lanes_for(build_codec(dtype_name))
    words = word_type(build_codec(dtype_name))

    @cuda.jit
    def lane_copy(src, dst):
        a = cuda.local.array(VECTOR_WORDS, words)
        b = cuda.local.array(VECTOR_WORDS, words)
        t = cuda.blockIdx.x
        col = cuda.threadIdx.x * lanes
        if col < src.shape[1]:
            load_vector(src, (t, col), a, 0)
            for k in range(lanes):
                if get_lane(a, k) == src[t, col + k]:
                    put_lane(b, k, get_lane(a, k))
                else:
                    put_lane(b, k, store(float32(math.nan)))
            store_vector(dst, (t, col), b, 0)

    return lane_copy
