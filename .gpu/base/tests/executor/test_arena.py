"""The executor allocates exactly the plan: one allocation per pool, every view at its planned place."""

from __future__ import annotations

import pytest
import torch

from executor.arena import materialize
from executor.device import open_device
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5-g6"])
def test_views_are_the_plans_buffers(name):
    plan = build_plan(load_model(name), load_hardware("cpu-sim"), load_serving("sim"))
    arena = materialize(plan, open_device("auto"))
    materialized = [p for p in plan.pools if p.materialized]
    assert sorted(arena.pools) == sorted(p.name for p in materialized)
    assert arena.allocated_bytes == sum(p.bytes for p in materialized)
    for pool in materialized:
        raw = arena.pools[pool.name]
        assert raw.numel() == pool.bytes
        base = raw.data_ptr()
        expected = {b.name: b for b in (*pool.buffers, *pool.fused)}
        assert sorted(arena.names(pool.name)) == sorted(expected)
        for name, buffer in expected.items():
            view = arena.tensor(pool.name, name)
            assert view.data_ptr() - base == buffer.offset, (pool.name, name)
            assert view.numel() * view.element_size() == buffer.bytes, (pool.name, name)
            assert tuple(view.shape) == tuple(buffer.shape)
            assert str(view.dtype).removeprefix("torch.") == buffer.dtype
            assert view.is_contiguous()


def test_budget_only_pools_are_not_allocated():
    plan = build_plan(load_model("tiny-qwen3"), load_hardware("h200"), load_serving("sim"))
    runtime = plan.pool("runtime")
    assert not runtime.materialized and runtime.bytes > 0
    small = build_plan(load_model("tiny-qwen3"), load_hardware("cpu-sim"), load_serving("sim"))
    arena = materialize(small, open_device("auto"))
    assert "runtime" not in arena.pools


def test_fused_qkv_view_is_q_then_k_then_v():
    plan = build_plan(load_model("tiny-qwen3-g5"), load_hardware("cpu-sim"), load_serving("sim"))
    arena = materialize(plan, open_device("auto"))
    prefix = "model.layers.1.self_attn"
    parts = [arena.tensor("weights", f"{prefix}.{p}_proj.weight") for p in ("q", "k", "v")]
    for index, part in enumerate(parts):
        part.fill_(float(index + 1))
    fused = arena.tensor("weights", f"{prefix}.qkv_proj.weight")
    assert torch.equal(fused, torch.cat(parts))
