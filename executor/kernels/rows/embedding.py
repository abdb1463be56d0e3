"""Token embedding gather: ``out[t, :] = table[ids[t], :]``.

An id ``-(r + 1)`` (negative) stands for ``previous_ids[r]``, the id the previous step sampled
for its row r: an engine that runs a step before it has read the previous step's samples back
(overlapped scheduling) feeds each decode row's new token from the device that way.

A vocab-parallel table (tensor parallelism) holds the ids ``[first_id, first_id + rows)`` of a
vocabulary of ``vocab`` ids: an id of the vocabulary outside its rows gives a zero row (another
rank's table holds it; the ranks' rows are summed by an all-reduce). The whole table is
``first_id`` 0 and ``vocab`` its rows.

A pure copy of storage elements (no conversion, so bf16 bits travel
bit-exact). The codec is used for the zeros and for one more thing: an id outside ``[0, vocab)``
(after the lookup above; a row r outside previous_ids counts as outside) cannot
raise on the device, so its row is filled with NaN (``codec.store(nan)``)
instead of reading out of bounds; the NaN then reaches the logits, where it
is visible (argmax picks NaN), rather than a plausible wrong token.

Grid x over token rows (grid-stride), y over column tiles; threads stride over
the hidden dimension so each warp copies a contiguous run, UNROLL loads in
flight per thread (primitives/grid.py). When the table's and the output's rows are
whole numbers of 16-byte-aligned chunks (``vector_aligned``), the launcher
runs the vector kernel: the same copy in 16-byte chunks (vector.py); the
scalar kernel otherwise. Both copy the same bits.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

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
def resolve(token, previous_ids):
    """The id an ids entry stands for: itself, or for -(r + 1) the previous step's sampled id of row r
    (-1, outside every vocabulary, when r is past previous_ids)."""
    if token >= 0:
        return token
    row = -(token + 1)
    return previous_ids[row] if row < previous_ids.shape[0] else -1


def build_embedding_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(ids int32 [T], table [rows, H], out [T, H], previous_ids int32 [R], first_id int32,
    vocab int32)``; table and out in the codec's storage dtype."""
    store = codec.store

    @cuda.jit
    def embedding(ids, table, out, previous_ids, first_id, vocab):
        hidden = out.shape[1]
        step = cuda.blockDim.x
        tile = step * UNROLL
        first = cuda.blockIdx.y * tile + cuda.threadIdx.x
        for t in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            id_ = resolve(ids[t], previous_ids)
            token = id_ - first_id
            if 0 <= id_ < vocab and not 0 <= token < table.shape[0]:  # another rank's row
                zero = store(float32(0.0))
                for i in range(cuda.blockIdx.y * step + cuda.threadIdx.x, hidden, cuda.gridDim.y * step):
                    out[t, i] = zero
            elif 0 <= id_ < vocab:
                for i in range(first, hidden, cuda.gridDim.y * tile):
                    if i + 3 * step < hidden:  # a full tile: all loads, then all stores
                        v0, v1 = table[token, i], table[token, i + step]
                        v2, v3 = table[token, i + 2 * step], table[token, i + 3 * step]
                        out[t, i] = v0
                        out[t, i + step] = v1
                        out[t, i + 2 * step] = v2
                        out[t, i + 3 * step] = v3
                    else:  # the row's ragged end
                        for j in range(i, hidden, step):
                            out[t, j] = table[token, j]
            else:
                poison = store(float32(math.nan))
                for i in range(cuda.blockIdx.y * step + cuda.threadIdx.x, hidden, cuda.gridDim.y * step):
                    out[t, i] = poison

    return embedding


def build_embedding_vector_kernel(codec: Codec) -> Callable[..., Any]:
    """Kernel ``(ids int32 [T], table [rows, H], out [T, H], previous_ids int32 [R], first_id int32, vocab int32)``
    as build_embedding_kernel, in 16-byte chunks.

    Every chunk of every table and output row must be 16-byte aligned (the launcher checks).
    """
    store = codec.store
    load_vector, store_vector = build_vector_access()
    lanes = lanes_for(codec)
    _, put_lane = build_lanes(codec)
    words = word_type(codec)
    buffer_words = VECTOR_UNROLL * VECTOR_WORDS

    @cuda.jit
    def embedding_vector(ids, table, out, previous_ids, first_id, vocab):
        chunks = out.shape[1] // lanes
        buf = cuda.local.array(buffer_words, words)
        poison = store(float32(math.nan))
        zero = store(float32(0.0))
        step = cuda.blockDim.x
        tile = step * VECTOR_UNROLL
        first = cuda.blockIdx.y * tile + cuda.threadIdx.x
        for t in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            id_ = resolve(ids[t], previous_ids)
            token = id_ - first_id
            valid = 0 <= id_ < vocab
            held = valid and 0 <= token < table.shape[0]
            fill = zero if valid else poison
            for c in range(first, chunks, cuda.gridDim.y * tile):
                for u in range(VECTOR_UNROLL):  # all loads of the tile, then all stores
                    if c + u * step < chunks:
                        if held:
                            load_vector(table, (token, (c + u * step) * lanes), buf, u * VECTOR_WORDS)
                        else:
                            for k in range(u * lanes, (u + 1) * lanes):
                                put_lane(buf, k, fill)
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        store_vector(out, (t, (c + u * step) * lanes), buf, u * VECTOR_WORDS)

    return embedding_vector


class Embedding:
    """Launcher for ``out[t, :] = table[ids[t], :]`` (not in place).

    Arrays: ids int32 [T]; table [rows, H] and out [T, H] in the codec's storage
    dtype (float32, or bf16 viewed as int16); row-sliced views allowed;
    previous_ids int32 [R], the previous step's sampled ids that an id -(r + 1)
    stands for (module docstring). ``first_id``: the id of the table's row 0; ``vocab``: the
    vocabulary's ids (None: the table's rows). Ids outside [0, vocab) give a NaN row, ids of the
    vocabulary the table does not hold a zero row.
    ``vectorize=False`` always runs the scalar kernel.
    """

    def __init__(self, codec: Codec, max_threads: int = MAX_THREADS, vectorize: bool = True) -> None:
        self.kernel = Kernel(build_embedding_kernel(codec))
        self.vector_kernel = Kernel(build_embedding_vector_kernel(codec)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = check_max_threads(max_threads)

    def uses_vector(self, table: Any, out: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel."""
        return self.vector_kernel is not None and vector_aligned(table, out)

    def __call__(self, ids: Any, table: Any, out: Any, previous_ids: Any, stream: Any = 0, first_id: int = 0,
                 vocab: int | None = None) -> None:
        rows, hidden = out.shape
        if tuple(ids.shape) != (rows,):
            raise ValueError(f"ids has shape {tuple(ids.shape)}, expected ({rows},)")
        if table.shape[1] != hidden:
            raise ValueError(f"table has shape {tuple(table.shape)}, expected (V, {hidden})")
        if rows == 0 or hidden == 0:
            return
        ids_range = (np.int32(first_id), np.int32(table.shape[0] if vocab is None else vocab))
        if self.uses_vector(table, out):
            grid, threads = elementwise_grid(rows, hidden // self.lanes, self.max_threads, VECTOR_UNROLL)
            self.vector_kernel[grid, threads, stream](ids, table, out, previous_ids, *ids_range)
            return
        grid, threads = elementwise_grid(rows, hidden, self.max_threads)
        self.kernel[grid, threads, stream](ids, table, out, previous_ids, *ids_range)
