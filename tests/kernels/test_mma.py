"""The tensor-core tile and the bf16x2 pack: the simulator's emulation here, the hardware on the GPU,
both against float64 and torch's bf16 cast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.mma import build_mma_bf16, build_pack_bf16x2
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


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
def test_mma_and_pack_are_single_instructions_on_sm90():
    compile_for_sm90(
        """
        from tests.kernels.test_mma import build_pack_kernel, build_tiles_kernel
        text = ptx(build_tiles_kernel(), arr("int32", 3), arr("int32", 3), arr("float32", 3), arr("float32", 3))
        assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 1, "no tensor-core MMA in PTX"
        text = ptx(build_pack_kernel(), arr("float32", 1), arr("float32", 1), arr("int32", 1))
        assert "cvt.rn.bf16x2.f32" in text, "no packed conversion in PTX"
        """
    )
