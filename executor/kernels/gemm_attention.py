"""The two Numba kernels of GEMM prefill attention; the GEMMs themselves run through torch.

A long prefill chunk computes attention as ``softmax(scale * Q K^T, causal) V``
with two batched GEMMs on the tensor cores (executor.models.prefill_attention).
Between them sit these kernels:

- ``GatherKv``: one request's first ``num_tokens`` keys and values, copied out
  of their KV pages into the contiguous ``[Hkv, C, D]`` scratch a GEMM reads.
  A pure copy of storage elements (any 4-byte element type; callers pass bf16
  pairs as int32).
- ``CausalSoftmax``: each float32 score row -> its probabilities in the
  activation dtype, ``exp(scale * s - m) / l`` over the keys the row's query
  may see (``j <= position``) and 0 beyond it (the tile's later rows see more
  keys, so its GEMM spans them all). A warp per row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.codec import Codec
from executor.kernels.launch import Kernel
from executor.kernels.reduce import build_group_max, build_group_sum
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

SOFTMAX_ROWS_PER_BLOCK = 8  # warps (rows) per softmax block on the GPU
#: Score loads each softmax lane issues together. On the H200 the unrolled and the plain sweep ran
#: within the run-to-run noise of each other (both near torch.softmax on the same scores); this is
#: the version every GPU test and benchmark of the fourth session ran.
SOFTMAX_UNROLL = 4
#: gather: elements each thread copies (consecutive threads take consecutive elements).
GATHER_PER_THREAD = 4


def build_gather_kv() -> Any:
    """Kernel ``(k_cache, v_cache [pages, S, Hkv, W], page_indices [P] i32, page_start, num_tokens,
    keys, values [Hkv, C, W])``: keys[h, j, :] = k_cache[page_indices[page_start + j // S], j % S, h, :]
    for j < num_tokens (and the same for values). A flat grid over num_tokens x Hkv x W elements,
    ordered as the pages are (token, head, element): reads are coalesced, writes within a head row."""

    @cuda.jit
    def gather_kv_kernel(k_cache, v_cache, page_indices, page_start, num_tokens, keys, values):
        page_size, heads, width = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        total = num_tokens * heads * width
        base = cuda.blockIdx.x * cuda.blockDim.x * GATHER_PER_THREAD
        end = min(total, base + cuda.blockDim.x * GATHER_PER_THREAD)
        for e in range(base + cuda.threadIdx.x, end, cuda.blockDim.x):
            w = e % width
            h = (e // width) % heads
            j = e // (width * heads)
            page = page_indices[page_start + j // page_size]
            keys[h, j, w] = k_cache[page, j % page_size, h, w]
            values[h, j, w] = v_cache[page, j % page_size, h, w]

    return gather_kv_kernel


class GatherKv:
    """Launcher: copy one request's ``num_tokens`` keys and values from the paged cache.

    - k_cache, v_cache [pages, S, Hkv, W]: one layer's cache (any element type; W = D, or D / 2
      for bf16 viewed as int32 pairs).
    - page_indices [P] int32: the step's page table; the request's pages start at ``page_start``.
    - keys, values [Hkv, C, W]: the planned gather scratch, same element type; C >= num_tokens.
    """

    def __init__(self) -> None:
        self.kernel = Kernel(build_gather_kv())
        self.threads = 32 if simulator_enabled() else 256

    def __call__(self, k_cache: Any, v_cache: Any, page_indices: Any, page_start: int, num_tokens: int,
                 keys: Any, values: Any, stream: Any = 0) -> None:
        _, page_size, heads, width = (int(n) for n in k_cache.shape)
        if tuple(keys.shape[::2]) != (heads, width) or keys.shape != values.shape:
            raise ValueError(f"gather_kv: keys/values must be [{heads}, C, {width}], got {tuple(keys.shape)} "
                             f"and {tuple(values.shape)}")
        if num_tokens > keys.shape[1]:
            raise ValueError(f"gather_kv: {num_tokens} tokens, scratch holds {keys.shape[1]}")
        if page_start + -(-num_tokens // page_size) > page_indices.shape[0]:
            raise ValueError(f"gather_kv: {num_tokens} tokens from page entry {page_start} run past the "
                             f"{page_indices.shape[0]}-entry page table")
        if num_tokens == 0:
            return
        per_block = self.threads * GATHER_PER_THREAD
        blocks = -(-num_tokens * heads * width // per_block)
        self.kernel[blocks, self.threads, stream](k_cache, v_cache, page_indices, np.int32(page_start),
                                                  np.int32(num_tokens), keys, values)


def build_causal_softmax(codec: Codec, lanes: int, rows_per_block: int) -> Any:
    """Kernel ``(scores [R', K] f32, probs [R', K] storage, rows_per_head, first_position, scale f32)``.

    Row i is query row ``t = i % rows_per_head`` of its (kv head, group member) block, at position
    ``first_position + t``; it sees keys ``0 .. first_position + t``. ``lanes`` threads (a warp on
    the GPU) own a row, ``rows_per_block`` rows a block: a tile's rows are a few thousand keys
    long, too short to keep a whole block busy through block-wide reductions, and a warp reduces
    with shuffles and no barrier. Three sweeps of the row, SOFTMAX_UNROLL loads per lane at a
    time: its maximum, the sum of exponentials, the probabilities; the second and third re-read
    the row from cache, so DRAM sees each score once and each probability once. ``scale`` must be
    > 0 (max(scale x) = scale max(x)).
    """
    store = codec.store
    group_max, group_sum = build_group_max(), build_group_sum()
    threads = lanes * rows_per_block

    @cuda.jit
    def causal_softmax_kernel(scores, probs, rows_per_head, first_position, scale):
        scratch = cuda.shared.array(threads, float32)  # the simulator's group reductions
        x = cuda.local.array(SOFTMAX_UNROLL, float32)  # registers: UNROLL loads in flight per lane
        lane = cuda.threadIdx.x % lanes
        row = cuda.blockIdx.x * rows_per_block + cuda.threadIdx.x // lanes
        num_rows, keys = scores.shape
        visible = 0  # a row past the end still joins its group's reductions
        if row < num_rows:
            visible = min(keys, first_position + row % rows_per_head + 1)
        # Loads are clamped to the last visible key so that they are unconditional (issued together)
        # and in the row; the duplicates are harmless to the max and left out of the sum.
        last = max(visible - 1, 0)
        sweep = SOFTMAX_UNROLL * lanes
        row_max = float32(-math.inf)
        for j in range(lane, visible, sweep):
            for u in range(SOFTMAX_UNROLL):
                x[u] = scores[row, min(j + u * lanes, last)]
            for u in range(SOFTMAX_UNROLL):
                row_max = max(row_max, x[u])
        row_max = group_max(scratch, row_max, lanes) * scale
        total = float32(0.0)
        for j in range(lane, visible, sweep):
            for u in range(SOFTMAX_UNROLL):
                x[u] = scores[row, min(j + u * lanes, last)]
            for u in range(SOFTMAX_UNROLL):
                if j + u * lanes < visible:
                    total += float32(math.exp(x[u] * scale - row_max))
        total = group_sum(scratch, total, lanes)
        if row < num_rows:  # visible >= 1: the row's maximum adds exp(0) = 1 to its sum
            inverse = float32(1.0) / total
            for j in range(lane, keys, sweep):
                for u in range(SOFTMAX_UNROLL):
                    x[u] = scores[row, min(j + u * lanes, last)]
                for u in range(SOFTMAX_UNROLL):
                    k = j + u * lanes
                    if k < keys:
                        p = float32(0.0)
                        if k < visible:
                            p = float32(math.exp(x[u] * scale - row_max)) * inverse
                        probs[row, k] = store(p)

    return causal_softmax_kernel


class CausalSoftmax:
    """Launcher: ``probs = causal softmax(scale * scores)`` per row.

    - scores [R', K] float32: rows ordered (kv head, group member, query row of the tile).
    - probs [R', K] storage dtype (not in place).
    - rows_per_head: query rows of the tile; first_position: the position of its first row
      (row t sees keys 0 .. first_position + t, which must be < K + 1).
    - scale: > 0.
    """

    def __init__(self, codec: Codec) -> None:
        # A warp per row on the GPU; 4 threads per row in the simulator, where threads are Python threads.
        self.lanes, self.rows_per_block = (4, 2) if simulator_enabled() else (32, SOFTMAX_ROWS_PER_BLOCK)
        self.kernel = Kernel(build_causal_softmax(codec, self.lanes, self.rows_per_block))

    def __call__(self, scores: Any, probs: Any, rows_per_head: int, first_position: int, scale: float,
                 stream: Any = 0) -> None:
        rows, keys = (int(n) for n in scores.shape)
        if tuple(probs.shape) != (rows, keys):
            raise ValueError(f"causal_softmax: probs must be [{rows}, {keys}], got {tuple(probs.shape)}")
        if rows % rows_per_head or first_position < 0 or first_position + rows_per_head > keys:
            raise ValueError(f"causal_softmax: {rows} rows of {rows_per_head} per head from position "
                             f"{first_position} do not fit {keys} keys")
        if not scale > 0:
            raise ValueError(f"causal_softmax: scale must be > 0, got {scale}")
        if rows == 0:
            return
        blocks = -(-rows // self.rows_per_block)
        self.kernel[blocks, self.lanes * self.rows_per_block, stream](
            scores, probs, np.int32(rows_per_head), np.int32(first_position), np.float32(scale))
