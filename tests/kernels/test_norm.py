"""RMSNorm kernels against torch references (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.rows.norm import (
    SCRATCH_BYTES_PER_THREAD,
    AddRmsNormInplace,
    RmsNorm,
    row_threads,
    vector_row_threads,
)
from executor.numba_cuda import load_cuda
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
    norm = RmsNorm(build_codec(dtype_name), round_before_weight, SIM_THREADS)
    assert norm.uses_vector(x_store, w_store, out)  # 168 columns are whole 16-byte chunks
    norm(x_store, w_store, out, EPS, offset)
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


# ---------------------------------------------------------------- vector path (16-byte chunks)

VECTOR_SWEEP_THREADS = 4  # a 168-wide row is 42 (float32) or 21 (bf16) chunks: several sweeps of 4 x 4 chunks


def launch_vector(kernel, rows: int, *args) -> None:
    """Run a vector kernel with VECTOR_SWEEP_THREADS threads, so rows take several sweeps (ragged last)."""
    kernel[rows, VECTOR_SWEEP_THREADS, 0, VECTOR_SWEEP_THREADS * SCRATCH_BYTES_PER_THREAD](*args)


@pytest.mark.parametrize("dtype_name,round_before_weight,offset", CASES[1:])
def test_vector_rms_norm_rows_of_several_sweeps(dtype_name, round_before_weight, offset):
    """Rows longer than one sweep re-read x in pass 2; in place (out is x) gives the same bits."""
    gen = torch.Generator().manual_seed(7)
    rows, width = 2, 168
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, width, generator=gen) * 3.0).to(dt)
    w = (torch.randn(width, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(dt)
    norm = RmsNorm(build_codec(dtype_name), round_before_weight, SIM_THREADS)
    w_store, out = to_storage(w, dtype_name), poisoned((rows, width), dtype_name)
    assert norm.uses_vector(to_storage(x, dtype_name), w_store, out)
    args = (np.float32(EPS), np.float32(offset))
    launch_vector(norm.vector_kernel, rows, to_storage(x, dtype_name), w_store, out, *args)
    got = from_storage(out, dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x, w, offset), 1e-5)
    else:
        assert_bf16_close(got, hf_rms_norm(x, w, offset, round_before_weight))
    dev = load_cuda().to_device(to_storage(x, dtype_name))
    launch_vector(norm.vector_kernel, rows, dev, w_store, dev, *args)  # out is x
    np.testing.assert_array_equal(dev.copy_to_host(), out)


@pytest.mark.parametrize("dtype_name,round_before_weight,offset", CASES[1:])
def test_vector_add_rms_norm_rows_of_several_sweeps(dtype_name, round_before_weight, offset):
    gen = torch.Generator().manual_seed(8)
    rows, width = 2, 168
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, width, generator=gen) * 2.0).to(dt)
    res = (torch.randn(rows, width, generator=gen) * 4.0).to(dt)
    w = (torch.randn(width, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(dt)
    fused = AddRmsNormInplace(build_codec(dtype_name), round_before_weight, SIM_THREADS)
    cuda = load_cuda()  # device arrays: out is x, a real alias in the simulator too
    x_dev, res_dev = cuda.to_device(to_storage(x, dtype_name)), cuda.to_device(to_storage(res, dtype_name))
    w_store = to_storage(w, dtype_name)
    assert fused.uses_vector(x_dev, res_dev, w_store, x_dev)
    launch_vector(fused.vector_kernel, rows, x_dev, res_dev, w_store, x_dev, np.float32(EPS), np.float32(offset))
    summed = res + x
    np.testing.assert_array_equal(res_dev.copy_to_host(), to_storage(summed, dtype_name))
    got = from_storage(x_dev.copy_to_host(), dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x.double() + res.double(), w, offset), 1e-5)
    else:
        assert_bf16_close(got, hf_rms_norm(summed, w, offset, round_before_weight))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_misaligned_rows_fall_back_to_scalar(dtype_name):
    """Rows starting one element past a chunk boundary take the scalar kernels, with the same results."""
    gen = torch.Generator().manual_seed(9)
    big = torch.randn(2, 169, generator=gen) * 2.0
    w = torch.rand(168, generator=gen) + 0.5
    codec = build_codec(dtype_name)
    cuda = load_cuda()
    buf = cuda.to_device(to_storage(big, dtype_name))
    x_shifted, w_store = buf[:, 1:], to_storage(w, dtype_name)
    x_aligned = to_storage(big[:, 1:], dtype_name)
    norm = RmsNorm(codec, True, SIM_THREADS)
    assert not norm.uses_vector(x_shifted, w_store, x_shifted)
    assert norm.uses_vector(x_aligned, w_store, x_aligned)
    out_scalar, out_vector = poisoned((2, 168), dtype_name), poisoned((2, 168), dtype_name)
    norm(x_shifted, w_store, out_scalar, EPS, 0.0)
    norm(x_aligned, w_store, out_vector, EPS, 0.0)
    got_scalar, got_vector = from_storage(out_scalar, dtype_name), from_storage(out_vector, dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got_scalar, got_vector, 1e-6)
    else:  # the paths sum squares in different orders: an inv_rms ulp can flip a rounding
        assert_bf16_close(got_scalar, got_vector, exact=0.97)
    fused = AddRmsNormInplace(codec, True, SIM_THREADS)
    res = cuda.to_device(to_storage(big, dtype_name))
    assert not fused.uses_vector(x_shifted, res[:, 1:], w_store, x_shifted)
    fused(x_shifted, res[:, 1:], w_store, x_shifted, EPS, 0.0)
    np.testing.assert_array_equal(res.copy_to_host()[:, 1:], to_storage(big[:, 1:] + big[:, 1:], dtype_name))


def test_vector_block_size():
    assert vector_row_threads(1, 512, 512) == 512  # decode: a chunk per thread
    assert vector_row_threads(16384, 512, 512) == 128  # 4096 bf16: one sweep of 128 threads
    assert vector_row_threads(16384, 640, 512) == 256  # 5120 bf16: one sweep of 256 threads
    assert vector_row_threads(16384, 640, 128) == 128  # max_threads still caps the block


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


@pytest.mark.ptx
def test_compiles_for_sm90():
    """Both kernels (scalar and vector), both codecs and both rounding modes compile to sm_90 PTX with
    float32 math only; the vector kernels with 16-byte accesses and no local memory."""
    compile_for_sm90(
        """
        from executor.kernels.rows.norm import (
            build_add_rms_norm_kernel, build_add_rms_norm_vector_kernel,
            build_rms_norm_kernel, build_rms_norm_vector_kernel,
        )
        for name, round_before_weight in (("float32", False), ("bfloat16", True), ("bfloat16", False)):
            codec = build_codec(name)
            rows, vec, f32 = arr(name, 2), arr(name, 1), types.float32
            ptx(build_rms_norm_kernel(codec, round_before_weight), rows, vec, rows, f32, f32)
            ptx(build_add_rms_norm_kernel(codec, round_before_weight), rows, rows, vec, rows, f32, f32)
            vector_ptx(build_rms_norm_vector_kernel(codec, round_before_weight), rows, vec, rows, f32, f32)
            vector_ptx(build_add_rms_norm_vector_kernel(codec, round_before_weight), rows, rows, vec, rows, f32, f32)
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
    norm = RmsNorm(build_codec("bfloat16"), round_before_weight)
    assert norm.uses_vector(x.view(torch.int16), w.view(torch.int16), out.view(torch.int16))
    norm(x.view(torch.int16), w.view(torch.int16), out.view(torch.int16), EPS, offset)
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


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,width,round_before_weight,offset",
    [(16384, 4096, True, 0.0), (4097, 5120, False, 1.0), (300, 2560, True, 0.0), (3, 4096, False, 1.0)],
)
def test_gpu_vector_matches_scalar_bf16(rows, width, round_before_weight, offset):
    """The vector kernels against the scalar ones at real sizes (one-sweep rows, both block-size regimes)."""
    gen = torch.Generator(device="cuda").manual_seed(10)
    x = (torch.randn(rows, width, device="cuda", generator=gen) * 2).bfloat16()
    res = (torch.randn(rows, width, device="cuda", generator=gen) * 4).bfloat16()
    w = (torch.randn(width, device="cuda", generator=gen) * 0.2 + (0.0 if offset else 1.0)).bfloat16()
    codec = build_codec("bfloat16")

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16)

    outs = {}
    for vectorize in (True, False):
        norm = RmsNorm(codec, round_before_weight, vectorize=vectorize)
        fused = AddRmsNormInplace(codec, round_before_weight, vectorize=vectorize)
        out, x2, res2 = torch.full_like(x, float("nan")), x.clone(), res.clone()
        assert norm.uses_vector(bits(x), bits(w), bits(out)) == vectorize
        norm(bits(x), bits(w), bits(out), EPS, offset)
        fused(bits(x2), bits(res2), bits(w), bits(x2), EPS, offset)  # out is x
        outs[vectorize] = (out, x2, res2)
    torch.cuda.synchronize()
    (out_v, fused_v, res_v), (out_s, fused_s, res_s) = outs[True], outs[False]
    assert torch.equal(res_v, res_s)
    # Sums of squares in a different order: inv_rms may differ by a float32 ulp, flipping a rare rounding.
    assert_bf16_close(out_v.double().cpu(), out_s.cpu(), exact=0.999)
    assert_bf16_close(fused_v.double().cpu(), fused_s.cpu(), exact=0.999)
    assert_bf16_close(out_v.double().cpu(), hf_rms_norm(x, w, offset, round_before_weight).cpu())


@pytest.mark.gpu
def test_gpu_misaligned_rows_fall_back_bf16():
    gen = torch.Generator(device="cuda").manual_seed(11)
    big = (torch.randn(777, 4097, device="cuda", generator=gen) * 2).bfloat16()
    x = big[:, 1:]  # rows start 2 bytes past a chunk boundary
    w = (torch.randn(4096, device="cuda", generator=gen) * 0.2 + 1.0).bfloat16()
    out = torch.full((777, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
    norm = RmsNorm(build_codec("bfloat16"), True)
    assert not norm.uses_vector(x.view(torch.int16), w.view(torch.int16), out.view(torch.int16))
    norm(x.view(torch.int16), w.view(torch.int16), out.view(torch.int16), EPS, 0.0)
    torch.cuda.synchronize()
    assert_bf16_close(out.double().cpu(), hf_rms_norm(x, w, 0.0, True).cpu())
