"""The tensor-core tile and the bf16x2 pack: the simulator's emulation here, the hardware on the GPU,
both against float64 and torch's bf16 cast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.async_copy import build_async_copy, build_shared_address
from executor.kernels.primitives.mma import build_fragment_loads, build_mma_bf16, build_pack_bf16x2
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90

cuda = load_cuda()


def build_tiles_kernel():
    """Kernel ``(a_words [W, 16, 8], bt_words [W, 8, 8], c [W, 16, 8], d [W, 16, 8])``: warp w computes
    d[w] = A_w @ B_w + c[w]; A row-major and B stored transposed (B^T row-major), two bf16 a word."""
    mma = build_mma_bf16()

    @cuda.jit
    def tiles(a_words, bt_words, c, d):
        w = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        d0, d1, d2, d3 = mma(a_words[w, g, t], a_words[w, g + 8, t], a_words[w, g, t + 4], a_words[w, g + 8, t + 4],
                             bt_words[w, g, t], bt_words[w, g, t + 4],
                             c[w, g, 2 * t], c[w, g, 2 * t + 1], c[w, g + 8, 2 * t], c[w, g + 8, 2 * t + 1])
        d[w, g, 2 * t] = d0
        d[w, g, 2 * t + 1] = d1
        d[w, g + 8, 2 * t] = d2
        d[w, g + 8, 2 * t + 1] = d3

    return tiles


def build_pack_kernel():
    pack = build_pack_bf16x2()

    @cuda.jit
    def pack_all(low, high, words):
        i = cuda.grid(1)
        if i < words.shape[0]:
            words[i] = pack(low[i], high[i])

    return pack_all


def build_fragment_kernel():
    """Kernel ``(src [16, 20] int32, valid_rows, plain [32, 4], transposed [32, 4])``: one warp stages
    src's first valid_rows rows (zeros after) into a shared tile by cp.async, then each lane
    stores what load_b_x4(tile, 8, 4) and load_b_x4_trans(tile, 0, 8) dealt it."""
    lane_address, load_b_x4, load_b_x4_trans = build_fragment_loads()
    copy_async, copy_async_wait_all = build_async_copy()
    shared_address = build_shared_address()
    alignment = None if simulator_enabled() else 16

    @cuda.jit
    def fragments(src, valid_rows, plain, transposed):
        tile = cuda.shared.array((16, 20), np.int32, alignment=alignment)
        lane = cuda.threadIdx.x
        tile_address = shared_address(tile, (0, 0))
        for chunk in range(lane, 16 * 5, 32):
            row, col = chunk // 5, (chunk % 5) * 4
            valid = row < valid_rows
            copy_async(tile, tile_address, (row, col), src, (row if valid else 0, col), valid)
        copy_async_wait_all()
        cuda.syncthreads()
        plain[lane, 0], plain[lane, 1], plain[lane, 2], plain[lane, 3] = load_b_x4(tile, lane_address(tile, False), 8, 4)
        r0, r1, r2, r3 = load_b_x4_trans(tile, lane_address(tile, True), 0, 8)
        transposed[lane, 0], transposed[lane, 1], transposed[lane, 2], transposed[lane, 3] = r0, r1, r2, r3

    return fragments


def test_fragment_loads_deal_ldmatrix_fragments_from_an_async_staged_tile():
    """Expected values from the bf16 matrix (the tile as [16, 40] bf16), not from the words: lane
    (g, t) gets row g of a matrix at bf16 columns 2t, 2t + 1 (plain) or column g at rows 2t, 2t + 1
    (transposed). Rows 12.. were not valid: cp.async must zero them."""
    rng = np.random.default_rng(5)
    src = rng.integers(-2**31, 2**31, size=(16, 20), dtype=np.int64).astype(np.int32)
    plain = np.zeros((32, 4), np.int32)
    transposed = np.zeros((32, 4), np.int32)
    build_fragment_kernel()[1, 32](src, 12, plain, transposed)
    tile = src.copy()
    tile[12:] = 0
    halves = tile.view(np.uint16).astype(np.uint32)  # [16, 40]: little-endian, a word's low half first
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for m in range(4):
        row, col = 8 + g, 8 + 8 * m + 2 * t  # words 4.. are bf16 columns 8..
        expected = (halves[row, col] | halves[row, col + 1] << 16).astype(np.uint32).view(np.int32)
        np.testing.assert_array_equal(plain[:, m], expected, err_msg=f"plain register {m}")
        row, col = 8 * (m % 2) + 2 * t, 16 + 8 * (m // 2) + g  # words 8.. are bf16 columns 16..
        expected = (halves[row, col] | halves[row + 1, col] << 16).astype(np.uint32).view(np.int32)
        np.testing.assert_array_equal(transposed[:, m], expected, err_msg=f"transposed register {m}")


def test_mma_tiles_of_two_warps_match_float64():
    """Two warps, each its own tile: a lane that reads another lane's fragment, or a warp another
    warp's, gives a wrong tile."""
    gen = torch.Generator().manual_seed(3)
    warps = 2
    a = torch.randn(warps, 16, 16, generator=gen).bfloat16()
    b = torch.randn(warps, 16, 8, generator=gen).bfloat16()
    c = torch.randn(warps, 16, 8, generator=gen)
    a_words = a.view(torch.int16).numpy().copy().view(np.int32)
    bt_words = b.transpose(1, 2).contiguous().view(torch.int16).numpy().copy().view(np.int32)
    d = np.zeros((warps, 16, 8), np.float32)
    build_tiles_kernel()[1, 32 * warps](a_words, bt_words, c.numpy(), d)
    expected = (a.double() @ b.double() + c.double()).numpy()
    np.testing.assert_allclose(d, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_pack_rounds_both_halves_like_torch():
    rng = np.random.default_rng(4)
    low = (rng.standard_normal(1000) * 10).astype(np.float32)
    high = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
    words = np.zeros(1000, np.int32)
    build_pack_kernel()[8, 128](low, high, words)
    bits = words.view(np.uint32)
    np.testing.assert_array_equal((bits & 0xFFFF).astype(np.uint16), torch.from_numpy(low).bfloat16().view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal((bits >> 16).astype(np.uint16), torch.from_numpy(high).bfloat16().view(torch.int16).numpy().view(np.uint16))


@pytest.mark.ptx
def test_tensor_core_building_blocks_are_single_instructions_on_sm90():
    compile_for_sm90(
        """
        from tests.kernels.test_mma import build_pack_kernel, build_tiles_kernel
        text = ptx(build_tiles_kernel(), arr("int32", 3), arr("int32", 3), arr("float32", 3), arr("float32", 3))
        assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 1, "no tensor-core MMA in PTX"
        text = ptx(build_pack_kernel(), arr("float32", 1), arr("float32", 1), arr("int32", 1))
        assert "cvt.rn.bf16x2.f32" in text, "no packed conversion in PTX"
        from tests.kernels.test_mma import build_fragment_kernel
        text = ptx(build_fragment_kernel(), arr("int32", 2), types.int64, arr("int32", 2), arr("int32", 2))
        assert text.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 1, "no plain ldmatrix in PTX"
        assert text.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 1, "no transposed ldmatrix in PTX"
        assert "cp.async.cg.shared.global" in text and "cp.async.wait_all" in text, "no cp.async in PTX"
        """
    )
