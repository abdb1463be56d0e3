"""Causal prefill attention on warpgroup tensor-core products (sm_90a): flash.py's loop, with Q K^T and
P V as ``wgmma`` (primitives/wgmma.py) instead of per-warp ``mma.sync``.

The same launch and result as flash.py's FlashAttention (its module docstring: the packed chunks, the
causal rows, the bf16 P, the float32 online softmax), computed differently:

- A block is one warpgroup (4 warps, 128 threads) over 64 query rows of one q head; warp w owns rows
  16 w .. 16 w + 15, as in a flash.py block of one m-tile a warp.
- Q (once), K and V (per key block of ``keys`` keys) are staged by cp.async into 128-byte swizzled
  tiles (``CoreTile``; plain core-matrix tiles where the head size is not a multiple of 64) in dynamic
  shared memory. The tensor cores read each staged key and value once for the whole warpgroup, where
  mma.sync's ldmatrix reads them once per warp: that shared-memory traffic is what holds flash.py at
  about a third of the tensor-core rate at head_dim 256. Unswizzled tiles run at a third of the
  swizzled speed (``warpgroup_shape`` has the figures).
- S = Q K^T is D / 16 products of m64 n``keys`` k16, both operands in shared memory (K K-major). The
  softmax runs on S in registers (online_softmax.py, the accumulator layout is mma.sync's), P is
  packed to bf16 A fragments in registers, and O += P V is ``keys`` / 16 products of m64 n``D`` k16
  with A from those registers and V read MN-major from its key-major tile (no transposed copy).
- V of a key block lands while the warpgroup computes its scores, K of the next while it computes
  P V, as in flash.py. Each product group is committed and waited for before its accumulator is
  read (``WarpgroupShape.overlap`` lets P V run on into the next scores instead).

A thread holds O (D / 2 float32: 128 at head_dim 256), S (``keys`` / 2) and P (``keys`` / 4 words);
two blocks an SM share its registers and (96 KiB a block at head_dim 256 and 64 keys) its shared
memory, so one block's softmax overlaps the other's products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from executor.kernels.attention.flash import FlashAttention
from executor.kernels.attention.online_softmax import build_online_softmax
from executor.kernels.attention.packed import build_block_request
from executor.kernels.primitives.async_copy import build_async_copy, build_row_copy, build_shared_address
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.shared_tile import build_shared_tile
from executor.kernels.primitives.wgmma import (SWIZZLE_ELEMENTS, WARPGROUP_ROWS, WARPGROUP_THREADS, CoreTile,
                                               build_chunk_word, build_descriptor, build_step_offset, build_wgmma,
                                               build_wgmma_sync, build_wgmma_wait)
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

#: Head sizes the warpgroup kernel serves: the P V product's N is the head size (a wgmma N is at most
#: 256), and staging takes rows in groups of four 16-byte chunks (head_dim % 32 == 0).
WARPGROUP_HEAD_DIMS = (32, 64, 128, 256)


@dataclass(frozen=True)
class WarpgroupShape:
    """A block's key block: ``keys`` keys staged a round (the N of the S product), the blocks an SM the
    compiler must leave registers for, and whether P V overlaps the next block's Q K^T."""

    keys: int = 64
    blocks_per_sm: int = 2
    #: Stage Q, K and V in the 128-byte swizzled layout (head_dim a multiple of 64) instead of the
    #: plain core-matrix one (primitives/wgmma.py).
    swizzle: bool = False
    #: Leave a key block's P V products running into the next block's score products (waiting for both
    #: before the V tile is restaged), so the tensor cores go from one to the next without the barrier
    #: and wait between; V's copy then overlaps the softmax instead of Q K^T. False (measured faster:
    #: ``warpgroup_shape``) waits for P V at the end of each key block and copies V during Q K^T.
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.keys % 32 or not 32 <= self.keys <= 256:
            raise ValueError(f"warpgroup flash attention: {self.keys} keys a round must be a multiple of 32 in 32..256 "
                             "(the staging's 32-row passes)")


