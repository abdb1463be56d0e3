"""The tensor-core decode projections (gemv_mma.py) against float64 references: the simulator at
tiny shapes (K split over two warps with a trip past the last unit, more tiles than a warp's
share, batch rows up to all 8 of B's columns), bf16 on the GPU at Qwen3-8B's shapes."""

from __future__ import annotations

import pytest
import torch

from executor.kernels.gemv_mma import GemvMma, split_warps
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import assert_close_rel, rounded
from tests.kernels.test_gemv import EPS, inputs, norm_reference

SIM_K = 96  # 3 units: two warps of one unit a trip take two trips, the second half empty
SIM_ROWS = 48  # 3 tiles of 16


def gemv(round_before_weight: bool = True) -> GemvMma:
    return GemvMma(round_before_weight, units_per_trip=1, warps=2)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("style", [(0.0, True), (1.0, False)], ids=["qwen3", "zero-centred"])
def test_norm_project(style, batch):
    offset, round_before = style
    a = inputs(batch, SIM_K, SIM_ROWS, "bfloat16", seed=11)
    out = torch.full((batch, SIM_ROWS), float("nan"), dtype=torch.bfloat16)
    gemv(round_before).norm_project(a["hidden"], a["norm_weight"], EPS, offset, a["weight"], out)
    normed = norm_reference(a["hidden"], a["norm_weight"], offset, round_before, "bfloat16")
    assert_close_rel(out.double(), normed @ a["weight"].double().t(), 1e-2)


@pytest.mark.parametrize("batch", [2, 8])
def test_norm_swiglu(batch):
    a = inputs(batch, SIM_K, 2 * SIM_ROWS, "bfloat16", seed=12)
    act = torch.full((batch, SIM_ROWS), float("nan"), dtype=torch.bfloat16)
    gemv().norm_swiglu(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], act)
    gate_up = rounded(norm_reference(a["hidden"], a["norm_weight"], 0.0, True, "bfloat16") @ a["weight"].double().t(),
                      "bfloat16")
    expected = rounded(torch.nn.functional.silu(gate_up[:, :SIM_ROWS]), "bfloat16") * gate_up[:, SIM_ROWS:]
    assert_close_rel(act.double(), expected, 1e-2)


@pytest.mark.parametrize("batch", [1, 5])
def test_project_add_is_in_place(batch):
    a = inputs(batch, SIM_K, SIM_ROWS, "bfloat16", seed=13)
    x = a["hidden"]
    residual = (torch.randn(batch, SIM_ROWS, generator=torch.Generator().manual_seed(14)) * 4).bfloat16()
    before = residual.clone()
    gemv().project_add(x, a["weight"], residual)
    product = rounded(x.double() @ a["weight"].double().t(), "bfloat16")
    assert_close_rel(residual.double(), before.double() + product, 1e-2)


def test_shape_errors_name_the_limits():
    a = inputs(9, SIM_K, SIM_ROWS, "bfloat16", seed=15)
    with pytest.raises(ValueError, match=r"x \(9, 96\).*need 1\.\.8 rows"):
        gemv().norm_project(a["hidden"], a["norm_weight"], EPS, 0.0, a["weight"], torch.empty(9, SIM_ROWS).bfloat16())
    with pytest.raises(ValueError, match=r"output rows a multiple of 16"):
        gemv().project_add(a["hidden"][:1], a["weight"][:40], torch.empty(1, 40).bfloat16())


def test_split_warps_keeps_every_tile_resident():
    """Qwen3-8B's projections on 132 SMs, and the limits: at most 8 warps, none without a unit."""
    assert [split_warps(tiles, 128, 132) for tiles in (384, 256, 768)] == [4, 8, 2]
    assert split_warps(256, 384, 132) == 8  # down: K 12288
    assert split_warps(2, 1, 132) == 1  # one unit: one warp
    assert split_warps(10_000, 128, 132) == 1
    for tiles in (1, 37, 384, 1000):
        warps = split_warps(tiles, 128, 132)
        assert warps == 1 or tiles * warps <= 16 * 132


def test_sm90_ptx_has_no_local_memory():
    """Every kernel at batch 8 on Qwen3-8B's K: 16-byte weight loads, mma.sync, no local memory."""
    compile_for_sm90(
        """
        from executor.kernels.gemv_mma import build_gemv_mma_kernel, STORE, RESIDUAL, SWIGLU
        for epilogue, normed, k, warps, units in ((STORE, True, 4096, 4, 8), (SWIGLU, True, 4096, 2, 4),
                                                  (RESIDUAL, False, 4096, 8, 8), (RESIDUAL, False, 12288, 8, 8)):
            kernel = build_gemv_mma_kernel(8, k, epilogue, normed=normed, round_before_weight=True, warps=warps,
                                           units_per_trip=units)
            text = ptx(kernel, arr("bfloat16", 2), arr("bfloat16", 1), arr("bfloat16", 2), arr("bfloat16", 2),
                       types.float32, types.float32)
            assert "ld.global.v4" in text and "mma.sync" in text and ".local" not in text, epilogue
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_gpu_qwen3_8b_shapes(batch):
    """bf16 at Qwen3-8B's projections: qkv (norm), gate_up (norm + SwiGLU), down (residual add)."""
    dev = torch.device("cuda")
    gemv = GemvMma(True)
    a = {name: t.to(dev) for name, t in inputs(batch, 4096, 6144, "bfloat16", seed=16).items()}
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
