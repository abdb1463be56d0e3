"""Causal prefill attention on tensor cores, without materialized scores (FlashAttention-2's loop).

For one request's chunk of ``rows`` query rows, the last rows of its ``kv_len`` tokens (row r
at position ``first_position + r``, first_position = kv_len - rows), over its keys at positions
0..kv_len-1, its K/V head-major as GEMM attention's GatherKv writes them ([Hkv, C, D] scratch,
C >= kv_len: a kv head's keys are one contiguous run, read 16 bytes a thread):

    out[r, h] = softmax_k(q[r, h] . k[h // group, k] * D^-0.5, keys k <= first_position + r) @ v[h // group]

All tensors are bf16; q and out are [rows, Hq, D], k and v [Hkv, >= kv_len, D]. The kernel reads
them as int32 words (two bf16 a word) and accumulates in float32. Like FlashAttention, it rounds
the probabilities P to bf16 for the P V product. The scores never reach memory: a block keeps
an online softmax (running row maximum and sum, in exp2 units) across key blocks.

Layout:
- A block has ``block_shape(D).warps`` warps over one q head's query rows, 16 rows a warp. Blocks
  of the last rows (the most keys under the causal mask) are launched first.
- Q's fragments stay in registers for the whole key loop.
- Per key block of ``block_shape(D).keys`` keys, the block stages K and V key-major in shared memory
  by cp.async (executor/kernels/async_copy.py), each row padded by 4 words so that the 8 rows
  an ldmatrix phase reads fall in 32 distinct banks. V of a key block is copied while the warps
  compute its scores, K of the next while they compute P V: one K and one V buffer.
- Each warp then runs S = Q K^T, the softmax update and O += P V with ``mma_bf16``, its B
  fragments from ``ldmatrix.x4`` (V's with ``.trans``, so V needs no transposed copy; mma.py).
  The O accumulators (D / 2 float32 a lane) and S stay in registers: every fragment loop has
  constant bounds. The sm_90 compile test checks for no local memory.
- Scores stay raw until the exponent: 2^(s * scale_log2 - max * scale_log2) is one FMA and one
  ex2. Only key blocks that cross the diagonal of the block's rows are masked.

On the H200 (bench/attention.py), one Qwen3-8B layer's attention at 16,384 tokens ran at 269
TFLOP/s, 0.41x torch SDPA's fused kernel (648 TFLOP/s). A thread holds 236 registers at D 128
(255 at D 256), so an SM keeps two blocks: little latency hiding around the mma.sync chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from executor.kernels.launch import Kernel
from executor.kernels.async_copy import build_async_copy, build_shared_address
from executor.kernels.mma import build_fragment_loads, build_mma_bf16, build_pack_bf16x2
from executor.kernels.reduce import build_group_max, build_group_sum
from executor.kernels.vector import as_words, vector_aligned
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

PAD_WORDS = 4  # per staged row: shifts consecutive rows by 4 banks (16 bytes, keeping rows 16-byte aligned)
LOG2_E = 1.4426950408889634
#: Shared memory a block may use without the opt-in attribute (launch.py's limit).
STATIC_SHARED_BYTES = 48 * 1024


@dataclass(frozen=True)
class BlockShape:
    """A block's work: ``warps`` warps of 16 query rows each, ``keys`` keys staged a round."""

    warps: int
    keys: int

    @property
    def rows(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps


def block_shape(head_dim: int) -> BlockShape:
    """4 warps and 64 keys where K and V of 64 keys fit STATIC_SHARED_BYTES, else 8 warps and 32 keys.

    Measured on the H200 (2026-11-30, one layer at 4096 / 16384 tokens, TFLOP/s): D 128 with 4
    warps ran at 211 / 277 with 64 keys, 177 / 227 with 32; 8 warps and 64 keys 189 / 250. For
    D 256, 64 keys do not fit: 8 warps and 32 keys 160 / 224, 4 warps and 16 keys 151 / 206.
    Capping registers for more blocks an SM only spilled and slowed it (D 128, 4 warps: 64 keys at
    3 blocks an SM 181 / 243, 32 keys at 3 / 4 blocks 175 / 230 and 148 / 191; docs/benchmarks.md).
    """
    for shape in (BlockShape(4, 64), BlockShape(8, 32)):
        if staged_bytes(head_dim, shape.keys) + shape.threads * 4 <= STATIC_SHARED_BYTES:
            return shape
    raise ValueError(f"flash attention: head_dim {head_dim} does not fit a 32-key block in shared memory")


def staged_bytes(head_dim: int, keys: int) -> int:
    """Shared memory of one staged key block: K and V, each [keys, D/2 + pad] words."""
    return 2 * 4 * keys * (head_dim // 2 + PAD_WORDS)


def build_flash_attention(head_dim: int, keys: int, group: int, warps: int) -> Callable[..., Any]:
    """Kernel ``(q [rows, Hq, D/2], k, v [Hkv, >= kv_len, D/2], out [rows, Hq, D/2] int32 words,
    rows, kv_len, first_position int32, scale_log2 f32)``; grid (ceil(rows / (16 warps)), Hq),
    32 warps threads, 128 warps bytes of dynamic shared memory (the simulator's quad reductions).

    head_dim a multiple of 32 (a fragment load covers two k-steps of Q K^T), keys of 16, q head h
    reads kv head h // group. scale_log2 is D^-0.5 * log2(e).
    """
    assert head_dim % 32 == 0 and keys % 16 == 0
    D, KB = head_dim, keys
    ROW_WORDS = D // 2 + PAD_WORDS         # a staged K or V row
    K_STEPS = D // 16                      # k-steps of Q K^T
    S_TILES = KB // 8                      # n-tiles of S
    P_STEPS = KB // 16                     # k-steps of P V
    O_TILES = D // 8                       # n-tiles of O
    CHUNKS_PER_ROW = D // 8                # 16-byte chunks of a K or V row
    THREADS, ROWS_PER_BLOCK = 32 * warps, 16 * warps
    COPIES = KB * CHUNKS_PER_ROW // THREADS  # chunks a thread stages of K, and of V, per key block
    assert COPIES * THREADS == KB * CHUNKS_PER_ROW
    Q_WORDS, S_VALUES, P_WORDS, O_VALUES = 4 * K_STEPS, 4 * S_TILES, 4 * P_STEPS, 4 * O_TILES
    mma = build_mma_bf16()
    pack = build_pack_bf16x2()
    lane_address, load_b_x4, load_b_x4_trans = build_fragment_loads()
    copy_async, copy_async_wait_all = build_async_copy()
    shared_address = build_shared_address()
    quad_max = build_group_max()
    quad_sum = build_group_sum()
    # ldmatrix and cp.async need 16-byte aligned rows; the simulator takes no alignment (and needs none).
    TILE_ALIGNMENT = None if simulator_enabled() else 16

    @cuda.jit(device=True, inline=True)
    def load_q(q, r0, r1, h, rows, qa, t):
        for s in range(K_STEPS):
            qa[4 * s] = q[r0, h, 8 * s + t] if r0 < rows else 0
            qa[4 * s + 1] = q[r1, h, 8 * s + t] if r1 < rows else 0
            qa[4 * s + 2] = q[r0, h, 8 * s + t + 4] if r0 < rows else 0
            qa[4 * s + 3] = q[r1, h, 8 * s + t + 4] if r1 < rows else 0

    @cuda.jit(device=True, inline=True)
    def stage(src, kvh, first_key, kv_len, tile, tile_address):
        """Start copying keys first_key.. of one kv head (K or V rows) into tile; zeros past kv_len
        (V's stale rows could hold NaN bits, and 0 x NaN would reach the output)."""
        tid = cuda.threadIdx.x
        for i in range(COPIES):
            c = tid + i * THREADS
            key = c // CHUNKS_PER_ROW
            col = (c % CHUNKS_PER_ROW) * 4
            valid = first_key + key < kv_len
            copy_async(tile, tile_address, (key, col), src, (kvh, first_key + key if valid else 0, col), valid)

    @cuda.jit(device=True, inline=True)
    def scores(qa, ks, k_lane, sacc):
        """sacc <- Q K^T of this warp's 16 rows and the staged keys (raw dot products)."""
        for j in range(S_TILES):
            c0 = float32(0.0)
            c1 = float32(0.0)
            c2 = float32(0.0)
            c3 = float32(0.0)
            for s in range(0, K_STEPS, 2):
                b0, b1, b2, b3 = load_b_x4(ks, k_lane, 8 * j, 8 * s)
                c0, c1, c2, c3 = mma(qa[4 * s], qa[4 * s + 1], qa[4 * s + 2], qa[4 * s + 3], b0, b1, c0, c1, c2, c3)
                c0, c1, c2, c3 = mma(qa[4 * s + 4], qa[4 * s + 5], qa[4 * s + 6], qa[4 * s + 7], b2, b3,
                                     c0, c1, c2, c3)
            sacc[4 * j] = c0
            sacc[4 * j + 1] = c1
            sacc[4 * j + 2] = c2
            sacc[4 * j + 3] = c3

    @cuda.jit(device=True, inline=True)
    def mask(sacc, first_key, p0, p1, t):
        """Keys after a row's position to -inf. A stored row's position is below kv_len, so this also
        drops the zero-filled keys past it."""
        for j in range(S_TILES):
            key = first_key + 8 * j + 2 * t
            if key > p0:
                sacc[4 * j] = -math.inf
            if key + 1 > p0:
                sacc[4 * j + 1] = -math.inf
            if key > p1:
                sacc[4 * j + 2] = -math.inf
            if key + 1 > p1:
                sacc[4 * j + 3] = -math.inf

    @cuda.jit(device=True, inline=True)
    def row_max(sacc, first, start):
        # first: 0 for row g (values 0, 1 of each tile), 2 for row g + 8
        best = start
        for j in range(S_TILES):
            best = max(best, max(sacc[4 * j + first], sacc[4 * j + first + 1]))
        return best

    @cuda.jit(device=True, inline=True)
    def exponentiate(sacc, first, scale_log2, max_log2):
        """p = 2^(score * scale_log2 - max_log2), one FMA and one exp2 a score; returns the row's partial sum."""
        total = float32(0.0)
        for j in range(S_TILES):
            for i in range(2):
                p = float32(math.exp2(sacc[4 * j + first + i] * scale_log2 - max_log2))
                sacc[4 * j + first + i] = p
                total += p
        return total

    @cuda.jit(device=True, inline=True)
    def accumulate(sacc, pa, vs, v_lane, o):
        """o += P V: P's bf16 A fragments from the S tiles (two n-tiles make one k-step); V's B
        fragments transposed out of the key-major tile, two output n-tiles a load."""
        for s in range(P_STEPS):
            pa[4 * s] = pack(sacc[8 * s], sacc[8 * s + 1])
            pa[4 * s + 1] = pack(sacc[8 * s + 2], sacc[8 * s + 3])
            pa[4 * s + 2] = pack(sacc[8 * s + 4], sacc[8 * s + 5])
            pa[4 * s + 3] = pack(sacc[8 * s + 6], sacc[8 * s + 7])
        for j in range(0, O_TILES, 2):
            for s in range(P_STEPS):
                b0, b1, b2, b3 = load_b_x4_trans(vs, v_lane, 16 * s, 4 * j)
                o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3] = mma(
                    pa[4 * s], pa[4 * s + 1], pa[4 * s + 2], pa[4 * s + 3], b0, b1,
                    o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3])
                o[4 * j + 4], o[4 * j + 5], o[4 * j + 6], o[4 * j + 7] = mma(
                    pa[4 * s], pa[4 * s + 1], pa[4 * s + 2], pa[4 * s + 3], b2, b3,
                    o[4 * j + 4], o[4 * j + 5], o[4 * j + 6], o[4 * j + 7])

    @cuda.jit(device=True, inline=True)
    def rescale(o, first, alpha):
        for j in range(O_TILES):
            o[4 * j + first] *= alpha
            o[4 * j + first + 1] *= alpha

    @cuda.jit
    def flash_attention(q, k, v, out, rows, kv_len, first_position, scale_log2):
        scratch = cuda.shared.array(0, float32)  # the simulator's quad reductions
        ks = cuda.shared.array((KB, ROW_WORDS), int32, alignment=TILE_ALIGNMENT)
        vs = cuda.shared.array((KB, ROW_WORDS), int32, alignment=TILE_ALIGNMENT)
        # Shared addresses taken once: each copy and fragment load then adds a constant offset.
        ks_address = shared_address(ks, (0, 0))
        vs_address = shared_address(vs, (0, 0))
        k_lane = lane_address(ks, False)
        v_lane = lane_address(vs, True)
        qa = cuda.local.array(Q_WORDS, int32)
        sacc = cuda.local.array(S_VALUES, float32)
        pa = cuda.local.array(P_WORDS, int32)
        o = cuda.local.array(O_VALUES, float32)
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        h = cuda.blockIdx.y
        kvh = h // group
        # Causal blocks differ in work: the last query rows see the most keys. Launch them first so
        # the short blocks fill the tail of the grid.
        first_row = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * ROWS_PER_BLOCK
        r0 = first_row + (cuda.threadIdx.x // 32) * 16 + g
        r1 = r0 + 8
        p0 = first_position + r0
        p1 = first_position + r1
        load_q(q, r0, r1, h, rows, qa, t)
        for i in range(O_VALUES):
            o[i] = float32(0.0)
        # Running maxima in raw score units. Finite start: a row whose keys are all masked so far
        # keeps alpha = 1 and sum 0, not NaN.
        m0 = float32(-1e30)
        m1 = float32(-1e30)
        l0 = float32(0.0)
        l1 = float32(0.0)
        unmasked_end = first_position + first_row + 1  # keys below this are visible to every row of the block
        key_end = first_position + min(first_row + ROWS_PER_BLOCK, rows)  # the block's last row sees up to here
        # Pipeline: V of a key block lands during its Q K^T and softmax, K of the next during its P V.
        stage(k, kvh, 0, kv_len, ks, ks_address)
        for first_key in range(0, key_end, KB):
            copy_async_wait_all()
            cuda.syncthreads()  # K landed for every thread; every warp is done with the last block's V
            stage(v, kvh, first_key, kv_len, vs, vs_address)
            scores(qa, ks, k_lane, sacc)
            if first_key + KB > unmasked_end:
                mask(sacc, first_key, p0, p1, t)
            x0 = quad_max(scratch, row_max(sacc, 0, m0), 4)
            x1 = quad_max(scratch, row_max(sacc, 2, m1), 4)
            alpha0 = float32(math.exp2((m0 - x0) * scale_log2))
            alpha1 = float32(math.exp2((m1 - x1) * scale_log2))
            m0 = x0
            m1 = x1
            l0 = l0 * alpha0 + exponentiate(sacc, 0, scale_log2, m0 * scale_log2)
            l1 = l1 * alpha1 + exponentiate(sacc, 2, scale_log2, m1 * scale_log2)
            rescale(o, 0, alpha0)
            rescale(o, 2, alpha1)
            copy_async_wait_all()
            cuda.syncthreads()  # V landed for every thread; every warp is done with this block's K
            if first_key + KB < key_end:
                stage(k, kvh, first_key + KB, kv_len, ks, ks_address)
            accumulate(sacc, pa, vs, v_lane, o)
        inv_l0 = float32(1.0) / quad_sum(scratch, l0, 4)
        inv_l1 = float32(1.0) / quad_sum(scratch, l1, 4)
        for j in range(O_TILES):
            if r0 < rows:
                out[r0, h, 4 * j + t] = pack(o[4 * j] * inv_l0, o[4 * j + 1] * inv_l0)
            if r1 < rows:
                out[r1, h, 4 * j + t] = pack(o[4 * j + 2] * inv_l1, o[4 * j + 3] * inv_l1)

    return flash_attention


class FlashAttention:
    """Launcher: causal attention of one request's query chunk over its keys, bf16 (or its int16 bits).

    q, out [rows, Hq, D]; k, v [Hkv, C, D] with C >= kv_len (GatherKv's scratch; only the first
    kv_len keys are read); Hq a multiple of Hkv; D a multiple of 32; every row's heads 16-byte
    aligned (a strided q such as Qwen3.5's gated one is fine). Query row r is at position
    kv_len - rows + r and sees keys 0..kv_len - rows + r.
    """

    def __init__(self) -> None:
        self._kernels: dict[tuple[int, int], tuple[BlockShape, Kernel]] = {}

    def kernel(self, head_dim: int, group: int) -> tuple[BlockShape, Kernel]:
        """The block shape and kernel for this head size and GQA group (built once)."""
        entry = self._kernels.get((head_dim, group))
        if entry is None:
            shape = block_shape(head_dim)
            entry = self._kernels[(head_dim, group)] = (
                shape, Kernel(build_flash_attention(head_dim, shape.keys, group, shape.warps)))
        return entry

    def __call__(self, q: Any, k: Any, v: Any, out: Any, kv_len: int, stream: Any = 0) -> None:
        """Attention of the chunk's rows, the last ``rows`` of the request's ``kv_len`` tokens (query
        row r at position kv_len - rows + r), over k[:, :kv_len] and v[:, :kv_len]."""
        rows, q_heads, head_dim = q.shape
        kv_heads, capacity, _ = k.shape
        if tuple(out.shape) != tuple(q.shape) or tuple(v.shape) != tuple(k.shape) or k.shape[2] != head_dim:
            raise ValueError(f"flash attention: q {tuple(q.shape)}, out {tuple(out.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}: q and out must match, k and v must match, one head_dim")
        if head_dim % 32 or kv_heads == 0 or q_heads % kv_heads:
            raise ValueError(f"flash attention: head_dim {head_dim} must be a multiple of 32 and q heads {q_heads} "
                             f"a multiple of kv heads {kv_heads}")
        if not rows <= kv_len <= capacity:
            raise ValueError(f"flash attention: kv_len {kv_len} must hold the chunk's {rows} rows and fit the "
                             f"{capacity} keys of k and v")
        if not vector_aligned(q, k, v, out):
            raise ValueError("flash attention: every head of q, k, v and out must be 16-byte aligned and contiguous")
        if rows == 0:
            return
        shape, kernel = self.kernel(head_dim, q_heads // kv_heads)
        grid = (-(-rows // shape.rows), q_heads)
        scale_log2 = np.float32(LOG2_E / math.sqrt(head_dim))
        kernel[grid, shape.threads, stream, shape.threads * 4](
            as_words(q), as_words(k), as_words(v), as_words(out), np.int32(rows), np.int32(kv_len),
            np.int32(kv_len - rows), scale_log2)

