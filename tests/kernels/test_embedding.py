"""Embedding gather against torch indexing (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import types as pytypes

import numpy as np
import pytest
import torch

from executor.kernels.codec import build_codec
from executor.kernels.embedding import Embedding, build_embedding_kernel
from executor.numba_cuda import load_cuda, simulator_enabled

BF16_NAN_BITS = 0x7FC0
SIM_THREADS = 32  # rows wider than the block exercise the column stride loop


def to_storage(t: torch.Tensor, dtype_name: str) -> np.ndarray:
    """A CPU tensor as the kernel's storage array (float32, or bf16 bits as int16)."""
    if dtype_name == "float32":
        return t.to(torch.float32).numpy().copy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().copy()


def poisoned(shape: tuple[int, ...], dtype_name: str) -> np.ndarray:
    if dtype_name == "float32":
        return np.full(shape, np.nan, dtype=np.float32)
    return np.full(shape, BF16_NAN_BITS, dtype=np.int16)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_embedding_gathers_rows_bit_exact(dtype_name):
    gen = torch.Generator().manual_seed(51)
    vocab, hidden = 11, 168  # a full tile of 4 x 32 columns per thread, then a ragged end
    table = to_storage(torch.randn(vocab, hidden, generator=gen), dtype_name)
    ids_full = np.array([9, 0, 10, 3, 3, 5], dtype=np.int32)
    out_full = poisoned((8, hidden), dtype_name)
    out = out_full[2:7]  # a row-sliced view of a bigger buffer
    Embedding(build_codec(dtype_name), SIM_THREADS)(ids_full[1:], table, out)
    np.testing.assert_array_equal(out_full[2:7], table[ids_full[1:]])
    np.testing.assert_array_equal(out_full[[0, 1, 7]], poisoned((3, hidden), dtype_name))  # untouched


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_embedding_out_of_range_id_gives_nan_row(dtype_name):
    table = to_storage(torch.ones(4, 8), dtype_name)
    out = to_storage(torch.zeros(3, 8), dtype_name)
    Embedding(build_codec(dtype_name), SIM_THREADS)(np.array([1, 4, -1], dtype=np.int32), table, out)
    values = torch.from_numpy(out)
    if dtype_name == "bfloat16":
        values = values.view(torch.bfloat16)
    values = values.double()
    assert (values[0] == 1.0).all()
    assert torch.isnan(values[1:]).all()


def test_shape_errors():
    emb = Embedding(build_codec("float32"), SIM_THREADS)
    table = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match="ids"):
        emb(np.zeros(3, np.int32), table, np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="table"):
        emb(np.zeros(2, np.int32), table, np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        Embedding(build_codec("float32"), 20)


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
def test_compiles_for_sm90(monkeypatch):
    cuda = load_cuda()
    from numba import types
    import numba.cuda.dispatcher as dispatcher

    if not cuda.is_available():  # device functions ask the current device for its compute capability
        hopper = pytypes.SimpleNamespace(compute_capability=(9, 0))
        monkeypatch.setattr(dispatcher, "get_current_device", lambda: hopper)
    for dtype_name, element in (("float32", types.float32), ("bfloat16", types.int16)):
        arr = types.Array(element, 2, "A")
        try:
            cuda.compile_ptx(
                build_embedding_kernel(build_codec(dtype_name)).py_func,
                (types.Array(types.int32, 1, "A"), arr, arr),
                cc=(9, 0),
            )
        except Exception as exc:  # noqa: BLE001  (NVVM missing is the only expected failure)
            if "NVVM" in str(exc) or "nvvm" in str(exc):
                pytest.skip(f"cuda.compile_ptx cannot find NVVM: {exc}")
            raise


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,hidden", [(1, 151936, 4096), (2048, 248320, 2560), (77, 151936, 5120)])
def test_gpu_embedding_bf16(rows, vocab, hidden):
    gen = torch.Generator(device="cuda").manual_seed(52)
    table = torch.randn(vocab, hidden, device="cuda", generator=gen).bfloat16()
    ids = torch.randint(0, vocab, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    ids[0] = vocab - 1
    out = torch.full((rows, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    Embedding(build_codec("bfloat16"))(ids, table.view(torch.int16), out.view(torch.int16))
    torch.cuda.synchronize()
    assert torch.equal(out, table[ids.long()])
