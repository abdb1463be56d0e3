"""Random sampling of one token per row: temperature, top-k, top-p, a stateless counter-based RNG.

Kernel ``sample(logits, temperature, top_k, top_p, seed, step, out_ids)``, one block per row:

- ``logits`` float32 [B, V] (a row-sliced view is fine), ``temperature`` float32 [B],
  ``top_k`` int32 [B], ``top_p`` float32 [B], ``seed`` int64 [B] (its 64 bits are the RNG key: negative
  seeds are fine), ``step`` int32 [B] (the index of the token being sampled for
  the request; only its low 32 bits matter), ``out_ids`` int32 [B].
- ``temperature <= 0`` (or NaN), ``top_k == 1``: greedy, the first index of the
  maximum with torch.argmax's NaN rule (sampling.py's ``better``).
- Otherwise a sample of ``softmax(logits * (1 / T))`` restricted to the top-k
  logits; ``top_k <= 0`` or ``>= V`` means no restriction. Ties at the k-th value
  are all kept (HF's TopKLogitsWarper keeps ``logits >= k-th largest``), and
  -0.0 counts as equal to +0.0.
- ``0 < top_p < 1`` restricts the candidates further to the nucleus: the smallest set of the
  largest logits whose share of the (top-k restricted) softmax is at least ``top_p`` (HF's
  TopPLogitsWarper after TopKLogitsWarper, vLLM's order). Ties at its smallest value are all
  kept. ``top_p >= 1`` (or <= 0, or NaN) is no restriction.
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
draw, say). Without top-p no float sum is involved anywhere, so the token depends only on
(seed, step, logits row, T, k): not on the batch position,
the batch composition or the block size. A top-p row's nucleus comes from float32 sums in a
fixed tree over the block's threads: its token depends on (seed, step, row, T, k, p) and the
block size (one per vocabulary size for a launcher), never on the batch. The hash is integer-only (uint64 holding
32-bit words, every product of two 32-bit words fits, every sum is masked), so the
simulator computes the very bits the GPU does; the two logs are float32 ``logf``
on the GPU and float64-then-rounded in the simulator (the last bit of a Gumbel
may differ between them, which flips a token only on a float32 tie of scores).

Work per row (one block of ``threads_for(ceil(V / GROUP), 512)`` threads; each "pass" is one
read of the row, from L2 after the first). A pass reads the row in 16-byte chunks of CHUNK = 4
logits (vector.py), UNROLL = 8 chunks a thread at a time: thread t loads chunks ``t, t + nt,
..., t + 7 nt`` of its sweep together (8 loads in flight), then visits their GROUP = 32
logits, then moves on by ``8 nt`` chunks. A row may start anywhere in a chunk (in a [B, V]
view with V % 4 != 0 row b starts at byte ``b * V * 4``): the up to 3 logits before its first
16-byte boundary (the head) and the up to 3 after its last whole chunk (the tail) are read one
at a time. The kernel takes each row's head from the row's own address, so any view whose last
axis is contiguous reads chunks; a view with a strided last axis is read a logit at a time.
Each pass's per-thread result (an argmax under ``better``'s index tie-break, a count) does not
depend on the order it visits the elements in, so the token does not either.

1. argmax pass (every row): max M and its index. Greedy rows stop here. A chunk whose 4
   logits are all below the thread's best (none NaN) is settled by 4 compares; ``better``
   (a dozen instructions and branches a logit) runs only on the others.
2. Window: ``g`` lies in [-2.82, 16.64], so an element with
   ``x_i < x_M - 21 - |x_M| * 2**-20`` can never win (the last term covers
   float32 rounding of the scores); it is skipped, hash and logs included. A chunk
   with no logit in the window is settled by 4 multiplies and compares.
3. top-k only (1 < k < V): a counting pass over the window. If at most k
   elements lie in it, the restriction cannot change the winner (the window is
   an upper set of the logits, so it lies inside the top-k set) and nothing more
   is done: the usual case for a peaked LLM distribution at T <= 1.
   Otherwise a radix select finds the k-th largest logit exactly, on an
   order-preserving 32-bit key of its float bits, 4 bits per pass: at most 8
   passes, each a read of the row, 16 per-thread counters in shared memory and a
   16-wide tree reduction; it stops early when the digit bin being split closes
   the count at exactly k. The cost does not depend on k.
4. top-p only (0 < p < 1): a mass pass sums ``m_i = exp(x_i - x_M)`` over the top-k set (Z)
   and over its part inside the window. If the window's share is below p, the nucleus holds
   every candidate already and nothing more is done. Otherwise an MSD radix select, like
   top-k's, walks the digit bins from the top by their mass (per-thread float32 bin sums in
   the radix counters' shared memory, stored as bits) to the key where the mass from the top
   reaches p x Z: 8 passes, each a read of the row that computes ``m_i`` for the window's
   candidates of the current prefix only. Chunks whose logits all lie more than 110 below the
   max in ``x`` (``m_i`` is exactly 0 in float32 there) are settled by 4 multiplies in the mass
   pass, and chunks outside the window by the window test in the radix passes.
5. Gumbel pass: the window (and top-k, top-p) test of a thread's 32 loaded logits marks the
   candidates in a 32-bit mask; Philox (10 rounds of two 64-bit multiplies) and the
   two logs then run once per marked candidate, on its logit read again (from L1: the
   thread loaded it just before), then a block argmax. The hash out of the unrolled
   loop keeps that loop small enough for NVVM to unroll, which keeps the loaded logits
   in registers (indexed by constants).

So: greedy 1 pass; unrestricted 2 passes; top-k 3 passes, at most 11 when more
than k logits lie within ~21 * T of the max; top-p adds 1 pass, or 9 when the window holds
more than a share p of the mass (the usual case for a peaked distribution). No global scratch; static shared
memory only (``SHARED_BYTES``, under 37 KB). No warp shuffles (the simulator runs it).

Block size and unroll. At batch 1 one block runs on one SM, so a pass takes about (row
bytes / bytes in flight) memory latencies: a scalar kernel keeps one 4-byte load a thread
in flight (2 KB a block of 512), ~300 dependent loads a thread, 77-80 us on an H200 for a
151,936-logit row. 512 threads x 8 chunks x 16 bytes keep 64 KB in flight: ~9 sweeps of
that row a pass. 1024 threads would put the radix counters (RADIX x threads int32) past
the 48 KB static shared memory limit; an unroll of 16 would take ~200 registers a thread
(ptxas for sm_90, UNROLL 4 / 8 / 16: 94 / 124 / 198), more than a 512-thread block may
have (128, held by launch_bounds). At this block size ptxas spills nothing. Measured (H200,
torch.profiler over a batch-1 Qwen3-8B decode graph): 23.1 us a step, 76.8 us for the scalar
kernel; no unroll / block-size sweep has been run.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from llvmlite import ir

from executor.kernels.primitives.codec import _bit_casts
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import check_max_threads, threads_for
from executor.kernels.sampling.argmax_rule import beats, better
from executor.kernels.primitives.vector import VECTOR_BYTES, VECTOR_WORDS, build_vector_access
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32, int64, types, uint64  # noqa: E402  (after load_cuda's numpy fix)

# The largest block a launcher picks: the radix counters are RADIX x MAX_THREADS int32.
MAX_THREADS = 512
# Row reads: 16-byte chunks of CHUNK logits, UNROLL chunks a thread loaded together (module docstring).
FLOAT32_BYTES = 4
CHUNK = VECTOR_WORDS
UNROLL = 8
GROUP = UNROLL * CHUNK  # logits a thread holds at a time; the Gumbel pass marks its candidates in one word
assert GROUP <= 32, "the Gumbel pass's candidate mask is one 32-bit word (cuda.ffs)"
# The row scans, the radix select and the Gumbel visit (called twice) are inlined by NVVM
# (alwaysinline), not in Numba's IR, whose inlining copies IR at each inlined call: the sm_90 compile
# took 20 s that way, 11 s this way (the scalar kernel's: 7 s). They must be inlined somewhere, for
# the loaded chunks to stay in registers. The simulator's jit takes no forceinline.
NVVM_INLINE = {} if simulator_enabled() else {"forceinline": True}
RADIX_BITS = 4
RADIX = 1 << RADIX_BITS
RADIX_PASSES = 32 // RADIX_BITS
# Static shared memory per block: radix counters, argmax candidates (value, index), 3 int64 of state,
# the top-p mass still wanted (float32, padded to 8 bytes).
SHARED_BYTES = RADIX * MAX_THREADS * 4 + MAX_THREADS * 8 + 3 * 8 + 8

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
# exp(d) is exactly 0 in float32 for d < -104 (the smallest subnormal is exp(-103.3)): a logit this
# far below the max in x = logit / T adds nothing to a top-p mass.
MASS_FLOOR = np.float32(-110.0)
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
def block_sum(values, value):
    """Block-wide float32 sum of a per-thread value through ``values`` (a fixed tree: the same bits for a
    block size); every thread gets it. Ends with a barrier."""
    tid = cuda.threadIdx.x
    values[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            values[tid] += values[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = values[0]
    cuda.syncthreads()
    return total


# ---------------------------------------------------------------- reading a row


def build_data_address() -> Callable[..., Any]:
    """Device function ``data_address(array) -> int``: the address of ``array``'s first element.

    An llvmlite intrinsic on the GPU (the array's data pointer as an integer); in the simulator the
    address of the numpy memory the kernel reads, which is where vector.py's simulated loads check
    their 16-byte alignment.
    """
    if simulator_enabled():

        @cuda.jit(device=True)
        def simulated_data_address(array):
            return int(array.__array_interface__["data"][0])

        return simulated_data_address

    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    @intrinsic
    def data_address(typingctx, array):
        if not isinstance(array, types.Array):
            raise TypingError(f"data_address: takes an array, got {array}")

        def codegen(context, builder, signature, args):
            struct = context.make_array(signature.args[0])(context, builder, value=args[0])
            return builder.ptrtoint(struct.data, ir.IntType(64))

        return types.int64(array), codegen

    return data_address


def build_row_split(data_address: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``row_split(logits, b) -> (head, chunks)``: row b is ``head`` logits before
    its first 16-byte boundary, ``chunks`` whole 16-byte chunks, then the tail (fewer than CHUNK).

    From the row's own address, so a row may start anywhere. A row whose logits are not adjacent
    (last axis strided) or not 4-byte aligned is all head: read one logit at a time.
    """

    @cuda.jit(device=True, inline=True)
    def row_split(logits, b):
        vocab = logits.shape[1]
        start_bytes = data_address(logits) + b * logits.strides[0]
        if logits.strides[1] != FLOAT32_BYTES or start_bytes % FLOAT32_BYTES != 0:
            return vocab, int64(0)
        lane = start_bytes % VECTOR_BYTES // FLOAT32_BYTES  # of the row's first logit in its chunk
        head = min(vocab, (CHUNK - lane) % CHUNK)
        return head, (vocab - head) // CHUNK

    return row_split


def build_load_group(load_vector: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``load_group(logits, b, head, chunks, c, words)``: chunks ``c, c + nt, ...,
    c + (UNROLL - 1) nt`` of row b (those < chunks) into ``words``, chunk ``c + u nt`` at
    ``words[u * CHUNK:]``: UNROLL independent 16-byte loads in flight before any is used."""

    @cuda.jit(device=True, inline=True)
    def load_group(logits, b, head, chunks, c, words):
        nt = cuda.blockDim.x
        for u in range(UNROLL):
            if c + u * nt < chunks:
                load_vector(logits, (b, head + (c + u * nt) * CHUNK), words, u * CHUNK)

    return load_group


def build_edge_scan(visit: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``edges(logits, b, head, chunks, carry, context) -> carry``: ``visit`` over the
    scalar head and tail of row b (the logits outside its whole chunks, from row_split), a logit a
    thread."""

    @cuda.jit(device=True, inline=True)
    def edges(logits, b, head, chunks, carry, context):
        nt = cuda.blockDim.x
        tail = head + chunks * CHUNK
        for e in range(cuda.threadIdx.x, head + logits.shape[1] - tail, nt):
            i = e if e < head else tail + e - head
            carry = visit(carry, float32(logits[b, i]), i, context)
        return carry

    return edges


def build_row_scan(load_group: Callable[..., Any], visit: Callable[..., Any],
                   chunk_may_change: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``scan(logits, b, head, chunks, words, carry, context) -> carry``: this
    thread's ``carry = visit(carry, logit, index, context)`` over its share of row b.

    ``(head, chunks)`` from row_split; ``words`` is a GROUP-float32 local array (registers once the
    unrolled loops index it with constants). The head and the tail go first, a logit a thread, then
    groups of UNROLL chunks; ``visit`` must not depend on the order it sees the elements in. A
    loaded chunk whose ``chunk_may_change(carry, words, first_word, context)`` is False is not
    visited: it must be False only where no visit of the chunk's logits would change the carry.
    """
    edges = build_edge_scan(visit)

    @cuda.jit(device=True, **NVVM_INLINE)
    def scan(logits, b, head, chunks, words, carry, context):
        nt = cuda.blockDim.x
        carry = edges(logits, b, head, chunks, carry, context)
        for c in range(cuda.threadIdx.x, chunks, nt * UNROLL):
            load_group(logits, b, head, chunks, c, words)
            for u in range(UNROLL):
                if c + u * nt < chunks and chunk_may_change(carry, words, u * CHUNK, context):
                    first = head + (c + u * nt) * CHUNK
                    for k in range(CHUNK):
                        carry = visit(carry, words[u * CHUNK + k], first + k, context)
        return carry

    return scan


@cuda.jit(device=True, inline=True)
def any_chunk(_carry, _words, _first_word, _context):
    """chunk_may_change for a visit that every logit may change: visit them all."""
    return True


@cuda.jit(device=True, inline=True)
def argmax_visit(best, logit, index, _context):
    """Argmax carry ``(value, index)``: better's rule, which no visiting order changes."""
    return better(logit, int32(index), best[0], best[1])


@cuda.jit(device=True, inline=True)
def argmax_chunk_may_change(best, words, first_word, _context):
    """False when each logit of the chunk is below the best (none NaN), so none beats it.

    Four compares settle almost every chunk of a row. better's NaN and tie tests cost about a dozen
    instructions and branches a logit (ptxas, sm_90): at one block an SM, issuing them for every
    logit would take about as long as the row's reads.
    """
    below = True
    for k in range(CHUNK):
        below &= words[first_word + k] < best[0]
    return not below


@cuda.jit(device=True, inline=True)
def window_visit(inside, logit, _index, context):
    """Count carry: elements whose scaled logit lies in the window; context is ``(1 / T, cut)``."""
    inv_t, cut = context
    if logit * inv_t >= cut:
        return inside + 1
    return inside


@cuda.jit(device=True, inline=True)
def window_chunk_may_change(_carry, words, first_word, context):
    """False when no logit of the chunk lies in the window (context starts ``(1 / T, cut)``): such a
    chunk neither counts nor holds a Gumbel candidate. Four multiplies and compares a chunk, where
    the test a logit costs about ten instructions with its branches."""
    inv_t, cut = context[0], context[1]
    outside = True
    for k in range(CHUNK):
        outside &= words[first_word + k] * inv_t < cut
    return not outside


@cuda.jit(device=True, inline=True)
def radix_visit(carry, logit, _index, context):
    """Adds the element to this thread's counter of its digit when its key matches the digits chosen so
    far; context is ``(counts, prefix, shift)`` (kth_largest_key). The carry passes through."""
    counts, prefix, shift = context
    key = order_key(logit)
    if (key >> (shift + RADIX_BITS)) == prefix:
        counts[(key >> shift) & (RADIX - 1), cuda.threadIdx.x] += 1
    return carry


@cuda.jit(device=True, inline=True)
def is_candidate(logit, inv_t, cut, threshold):
    """Whether an element may win the Gumbel-max: inside the window and (threshold > 0) the top k and the
    top-p nucleus (both upper sets of the order keys: one threshold holds them)."""
    return logit * inv_t >= cut and (threshold == 0 or order_key(logit) >= threshold)


@cuda.jit(device=True, **NVVM_INLINE)
def gumbel_visit(best, logit, index, context):
    """Gumbel-max carry ``(score, index)`` over the candidates; context is
    ``(1 / T, cut, threshold, key0, key1, step_word)``."""
    inv_t, cut, threshold, key0, key1, step_word = context
    if is_candidate(logit, inv_t, cut, threshold):
        score = logit * inv_t + gumbel(key0, key1, step_word, uint64(index))
        return better(score, int32(index), best[0], best[1])
    return best


@cuda.jit(device=True, inline=True)
def mass_visit(carry, logit, _index, context):
    """Top-p mass carry ``(in top k, in top k and the window)`` of ``exp(x - x_top)``; context is
    ``(1 / T, cut, top-k threshold key or 0, x_top)``."""
    inv_t, cut, threshold, x_top = context
    total, inside = carry
    if threshold == 0 or order_key(logit) >= threshold:
        x = logit * inv_t
        mass = float32(math.exp(x - x_top))
        total += mass
        if x >= cut:
            inside += mass
    return total, inside


@cuda.jit(device=True, inline=True)
def mass_chunk_may_change(_carry, words, first_word, context):
    """False when every logit of the chunk lies so far below the max (MASS_FLOOR) that its mass is 0."""
    inv_t, x_top = context[0], context[3]
    below = True
    for k in range(CHUNK):
        below &= words[first_word + k] * inv_t - x_top < MASS_FLOOR
    return not below


@cuda.jit(device=True, inline=True)
def radix_mass_visit(carry, logit, _index, context):
    """Adds the element's mass to this thread's float32 bin (bits in ``counts``) of its digit when it is
    a candidate whose key matches the digits chosen so far; context is ``(1 / T, cut, top-k threshold,
    x_top, counts, prefix, shift)`` (top_p_key). The carry passes through."""
    inv_t, cut, threshold, x_top, counts, prefix, shift = context
    if is_candidate(logit, inv_t, cut, threshold):
        key = order_key(logit)
        if (key >> (shift + RADIX_BITS)) == prefix:
            digit = (key >> shift) & (RADIX - 1)
            tid = cuda.threadIdx.x
            mass = float32(math.exp(logit * inv_t - x_top))
            counts[digit, tid] = float_as_int(_int_as_float(counts[digit, tid]) + mass)
    return carry


def build_top_p_key(mass_scan: Callable[..., Any], radix_mass_scan: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``top_p_key(logits, b, head, chunks, words, p, context, values, counts, state, wanted)``:
    the ``order_key`` threshold of row b's top-p nucleus, or 0 when it holds every candidate; context is
    ``(1 / T, cut, top-k threshold key or 0, x_top)``.

    ``mass_scan`` (mass_visit) gives Z and the window's mass. When the window holds at least p x Z,
    the nucleus's smallest key lies among the window's candidates: an MSD radix select over their
    keys, 4 bits a pass, with float32 mass bins (bits in ``counts``) summed by a tree. Thread 0 walks
    the bins from the top, skipping empty ones, to the one where the mass from the top reaches the
    mass still wanted (``wanted[0]``). The chosen bin is never empty unless float rounding left the
    wanted mass above every bin, and then the walk ends in the lowest bin, below every candidate
    already counted: the nucleus is never empty. Ends with a barrier.
    """

    @cuda.jit(device=True, **NVVM_INLINE)
    def top_p_key(logits, b, head, chunks, words, p, context, values, counts, state, wanted):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        total, inside = mass_scan(logits, b, head, chunks, words, (float32(0.0), float32(0.0)), context)
        total = block_sum(values, total)
        inside = block_sum(values, inside)
        goal = p * total
        if inside < goal:
            return int64(0)  # every candidate is in the nucleus (uniform: every thread has the same sums)
        inv_t, cut, threshold, x_top = context
        if tid == 0:
            state[0] = 0  # digits chosen so far
            wanted[0] = goal  # mass still wanted inside them
        cuda.syncthreads()
        for p_index in range(RADIX_PASSES):
            shift = 32 - RADIX_BITS * (p_index + 1)
            prefix = state[0]
            for d in range(RADIX):
                counts[d, tid] = 0  # the bits of 0.0
            radix_mass_scan(logits, b, head, chunks, words, 0, (inv_t, cut, threshold, x_top, counts, prefix, shift))
            cuda.syncthreads()
            stride = nt // 2
            while stride > 0:
                if tid < stride:
                    for d in range(RADIX):
                        counts[d, tid] = float_as_int(_int_as_float(counts[d, tid])
                                                      + _int_as_float(counts[d, tid + stride]))
                cuda.syncthreads()
                stride //= 2
            if tid == 0:
                goal_left = wanted[0]
                above = float32(0.0)
                d = RADIX - 1
                while d > 0:
                    mass = _int_as_float(counts[d, 0])
                    if mass > float32(0.0) and above + mass >= goal_left:
                        break
                    above += mass
                    d -= 1
                state[0] = prefix * RADIX + d
                wanted[0] = goal_left - above
            # Every thread reads state[0] at the next pass's start; thread 0 rewrites it only after that
            # pass's barriers.
            cuda.syncthreads()
        key = state[0]
        cuda.syncthreads()
        return key

    return top_p_key


def build_gumbel_scan(load_group: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``scan(logits, b, head, chunks, words, best, context) -> best``: build_row_scan
    with gumbel_visit, but the hash runs outside the unrolled loop (module docstring, pass 4): the
    loop marks the group's candidates in a mask, then each marked logit is read again and scored."""
    edges = build_edge_scan(gumbel_visit)

    @cuda.jit(device=True, **NVVM_INLINE)
    def scan(logits, b, head, chunks, words, best, context):
        nt = cuda.blockDim.x
        inv_t, cut, threshold, _key0, _key1, _step_word = context
        best = edges(logits, b, head, chunks, best, context)
        for c in range(cuda.threadIdx.x, chunks, nt * UNROLL):
            load_group(logits, b, head, chunks, c, words)
            marked = int64(0)  # bit u * CHUNK + k: the logit at words[u * CHUNK + k]
            for u in range(UNROLL):
                if c + u * nt < chunks and window_chunk_may_change(best, words, u * CHUNK, context):
                    for k in range(CHUNK):
                        if is_candidate(words[u * CHUNK + k], inv_t, cut, threshold):
                            marked |= int64(1) << (u * CHUNK + k)
            while marked != 0:
                j = cuda.ffs(marked) - 1
                marked &= marked - 1
                i = head + (c + j // CHUNK * nt) * CHUNK + j % CHUNK
                best = gumbel_visit(best, float32(logits[b, i]), i, context)
        return best

    return scan


def build_kth_largest_key(radix_scan: Callable[..., Any]) -> Callable[..., Any]:
    """Device function ``kth_largest_key(logits, b, head, chunks, words, k, counts, state)``: the
    ``order_key`` of the k-th largest logit of row b (1 <= k <= V), by MSD radix select.

    Pass p counts, per thread, the elements whose key matches the digits chosen so
    far in each of the RADIX bins of the next digit (``radix_scan``: build_row_scan of
    radix_visit); a tree sums the counters; thread 0 walks the bins from the top to the
    one holding the k-th element. If that bin closes the count at exactly k, every key >=
    the bin's lower bound is in the top k and the lower bound is returned at once. Ends
    with a barrier.
    """

    @cuda.jit(device=True, **NVVM_INLINE)
    def kth_largest_key(logits, b, head, chunks, words, k, counts, state):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
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
            radix_scan(logits, b, head, chunks, words, 0, (counts, prefix, shift))
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

    return kth_largest_key


def build_sample_kernel() -> Callable[..., Any]:
    """Kernel ``(logits f32 [B, V], temperature f32 [B], top_k i32 [B], top_p f32 [B], seed i64 [B],
    step i32 [B], out_ids i32 [B])``.

    Launch with one block per row (grid-stride over rows) and a power-of-two block of at
    most MAX_THREADS threads; shared memory is static. Any block size gives the same tokens
    for rows without top-p (module docstring).
    """
    load_group = build_load_group(build_vector_access()[0])
    row_split = build_row_split(build_data_address())
    argmax_scan = build_row_scan(load_group, argmax_visit, argmax_chunk_may_change)
    window_scan = build_row_scan(load_group, window_visit, window_chunk_may_change)
    kth_largest_key = build_kth_largest_key(build_row_scan(load_group, radix_visit, any_chunk))
    top_p_key = build_top_p_key(build_row_scan(load_group, mass_visit, mass_chunk_may_change),
                                build_row_scan(load_group, radix_mass_visit, window_chunk_may_change))
    gumbel_scan = build_gumbel_scan(load_group)

    # Hold ptxas to 128 registers a thread, so that a block of MAX_THREADS launches (64K registers an
    # SM).
    launch_options = launch_bounds(MAX_THREADS)

    @cuda.jit(**launch_options)
    def sample(logits, temperature, top_k, top_p, seed, step, out_ids):
        values = cuda.shared.array(MAX_THREADS, float32)
        indices = cuda.shared.array(MAX_THREADS, int32)
        counts = cuda.shared.array((RADIX, MAX_THREADS), int32)
        state = cuda.shared.array(3, int64)
        wanted = cuda.shared.array(1, float32)
        words = cuda.local.array(GROUP, float32)  # registers: the loaded chunks
        vocab = logits.shape[1]
        tid = cuda.threadIdx.x
        for b in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):
            head, chunks = row_split(logits, b)
            # 1. argmax: the greedy answer, and the max for the window. Sentinel: index V loses to every element.
            best_value, best_index = argmax_scan(logits, b, head, chunks, words, (NEG_INF, int32(vocab)), 0)
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
                inside = window_scan(logits, b, head, chunks, words, int64(0), (inv_t, cut))
                if block_count(counts, inside) > k:
                    threshold = kth_largest_key(logits, b, head, chunks, words, k, counts, state)
            # 4. top-p: the nucleus's threshold key (an upper set inside the top k's); 0 keeps everything.
            p = float32(top_p[b])
            if p > float32(0.0) and p < float32(1.0):
                nucleus = top_p_key(logits, b, head, chunks, words, p, (inv_t, cut, threshold, x_top), values, counts,
                                    state, wanted)
                threshold = max(threshold, nucleus)
            # 5. Gumbel-max over the candidates.
            key0, key1 = seed_words(seed[b])
            step_word = uint64(int64(step[b])) & MASK32
            context = (inv_t, cut, threshold, key0, key1, step_word)
            score, index = gumbel_scan(logits, b, head, chunks, words, (NEG_INF, int32(vocab)), context)
            _, chosen = block_argmax(values, indices, score, index)
            if tid == 0:
                out_ids[b] = chosen

    return sample


class Sample:
    """Launcher: ``out_ids[b]`` = a token of row b (greedy, or sampled with temperature, top-k and top-p).

    Arrays (all indexed by row b): logits float32 [B, V], temperature float32 [B],
    top_k int32 [B], top_p float32 [B], seed int64 [B], step int32 [B], out_ids int32 [B]. Semantics and
    cost: the module docstring. One block per row of ``threads_for(ceil(V / GROUP), max_threads)``
    threads (a thread reads GROUP logits a sweep); no scratch buffers, SHARED_BYTES of static
    shared memory per block.
    """

    def __init__(self, max_threads: int = MAX_THREADS) -> None:
        self.kernel = Kernel(build_sample_kernel())
        self.max_threads = check_max_threads(max_threads, MAX_THREADS)

    def __call__(self, logits: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, step: Any, out_ids: Any,
                 stream: Any = 0) -> None:
        rows, vocab = logits.shape
        for name, array in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                            ("step", step), ("out_ids", out_ids)):
            if tuple(array.shape) != (rows,):
                raise ValueError(f"{name} has shape {tuple(array.shape)}, expected ({rows},)")
        if vocab == 0:
            raise ValueError("sampling over an empty vocabulary")
        if rows == 0:
            return
        threads = threads_for(math.ceil(vocab / GROUP), self.max_threads)
        self.kernel[rows, threads, stream](logits, temperature, top_k, top_p, seed, step, out_ids)
