"""A plan larger than the GPU's free memory is refused before the arena is allocated, with the numbers a user
needs (what the plan materializes, what the card has free), instead of torch's out-of-memory traceback."""

from __future__ import annotations

from executor.serving import gpu_shortfall
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan

GIB = 2**30


def h200_plan():
    """Qwen3-8B as the H200's default serving config plans it (about 127 GB of a 141 GB card)."""
    hardware = load_hardware("h200")
    return build_plan(load_model("qwen3-8b"), hardware, load_serving(hardware.default_serving, {}))


def test_an_h200_plan_on_an_h100_names_both_sizes_and_the_way_out():
    plan = h200_plan()
    message = gpu_shortfall(plan, "NVIDIA H100 80GB HBM3", free_bytes=int(63.32 * GIB), total_bytes=int(79.18 * GIB))
    assert message is not None
    need = sum(pool.bytes for pool in plan.pools if pool.materialized)
    assert need > 100 * GIB  # the H200's plan
    assert f"{plan.model.name} on hardware h200" in message and f"({need:,} bytes)" in message
    assert "this GPU (NVIDIA H100 80GB HBM3) has 63.32 GiB free of 79.18 GiB" in message
    assert "--hardware" in message and "--gpu-memory-utilization" in message


def test_a_plan_within_the_free_memory_passes():
    plan = h200_plan()
    need = sum(pool.bytes for pool in plan.pools if pool.materialized)
    assert gpu_shortfall(plan, "NVIDIA H200", free_bytes=need, total_bytes=141 * 10**9) is None
    assert gpu_shortfall(plan, "NVIDIA H200", free_bytes=need - 1, total_bytes=141 * 10**9) is not None
