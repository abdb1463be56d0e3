"""KV, recurrent-state and attention-plan pools against independent figures."""

from __future__ import annotations

import pytest

import planner.attention_plan as attention_plan
from planner.capacity import build_capacity
from planner.geometry import build_geometry
from planner.kv_cache import kv_bytes_per_token, recurrent_bytes_per_slot
from planner.layout import BufferRequest
from planner.loader import load_model, load_serving

MiB = 1 << 20


def _geometry(name: str):
    return build_geometry(load_model(name), load_serving("default"))


def test_kv_bytes_per_token_match_published_figures():
    assert kv_bytes_per_token(_geometry("qwen3-8b"), "bfloat16") == 147_456
    assert kv_bytes_per_token(_geometry("qwen3.5-4b"), "bfloat16") == 32_768


def test_recurrent_bytes_per_slot_match_published_figures():
    assert recurrent_bytes_per_slot(_geometry("qwen3.5-4b"), "bfloat16") == int(49.125 * MiB)
    per_slot_27b = recurrent_bytes_per_slot(_geometry("qwen3.5-27b"), "bfloat16")
    assert per_slot_27b / MiB == pytest.approx(146.8, abs=0.05)


def test_kv_pool_is_page_first_with_the_padding_page(plan_for):
    plan = plan_for("qwen3-8b")
    kv = plan.pool("kv_cache").buffer("kv_cache")
    assert kv.shape == (plan.capacity.kv_pages, 36, 2, 16, 8, 128)
    assert plan.capacity.kv_tokens == (plan.capacity.kv_pages - 1) * 16


def test_recurrent_pool_has_a_slot_per_request_and_state_then_the_snapshots(plan_for):
    plan = plan_for("qwen3.5-4b", states_per_slot=2, prefix_state_slots=5)
    pool = plan.pool("recurrent_state")
    assert plan.capacity.prefix_state_slots == 5
    assert pool.buffer("ssm_state").shape[1] == 2 * plan.capacity.max_batch + 5
    assert pool.buffer("conv_state").shape[1] == 2 * plan.capacity.max_batch + 5
    no_snapshots = plan_for("qwen3.5-4b", states_per_slot=2, prefix_state_slots=0)
    assert no_snapshots.pool("recurrent_state").buffer("ssm_state").shape[1] == 2 * plan.capacity.max_batch
    one_state = pool.buffer("ssm_state").bytes // pool.buffer("ssm_state").shape[1]
    assert no_snapshots.pool("recurrent_state").bytes < pool.bytes - 4 * one_state  # the snapshots are planned bytes


def test_a_model_without_linear_attention_plans_no_snapshot(plan_for):
    plan = plan_for("qwen3-0.6b", prefix_state_slots=32)
    assert plan.capacity.prefix_state_slots == 0 and plan.capacity.recurrent_slots == 0
    assert all(p.name != "recurrent_state" for p in plan.pools)


def _capacity(**overrides):
    values = dict(max_batch=8, max_context=1000, page_size=16, max_prefill_tokens=512, gqa_group=4,
                  recurrent_slots_per_request=0)
    return build_capacity(**{**values, **overrides})


def test_attention_plan_has_the_eleven_buffers_sized_by_capacity():
    capacity = _capacity()
    pool = attention_plan.build_attention_plan(capacity)
    lengths = {b.name: b.shape[0] for b in pool.buffers}
    assert len(lengths) == 11
    assert lengths["page_indices"] == 8 * 63  # ceil(1000 / 16) pages per request
    assert lengths["positions"] == 512 + 7
    assert lengths["request_indices"] == (512 + 7) * 4
    assert pool.buffer("total_num_rows").dtype == "uint32"


def test_attention_plan_bytes_come_from_the_same_lengths(monkeypatch):
    """Lengthen one buffer in the layout: the pool's bytes must grow by exactly its bytes."""
    capacity = _capacity()
    before = attention_plan.build_attention_plan(capacity)
    original = attention_plan.attention_plan_requests

    def longer(cap):
        requests = original(cap)
        first = requests[0]
        return [BufferRequest(first.name, first.dtype, (first.shape[0] + 1024,)), *requests[1:]]

    monkeypatch.setattr(attention_plan, "attention_plan_requests", longer)
    after = attention_plan.build_attention_plan(capacity)
    assert after.bytes - before.bytes == 1024 * 4
    assert after.buffer("page_indices").bytes - before.buffer("page_indices").bytes == 1024 * 4


