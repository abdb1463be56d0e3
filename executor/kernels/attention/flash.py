"""Causal prefill attention on tensor cores, without materialized scores (FlashAttention-2's loop).

For each request of a launch's packed range (executor/kernels/attention/packed.py: the step's
requests first_request.., those with at least min_rows rows), its chunk of ``rows`` query rows,
the last rows of its ``kv_len`` tokens (row r at position ``first_position + r``, first_position =
kv_len - rows), over its keys at positions 0..kv_len-1, its K/V head-major as PackedGatherKv
writes them ([Hkv, C, D] scratch, the packed requests' runs one after another: a kv head's
keys of a request are one contiguous run, read 16 bytes a thread):

    out[r, h] = softmax_k(q[r, h] . k[h // group, k] * D^-0.5, keys k <= first_position + r) @ v[h // group]

One launch serves all of a step's long chunks (grid z runs over the requests): a step of several
chunks of ~1,024 rows is one grid of all their blocks, where a launch a chunk leaves SMs idle.

All tensors are bf16; q and out are the step's [T, Hq, D] rows, k and v [Hkv, C, D]. The kernel reads
them as int32 words (two bf16 a word) and accumulates in float32. Like FlashAttention, it rounds
the probabilities P to bf16 for the P V product. The scores never reach memory: a block keeps
an online softmax (running row maximum and sum, in exp2 units) across key blocks.

Layout:
- A block has ``warps`` warps over one q head's query rows, ``m_tiles`` 16-row tiles a warp
  (``BlockShape``; ``block_shape`` picks two m-tiles for D <= 128, one for D 256). Blocks of the
  last rows (the most keys under the causal mask) are launched first.
- ``block_shape`` stages the block's query rows once in dynamic shared memory (past the 48 KiB a
  block gets by default: ``Kernel`` opts in); each warp reads its Q fragments there by ``ldmatrix``
  every k-step. A shape may keep one m-tile's Q fragments in registers instead (benchmarks).
- Per key block of ``keys`` keys, the block stages K and V key-major in static shared memory by
  cp.async (executor/kernels/primitives/async_copy.py), each row padded by 4 words so that the 8
  rows an ldmatrix phase reads fall in 32 distinct banks. V of a key block is copied while the warps
  compute its scores, K of the next while they compute P V: one K and one V buffer. A copy's
  addresses are a row cursor's multiply-add and a shared offset computed inside the loop; held
  across it, they take a register each (255 registers and spills).
- Each warp then runs S = Q K^T, the softmax update and O += P V with ``mma_bf16``, its K fragments
  from ``ldmatrix.x4`` two n-tiles a load and each feeding every m-tile, V's with ``.trans`` (so V
  needs no transposed copy; primitives/mma.py). O (D / 2 float32 a lane an m-tile) and S stay in
  registers: every fragment loop has constant bounds. The sm_90 compile test checks for no local
  memory.
- A key block's softmax update is one straight run over all the warp's rows (independent chains the
  scheduler interleaves; the conditional O rescales come after). Scores stay raw until the exponent:
  2^(s * scale_log2 - max * scale_log2) is one FMA and one ex2.approx.ftz (primitives/fast_math.py).
  O is rescaled only when a row's maximum grew (alpha = 1 exactly otherwise). Only key blocks that
  cross the diagonal of the block's rows are masked.

On the H200 one Qwen3-8B layer's attention at 16,384 tokens takes 7,046-7,316 us (300-312 TFLOP/s,
D 128), where torch SDPA's fused kernel takes 3,322; Qwen3.5-9B's (D 256) 8,228-8,294 us (265-267
TFLOP/s; bench/attention.py, docs/benchmarks.md, "Causal prefill attention of one layer").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from executor.kernels.attention.online_softmax import build_online_softmax
from executor.kernels.attention.packed import build_block_request
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.async_copy import build_async_copy, build_row_copy, build_shared_address
from executor.kernels.primitives.mma import build_a_fragment_load, build_fragment_loads, build_mma_bf16
from executor.kernels.primitives.shared_tile import build_shared_tile
from executor.kernels.primitives.vector import as_words, vector_aligned
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

PAD_WORDS = 4  # per staged row: shifts consecutive rows by 4 banks (16 bytes, keeping rows 16-byte aligned)
LOG2_E = 1.4426950408889634
#: Static shared memory a block may declare (PTX's limit): the K and V tiles must fit it; Q's tile is dynamic.
STATIC_SHARED_BYTES = 48 * 1024
#: Head sizes whose two m-tiles' O a thread holds (2 x D / 2 float32); D 256's would take all 255 registers.
MAX_TWO_TILE_HEAD_DIM = 128


@dataclass(frozen=True)
class BlockShape:
    """A block's work: ``warps`` warps of ``m_tiles`` 16-row query tiles each, ``keys`` keys staged a
    round; the query fragments in registers (one m-tile only) or read from a shared query tile."""

    warps: int
    keys: int
    m_tiles: int = 1
    query_in_shared: bool = False
    #: Launch bound: blocks an SM the compiler must leave registers for (None: no bound).
    blocks_per_sm: int | None = None

    def __post_init__(self) -> None:
        if self.m_tiles > 1 and not self.query_in_shared:
            raise ValueError(f"flash attention block {self}: {self.m_tiles} m-tiles a warp need the shared query tile")

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps


def block_shape(head_dim: int) -> BlockShape:
    """4 warps, 32 keys a round, Q in shared memory; two m-tiles a warp (each K and V fragment then
    feeds both) where O of 32 rows fits a thread's registers beside S (D <= MAX_TWO_TILE_HEAD_DIM).

    Measured on the H200 (bench/attention.py --block-shapes, one Qwen3-8B layer, us at 4,096 / 16,384
    tokens, one start): D 128 at 4:32:2:shared 649.9 / 7,076.9; Q in registers 4:64:1 672.6 /
    8,140.3, the same under three blocks an SM 759.3 / 8,146.4; 4:64:1:shared under four blocks an
    SM 669.1 / 8,064.7; 4:64:2:shared (spills) 744.8 / 7,893.8 (docs/benchmarks.md, "Causal prefill
    attention of one layer").
    """
    m_tiles = 2 if head_dim <= MAX_TWO_TILE_HEAD_DIM else 1
    shape = BlockShape(4, 32, m_tiles, True)
    if staged_bytes(head_dim, shape.keys) > STATIC_SHARED_BYTES:
        raise ValueError(f"flash attention: head_dim {head_dim} does not fit a 32-key block in shared memory")
    return shape


def staged_bytes(head_dim: int, keys: int) -> int:
    """Static shared memory of one staged key block: K and V, each [keys, D/2 + pad] words."""
    return 2 * 4 * keys * (head_dim // 2 + PAD_WORDS)


def query_tile_bytes(head_dim: int, shape: BlockShape) -> int:
    """Dynamic shared memory of a block's query tile, [rows, D/2 + pad] words (0 with Q in registers)."""
    return 4 * shape.rows * (head_dim // 2 + PAD_WORDS) if shape.query_in_shared else 0


def build_flash_attention(head_dim: int, group: int, shape: BlockShape) -> Callable[..., Any]:
    """Kernel ``(q [T, Hq, D/2], k, v [Hkv, C, D/2], out [T, Hq, D/2] int32 words, q_indptr [R + 1],
    positions [T] int32, first_request, min_rows int32, scale_log2 f32)``; grid (ceil(longest packed
    chunk's rows / shape.rows), Hq, requests of the range), shape.threads threads,
    ``query_tile_bytes`` of dynamic shared memory. A block past its chunk's rows, or of a request
    that is not packed, returns at once.

    head_dim a multiple of 32 (a fragment load covers two k-steps of Q K^T), keys of 16, q head h
    reads kv head h // group. scale_log2 is D^-0.5 * log2(e).
    """
    assert head_dim % 32 == 0 and shape.keys % 16 == 0 and shape.m_tiles >= 1
    D, KB, M, Q_IN_SHARED = head_dim, shape.keys, shape.m_tiles, shape.query_in_shared
    ROW_WORDS = D // 2 + PAD_WORDS         # a staged Q, K or V row
    K_STEPS = D // 16                      # k-steps of Q K^T
    S_TILES = KB // 8                      # n-tiles of S
    P_STEPS = KB // 16                     # k-steps of P V
    O_TILES = D // 8                       # n-tiles of O
    CHUNKS_PER_ROW = D // 8                # 16-byte chunks of a Q, K or V row
    THREADS, WARP_ROWS, ROWS_PER_BLOCK = shape.threads, 16 * M, shape.rows
    COPIES = KB * CHUNKS_PER_ROW // THREADS  # chunks a thread stages of K, and of V, per key block
    Q_COPIES = ROWS_PER_BLOCK * CHUNKS_PER_ROW // THREADS  # chunks a thread stages of Q, once
    assert COPIES * THREADS == KB * CHUNKS_PER_ROW and Q_COPIES * THREADS == ROWS_PER_BLOCK * CHUNKS_PER_ROW
    # Per m-tile: a lane's S values and O values.
    S_VALUES, O_VALUES = 4 * S_TILES, 4 * O_TILES
    # A lane's registers over all its m-tiles (local arrays need constant sizes): Q fragments (all
    # k-steps in registers, or one k-step of each m-tile read from shared memory), S, one k-step's P
    # words, O, row states.
    QA_WORDS = 4 * M if Q_IN_SHARED else 4 * K_STEPS
    SACC_VALUES, PA_WORDS, ACC_VALUES, ROW_STATES = M * S_VALUES, 4 * M, M * O_VALUES, 2 * M
    mma = build_mma_bf16()
    mask, softmax_update, rescale_output, pack_probabilities, store_output = build_online_softmax(S_TILES, O_TILES, M)
    lane_address, _, load_b_x4_trans = build_fragment_loads()
    load_a_x4 = build_a_fragment_load()
    copy_async, copy_async_wait_all = build_async_copy()
    row_cursor, copy_row_async, fresh_address = build_row_copy(4 * (D // 2))  # K and V rows: D / 2 words
    ROWS_PER_PASS = THREADS // CHUNKS_PER_ROW  # rows the block's threads copy a chunk each of
    shared_address = build_shared_address()
    query_tile = build_shared_tile(ROWS_PER_BLOCK, ROW_WORDS)
    block_request = build_block_request(ROWS_PER_BLOCK)
    # ldmatrix and cp.async need 16-byte aligned rows; the simulator takes no alignment (and needs none).
    TILE_ALIGNMENT = None if simulator_enabled() else 16
    SCRATCH_VALUES = THREADS if simulator_enabled() else 1  # the simulator's quad reductions

    @cuda.jit(device=True, inline=True)
    def stage_queries(q, head, first, limit, tile, tile_address):
        """Start copying query rows first.. of one q head into the query tile, Q_COPIES 16-byte chunks
        a thread; zeros from row ``limit`` on. Once a block, so plain array indexing does."""
        tid = cuda.threadIdx.x
        for i in range(Q_COPIES):
            c = tid + i * THREADS
            row = c // CHUNKS_PER_ROW
            col = (c % CHUNKS_PER_ROW) * 4
            valid = first + row < limit
            copy_async(tile, tile_address, (row, col), q, (first + row if valid else 0, head, col), valid)

    @cuda.jit(device=True, inline=True)
    def stage(src, cursor, first, limit, tile, tile_address):
        """Start copying rows first.. of one kv head of K or V (``cursor``: its row 0, this thread's
        chunk) into tile, COPIES 16-byte chunks a thread; zeros from row ``limit`` on (V's stale rows
        could hold NaN bits, and 0 x NaN would reach the output). A copy's addresses are a cursor
        multiply-add and a shared offset computed here, in the key loop: where the compiler could
        hoist them, it held each copy's address in registers across the loop."""
        tid = cuda.threadIdx.x
        lane_row = tid // CHUNKS_PER_ROW
        rows_left = limit - first - lane_row  # this thread's rows below limit, from its first
        address = fresh_address(tile_address)
        for i in range(COPIES):
            valid = ROWS_PER_PASS * i < rows_left
            row = first + lane_row + ROWS_PER_PASS * i
            copy_row_async(tile, address, (lane_row + ROWS_PER_PASS * i, (tid % CHUNKS_PER_ROW) * 4), src, cursor,
                           row if valid else 0, valid)

    if Q_IN_SHARED:
        @cuda.jit(device=True, inline=True)
        def start_queries(q, h, first, limit, warp_row, dynamic, ks, qa):
            """Start copying the block's query rows of head h, step rows first.., into the dynamic
            query tile (zeros from the chunk's end, step row ``limit``, on); returns the tile."""
            qs = query_tile(dynamic, 0)
            stage_queries(q, h, first, limit, qs, shared_address(qs, (0, 0)))
            return qs

        @cuda.jit(device=True, inline=True)
        def query_fragments(qs, q_lane, warp_row, s, qa):
            """qa[4 i .. 4 i + 3] <- m-tile i's A fragment of k-step s."""
            for i in range(M):
                qa[4 * i], qa[4 * i + 1], qa[4 * i + 2], qa[4 * i + 3] = load_a_x4(qs, q_lane, warp_row + 16 * i, 8 * s)

        QA_STEP = 0  # m-tile i's fragment of any k-step sits at qa[4 i]
    else:
        @cuda.jit(device=True, inline=True)
        def start_queries(q, h, first, limit, warp_row, dynamic, ks, qa):
            """qa[4 s ..] <- the warp's A fragments of every k-step, from global memory, the block's
            rows from step row ``first`` (zeros from step row ``limit`` on); returns a stand-in tile
            (K's) that nothing reads as queries."""
            lane = cuda.threadIdx.x % 32
            t = lane % 4
            r0 = first + warp_row + lane // 4
            r1 = r0 + 8
            for s in range(K_STEPS):
                qa[4 * s] = q[r0, h, 8 * s + t] if r0 < limit else 0
                qa[4 * s + 1] = q[r1, h, 8 * s + t] if r1 < limit else 0
                qa[4 * s + 2] = q[r0, h, 8 * s + t + 4] if r0 < limit else 0
                qa[4 * s + 3] = q[r1, h, 8 * s + t + 4] if r1 < limit else 0
            return ks

        @cuda.jit(device=True, inline=True)
        def query_fragments(qs, q_lane, warp_row, s, qa):
            pass  # loaded once by start_queries

        QA_STEP = 4  # k-step s's fragment sits at qa[4 s]

    @cuda.jit(device=True, inline=True)
    def mma_pair(a0, a1, a2, a3, b0, b1, b2, b3, acc, c):
        """acc[c .. c + 3] += A (b0, b1) and acc[c + 4 .. c + 7] += A (b2, b3): one A fragment against
        two n-tiles' B fragments."""
        acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma(a0, a1, a2, a3, b0, b1, acc[c], acc[c + 1], acc[c + 2],
                                                         acc[c + 3])
        acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7] = mma(a0, a1, a2, a3, b2, b3, acc[c + 4], acc[c + 5],
                                                             acc[c + 6], acc[c + 7])

    @cuda.jit(device=True, inline=True)
    def scores(qs, q_lane, warp_row, ks, k_lane, qa, sacc):
        """sacc <- Q K^T of this warp's m-tiles and the staged keys (raw dot products). Per k-step,
        every K fragment (two n-tiles a load) feeds all m-tiles."""
        for i in range(SACC_VALUES):
            sacc[i] = float32(0.0)
        for s in range(K_STEPS):
            query_fragments(qs, q_lane, warp_row, s, qa)
            for j in range(0, S_TILES, 2):
                # K rows 8j.. are n-tile j, rows 8j + 8.. n-tile j + 1: A's quarters are their b0, b1.
                b0, b0_next, b1, b1_next = load_a_x4(ks, k_lane, 8 * j, 8 * s)
                for i in range(M):
                    a = QA_STEP * s + 4 * i
                    mma_pair(qa[a], qa[a + 1], qa[a + 2], qa[a + 3], b0, b1, b0_next, b1_next, sacc,
                             i * S_VALUES + 4 * j)

    @cuda.jit(device=True, inline=True)
    def accumulate(sacc, pa, vs, v_lane, o):
        """o += P V, one k-step (16 keys) at a time: that step's P as bf16 A fragments of every m-tile
        (two S n-tiles make one), then V's B fragments transposed out of the key-major tile, two
        output n-tiles a load, each feeding every m-tile. Packing a step just before its MMAs keeps
        only its P words live beside S and O."""
        for s in range(P_STEPS):
            pack_probabilities(sacc, pa, s, 0)
            for j in range(0, O_TILES, 2):
                b0, b1, b2, b3 = load_b_x4_trans(vs, v_lane, 16 * s, 4 * j)
                for i in range(M):
                    mma_pair(pa[4 * i], pa[4 * i + 1], pa[4 * i + 2], pa[4 * i + 3], b0, b1, b2, b3, o,
                             i * O_VALUES + 4 * j)

    @cuda.jit(**launch_bounds(None if shape.blocks_per_sm is None else (THREADS, shape.blocks_per_sm)))
    def flash_attention(q, k, v, out, q_indptr, positions, first_request, min_rows, scale_log2):
        scratch = cuda.shared.array(SCRATCH_VALUES, float32)
        dynamic = cuda.shared.array(0, int32, alignment=TILE_ALIGNMENT)
        ks = cuda.shared.array((KB, ROW_WORDS), int32, alignment=TILE_ALIGNMENT)
        vs = cuda.shared.array((KB, ROW_WORDS), int32, alignment=TILE_ALIGNMENT)
        qa = cuda.local.array(QA_WORDS, int32)
        sacc = cuda.local.array(SACC_VALUES, float32)
        pa = cuda.local.array(PA_WORDS, int32)
        o = cuda.local.array(ACC_VALUES, float32)
        row_maxima = cuda.local.array(ROW_STATES, float32)  # running, raw score units; [2 i] row g, [2 i + 1] g + 8
        row_sums = cuda.local.array(ROW_STATES, float32)
        alphas = cuda.local.array(ROW_STATES, float32)  # this key block's rescale of each row state's O and sum
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        h = cuda.blockIdx.y
        kvh = h // group
        active, q_start, rows, kv_len, first_row, kv_offset = block_request(q_indptr, positions, first_request, min_rows)
        if not active:
            return  # a request the launch skips, or a row block past a shorter chunk's rows (packed.py)
        first_position = kv_len - rows
        warp_row = (cuda.threadIdx.x // 32) * WARP_ROWS  # the warp's first row in the block
        qs = start_queries(q, h, q_start + first_row, q_start + rows, warp_row, dynamic, ks, qa)
        # Shared addresses taken once: each copy and fragment load then adds a constant offset. A's
        # quarters are the transposed load's matrices, untransposed: Q's, and K's two n-tiles at a time.
        ks_address = shared_address(ks, (0, 0))
        vs_address = shared_address(vs, (0, 0))
        q_lane = lane_address(qs, True)
        k_lane = lane_address(ks, True)
        v_lane = lane_address(vs, True)
        for i in range(ACC_VALUES):
            o[i] = float32(0.0)
        # Finite start: a row whose keys are all masked so far keeps alpha = 1 and sum 0, not NaN.
        for i in range(ROW_STATES):
            row_maxima[i] = float32(-1e30)
            row_sums[i] = float32(0.0)
        unmasked_end = first_position + first_row + 1  # keys below this are visible to every row of the block
        key_end = first_position + min(first_row + ROWS_PER_BLOCK, rows)  # the block's last row sees up to here
        # Pipeline: a shared Q lands with the first K; V of a key block lands during its Q K^T and
        # softmax, K of the next during its P V.
        col = (cuda.threadIdx.x % CHUNKS_PER_ROW) * 4
        k_cursor = row_cursor(k, (kvh, kv_offset, col))
        v_cursor = row_cursor(v, (kvh, kv_offset, col))
        stage(k, k_cursor, 0, kv_len, ks, ks_address)
        for first_key in range(0, key_end, KB):
            copy_async_wait_all()
            cuda.syncthreads()  # K landed for every thread; every warp is done with the last block's V
            stage(v, v_cursor, first_key, kv_len, vs, vs_address)
            scores(qs, q_lane, warp_row, ks, k_lane, qa, sacc)
            if first_key + KB > unmasked_end:
                for i in range(M):
                    p0 = first_position + first_row + warp_row + 16 * i + g
                    mask(sacc, i, first_key, p0, p0 + 8, t)
            softmax_update(scratch, sacc, row_maxima, row_sums, alphas, scale_log2)
            rescale_output(o, alphas)
            copy_async_wait_all()
            cuda.syncthreads()  # V landed for every thread; every warp is done with this block's K
            if first_key + KB < key_end:
                stage(k, k_cursor, first_key + KB, kv_len, ks, ks_address)
            accumulate(sacc, pa, vs, v_lane, o)
        store_output(scratch, o, row_sums, out, q_start, first_row, warp_row, rows, h, g, t)

    return flash_attention


def single_request(rows: int, kv_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q_indptr, positions)`` int32 of one request's chunk of ``rows`` rows, the last of its ``kv_len``
    tokens: the metadata of a one-request launch (benchmarks, tests)."""
    if not 1 <= rows <= kv_len:
        raise ValueError(f"flash attention: a chunk of {rows} rows must be 1..kv_len {kv_len}")
    return (np.array([0, rows], dtype=np.int32), np.arange(kv_len - rows, kv_len, dtype=np.int32))


class FlashAttention:
    """Launcher: causal attention of a packed range of a step's chunks over their gathered keys, bf16
    (or its int16 bits).

    q, out [T, Hq, D] (the step's rows); k, v [Hkv, C, D] (PackedGatherKv's scratch); Hq a multiple
    of Hkv; D a multiple of 32; every row's heads 16-byte aligned (a strided q such as Qwen3.5's gated
    one is fine). q_indptr [R + 1] and positions [T] int32 are the step's metadata; the launch serves
    requests ``first_request .. first_request + num_requests - 1`` with at least ``min_rows`` rows
    (packed.py), whose kv_len add up to ``kv_tokens`` and whose longest chunk has ``max_rows`` rows.
    """

    def __init__(self, shape: BlockShape | None = None) -> None:
        """``shape``: one block shape for every head size instead of ``block_shape``'s (for benchmarks)."""
        self.shape = shape
        self._launches: dict[tuple[int, int], tuple[int, int, int, Kernel]] = {}

    def launch_shape(self, head_dim: int, group: int) -> tuple[int, int, int, Kernel]:
        """(query rows a block, threads a block, dynamic shared bytes, kernel) for this head size and GQA
        group (built once)."""
        entry = self._launches.get((head_dim, group))
        if entry is None:
            entry = self._launches[(head_dim, group)] = self._build(head_dim, group)
        return entry

    def _build(self, head_dim: int, group: int) -> tuple[int, int, int, Kernel]:
        shape = self.shape or block_shape(head_dim)
        tile_bytes = query_tile_bytes(head_dim, shape)
        kernel = Kernel(build_flash_attention(head_dim, group, shape), dynamic_shared_bytes=tile_bytes)
        return shape.rows, shape.threads, tile_bytes, kernel

    def __call__(self, q: Any, k: Any, v: Any, out: Any, q_indptr: Any, positions: Any, first_request: int,
                 num_requests: int, max_rows: int, kv_tokens: int, min_rows: int = 1, stream: Any = 0) -> None:
        """Attention of the packed chunks' rows into their rows of ``out``."""
        _, q_heads, head_dim = q.shape
        kv_heads, capacity, _ = k.shape
        if tuple(out.shape) != tuple(q.shape) or tuple(v.shape) != tuple(k.shape) or k.shape[2] != head_dim:
            raise ValueError(f"flash attention: q {tuple(q.shape)}, out {tuple(out.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}: q and out must match, k and v must match, one head_dim")
        if head_dim % 32 or kv_heads == 0 or q_heads % kv_heads:
            raise ValueError(f"flash attention: head_dim {head_dim} must be a multiple of 32 and q heads {q_heads} "
                             f"a multiple of kv heads {kv_heads}")
        if kv_tokens > capacity:
            raise ValueError(f"flash attention: the packed requests' {kv_tokens} keys do not fit the {capacity} "
                             f"keys of k and v")
        if not 0 <= first_request <= first_request + num_requests <= q_indptr.shape[0] - 1:
            raise ValueError(f"flash attention: requests {first_request}..{first_request + num_requests - 1} "
                             f"outside the step's {q_indptr.shape[0] - 1}")
        if k.stride(1) != head_dim or v.stride(1) != head_dim:
            raise ValueError(f"flash attention: k and v rows must lie head_dim {head_dim} elements apart (a kv head's "
                             f"keys one run), not {k.stride(1)} and {v.stride(1)}")
        if not vector_aligned(q, k, v, out):
            raise ValueError("flash attention: every head of q, k, v and out must be 16-byte aligned and contiguous")
        if num_requests == 0 or max_rows == 0:
            return
        rows, threads, shared_bytes, kernel = self.launch_shape(head_dim, q_heads // kv_heads)
        grid = (-(-max_rows // rows), q_heads, num_requests)
        scale_log2 = np.float32(LOG2_E / math.sqrt(head_dim))
        kernel[grid, threads, stream, shared_bytes](
            as_words(q), as_words(k), as_words(v), as_words(out), q_indptr, positions, np.int32(first_request),
            np.int32(min_rows), scale_log2)
