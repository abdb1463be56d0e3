"""planner.ideal_time against counts made by hand from the tiny configs' sizes (configs/models/tiny-*.yaml).

tiny-qwen3: H 64, I 128, Hq 4, Hkv 2, D 16, V 256, 2 full layers, untied, float32.
tiny-qwen3.5: the same widths; layer 0 linear (Hk 2, Hv 4, dk = dv = 8, conv kernel 4), layer 1 full with
the output gate (q_proj 2 x Hq x D rows), untied, float32.
"""

from __future__ import annotations

import pytest

from planner.ideal_time import ModelCosts, StepWork, step_ideal_s, workload_cost

# tiny-qwen3, per layer: q 64x64 + k 32x64 + v 32x64 + o 64x64 + gate, up 128x64 + down 64x128.
QWEN3_PROJECTIONS = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)  # 73,728
QWEN3_LM_HEAD = 256 * 64
# Q K^T and P V over 4 heads of 16 dims: 2 x 64 multiply-adds a (query, key) pair, a layer, 2 layers.
QWEN3_FLOPS_PER_PAIR = 2 * 2 * (2 * 64)  # 512
# Float32 bytes of every weight but the embedding: per layer the projections above, q/k norms (16 each)
# and two layer norms (64 each); then the final norm (64) and lm_head.
QWEN3_DECODE_WEIGHT_BYTES = 4 * (QWEN3_PROJECTIONS + 2 * (16 + 16 + 64 + 64) + 64 + QWEN3_LM_HEAD)  # 361,984
QWEN3_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x K|V x Hkv x D x float32 = 512


def qwen3_prefill_flops(tokens: int, pairs: int, requests: int) -> int:
    return 2 * QWEN3_PROJECTIONS * tokens + QWEN3_FLOPS_PER_PAIR * pairs + requests * 2 * QWEN3_LM_HEAD


def test_qwen3_costs_are_the_hand_counts(plan_for):
    costs = ModelCosts.of(plan_for("tiny-qwen3", "cpu-sim", "sim"))
    assert costs.projection_weights == QWEN3_PROJECTIONS
    assert costs.lm_head_weights == QWEN3_LM_HEAD
    assert costs.decode_weight_bytes == QWEN3_DECODE_WEIGHT_BYTES
    assert costs.kv_bytes_per_token == QWEN3_KV_BYTES_PER_TOKEN
    assert costs.attention_flops_per_pair == QWEN3_FLOPS_PER_PAIR
    assert (costs.state_bytes_per_row, costs.linear_flops_per_token) == (0, 0)


def test_qwen3_workload_prefill_and_decode_steps(plan_for):
    """max_batch 2, requests (prompt, output) A (4, 3), B (2, 2), C (6, 4) in that order. Decode rows (a
    request's first token comes from its prefill) and the keys each sees: A 5, 6; B 3; C 7, 8, 9.
    Step 1: A 5 + B 3; B finishes, C joins. Step 2: A 6 + C 7; A finishes. Step 3: C 8. Step 4: C 9."""
    plan = plan_for("tiny-qwen3", "cpu-sim", "sim", max_batch=2)
    cost = workload_cost(plan, [(4, 3), (2, 2), (6, 4)])
    assert cost.prefill_tokens == 12
    pairs = (1 + 2 + 3 + 4) + (1 + 2) + (1 + 2 + 3 + 4 + 5 + 6)  # causal keys of every prompt position
    assert cost.prefill_flops == qwen3_prefill_flops(12, pairs, 3)
    rows_and_keys = [(2, 5 + 3), (2, 6 + 7), (1, 8), (1, 9)]
    assert [step.rows for step in cost.steps] == [rows for rows, _ in rows_and_keys]
    assert [step.bytes for step in cost.steps] == [QWEN3_DECODE_WEIGHT_BYTES + keys * QWEN3_KV_BYTES_PER_TOKEN
                                                   for _, keys in rows_and_keys]
    assert [step.flops for step in cost.steps] == [qwen3_prefill_flops(rows, keys, rows)
                                                   for rows, keys in rows_and_keys]


