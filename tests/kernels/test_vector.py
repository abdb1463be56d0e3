"""16-byte vector access (executor/kernels/primitives/vector.py): host alignment checks, lanes, the simulator's
emulation, and the sm_90 intrinsics' PTX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.primitives.vector import VECTOR_BYTES, VECTOR_WORDS, array_layout, lanes_for, vector_aligned
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.lane_copy import build_lane_copy
from tests.kernels.storage import DTYPES, to_storage

cuda = load_cuda()


def at_offset(shape: tuple[int, ...], dtype: np.dtype, offset_bytes: int) -> np.ndarray:
    """A C-contiguous array whose data address is ``offset_bytes`` past a multiple of 16."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + 2 * VECTOR_BYTES, dtype=np.uint8)
    start = (-raw.ctypes.data) % VECTOR_BYTES + offset_bytes
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def test_vector_aligned_layouts():
    base = at_offset((4, 16), np.float32, 0)
    assert vector_aligned(base)
    assert vector_aligned(base[1:3])  # row views keep 64-byte row steps
    assert vector_aligned(base[:, 4:12])  # starts on a chunk, 32-byte rows within 64-byte steps
    assert not vector_aligned(base[:, 1:9])  # starts 4 bytes into a chunk
    assert not vector_aligned(base[:, :6])  # 24-byte rows: not whole chunks
    assert not vector_aligned(base[:, ::2])  # the last axis is not contiguous
    assert not vector_aligned(at_offset((4, 16), np.float32, 4))
    odd_steps = at_offset((4, 10), np.float32, 0)[:, :8]  # 40-byte row steps
    assert not vector_aligned(odd_steps)
    assert vector_aligned(odd_steps[:1])  # one row is never stepped over
    assert vector_aligned(at_offset((3, 2, 8), np.int16, 0))
    assert not vector_aligned(at_offset((3, 2, 4), np.int16, 0))  # 8-byte heads
    assert not vector_aligned(base, at_offset((4, 16), np.float32, 8))  # every array must qualify
    assert not vector_aligned(np.zeros((), np.float32))


def test_torch_tensors_get_the_same_answers_as_their_numpy_views():
    """The checks read torch tensors directly (a launch's fast path): on the views of
    test_vector_aligned_layouts and a few more, as tensors, they answer as on the numpy arrays."""
    from executor.kernels.primitives.vector import contiguous_aligned

    base = at_offset((4, 16), np.float32, 0)
    views = [base, base[1:3], base[:, 4:12], base[:, 1:9], base[:, :6], base[:, ::2], base[::2], base.T,
             at_offset((4, 16), np.float32, 4), at_offset((4, 10), np.float32, 0)[:, :8],
             at_offset((4, 10), np.float32, 0)[:1, :8], at_offset((3, 2, 8), np.int16, 0),
             at_offset((3, 2, 4), np.int16, 0), at_offset((3, 2, 8), np.int16, 0)[:, :1], np.zeros((), np.float32),
             at_offset((0, 8), np.float32, 0)]
    for index, view in enumerate(views):
        tensor = torch.from_numpy(view)
        assert vector_aligned(tensor) == vector_aligned(view), index
        assert contiguous_aligned(tensor) == contiguous_aligned(view), index


def test_array_layout_of_torch_and_device_arrays():
    t = torch.zeros(5, 24, dtype=torch.bfloat16)
    view = t.view(torch.int16)[1:4, 8:]
    layout = array_layout(view)
    assert layout.shape == (3, 16)
    assert layout.strides_bytes == (48, 2)
    assert layout.address == t.data_ptr() + 48 + 16
    assert vector_aligned(view) == (t.data_ptr() % VECTOR_BYTES == 0)
    dev = cuda.to_device(at_offset((2, 8), np.float32, 0))
    assert array_layout(dev).shape == (2, 8)
    assert array_layout(dev).strides_bytes == (32, 4)


def test_lanes_per_chunk():
    assert lanes_for(build_codec("float32")) == 4
    assert lanes_for(build_codec("bfloat16")) == 8
    assert VECTOR_WORDS * 4 == VECTOR_BYTES


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_lanes_round_trip(dtype_name):
    gen = torch.Generator().manual_seed(61)
    values = torch.randn(2, 16, generator=gen) * 100
    values[0, :4] = torch.tensor([-0.0, float("inf"), -3.0e38, 1e-40])  # sign bits, extremes, subnormal
    src = at_offset((2, 16), np.dtype(np.float32 if dtype_name == "float32" else np.int16), 0)
    src[...] = to_storage(values, dtype_name)
    dst = cuda.to_device(np.zeros_like(src))
    lanes = lanes_for(build_codec(dtype_name))
    build_lane_copy(dtype_name)[2, 16 // lanes](cuda.to_device(src), dst)
    np.testing.assert_array_equal(dst.copy_to_host().view(np.uint8), src.view(np.uint8))


@pytest.mark.skipif(not simulator_enabled(), reason="the simulator's emulation checks alignment")
def test_simulated_vector_access_rejects_misaligned_chunks():
    kernel = build_lane_copy("float32")
    src = cuda.to_device(at_offset((1, 12), np.float32, 0))
    with pytest.raises(AssertionError, match="misaligned"):
        kernel[1, 2](src[:, 1:9], cuda.to_device(at_offset((1, 8), np.float32, 0)))


@pytest.mark.ptx
def test_intrinsics_compile_to_16_byte_accesses():
    """One 16-byte load and store per chunk, in registers (no local memory), for both codecs."""
    compile_for_sm90(
        """
        from tests.kernels.lane_copy import build_lane_copy
        for name in DTYPES:
            vector_ptx(build_lane_copy(name), arr(name, 2), arr(name, 2))
        """
    )
