"""RMSNorm kernels against torch references (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.codec import build_codec
from executor.kernels.norm import AddRmsNormInplace, RmsNorm, row_threads
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, assert_bf16_close, assert_close_rel, from_storage, poisoned, to_storage

EPS = 1e-6
SIM_THREADS = 32  # simulator blocks: few threads, and rows wider than the block exercise the stride loop


# ---------------------------------------------------------------- helpers


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, offset: float, round_before_weight: bool) -> torch.Tensor:
    """HF's Qwen3RMSNorm (round before weight) / Qwen3_5RMSNorm, in x's dtype."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if round_before_weight:
        return (w + offset).to(x.dtype) * n.to(x.dtype) if offset else w * n.to(x.dtype)
    return (n * (offset + w.float())).to(x.dtype)


def ref64(x: torch.Tensor, w: torch.Tensor, offset: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.double())


CASES = [("float32", False, 0.0), ("float32", True, 0.0), ("bfloat16", True, 0.0), ("bfloat16", False, 1.0)]


# ---------------------------------------------------------------- simulator tests


@pytest.mark.parametrize("dtype_name,round_before_weight,offset", CASES)
def test_rms_norm(dtype_name, round_before_weight, offset):
    gen = torch.Generator().manual_seed(1)
    rows, width = 3, 168  # one full tile of 4 x 32 columns, then a ragged end
    big = torch.randn(rows + 2, width, generator=gen) * 3.0
    w = torch.randn(width, generator=gen) * 0.5 + (0.0 if offset else 1.0)
    dt = getattr(torch, dtype_name)
    x_store = to_storage(big, dtype_name)[1 : rows + 1]  # a row-sliced view of a bigger buffer
    w_store = to_storage(w, dtype_name)
    out = poisoned((rows, width), dtype_name)
    RmsNorm(build_codec(dtype_name), round_before_weight, SIM_THREADS)(x_store, w_store, out, EPS, offset)
    x = big[1 : rows + 1].to(dt)
    got = from_storage(out, dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x, w, offset), 1e-5)
    else:
        assert_bf16_close(got, hf_rms_norm(x, w.to(dt), offset, round_before_weight))
        assert_close_rel(got, ref64(x, w.to(dt), offset), 1e-2)


@pytest.mark.parametrize("dtype_name,round_before_weight,offset", CASES[1:3])
def test_rms_norm_out_aliases_x(dtype_name, round_before_weight, offset):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 168, generator=gen)
    w = torch.rand(168, generator=gen) + 0.5
    buf = to_storage(x, dtype_name)
    separate = poisoned(buf.shape, dtype_name)
    norm = RmsNorm(build_codec(dtype_name), round_before_weight, SIM_THREADS)
    norm(buf, to_storage(w, dtype_name), separate, EPS, offset)
    # One device array passed twice: the simulator copies each host argument
    # separately and writes them back in order, which would hide a real alias.
    dev = load_cuda().to_device(buf)
    norm(dev, to_storage(w, dtype_name), dev, EPS, offset)  # in place: out is x
    np.testing.assert_array_equal(dev.copy_to_host(), separate)


@pytest.mark.parametrize("dtype_name,round_before_weight,offset", CASES)
def test_add_rms_norm_inplace(dtype_name, round_before_weight, offset):
    gen = torch.Generator().manual_seed(3)
    rows, width = 3, 168
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, width, generator=gen) * 2.0).to(dt)
    res = (torch.randn(rows, width, generator=gen) * 4.0).to(dt)
    w = (torch.randn(width, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(dt)
    x_store, res_store = to_storage(x, dtype_name), to_storage(res, dtype_name)
    out = poisoned((rows, width), dtype_name)
    AddRmsNormInplace(build_codec(dtype_name), round_before_weight, SIM_THREADS)(
        x_store, res_store, to_storage(w, dtype_name), out, EPS, offset
    )
    summed = res + x  # HF: residual + hidden_states, in the activation dtype
    np.testing.assert_array_equal(res_store, to_storage(summed, dtype_name))
    got = from_storage(out, dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x.double() + res.double(), w, offset), 1e-5)
    else:
        assert_bf16_close(got, hf_rms_norm(summed, w, offset, round_before_weight))
        assert_close_rel(got, ref64(summed, w, offset), 1e-2)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_add_rms_norm_out_aliases_x(dtype_name):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 168, generator=gen)
    res = torch.randn(2, 168, generator=gen)
    w = to_storage(torch.rand(168, generator=gen) + 0.5, dtype_name)
    fused = AddRmsNormInplace(build_codec(dtype_name), True, SIM_THREADS)
    x1, r1, out1 = to_storage(x, dtype_name), to_storage(res, dtype_name), poisoned((2, 168), dtype_name)
    fused(x1, r1, w, out1, EPS, 0.0)
    cuda = load_cuda()  # device arrays: a real alias in the simulator too
    x2, r2 = cuda.to_device(to_storage(x, dtype_name)), cuda.to_device(to_storage(res, dtype_name))
    fused(x2, r2, w, x2, EPS, 0.0)  # out is x
    np.testing.assert_array_equal(r2.copy_to_host(), r1)
    np.testing.assert_array_equal(x2.copy_to_host(), out1)