def test_logical_pages_count_shared_prefix_pages_per_request():
    """B requests at full context that share a prefix list B x ceil(C/S) entries, not unique pages."""
    capacity = _capacity(max_batch=4, max_context=64, page_size=16)
    shared_prefix = [1, 2, 3]  # physical pages every request lists
    page_tables = [shared_prefix + [4 + r] for r in range(4)]  # each request: 64 tokens = 4 pages
    entries = sum(len(t) for t in page_tables)
    unique = len({p for t in page_tables for p in t})
    assert entries == capacity.logical_pages == 16
    assert unique == 7 < capacity.logical_pages


def test_gemm_attention_scratch_is_bounded_and_shares_bytes_with_the_mlp(plan_for):
    """Qwen3-8B, default serving at C = 8192 (T = 2048 + 63): a whole step's scores (32 heads x T x C
    = 553 M) are capped at 2^26, which still holds one row's whole context (32 x 8192); the
    scratch lives only at the attention stage, so it reuses some of the MLP's bytes."""
    plan = plan_for("qwen3-8b", prefill_attention="gemm", max_context=8192)
    assert plan.capacity.prefill_score_elements == 1 << 26
    prefill = plan.pool("prefill")
    scratch = {b.name: b for b in prefill.buffers if b.name.startswith("attn_") and b.name != "attn_out"}
    assert set(scratch) == {"attn_packed", "attn_keys", "attn_values", "attn_scores", "attn_probs"}
    assert scratch["attn_keys"].shape == (8, 8192, 128)
    assert scratch["attn_scores"].bytes == 4 << 26 and scratch["attn_probs"].bytes == 2 << 26
    without = plan_for("qwen3-8b", prefill_attention="gemm", max_context=8192, gemm_attention_min_tokens=4096)  # longer than any chunk: no GEMM attention
    assert without.capacity.prefill_score_elements == 0
    assert not any(b.name.startswith("attn_") and b.name != "attn_out" for b in without.pool("prefill").buffers)
    # The pool grows by less than the scratch: it overlaps the MLP roles' bytes.
    growth = prefill.bytes - without.pool("prefill").bytes
    assert 0 < growth < sum(b.bytes for b in scratch.values())
    assert "attn_scores" not in {b.name for b in plan.pool("decode").buffers}


def test_gemm_attention_scores_never_hold_less_than_one_rows_context(plan_for):
    plan = plan_for("qwen3-32b", prefill_attention="gemm", max_context=40960, max_prefill_tokens=256)  # 64 heads x 40960 x 319 > 2^26
    assert plan.capacity.prefill_score_elements == 1 << 26
    small = build_capacity(max_batch=1, max_context=1 << 20, page_size=16, max_prefill_tokens=16, gqa_group=8,
                           recurrent_slots_per_request=0, num_q_heads=128, gemm_attention_min_tokens=16)
    assert small.prefill_score_elements == 128 << 20  # one row's context (2^27) beats the 2^26 cap


def test_chunked_delta_rule_scratch_is_planned_for_bf16_qwen3_5_prefill_only(plan_for):
    """Qwen3.5-9B bf16 (default serving, T = 2048 + 63 rows): the prefill pool holds each row's chunk row
    of the transform and of the Gram products (64 bf16 a value head, 32 heads) and 8 float32 factors,
    live only at the delta rule; the decode pool, a float32 plan and Qwen3-8B hold none."""
    plan = plan_for("qwen3.5-9b")
    rows = plan.capacity.max_tokens_per_step
    assert (plan.capacity.delta_rule_chunk, rows) == (64, 2111)
    scratch = {b.name: b for b in plan.pool("prefill").buffers if b.name.startswith("delta_") and b.name != "delta_out"}
    assert {name: (b.dtype, b.shape, b.bytes) for name, b in scratch.items()} == {
        "delta_transform": ("bfloat16", (2111, 32, 64), 2111 * 32 * 64 * 2),
        "delta_gram": ("bfloat16", (2111, 32, 64), 2111 * 32 * 64 * 2),
        "delta_scalars": ("float32", (2111, 32, 8), 2111 * 32 * 8 * 4),
    }
    assert all(b.live == scratch["delta_gram"].live for b in scratch.values())
    assert not any(b.name in scratch for b in plan.pool("decode").buffers)
    for other in (plan_for("qwen3.5-9b", dtype="float32"), plan_for("qwen3-8b")):
        assert other.capacity.delta_rule_chunk == 0
        assert not any(b.name in scratch for b in other.pool("prefill").buffers)
