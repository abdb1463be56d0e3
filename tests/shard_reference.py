"""One tensor-parallel rank's share of each full HF tensor, cut with torch from HF's layout (tests only).

The reference the planner's weight shards (planner/shards.py) and the executor's shard loading are
compared with: written from how transformers' Qwen3 and Qwen3.5 modules lay out their projections
(heads reshaped and chunked), not from the planner's ranges.
"""

from __future__ import annotations

import torch

from planner.config import ModelConfig


def reference_shard(model: ModelConfig, name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank`` of ``tp``'s part of HF tensor ``name`` (full checkpoint shape ``full``)."""
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    hidden = model.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        shard = -(-model.vocab_size // tp)
        padded = torch.zeros(shard * tp, hidden, dtype=full.dtype)
        padded[: model.vocab_size] = full
        return padded.chunk(tp)[rank]
    if leaf.endswith("norm.weight"):
        return full
    heads, head_dim = model.num_attention_heads, model.head_dim
    if leaf == "self_attn.q_proj.weight":  # per head: D rows, or [q | gate] 2 D rows (Qwen3.5)
        return full.view(heads, -1, hidden).chunk(tp)[rank].reshape(-1, hidden)
    if leaf in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        kv_heads = full.view(model.num_key_value_heads, head_dim, hidden)
        replicas = max(1, tp // model.num_key_value_heads)  # tp > Hkv: each KV head on tp / Hkv ranks
        return kv_heads.repeat_interleave(replicas, dim=0).chunk(tp)[rank].reshape(-1, hidden)
    if leaf == "self_attn.o_proj.weight":
        return full.view(hidden, heads, head_dim).chunk(tp, dim=1)[rank].reshape(hidden, -1)
    if leaf in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return full.chunk(tp)[rank]
    if leaf in ("mlp.down_proj.weight", "linear_attn.out_proj.weight"):
        return full.chunk(tp, dim=1)[rank]
    if leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        lin = model.linear_attention
        key_width = lin.num_key_heads * lin.key_head_dim
        q, k, v = full.split([key_width, key_width, lin.num_value_heads * lin.value_head_dim])
        return torch.cat([part.chunk(tp)[rank] for part in (q, k, v)])
    if leaf in ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                "linear_attn.A_log", "linear_attn.dt_bias"):
        return full.chunk(tp)[rank]
    raise KeyError(f"no reference shard rule for {name}")
