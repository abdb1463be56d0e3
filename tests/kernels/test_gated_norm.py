"""Gated RMSNorm of the Gated DeltaNet output (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.primitives.codec import build_codec
from executor.kernels.rows.gated_norm import GatedRmsNorm
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, assert_bf16_close, assert_close_rel, from_storage, poisoned, to_storage

EPS = 1e-6
HV, DV = 3, 40  # dv not a power of two: a ragged last stride


# ---------------------------------------------------------------- helpers


def ref64(x, z, w):
    """float64 gated norm: x [T, Hv, dv], z [T, Hv*dv], w [dv] -> [T, Hv*dv]."""
    x, z, w = x.double(), z.double(), w.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    return (n * F.silu(z.reshape(x.shape))).reshape(z.shape)


def hf_gated_norm(x, z, w):
    """HF's own Qwen3_5RMSNormGated, in x's dtype, as the layer calls it (rows of dv)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    dv = x.shape[-1]
    norm = Qwen3_5RMSNormGated(dv, eps=EPS).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return norm(x.reshape(-1, dv), z.reshape(-1, dv)).reshape(z.shape)


def make_inputs(gen, rows, dtype_name, hv=HV, dv=DV, device="cpu"):
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, hv, dv, generator=gen, device=device) * 3).to(dt)
    z = (torch.randn(rows, hv * dv, generator=gen, device=device) * 2).to(dt)
    w = (torch.rand(dv, generator=gen, device=device) + 0.5).to(dt)
    return x, z, w


# ---------------------------------------------------------------- simulator tests


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_matches_reference_and_hf(dtype_name):
    gen = torch.Generator().manual_seed(1)
    rows = 2
    x, z, w = make_inputs(gen, rows, dtype_name)
    big_z = torch.cat([z, z, z])
    z_view = to_storage(big_z, dtype_name)[rows : 2 * rows]  # a row-sliced view of a bigger buffer
    out = poisoned((rows, HV * DV), dtype_name)
    GatedRmsNorm(build_codec(dtype_name))(to_storage(x, dtype_name), z_view, to_storage(w, dtype_name), out, EPS)
    got = from_storage(out, dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x, z, w), 1e-5)
        assert_close_rel(got, hf_gated_norm(x, z, w).double(), 1e-5)
    else:
        assert_close_rel(got, ref64(x, z, w), 1e-2)
        assert_bf16_close(got, hf_gated_norm(x, z, w))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_in_place_over_x_and_over_z(dtype_name):
    """out sharing memory with x (viewed [T, Hv*dv]) or with z gives the out-of-place result."""
    gen = torch.Generator().manual_seed(2)
    x, z, w = make_inputs(gen, 1, dtype_name)
    norm = GatedRmsNorm(build_codec(dtype_name))
    w_s = to_storage(w, dtype_name)
    separate = poisoned((1, HV * DV), dtype_name)
    norm(to_storage(x, dtype_name), to_storage(z, dtype_name), w_s, separate, EPS)
    x_buf = to_storage(x, dtype_name)
    norm(x_buf, to_storage(z, dtype_name), w_s, x_buf.reshape(1, HV * DV), EPS)
    np.testing.assert_array_equal(x_buf.reshape(1, HV * DV), separate)
    z_buf = to_storage(z, dtype_name)
    norm(to_storage(x, dtype_name), z_buf, w_s, z_buf, EPS)
    np.testing.assert_array_equal(z_buf, separate)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_vector_kernel_matches_reference_hf_and_the_scalar_kernel(dtype_name):
    """dv 16 (2 bf16 chunks or 4 float32 ones a head): the vector kernel on a row-sliced z view, in more
    (row, head) pairs than a block takes a round (a partial last round), against float64, HF and the
    scalar kernel (the launcher's path for other views) on the same inputs."""
    gen = torch.Generator().manual_seed(4)
    rows, hv, dv = 45, 3, 16
    x, z, w = make_inputs(gen, rows, dtype_name, hv, dv)
    norm = GatedRmsNorm(build_codec(dtype_name))
    big_z = to_storage(torch.cat([z, z]), dtype_name)
    vector_out = poisoned((rows, hv * dv), dtype_name)
    norm(to_storage(x, dtype_name), big_z[rows:], to_storage(w, dtype_name), vector_out, EPS)
    assert list(norm.vector_kernels) == [dv]
    scalar_out = poisoned((rows, hv * dv), dtype_name)
    norm.kernel[(rows, hv), dv](to_storage(x, dtype_name), to_storage(z, dtype_name), to_storage(w, dtype_name),
                                scalar_out, np.float32(EPS))
    got, scalar = from_storage(vector_out, dtype_name), from_storage(scalar_out, dtype_name)
    tol = 1e-5 if dtype_name == "float32" else 1e-2
    assert_close_rel(got, ref64(x, z, w), tol)
    assert_close_rel(got, scalar, 1e-5 if dtype_name == "float32" else 1e-2)
    if dtype_name == "float32":
        assert_close_rel(got, hf_gated_norm(x, z, w).double(), 1e-5)
    else:
        assert_bf16_close(got, hf_gated_norm(x, z, w))


def test_shape_errors():
    norm = GatedRmsNorm(build_codec("float32"))
    x = np.zeros((2, HV, DV), np.float32)
    z = np.zeros((2, HV * DV), np.float32)
    with pytest.raises(ValueError, match="weight"):
        norm(x, z, np.zeros(DV + 1, np.float32), z.copy(), EPS)
    with pytest.raises(ValueError, match="out"):
        norm(x, z, np.zeros(DV, np.float32), np.zeros((2, HV, DV), np.float32), EPS)
    with pytest.raises(ValueError, match="x must be"):
        norm(z, z, np.zeros(DV, np.float32), z.copy(), EPS)


# ---------------------------------------------------------------- real-GPU compilation (no GPU needed)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.rows.gated_norm import build_gated_rms_norm, build_gated_rms_norm_vector
        for name in DTYPES:
            args = (arr(name, 3), arr(name, 2), arr(name, 1), arr(name, 2), types.float32)
            ptx(build_gated_rms_norm(build_codec(name)), *args)
            text = ptx(build_gated_rms_norm_vector(build_codec(name), 128), *args)
            assert ".local" not in text, f"{name}: local memory"
        """
    )


# ---------------------------------------------------------------- GPU tests at real sizes (bf16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 300])
def test_gpu_gated_norm_bf16(rows):
    gen = torch.Generator(device="cuda").manual_seed(3)
    hv, dv = 48, 128
    x, z, w = make_inputs(gen, rows, "bfloat16", hv, dv, device="cuda")
    out = torch.full_like(z, float("nan"))
    i16 = lambda t: t.view(torch.int16)  # noqa: E731
    GatedRmsNorm(build_codec("bfloat16"))(i16(x), i16(z), i16(w), i16(out), EPS)
    torch.cuda.synchronize()
    assert_close_rel(out.double().cpu(), ref64(x, z, w).cpu(), 1e-2)
    assert_bf16_close(out.double().cpu(), hf_gated_norm(x, z, w).cpu())
