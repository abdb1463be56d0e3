"""The causal softmax between the two GEMMs of GEMM prefill attention (executor.models.prefill_attention).

``CausalSoftmax``: each float32 score row -> its probabilities in the
activation dtype, ``exp(scale * s - m) / l`` over the keys the row's query may
see (``j <= position``) and 0 beyond it (the tile's later rows see more keys,
so its GEMM spans them all).

The softmax is bound by memory traffic: each float32 score is read once and
each probability written once, in 16-byte accesses (vector.py). Two kernels:

- Register (rows of up to 8192 keys): a row's threads hold its scores in
  registers, four 8-score groups a thread, all loaded before any is used; the
  row's maximum and sum are reduced across its threads and the probabilities
  written from the same registers, each exponential computed once. Builds of
  128 threads hold 1, 2 or 4 rows a block (rows of up to 4096, 2048 or 1024
  keys), one of 256 threads rows of up to 8192.
- Streaming (longer rows): a block per row sweeps the row twice in DRAM, an
  online (max, sum) and then the probabilities.

On the H200 the register kernel took a 4096-token Qwen3-8B prefill's eight
tiles of 16384 score rows (512 to 4096 keys) in 611 us, against 897 us for a
shared-memory row cache and 1182 us for the streaming kernel alone; past 8192
keys the streaming kernel is the fastest build measured (a sweep of builds of
128-512 threads and 1-8 groups a thread: docs/benchmarks.md, "Row kernel
sweeps"; bench/kernels.py's causal_softmax case times the last tile).

Rows are ``K`` scores long and K is arbitrary, so a row starts anywhere within
a 16-byte chunk: each pass takes the elements before the row's first aligned
boundary one at a time (the head), then whole chunks or groups, then the
scalar tail. The launcher only requires both base addresses 16-byte aligned and
the rows contiguous; otherwise the streaming kernel's scalar build runs. Both
rows start at element row * K, so a bf16 probability chunk (8 elements, its
offset a multiple of 8) starts where a score chunk does: an 8-score group,
from an 8-element boundary, is two whole score chunks and one probability chunk.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import build_group_max, build_group_sum
from executor.kernels.primitives.vector import (
    VECTOR_WORDS, build_lanes, build_vector_access, contiguous_aligned, lanes_for, word_type,
)
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

#: The warp on the GPU, and the streaming kernel's block. In the simulator, where every thread is a
#: Python thread, blocks of 8-16 threads in "warps" of 4 still give rows of several warps and of
#: part of one.
SOFTMAX_THREADS, SOFTMAX_WARP = 256, 32
SIMULATOR_THREADS, SIMULATOR_WARP = 16, 4
#: The streaming kernel's rows per block. Its rows are long (> 8192 keys), and few rows in flight leave
#: its second sweep's re-reads a chance in the H200's 50 MB of L2.
STREAMING_ROWS_PER_BLOCK = 1
#: 16-byte score loads each streaming thread issues together (on the H200, 4 x 256 threads within 2%
#: of the best of unrolls 2, 4, 8 at 128-512 threads).
SOFTMAX_UNROLL = 4
#: The register kernel: a thread holds REGISTER_GROUPS groups of GROUP scores (two 16-byte score chunks,
#: whose probabilities are one 16-byte bf16 chunk), all loaded before any is used.
GROUP, REGISTER_GROUPS = 8, 4
#: Its builds, (threads a block, rows a block), fewest keys first: a build holds rows of up to
#: threads // rows x REGISTER_GROUPS x GROUP keys (1024, 2048, 4096, 8192 on the GPU).
REGISTER_BUILDS = ((128, 4), (128, 2), (128, 1), (256, 1))
SIMULATOR_REGISTER_BUILDS = ((8, 4), (8, 2), (8, 1), (16, 1))


@cuda.jit(device=True, inline=True)
def _larger(a, b):
    return max(a, b)


@cuda.jit(device=True, inline=True)
def _plus(a, b):
    return a + b


def build_row_reductions(threads: int, rows_per_block: int, warp: int) -> tuple[Any, Any]:
    """``(row_max, row_sum)``: device functions ``(shared, partials, value) -> float32``, the maximum
    and the sum of ``value`` over the ``threads // rows_per_block`` consecutive threads of this
    thread's row, returned to each of them.

    Shuffles within a warp (reduce.py), then, for a row of several warps, each warp's result through
    ``shared[partials + warp]`` and a barrier. In the simulator ``shared[partials + threads // warp:]``
    is reduce.py's scratch of ``threads`` float32 (reduction_bytes counts both). Every thread of the
    block calls them, rows past the end included (barriers).
    """
    per_row = threads // rows_per_block
    width = min(warp, per_row)  # the simulator's 8 rows a block have fewer threads than a warp
    warps_per_row = per_row // width

    def build(group_reduce: Any, combine: Any) -> Any:
        @cuda.jit(device=True, inline=True)
        def row_reduce(shared, partials, value):
            value = group_reduce(shared[partials + threads // warp:], value, width)
            if warps_per_row > 1:
                tid = cuda.threadIdx.x
                if tid % width == 0:
                    shared[partials + tid // width] = value
                cuda.syncthreads()
                first = partials + tid // per_row * warps_per_row
                value = shared[first]
                for w in range(1, warps_per_row):
                    value = combine(value, shared[first + w])
                cuda.syncthreads()  # before the next reduction rewrites the partials
            return value

        return row_reduce

    return build(build_group_max(), _larger), build(build_group_sum(), _plus)


def reduction_bytes(threads: int, warp: int) -> int:
    """Shared memory of build_row_reductions: a float32 a warp, and in the simulator one a thread."""
    return 4 * (threads // warp + (threads if simulator_enabled() else 0))


@cuda.jit(device=True, inline=True)
def _softmax_row(scores, rows_per_head, group, first_position, rows_per_block, per_row):
    """(slot of the row in the block, row, its visible keys) of this thread."""
    slot = cuda.threadIdx.x // per_row
    row = cuda.blockIdx.x * rows_per_block + slot
    visible = 0  # a row past the end still joins the block's barriers and reductions
    if row < scores.shape[0]:
        visible = min(scores.shape[1], first_position + row // group % rows_per_head + 1)
    return slot, row, visible


@cuda.jit(device=True, inline=True)
def aligned_split(row, length, row_length, lanes):
    """``(head, chunks)`` of the first ``length`` elements of ``row`` in a C-contiguous array of
    ``row_length``-element rows, ``lanes`` elements to 16 bytes, at a 16-byte aligned address: the
    ``head`` elements before the row's first 16-byte boundary, then ``chunks`` whole chunks (the
    fewer than ``lanes`` left are the tail)."""
    head = min(length, (lanes - row * row_length % lanes) % lanes)
    return head, (length - head) // lanes


@cuda.jit(device=True, inline=True)
def _term(x, scale, largest):
    """exp(scale x - max): a score's term of the sum."""
    return float32(math.exp(x * scale - largest))


