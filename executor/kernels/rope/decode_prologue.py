"""The q/k norm + RoPE + KV write of a decode step as a prologue of tensor-core decode attention.

Unfused, a decode step's attention path is three launches a layer: fused_kv_write.py's q/k norm +
RoPE + KV write, attention/decode_mma.py's split attention and attention/merge.py's merge. At batch
1 each is a few warps that wait out their own instructions' latencies (docs/benchmarks.md,
"Small-kernel latency" and "Decode attention instructions"), so a launch costs its whole chain of
dependent loads and arithmetic. Here the first launch's work runs inside the attention kernel,
while the block's first K/V copies are in flight, and only on the heads the block attends with:

- every block (kv head h, tile) normalizes and rotates its G query heads h G .. h G + G - 1 into
  shared memory (``q_sh [G, D / 2]`` words of two bf16), where the q fragments are read from;
- the tile that holds the row's new key (its chunk ends at the row's position: ``owner``) also
  normalizes and rotates k head h and copies v head h, into the cache as fused_kv_write.py does and
  into ``new_sh [2, D / 2]`` (k, then v);
- the new key's cache row may be copied into the ring before this block (or any) has written it,
  so ``patch`` overwrites that ring row with ``new_sh`` once the warp's copies of the slot have
  landed. Every other key was written by an earlier step.

The prologue runs qk_norm_rope.py's very device functions (``build_vector_head``) on groups of
``rope_group_threads`` threads a head, one pair unit a thread, the same groups and shuffle order as
fused_kv_write.py's launch: q, the cache and the attention output are bit-identical to the two
launches (tests/kernels/test_decode_rope_attention.py). Shapes it serves (``prologue_fits``): bf16,
full rotary (rotary_dim = head_dim) with one pair unit a thread, and G + 2 head groups in a block.

The prologue's own chain (q load, float64 powers and sincos for the row's cos/sin, the reduction,
two block barriers) is longer than the copies it overlaps, so the kernel runs it in three parts
between its metadata lookups (``start``, ``load``, ``finish``): inv_freq's powers while the tile's
entries land, the q/k/v chunks while the row's position does. On the H200 (Qwen3-8B, batch 1, 512
tokens): fused, the engine's batch-1 step took 4.551-4.555 ms against 4.641-4.644 with the separate
5.6 us launch, and batch 64 6.875-6.888 against 7.011-7.014; in three parts the kernel took
10.7-10.8 us a layer against 12.1 in one, and it takes 6.9 us with attention/decode_mma.py's
instruction cuts (docs/benchmarks.md, "Decode step profile").
"""

from __future__ import annotations

from typing import Any, NamedTuple

from executor.kernels.primitives.codec import build_codec
from executor.kernels.primitives.launch import WARP_THREADS
from executor.kernels.rows.norm import inv_rms_from_sum
from executor.kernels.primitives.reduce import build_group_sum
from executor.kernels.rope.qk_norm_rope import build_vector_head, store_inv_freq
from executor.kernels.rope.layout import vector_group_threads
from executor.kernels.primitives.vector import VECTOR_WORDS, build_vector_access, lanes_for
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)


def rope_group_threads(head_dim: int) -> int:
    """Threads a head in the prologue: fused_kv_write.py's group for a full-rotary bf16 head."""
    return vector_group_threads(head_dim, head_dim, lanes_for(build_codec("bfloat16")))


def prologue_fits(head_dim: int, group_size: int, threads: int) -> bool:
    """Whether blocks of ``threads`` threads can run the prologue for heads of ``head_dim`` (full
    rotary) in groups of ``group_size``: one pair unit a thread, so a head's group holds it in
    registers between the sum of squares and the rotation, and room for the G q heads, k and v."""
    lanes = lanes_for(build_codec("bfloat16"))
    group = rope_group_threads(head_dim)
    return head_dim % (2 * lanes) == 0 and head_dim // 2 // lanes == group and (group_size + 2) * group <= threads


