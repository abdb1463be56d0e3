"""Random sampling of one token per row: temperature, top-k, a stateless counter-based RNG.

Kernel ``sample(logits, temperature, top_k, seed, step, out_ids)``, one block per row:

- ``logits`` float32 [B, V] (a row-sliced view is fine), ``temperature`` float32 [B],
  ``top_k`` int32 [B], ``seed`` int64 [B] (its 64 bits are the RNG key: negative
  seeds are fine), ``step`` int32 [B] (the index of the token being sampled for
  the request; only its low 32 bits matter), ``out_ids`` int32 [B].
- ``temperature <= 0`` (or NaN), ``top_k == 1``: greedy, the first index of the
  maximum with torch.argmax's NaN rule (sampling.py's ``better``).
- Otherwise a sample of ``softmax(logits * (1 / T))`` restricted to the top-k
  logits; ``top_k <= 0`` or ``>= V`` means no restriction. Ties at the k-th value
  are all kept (HF's TopKLogitsWarper keeps ``logits >= k-th largest``), and
  -0.0 counts as equal to +0.0.
- A row whose maximum is not finite (a NaN anywhere, +inf, or all -inf) gets the
  greedy answer in every mode: softmax is undefined there, and a NaN row shows up
  as the index of its first NaN instead of a plausible token. So does a row whose
  ``1 / T`` or ``max * (1 / T)`` overflows (T tiny: the greedy limit).

Randomness: Gumbel-max. The token is ``argmax_i (x_i + g_i)`` over the candidates,
``x_i = logits_i * (1/T)`` (float32), ``g_i = -log(-log(u_i))``, ``u_i`` a
uniform from Philox4x32-10 (Salmon et al., SC'11; also one of cuRAND's
generators) keyed by the 64-bit seed (key = low word, high word) at counter
``(i, step, 0, 0)``; word 0 ``w`` of the output gives
``u = ((w >> 9) + 0.5) * 2**-23``, in ``[2**-24, 1 - 2**-24]`` (never 0 or 1).
Counter words 2 and 3 are free for other streams of the same request (a top-p
draw, say). No float sum is involved anywhere, so the token depends only on
(seed, step, logits row, T, k): not on the batch position,
the batch composition or the block size. The hash is integer-only (uint64 holding
32-bit words, every product of two 32-bit words fits, every sum is masked), so the
simulator computes the very bits the GPU does; the two logs are float32 ``logf``
on the GPU and float64-then-rounded in the simulator (the last bit of a Gumbel
may differ between them, which flips a token only on a float32 tie of scores).

Work per row (one block of ``threads_for(V, 512)`` threads; each "pass" is one
strided read of the row, from L2 after the first):

1. argmax pass (every row): max M and its index. Greedy rows stop here.
2. Window: ``g`` lies in [-2.82, 16.64], so an element with
   ``x_i < x_M - 21 - |x_M| * 2**-20`` can never win (the last term covers
   float32 rounding of the scores); it is skipped, hash and logs included.
3. top-k only (1 < k < V): a counting pass over the window. If at most k
   elements lie in it, the restriction cannot change the winner (the window is
   an upper set of the logits, so it lies inside the top-k set) and nothing more
   is done: the usual case for a peaked LLM distribution at T <= 1.
   Otherwise a radix select finds the k-th largest logit exactly, on an
   order-preserving 32-bit key of its float bits, 4 bits per pass: at most 8
   passes, each a read of the row, 16 per-thread counters in shared memory and a
   16-wide tree reduction; it stops early when the digit bin being split closes
   the count at exactly k. The cost does not depend on k.
4. Gumbel pass: Philox (10 rounds of two 64-bit multiplies) + two logs only for
   candidates inside the window, then a block argmax.

So: greedy 1 pass; unrestricted 2 passes; top-k 3 passes, at most 11 when more
than k logits lie within ~21 * T of the max. No global scratch; static shared
memory only (``SHARED_BYTES``, under 37 KB). No warp shuffles (the simulator runs it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from executor.kernels.codec import _bit_casts
from executor.kernels.launch import Kernel
from executor.kernels.reduce import check_max_threads, threads_for
from executor.kernels.sampling import beats, better
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32, int32, int64, uint64  # noqa: E402  (after load_cuda's numpy fix)

# The largest block a launcher picks: the radix counters are RADIX x MAX_THREADS int32.
MAX_THREADS = 512
RADIX_BITS = 4
RADIX = 1 << RADIX_BITS
RADIX_PASSES = 32 // RADIX_BITS
# Static shared memory per block: radix counters, argmax candidates (value, index), 3 int64 of state.
SHARED_BYTES = RADIX * MAX_THREADS * 4 + MAX_THREADS * 8 + 3 * 8

# Philox4x32-10 constants (multipliers and Weyl key increments of the published generator).
PHILOX_ROUNDS = 10
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
ZERO64 = np.uint64(0)
# Uniform from the top 23 bits of a word: (m + 0.5) * 2**-23, exact in float32.
UNIFORM_SHIFT = np.uint64(9)
TWO_M23 = np.float32(2.0**-23)
TWO_M24 = np.float32(2.0**-24)
# Gumbel noise from those uniforms lies in [-log(24 ln 2), -log(-log(1 - 2**-24))] = [-2.82, 16.64]:
# a span under 20, plus 1 of slack. Elements further than this below the max cannot win.
GUMBEL_WINDOW = np.float32(21.0)
WINDOW_REL = np.float32(2.0**-20)  # covers float32 rounding of large scores (|x| * 2**-23 per rounding)
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)
NAN_KEY = 0xFFFFFFFF  # NaN sorts above +inf (it is always a candidate and wins, as in argmax)

_int_as_float, float_as_int = _bit_casts()


@cuda.jit(device=True, inline=True)
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter (c0..c3) under key (k0, k1); uint64 values holding 32-bit words.

    Every product is of two 32-bit words (fits in 64 bits), every key sum is
    masked, so the simulator's numpy uint64 scalars and the GPU agree bit for bit.
    """
    for _ in range(PHILOX_ROUNDS):
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> SHIFT32) ^ c1 ^ k0, p1 & MASK32, (p0 >> SHIFT32) ^ c3 ^ k1, p0 & MASK32
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


