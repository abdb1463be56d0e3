"""Residual add_inplace against torch (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.codec import build_codec
from executor.kernels.residual import AddInplace
from executor.numba_cuda import load_cuda, simulator_enabled
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
    AddInplace(build_codec(dtype_name), SIM_THREADS)(buf[1:4], to_storage(x, dtype_name))
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


def test_add_inplace_shape_errors():
    add = AddInplace(build_codec("float32"), SIM_THREADS)
    with pytest.raises(ValueError, match="expected"):
        add(np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        AddInplace(build_codec("float32"), 100)


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.residual import build_add_inplace_kernel
        for name in DTYPES:
            ptx(build_add_inplace_kernel(build_codec(name)), arr(name, 2), arr(name, 2))
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (333, 5120), (4096, 2560)])
def test_gpu_add_inplace_bf16(rows, hidden):
    gen = torch.Generator(device="cuda").manual_seed(23)
    acc = (torch.randn(rows, hidden, device="cuda", generator=gen) * 4).bfloat16()
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    expected = acc + x
    AddInplace(build_codec("bfloat16"))(acc.view(torch.int16), x.view(torch.int16))
    torch.cuda.synchronize()
    assert torch.equal(acc, expected)