def warpgroup_shape(head_dim: int) -> WarpgroupShape:
    """64 keys a round, the 128-byte swizzle where the head size allows it (a multiple of 64), P V
    waited for within its key block: at head_dim 256 the Q, K and V tiles take 96 KiB, two blocks an SM.

    Measured on an H100 (bench/attention.py, one layer, us at 4,096 / 16,384 tokens; docs/benchmarks.md
    "Causal prefill attention of one layer"): Qwen3.5-9B (D 256) warpgroup:64:swizzle 444.3 / 5,020.5,
    with P V running into the next Q K^T 486.6 / 5,111.9, unswizzled 1,320.7 / 14,402.6,
    128 keys 614.9 / 7,669.9 (spills), mma.sync (flash.py) 735.5 / 8,186.3; Qwen3-8B (D 128) 442.8 /
    4,886.8 against mma.sync's 798.4 / 7,415.1."""
    return WarpgroupShape(swizzle=head_dim % SWIZZLE_ELEMENTS == 0)


def shared_bytes(head_dim: int, shape: WarpgroupShape) -> int:
    """Dynamic shared memory of a block: the Q tile (64 rows), then the K and V tiles."""
    return 2 * head_dim * (WARPGROUP_ROWS + 2 * shape.keys)


def build_flash_wgmma(head_dim: int, group: int, shape: WarpgroupShape) -> Callable[..., Any]:
    """The kernel, with flash.py's ``build_flash_attention`` arguments and grid (64 rows a block,
    WARPGROUP_THREADS threads, ``shared_bytes`` of dynamic shared memory)."""
    if head_dim not in WARPGROUP_HEAD_DIMS:
        raise ValueError(f"warpgroup flash attention: head_dim {head_dim} is not one of {WARPGROUP_HEAD_DIMS}")
    D, KB, ROWS, THREADS = head_dim, shape.keys, WARPGROUP_ROWS, WARPGROUP_THREADS
    CHUNKS = D // 8                       # 16-byte chunks of a Q, K or V row
    K_STEPS, P_STEPS = D // 16, KB // 16  # k-steps of Q K^T and of P V
    S_TILES, O_TILES = KB // 8, D // 8
    S_VALUES, O_VALUES, PA_WORDS = 4 * S_TILES, 4 * O_TILES, 4 * P_STEPS
    SWIZZLE = shape.swizzle
    q_tile, kv_tile = CoreTile(ROWS, D, SWIZZLE), CoreTile(KB, D, SWIZZLE)
    Q_SHAPE, KV_SHAPE = q_tile.shape, kv_tile.shape
    Q_WORDS, KV_WORDS = q_tile.bytes // 4, kv_tile.bytes // 4
    q_layout, k_layout, v_layout = q_tile.k_major(), kv_tile.k_major(), kv_tile.mn_major()
    q_step, k_step, v_step = build_step_offset(q_layout), build_step_offset(k_layout), build_step_offset(v_layout)
    Q_PASSES, PASSES = ROWS // 32, KB // 32  # 32-row passes down the Q tile and a K or V tile
    CHUNK_GROUPS = CHUNKS // 4  # 4-chunk groups across a row
    scores_product = build_wgmma(KB, False, True)
    values_product = build_wgmma(D, True, False)
    wgmma_fence, wgmma_commit, proxy_fence = build_wgmma_sync()
    wait_scores = build_wgmma_wait(S_VALUES)
    wait_output = build_wgmma_wait(O_VALUES)
    OVERLAP = shape.overlap
    descriptor = build_descriptor()
    chunk_word = build_chunk_word()
    mask, softmax_update, rescale_output, pack_probabilities, store_output = build_online_softmax(S_TILES, O_TILES, 1)
    copy_async, copy_async_wait_all = build_async_copy()
    if not simulator_enabled():
        row_cursor, copy_chunk_async, fresh_address = build_row_copy(16)  # a "row" is one 16-byte chunk
    shared_address = build_shared_address()
    q_view = build_shared_tile(*Q_SHAPE)
    kv_view = build_shared_tile(*KV_SHAPE)
    block_request = build_block_request(ROWS)
    # cp.async and the core matrices need 16-byte aligned tiles, swizzle atoms 1,024-byte aligned ones
    # (every tile's size is a multiple of 1,024 bytes); the simulator takes no alignment.
    TILE_ALIGNMENT = None if simulator_enabled() else 1024
    SCRATCH_VALUES = THREADS if simulator_enabled() else 1  # the simulator's quad reductions

    @cuda.jit(device=True, inline=True)
    def first_place():
        """This thread's (row, chunk) of its first copy into a tile. A pass of the block's copies covers
        32 rows x 4 chunks, a warp's 32 copies 8 rows x 4 chunks, so each chunk column's 8 rows fill
        one core matrix (128 bytes: no bank conflict) and each row reads 64 contiguous bytes. Passes
        go down a tile's rows, then across its chunks: pass p of chunk group c adds 32 p rows and 4 c
        chunks, constants once the copy loops unroll."""
        tid = cuda.threadIdx.x
        return (tid & 7) + ((tid >> 5) << 3), (tid >> 3) & 3

    @cuda.jit(device=True, inline=True)
    def stage_queries(q, head, first, limit, tile, tile_address):
        """Start copying step rows first.. of q head ``head`` into the Q tile; zeros from row limit on.
        Once a block, so plain array indexing does."""
        row0, chunk0 = first_place()
        for c in range(CHUNK_GROUPS):
            for p in range(Q_PASSES):
                row, chunk = row0 + 32 * p, chunk0 + 4 * c
                valid = first + row < limit
                copy_async(tile, tile_address, chunk_word(row, chunk, ROWS, SWIZZLE), q,
                           (first + row if valid else 0, head, 4 * chunk), valid)

    if simulator_enabled():
        @cuda.jit(device=True, inline=True)
        def stage(src, kv_head, kv_offset, first, limit, tile, tile_address):
            """Start copying keys first.. of one kv head of K or V into a tile; zeros from key limit on
            (V's stale rows could hold NaN bits, and 0 x NaN would reach the output)."""
            row0, chunk0 = first_place()
            for c in range(CHUNK_GROUPS):
                for p in range(PASSES):
                    row, chunk = row0 + 32 * p, chunk0 + 4 * c
                    valid = first + row < limit
                    copy_async(tile, tile_address, chunk_word(row, chunk, KB, SWIZZLE), src,
                               (kv_head, kv_offset + (first + row if valid else 0), 4 * chunk), valid)
    else:
        @cuda.jit(device=True, inline=True)
        def stage(src, kv_head, kv_offset, first, limit, tile, tile_address):
            """The same copies, each an add to one cursor (the request's first key of this kv head, in
            16-byte chunks) and a constant shared offset: indexing src per copy costs a multiply-add
            per axis and checks, which at 16 copies a stage outweighed the products."""
            row0, chunk0 = first_place()
            cursor = row_cursor(src, (kv_head, kv_offset, 0))
            address = fresh_address(tile_address)
            start = (first + row0) * CHUNKS + chunk0
            for c in range(CHUNK_GROUPS):
                for p in range(PASSES):
                    valid = first + row0 + 32 * p < limit
                    copy_chunk_async(tile, address, chunk_word(row0 + 32 * p, chunk0 + 4 * c, KB, SWIZZLE), src, cursor,
                                     start + (32 * p * CHUNKS + 4 * c) if valid else 0, valid)

    @cuda.jit(**launch_bounds((THREADS, shape.blocks_per_sm)))
    def flash_attention(q, k, v, out, q_indptr, positions, first_request, min_rows, scale_log2):
        scratch = cuda.shared.array(SCRATCH_VALUES, float32)
        dynamic = cuda.shared.array(0, int32, alignment=TILE_ALIGNMENT)
        sacc = cuda.local.array(S_VALUES, float32)
        pa = cuda.local.array(PA_WORDS, int32)
        o = cuda.local.array(O_VALUES, float32)
        row_maxima = cuda.local.array(2, float32)  # running, raw score units: row g, row g + 8
        row_sums = cuda.local.array(2, float32)
        alphas = cuda.local.array(2, float32)
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        h = cuda.blockIdx.y
        kvh = h // group
        active, q_start, rows, kv_len, first_row, kv_offset = block_request(q_indptr, positions, first_request, min_rows)
        if not active:
            return  # a request the launch skips, or a row block past a shorter chunk's rows (packed.py)
        first_position = kv_len - rows
        warp_row = (cuda.threadIdx.x // 32) * 16
        qs = q_view(dynamic, 0)
        ks = kv_view(dynamic, Q_WORDS)
        vs = kv_view(dynamic, Q_WORDS + KV_WORDS)
        q_address = shared_address(qs, (0, 0))
        k_address = shared_address(ks, (0, 0))
        v_address = shared_address(vs, (0, 0))
        q_descriptor = descriptor(q_address, q_layout.leading, q_layout.stride, q_layout.mode)
        k_descriptor = descriptor(k_address, k_layout.leading, k_layout.stride, k_layout.mode)
        v_descriptor = descriptor(v_address, v_layout.leading, v_layout.stride, v_layout.mode)
        stage_queries(q, h, q_start + first_row, q_start + rows, qs, q_address)
        for i in range(O_VALUES):
            o[i] = float32(0.0)
        # Finite start: a row whose keys are all masked so far keeps alpha = 1 and sum 0, not NaN.
        for i in range(2):
            row_maxima[i] = float32(-1e30)
            row_sums[i] = float32(0.0)
        unmasked_end = first_position + first_row + 1  # keys below this are visible to every row of the block
        key_end = first_position + min(first_row + ROWS, rows)  # the block's last row sees up to here
        p0 = first_position + first_row + warp_row + g
        stage(k, kvh, kv_offset, 0, kv_len, ks, k_address)
        for first_key in range(0, key_end, KB):
            copy_async_wait_all()
            proxy_fence()
            cuda.syncthreads()  # K (and Q) landed for every thread
            wgmma_fence()
            for s in range(K_STEPS):
                scores_product(sacc, qs, q_descriptor + q_step(s), ks, k_descriptor + k_step(s), s > 0)
            wgmma_commit()
            if OVERLAP:
                # The last key block's P V ran on into these scores. Waiting for only that group
                # (wait_group 1) makes ptxas serialize every product (it cannot tell which group a
                # later read of O follows), so this waits for both.
                wait_output(o)
                cuda.syncthreads()  # every thread's P V is done with the V tile
            stage(v, kvh, kv_offset, first_key, kv_len, vs, v_address)
            wait_scores(sacc)
            if first_key + KB > unmasked_end:
                mask(sacc, 0, first_key, p0, p0 + 8, t)
            softmax_update(scratch, sacc, row_maxima, row_sums, alphas, scale_log2)
            rescale_output(o, alphas)
            for s in range(P_STEPS):
                pack_probabilities(sacc, pa, s, 4 * s)
            copy_async_wait_all()
            proxy_fence()
            cuda.syncthreads()  # V landed for every thread; every thread's score products are done with K
            if first_key + KB < key_end:
                stage(k, kvh, kv_offset, first_key + KB, kv_len, ks, k_address)
            wgmma_fence()
            for s in range(P_STEPS):
                values_product(o, pa[4 * s], pa[4 * s + 1], pa[4 * s + 2], pa[4 * s + 3], vs,
                               v_descriptor + v_step(s), True)
            wgmma_commit()
            if not OVERLAP:
                wait_output(o)
        if OVERLAP:
            wait_output(o)  # the last key block's P V
        store_output(scratch, o, row_sums, out, q_start, first_row, warp_row, rows, h, g, t)

    return flash_attention


class WarpgroupFlashAttention(FlashAttention):
    """FlashAttention's launcher (same arguments, checks and result) running the warpgroup kernel."""

    def __init__(self, shape: WarpgroupShape | None = None) -> None:
        """``shape``: one key block for every head size instead of ``warpgroup_shape``'s (benchmarks)."""
        super().__init__()
        self.warpgroup_shape = shape

    def _build(self, head_dim: int, group: int) -> tuple[int, int, int, Kernel]:
        shape = self.warpgroup_shape or warpgroup_shape(head_dim)
        tile_bytes = shared_bytes(head_dim, shape)
        kernel = Kernel(build_flash_wgmma(head_dim, group, shape), dynamic_shared_bytes=tile_bytes)
        return WARPGROUP_ROWS, WARPGROUP_THREADS, tile_bytes, kernel
