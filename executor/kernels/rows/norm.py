"""RMSNorm over the last axis of token rows, plain and fused with the residual add.

    y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w)

``weight_offset`` is 0.0 for Qwen3 (``w * norm(x)``) and 1.0 for Qwen3.5's
zero-centred RMSNorm (``norm(x) * (1 + w)``). Statistics and arithmetic are
float32 whatever the storage codec. Two rounding behaviours mirror HF exactly:

- ``round_before_weight=True`` (Qwen3RMSNorm): ``norm(x)`` is rounded to the
  storage dtype, then multiplied by the weight and rounded again.
- ``round_before_weight=False`` (Qwen3_5RMSNorm): ``norm(x) * (offset + w)`` in
  float32, rounded once.

With the F32 codec both are the same float32 computation.

One block owns one row (grid-stride over rows); threads stride over the row so
loads are coalesced, UNROLL loads in flight per thread. Pass 1 reads the row
and reduces the sum of squares; the reduction ends in a barrier; pass 2 writes
(re-reading the row, mostly from L2). Every element is written by the thread
that read it in pass 1, so ``out`` may alias ``x`` (and, for the fused kernel,
``residual``). Launchers pick the block size from the row count (row_threads).

Vector kernels: when x, out (and residual) rows and the weight are whole
numbers of 16-byte-aligned chunks (``vector_aligned``), the launchers run the
same two passes over 16-byte chunks (vector.py), VECTOR_UNROLL chunks per
thread per sweep. A row that fits in one sweep (the usual case: the launcher
sizes the block for it) stays in registers between the passes, so pass 2
reads only the weight. Elements are rounded exactly as in the scalar kernels;
only the order of the float32 sum of squares differs (each thread sums its
chunks' elements in turn), which moves inv_rms by float32 ulps at most.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import block_sum, check_max_threads, threads_for
from executor.kernels.primitives.vector import VECTOR_WORDS, build_lanes, build_vector_access, lanes_for, vector_aligned, word_type
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

# The largest block a launcher may pick.
MAX_THREADS = 1024
# The reduction scratch is dynamic shared memory (blockDim.x float32, sized by the
# launch): the simulator hands out static cuda.shared.array allocations through
# an unlocked dict, and two threads of a block racing on the first allocation
# can each get their own array (seen: flaky simulator failures).
SCRATCH_BYTES_PER_THREAD = 4
# Block size limits, measured on an H200 with bf16 rows of 4096: many rows (a
# prefill chunk) want small blocks (16384 rows: 128 threads 243 us, 512 threads
# 369 us: a shorter reduction tree, more blocks per SM); a few rows (decode)
# want wide ones (1 row: 128 threads 8.7 us, 512 threads 6.4 us).
DEFAULT_THREADS = 512
MANY_ROWS = 256
MANY_ROWS_THREADS = 128
UNROLL = 4  # elements per thread in flight; the passes spell out this many loads
# Vector kernels: 16-byte chunks per thread per sweep, and the block limit for
# many rows. A 4096-wide bf16 row (512 chunks) is one sweep of 128 threads, a
# 5120-wide one (640 chunks) one sweep of 256 threads.
VECTOR_UNROLL = 4
MANY_ROWS_VECTOR_THREADS = 256


def build_normalize(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Device function ``(value, inv_rms, w, weight_offset) -> float32``: one output element before its store.

    ``value`` and ``w`` are already float32 (loaded); the caller stores the result.
    Shared with the q/k norm in rope/qk_norm_rope.py so both follow the same rounding.
    """
    load, store = codec.load, codec.store

    if round_before_weight:

        @cuda.jit(device=True, inline=True)
        def normalize(value, inv_rms, w, weight_offset):
            # HF Qwen3RMSNorm: norm(x).to(input_dtype), then weight * that.
            return load(store(value * inv_rms)) * (weight_offset + w)

    else:

        @cuda.jit(device=True, inline=True)
        def normalize(value, inv_rms, w, weight_offset):
            # HF Qwen3_5RMSNorm: (norm(x) * (1 + w)) in float32, rounded once by the caller.
            return value * inv_rms * (weight_offset + w)

    return normalize


@cuda.jit(device=True, inline=True)
def inv_rms_from_sum(sum_sq, n, eps):
    """``rsqrt(sum_sq / n + eps)`` in float32 (``n`` elements, ``eps`` float32)."""
    return float32(1.0) / float32(math.sqrt(float32(sum_sq) / float32(n) + eps))


