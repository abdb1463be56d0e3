"""The fused decode GEMVs (gemv.py) against float64 references: the simulator at tiny shapes (rows
past the grid, K past a warp's sweep), bf16 on the GPU at Qwen3-8B's shapes."""

from __future__ import annotations

import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.gemv import Gemv
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, assert_close_rel, rounded

EPS = 1e-6


def norm_reference(hidden: torch.Tensor, weight: torch.Tensor, offset: float, round_before_weight: bool,
                   dtype_name: str) -> torch.Tensor:
    """HF's RMSNorm output in the storage dtype, as float64: Qwen3 rounds norm(x) before the weight."""
    h = hidden.double()
    normalized = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + EPS)
    if round_before_weight:
        normalized = rounded(normalized, dtype_name)
    return rounded(normalized * (offset + weight.double()), dtype_name)


def inputs(batch: int, in_features: int, rows: int, dtype_name: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype_name)
    return {
        "hidden": (torch.randn(batch, in_features, generator=gen) * 2).to(dt),
        "norm_weight": (torch.rand(in_features, generator=gen) + 0.5).to(dt),
        "weight": (torch.randn(rows, in_features, generator=gen) / in_features**0.5).to(dt),
    }


def tolerance(dtype_name: str) -> float:
    return 1e-5 if dtype_name == "float32" else 1e-2


# K: 18 float32 / 11 bf16 chunks (a partial sweep of a 4-lane, 8-chunk row team); 70 rows: more than
# the simulator's grid of 8 one-warp blocks of 8 row teams, so blocks walk row groups grid-stride.
SIM_SHAPES = {"float32": 72, "bfloat16": 88}
SIM_ROWS = 70


def gemv(dtype_name: str, round_before_weight: bool = True) -> Gemv:
    return Gemv(build_codec(dtype_name), round_before_weight)


@pytest.mark.parametrize("rows", [SIM_ROWS, SIM_ROWS + 1], ids=["two-rows-a-team", "odd-one-row-a-team"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("style", [(0.0, True), (1.0, False)], ids=["qwen3", "zero-centred"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_norm_project(dtype_name, style, batch, rows):
    """Even N: a row team owns rows n and n + N / 2; odd N: one row."""
    offset, round_before = style
    k = SIM_SHAPES[dtype_name]
    a = inputs(batch, k, rows, dtype_name, seed=1)
    out = torch.full((batch, rows), float("nan"), dtype=a["hidden"].dtype)
    gemv(dtype_name, round_before).norm_project(a["hidden"], a["norm_weight"], EPS, offset, a["weight"], out)
    normed = norm_reference(a["hidden"], a["norm_weight"], offset, round_before, dtype_name)
    assert_close_rel(out.double(), normed @ a["weight"].double().t(), tolerance(dtype_name))


@pytest.mark.parametrize("rows", [SIM_ROWS, SIM_ROWS + 1], ids=["two-rows-a-team", "odd-one-row-a-team"])
def test_norm_project_float32_logits_of_a_bf16_model(rows):
    """A float32 out (the lm_head's logits) holds exactly the bf16 outputs, converted."""
    a = inputs(1, SIM_SHAPES["bfloat16"], rows, "bfloat16", seed=6)
    launcher = gemv("bfloat16")
    stored = torch.full((1, rows), float("nan"), dtype=torch.bfloat16)
    logits = torch.full((1, rows), float("nan"), dtype=torch.float32)
    launcher.norm_project(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], stored)
    launcher.norm_project(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], logits)
    assert torch.equal(logits, stored.float())


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_norm_swiglu(dtype_name, batch):
    k = SIM_SHAPES[dtype_name]
    a = inputs(batch, k, 2 * SIM_ROWS, dtype_name, seed=2)
    act = torch.full((batch, SIM_ROWS), float("nan"), dtype=a["hidden"].dtype)
    gemv(dtype_name).norm_swiglu(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], act)
    gate_up = rounded(norm_reference(a["hidden"], a["norm_weight"], 0.0, True, dtype_name) @ a["weight"].double().t(),
                      dtype_name)
    gate, up = gate_up[:, :SIM_ROWS], gate_up[:, SIM_ROWS:]
    expected = rounded(torch.nn.functional.silu(gate), dtype_name) * up  # activation.py's rounding
    assert_close_rel(act.double(), expected, tolerance(dtype_name))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_project_add_is_in_place(dtype_name, batch):
    k = SIM_SHAPES[dtype_name]
    a = inputs(batch, k, SIM_ROWS, dtype_name, seed=3)
    x = a["hidden"]
    residual = (torch.randn(batch, SIM_ROWS, generator=torch.Generator().manual_seed(4)) * 4).to(x.dtype)
    before = residual.clone()
    gemv(dtype_name).project_add(x, a["weight"], residual)
    product = rounded(x.double() @ a["weight"].double().t(), dtype_name)
    assert_close_rel(residual.double(), before.double() + product, tolerance(dtype_name))


def test_shape_mismatch_names_the_shapes():
    a = inputs(1, 72, SIM_ROWS, "float32", seed=5)
    out = torch.empty(1, SIM_ROWS + 1)
    with pytest.raises(ValueError, match=r"weight \(70, 72\), out \(1, 71\)"):
        gemv("float32").norm_project(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], out)


