"""The causal softmax of GEMM prefill attention against float64 torch.softmax.

Each kernel runs at tiny K in the simulator: every register build alone (CausalSoftmax's
register_builds), up to rows that fill all its threads' groups, and the streaming kernel (no
register build). Rows of odd K start at every offset within a 16-byte chunk, of scores and of
bf16 probabilities alike.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from executor.device import open_device
from executor.kernels.attention.causal_softmax import REGISTER_BUILDS, SIMULATOR_REGISTER_BUILDS, CausalSoftmax, register_keys
from executor.kernels.primitives.codec import build_codec
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, TOL, assert_close_rel, from_storage, poisoned

HEAD_DIM = 16  # the simulator cases' scale is 1 / sqrt(HEAD_DIM)


#: (rows_per_head, first_position, num_keys, heads, group) of the softmax cases:
#: - 9 rows of 13 keys seeing 11..13: odd K puts row starts at every offset in a chunk, and the
#:   last block of 4 or 2 rows has rows past the end;
#: - 16 rows (4 query rows x a group of 2, 2 heads) seeing 1..4 of 11 keys: rows shorter than their
#:   head, and mostly masked;
#: - 6 rows (2 query rows x a group of 3) seeing 281 and 282 of 299 keys: several sweeps of the
#:   streaming kernel's loops.
SOFTMAX_CASES = [(3, 10, 13, 3, 1), (4, 0, 11, 2, 2), (2, 280, 299, 1, 3)]


def _aligned(shape: tuple[int, ...], dtype: np.dtype, offset_bytes: int = 0) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts ``offset_bytes`` past a 16-byte boundary."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + 32, np.uint8)
    start = -buffer.ctypes.data % 16 + offset_bytes
    return buffer[start: start + nbytes].view(dtype).reshape(shape)


def _softmax_matches_float64(softmax: CausalSoftmax, dtype_name: str, rows_per_head: int, first_position: int,
                             num_keys: int, heads: int, group: int = 1, offset_bytes: int = 0, seed: int = 1) -> None:
    """softmax of random scores (arrays ``offset_bytes`` past 16-byte boundaries) against float64:
    within the dtype's tolerance, exactly 0 past each row's position, every element written."""
    generator = torch.Generator().manual_seed(seed)
    rows = heads * rows_per_head * group
    values = torch.randn(rows, num_keys, generator=generator) * 4
    scores = _aligned((rows, num_keys), np.float32, offset_bytes)
    scores[:] = values.numpy()
    poison = poisoned((rows, num_keys), dtype_name)
    probs = _aligned((rows, num_keys), poison.dtype, offset_bytes)
    probs[:] = poison
    scale = 1 / math.sqrt(HEAD_DIM)
    softmax(scores, probs, rows_per_head, first_position, scale, group=group)
    visible = first_position + torch.arange(rows) // group % rows_per_head + 1
    masked = torch.arange(num_keys)[None, :] >= visible[:, None]
    reference = (values.double() * scale).masked_fill(masked, -math.inf).softmax(-1)
    got = from_storage(probs, dtype_name)
    assert_close_rel(got, reference, TOL[dtype_name])
    assert (got[masked] == 0).all()


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_softmax_matches_float64(dtype_name):
    """The default builds: the register kernel at 4 rows a block."""
    softmax = CausalSoftmax(build_codec(dtype_name))
    assert softmax.register_build(9) == SIMULATOR_REGISTER_BUILDS[0]
    assert softmax.uses_vector(_aligned((9, 9), np.float32), _aligned((9, 9), np.int16))
    _softmax_matches_float64(softmax, dtype_name, 3, 6, 9, 3)  # rows see 7, 8, 9 keys


@pytest.mark.parametrize("build", [*SIMULATOR_REGISTER_BUILDS, None])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_softmax_kernels_match_float64(dtype_name, build):
    """Each register build alone on the cases it holds, the last filling every group of its threads
    (nearly its most keys), and the streaming kernel (build None) on them all."""
    softmax = CausalSoftmax(build_codec(dtype_name), register_builds=() if build is None else (build,))
    most_keys = 299 if build is None else register_keys(*build)
    cases = [case for case in SOFTMAX_CASES if case[2] <= most_keys] + [(2, most_keys - 5, most_keys - 3, 2, 2)]
    for rows_per_head, first_position, num_keys, heads, group in cases:
        assert softmax.register_build(num_keys) == build
        _softmax_matches_float64(softmax, dtype_name, rows_per_head, first_position, num_keys, heads, group)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_softmax_without_16_byte_alignment_runs_scalar(dtype_name):
    """Base addresses off a 16-byte boundary, or rows not contiguous: the streaming kernel one score at
    a time (the simulator's vector accesses would fail on a misaligned address)."""
    softmax = CausalSoftmax(build_codec(dtype_name))
    assert not softmax.uses_vector(_aligned((4, 8), np.float32, 4), _aligned((4, 8), np.int16))
    assert not softmax.uses_vector(_aligned((4, 8), np.float32), _aligned((4, 8), np.int16, 2))
    assert not softmax.uses_vector(_aligned((4, 16), np.float32)[:, :8], _aligned((4, 8), np.int16))
    _softmax_matches_float64(softmax, dtype_name, 3, 10, 13, 3, group=2, offset_bytes=4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_keys, build", [(1000, 0), (2001, 1), (4093, 2), (8190, 3), (9000, None)])
def test_causal_softmax_matches_float64_on_gpu(num_keys, build):
    """bf16 on the H200 with the default builds: 2 kv heads of 64 query rows x a group of 4 (Qwen3-8B's)
    ending at key num_keys run each register build (rows of up to 1024, 2048, 4096 and 8192 keys), and
    past them the streaming one."""
    device = open_device("cuda")
    softmax = CausalSoftmax(build_codec("bfloat16"))
    assert softmax.register_build(num_keys) == (None if build is None else REGISTER_BUILDS[build])
    rows_per_head, heads, group = 64, 2, 4
    rows = heads * rows_per_head * group
    first_position = num_keys - rows_per_head
    values = torch.randn(rows, num_keys, generator=torch.Generator().manual_seed(4)) * 4
    scores = values.to(device.torch_device)
    probs = torch.full(scores.shape, float("nan"), dtype=torch.bfloat16, device=device.torch_device)
    assert softmax.uses_vector(scores, probs)
    scale = 1 / math.sqrt(128)
    softmax(scores, probs, rows_per_head, first_position, scale, group=group, stream=device.current_stream())
    device.synchronize()
    visible = first_position + torch.arange(rows) // group % rows_per_head + 1
    masked = torch.arange(num_keys)[None, :] >= visible[:, None]
    reference = (values.double() * scale).masked_fill(masked, -math.inf).softmax(-1)
    got = probs.cpu().double()
    assert_close_rel(got, reference, TOL["bfloat16"])
    assert (got[masked] == 0).all()


def test_causal_softmax_rejects_a_build_off_the_warp():
    with pytest.raises(ValueError, match="6 threads and 1 rows"):
        CausalSoftmax(build_codec("float32"), register_builds=((6, 1),))


@pytest.mark.ptx
def test_compiles_for_sm90():
    """Every build, both codecs, with float32 math only; the vector builds with 16-byte global loads and
    stores and no local memory (their chunk buffers in registers)."""
    compile_for_sm90(
        """
        from executor.kernels.attention.causal_softmax import (
            REGISTER_BUILDS, SOFTMAX_THREADS, SOFTMAX_WARP, STREAMING_ROWS_PER_BLOCK, build_register_softmax,
            build_streaming_softmax,
        )
        for name in DTYPES:
            codec = build_codec(name)
            args = (arr("float32", 2), arr(name, 2), types.int32, types.int32, types.int32, types.float32)
            for threads, rows in REGISTER_BUILDS:
                vector_ptx(build_register_softmax(codec, threads, rows, SOFTMAX_WARP), *args)
            for vector in (True, False):
                build = build_streaming_softmax(codec, SOFTMAX_THREADS, STREAMING_ROWS_PER_BLOCK, SOFTMAX_WARP, vector)
                (vector_ptx if vector else ptx)(build, *args)
        """
    )