def build_row_passes(codec: Codec, round_before_weight: bool) -> tuple[Callable[..., Any], ...]:
    """Device functions over one row ``t``, each thread on its columns ``tid + k * blockDim``.

    - ``sum_squares(x, t, n) -> float32``: this thread's share of sum(x[t]^2).
    - ``add_sum_squares(x, residual, t, n) -> float32``: residual[t] <- store(residual[t] + x[t]),
      returning this thread's share of the rounded sum's squares.
    - ``write_normed(src, weight, out, t, n, inv_rms, weight_offset)``: out[t] <- normalized src[t].

    Every pass loads UNROLL elements before it stores any (the compiler cannot
    hoist loads over stores to a possibly aliased array), and a thread only ever
    touches its own columns, so out may alias the arrays it reads.
    """
    load, store = codec.load, codec.store
    normalize = build_normalize(codec, round_before_weight)

    @cuda.jit(device=True, inline=True)
    def sum_squares(x, t, n):
        step = cuda.blockDim.x
        partial = float32(0.0)
        for i in range(cuda.threadIdx.x, n, step * UNROLL):
            if i + 3 * step < n:
                v0, v1, v2, v3 = load(x[t, i]), load(x[t, i + step]), load(x[t, i + 2 * step]), load(x[t, i + 3 * step])
                partial += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)
            else:
                for j in range(i, n, step):
                    v = load(x[t, j])
                    partial += v * v
        return partial

    @cuda.jit(device=True, inline=True)
    def add_pair(x, residual, t, j):
        stored = store(load(residual[t, j]) + load(x[t, j]))
        residual[t, j] = stored
        v = load(stored)
        return v * v

    @cuda.jit(device=True, inline=True)
    def add_sum_squares(x, residual, t, n):
        step = cuda.blockDim.x
        partial = float32(0.0)
        for i in range(cuda.threadIdx.x, n, step * UNROLL):
            if i + 3 * step < n:
                r0, r1 = residual[t, i], residual[t, i + step]
                r2, r3 = residual[t, i + 2 * step], residual[t, i + 3 * step]
                x0, x1, x2, x3 = x[t, i], x[t, i + step], x[t, i + 2 * step], x[t, i + 3 * step]
                s0, s1 = store(load(r0) + load(x0)), store(load(r1) + load(x1))
                s2, s3 = store(load(r2) + load(x2)), store(load(r3) + load(x3))
                residual[t, i] = s0
                residual[t, i + step] = s1
                residual[t, i + 2 * step] = s2
                residual[t, i + 3 * step] = s3
                v0, v1, v2, v3 = load(s0), load(s1), load(s2), load(s3)
                partial += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)
            else:
                for j in range(i, n, step):
                    partial += add_pair(x, residual, t, j)
        return partial

    @cuda.jit(device=True, inline=True)
    def normed(src_bits, w_bits, inv_rms, weight_offset):
        return store(normalize(load(src_bits), inv_rms, load(w_bits), weight_offset))

    @cuda.jit(device=True, inline=True)
    def write_normed(src, weight, out, t, n, inv_rms, weight_offset):
        step = cuda.blockDim.x
        for i in range(cuda.threadIdx.x, n, step * UNROLL):
            if i + 3 * step < n:
                a0, a1, a2, a3 = src[t, i], src[t, i + step], src[t, i + 2 * step], src[t, i + 3 * step]
                w0, w1, w2, w3 = weight[i], weight[i + step], weight[i + 2 * step], weight[i + 3 * step]
                out[t, i] = normed(a0, w0, inv_rms, weight_offset)
                out[t, i + step] = normed(a1, w1, inv_rms, weight_offset)
                out[t, i + 2 * step] = normed(a2, w2, inv_rms, weight_offset)
                out[t, i + 3 * step] = normed(a3, w3, inv_rms, weight_offset)
            else:
                for j in range(i, n, step):
                    out[t, j] = normed(src[t, j], weight[j], inv_rms, weight_offset)

    return sum_squares, add_sum_squares, write_normed


