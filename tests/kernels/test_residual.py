"""Residual add_inplace against torch (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from tests.kernels.add_inplace import AddInplace, build_add_inplace_vector_kernel
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, from_storage, to_storage

SIM_THREADS = 32  # rows wider than the block exercise the column stride loop


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_add_inplace(dtype_name):
    gen = torch.Generator().manual_seed(21)
    dt = getattr(torch, dtype_name)
    # 168 columns: a full tile of 4 x 32 columns per thread, then a ragged end.
    acc_full = (torch.randn(5, 168, generator=gen) * 4).to(dt)
    x = torch.randn(3, 168, generator=gen).to(dt)
    buf = to_storage(acc_full, dtype_name)
    before = buf.copy()
    add = AddInplace(build_codec(dtype_name), SIM_THREADS)
    assert add.uses_vector(buf[1:4], to_storage(x, dtype_name))
    add(buf[1:4], to_storage(x, dtype_name))
    # Rows outside the view are untouched.
    np.testing.assert_array_equal(buf[[0, 4]], before[[0, 4]])
    got = from_storage(buf[1:4], dtype_name)
    if dtype_name == "float32":
        ref = acc_full[1:4].double() + x.double()
        assert (got - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    else:  # HF: residual + hidden_states in bf16, bit for bit
        np.testing.assert_array_equal(buf[1:4], to_storage(acc_full[1:4] + x, dtype_name))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_add_inplace_acc_is_x(dtype_name):
    gen = torch.Generator().manual_seed(22)
    dt = getattr(torch, dtype_name)
    a = torch.randn(2, 133, generator=gen).to(dt)
    # One device array passed twice: the simulator copies each host argument
    # separately, which would hide a real alias.
    buf = load_cuda().to_device(to_storage(a, dtype_name))
    AddInplace(build_codec(dtype_name), SIM_THREADS)(buf, buf)
    np.testing.assert_array_equal(buf.copy_to_host(), to_storage(a + a, dtype_name))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_vector_kernel_matches_scalar(dtype_name):
    """The vector kernel on a grid of 2 column blocks of 4 threads: rows of several tiles (column
    grid-stride, ragged last tile), in place with x the same device array; bit-exact with the scalar kernel."""
    gen = torch.Generator().manual_seed(24)
    dt = getattr(torch, dtype_name)
    a = (torch.randn(3, 168, generator=gen) * 4).to(dt)
    x = torch.randn(3, 168, generator=gen).to(dt)
    scalar = to_storage(a, dtype_name)
    AddInplace(build_codec(dtype_name), SIM_THREADS, vectorize=False)(scalar, to_storage(x, dtype_name))
    cuda = load_cuda()
    acc = cuda.to_device(to_storage(a, dtype_name))
    build_add_inplace_vector_kernel(build_codec(dtype_name))[(3, 2), 4](acc, cuda.to_device(to_storage(x, dtype_name)))
    np.testing.assert_array_equal(acc.copy_to_host(), scalar)
    same = cuda.to_device(to_storage(a, dtype_name))
    build_add_inplace_vector_kernel(build_codec(dtype_name))[(3, 2), 4](same, same)
    np.testing.assert_array_equal(same.copy_to_host(), to_storage(a + a, dtype_name))


def test_misaligned_rows_fall_back_to_scalar():
    values = np.arange(2 * 17, dtype=np.float32).reshape(2, 17)
    buf = load_cuda().to_device(values)
    add = AddInplace(build_codec("float32"), SIM_THREADS)
    acc, x = buf[:, 1:], np.ones((2, 16), np.float32)  # rows start 4 bytes into a chunk
    assert not add.uses_vector(acc, x)
    add(acc, x)
    np.testing.assert_array_equal(buf.copy_to_host()[:, 1:], values[:, 1:] + 1)


def test_add_inplace_shape_errors():
    add = AddInplace(build_codec("float32"), SIM_THREADS)
    with pytest.raises(ValueError, match="expected"):
        add(np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        AddInplace(build_codec("float32"), 100)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from tests.kernels.add_inplace import build_add_inplace_kernel, build_add_inplace_vector_kernel
        for name in DTYPES:
            ptx(build_add_inplace_kernel(build_codec(name)), arr(name, 2), arr(name, 2))
            vector_ptx(build_add_inplace_vector_kernel(build_codec(name)), arr(name, 2), arr(name, 2))
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (333, 5120), (4096, 2560)])
def test_gpu_add_inplace_bf16(rows, hidden):
    gen = torch.Generator(device="cuda").manual_seed(23)
    acc = (torch.randn(rows, hidden, device="cuda", generator=gen) * 4).bfloat16()
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    expected = acc + x
    add = AddInplace(build_codec("bfloat16"))
    assert add.uses_vector(acc.view(torch.int16), x.view(torch.int16))
    add(acc.view(torch.int16), x.view(torch.int16))
    torch.cuda.synchronize()
    assert torch.equal(acc, expected)


@pytest.mark.gpu
def test_gpu_misaligned_rows_fall_back_bf16():
    gen = torch.Generator(device="cuda").manual_seed(25)
    big = (torch.randn(333, 4097, device="cuda", generator=gen) * 4).bfloat16()
    x = torch.randn(333, 4096, device="cuda", generator=gen).bfloat16()
    expected = big[:, 1:] + x
    add = AddInplace(build_codec("bfloat16"))
    assert not add.uses_vector(big[:, 1:].view(torch.int16), x.view(torch.int16))
    add(big[:, 1:].view(torch.int16), x.view(torch.int16))
    torch.cuda.synchronize()
    assert torch.equal(big[:, 1:], expected)