def test_block_size_follows_row_count():
    assert row_threads(1, 4096, 512) == 512  # a decode row: wide blocks
    assert row_threads(64, 5120, 1024) == 1024
    assert row_threads(16384, 4096, 512) == 128  # a prefill chunk: many small blocks
    assert row_threads(3, 168, 32) == 32  # the simulator tests' explicit cap


def test_shape_errors():
    norm = RmsNorm(build_codec("float32"), False)
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight"):
        norm(x, np.zeros(7, np.float32), x, EPS, 0.0)
    with pytest.raises(ValueError, match="expected"):
        norm(x, np.zeros(8, np.float32), np.zeros((3, 8), np.float32), EPS, 0.0)
    with pytest.raises(ValueError, match="power of two"):
        RmsNorm(build_codec("float32"), False, max_threads=48)


# ---------------------------------------------------------------- real-GPU compilation


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
def test_compiles_for_sm90():
    """Both kernels, both codecs and both rounding modes compile to sm_90 PTX with float32 math only."""
    compile_for_sm90(
        """
        from executor.kernels.norm import build_add_rms_norm_kernel, build_rms_norm_kernel
        for name, round_before_weight in (("float32", False), ("bfloat16", True), ("bfloat16", False)):
            codec = build_codec(name)
            rows, vec, f32 = arr(name, 2), arr(name, 1), types.float32
            ptx(build_rms_norm_kernel(codec, round_before_weight), rows, vec, rows, f32, f32)
            ptx(build_add_rms_norm_kernel(codec, round_before_weight), rows, rows, vec, rows, f32, f32)
        """
    )


# ---------------------------------------------------------------- GPU tests at real sizes (bf16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,width,round_before_weight,offset",
    [
        (777, 4096, True, 0.0),
        (777, 5120, False, 1.0),
        (777, 128, True, 0.0),
        (1, 4096, True, 0.0),  # decode: few rows take wide blocks
        (5, 5120, False, 1.0),
    ],
)
def test_gpu_rms_norm_bf16(rows, width, round_before_weight, offset):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(rows, width, device="cuda", generator=gen) * 2).bfloat16()
    w = (torch.randn(width, device="cuda", generator=gen) * 0.2 + (0.0 if offset else 1.0)).bfloat16()
    out = torch.full_like(x, float("nan"))
    RmsNorm(build_codec("bfloat16"), round_before_weight)(
        x.view(torch.int16), w.view(torch.int16), out.view(torch.int16), EPS, offset
    )
    torch.cuda.synchronize()
    assert_bf16_close(out.double().cpu(), hf_rms_norm(x, w, offset, round_before_weight).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,width,round_before_weight,offset", [(513, 4096, True, 0.0), (513, 2560, False, 1.0), (2, 4096, True, 0.0)]
)
def test_gpu_add_rms_norm_bf16(rows, width, round_before_weight, offset):
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    res = (torch.randn(rows, width, device="cuda", generator=gen) * 4).bfloat16()
    w = (torch.randn(width, device="cuda", generator=gen) * 0.2 + (0.0 if offset else 1.0)).bfloat16()
    summed = res + x
    hf = hf_rms_norm(summed, w, offset, round_before_weight)
    AddRmsNormInplace(build_codec("bfloat16"), round_before_weight)(
        x.view(torch.int16), res.view(torch.int16), w.view(torch.int16), x.view(torch.int16), EPS, offset
    )
    torch.cuda.synchronize()
    assert torch.equal(res, summed)
    assert_bf16_close(x.double().cpu(), hf.cpu())