def build_rms_norm_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(x [T,H], weight [H], out [T,H], eps f32, weight_offset f32)``; storage per ``codec``.

    Launch with ``SCRATCH_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory.
    """
    sum_squares, _, write_normed = build_row_passes(codec, round_before_weight)

    @cuda.jit
    def rms_norm(x, weight, out, eps, weight_offset):
        scratch = cuda.shared.array(0, float32)
        hidden = x.shape[1]
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            # block_sum's barriers order every pass-1 read of the row before any pass-2 write.
            inv_rms = inv_rms_from_sum(block_sum(scratch, sum_squares(x, t, hidden)), hidden, eps)
            write_normed(x, weight, out, t, hidden, inv_rms, weight_offset)

    return rms_norm


def build_add_rms_norm_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(x [T,H], residual [T,H], weight [H], out [T,H], eps f32, weight_offset f32)``.

    ``residual <- store(residual + x)`` in place, then ``out <- rms_norm(residual)``
    from the rounded residual, as HF's ``residual + hidden_states`` in the model dtype.
    Launch with ``SCRATCH_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory.
    """
    _, add_sum_squares, write_normed = build_row_passes(codec, round_before_weight)

    @cuda.jit
    def add_rms_norm_inplace(x, residual, weight, out, eps, weight_offset):
        scratch = cuda.shared.array(0, float32)
        hidden = x.shape[1]
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            partial = add_sum_squares(x, residual, t, hidden)
            # The barriers order every pass-1 read of x before any pass-2 write of out;
            # pass 2 reads back only the residual elements this thread wrote itself.
            inv_rms = inv_rms_from_sum(block_sum(scratch, partial), hidden, eps)
            write_normed(residual, weight, out, t, hidden, inv_rms, weight_offset)

    return add_rms_norm_inplace


def build_vector_row_passes(codec: Codec, round_before_weight: bool) -> tuple[Callable[..., Any], ...]:
    """Device functions over one row ``t`` in 16-byte chunks; thread ``tid`` owns chunks
    ``tid + u * blockDim + s * sweep`` (u < VECTOR_UNROLL, sweep = VECTOR_UNROLL * blockDim).

    ``row`` and ``other`` are local word buffers of VECTOR_UNROLL chunks (vector.py), ``w`` one of a chunk.

    - ``sum_squares(x, t, row) -> float32``: this thread's share of sum(x[t]^2); ``row`` is
      left holding the thread's chunks of the last sweep.
    - ``add_sum_squares(x, residual, t, row, other) -> float32``: residual[t] <- store(residual[t] + x[t]),
      returning this thread's share of the rounded sum's squares; ``row`` left holding the sums.
    - ``write_normed(src, weight, out, t, row, w, inv_rms, weight_offset)``: out[t] <- normalized
      src[t]. When the row is one sweep, ``row`` already holds this thread's chunks of src[t]
      (left by the pass-1 function) and src is not read again.

    A thread loads all chunks of a sweep before it stores any and touches only its own chunks,
    so out may alias the arrays it reads.
    """
    load, store = codec.load, codec.store
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(codec)
    lanes = lanes_for(codec)
    normalize = build_normalize(codec, round_before_weight)

    @cuda.jit(device=True, inline=True)
    def sum_squares(x, t, row):
        chunks = x.shape[1] // lanes
        step = cuda.blockDim.x
        partial = float32(0.0)
        for c in range(cuda.threadIdx.x, chunks, step * VECTOR_UNROLL):
            for u in range(VECTOR_UNROLL):
                if c + u * step < chunks:
                    load_vector(x, (t, (c + u * step) * lanes), row, u * VECTOR_WORDS)
            for u in range(VECTOR_UNROLL):
                if c + u * step < chunks:
                    for k in range(u * lanes, (u + 1) * lanes):
                        v = load(get_lane(row, k))
                        partial += v * v
        return partial

    @cuda.jit(device=True, inline=True)
    def add_sum_squares(x, residual, t, row, other):
        chunks = x.shape[1] // lanes
        step = cuda.blockDim.x
        partial = float32(0.0)
        for c in range(cuda.threadIdx.x, chunks, step * VECTOR_UNROLL):
            for u in range(VECTOR_UNROLL):
                if c + u * step < chunks:
                    load_vector(residual, (t, (c + u * step) * lanes), row, u * VECTOR_WORDS)
                    load_vector(x, (t, (c + u * step) * lanes), other, u * VECTOR_WORDS)
            for u in range(VECTOR_UNROLL):
                if c + u * step < chunks:
                    for k in range(u * lanes, (u + 1) * lanes):
                        summed = store(load(get_lane(row, k)) + load(get_lane(other, k)))
                        put_lane(row, k, summed)
                        v = load(summed)
                        partial += v * v
                    store_vector(residual, (t, (c + u * step) * lanes), row, u * VECTOR_WORDS)
        return partial

    @cuda.jit(device=True, inline=True)
    def write_normed(src, weight, out, t, row, w, inv_rms, weight_offset):
        chunks = src.shape[1] // lanes
        step = cuda.blockDim.x
        one_sweep = chunks <= step * VECTOR_UNROLL
        for c in range(cuda.threadIdx.x, chunks, step * VECTOR_UNROLL):
            if not one_sweep:
                for u in range(VECTOR_UNROLL):
                    if c + u * step < chunks:
                        load_vector(src, (t, (c + u * step) * lanes), row, u * VECTOR_WORDS)
            for u in range(VECTOR_UNROLL):
                if c + u * step < chunks:
                    # One weight chunk at a time (an L1/L2 hit: every row reads it): fewer
                    # registers than the whole sweep's weights, so more rows in flight per SM.
                    load_vector(weight, ((c + u * step) * lanes,), w, 0)
                    for k in range(lanes):
                        j = u * lanes + k
                        value = normalize(load(get_lane(row, j)), inv_rms, load(get_lane(w, k)), weight_offset)
                        put_lane(row, j, store(value))
                    store_vector(out, (t, (c + u * step) * lanes), row, u * VECTOR_WORDS)

    return sum_squares, add_sum_squares, write_normed