@pytest.mark.ptx
def test_sm90_ptx_keeps_buffers_in_registers():
    """Every kernel at batch 1 on Qwen3-8B's K: 16-byte weight loads, the staged x written and read 16
    bytes at a time in shared memory, no local memory (the chunk buffers stay in registers)."""
    compile_for_sm90(
        """
        from executor.kernels.gemv import build_gemv_kernel, STORE, RESIDUAL, SWIGLU
        for name in DTYPES:
            for epilogue, normed in ((STORE, True), (SWIGLU, True), (RESIDUAL, False)):
                kernel = build_gemv_kernel(build_codec(name), 1, 4096, epilogue, normed=normed, launch_bounds=(128, 4),
                                           paired=epilogue != RESIDUAL)  # as Gemv builds them
                text = ptx(kernel, arr(name, 2), arr(name, 1), arr(name, 2), arr(name, 2), types.float32,
                           types.float32)
                assert "ld.global.v4" in text and ".local" not in text, (name, epilogue)
                assert ("ld.shared.v4" in text) == normed, (name, epilogue)
                assert ("st.shared.v4" in text) == normed, (name, epilogue)
        logits = build_gemv_kernel(build_codec("bfloat16"), 1, 4096, STORE, normed=True, launch_bounds=(128, 4),
                                   paired=True, float32_out=True)  # the lm_head's float32 logits
        text = ptx(logits, arr("bfloat16", 2), arr("bfloat16", 1), arr("bfloat16", 2), arr("float32", 2),
                   types.float32, types.float32)
        assert "cvt.rn.bf16.f32" in text and ".local" not in text
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_qwen3_8b_shapes(batch):
    """bf16 at Qwen3-8B's projections: qkv (norm), gate_up (norm + SwiGLU), down (residual add)."""
    dev = torch.device("cuda")
    gemv = Gemv(build_codec("bfloat16"), True)  # a warp a row
    a = {name: t.to(dev) for name, t in inputs(batch, 4096, 6144, "bfloat16", seed=6).items()}
    out = torch.empty(batch, 6144, dtype=torch.bfloat16, device=dev)
    gemv.norm_project(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], out)
    normed = norm_reference(a["hidden"].cpu(), a["norm_weight"].cpu(), 0.0, True, "bfloat16")
    assert_close_rel(out.cpu().double(), normed @ a["weight"].cpu().double().t(), 1e-2)

    gate_up = (torch.randn(2 * 12288, 4096, device=dev) / 64).bfloat16()
    act = torch.empty(batch, 12288, dtype=torch.bfloat16, device=dev)
    gemv.norm_swiglu(a["hidden"], a["norm_weight"], EPS, 0.0, gate_up, act)
    projected = rounded(normed @ gate_up.cpu().double().t(), "bfloat16")
    expected = rounded(torch.nn.functional.silu(projected[:, :12288]), "bfloat16") * projected[:, 12288:]
    assert_close_rel(act.cpu().double(), expected, 1e-2)

    down = (torch.randn(4096, 12288, device=dev) / 110).bfloat16()
    residual = torch.randn(batch, 4096, device=dev).bfloat16()
    before = residual.cpu().double()
    gemv.project_add(act, down, residual)
    product = rounded(act.cpu().double() @ down.cpu().double().t(), "bfloat16")
    assert_close_rel(residual.cpu().double(), before + product, 1e-2)