def test_shared_prefix_is_computed_once(plan_for):
    """Prefix 4: the first prompt computes all 6 positions; the second computes positions 4 and 5; the third
    (4 tokens, all prefix) still computes its last position, 3, for its logits."""
    plan = plan_for("tiny-qwen3", "cpu-sim", "sim")
    cost = workload_cost(plan, [(6, 1), (6, 1), (4, 1)], shared_prefix=4)
    assert cost.prefill_tokens == 6 + 2 + 1
    pairs = (1 + 2 + 3 + 4 + 5 + 6) + (5 + 6) + 4
    assert cost.prefill_flops == qwen3_prefill_flops(9, pairs, 3)
    assert cost.steps == ()  # one output token each: all from prefill


def test_qwen3_5_linear_layers_add_state_traffic_and_delta_rule_flops(plan_for):
    costs = ModelCosts.of(plan_for("tiny-qwen3.5", "cpu-sim", "sim"))
    mlp = 3 * 128 * 64
    linear_layer = 64 * 64 + 32 * 64 + 4 * 64 + 4 * 64 + 64 * 32 + mlp  # in_proj qkv, z, b, a; out_proj
    full_layer = 128 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + mlp  # q (with its gate half), k, v, o
    assert costs.projection_weights == linear_layer + full_layer
    assert costs.attention_flops_per_pair == 2 * 2 * 4 * 16  # one full layer
    assert costs.linear_flops_per_token == 2 * 3 * 4 * 8 * 8  # S^T k, k delta^T, S^T q over Hv 4 of 8 x 8
    # a slot: float32 state 4 x 8 x 8 and conv state conv_dim 64 x 3 float32, read and written
    assert costs.state_bytes_per_row == 2 * (4 * 8 * 8 * 4 + 64 * 3 * 4)
    assert costs.kv_bytes_per_token == 2 * 2 * 16 * 4  # one full layer
    (step,) = workload_cost(plan_for("tiny-qwen3.5", "cpu-sim", "sim"), [(3, 2)]).steps
    assert step.bytes == costs.decode_weight_bytes + 4 * costs.kv_bytes_per_token + costs.state_bytes_per_row


def test_tied_embedding_is_read_as_lm_head(plan_for):
    """tiny-qwen3-g5 (tied): H 32, I 64, Hq 20, Hkv 4, D 8, V 128, 2 layers."""
    costs = ModelCosts.of(plan_for("tiny-qwen3-g5", "cpu-sim", "sim"))
    assert costs.lm_head_weights == 128 * 32
    layer = 160 * 32 + 2 * 32 * 32 + 32 * 160 + 3 * 64 * 32 + 8 + 8 + 32 + 32  # projections, q/k and layer norms
    assert costs.decode_weight_bytes == 4 * (2 * layer + 32 + 128 * 32)  # final norm and the table, once


def test_qwen3_8b_projection_weights(plan_for):
    """Qwen3-8B: 36 layers of q, o 4096 x 4096, k, v 1024 x 4096, gate, up, down 12288 x 4096."""
    costs = ModelCosts.of(plan_for("qwen3-8b"))
    assert costs.projection_weights == 36 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 12288 * 4096)
    assert costs.lm_head_weights == 151936 * 4096