def build_rms_norm_vector_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(x [T,H], weight [H], out [T,H], eps f32, weight_offset f32)`` as build_rms_norm_kernel,
    over 16-byte chunks; every chunk of x, out and weight must be 16-byte aligned (the launcher checks).

    Launch with ``SCRATCH_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory.
    """
    sum_squares, _, write_normed = build_vector_row_passes(codec, round_before_weight)
    words = word_type(codec)
    buffer_words = VECTOR_UNROLL * VECTOR_WORDS

    @cuda.jit
    def rms_norm_vector(x, weight, out, eps, weight_offset):
        scratch = cuda.shared.array(0, float32)
        row = cuda.local.array(buffer_words, words)
        w = cuda.local.array(VECTOR_WORDS, words)
        hidden = x.shape[1]
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            # block_sum's barriers order every pass-1 read of the row before any pass-2 write.
            inv_rms = inv_rms_from_sum(block_sum(scratch, sum_squares(x, t, row)), hidden, eps)
            write_normed(x, weight, out, t, row, w, inv_rms, weight_offset)

    return rms_norm_vector


def build_add_rms_norm_vector_kernel(codec: Codec, round_before_weight: bool) -> Callable[..., Any]:
    """Kernel ``(x [T,H], residual [T,H], weight [H], out [T,H], eps f32, weight_offset f32)`` as
    build_add_rms_norm_kernel, over 16-byte chunks; every chunk must be 16-byte aligned (the launcher checks).

    Launch with ``SCRATCH_BYTES_PER_THREAD * blockDim.x`` bytes of dynamic shared memory.
    """
    _, add_sum_squares, write_normed = build_vector_row_passes(codec, round_before_weight)
    words = word_type(codec)
    buffer_words = VECTOR_UNROLL * VECTOR_WORDS

    @cuda.jit
    def add_rms_norm_inplace_vector(x, residual, weight, out, eps, weight_offset):
        scratch = cuda.shared.array(0, float32)
        row = cuda.local.array(buffer_words, words)
        other = cuda.local.array(buffer_words, words)
        hidden = x.shape[1]
        for t in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
            partial = add_sum_squares(x, residual, t, row, other)
            # The barriers order every pass-1 read of x before any pass-2 write of out;
            # pass 2 reads back only the residual chunks this thread wrote itself.
            inv_rms = inv_rms_from_sum(block_sum(scratch, partial), hidden, eps)
            write_normed(residual, weight, out, t, row, other, inv_rms, weight_offset)

    return add_rms_norm_inplace_vector


def block_limit(max_threads: int) -> int:
    """Validate a launcher's largest block size: a power of two within the shared scratch."""
    return check_max_threads(max_threads, MAX_THREADS)


def row_threads(rows: int, hidden: int, max_threads: int) -> int:
    """Block size for ``rows`` rows of ``hidden`` elements under a launcher's ``max_threads``."""
    limit = min(max_threads, MANY_ROWS_THREADS) if rows >= MANY_ROWS else max_threads
    return threads_for(math.ceil(hidden / UNROLL), limit)