@cuda.jit(device=True, inline=True)
def uniform_bits(key0, key1, step_word, index):
    """The 32-bit random word of element ``index`` at ``step_word`` (uint64 words): Philox word 0."""
    w0, _w1, _w2, _w3 = philox4x32(index, step_word, ZERO64, ZERO64, key0, key1)
    return w0


@cuda.jit(device=True, inline=True)
def gumbel(key0, key1, step_word, index):
    """Gumbel(0, 1) noise of element ``index`` as float32: ``-log(-log(u))``, u in [2**-24, 1 - 2**-24]."""
    u = float32(uniform_bits(key0, key1, step_word, index) >> UNIFORM_SHIFT) * TWO_M23 + TWO_M24
    return float32(-math.log(-math.log(u)))


@cuda.jit(device=True, inline=True)
def seed_words(seed_value):
    """(low, high) 32-bit words of an int64 seed, as uint64 values."""
    s = uint64(seed_value)
    return s & MASK32, (s >> SHIFT32) & MASK32


@cuda.jit(device=True, inline=True)
def order_key(value):
    """A 32-bit key (int64 in [0, 2**32)) ordered like the float32 ``value``; -0.0 maps like +0.0, NaN on top."""
    if value != value:
        return int64(NAN_KEY)
    if value == float32(0.0):
        return int64(0x80000000)
    bits = int64(float_as_int(float32(value)))  # signed int32 bits
    if bits >= 0:
        return bits + int64(0x80000000)
    return int64(0x7FFFFFFF) - (bits & int64(0x7FFFFFFF))


@cuda.jit(device=True, inline=True)
def is_finite(x):
    return x == x and x != POS_INF and x != NEG_INF


@cuda.jit(device=True, inline=True)
def block_argmax(values, indices, value, index):
    """Block-wide winner of ``(value, index)`` under argmax's rule; every thread gets it. Ends with a barrier."""
    tid = cuda.threadIdx.x
    values[tid] = value
    indices[tid] = index
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride and beats(values[tid + stride], indices[tid + stride], values[tid], indices[tid]):
            values[tid] = values[tid + stride]
            indices[tid] = indices[tid + stride]
        cuda.syncthreads()
        stride //= 2
    best_value = values[0]
    best_index = indices[0]
    cuda.syncthreads()
    return best_value, best_index