def shared_shapes(head_dim: int, group_size: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """The prologue's shared arrays: q_sh [G, D / 2] and new_sh [2, D / 2] (int32 words of two bf16),
    and rope_sh's 3 D / 2 float32 (the row's inv_freq, cos and sin)."""
    return (group_size, head_dim // 2), (2, head_dim // 2), 3 * head_dim // 2


def shared_bytes(head_dim: int, group_size: int) -> int:
    """Shared memory the prologue adds to a block (``shared_shapes``, 4-byte words)."""
    (q_rows, q_words), (new_rows, new_words), rope_floats = shared_shapes(head_dim, group_size)
    return 4 * (q_rows * q_words + new_rows * new_words + rope_floats)


class Prologue(NamedTuple):
    """build_rope_prologue's device functions (its docstring)."""

    start: Any
    load: Any
    finish: Any
    patch: Any


def build_rope_prologue(head_dim: int, group_size: int, round_before_weight: bool, slot_keys: int,
                        warp_barrier: Any) -> Prologue:
    """The prologue's device functions for heads of ``head_dim`` in groups of ``group_size``, ring slots
    of ``slot_keys`` keys and the attention kernel's ``warp_barrier``. ``args`` = (q [T, Hq, D], k, v
    [T, Hkv, D], q_weight, k_weight [D], eps, weight_offset, theta, k_cache, v_cache) in bf16 bits (the
    qkv projection's output, not yet normed). All threads of the block call the first three, once, in
    turn (the attention kernel issues its own lookups and copies between them):

    start(args, rope_sh)
        the row-independent inv_freq table into ``rope_sh`` (3 D / 2 float32), before any lookup.
    load(args, row, h, lo, hi, w_lo, w_hi)
        a thread's q (or k, or v) chunks of row ``row``, kv head h, and its norm weights into the four
        VECTOR_WORDS buffers, as soon as the row is known.
    finish(args, row, h, last, owner, page, in_page, q_sh, new_sh, rope_sh, scratch, lo, hi, w_lo, w_hi)
        ``last`` is the row's position, ``owner`` whether this tile holds key ``last``, whose cache row
        is (page, in_page). Leaves q_sh [G, D / 2] and (owner) new_sh [2, D / 2] filled and k/v
        written into the caches; ends with a barrier. ``scratch``: the simulator's reduction scratch
        (blockDim.x float32).
    patch(ring, k_row, slot_first, last, owner, new_sh, lane)
        every warp, after its copies of the slot of keys slot_first .. slot_first + slot_keys - 1 (K
        rows at ring[k_row ..], V rows slot_keys after) have landed: key ``last``'s rows from new_sh;
        ends with a warp barrier.
    """
    codec = build_codec("bfloat16")
    D, G, SLOT_KEYS = head_dim, group_size, slot_keys
    HALF = D // 2
    LANES = lanes_for(codec)  # elements a 16-byte chunk
    PAIRS = HALF // LANES
    RG = rope_group_threads(D)
    assert PAIRS == RG, "one pair unit a thread (prologue_fits)"
    load_vector, store_vector = build_vector_access()
    group_sum = build_group_sum()

    @cuda.jit(device=True, inline=True)
    def put_q_chunk(q_sh, t, g, col, chunk, cache, page, slot):
        for i in range(VECTOR_WORDS):
            q_sh[g, col // 2 + i] = chunk[i]

    @cuda.jit(device=True, inline=True)
    def put_k_chunk(new_sh, t, h, col, chunk, k_cache, page, slot):
        store_vector(k_cache, (page, slot, h, col), chunk, 0)
        for i in range(VECTOR_WORDS):
            new_sh[0, col // 2 + i] = chunk[i]

    head = build_vector_head(codec, round_before_weight)
    store_cos_sin, unit_load, unit_squares, touch_weights = (head.store_cos_sin, head.unit_load, head.unit_squares,
                                                             head.touch_weights)
    q_norm_rope = build_vector_head(codec, round_before_weight, put_q_chunk).head_norm_rope
    k_norm_rope = build_vector_head(codec, round_before_weight, put_k_chunk).head_norm_rope

    @cuda.jit(device=True, inline=True)
    def start(args, rope_sh):
        # inv_freq needs no lookup: its float64 powers run while the tile's metadata lands.
        store_inv_freq(rope_sh, 0, HALF, D, args[7])

    @cuda.jit(device=True, inline=True)
    def load(args, row, h, lo, hi, w_lo, w_hi):
        q, k, v, q_weight, k_weight = args[0], args[1], args[2], args[3], args[4]
        group = cuda.threadIdx.x // RG  # q head h G + group for group < G, then k head h, then v head h
        lane = cuda.threadIdx.x % RG
        # Every block loads k and v: whether it owns the new key is known only once the row's
        # position lands, and these loads go out with that lookup.
        if group < G:
            touch_weights(q_weight, lane, HALF, PAIRS, PAIRS, w_lo, w_hi)
            unit_load(q, row, h * G + group, lane, HALF, PAIRS, lo, hi)
        elif group == G:
            touch_weights(k_weight, lane, HALF, PAIRS, PAIRS, w_lo, w_hi)
            unit_load(k, row, h, lane, HALF, PAIRS, lo, hi)
        elif group == G + 1:
            load_vector(v, (row, h, lane * LANES), lo, 0)
            load_vector(v, (row, h, (lane + RG) * LANES), hi, 0)

    # Not inlined by Numba: its IR inlining copies a callee's whole IR at each level, and the rope
    # functions nested in the attention kernel took 29 s to compile against the plain kernel's 5
    # (local, sm_90); as a device function it compiles once (NVVM still inlines its one call).
    @cuda.jit(device=True)
    def finish(args, row, h, last, owner, page, in_page, q_sh, new_sh, rope_sh, scratch, lo, hi, w_lo, w_hi):
        q_weight, k_weight, eps, weight_offset, k_cache, v_cache = args[3], args[4], args[5], args[6], args[8], args[9]
        group = cuda.threadIdx.x // RG
        lane = cuda.threadIdx.x % RG
        is_q = group < G
        is_k = owner and group == G
        is_v = owner and group == G + 1
        store_cos_sin(rope_sh, 0, HALF, 2 * HALF, HALF, float32(last))
        cuda.syncthreads()
        partial = unit_squares(lane, PAIRS, lo, hi) if is_q or is_k else float32(0.0)
        inv_rms = inv_rms_from_sum(group_sum(scratch, partial, RG), D, eps)
        if is_q:
            q_norm_rope(q_sh, q_weight, 0, group, lane, RG, HALF, PAIRS, PAIRS, True, inv_rms, weight_offset,
                        rope_sh, HALF, 2 * HALF, lo, hi, w_lo, w_hi, q_sh, 0, 0)
        elif is_k:
            k_norm_rope(new_sh, k_weight, 0, h, lane, RG, HALF, PAIRS, PAIRS, True, inv_rms, weight_offset,
                        rope_sh, HALF, 2 * HALF, lo, hi, w_lo, w_hi, k_cache, page, in_page)
        elif is_v:
            store_vector(v_cache, (page, in_page, h, lane * LANES), lo, 0)
            store_vector(v_cache, (page, in_page, h, (lane + RG) * LANES), hi, 0)
            for i in range(VECTOR_WORDS):
                new_sh[1, lane * VECTOR_WORDS + i] = lo[i]
                new_sh[1, (lane + RG) * VECTOR_WORDS + i] = hi[i]
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def patch(ring, k_row, slot_first, last, owner, new_sh, lane):
        if owner and slot_first <= last and last < slot_first + SLOT_KEYS:  # the same for the whole warp
            key_row = k_row + last - slot_first
            word = lane
            while word < HALF:
                ring[key_row, word] = new_sh[0, word]
                ring[key_row + SLOT_KEYS, word] = new_sh[1, word]
                word += WARP_THREADS
        warp_barrier()

    return Prologue(start, load, finish, patch)
