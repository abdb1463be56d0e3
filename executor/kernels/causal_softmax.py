"""The causal softmax between the two GEMMs of GEMM prefill attention (executor.models.prefill_attention).

``CausalSoftmax``: each float32 score row -> its probabilities in the
activation dtype, ``exp(scale * s - m) / l`` over the keys the row's query may
see (``j <= position``) and 0 beyond it (the tile's later rows see more keys,
so its GEMM spans them all).

The softmax is bound by memory traffic. A warp per row sweeping its row three
times (max, sum, write) with 4-byte loads moved about 1 TB/s of useful traffic
on an H200, which copies at ~4 TB/s: 189 us of each 16384 x 2304 tile, a third
of a 4096-token Qwen3-8B prefill. So each score is read from DRAM once, in
16-byte accesses (vector.py), by one of two kernels (on the H200: 105 us for
that tile, torch.softmax of the same float32 scores 162 us; the read and
write alone would take 55 us at the copy bandwidth):

- Cached (rows of up to ~12,000 keys): a block owns ``rows_per_block`` rows
  (8, 4, 2 or 1: a build each, threads // rows_per_block >= 32 threads a row)
  and copies their visible scores into dynamic shared memory, tracking the
  maximum on the way; the sum of exponentials and the probabilities then read
  shared memory. The launcher picks the most rows whose cache fits
  SHARED_BUDGET_BYTES, under the 48 KiB a block gets without opting in to more.
- Streaming (longer rows): a block per row sweeps the row twice in DRAM, an
  online (max, sum) and then the probabilities.

Rows are ``K`` scores long and K is arbitrary, so a row starts anywhere within
a 16-byte chunk: each pass takes the elements before the row's first 16-byte
boundary one at a time (the head), then whole chunks, then the scalar tail.
The launcher only requires both base addresses 16-byte aligned and the rows
contiguous; otherwise the streaming kernel's scalar build runs. Both rows start
at element row * K, so a probability chunk (4 float32 or 8 bf16 elements, its
offset a multiple of 4 or 8) starts where a score chunk does: it is 1 or 2
whole score chunks.

The row cache is four planes of ``K // 4 + 2`` words: score ``j`` lies in plane
``(j + skew) % 4`` at ``(j + skew) // 4``, skew being the row start's offset in
its chunk. A thread's 16-byte load lands as four words at one index of the four
planes, so a warp's stores are 32 consecutive words a plane, free of bank
conflicts; stored as they lie in DRAM (4 words a thread) they would conflict 4
ways, and the bf16 write pass's reads (8 consecutive words a thread) 8 ways
(with planes: 2). The exponentials are computed again in the write pass rather
than written back: the arithmetic units idle here, shared memory does not.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.codec import Codec
from executor.kernels.launch import SHARED_LIMIT_BYTES, Kernel
from executor.kernels.reduce import build_group_max, build_group_sum
from executor.kernels.vector import (
    VECTOR_BYTES, VECTOR_WORDS, array_layout, build_lanes, build_vector_access, lanes_for, word_type,
)
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, uint64  # noqa: E402  (after load_cuda's numpy fix)

#: Softmax block size and warp on the GPU; in the simulator, where every thread is a Python thread, a
#: block of 16 threads in "warps" of 4 still gives rows of several warps (1 or 2 rows a block) and of
#: part of one (8 rows).
SOFTMAX_THREADS, SOFTMAX_WARP = 256, 32
SIMULATOR_THREADS, SIMULATOR_WARP = 16, 4
#: Rows per block of the cached kernel's builds, the most first.
CACHED_ROWS = (8, 4, 2, 1)
#: The cached kernel's budget under the launch limit: the KiB of margin is for static shared memory the
#: kernels may gain.
SHARED_BUDGET_BYTES = SHARED_LIMIT_BYTES - 1024
#: The streaming kernel's rows per block. Its rows are long (> ~12,000 keys, > 3,000 chunks: a dozen a
#: thread), and few rows in flight leave its second sweep's re-reads a chance in the H200's 50 MB of L2:
#: 64 KB rows of a warp each (64 an SM) are ~540 MB in flight, of a block of 256 each (4 an SM at 56
#: registers a thread) ~35 MB. An estimate, not measured.
STREAMING_ROWS_PER_BLOCK = 1
#: 16-byte score loads each softmax thread issues together. On the H200 (16384 x 2304, 4096 x 8448 and
#: 4096 x 15000 bf16 tiles) unrolls of 2, 4 and 8 at 128, 256 and 512 threads a block: 4 x 256 within 2%
#: of the best everywhere; 512 threads 35-45% slower, an unroll of 2 up to 10%.
SOFTMAX_UNROLL = 4


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


def cached_shared_bytes(rows_per_block: int, num_keys: int, threads: int, warp: int) -> int:
    """Dynamic shared memory of a cached softmax block: ``rows_per_block`` row caches of 4 planes of
    ``num_keys // 4 + 2`` float32 (a row shifted by its skew of up to 3), then the reduction scratch."""
    return rows_per_block * VECTOR_WORDS * (num_keys // VECTOR_WORDS + 2) * 4 + reduction_bytes(threads, warp)


@cuda.jit(device=True, inline=True)
def _softmax_row(scores, rows_per_head, first_position, rows_per_block, per_row):
    """(slot of the row in the block, row, its visible keys) of this thread."""
    slot = cuda.threadIdx.x // per_row
    row = cuda.blockIdx.x * rows_per_block + slot
    visible = 0  # a row past the end still joins the block's barriers and reductions
    if row < scores.shape[0]:
        visible = min(scores.shape[1], first_position + row % rows_per_head + 1)
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
def _cache_word(cache, plane, index, which):
    """The shared memory word of a row cache at ``cache`` (planes of ``plane`` words) at ``index`` of
    plane ``which``: score j's is ``(j + skew) // 4`` of plane ``(j + skew) % 4`` (module docstring).
    Unsigned: indexing with a signed integer adds Numba's negative-index wraparound (ptxas for sm_90:
    72 registers a thread with it, 48 without)."""
    return uint64(cache + which * plane + index)


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


def build_cached_softmax(codec: Codec, threads: int, rows_per_block: int, warp: int) -> Any:
    """Kernel ``(scores [R, K] f32, probs [R, K] storage, rows_per_head, first_position, scale f32)``
    through the shared row cache (module docstring).

    Row i is query row ``t = i % rows_per_head`` of its (kv head, group member) block, at position
    ``first_position + t``; it sees keys ``0 .. first_position + t``. Both arrays C-contiguous at
    16-byte aligned addresses; ``scale`` > 0 (max(scale x) = scale max(x)). Launch ceil(R /
    rows_per_block) blocks of ``threads`` (a multiple of ``warp``) with ``cached_shared_bytes(
    rows_per_block, K, threads, warp)`` bytes of dynamic shared memory; a row's threads are
    consecutive.
    """
    store = codec.store
    load_vector, store_vector = build_vector_access()
    _, put_lane = build_lanes(codec)
    out_lanes, out_word = lanes_for(codec), word_type(codec)
    chunk = VECTOR_WORDS  # float32 scores to a 16-byte chunk
    per_row = threads // rows_per_block
    sweep = SOFTMAX_UNROLL * per_row
    buffer_words = SOFTMAX_UNROLL * chunk
    row_max, row_sum = build_row_reductions(threads, rows_per_block, warp)

    @cuda.jit
    def cached_causal_softmax_kernel(scores, probs, rows_per_head, first_position, scale):
        shared = cuda.shared.array(0, float32)
        words = cuda.local.array(buffer_words, float32)  # registers: the loads in flight
        out = cuda.local.array(VECTOR_WORDS, out_word)
        num_keys = scores.shape[1]
        slot, row, visible = _softmax_row(scores, rows_per_head, first_position, rows_per_block, per_row)
        lane = cuda.threadIdx.x % per_row
        plane = num_keys // chunk + 2  # cached_shared_bytes's layout
        cache = slot * chunk * plane
        partials = rows_per_block * chunk * plane
        skew = row * num_keys % chunk

        # The visible scores into the cache, and this thread's maximum of them.
        largest = float32(-math.inf)
        head, chunks = aligned_split(row, visible, num_keys, chunk)
        tail = head + chunk * chunks
        for e in range(lane, head + visible - tail, per_row):  # the head and the tail, a score a thread
            j = e if e < head else tail + e - head
            x = scores[row, j]
            shared[_cache_word(cache, plane, (j + skew) // chunk, (j + skew) % chunk)] = x
            largest = max(largest, x)
        for c in range(lane, chunks, sweep):
            for u in range(SOFTMAX_UNROLL):
                if c + u * per_row < chunks:
                    load_vector(scores, (row, head + (c + u * per_row) * chunk), words, u * chunk)
            for u in range(SOFTMAX_UNROLL):
                if c + u * per_row < chunks:
                    index = (head + skew) // chunk + c + u * per_row
                    for k in range(chunk):
                        shared[_cache_word(cache, plane, index, k)] = words[u * chunk + k]
                        largest = max(largest, words[u * chunk + k])
        cuda.syncthreads()  # the whole row cached before its threads read each other's scores
        largest = row_max(shared, partials, largest) * scale

        total = float32(0.0)
        for index in range(lane, (skew + visible + chunk - 1) // chunk, per_row):
            for k in range(chunk):
                j = index * chunk + k - skew
                if j >= 0 and j < visible:
                    total += _term(shared[_cache_word(cache, plane, index, k)], scale, largest)
        total = row_sum(shared, partials, total)

        if row < scores.shape[0]:  # visible >= 1: the row's maximum adds exp(0) = 1 to its sum
            inverse = float32(1.0) / total
            head, chunks = aligned_split(row, num_keys, num_keys, out_lanes)
            tail = head + out_lanes * chunks
            for e in range(lane, head + num_keys - tail, per_row):
                j = e if e < head else tail + e - head
                p = float32(0.0)
                if j < visible:
                    x = shared[_cache_word(cache, plane, (j + skew) // chunk, (j + skew) % chunk)]
                    p = _term(x, scale, largest) * inverse
                probs[row, j] = store(p)
            for c in range(lane, chunks, per_row):
                first = head + c * out_lanes
                index = (first + skew) // chunk  # first + skew is a multiple of chunk (module docstring)
                for k in range(out_lanes):
                    p = float32(0.0)
                    if first + k < visible:
                        x = shared[_cache_word(cache, plane, index + k // chunk, k % chunk)]
                        p = _term(x, scale, largest) * inverse
                    put_lane(out, k, store(p))
                store_vector(probs, (row, first), out, 0)

    return cached_causal_softmax_kernel


def build_streaming_softmax(codec: Codec, threads: int, rows_per_block: int, warp: int, vector: bool) -> Any:
    """Kernel ``(scores [R, K] f32, probs [R, K] storage, rows_per_head, first_position, scale f32)`` as
    build_cached_softmax's, for rows of any length: two sweeps of the row in DRAM.

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
    def streaming_causal_softmax_kernel(scores, probs, rows_per_head, first_position, scale):
        shared = cuda.shared.array(0, float32)  # the reductions' scratch
        words = cuda.local.array(buffer_words, float32)  # registers: the loads in flight
        out = cuda.local.array(VECTOR_WORDS, out_word)
        num_keys = scores.shape[1]
        _, row, visible = _softmax_row(scores, rows_per_head, first_position, rows_per_block, per_row)
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


def contiguous_aligned(*arrays: Any) -> bool:
    """Whether every array is C-contiguous from a 16-byte aligned address: the vector kernels' need.
    Unlike vector.vector_aligned, rows need not be whole chunks (the kernels align each row)."""
    for a in arrays:
        layout = array_layout(a)
        if layout.address % VECTOR_BYTES:
            return False
        expected = layout.itemsize_bytes
        for length, stride in reversed(tuple(zip(layout.shape, layout.strides_bytes))):
            if length > 1 and stride != expected:
                return False
            expected *= length
    return True


class CausalSoftmax:
    """Launcher: ``probs = causal softmax(scale * scores)`` per row.

    - scores [R', K] float32: rows ordered (kv head, group member, query row of the tile).
    - probs [R', K] storage dtype (not in place).
    - rows_per_head: query rows of the tile; first_position: the position of its first row
      (row t sees keys 0 .. first_position + t, which must be < K + 1).
    - scale: > 0.

    The cached kernel runs when ``cached_rows(K)`` > 0 and ``uses_vector``, else the streaming one
    (16-byte accesses when ``uses_vector``). ``shared_budget``: the cached kernel's most dynamic shared
    memory, in bytes (tests lower it to reach every build at small K).
    """

    def __init__(self, codec: Codec, shared_budget: int = SHARED_BUDGET_BYTES) -> None:
        if not 0 <= shared_budget <= SHARED_LIMIT_BYTES:
            raise ValueError(f"causal_softmax: shared_budget must be in [0, {SHARED_LIMIT_BYTES}] bytes, "
                             f"got {shared_budget}")
        simulated = simulator_enabled()
        self.threads, self.warp = (SIMULATOR_THREADS, SIMULATOR_WARP) if simulated else (SOFTMAX_THREADS, SOFTMAX_WARP)
        self.shared_budget = shared_budget
        self.cached = {rows: Kernel(build_cached_softmax(codec, self.threads, rows, self.warp)) for rows in CACHED_ROWS}
        self.streaming = {
            vector: Kernel(build_streaming_softmax(codec, self.threads, STREAMING_ROWS_PER_BLOCK, self.warp, vector))
            for vector in (True, False)
        }

    def shared_bytes(self, rows_per_block: int, num_keys: int) -> int:
        """Dynamic shared memory of a cached block of ``rows_per_block`` rows of ``num_keys`` keys."""
        return cached_shared_bytes(rows_per_block, num_keys, self.threads, self.warp)

    def cached_rows(self, num_keys: int) -> int:
        """Rows per block of the cached kernel for rows of ``num_keys`` keys: the most in CACHED_ROWS
        whose shared memory fits the budget, or 0 when not even one row's does (streaming kernel)."""
        return next((rows for rows in CACHED_ROWS if self.shared_bytes(rows, num_keys) <= self.shared_budget), 0)

    @staticmethod
    def uses_vector(scores: Any, probs: Any) -> bool:
        """Whether a call with these arrays may take 16-byte accesses (contiguous_aligned)."""
        return contiguous_aligned(scores, probs)

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
        args = (scores, probs, np.int32(rows_per_head), np.int32(first_position), np.float32(scale))
        vector = self.uses_vector(scores, probs)
        rows_per_block = self.cached_rows(keys) if vector else 0
        if rows_per_block:
            blocks = -(-rows // rows_per_block)
            self.cached[rows_per_block][blocks, self.threads, stream, self.shared_bytes(rows_per_block, keys)](*args)
        else:
            blocks = -(-rows // STREAMING_ROWS_PER_BLOCK)
            self.streaming[vector][blocks, self.threads, stream, reduction_bytes(self.threads, self.warp)](*args)
