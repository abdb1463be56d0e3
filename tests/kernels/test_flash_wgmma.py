"""Causal flash attention on warpgroup products against float64 attention (simulator at tiny shapes,
GPU at model sizes), through the same checks as the mma.sync kernel's (test_flash_attention.py)."""

from __future__ import annotations

import pytest
import torch

from executor.kernels.attention.flash import single_request
from executor.kernels.attention.flash_wgmma import (WarpgroupFlashAttention, WarpgroupShape, shared_bytes,
                                                    warpgroup_shape)
from executor.numba_cuda import simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.test_flash_attention import check_packed_launch, run_case

DEVICE = "cpu" if simulator_enabled() else "cuda"


def test_matches_float64_in_the_simulator():
    """Head dim 64, 32 keys a round, swizzled tiles (as Qwen3's head_dim 128 runs): a 70-row prompt takes
    two query blocks (the last launched first) and three key blocks (the online softmax rescales), the
    diagonal ones masked; GQA group 2."""
    run_case(70, 70, q_heads=2, kv_heads=1, head_dim=64, device=DEVICE,
             attention=WarpgroupFlashAttention(WarpgroupShape(keys=32, swizzle=True)))


def test_one_launch_serves_packed_chunks_and_skips_the_others():
    """Unswizzled tiles (the other layout), four key blocks before the second chunk's diagonal."""
    check_packed_launch(WarpgroupFlashAttention(WarpgroupShape(keys=32)), head_dim=64)


def test_shapes_and_errors():
    assert shared_bytes(256, warpgroup_shape(256)) == 96 * 1024  # Q, K and V tiles: two blocks an SM
    assert warpgroup_shape(256).swizzle and warpgroup_shape(128).swizzle and not warpgroup_shape(32).swizzle
    with pytest.raises(ValueError, match="multiple of 32"):
        WarpgroupShape(keys=48)
    with pytest.raises(ValueError, match="head_dim 96"):
        WarpgroupFlashAttention()(*_head_dim_96_arguments())


def _head_dim_96_arguments():
    q = torch.zeros((4, 2, 96), dtype=torch.int16)
    kv = torch.zeros((1, 6, 96), dtype=torch.int16)
    return (q, kv, kv, q.clone(), *(torch.as_tensor(a) for a in single_request(4, 6)), 0, 1, 4, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,kv_len,q_heads,kv_heads,head_dim,strided,shape", [
    (1031, 1031, 32, 8, 128, False, None),       # Qwen3-8B heads, a ragged prompt (warpgroup_shape's)
    (700, 4099, 32, 8, 128, False, None),        # a chunk after 3399 cached tokens
    (517, 517, 16, 4, 256, True, None),          # Qwen3.5-9B: D 256, gated (strided) q
    (2049, 2049, 16, 4, 256, True, WarpgroupShape(keys=32, overlap=True, swizzle=True)),
    (300, 1000, 8, 2, 256, False, WarpgroupShape(keys=128)),  # unswizzled
    (1031, 1031, 32, 8, 128, False, WarpgroupShape(swizzle=False)),
])
def test_matches_float64_at_model_sizes(rows, kv_len, q_heads, kv_heads, head_dim, strided, shape):
    run_case(rows, kv_len, q_heads, kv_heads, head_dim, "cuda", strided_q=strided,
             attention=WarpgroupFlashAttention(shape))


@pytest.mark.gpu
def test_packed_launch_on_the_gpu():
    check_packed_launch(WarpgroupFlashAttention(), head_dim=128)


@pytest.mark.ptx
def test_compiles_to_warpgroup_products_in_registers_on_sm90a():
    """Every product unrolled (D / 16 score products and keys / 16 value products a key block) and no
    local memory: an O or S accumulator indexed at run time would spill there."""
    compile_for_sm90(
        """
        from executor.kernels.attention.flash_wgmma import build_flash_wgmma, warpgroup_shape
        for head_dim, group in ((128, 4), (256, 4)):
            shape = warpgroup_shape(head_dim)
            kernel = build_flash_wgmma(head_dim, group, shape)
            argtypes = (*[arr("int32", 3)] * 4, arr("int32", 1), arr("int32", 1), types.int32, types.int32,
                        types.float32)
            text = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0, "a"))[0]
            assert text.count(f"wgmma.mma_async.sync.aligned.m64n{shape.keys}k16.f32.bf16.bf16") == head_dim // 16
            assert text.count(f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.bf16.bf16") == shape.keys // 16
            assert "cp.async.cg.shared.global" in text and "fence.proxy.async.shared::cta" in text
            assert ".local" not in text, f"head_dim {head_dim}: local memory"
        """
    )


def test_routing_sends_hopper_heads_to_the_warpgroup_kernel():
    from executor.routing import warpgroup_flash

    assert warpgroup_flash("9.0", 256) and warpgroup_flash("9.0", 128)
    assert not warpgroup_flash("8.0", 128) and not warpgroup_flash("12.0", 128)  # wgmma is sm_90a's only
    assert not warpgroup_flash("9.0", 96) and not warpgroup_flash("9.0", 32)


@pytest.mark.parametrize("model,hardware,warpgroup", [
    ("qwen3-8b", "h200", True), ("qwen3-8b", "h100-sxm", True), ("qwen3-8b", "a100-80gb", False),
])
def test_the_model_launchers_follow_the_plan_s_hardware(model, hardware, warpgroup):
    """A model's FlashAttention launcher is the warpgroup kernel exactly where its plan's GPU is a Hopper."""
    from executor.models.launchers import QWEN3_NORM, build_kernels
    from planner.loader import load_hardware, load_model, load_serving
    from planner.plan import build_plan

    plan = build_plan(load_model(model), load_hardware(hardware), load_serving("default", {"max_context": 4096}))
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, QWEN3_NORM, plan.hardware.num_sms,
                            plan.capacity.page_size, plan.hardware.compute_capability)
    assert isinstance(kernels.flash_attention, WarpgroupFlashAttention) == warpgroup