@cuda.jit(device=True, inline=True)
def block_count(counts, value):
    """Block-wide sum of a per-thread count through row 0 of ``counts``; every thread gets it. Ends with a barrier."""
    tid = cuda.threadIdx.x
    counts[0, tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            counts[0, tid] += counts[0, tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = int64(counts[0, 0])
    cuda.syncthreads()
    return total


@cuda.jit(device=True, inline=True)
def kth_largest_key(logits, b, k, counts, state):
    """``order_key`` of the k-th largest logit of row b (1 <= k <= V), by MSD radix select.

    Pass p counts, per thread, the elements whose key matches the digits chosen so
    far in each of the RADIX bins of the next digit; a tree sums the counters; thread 0
    walks the bins from the top to the one holding the k-th element. If that bin
    closes the count at exactly k, every key >= the bin's lower bound is in the top k
    and the lower bound is returned at once. Ends with a barrier.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    vocab = logits.shape[1]
    if tid == 0:
        state[0] = 0  # digits chosen so far
        state[1] = k  # rank still wanted inside them
        state[2] = 0  # 1 once a bin closed the count exactly
    cuda.syncthreads()
    threshold = int64(-1)
    for p in range(RADIX_PASSES):
        shift = 32 - RADIX_BITS * (p + 1)
        prefix = state[0]
        for d in range(RADIX):
            counts[d, tid] = 0
        for i in range(tid, vocab, nt):
            key = order_key(float32(logits[b, i]))
            if (key >> (shift + RADIX_BITS)) == prefix:
                counts[(key >> shift) & (RADIX - 1), tid] += 1
        cuda.syncthreads()
        stride = nt // 2
        while stride > 0:
            if tid < stride:
                for d in range(RADIX):
                    counts[d, tid] += counts[d, tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            wanted = state[1]
            above = int64(0)
            d = RADIX - 1
            while d > 0 and above + counts[d, 0] < wanted:
                above += counts[d, 0]
                d -= 1
            state[0] = prefix * RADIX + d
            state[1] = wanted - above
            state[2] = 1 if above + counts[d, 0] == wanted else 0
        cuda.syncthreads()
        chosen = state[0]
        if state[2] != 0 and threshold < 0:
            threshold = chosen << shift
        # Every thread has read state before thread 0 may rewrite it in the next pass.
        cuda.syncthreads()
        if threshold >= 0:
            break
    if threshold < 0:
        threshold = state[0]
    return threshold


def build_sample_kernel() -> Callable[..., Any]:
    """Kernel ``(logits f32 [B, V], temperature f32 [B], top_k i32 [B], seed i64 [B], step i32 [B], out_ids i32 [B])``.

    Launch with one block per row (grid-stride over rows) and a power-of-two block of at
    most MAX_THREADS threads; shared memory is static.
    """

    @cuda.jit
    def sample(logits, temperature, top_k, seed, step, out_ids):
        values = cuda.shared.array(MAX_THREADS, float32)
        indices = cuda.shared.array(MAX_THREADS, int32)
        counts = cuda.shared.array((RADIX, MAX_THREADS), int32)
        state = cuda.shared.array(3, int64)
        vocab = logits.shape[1]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        for b in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):
            # 1. argmax: the greedy answer, and the max for the window.
            best_value = NEG_INF
            best_index = int32(vocab)  # sentinel: loses to every element
            for i in range(tid, vocab, nt):
                best_value, best_index = better(float32(logits[b, i]), int32(i), best_value, best_index)
            top, top_index = block_argmax(values, indices, best_value, best_index)
            t = float32(temperature[b])
            k = int64(top_k[b])
            greedy = not (t > float32(0.0)) or k == 1 or not is_finite(top)
            inv_t = float32(0.0)
            x_top = float32(0.0)
            if not greedy:
                inv_t = float32(1.0) / t
                x_top = top * inv_t
                greedy = not is_finite(inv_t) or not is_finite(x_top)
            if greedy:
                if tid == 0:
                    out_ids[b] = top_index
                continue
            # 2. the window of elements that can still win.
            cut = x_top - (GUMBEL_WINDOW + abs(x_top) * WINDOW_REL)
            # 3. top-k threshold key; 0 keeps everything.
            threshold = int64(0)
            if k > 0 and k < vocab:
                inside = 0
                for i in range(tid, vocab, nt):
                    if float32(logits[b, i]) * inv_t >= cut:
                        inside += 1
                if block_count(counts, inside) > k:
                    threshold = kth_largest_key(logits, b, k, counts, state)
            # 4. Gumbel-max over the candidates.
            key0, key1 = seed_words(seed[b])
            step_word = uint64(int64(step[b])) & MASK32
            best_value = NEG_INF
            best_index = int32(vocab)
            for i in range(tid, vocab, nt):
                logit = float32(logits[b, i])
                x = logit * inv_t
                if x >= cut and (threshold == 0 or order_key(logit) >= threshold):
                    score = x + gumbel(key0, key1, step_word, uint64(i))
                    best_value, best_index = better(score, int32(i), best_value, best_index)
            _, chosen = block_argmax(values, indices, best_value, best_index)
            if tid == 0:
                out_ids[b] = chosen

    return sample


class Sample:
    """Launcher: ``out_ids[b]`` = a token of row b (greedy, or sampled with temperature and top-k).

    Arrays (all indexed by row b): logits float32 [B, V], temperature float32 [B],
    top_k int32 [B], seed int64 [B], step int32 [B], out_ids int32 [B]. Semantics and
    cost: the module docstring. One block per row of ``threads_for(V, max_threads)``
    threads; no scratch buffers, SHARED_BYTES of static shared memory per block.
    """

    def __init__(self, max_threads: int = MAX_THREADS) -> None:
        self.kernel = Kernel(build_sample_kernel())
        self.max_threads = check_max_threads(max_threads, MAX_THREADS)

    def __call__(self, logits: Any, temperature: Any, top_k: Any, seed: Any, step: Any, out_ids: Any,
                 stream: Any = 0) -> None:
        rows, vocab = logits.shape
        for name, array in (("temperature", temperature), ("top_k", top_k), ("seed", seed), ("step", step),
                            ("out_ids", out_ids)):
            if tuple(array.shape) != (rows,):
                raise ValueError(f"{name} has shape {tuple(array.shape)}, expected ({rows},)")
        if vocab == 0:
            raise ValueError("sampling over an empty vocabulary")
        if rows == 0:
            return
        threads = threads_for(vocab, self.max_threads)
        self.kernel[rows, threads, stream](logits, temperature, top_k, seed, step, out_ids)
