"""Embedding gather against torch indexing (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.rows.embedding import Embedding, build_embedding_vector_kernel
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, from_storage, poisoned, to_storage

SIM_THREADS = 32  # rows wider than the block exercise the column stride loop
NO_PREVIOUS = np.zeros(0, dtype=np.int32)  # no previous step: no id may name one of its rows


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_embedding_gathers_rows_bit_exact(dtype_name):
    gen = torch.Generator().manual_seed(51)
    vocab, hidden = 11, 168  # a full tile of 4 x 32 columns per thread, then a ragged end
    table = to_storage(torch.randn(vocab, hidden, generator=gen), dtype_name)
    ids_full = np.array([9, 0, 10, 3, 3, 5], dtype=np.int32)
    out_full = poisoned((8, hidden), dtype_name)
    out = out_full[2:7]  # a row-sliced view of a bigger buffer
    emb = Embedding(build_codec(dtype_name), SIM_THREADS)
    assert emb.uses_vector(table, out)
    emb(ids_full[1:], table, out, NO_PREVIOUS)
    np.testing.assert_array_equal(out_full[2:7], table[ids_full[1:]])
    np.testing.assert_array_equal(out_full[[0, 1, 7]], poisoned((3, hidden), dtype_name))  # untouched


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_embedding_out_of_range_id_gives_nan_row(dtype_name):
    table = to_storage(torch.ones(4, 8), dtype_name)
    out = to_storage(torch.zeros(3, 8), dtype_name)
    Embedding(build_codec(dtype_name), SIM_THREADS)(np.array([1, 4, -1], dtype=np.int32), table, out, NO_PREVIOUS)
    values = from_storage(out, dtype_name)
    assert (values[0] == 1.0).all()
    assert torch.isnan(values[1:]).all()


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_vector_kernel_tiles_and_poison(dtype_name):
    """The vector kernel on 2 column blocks of 4 threads (several tiles per row, ragged last one),
    out-of-range ids included: the same bits as the scalar kernel."""
    gen = torch.Generator().manual_seed(53)
    table = to_storage(torch.randn(6, 168, generator=gen), dtype_name)
    ids = np.array([5, -1, 0, 6, 2], dtype=np.int32)
    scalar = poisoned((5, 168), dtype_name)
    Embedding(build_codec(dtype_name), SIM_THREADS, vectorize=False)(ids, table, scalar, NO_PREVIOUS)
    out = load_cuda().to_device(poisoned((5, 168), dtype_name))
    build_embedding_vector_kernel(build_codec(dtype_name))[(5, 2), 4](ids, table, out, NO_PREVIOUS, np.int32(0),
                                                                        np.int32(6))
    np.testing.assert_array_equal(out.copy_to_host(), scalar)
    assert torch.isnan(from_storage(scalar[[1, 3]], dtype_name)).all()


def test_unaligned_width_falls_back_to_scalar():
    table = to_storage(torch.randn(4, 12), "bfloat16")  # 24-byte rows: not whole 16-byte chunks
    out = poisoned((2, 12), "bfloat16")
    emb = Embedding(build_codec("bfloat16"), SIM_THREADS)
    assert not emb.uses_vector(table, out)
    emb(np.array([3, 1], dtype=np.int32), table, out, NO_PREVIOUS)
    np.testing.assert_array_equal(out, table[[3, 1]])


@pytest.mark.parametrize("vectorize", [True, False])
def test_negative_ids_name_the_previous_steps_samples(vectorize):
    """-(r + 1) reads row r of previous_ids (the overlapped engine's decode tokens); a row past it, or a
    previous id outside the vocabulary, gives the NaN row."""
    gen = torch.Generator().manual_seed(54)
    table = to_storage(torch.randn(7, 168, generator=gen), "bfloat16")
    previous = np.array([6, 2, 9], dtype=np.int32)  # 9: outside the 7-row table
    ids = np.array([-2, 4, -1, -4, -3], dtype=np.int32)  # previous[1], 4, previous[0], past the rows, previous[2]
    out = poisoned((5, 168), "bfloat16")
    Embedding(build_codec("bfloat16"), SIM_THREADS, vectorize=vectorize)(ids, table, out, previous)
    np.testing.assert_array_equal(out[:3], table[[2, 4, 6]])
    assert torch.isnan(from_storage(out[3:], "bfloat16")).all()


@pytest.mark.parametrize("vectorize", [True, False])
def test_vocab_shard_gives_zero_rows_for_other_ranks_ids(vectorize):
    """A padded vocab shard (ids 8 .. 11 of a 10-id vocabulary in a 4-row table, rows 2 and 3 padding):
    its ids copy their rows, the vocabulary's other ids give zero rows (another rank holds them), ids
    past the vocabulary (the padding's 10, 11 and beyond) NaN rows. Rows summed over the shards are
    the whole table's lookup."""
    gen = torch.Generator().manual_seed(55)
    full = torch.randn(12, 168, generator=gen)
    full[10:] = 0.0  # the padding rows
    ids = np.array([9, 0, 8, 10, -1, 5, 11], dtype=np.int32)
    total = torch.zeros(7, 168, dtype=torch.float64)
    for first_id in (0, 4, 8):
        table = to_storage(full[first_id : first_id + 4], "float32")
        out = poisoned((7, 168), "float32")
        Embedding(build_codec("float32"), SIM_THREADS, vectorize=vectorize)(ids, table, out, NO_PREVIOUS,
                                                                            first_id=first_id, vocab=10)
        values = from_storage(out, "float32")
        held = [i for i, t in enumerate(ids) if first_id <= t < min(first_id + 4, 10)]
        others = [i for i, t in enumerate(ids) if 0 <= t < 10 and i not in held]
        assert torch.equal(values[held], full[ids[held]])
        assert (values[others] == 0.0).all()
        assert torch.isnan(values[[3, 4, 6]]).all()
        total += values.double()
    valid = [0, 1, 2, 5]
    assert torch.equal(total[valid].float(), full[ids[valid]])


def test_shape_errors():
    emb = Embedding(build_codec("float32"), SIM_THREADS)
    table = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match="ids"):
        emb(np.zeros(3, np.int32), table, np.zeros((2, 8), np.float32), NO_PREVIOUS)
    with pytest.raises(ValueError, match="table"):
        emb(np.zeros(2, np.int32), table, np.zeros((2, 9), np.float32), NO_PREVIOUS)
    with pytest.raises(ValueError, match="power of two"):
        Embedding(build_codec("float32"), 20)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.rows.embedding import build_embedding_kernel, build_embedding_vector_kernel
        for name in DTYPES:
            ptx(build_embedding_kernel(build_codec(name)), arr("int32", 1), arr(name, 2), arr(name, 2), arr("int32", 1),
                types.int32, types.int32)
            vector_ptx(build_embedding_vector_kernel(build_codec(name)), arr("int32", 1), arr(name, 2), arr(name, 2),
                       arr("int32", 1), types.int32, types.int32)
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,hidden", [(1, 151936, 4096), (2048, 248320, 2560), (77, 151936, 5120)])
def test_gpu_embedding_bf16(rows, vocab, hidden):
    gen = torch.Generator(device="cuda").manual_seed(52)
    table = torch.randn(vocab, hidden, device="cuda", generator=gen).bfloat16()
    ids = torch.randint(0, vocab, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    ids[0] = vocab - 1
    out = torch.full((rows, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    emb = Embedding(build_codec("bfloat16"))
    assert emb.uses_vector(table.view(torch.int16), out.view(torch.int16))
    emb(ids, table.view(torch.int16), out.view(torch.int16), ids[:0])
    torch.cuda.synchronize()
    assert torch.equal(out, table[ids.long()])
