"""Property tests over random valid configs: the layout's invariants hold for all of them."""

from __future__ import annotations

import jsonschema
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from planner.kernel_limits import FLASH_HEAD_DIM_MULTIPLE
from planner.config import HardwareConfig, ModelConfig, ServingConfig
from planner.errors import PlanDoesNotFit
from planner.layout import ALIGNMENT_BYTES
from planner.plan import build_plan
from planner.schema import load_committed


@st.composite
def configs(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    group = draw(st.sampled_from([1, 2, 3, 5, 6, 8]))
    head_dim = draw(st.sampled_from([8, 16, 64, 128, 256]))
    hybrid = draw(st.booleans())
    layers = draw(st.integers(1, 12))
    model = dict(
        name="random", architecture="qwen3_5" if hybrid else "qwen3",
        hidden_size=draw(st.sampled_from([32, 96, 512, 2048])), num_layers=layers,
        intermediate_size=draw(st.integers(1, 8192)), num_attention_heads=kv_heads * group,
        num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=draw(st.integers(1, 200_000)),
        max_position_embeddings=draw(st.integers(64, 1 << 18)), tie_word_embeddings=draw(st.booleans()),
        dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        partial_rotary_factor=0.25 if hybrid else 1.0, attn_output_gate=hybrid,
    )
    if hybrid:
        hk = draw(st.sampled_from([1, 2, 4]))
        layers = model["num_layers"] = max(2, layers)
        kinds = [draw(st.sampled_from(["linear_attention", "full_attention"])) for _ in range(layers - 2)]
        model["layer_types"] = ("linear_attention", *kinds, "full_attention")
        model["linear_attention"] = dict(num_key_heads=hk, num_value_heads=hk * draw(st.integers(1, 3)),
                                         key_head_dim=draw(st.sampled_from([8, 128])),
                                         value_head_dim=draw(st.sampled_from([8, 128])))
    max_batch = draw(st.integers(1, 256))
    serving = dict(
        max_batch=max_batch, max_context=draw(st.integers(1, model["max_position_embeddings"])),
        page_size=draw(st.sampled_from([1, 4, 16, 64])), max_prefill_tokens=draw(st.integers(1, 16384)),
        gpu_memory_utilization=draw(st.floats(0.5, 1.0)), min_kv_pages=1, decode_graph_batch_sizes=(1,),
        states_per_slot=draw(st.integers(1, 2)), prefix_state_slots=draw(st.sampled_from([0, 1, 16, 4096])),
        gemm_attention_min_tokens=draw(st.sampled_from([1, 256, 1 << 20])),
    )
    if head_dim % FLASH_HEAD_DIM_MULTIPLE == 0 and model["dtype"] == "bfloat16":  # what the flash kernel runs
        serving["prefill_attention"] = draw(st.sampled_from(["gemm", "flash"]))
    hardware = dict(name="random", device_memory_bytes=draw(st.integers(1 << 30, 1 << 38)),
                    hbm_bandwidth_bytes_per_s=10**12, num_sms=100, compute_capability="9.0")
    return ModelConfig.model_validate(model), HardwareConfig.model_validate(hardware), ServingConfig.model_validate(serving)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
@example(case=(
    ModelConfig(name="random", architecture="qwen3", hidden_size=32, num_layers=9, intermediate_size=1,
                num_attention_heads=8, num_key_value_heads=8, head_dim=256, vocab_size=1, max_position_embeddings=64,
                rms_norm_eps=1e-06, rope_theta=1000000.0, dtype="bfloat16"),
    HardwareConfig(name="random", device_memory_bytes=1 << 30, device_memory_source="declared",
                   hbm_bandwidth_bytes_per_s=10**12, num_sms=100, compute_capability="9.0"),
    ServingConfig(max_batch=224, max_context=1, page_size=64, max_prefill_tokens=1, gpu_memory_utilization=1.0,
                  gemm_attention_min_tokens=1, prefill_attention="gemm", decode_graph_batch_sizes=(1,)),
)).via("a plan whose batch fits at no context: max_context_at_batch 0, not None")
def test_layout_invariants(case):
    model, hardware, serving = case
    try:
        plan = build_plan(model, hardware, serving)
    except PlanDoesNotFit:
        return
    for pool in plan.pools:
        fused_parts = {name for view in pool.fused for name in view.parts[1:]}
        for buffer in pool.buffers:
            if buffer.name not in fused_parts:  # fused parts follow their predecessor tightly
                assert buffer.offset % ALIGNMENT_BYTES == 0, (pool.name, buffer.name)
            assert buffer.offset + buffer.bytes <= pool.bytes, (pool.name, buffer.name)
        if pool.name in ("decode", "prefill"):
            peak = max(b.offset + b.bytes for b in pool.buffers)
            assert pool.bytes == -(-peak // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
            for a in pool.buffers:
                for b in pool.buffers:
                    live_together = a.live[0] <= b.live[1] and b.live[0] <= a.live[1]
                    if a is not b and live_together:
                        assert a.offset + a.bytes <= b.offset or b.offset + b.bytes <= a.offset, (a.name, b.name)
        elif pool.materialized:
            spans = sorted((b.offset, b.offset + b.bytes) for b in pool.buffers)
            assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    capacity = plan.capacity
    if plan.geometry.num_linear_layers:  # the requests' states, then the prefix cache's snapshots
        assert capacity.prefix_state_slots == serving.prefix_state_slots
        slots = capacity.recurrent_slots + capacity.prefix_state_slots
        assert plan.pool("recurrent_state").buffer("ssm_state").shape[1] == slots
    else:
        assert capacity.prefix_state_slots == 0
    budget = plan.budget
    assert budget.non_kv_bytes + budget.kv_bytes == sum(p.bytes for p in plan.pools)
    assert budget.non_kv_bytes + budget.kv_bytes + budget.free_bytes == budget.usable_bytes
    assert budget.free_bytes < max(1, plan.pool("kv_cache").bytes // max(1, plan.capacity.kv_pages)) + ALIGNMENT_BYTES
    jsonschema.validate(plan.model_dump(mode="json"), load_committed("plan"))
