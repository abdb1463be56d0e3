"""Transient buffers of a forward step, with live ranges over the stages of a layer.

One set of roles serves every layer of its kind: a step walks the layers and
reuses the same ``qkv``, ``gate_up``, ... buffers each time. ``hidden`` (the
residual stream, accumulated in place), ``normed`` and ``proj_out`` carry
values across stages and layers, so they live the whole step. The other roles
live only between the stage that writes them and the last stage that reads
them, so roles of full-attention layers, of linear-attention layers and of the
MLP share bytes (invariant 6, docs/design.md). The decode pool is this layout
at B rows, the prefill pool at T rows.
"""

from __future__ import annotations

from planner.geometry import Geometry
from planner.kernel_limits import DELTA_RULE_ROW_SCALARS
from planner.layout import BufferRequest, Pool, pack_by_lifetime

#: Stages of one step in execution order. A layer runs input_norm, then either
#: the attn.* or the linear.* stages, then post_norm and mlp.*; the last layer
#: is followed by final_norm and lm_head.
STAGES = (
    "embed",  # token_ids -> hidden
    "input_norm",  # hidden += proj_out (previous layer); normed = norm(hidden)
    "attn.qkv_proj",  # normed -> qkv
    "attn.rope_kv_write",  # q/k norm + RoPE in place in qkv; K, V -> KV pool
    "attn.attention",  # qkv (q) + KV pool -> attn_out
    "attn.output_gate",  # attn_out *= sigmoid(gate part of qkv) (Qwen3.5)
    "attn.o_proj",  # attn_out -> proj_out
    "linear.in_proj",  # normed -> in_proj [qkv | z | b | a]
    "linear.gates",  # in_proj b, a -> gate_g, gate_beta
    "linear.conv",  # in_proj qkv part + conv state -> conv_out
    "linear.delta_rule",  # conv_out, gates + ssm state -> delta_out
    "linear.gated_norm",  # delta_out, in_proj z -> gated_out
    "linear.out_proj",  # gated_out -> proj_out
    "post_norm",  # hidden += proj_out; normed = norm(hidden)
    "mlp.gate_up_proj",  # normed -> gate_up
    "mlp.act",  # gate_up -> act
    "mlp.down_proj",  # act -> proj_out
    "final_norm",  # hidden += proj_out; normed = norm(hidden)
    "lm_head",  # normed rows -> sampling pool
)

_STAGE = {name: index for index, name in enumerate(STAGES)}
_WHOLE_STEP = (0, len(STAGES) - 1)


def _live(first: str, last: str) -> tuple[int, int]:
    return (_STAGE[first], _STAGE[last])


def step_requests(geometry: Geometry, rows: int, dtype: str, kv_splits: int = 0, gather_tokens: int = 0,
                  score_elements: int = 0, delta_rule_chunk: int = 0) -> list[BufferRequest]:
    """Role buffers of a step of ``rows`` token rows (B for decode, T for prefill). ``kv_splits`` > 1
    adds the split-KV attention scratch (decode): float32 partial outputs and log-sum-exps of
    up to ``kv_splits`` kv chunks per row, merged into attn_out. ``gather_tokens`` > 0 adds the
    long-chunk attention scratch (prefill, either backend): one request's keys and values gathered
    from their pages, [Hkv, gather_tokens, D] each. ``score_elements`` > 0 adds GEMM attention's
    own scratch: the chunk's queries (then outputs) packed by kv head [Hkv, group x rows, D], and
    one tile's float32 scores and their probabilities (FlashAttention keeps both on chip).
    ``delta_rule_chunk`` > 0 adds the chunked delta rule's scratch (prefill, linear-attention layers):
    per row and value head, its chunk's row of the transform (I + A)^-1 and of the causal decayed
    q k^T, ``delta_rule_chunk`` values each in the activation dtype, and DELTA_RULE_ROW_SCALARS
    float32 factors, written by the rule's first pass and read by its second."""
    assert gather_tokens or not score_elements, "GEMM attention reads the gathered keys"
    g = geometry
    requests = [
        BufferRequest("token_ids", "int32", (rows,), _live("embed", "embed")),
        BufferRequest("hidden", dtype, (rows, g.hidden_size), _WHOLE_STEP),
        BufferRequest("normed", dtype, (rows, g.hidden_size), _WHOLE_STEP),
        BufferRequest("proj_out", dtype, (rows, g.hidden_size), _WHOLE_STEP),
        BufferRequest("gate_up", dtype, (rows, g.gate_up_rows), _live("mlp.gate_up_proj", "mlp.act")),
        BufferRequest("act", dtype, (rows, g.intermediate_size), _live("mlp.act", "mlp.down_proj")),
    ]
    if g.num_full_layers:
        requests += [
            BufferRequest("qkv", dtype, (rows, g.qkv_rows), _live("attn.qkv_proj", "attn.output_gate")),
            BufferRequest("attn_out", dtype, (rows, g.attn_out_width), _live("attn.attention", "attn.o_proj")),
        ]
        attention = _live("attn.attention", "attn.attention")  # the attention scratch
        if kv_splits > 1:
            requests += [
                BufferRequest("attn_partial_out", "float32", (rows, kv_splits, g.num_q_heads, g.head_dim), attention),
                BufferRequest("attn_partial_lse", "float32", (rows, kv_splits, g.num_q_heads), attention),
            ]
        if gather_tokens:
            gathered = (g.num_kv_heads, gather_tokens, g.head_dim)
            requests += [
                BufferRequest("attn_keys", dtype, gathered, attention),
                BufferRequest("attn_values", dtype, gathered, attention),
            ]
        if score_elements:
            requests += [
                BufferRequest("attn_packed", dtype, (rows, g.num_q_heads, g.head_dim), attention),
                BufferRequest("attn_scores", "float32", (score_elements,), attention),
                BufferRequest("attn_probs", dtype, (score_elements,), attention),
            ]
    if g.num_linear_layers:
        value_width, heads = g.linear_value_width, g.linear_num_value_heads
        requests += [
            BufferRequest("in_proj", dtype, (rows, g.linear_in_proj_rows), _live("linear.in_proj", "linear.gated_norm")),
            BufferRequest("conv_out", dtype, (rows, g.conv_dim), _live("linear.conv", "linear.delta_rule")),
            BufferRequest("gate_g", "float32", (rows, heads), _live("linear.gates", "linear.delta_rule")),
            BufferRequest("gate_beta", "float32", (rows, heads), _live("linear.gates", "linear.delta_rule")),
            BufferRequest("delta_out", dtype, (rows, value_width), _live("linear.delta_rule", "linear.gated_norm")),
            BufferRequest("gated_out", dtype, (rows, value_width), _live("linear.gated_norm", "linear.out_proj")),
        ]
        if delta_rule_chunk:
            rule = _live("linear.delta_rule", "linear.delta_rule")
            requests += [
                BufferRequest("delta_transform", dtype, (rows, heads, delta_rule_chunk), rule),
                BufferRequest("delta_gram", dtype, (rows, heads, delta_rule_chunk), rule),
                BufferRequest("delta_scalars", "float32", (rows, heads, DELTA_RULE_ROW_SCALARS), rule),
            ]
    return requests


def build_step_pool(name: str, geometry: Geometry, rows: int, dtype: str, kv_splits: int = 0,
                    gather_tokens: int = 0, score_elements: int = 0, delta_rule_chunk: int = 0) -> Pool:
    """A transient pool (``decode`` or ``prefill``) packed by live range."""
    return pack_by_lifetime(name, step_requests(geometry, rows, dtype, kv_splits, gather_tokens, score_elements,
                                                delta_rule_chunk))
