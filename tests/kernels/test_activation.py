"""silu_mul (activation.py) against torch (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.rows.activation import SiluMul, build_silu_mul_vector_kernel
from executor.kernels.primitives.codec import build_codec
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import (
    DTYPES, OVERFLOW_WARNING, assert_bf16_close, assert_close_rel, from_storage, poisoned, to_storage,
)

SIM_THREADS = 32  # rows wider than the block exercise the stride loops


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_silu_mul(dtype_name):
    gen = torch.Generator().manual_seed(31)
    rows, inter = 3, 168  # a full tile of 4 x 32 columns per thread, then a ragged end
    dt = getattr(torch, dtype_name)
    big = (torch.randn(rows + 1, 2 * inter, generator=gen) * 3).to(dt)
    big[0, :4] = torch.tensor([-120.0, 95.0, 0.0, -0.0])  # exp overflow, silu(0)
    gate_up = to_storage(big, dtype_name)[:rows]  # a row-sliced view of a bigger buffer
    out = poisoned((rows, inter), dtype_name)
    silu_mul = SiluMul(build_codec(dtype_name), SIM_THREADS)
    assert silu_mul.uses_vector(gate_up, out)
    silu_mul(gate_up, out)
    got = from_storage(out, dtype_name)
    gate, up = big[:rows, :inter], big[:rows, inter:]
    if dtype_name == "float32":
        assert_close_rel(got, F.silu(gate.double()) * up.double(), 1e-5)
    else:  # HF: act_fn(gate_proj(x)) * up_proj(x), both ops in bf16
        assert_bf16_close(got, F.silu(gate) * up)
        assert_close_rel(got, F.silu(gate.double()) * up.double(), 1e-2)


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_silu_mul_vector_kernel_matches_scalar(dtype_name):
    """The vector kernel on 2 column blocks of 4 threads (several tiles per row, ragged last one),
    out written over the gate half in place: the same bits as the scalar kernel."""
    gen = torch.Generator().manual_seed(36)
    rows, inter = 2, 168
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(getattr(torch, dtype_name))
    gate_up[0, :3] = torch.tensor([-120.0, 95.0, -0.0])
    scalar = poisoned((rows, inter), dtype_name)
    SiluMul(build_codec(dtype_name), SIM_THREADS, vectorize=False)(to_storage(gate_up, dtype_name), scalar)
    buf = load_cuda().to_device(to_storage(gate_up, dtype_name))
    build_silu_mul_vector_kernel(build_codec(dtype_name))[(rows, 2), 4](buf, buf[:, :inter])
    np.testing.assert_array_equal(buf.copy_to_host()[:, :inter], scalar)


def test_silu_mul_unaligned_width_falls_back_to_scalar():
    gate_up = to_storage(torch.randn(2, 2 * 166), "bfloat16")  # I = 166: 332-byte rows
    out = poisoned((2, 166), "bfloat16")
    silu_mul = SiluMul(build_codec("bfloat16"), SIM_THREADS)
    assert not silu_mul.uses_vector(gate_up, out)
    silu_mul(gate_up, out)
    gate, up = from_storage(gate_up[:, :166], "bfloat16"), from_storage(gate_up[:, 166:], "bfloat16")
    assert_bf16_close(from_storage(out, "bfloat16"), F.silu(gate.bfloat16()) * up.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(1, 12288), (511, 9728), (4096, 3072)])
def test_gpu_silu_mul_bf16(rows, inter):
    gen = torch.Generator(device="cuda").manual_seed(34)
    gate_up = (torch.randn(rows, 2 * inter, device="cuda", generator=gen) * 3).bfloat16()
    out = torch.full((rows, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    silu_mul = SiluMul(build_codec("bfloat16"))
    assert silu_mul.uses_vector(gate_up.view(torch.int16), out.view(torch.int16))
    silu_mul(gate_up.view(torch.int16), out.view(torch.int16))
    torch.cuda.synchronize()
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert_bf16_close(out.double().cpu(), expected.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(4096, 12288), (333, 9728)])
def test_gpu_silu_mul_vector_matches_scalar_bf16(rows, inter):
    gen = torch.Generator(device="cuda").manual_seed(38)
    gate_up = (torch.randn(rows, 2 * inter, device="cuda", generator=gen) * 3).bfloat16()
    outs = []
    for vectorize in (True, False):
        out = torch.full((rows, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
        silu_mul = SiluMul(build_codec("bfloat16"), vectorize=vectorize)
        assert silu_mul.uses_vector(gate_up.view(torch.int16), out.view(torch.int16)) == vectorize
        silu_mul(gate_up.view(torch.int16), out.view(torch.int16))
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])


def test_shape_errors():
    codec = build_codec("float32")
    with pytest.raises(ValueError, match="gate_up"):
        SiluMul(codec, SIM_THREADS)(np.zeros((2, 10), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        SiluMul(codec, 96)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.rows.activation import build_silu_mul_kernel, build_silu_mul_vector_kernel
        for name in DTYPES:
            codec = build_codec(name)
            ptx(build_silu_mul_kernel(codec), arr(name, 2), arr(name, 2))
            vector_ptx(build_silu_mul_vector_kernel(codec), arr(name, 2), arr(name, 2))
        """
    )