@cuda.jit(device=True, inline=True)
def _online(largest, total, value):
    """(max, sum of exp(v - max)) over the values before ``value`` and it, from those before it."""
    if value > largest:
        total *= float32(math.exp(largest - value))  # 0 before the first value (exp(-inf))
        largest = value
    return largest, total + float32(math.exp(value - largest))


def register_keys(threads: int, rows_per_block: int) -> int:
    """The longest row a register build holds."""
    return threads // rows_per_block * REGISTER_GROUPS * GROUP


def build_register_softmax(codec: Codec, threads: int, rows_per_block: int, warp: int) -> Any:
    """Kernel ``(scores [R, K] f32, probs [R, K] storage, rows_per_head, group, first_position, scale f32)``
    for rows of K <= register_keys(threads, rows_per_block), each score read from DRAM once into registers.

    Row i is query row ``t = i // group % rows_per_head`` of its kv head (rows ordered kv head, query
    row, group member), at position ``first_position + t``; it sees keys ``0 .. first_position + t``.
    ``scale`` > 0 (max(scale x) = scale max(x)).

    A row's ``threads // rows_per_block`` threads split it into 8-score groups from its first
    8-element boundary (16-byte aligned in both arrays); thread l holds groups l, l + per_row, ...
    The up to 7 scores before that boundary and after the last whole group are read one at a time
    (again from L1 in the later passes). Each exponential is computed once and kept in its register.
    Both arrays C-contiguous at 16-byte aligned addresses. Launch ceil(R / rows_per_block) blocks of
    ``threads`` with ``reduction_bytes(threads, warp)`` bytes of dynamic shared memory.
    """
    store = codec.store
    load_vector, store_vector = build_vector_access()
    _, put_lane = build_lanes(codec)
    out_lanes, out_word = lanes_for(codec), word_type(codec)
    chunk = VECTOR_WORDS
    per_row = threads // rows_per_block
    held = REGISTER_GROUPS * GROUP
    row_max, row_sum = build_row_reductions(threads, rows_per_block, warp)

    @cuda.jit
    def register_causal_softmax_kernel(scores, probs, rows_per_head, group, first_position, scale):
        shared = cuda.shared.array(0, float32)  # the reductions' scratch
        x = cuda.local.array(held, float32)  # registers: the thread's groups, scores then exponentials
        out = cuda.local.array(VECTOR_WORDS, out_word)
        num_keys = scores.shape[1]
        _, row, visible = _softmax_row(scores, rows_per_head, group, first_position, rows_per_block, per_row)
        lane = cuda.threadIdx.x % per_row
        head, groups = aligned_split(row, visible, num_keys, GROUP)
        tail = head + GROUP * groups

        for i in range(REGISTER_GROUPS):
            c = lane + i * per_row
            if c < groups:
                for h in range(GROUP // chunk):
                    load_vector(scores, (row, head + c * GROUP + h * chunk), x, i * GROUP + h * chunk)
        largest = float32(-math.inf)
        for e in range(lane, head + visible - tail, per_row):  # the scalar head and tail
            largest = max(largest, scores[row, e if e < head else tail + e - head])
        for i in range(REGISTER_GROUPS):
            if lane + i * per_row < groups:
                for k in range(GROUP):
                    largest = max(largest, x[i * GROUP + k])
        largest = row_max(shared, 0, largest) * scale

        total = float32(0.0)
        for e in range(lane, head + visible - tail, per_row):
            total += _term(scores[row, e if e < head else tail + e - head], scale, largest)
        for i in range(REGISTER_GROUPS):
            if lane + i * per_row < groups:
                for k in range(GROUP):
                    p = _term(x[i * GROUP + k], scale, largest)
                    x[i * GROUP + k] = p
                    total += p
        total = row_sum(shared, 0, total)

        if row < scores.shape[0]:  # visible >= 1: the row's maximum adds exp(0) = 1 to its sum
            inverse = float32(1.0) / total
            # The whole row's split: the same head as the visible one whenever groups > 0.
            head, all_groups = aligned_split(row, num_keys, num_keys, GROUP)
            tail = head + GROUP * all_groups
            for e in range(lane, head + num_keys - tail, per_row):
                j = e if e < head else tail + e - head
                p = float32(0.0)
                if j < visible:
                    p = _term(scores[row, j], scale, largest) * inverse
                probs[row, j] = store(p)
            for i in range(REGISTER_GROUPS):
                c = lane + i * per_row
                if c < all_groups:
                    first = head + c * GROUP
                    for k in range(GROUP):
                        p = float32(0.0)
                        if c < groups:
                            p = x[i * GROUP + k] * inverse
                        elif first + k < visible:  # the visible scalar tail, in this group of the whole row
                            p = _term(scores[row, first + k], scale, largest) * inverse
                        put_lane(out, k % out_lanes, store(p))
                        if k % out_lanes == out_lanes - 1:
                            store_vector(probs, (row, first + k + 1 - out_lanes), out, 0)

    return register_causal_softmax_kernel


def build_streaming_softmax(codec: Codec, threads: int, rows_per_block: int, warp: int, vector: bool) -> Any:
    """Kernel ``(scores [R, K] f32, probs [R, K] storage, rows_per_head, group, first_position, scale f32)`` as
    build_register_softmax's, for rows of any length: two sweeps of the row in DRAM.

    Sweep 1 keeps each thread's online (max m, sum l of exp(scale x - m)), l rescaled by exp(m_old -
    m_new) when m grows (once per SOFTMAX_UNROLL chunks); the row's max M is reduced, then the sum of
    the l exp(m - M). Sweep 2 writes the probabilities, back to front: the end of the row, read last,
    is the likeliest to still be in L2. ``vector``: 16-byte accesses, both arrays C-contiguous at
    16-byte aligned addresses; otherwise one element at a time, any strides. Launch ceil(R /
    rows_per_block) blocks of ``threads`` with ``reduction_bytes(threads, warp)`` bytes of dynamic
    shared memory.
    """
    store = codec.store
    load_vector, store_vector = build_vector_access()
    _, put_lane = build_lanes(codec)
    out_lanes, out_word = lanes_for(codec), word_type(codec)
    chunk = VECTOR_WORDS
    per_row = threads // rows_per_block
    sweep = SOFTMAX_UNROLL * per_row
    # Sweep 2 loads the same SOFTMAX_UNROLL score chunks together: half as many bf16 probability chunks.
    out_unroll = SOFTMAX_UNROLL * chunk // out_lanes
    out_sweep = out_unroll * per_row
    buffer_words = SOFTMAX_UNROLL * chunk
    row_max, row_sum = build_row_reductions(threads, rows_per_block, warp)

    @cuda.jit
    def streaming_causal_softmax_kernel(scores, probs, rows_per_head, group, first_position, scale):
        shared = cuda.shared.array(0, float32)  # the reductions' scratch
        words = cuda.local.array(buffer_words, float32)  # registers: the loads in flight
        out = cuda.local.array(VECTOR_WORDS, out_word)
        num_keys = scores.shape[1]
        _, row, visible = _softmax_row(scores, rows_per_head, group, first_position, rows_per_block, per_row)
        lane = cuda.threadIdx.x % per_row

        largest, total = float32(-math.inf), float32(0.0)
        head, chunks = visible, 0  # without vector accesses, every score is "head"
        if vector:
            head, chunks = aligned_split(row, visible, num_keys, chunk)
        tail = head + chunk * chunks
        for e in range(lane, head + visible - tail, per_row):
            j = e if e < head else tail + e - head
            largest, total = _online(largest, total, scores[row, j] * scale)
        for c in range(lane, chunks, sweep):
            for u in range(SOFTMAX_UNROLL):
                if c + u * per_row < chunks:
                    load_vector(scores, (row, head + (c + u * per_row) * chunk), words, u * chunk)
            top = largest
            for u in range(SOFTMAX_UNROLL):
                if c + u * per_row < chunks:
                    for k in range(chunk):
                        top = max(top, words[u * chunk + k] * scale)
            if top > largest:
                total *= float32(math.exp(largest - top))
                largest = top
            for u in range(SOFTMAX_UNROLL):
                if c + u * per_row < chunks:
                    for k in range(chunk):
                        total += _term(words[u * chunk + k], scale, largest)
        row_largest = row_max(shared, 0, largest)
        if largest > float32(-math.inf):  # a thread that saw no score adds nothing (exp(-inf + inf) is NaN)
            total *= float32(math.exp(largest - row_largest))
        total = row_sum(shared, 0, total)

        if row < scores.shape[0]:
            inverse = float32(1.0) / total
            head, chunks = num_keys, 0
            if vector:
                head, chunks = aligned_split(row, num_keys, num_keys, out_lanes)
            tail = head + out_lanes * chunks
            for e in range(lane, head + num_keys - tail, per_row):
                j = e if e < head else tail + e - head
                p = float32(0.0)
                if j < visible:
                    p = _term(scores[row, j], scale, row_largest) * inverse
                probs[row, j] = store(p)
            for s in range((chunks + out_sweep - 1) // out_sweep - 1, -1, -1):
                c = s * out_sweep + lane
                for u in range(out_unroll):
                    first = head + (c + u * per_row) * out_lanes
                    if c + u * per_row < chunks and first < visible:  # a probability chunk of score chunks
                        for h in range(out_lanes // chunk):
                            load_vector(scores, (row, first + h * chunk), words, u * out_lanes + h * chunk)
                for u in range(out_unroll):
                    if c + u * per_row < chunks:
                        first = head + (c + u * per_row) * out_lanes
                        for k in range(out_lanes):
                            p = float32(0.0)
                            if first + k < visible:
                                p = _term(words[u * out_lanes + k], scale, row_largest) * inverse
                            put_lane(out, k, store(p))
                        store_vector(probs, (row, first), out, 0)

    return streaming_causal_softmax_kernel


class CausalSoftmax:
    """Launcher: ``probs = causal softmax(scale * scores)`` per row.

    - scores [R', K] float32: rows ordered (kv head, query row of the tile, group member): ``group``
      consecutive rows share a query row (GQA heads packed by kv head).
    - probs [R', K] storage dtype (not in place).
    - rows_per_head: query rows of the tile; first_position: the position of its first row
      (query row t sees keys 0 .. first_position + t, which must be < K + 1).
    - scale: > 0.

    With ``uses_vector``, the first of ``register_builds`` (threads, rows a block) that holds K keys
    runs, else the streaming kernel (16-byte accesses when ``uses_vector``). The default builds are
    REGISTER_BUILDS (SIMULATOR_REGISTER_BUILDS in the simulator); tests pass one build, or none, to
    reach each kernel at small K.
    """

    def __init__(self, codec: Codec, register_builds: tuple[tuple[int, int], ...] | None = None) -> None:
        simulated = simulator_enabled()
        self.threads, self.warp = (SIMULATOR_THREADS, SIMULATOR_WARP) if simulated else (SOFTMAX_THREADS, SOFTMAX_WARP)
        if register_builds is None:
            register_builds = SIMULATOR_REGISTER_BUILDS if simulated else REGISTER_BUILDS
        for threads, rows in register_builds:
            if threads % self.warp or threads % rows or threads > 1024:
                raise ValueError(f"causal_softmax: a register build of {threads} threads and {rows} rows a block; "
                                 f"threads must be a multiple of the {self.warp}-thread warp and of rows, <= 1024")
        # (most keys, threads, rows a block, shared bytes, kernel), fewest keys first
        self.register = [(register_keys(threads, rows), threads, rows, reduction_bytes(threads, self.warp),
                          Kernel(build_register_softmax(codec, threads, rows, self.warp)))
                         for threads, rows in sorted(register_builds, key=lambda build: register_keys(*build))]
        self.streaming = {
            vector: Kernel(build_streaming_softmax(codec, self.threads, STREAMING_ROWS_PER_BLOCK, self.warp, vector))
            for vector in (True, False)
        }
        self.streaming_shared_bytes = reduction_bytes(self.threads, self.warp)

    def register_build(self, num_keys: int) -> tuple[int, int] | None:
        """(threads, rows a block) of the register build that runs rows of ``num_keys`` keys, or None
        (the streaming kernel)."""
        entry = self._register_entry(num_keys)
        return None if entry is None else entry[1:3]

    def _register_entry(self, num_keys: int) -> tuple[int, int, int, int, Kernel] | None:
        """The first register build holding rows of ``num_keys`` keys (``self.register``'s entry)."""
        return next((entry for entry in self.register if entry[0] >= num_keys), None)

    @staticmethod
    def uses_vector(scores: Any, probs: Any) -> bool:
        """Whether a call with these arrays may take 16-byte accesses (contiguous_aligned)."""
        return contiguous_aligned(scores, probs)

    def __call__(self, scores: Any, probs: Any, rows_per_head: int, first_position: int, scale: float,
                 group: int = 1, stream: Any = 0) -> None:
        rows, keys = (int(n) for n in scores.shape)
        if tuple(probs.shape) != (rows, keys):
            raise ValueError(f"causal_softmax: probs must be [{rows}, {keys}], got {tuple(probs.shape)}")
        if group < 1 or rows % (rows_per_head * group) or first_position < 0 or first_position + rows_per_head > keys:
            raise ValueError(f"causal_softmax: {rows} rows of {rows_per_head} query rows x {group} per head from "
                             f"position {first_position} do not fit {keys} keys")
        if not scale > 0:
            raise ValueError(f"causal_softmax: scale must be > 0, got {scale}")
        if rows == 0:
            return
        args = (scores, probs, np.int32(rows_per_head), np.int32(group), np.int32(first_position), np.float32(scale))
        vector = self.uses_vector(scores, probs)
        entry = self._register_entry(keys) if vector else None
        if entry is not None:
            _, threads, rows_per_block, shared_bytes, kernel = entry
            kernel[-(-rows // rows_per_block), threads, stream, shared_bytes](*args)
            return
        blocks = -(-rows // STREAMING_ROWS_PER_BLOCK)
        self.streaming[vector][blocks, self.threads, stream, self.streaming_shared_bytes](*args)
