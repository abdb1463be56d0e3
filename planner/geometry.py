"""Per-rank model geometry: the sizes every buffer builder and kernel launch uses.

Derived once from the frozen configs and carried in the plan, so the executor reads sizes instead
of computing them. Tensor parallelism over tp ranks shards the query heads, the intermediate size
and the linear-attention heads (each divides by tp), replicates the KV heads when tp exceeds them
(rank r holds KV head r // (tp / Hkv)), and shards the vocabulary in padded shards: each rank holds
ceil(V / tp) rows of the embedding and of lm_head, rank r the ids [r x shard, min((r + 1) x shard, V)),
the last ranks' tail rows padding. Every rank materializes the same per-rank plan; what differs
between ranks (the vocab slice) is named per rank here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner import checked
from planner.checked import I32
from planner.config import ModelConfig, ServingConfig


class Geometry(BaseModel):
    """Sizes of one tensor-parallel rank's share of the model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(description="H")
    num_layers: int = Field(description="L")
    layer_kinds: tuple[str, ...] = Field(description="full_attention | linear_attention per layer")
    layer_slots: tuple[int, ...] = Field(
        description="Per layer: its index among layers of its kind (KV-pool layer or recurrent-state layer)"
    )
    num_full_layers: int
    num_linear_layers: int
    num_q_heads: int = Field(description="Hq on this rank")
    num_kv_heads: int = Field(description="Hkv on this rank (replicated when tp > Hkv)")
    head_dim: int = Field(description="D")
    rotary_dim: int = Field(description="Dimensions of a head that RoPE rotates")
    gqa_group: int = Field(description="Hq / Hkv")
    q_proj_rows: int = Field(description="Rows of q_proj on this rank: Hq x D, doubled with an output gate")
    kv_proj_rows: int = Field(description="Rows of k_proj (and of v_proj) on this rank: Hkv x D")
    qkv_rows: int = Field(description="q_proj + k_proj + v_proj rows: width of the fused QKV output")
    attn_out_width: int = Field(description="Attention output width on this rank: Hq x D (o_proj's input)")
    intermediate_size: int = Field(description="I on this rank")
    gate_up_rows: int = Field(description="gate_proj + up_proj rows: 2 I, width of the fused MLP input GEMM")
    vocab_size: int = Field(description="Rows of the embedding and of lm_head on each rank: ceil(V / tp), the "
                            "padded vocab shard")
    tensor_parallel_size: int = Field(1, description="tp: ranks the model is sharded over")
    full_vocab_size: int = Field(0, description="V: ids of the whole vocabulary (the sampler's row length)")
    padded_vocab_size: int = Field(0, description="tp x vocab_size: columns of the gathered logits, padding "
                                   "included")
    vocab_slices: tuple[tuple[int, int], ...] = Field(
        (), description="Per rank: the ids [start, end) its embedding and lm_head rows hold, from its first row; "
        "rows past end - start are padding (zero)")
    linear_num_key_heads: int = Field(0, description="Hk on this rank")
    linear_num_value_heads: int = Field(0, description="Hv on this rank")
    linear_key_head_dim: int = Field(0, description="dk")
    linear_value_head_dim: int = Field(0, description="dv")
    conv_kernel_size: int = Field(0, description="K")
    conv_dim: int = Field(0, description="2 Hk dk + Hv dv: channels of the depthwise conv")
    linear_value_width: int = Field(0, description="Hv x dv: width of z, the delta-rule output and out_proj's input")
    linear_in_proj_rows: int = Field(0, description="in_proj_qkv + z + b + a rows: width of the fused projection")


def build_geometry(model: ModelConfig, serving: ServingConfig) -> Geometry:
    """The per-rank geometry; assumes ``check_compatible(model, serving)`` passed."""
    tp = serving.tensor_parallel_size
    vocab_shard = checked.ceil_div("vocab shard rows", model.vocab_size, tp, width=I32)
    kinds = model.kinds
    slots, seen = [], {"full_attention": 0, "linear_attention": 0}
    for kind in kinds:
        slots.append(seen[kind])
        seen[kind] += 1
    q_heads = model.num_attention_heads // tp
    kv_heads = max(1, model.num_key_value_heads // tp)
    head_dim = model.head_dim
    q_rows = checked.mul("q_proj rows", q_heads, head_dim, 2 if model.attn_output_gate else 1, width=I32)
    kv_rows = checked.mul("k_proj rows", kv_heads, head_dim, width=I32)
    fields: dict[str, int] = {}
    lin = model.linear_attention
    if lin is not None:
        hk, hv = lin.num_key_heads // tp, lin.num_value_heads // tp
        key_width = checked.mul("linear key width", hk, lin.key_head_dim, width=I32)
        value_width = checked.mul("linear value width", hv, lin.value_head_dim, width=I32)
        conv_dim = checked.add("conv_dim", key_width, key_width, value_width, width=I32)
        fields = {
            "linear_num_key_heads": hk,
            "linear_num_value_heads": hv,
            "linear_key_head_dim": lin.key_head_dim,
            "linear_value_head_dim": lin.value_head_dim,
            "conv_kernel_size": lin.conv_kernel_size,
            "conv_dim": conv_dim,
            "linear_value_width": value_width,
            "linear_in_proj_rows": checked.add("linear in_proj rows", conv_dim, value_width, hv, hv, width=I32),
        }
    return Geometry(
        hidden_size=model.hidden_size,
        num_layers=model.num_layers,
        layer_kinds=kinds,
        layer_slots=tuple(slots),
        num_full_layers=seen["full_attention"],
        num_linear_layers=seen["linear_attention"],
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=model.rotary_dim,
        gqa_group=q_heads // kv_heads,
        q_proj_rows=q_rows,
        kv_proj_rows=kv_rows,
        qkv_rows=checked.add("qkv rows", q_rows, kv_rows, kv_rows, width=I32),
        attn_out_width=checked.mul("attention output width", q_heads, head_dim, width=I32),
        intermediate_size=model.intermediate_size // tp,
        gate_up_rows=checked.mul("gate_up rows", 2, model.intermediate_size // tp, width=I32),
        vocab_size=vocab_shard,
        tensor_parallel_size=tp,
        full_vocab_size=model.vocab_size,
        padded_vocab_size=checked.mul("padded vocab", vocab_shard, tp, width=I32),
        vocab_slices=tuple((min(r * vocab_shard, model.vocab_size), min((r + 1) * vocab_shard, model.vocab_size))
                           for r in range(tp)),
        **fields,
    )
