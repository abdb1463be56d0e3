"""The online softmax of a tensor-core attention block, on a lane's accumulator fragments.

Both FlashAttention kernels (flash.py on ``mma.sync``, flash_wgmma.py on warpgroup products) hold a
lane's scores and output in the accumulator layout of primitives/mma.py, per 16-row m-tile: for
n-tile j (8 columns), values 4 j, 4 j + 1 are row g's columns 8 j + 2 t, + 1 and values 4 j + 2,
4 j + 3 row g + 8's. ``build_online_softmax(s_tiles, o_tiles, m_tiles)`` gives, for ``m_tiles``
m-tiles of ``s_tiles`` score n-tiles and ``o_tiles`` output n-tiles a lane (row state r: m-tile
r // 2, row g + 8 (r % 2)):

    mask(sacc, tile, first_key, p0, p1, t)
        m-tile ``tile``'s scores of keys after a row's position (p0 for row g, p1 for g + 8) to -inf. A
        stored row's position is below kv_len, so this also drops the zero-filled keys past it.
    softmax_update(scratch, sacc, row_maxima, row_sums, alphas, scale_log2)
        one key block: new row maxima (over the row's quad), S <- P = 2^((s - max) scale_log2) in
        place, sums rescaled and grown, alphas[r] = the factor for row state r's O.
    rescale_output(o, alphas)
        O's rows whose maximum grew times their alpha (alpha = 1 exactly otherwise: skipped).
    pack_probabilities(sacc, pa, s, first)
        pa[first + 4 i .. first + 4 i + 3] <- m-tile i's P of k-step s (16 keys) as bf16 A fragments.
    store_output(scratch, o, row_sums, out, q_start, first_row, warp_row, rows, h, g, t)
        out rows (bf16 words) <- O / row sum, rows below ``rows`` only.

Scores stay raw until the exponent: 2^(s * scale_log2 - max * scale_log2) is one FMA and one
ex2.approx.ftz (primitives/fast_math.py). A key block's update is one straight run over all the
lane's rows (independent chains the scheduler interleaves).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from executor.kernels.primitives.fast_math import build_exp2_scaled
from executor.kernels.primitives.mma import build_pack_bf16x2
from executor.kernels.primitives.reduce import build_group_max, build_group_sum
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)


class OnlineSoftmax(NamedTuple):
    mask: Any
    softmax_update: Any
    rescale_output: Any
    pack_probabilities: Any
    store_output: Any


def build_online_softmax(s_tiles: int, o_tiles: int, m_tiles: int) -> OnlineSoftmax:
    """The device functions of the module docstring for this fragment shape."""
    S_TILES, O_TILES, M = s_tiles, o_tiles, m_tiles
    S_VALUES, O_VALUES, ROW_STATES = 4 * S_TILES, 4 * O_TILES, 2 * M
    exp2_scaled = build_exp2_scaled()
    pack = build_pack_bf16x2()
    quad_max = build_group_max()
    quad_sum = build_group_sum()

    @cuda.jit(device=True, inline=True)
    def mask(sacc, tile, first_key, p0, p1, t):
        for j in range(S_TILES):
            c = tile * S_VALUES + 4 * j
            key = first_key + 8 * j + 2 * t
            if key > p0:
                sacc[c] = -math.inf
            if key + 1 > p0:
                sacc[c + 1] = -math.inf
            if key > p1:
                sacc[c + 2] = -math.inf
            if key + 1 > p1:
                sacc[c + 3] = -math.inf

    @cuda.jit(device=True, inline=True)
    def row_max(sacc, first, start):
        """The row's maximum over its S values and ``start``. first: an m-tile's S values at 0, + 0 for
        row g (values 0, 1 of each n-tile), + 2 for row g + 8. Two chains, half as long as one."""
        even, odd = start, start
        for j in range(S_TILES):
            even = max(even, sacc[first + 4 * j])
            odd = max(odd, sacc[first + 4 * j + 1])
        return max(even, odd)

    @cuda.jit(device=True, inline=True)
    def exponentiate(sacc, first, scale_log2, max_log2):
        """p = 2^(score * scale_log2 - max_log2), one FMA and one ex2 a score; returns the row's partial
        sum (two chains)."""
        even, odd = float32(0.0), float32(0.0)
        for j in range(S_TILES):
            p0 = exp2_scaled(sacc[first + 4 * j], scale_log2, max_log2)
            p1 = exp2_scaled(sacc[first + 4 * j + 1], scale_log2, max_log2)
            sacc[first + 4 * j], sacc[first + 4 * j + 1] = p0, p1
            even += p0
            odd += p1
        return even + odd

    @cuda.jit(device=True, inline=True)
    def softmax_update(scratch, sacc, row_maxima, row_sums, alphas, scale_log2):
        best = cuda.local.array(ROW_STATES, float32)
        for r in range(ROW_STATES):
            best[r] = row_max(sacc, (r // 2) * S_VALUES + 2 * (r % 2), row_maxima[r])
        for r in range(ROW_STATES):
            best[r] = quad_max(scratch, best[r], 4)
        for r in range(ROW_STATES):
            alphas[r] = float32(math.exp2((row_maxima[r] - best[r]) * scale_log2))
            row_maxima[r] = best[r]
            total = exponentiate(sacc, (r // 2) * S_VALUES + 2 * (r % 2), scale_log2, best[r] * scale_log2)
            row_sums[r] = row_sums[r] * alphas[r] + total

    @cuda.jit(device=True, inline=True)
    def rescale(o, first, alpha):
        # first: an m-tile's O values at 0, + 0 for row g, + 2 for row g + 8
        for j in range(O_TILES):
            o[first + 4 * j] *= alpha
            o[first + 4 * j + 1] *= alpha

    @cuda.jit(device=True, inline=True)
    def rescale_output(o, alphas):
        for r in range(ROW_STATES):
            if alphas[r] != float32(1.0):  # the row's maximum grew: rare once a few key blocks are in
                rescale(o, (r // 2) * O_VALUES + 2 * (r % 2), alphas[r])

    @cuda.jit(device=True, inline=True)
    def pack_probabilities(sacc, pa, s, first):
        for i in range(M):
            c = i * S_VALUES + 8 * s
            pa[first + 4 * i] = pack(sacc[c], sacc[c + 1])
            pa[first + 4 * i + 1] = pack(sacc[c + 2], sacc[c + 3])
            pa[first + 4 * i + 2] = pack(sacc[c + 4], sacc[c + 5])
            pa[first + 4 * i + 3] = pack(sacc[c + 6], sacc[c + 7])

    @cuda.jit(device=True, inline=True)
    def store_output(scratch, o, row_sums, out, q_start, first_row, warp_row, rows, h, g, t):
        for r in range(ROW_STATES):
            inv_sum = float32(1.0) / quad_sum(scratch, row_sums[r], 4)
            row = first_row + warp_row + 16 * (r // 2) + 8 * (r % 2) + g
            c = (r // 2) * O_VALUES + 2 * (r % 2)
            if row < rows:
                for j in range(O_TILES):
                    out[q_start + row, h, 4 * j + t] = pack(o[c + 4 * j] * inv_sum, o[c + 4 * j + 1] * inv_sum)

    return OnlineSoftmax(mask, softmax_update, rescale_output, pack_probabilities, store_output)
