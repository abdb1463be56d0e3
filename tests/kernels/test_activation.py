"""silu_mul and sigmoid_mul_inplace against torch (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.activation import (
    SigmoidMulInplace,
    SiluMul,
    build_sigmoid_mul_inplace_vector_kernel,
    build_silu_mul_vector_kernel,
)
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
    gate_mul = SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS)
    assert gate_mul.uses_vector(x_dev[:, :, :head_dim], q_gate_dev[:, :, head_dim:])
    gate_mul(x_dev[:, :, :head_dim], q_gate_dev[:, :, head_dim:])
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
    gate_mul = SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS)
    assert not gate_mul.uses_vector(buf, buf)  # 130-element heads are not whole 16-byte chunks
    gate_mul(buf, buf)
    got = from_storage(buf.copy_to_host(), dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, a.double() * torch.sigmoid(a.double()), 1e-5)
    else:
        assert_bf16_close(got, a * torch.sigmoid(a))


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


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_sigmoid_mul_vector_kernel_matches_scalar(dtype_name):
    """Chunks of several heads per tile on 2 column blocks of 4 threads, strided x and gate views."""
    gen = torch.Generator().manual_seed(37)
    rows, heads, head_dim = 2, 3, 24
    q_gate = (torch.randn(rows, heads, 2 * head_dim, generator=gen) * 3).to(getattr(torch, dtype_name))
    cuda = load_cuda()
    expected = cuda.to_device(to_storage(q_gate, dtype_name))
    gate_mul = SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS, vectorize=False)
    gate_mul(expected[:, :, :head_dim], expected[:, :, head_dim:])
    buf = cuda.to_device(to_storage(q_gate, dtype_name))
    build_sigmoid_mul_inplace_vector_kernel(build_codec(dtype_name))[(rows, 2), 4](
        buf[:, :, :head_dim], buf[:, :, head_dim:]
    )
    np.testing.assert_array_equal(buf.copy_to_host(), expected.copy_to_host())


def test_silu_mul_unaligned_width_falls_back_to_scalar():
    gate_up = to_storage(torch.randn(2, 2 * 166), "bfloat16")  # I = 166: 332-byte rows
    out = poisoned((2, 166), "bfloat16")
    silu_mul = SiluMul(build_codec("bfloat16"), SIM_THREADS)
    assert not silu_mul.uses_vector(gate_up, out)
    silu_mul(gate_up, out)
    gate, up = from_storage(gate_up[:, :166], "bfloat16"), from_storage(gate_up[:, 166:], "bfloat16")
    assert_bf16_close(from_storage(out, "bfloat16"), F.silu(gate.bfloat16()) * up.bfloat16())


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
        from executor.kernels.activation import (
            build_sigmoid_mul_inplace_kernel, build_sigmoid_mul_inplace_vector_kernel, build_silu_mul_kernel,
            build_silu_mul_vector_kernel,
        )
        for name in DTYPES:
            codec = build_codec(name)
            ptx(build_silu_mul_kernel(codec), arr(name, 2), arr(name, 2))
            ptx(build_sigmoid_mul_inplace_kernel(codec), arr(name, 3), arr(name, 3))
            vector_ptx(build_silu_mul_vector_kernel(codec), arr(name, 2), arr(name, 2))
            vector_ptx(build_sigmoid_mul_inplace_vector_kernel(codec), arr(name, 3), arr(name, 3))
        """
    )


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
@pytest.mark.parametrize("rows,heads", [(1, 16), (300, 24), (4096, 16)])
def test_gpu_sigmoid_mul_inplace_bf16(rows, heads):
    head_dim = 256
    gen = torch.Generator(device="cuda").manual_seed(35)
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 2).bfloat16()
    q_gate = (torch.randn(rows, heads, 2 * head_dim, device="cuda", generator=gen) * 3).bfloat16()
    gate = q_gate[..., head_dim:]
    expected = x * torch.sigmoid(gate)
    gate_mul = SigmoidMulInplace(build_codec("bfloat16"))
    assert gate_mul.uses_vector(x.view(torch.int16), gate.view(torch.int16))
    gate_mul(x.view(torch.int16), gate.view(torch.int16))
    torch.cuda.synchronize()
    assert_bf16_close(x.double().cpu(), expected.cpu())


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


@pytest.mark.gpu
def test_gpu_sigmoid_mul_vector_matches_scalar_bf16():
    gen = torch.Generator(device="cuda").manual_seed(39)
    rows, heads, head_dim = 1025, 16, 256
    q_gate = (torch.randn(rows, heads, 2 * head_dim, device="cuda", generator=gen) * 3).bfloat16()
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 2).bfloat16()
    outs = []
    for vectorize in (True, False):
        y = x.clone()
        gate_mul = SigmoidMulInplace(build_codec("bfloat16"), vectorize=vectorize)
        gate = q_gate[..., head_dim:].view(torch.int16)
        assert gate_mul.uses_vector(y.view(torch.int16), gate) == vectorize
        gate_mul(y.view(torch.int16), gate)
        outs.append(y)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