def vector_row_threads(rows: int, chunks: int, max_threads: int) -> int:
    """Block size for the vector kernels: ``rows`` rows of ``chunks`` 16-byte chunks.

    Few rows (decode): one chunk per thread, up to ``max_threads``, for the most
    loads in flight per row. Many rows: just enough threads for one sweep of
    VECTOR_UNROLL chunks each (the row stays in registers), at most
    MANY_ROWS_VECTOR_THREADS, so small blocks keep many rows in flight per SM.
    """
    if rows >= MANY_ROWS:
        return threads_for(math.ceil(chunks / VECTOR_UNROLL), min(max_threads, MANY_ROWS_VECTOR_THREADS))
    return threads_for(chunks, max_threads)


def _check_shape(name: str, a: Any, expected: tuple[int, ...]) -> None:
    if tuple(a.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {expected}")


def launch_rows(launcher: Any, vector: bool, rows: int, hidden: int, stream: Any, *args: Any) -> None:
    """One block per row: the launcher's vector or scalar kernel, its block size for ``rows`` rows of
    ``hidden`` elements, and the reduction scratch as dynamic shared memory."""
    if vector:
        threads = vector_row_threads(rows, hidden // launcher.lanes, launcher.max_threads)
    else:
        threads = row_threads(rows, hidden, launcher.max_threads)
    kernel = launcher.vector_kernel if vector else launcher.kernel
    kernel[rows, threads, stream, threads * SCRATCH_BYTES_PER_THREAD](*args)


class RmsNorm:
    """Launcher for ``out = rms_norm(x) * (weight_offset + weight)``.

    Arrays: x [T, H], out [T, H] (row-sliced views allowed; ``out`` may be ``x``),
    weight [H]; all in the codec's storage dtype (float32, or bf16 viewed as int16).
    ``eps`` and ``weight_offset`` are plain floats, passed as float32.
    ``max_threads`` caps the block (a power of two, 32..1024); see row_threads.
    16-byte vector kernel when ``uses_vector``; ``vectorize=False`` always runs the scalar one.
    """

    def __init__(
        self, codec: Codec, round_before_weight: bool, max_threads: int = DEFAULT_THREADS, vectorize: bool = True
    ) -> None:
        self.kernel = Kernel(build_rms_norm_kernel(codec, round_before_weight))
        self.vector_kernel = Kernel(build_rms_norm_vector_kernel(codec, round_before_weight)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = block_limit(max_threads)

    def uses_vector(self, x: Any, weight: Any, out: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel."""
        return self.vector_kernel is not None and vector_aligned(x, weight, out)

    def __call__(self, x: Any, weight: Any, out: Any, eps: float, weight_offset: float, stream: Any = 0) -> None:
        rows, hidden = x.shape
        _check_shape("out", out, (rows, hidden))
        _check_shape("weight", weight, (hidden,))
        if rows == 0:
            return
        launch_rows(self, self.uses_vector(x, weight, out), rows, hidden, stream,
                    x, weight, out, np.float32(eps), np.float32(weight_offset))


class AddRmsNormInplace:
    """Launcher for the fused residual step (in place on ``residual``).

    ``residual <- residual + x`` (rounded to storage), then
    ``out <- rms_norm(residual) * (weight_offset + weight)``.
    Arrays: x, residual, out [T, H]; weight [H]; codec storage dtype. ``out`` may
    be ``x`` (the usual call: the layer output becomes the next normed input).
    16-byte vector kernel when ``uses_vector``; ``vectorize=False`` always runs the scalar one.
    """

    def __init__(
        self, codec: Codec, round_before_weight: bool, max_threads: int = DEFAULT_THREADS, vectorize: bool = True
    ) -> None:
        self.kernel = Kernel(build_add_rms_norm_kernel(codec, round_before_weight))
        self.vector_kernel = Kernel(build_add_rms_norm_vector_kernel(codec, round_before_weight)) if vectorize else None
        self.lanes = lanes_for(codec)
        self.max_threads = block_limit(max_threads)

    def uses_vector(self, x: Any, residual: Any, weight: Any, out: Any) -> bool:
        """Whether a call with these arrays runs the 16-byte vector kernel."""
        return self.vector_kernel is not None and vector_aligned(x, residual, weight, out)

    def __call__(
        self, x: Any, residual: Any, weight: Any, out: Any, eps: float, weight_offset: float, stream: Any = 0
    ) -> None:
        rows, hidden = x.shape
        _check_shape("residual", residual, (rows, hidden))
        _check_shape("out", out, (rows, hidden))
        _check_shape("weight", weight, (hidden,))
        if rows == 0:
            return
        launch_rows(self, self.uses_vector(x, residual, weight, out), rows, hidden, stream,
                    x, residual, weight, out, np.float32(eps), np.float32(weight_offset))
