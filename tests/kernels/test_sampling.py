"""argmax over float32 logits rows against torch.argmax (simulator at tiny shapes; GPU at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.argmax import Argmax
from tests.kernels.compile_check import compile_for_sm90

SIM_THREADS = 32  # rows wider than the block exercise the stride loop and the tree


def run_argmax(logits: np.ndarray, max_threads: int = SIM_THREADS) -> np.ndarray:
    out = np.full(logits.shape[0], -7, dtype=np.int32)  # poison: not a valid index
    Argmax(max_threads)(logits, out)
    return out


def test_argmax_random_rows():
    gen = torch.Generator().manual_seed(11)
    big = torch.randn(5, 300, generator=gen)  # two full tiles of 4 x 32 logits per thread, then a ragged end
    logits = big.numpy()[1:4]  # a row-sliced view of a bigger buffer
    np.testing.assert_array_equal(run_argmax(logits), torch.argmax(big[1:4], dim=-1).numpy())


def test_argmax_ties_pick_the_first_index():
    logits = np.zeros((4, 70), dtype=np.float32)
    logits[0, [40, 9, 69]] = 3.0  # threads 8, 9, 5: the lower thread holds the higher index
    logits[1, [33, 1]] = 2.0  # same thread (1), the first pass holds the lower index
    logits[2, :] = -np.inf  # all -inf: index 0
    logits[3, [64, 32]] = 1.0  # same thread (0), second pass of its stride loop loses
    np.testing.assert_array_equal(run_argmax(logits), torch.argmax(torch.from_numpy(logits), dim=-1).numpy())
    assert list(run_argmax(logits)) == [9, 1, 0, 32]


def test_argmax_ties_across_full_tiles():
    logits = np.zeros((2, 260), dtype=np.float32)
    logits[0, [200, 40, 9, 150]] = 5.0  # tile 1; tile 0 thread 8 second load; thread 9 first load; tile 1
    logits[1, [255, 130]] = -0.5  # all others are 0: the first 0 (index 0) wins
    logits[1, 0] = -1.0
    assert list(run_argmax(logits)) == [9, 1]


def test_argmax_nan_is_the_maximum():
    logits = np.zeros((2, 50), dtype=np.float32)
    logits[0, [3, 40]] = [np.inf, np.nan]
    logits[1, [45, 9, 20]] = [np.nan, np.nan, 9.0]
    np.testing.assert_array_equal(run_argmax(logits), torch.argmax(torch.from_numpy(logits), dim=-1).numpy())


def test_argmax_row_narrower_than_block():
    logits = np.array([[0.5, 2.0, -1.0], [1.0, 1.0, 1.0]], dtype=np.float32)
    assert list(run_argmax(logits, max_threads=64)) == [1, 0]


def test_argmax_shape_errors():
    with pytest.raises(ValueError, match="out_ids"):
        Argmax(SIM_THREADS)(np.zeros((2, 8), np.float32), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="power of two"):
        Argmax(48)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from tests.kernels.argmax import build_argmax_kernel
        ptx(build_argmax_kernel(), arr("float32", 2), arr("int32", 1))
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (64, 248320), (7, 1000)])
def test_gpu_argmax(rows, vocab):
    gen = torch.Generator(device="cuda").manual_seed(12)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen)
    logits[0, vocab // 3] = logits[0, 2 * vocab // 3] = 100.0  # a tie across blocks of threads
    out = torch.full((rows,), -7, dtype=torch.int32, device="cuda")
    Argmax()(logits, out)
    torch.cuda.synchronize()
    assert torch.equal(out.long(), torch.argmax(logits, dim=-1))
