"""Decode attention on tensor cores (bf16): the query heads that share a kv head are the rows of one
``mma`` tile, and a warp attends to eight cached keys at a time.

attention/decode.py's kernel does a decode step's dot products on CUDA cores: per key and lane, 16
FMAs a head, a tree of shuffles per head, and the float conversions of K and V. On the H200 it
reaches about 75% of the copy bandwidth at 64 requests x 4096 tokens, and staging its K/V through a
block-wide cp.async pipeline measured slower at every shape (16 keys x 3 stages: 463.6 us at 64 x
4096 against 343.4): issuing those instructions, not bytes in flight, bounds it (a reading, not
profiled). Here one ``mma.sync`` m16n8k16 (primitives/mma.py) does what 128 of those FMAs do: the
G <= 8 query heads of kv head h are rows 0 .. G - 1 of A (rows G .. 15 are zero), and a slot of
eight keys is B's eight columns.

Measured on the H200 (docs/benchmarks.md, "Decode attention kernel shapes"; CUDA-graph timing, us):
four warps of two slots, 11.7 / 18.6 at batch 1 (512 / 4096 tokens, split) and 154 at 32 x 4096
(85% of copy bandwidth), against the CUDA-core kernel's 12.3 / 19.9 and 264; two warps of three
slots, 304 at 64 x 4096 (86%) against 344. DecodeAttention runs the four-warp shape where a call
has at most FEW_BLOCKS_PER_SM (row, kv head) pairs an SM and MANY_PAIRS_SHAPE past that. In the
64 x 4096 decode step, with the graph's grid sized to the step (step.decode_grid_tiles; a grid with
room for every split tile of the bucket has 16,384 blocks for 512 real ones), the step took 15.99 ms
against 17.48 on the CUDA-core kernel.

- Block (kv head h, tile), W warps: grid (Hkv, tiles), so that blocks dispatch tile by tile. A
  decode graph's grid has room for the most tiles a step of its bucket makes, and the step's real
  tiles come first: padding blocks, which exit at once, dispatch after all real ones instead of
  between them. Warps are independent until the end: warp w takes the
  chunk's slots of eight keys w, w + W, w + 2W, ... and keeps its own online softmax and output;
  the warps meet once, in shared memory, as the lane groups of attention/decode.py do.
- K and V reach shared memory by ``cp.async`` (primitives/async_copy.py) into a ring of ``slots`` slots per
  warp (K rows, then V rows, each padded by 16 bytes so that ``ldmatrix`` rows fall in different
  banks). Lane l copies key l % 8 of a slot, chunks l // 8, l // 8 + 4, ...: one page-id lookup a
  lane a slot, looked up a slot before its copy is issued. The first ``slots`` iterations' copies
  go out before anything waits (a batch-1 tile of 64 keys is two iterations a warp: all its keys in
  flight, and the rope prologue's work overlaps them); a warp barrier (``syncwarp``) makes the
  lanes' copies of slot i visible, and a second one, after iteration i, frees the slot for the copy
  of iteration i + slots.
- Per slot: S = Q K^T by K_STEPS / 2 ``ldmatrix.x4`` loads and K_STEPS MMAs in two independent
  chains (lane (g, t) then holds scores of head g, keys 2t and 2t + 1); the slot's maximum per head
  by a quad reduction; P rounded to bf16 is already an A fragment (columns 0..7; 8..15 are zero),
  and P V is D / 8 MMAs whose B fragments come from ``ldmatrix.x4.trans`` of the V rows (mma's
  ``build_eight_key_value_load``). The sum of P stays a lane partial until the end.

Built with ``rope``, the kernels also do the step's q/k norm + RoPE + KV write first
(rope/decode_prologue.py: q from shared memory, the new key patched into its ring slot), which
DecodeRopeAttention (attention/decode_rope.py) launches at decode where the heads allow it.

At batch 1 a block's warps issue alone, so the kernel lasts about as long as a warp's chain of
instructions, and most of a warp's instructions are index arithmetic and the warps' meet. So thread
and block indices are known to be non-negative (primitives/indices.py), the plan's page size is
compiled in (a key's page and slot by constant arithmetic, not a division), q fragments are read by
select rather than a branch a load, and the warps' meet writes straight to global memory
(decode_tiles.py): ncu on the H200 counted 1,947 instructions a warp in the fused split kernel,
against 2,979 without these (docs/benchmarks.md, "Decode attention instructions"). A K/V row's
chunks are copied from one cursor and exponents are one FMA and ``ex2.approx.ftz``
(primitives/fast_math.py). In the batch-1 decode graph the fused kernel takes 6.9 us a layer,
against 10.7-10.8 without any of these.

P enters the P V product rounded to bf16, as in FlashAttention's kernels (and the prefill kernel,
attention/flash.py); scores and outputs accumulate in float32. The simulator runs the same kernel
with primitives/mma.py's emulations (block-wide barriers: every warp makes the same calls, so a warp
runs as many slot iterations as the busiest one, masking the slots past the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executor.kernels.primitives.async_copy import build_chunk_copy, build_copy_groups, build_shared_address
from executor.kernels.attention.paged import NEG_INF
from executor.kernels.primitives.codec import build_codec
from executor.kernels.rope.decode_prologue import build_rope_prologue, prologue_fits
from executor.kernels.rope.decode_prologue import shared_shapes as rope_shared_shapes
from executor.kernels.attention.decode_tiles import LOG2_E, build_meet, build_tile_lookups
from executor.kernels.primitives.fast_math import build_exp2_scaled
from executor.kernels.primitives.indices import build_indices
from executor.kernels.primitives.launch import SHARED_LIMIT_BYTES, WARP_THREADS
from executor.kernels.primitives.mma import build_eight_key_value_load, build_fragment_loads, build_mma_bf16, build_pack_bf16x2
from executor.kernels.primitives.reduce import build_group_max, build_group_sum
from executor.kernels.primitives.vector import VECTOR_WORDS
from executor.routing import TENSOR_CORE_DECODE_MAX_HEAD_DIM
from executor.numba_cuda import inlined, launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

SLOT_KEYS = 8  # keys a warp attends to at a time: the n of Q K^T's mma tile
MAX_GROUP = 8  # query heads a tile's rows hold (rows g < 8: the accumulator's c0, c1 half)
MAX_WARPS = 4  # warps a block: eight warps' rings would pass the static shared-memory limit at D 128
WARP_SLOTS = 2  # ring slots a warp: one slot in flight while the warp attends to the other
PAD_WORDS = 4  # per staged row: consecutive rows 4 banks apart (16 bytes; rows stay 16-byte aligned)
#: Per head row of the warps' outputs (part_sh [W, G, D + PART_PAD]): lane (g, t) stores element 8 j + 2 t
#: of head g, so with rows D apart (a multiple of 32 words) the G heads' stores fall in one bank; 8
#: words apart they fall in 8 g + 2 t, distinct for G <= 4.
PART_PAD = 8


def shared_bytes(head_dim: int, group_size: int, warps: int, slots: int) -> int:
    """Static shared memory of one block: the warps' K/V rings, then where the warps meet (their
    (max, sum) and outputs) and the simulator's reduction scratch (4-byte words)."""
    ring_words = warps * slots * 2 * SLOT_KEYS * (head_dim // 2 + PAD_WORDS)
    meet_words = 2 * warps * group_size + warps * group_size * (head_dim + PART_PAD)
    return 4 * (ring_words + meet_words + WARP_THREADS * warps)


@dataclass(frozen=True)
class MmaShape:
    """A block of the kernel: ``warps`` warps with ``slots`` ring slots each."""

    warps: int
    slots: int


#: The launcher's shape for calls of more than FEW_BLOCKS_PER_SM (row, kv head) pairs an SM (not
#: split; blocks run in waves): two warps of three slots, five blocks resident an SM, where four-warp
#: blocks leave an SM two (measured on the H200: 304 us at 64 x 4096 against 397; docs/benchmarks.md,
#: "Decode attention kernel shapes").
MANY_PAIRS_SHAPE = MmaShape(2, 3)


def default_mma_shapes(head_dim: int, group_size: int) -> tuple[MmaShape, MmaShape] | None:
    """The shapes the launcher runs by default, for calls of few (row, kv head) pairs (the most warps
    a block that fit, WARP_SLOTS slots each) and of many (MANY_PAIRS_SHAPE where it fits, else the
    first), or None where it keeps the CUDA-core kernel: heads past routing.TENSOR_CORE_DECODE_MAX_HEAD_DIM, or shapes
    the kernel does not serve."""
    warps = mma_warps(head_dim, group_size)
    if warps is None or head_dim > TENSOR_CORE_DECODE_MAX_HEAD_DIM:
        return None
    many = MANY_PAIRS_SHAPE
    fits = shared_bytes(head_dim, group_size, many.warps, many.slots) <= SHARED_LIMIT_BYTES
    return MmaShape(warps, WARP_SLOTS), many if fits else MmaShape(warps, WARP_SLOTS)


def mma_warps(head_dim: int, group_size: int, slots: int = WARP_SLOTS) -> int | None:
    """Warps a block (at most MAX_WARPS) whose rings fit the shared-memory limit, or None when this
    kernel does not serve the shape (head_dim not a multiple of 32, more than MAX_GROUP heads a kv
    head, or not even one warp fits)."""
    if head_dim % 32 or not 1 <= group_size <= MAX_GROUP:
        return None
    fitting = [w for w in range(MAX_WARPS, 0, -1) if shared_bytes(head_dim, group_size, w, slots) <= SHARED_LIMIT_BYTES]
    return fitting[0] if fitting else None


def build_warp_barrier() -> Any:
    """``warp_barrier()``: ``syncwarp`` on the GPU; in the simulator, which has none, a block barrier
    (the kernel's warps make the same calls)."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def block_barrier():
            cuda.syncthreads()

        return block_barrier

    @cuda.jit(device=True, inline=True)
    def warp_barrier():
        cuda.syncwarp(0xFFFFFFFF)

    return warp_barrier


def build_decode_attention_mma(head_dim: int, group_size: int, warps: int, slots: int = WARP_SLOTS,
                               blocks_per_sm: int | None = None, rope: bool | None = None,
                               page_size: int | None = None) -> tuple[Any, Any]:
    """(direct kernel, split kernel) for bf16 K/V, head_dim a multiple of 32, group_size <= 8;
    arguments as decode.py's ``build_decode_attention`` (q, caches and out as int16 bits);
    grid (Hkv, tiles), ``32 * warps`` threads a block.

    ``rope`` not None: the kernels do the step's q/k norm + RoPE + KV write first
    (rope/decode_prologue.py; ``rope`` is the norm's round_before_weight) and take, in place of
    ``q``, ``q, k, v, q_weight, k_weight, eps, weight_offset, theta``: the qkv projection's rows
    before the norm, the norm weights and float32 scalars (rotary_dim = head_dim).

    ``page_size`` not None: the caches' tokens a page, compiled in (the launcher checks each call's
    cache against it): a key's page and slot are then a multiply and a shift, not a division.
    """
    assert head_dim % 32 == 0 and 1 <= group_size <= MAX_GROUP and slots >= 2
    D, G, W, SL = head_dim, group_size, warps, slots
    NT = WARP_THREADS * W
    ROW_WORDS = D // 2 + PAD_WORDS
    PART_ROW = D + PART_PAD
    RING_ROWS = W * SL * 2 * SLOT_KEYS  # warp w, slot s: K rows at (w * SL + s) * 16, V rows 8 after
    CHUNKS_PER_ROW = D // 8  # 16-byte chunks of a K or V row
    COPIES = CHUNKS_PER_ROW // 4  # chunks a lane copies of its key's K row (and of its V row)
    K_STEPS = D // 16
    O_TILES = D // 8
    Q_WORDS, O_VALUES = 2 * K_STEPS, 2 * O_TILES  # a lane's q fragment words and output values
    GROUP_STATES = W * G
    launch_options = launch_bounds(None if blocks_per_sm is None else (NT, blocks_per_sm))
    TILE_ALIGNMENT = None if simulator_enabled() else 16
    mma = build_mma_bf16()
    pack = build_pack_bf16x2()
    lane_address, load_k_x4, _ = build_fragment_loads()
    load_v8_x4 = build_eight_key_value_load()
    chunk_cursor, copy_chunk_async = build_chunk_copy()
    commit_group, wait_groups = build_copy_groups(SL - 1)
    shared_address = build_shared_address()
    warp_barrier = build_warp_barrier()
    quad_max = build_group_max()
    quad_sum = build_group_sum()
    tile_entries, tile_request, tile_keys = build_tile_lookups()
    exp2_scaled = build_exp2_scaled()
    ONE = float32(1.0)
    thread_index, block_x, block_y = build_indices()
    meet_out, meet_split = build_meet(G, D, NT, W, build_codec("bfloat16").store)
    FUSED = rope is not None
    PAGE_SIZE = page_size or 0  # 0: the cache's page size at run time
    # The prologue's shared arrays (one word each without it).
    Q_SH, NEW_SH, ROPE_SH = rope_shared_shapes(D, G) if FUSED else ((1, 1), (1, 1), 1)
    if FUSED:
        assert prologue_fits(D, G, NT)
        prologue_start, prologue_load, prologue_finish, patch = build_rope_prologue(D, G, rope, SLOT_KEYS,
                                                                                     warp_barrier)
    else:  # attend's FUSED branches are compiled out
        prologue_start = prologue_load = prologue_finish = patch = None

    @cuda.jit(device=True, inline=True)
    def locate(page_indices, page_base, page_size, pos, k1):
        """(page id, slot in the page) of key ``pos``, clamped to the chunk's last key (a valid address
        for a copy that reads nothing)."""
        pos = min(pos, k1 - 1)
        logical = pos // page_size
        return page_indices[page_base + logical], pos - logical * page_size

    @cuda.jit(device=True, inline=True)
    def issue(k_cache, v_cache, h, page, in_page, valid, ring, ring_address, first_row, lane):
        """Start copying this lane's chunks of its key's K and V rows into the slot at first_row
        (zeros when not ``valid``: stale V bits could be NaN, and 0 x NaN would reach the output)."""
        key = lane % SLOT_KEYS
        k_row = chunk_cursor(k_cache, (page, in_page, h, 0))
        v_row = chunk_cursor(v_cache, (page, in_page, h, 0))
        for i in range(COPIES):
            chunk = lane // SLOT_KEYS + 4 * i
            copy_chunk_async(ring, ring_address, (first_row + key, 4 * chunk), k_cache, k_row, chunk, valid)
            copy_chunk_async(ring, ring_address, (first_row + SLOT_KEYS + key, 4 * chunk), v_cache, v_row, chunk,
                             valid)

    @cuda.jit(device=True, inline=True)
    def q_word(q, row, head, d):
        """Elements d and d + 1 of q[row, head] as one word of two bf16 (d's bits low)."""
        return int32((int32(q[row, head, d]) & 0xFFFF) | (int32(q[row, head, d + 1]) << 16))

    @cuda.jit(device=True, **inlined())
    def attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
               request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale,
               s_sh, ring, part_sh, scratch, q_sh, new_sh, rope_sh):
        """decode.py's ``attend`` contract: warp w's (max, sum) of head g in s_sh[0 / 1,
        w G + g] and its output in part_sh[w, g], behind a barrier, for decode_tiles.py's meet;
        returns (row, chunk index, chunks of the row), row -1 when the block has nothing to do. FUSED: ``q`` is
        the prologue's ``args`` (q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache,
        v_cache), and q_sh, new_sh, rope_sh its shared arrays (else unused)."""
        h = block_x()
        tid = thread_index()
        page_size = PAGE_SIZE if PAGE_SIZE else k_cache.shape[1]
        # The lookups are three dependent rounds (decode_tiles.py). What needs only the earlier ones
        # goes out between them: inv_freq's powers with the first, the prologue's q/k/v chunks and this
        # lane's first page ids (clamped to the request's keys) with the row's position.
        b, c, step_rows = tile_entries(block_y(), request_indices, kv_tile_indices, total_num_rows)
        if FUSED:
            prologue_start(q, rope_sh)
        if b < 0:  # padding tile (a graph's fixed grid)
            return -1, 0, 0
        row, k0, bound, page_base, chunk = tile_request(b, c, step_rows, page_size, page_indptr, last_page_len,
                                                        q_indptr, kv_chunk_size)
        if row < 0:
            return -1, 0, 0
        lo = cuda.local.array(VECTOR_WORDS, int32)  # the prologue's chunks and norm weights (words of two bf16)
        hi = cuda.local.array(VECTOR_WORDS, int32)
        w_lo = cuda.local.array(VECTOR_WORDS, int32)
        w_hi = cuda.local.array(VECTOR_WORDS, int32)
        if FUSED:
            prologue_load(q, row, h, lo, hi, w_lo, w_hi)
        warp = tid // WARP_THREADS
        lane = tid % WARP_THREADS
        g = lane // 4
        t = lane % 4
        # The key this lane copies in iteration i: k0 + (i * W + warp) * 8 + lane % 8.
        own_key = k0 + warp * SLOT_KEYS + lane % SLOT_KEYS
        step_keys = W * SLOT_KEYS
        first_pages = cuda.local.array(SL, int32)
        first_slots = cuda.local.array(SL, int32)
        for i in range(SL):
            first_pages[i], first_slots[i] = locate(page_indices, page_base, page_size, own_key + i * step_keys,
                                                    bound)
        k1, num_chunks, last = tile_keys(positions, row, k0, bound, chunk)
        if k0 >= k1:
            return -1, 0, 0
        iterations = ((k1 - k0 + SLOT_KEYS - 1) // SLOT_KEYS + W - 1) // W  # the busiest warp's slots
        ring_address = shared_address(ring, (0, 0))
        fragment_address = lane_address(ring, False)
        for i in range(SL):  # iterations 0 .. SL - 1 in flight, a group each, before anything waits
            if i < iterations:
                pos = own_key + i * step_keys
                issue(k_cache, v_cache, h, first_pages[i], first_slots[i], pos < k1, ring, ring_address,
                      (warp * SL + i) * 2 * SLOT_KEYS, lane)
            commit_group()
        next_pos = own_key + SL * step_keys
        next_page, next_in_page = locate(page_indices, page_base, page_size, next_pos, k1)

        qa = cuda.local.array(Q_WORDS, int32)  # a0, a2 of each k-step; a1, a3 (rows 8..15) are zero
        o = cuda.local.array(O_VALUES, float32)  # head g's outputs 8j + 2t, 8j + 2t + 1
        owner = k1 > last  # this tile holds the row's new key
        if FUSED:  # normed and rotated q (and k, v) while the first slots' copies are in flight
            page, in_page = locate(page_indices, page_base, page_size, last, k1)
            prologue_finish(q, row, h, last, owner, page, in_page, q_sh, new_sh, rope_sh, scratch, lo, hi, w_lo,
                            w_hi)
            # Rows G .. 15 of A are zero: their lanes read row G - 1 and drop it (a select, not a branch a load).
            q_row = min(g, G - 1)
            for s in range(K_STEPS):
                word0 = q_sh[q_row, 8 * s + t]
                word1 = q_sh[q_row, 8 * s + 4 + t]
                qa[2 * s] = word0 if g < G else int32(0)
                qa[2 * s + 1] = word1 if g < G else int32(0)
        else:
            for s in range(K_STEPS):
                qa[2 * s] = q_word(q, row, h * G + g, 16 * s + 2 * t) if g < G else int32(0)
                qa[2 * s + 1] = q_word(q, row, h * G + g, 16 * s + 8 + 2 * t) if g < G else int32(0)
        for j in range(2 * O_TILES):
            o[j] = float32(0.0)
        top = float32(-1e30)  # finite: a head with no key yet keeps alpha = 1 and sum 0
        total = float32(0.0)  # this lane's part of the sum (its two keys of every slot)
        scale_log2 = scale * float32(LOG2_E)

        for i in range(iterations):
            wait_groups()  # this lane's copies of slot i landed (iteration i's group and every older one)
            warp_barrier()  # and every lane's
            k_row = (warp * SL + i % SL) * 2 * SLOT_KEYS
            if FUSED:  # the new key's rows, which the copy may have read before they were written
                patch(ring, k_row, k0 + (i * W + warp) * SLOT_KEYS, last, owner, new_sh, lane)
            # Even and odd k-steps accumulate apart: two dependent MMA chains of half the length.
            c0 = float32(0.0)
            c1 = float32(0.0)
            c2 = float32(0.0)
            c3 = float32(0.0)
            e0 = float32(0.0)
            e1 = float32(0.0)
            e2 = float32(0.0)
            e3 = float32(0.0)
            for s in range(0, K_STEPS, 2):
                b0, b1, b2, b3 = load_k_x4(ring, fragment_address, k_row, 8 * s)
                c0, c1, c2, c3 = mma(qa[2 * s], int32(0), qa[2 * s + 1], int32(0), b0, b1, c0, c1, c2, c3)
                e0, e1, e2, e3 = mma(qa[2 * s + 2], int32(0), qa[2 * s + 3], int32(0), b2, b3, e0, e1, e2, e3)
            key = k0 + (i * W + warp) * SLOT_KEYS + 2 * t
            s0 = (c0 + e0) * scale_log2 if key < k1 else NEG_INF
            s1 = (c1 + e1) * scale_log2 if key + 1 < k1 else NEG_INF
            best = max(top, quad_max(scratch, max(s0, s1), 4))
            alpha = exp2_scaled(top, ONE, best)  # 2^(top - best): an FMA and ex2.approx.ftz (fast_math.py)
            top = best
            p0 = exp2_scaled(s0, ONE, best)
            p1 = exp2_scaled(s1, ONE, best)
            total = total * alpha + p0 + p1
            pa = pack(p0, p1)
            for j in range(2 * O_TILES):
                o[j] *= alpha
            for j4 in range(O_TILES // 4):
                r0, r1, r2, r3 = load_v8_x4(ring, fragment_address, k_row + SLOT_KEYS, 16 * j4)
                o[8 * j4], o[8 * j4 + 1], d2, d3 = mma(pa, int32(0), int32(0), int32(0), r0, int32(0),
                                                       o[8 * j4], o[8 * j4 + 1], float32(0.0), float32(0.0))
                o[8 * j4 + 2], o[8 * j4 + 3], d2, d3 = mma(pa, int32(0), int32(0), int32(0), r1, int32(0),
                                                           o[8 * j4 + 2], o[8 * j4 + 3], float32(0.0), float32(0.0))
                o[8 * j4 + 4], o[8 * j4 + 5], d2, d3 = mma(pa, int32(0), int32(0), int32(0), r2, int32(0),
                                                           o[8 * j4 + 4], o[8 * j4 + 5], float32(0.0), float32(0.0))
                o[8 * j4 + 6], o[8 * j4 + 7], d2, d3 = mma(pa, int32(0), int32(0), int32(0), r3, int32(0),
                                                           o[8 * j4 + 6], o[8 * j4 + 7], float32(0.0), float32(0.0))
            warp_barrier()  # every lane is done with the slot before its next copy is issued
            ahead = i + SL
            if ahead < iterations:  # refill the slot this iteration used
                issue(k_cache, v_cache, h, next_page, next_in_page, next_pos < k1, ring, ring_address,
                      (warp * SL + ahead % SL) * 2 * SLOT_KEYS, lane)
            commit_group()  # a group every iteration (empty past the last), so the wait's count holds
            if ahead + 1 < iterations:  # the page id's latency passes while the next slot is attended to
                next_pos = own_key + (ahead + 1) * step_keys
                next_page, next_in_page = locate(page_indices, page_base, page_size, next_pos, k1)

        total = quad_sum(scratch, total, 4)
        # The warps meet: warp w's (max, sum) of head g in s_sh[0 / 1, w * G + g], its output in part_sh[w, g].
        if g < G:
            if t == 0:
                s_sh[0, warp * G + g] = top
                s_sh[1, warp * G + g] = total
            for j in range(O_TILES):
                part_sh[warp, g, 8 * j + 2 * t] = o[2 * j]
                part_sh[warp, g, 8 * j + 2 * t + 1] = o[2 * j + 1]
        cuda.syncthreads()
        return row, c, num_chunks

    @cuda.jit(device=True, inline=True)
    def run_direct(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                   request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale, out):
        """The direct kernels' body: every tile covers its whole row."""
        s_sh = cuda.shared.array((2, GROUP_STATES), float32)
        ring = cuda.shared.array((RING_ROWS, ROW_WORDS), int32, alignment=TILE_ALIGNMENT)
        part_sh = cuda.shared.array((W, G, PART_ROW), float32)
        scratch = cuda.shared.array(NT, float32)  # the simulator's quad reductions
        q_sh = cuda.shared.array(Q_SH, int32)
        new_sh = cuda.shared.array(NEW_SH, int32)
        rope_sh = cuda.shared.array(ROPE_SH, float32)
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, s_sh, ring, part_sh, scratch, q_sh, new_sh, rope_sh)
        if row >= 0:
            meet_out(s_sh, part_sh, out, row, cuda.blockIdx.x)

    @cuda.jit(device=True, **inlined())
    def run_split(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                  request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale, out, partial_out,
                  partial_lse):
        """The split kernels' body: tiles of a row of several chunks write partials for the merge."""
        s_sh = cuda.shared.array((2, GROUP_STATES), float32)
        ring = cuda.shared.array((RING_ROWS, ROW_WORDS), int32, alignment=TILE_ALIGNMENT)
        part_sh = cuda.shared.array((W, G, PART_ROW), float32)
        scratch = cuda.shared.array(NT, float32)
        q_sh = cuda.shared.array(Q_SH, int32)
        new_sh = cuda.shared.array(NEW_SH, int32)
        rope_sh = cuda.shared.array(ROPE_SH, float32)
        row, c, num_chunks = attend(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr,
                                    positions, request_indices, kv_tile_indices, kv_chunk_size, total_num_rows,
                                    scale, s_sh, ring, part_sh, scratch, q_sh, new_sh, rope_sh)
        if row >= 0:
            meet_split(s_sh, part_sh, out, partial_out, partial_lse, row, c, num_chunks, cuda.blockIdx.x)

    if FUSED:
        @cuda.jit(**launch_options)
        def direct_rope_kernel(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices,
                               page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices,
                               kv_chunk_size, total_num_rows, out, scale):
            run_direct((q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache), k_cache, v_cache,
                       page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices,
                       kv_tile_indices, kv_chunk_size, total_num_rows, scale, out)

        @cuda.jit(**launch_options)
        def split_rope_kernel(q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache, page_indices,
                              page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices,
                              kv_chunk_size, total_num_rows, out, partial_out, partial_lse, scale):
            run_split((q, k, v, q_weight, k_weight, eps, weight_offset, theta, k_cache, v_cache), k_cache, v_cache,
                      page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices,
                      kv_tile_indices, kv_chunk_size, total_num_rows, scale, out, partial_out, partial_lse)

        return direct_rope_kernel, split_rope_kernel

    @cuda.jit(**launch_options)
    def direct_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                      request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, scale):
        run_direct(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                   request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale, out)

    @cuda.jit(**launch_options)
    def split_kernel(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                     request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, out, partial_out,
                     partial_lse, scale):
        run_split(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, positions,
                  request_indices, kv_tile_indices, kv_chunk_size, total_num_rows, scale, out, partial_out,
                  partial_lse)

    return direct_kernel, split_kernel
