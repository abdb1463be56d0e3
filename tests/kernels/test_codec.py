"""The storage codecs' element conversions against torch's casts, bit for bit.

The same test runs the simulator's integer rounding here and the hardware's
``cvt.rn.bf16.f32`` on the GPU (the codec picks by where it runs); a store that
rounds ties away from zero, truncates, or mishandles subnormals, overflow or
infinities fails it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90

cuda = load_cuda()
THREADS = 64


def build_round_trip(codec):
    """Kernel ``(values f32 [n], stored [n], loaded f32 [n])``: stored = store(values), loaded = load(stored)."""
    load, store = codec.load, codec.store

    @cuda.jit
    def round_trip(values, stored, loaded):
        for i in range(cuda.grid(1), values.shape[0], cuda.gridsize(1)):
            bits = store(values[i])
            stored[i] = bits
            loaded[i] = load(bits)

    return round_trip


def float32_cases(count: int) -> np.ndarray:
    """Random float32 bit patterns over every exponent (NaNs dropped), then the edge values:
    exact ties below both bf16 parities, subnormals, the largest finite float32 (which rounds to
    infinity), the largest value that does not, and signed zeros and infinities."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, size=count, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=256, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    edges = np.array([0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7F7FFF,
                      0x7F7F8000, 0x3F808000, 0x3F818000, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000],
                     dtype=np.uint32)
    every = np.concatenate([bits, ties, ties | 0x80000000, edges, edges | 0x80000000]).view(np.float32)
    return every[~np.isnan(every)]


def test_bf16_store_and_load_match_torch():
    values = float32_cases(4096 if simulator_enabled() else 1 << 20)
    stored = np.zeros(values.shape, np.int16)
    loaded = np.zeros(values.shape, np.float32)
    build_round_trip(build_codec("bfloat16"))[8, THREADS](values, stored, loaded)
    expected = torch.from_numpy(values).to(torch.bfloat16)
    np.testing.assert_array_equal(stored, expected.view(torch.int16).numpy())
    np.testing.assert_array_equal(loaded, expected.to(torch.float32).numpy())


def test_f32_codec_is_the_identity():
    values = float32_cases(256)
    stored = np.zeros(values.shape, np.float32)
    loaded = np.zeros(values.shape, np.float32)
    build_round_trip(build_codec("float32"))[2, THREADS](values, stored, loaded)
    np.testing.assert_array_equal(stored.view(np.uint32), values.view(np.uint32))
    np.testing.assert_array_equal(loaded.view(np.uint32), values.view(np.uint32))


@pytest.mark.ptx
def test_bf16_store_is_one_conversion_on_sm90():
    """The GPU store is the hardware conversion, not the simulator's integer rounding."""
    compile_for_sm90(
        """
        from tests.kernels.test_codec import build_round_trip
        text = ptx(build_round_trip(build_codec("bfloat16")), arr("float32", 1), arr("bfloat16", 1), arr("float32", 1))
        assert "cvt.rn.bf16.f32" in text, "no hardware bf16 conversion in PTX"
        assert "32767" not in text and "0x7FFF" not in text.upper().replace("0X", "0x"), "integer rounding left in PTX"
        """
    )
