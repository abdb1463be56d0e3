"""The weights pool: every tensor of the HF checkpoint by its HF name and per-rank shape.

Projections that one GEMM reads together are placed back to back and exposed
as a fused view (``...self_attn.qkv_proj.weight``, ``...mlp.gate_up_proj.weight``,
``...linear_attn.in_proj.weight``), so the executor runs one GEMM where HF runs
three or four, without copying weights.
"""

from __future__ import annotations

from planner.geometry import Geometry
from planner.layout import BufferRequest, Pool, pack_sequential

#: Kept in float32 whatever the weight dtype: the decay gate g is computed in fp32.
FLOAT32_WEIGHTS = ("A_log", "dt_bias")


def build_weights(geometry: Geometry, dtype: str, tie_word_embeddings: bool) -> Pool:
    """The weights pool of one rank. Shapes are HF's ``[out_features, in_features]``."""
    g = geometry
    requests = [BufferRequest("model.embed_tokens.weight", dtype, (g.vocab_size, g.hidden_size))]
    fused: dict[str, tuple[int, ...]] = {}
    for layer, kind in enumerate(g.layer_kinds):
        prefix = f"model.layers.{layer}"
        mixer = _full_attention(g, prefix, dtype) if kind == "full_attention" else _linear_attention(g, prefix, dtype)
        requests += mixer
        requests += _mlp(g, prefix, dtype)
        requests += [
            BufferRequest(f"{prefix}.input_layernorm.weight", dtype, (g.hidden_size,)),
            BufferRequest(f"{prefix}.post_attention_layernorm.weight", dtype, (g.hidden_size,)),
        ]
        if kind == "full_attention":
            fused[f"{prefix}.self_attn.qkv_proj.weight"] = (g.qkv_rows, g.hidden_size)
        else:
            fused[f"{prefix}.linear_attn.in_proj.weight"] = (g.linear_in_proj_rows, g.hidden_size)
        fused[f"{prefix}.mlp.gate_up_proj.weight"] = (g.gate_up_rows, g.hidden_size)
    requests.append(BufferRequest("model.norm.weight", dtype, (g.hidden_size,)))
    if not tie_word_embeddings:
        requests.append(BufferRequest("lm_head.weight", dtype, (g.vocab_size, g.hidden_size)))
    return pack_sequential("weights", requests, fused)


def _full_attention(g: Geometry, prefix: str, dtype: str) -> list[BufferRequest]:
    attn, group = f"{prefix}.self_attn", f"{prefix}.self_attn.qkv_proj.weight"
    return [
        BufferRequest(f"{attn}.q_proj.weight", dtype, (g.q_proj_rows, g.hidden_size), group=group),
        BufferRequest(f"{attn}.k_proj.weight", dtype, (g.kv_proj_rows, g.hidden_size), group=group),
        BufferRequest(f"{attn}.v_proj.weight", dtype, (g.kv_proj_rows, g.hidden_size), group=group),
        BufferRequest(f"{attn}.o_proj.weight", dtype, (g.hidden_size, g.attn_out_width)),
        BufferRequest(f"{attn}.q_norm.weight", dtype, (g.head_dim,)),
        BufferRequest(f"{attn}.k_norm.weight", dtype, (g.head_dim,)),
    ]


def _linear_attention(g: Geometry, prefix: str, dtype: str) -> list[BufferRequest]:
    attn, group = f"{prefix}.linear_attn", f"{prefix}.linear_attn.in_proj.weight"
    value_width, heads = g.linear_value_width, g.linear_num_value_heads
    return [
        BufferRequest(f"{attn}.in_proj_qkv.weight", dtype, (g.conv_dim, g.hidden_size), group=group),
        BufferRequest(f"{attn}.in_proj_z.weight", dtype, (value_width, g.hidden_size), group=group),
        BufferRequest(f"{attn}.in_proj_b.weight", dtype, (heads, g.hidden_size), group=group),
        BufferRequest(f"{attn}.in_proj_a.weight", dtype, (heads, g.hidden_size), group=group),
        BufferRequest(f"{attn}.conv1d.weight", dtype, (g.conv_dim, 1, g.conv_kernel_size)),
        BufferRequest(f"{attn}.A_log", "float32", (heads,)),
        BufferRequest(f"{attn}.dt_bias", "float32", (heads,)),
        BufferRequest(f"{attn}.norm.weight", dtype, (g.linear_value_head_dim,)),
        BufferRequest(f"{attn}.out_proj.weight", dtype, (g.hidden_size, value_width)),
    ]


def _mlp(g: Geometry, prefix: str, dtype: str) -> list[BufferRequest]:
    mlp, group = f"{prefix}.mlp", f"{prefix}.mlp.gate_up_proj.weight"
    return [
        BufferRequest(f"{mlp}.gate_proj.weight", dtype, (g.intermediate_size, g.hidden_size), group=group),
        BufferRequest(f"{mlp}.up_proj.weight", dtype, (g.intermediate_size, g.hidden_size), group=group),
        BufferRequest(f"{mlp}.down_proj.weight", dtype, (g.hidden_size, g.intermediate_size)),
    ]