def test_ideal_seconds_take_the_larger_bound_of_each_decode_step(plan_for):
    plan = plan_for("tiny-qwen3", "cpu-sim", "sim", max_batch=2)
    cost = workload_cost(plan, [(4, 3), (2, 2), (6, 4)])
    byte_s = [(QWEN3_DECODE_WEIGHT_BYTES + keys * QWEN3_KV_BYTES_PER_TOKEN) / 1e6 for keys in (8, 13, 8, 9)]
    # 1 GFLOP/s and 1 MB/s: a step's bytes take ~0.36 s, its FLOPs ~0.15-0.3 ms x rows: memory bound
    ideal = cost.ideal(matmul_flops_per_s=1e9, copy_bytes_per_s=1e6)
    assert ideal.prefill_s == pytest.approx(cost.prefill_flops / 1e9)
    assert ideal.decode_s == pytest.approx(sum(byte_s))
    assert (ideal.decode_steps, ideal.compute_bound_steps) == (4, 0)
    assert ideal.total_s == pytest.approx(ideal.prefill_s + ideal.decode_s)
    flop_bound = cost.ideal(matmul_flops_per_s=1e3, copy_bytes_per_s=1e12)
    assert flop_bound.compute_bound_steps == 4
    assert flop_bound.decode_s == pytest.approx(sum(step.flops for step in cost.steps) / 1e3)


def test_a_step_is_priced_as_its_prefill_plus_its_decode_rows(plan_for):
    """A step of two decode rows reading 5 and 3 keys beside a 3-token chunk at positions 2-4 (3 + 4 + 5 keys)
    that ends its prompt, at 1 GFLOP/s and 1 MB/s: the chunk's FLOPs, then the decode rows' bytes (every weight
    once and 8 tokens of KV), which take longer than their FLOPs."""
    costs = ModelCosts.of(plan_for("tiny-qwen3", "cpu-sim", "sim"))
    work = StepWork(prefill_tokens=3, prefill_pairs=12, prefill_sampled=1, decode_rows=2, decode_context=8)
    prefill_s = qwen3_prefill_flops(3, 12, 1) / 1e9
    decode_s = (QWEN3_DECODE_WEIGHT_BYTES + 8 * QWEN3_KV_BYTES_PER_TOKEN) / 1e6
    assert step_ideal_s(costs, work, 1e9, 1e6) == pytest.approx(prefill_s + decode_s)
    assert step_ideal_s(costs, StepWork(prefill_tokens=3, prefill_pairs=12), 1e9, 1e6) == \
        pytest.approx(qwen3_prefill_flops(3, 12, 0) / 1e9)  # a chunk mid-prompt: no lm_head row
    compute_bound = step_ideal_s(costs, StepWork(decode_rows=2, decode_context=8), 1e3, 1e12)
    assert compute_bound == pytest.approx(qwen3_prefill_flops(2, 8, 2) / 1e3)


def test_a_workload_run_as_its_own_decode_steps_costs_its_ideal(plan_for):
    """Pricing the ideal's own schedule step by step (one prefill step, then its decode steps) gives its ideal."""
    plan = plan_for("tiny-qwen3", "cpu-sim", "sim", max_batch=2)
    requests = [(4, 3), (2, 2), (6, 4)]
    ideal = workload_cost(plan, requests).ideal(1e9, 1e6)
    costs = ModelCosts.of(plan)
    prefill = StepWork(prefill_tokens=12, prefill_pairs=10 + 3 + 21, prefill_sampled=3)
    decode = [StepWork(decode_rows=rows, decode_context=keys) for rows, keys in [(2, 8), (2, 13), (1, 8), (1, 9)]]
    assert sum(step_ideal_s(costs, w, 1e9, 1e6) for w in [prefill, *decode]) == pytest.approx(ideal.total_s)


@pytest.mark.parametrize(("requests", "prefix", "message"), [
    ([], 0, "no requests"),
    ([(0, 4)], 0, "request 0"),
    ([(4, 0)], 0, "request 0"),
    ([(4, 2), (3, 2)], 4, "shared_prefix 4"),
])
def test_bad_workloads_are_refused(plan_for, requests, prefix, message):
    with pytest.raises(ValueError, match=message):
        workload_cost(plan_for("tiny-qwen3", "cpu-sim", "sim"), requests, shared_prefix=prefix)


def test_rates_must_be_positive(plan_for):
    cost = workload_cost(plan_for("tiny-qwen3", "cpu-sim", "sim"), [(2, 2)])
    with pytest.raises(ValueError, match="rates must be > 0"):
        cost.ideal(0.0, 1e9)
