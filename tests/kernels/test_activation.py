"""silu_mul and sigmoid_mul_inplace against torch (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.activation import SigmoidMulInplace, SiluMul
from executor.kernels.codec import build_codec
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, assert_bf16_close, assert_close_rel, from_storage, poisoned, to_storage

SIM_THREADS = 32  # rows wider than the block exercise the stride loops


# The simulator's float32 cast of exp(100) (inf on the GPU too) warns about the overflow.
OVERFLOW_WARNING = "ignore:overflow encountered in cast:RuntimeWarning"


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
    SiluMul(build_codec(dtype_name), SIM_THREADS)(gate_up, out)
    got = from_storage(out, dtype_name)
    gate, up = big[:rows, :inter], big[:rows, inter:]
    if dtype_name == "float32":
        assert_close_rel(got, F.silu(gate.double()) * up.double(), 1e-5)
    else:  # HF: act_fn(gate_proj(x)) * up_proj(x), both ops in bf16
        assert_bf16_close(got, F.silu(gate) * up)
        assert_close_rel(got, F.silu(gate.double()) * up.double(), 1e-2)


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_sigmoid_mul_inplace_strided(dtype_name):
    gen = torch.Generator().manual_seed(32)
    rows, heads, head_dim = 2, 3, 136  # a full tile of 4 x 32, then a ragged end
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, heads, head_dim, generator=gen) * 2).to(dt)
    q_gate = (torch.randn(rows, heads, 2 * head_dim, generator=gen) * 3).to(dt)  # per head [q | gate]
    q_gate[0, 0, head_dim : head_dim + 2] = torch.tensor([-150.0, 150.0])  # exp overflow both ways
    # Device arrays: the simulator transfers only contiguous host arrays, and
    # strided device views are what the executor passes on the GPU too.
    cuda = load_cuda()
    q_gate_dev = cuda.to_device(to_storage(q_gate, dtype_name))
    x_dev = cuda.to_device(to_storage(torch.cat([x, x], dim=-1), dtype_name))  # x as a strided view too
    SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS)(x_dev[:, :, :head_dim], q_gate_dev[:, :, head_dim:])
    x_big = x_dev.copy_to_host()
    np.testing.assert_array_equal(x_big[..., head_dim:], to_storage(x, dtype_name))  # untouched
    got = from_storage(x_big[..., :head_dim], dtype_name)
    gate = q_gate[..., head_dim:]
    if dtype_name == "float32":
        assert_close_rel(got, x.double() * torch.sigmoid(gate.double()), 1e-5)
    else:  # HF: attn_output * torch.sigmoid(gate) in bf16
        assert_bf16_close(got, x * torch.sigmoid(gate))
        assert_close_rel(got, x.double() * torch.sigmoid(gate.double()), 1e-2)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_sigmoid_mul_inplace_gate_is_x(dtype_name):
    gen = torch.Generator().manual_seed(33)
    dt = getattr(torch, dtype_name)
    a = torch.randn(1, 2, 130, generator=gen).to(dt)
    # One device array passed twice: the simulator copies each host argument separately.
    buf = load_cuda().to_device(to_storage(a, dtype_name))
    SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS)(buf, buf)
    got = from_storage(buf.copy_to_host(), dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, a.double() * torch.sigmoid(a.double()), 1e-5)
    else:
        assert_bf16_close(got, a * torch.sigmoid(a))


def test_shape_errors():
    codec = build_codec("float32")
    with pytest.raises(ValueError, match="gate_up"):
        SiluMul(codec, SIM_THREADS)(np.zeros((2, 10), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="gate"):
        SigmoidMulInplace(codec, SIM_THREADS)(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 5), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        SiluMul(codec, 96)


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.activation import build_sigmoid_mul_inplace_kernel, build_silu_mul_kernel
        for name in DTYPES:
            codec = build_codec(name)
            ptx(build_silu_mul_kernel(codec), arr(name, 2), arr(name, 2))
            ptx(build_sigmoid_mul_inplace_kernel(codec), arr(name, 3), arr(name, 3))
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(1, 12288), (511, 9728), (4096, 3072)])
def test_gpu_silu_mul_bf16(rows, inter):
    gen = torch.Generator(device="cuda").manual_seed(34)
    gate_up = (torch.randn(rows, 2 * inter, device="cuda", generator=gen) * 3).bfloat16()
    out = torch.full((rows, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    SiluMul(build_codec("bfloat16"))(gate_up.view(torch.int16), out.view(torch.int16))
    torch.cuda.synchronize()
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert_bf16_close(out.double().cpu(), expected.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("rows,heads", [(1, 16), (300, 24), (4096, 16)])
def test_gpu_sigmoid_mul_inplace_bf16(rows, heads):
    head_dim = 256
    gen = torch.Generator(device="cuda").manual_seed(35)
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 2).bfloat16()
    q_gate = (torch.randn(rows, heads, 2 * head_dim, device="cuda", generator=gen) * 3).bfloat16()
    gate = q_gate[..., head_dim:]
    expected = x * torch.sigmoid(gate)
    SigmoidMulInplace(build_codec("bfloat16"))(x.view(torch.int16), gate.view(torch.int16))
    torch.cuda.synchronize()
    assert_bf16_close(x.double().cpu(), expected.cpu())
