"""Weight shards: which part of each full HF tensor one tensor-parallel rank's planned weight holds.

Every rank materializes the same per-rank weights pool (planner/weights.py); what differs is where
its rows and columns come from. ``weight_shards(model, geometry, rank)`` names, for every planned
weight, the full checkpoint tensor's shape and the index ranges along one axis whose concatenation
fills the planned view from its start (the rest of the view, a padded vocab shard's tail, is zero):

- column-parallel (axis 0, the output rows): q_proj by query heads (Qwen3.5's per-head [q | gate]
  rows move together), k_proj / v_proj by KV heads (the one KV head its query heads read when tp
  exceeds Hkv), gate_proj and up_proj by intermediate rows; Qwen3.5's in_proj_qkv and conv1d by key
  heads in each of their q and k parts and by value heads in their v part (HF concatenates
  [q | k | v] over all heads: three ranges), in_proj_z by value heads, in_proj_b, in_proj_a, A_log
  and dt_bias by value heads;
- row-parallel (axis 1, the input columns): o_proj, down_proj, linear-attention out_proj;
- vocab-parallel (axis 0): the embedding and lm_head, the rank's vocab slice (geometry.vocab_slices);
- replicated (no axis): every norm weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.config import ModelConfig
from planner.geometry import Geometry


@dataclass(frozen=True)
class Shard:
    """One rank's planned weight as ranges of the full tensor.

    full_shape  the checkpoint tensor's shape (HF's ``[out_features, in_features]``)
    axis        the axis it is split along; None: replicated whole
    ranges      [start, stop) ranges along ``axis`` of the full tensor, concatenated in order into the
                planned view from index 0; view entries past their total are padding (zero)
    """

    full_shape: tuple[int, ...]
    axis: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()

    @property
    def length(self) -> int:
        """Entries along ``axis`` the ranges fill."""
        return sum(stop - start for start, stop in self.ranges)


def weight_shards(model: ModelConfig, geometry: Geometry, rank: int) -> dict[str, Shard]:
    """The shard of every weight of ``rank``'s plan (the names of planner/weights.py's pool)."""
    g, tp = geometry, geometry.tensor_parallel_size
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside the plan's tensor_parallel_size {tp}")
    hidden = model.hidden_size
    vocab_start, vocab_end = g.vocab_slices[rank]
    vocab = Shard((model.vocab_size, hidden), 0, ((vocab_start, vocab_end),))
    shards = {"model.embed_tokens.weight": vocab, "model.norm.weight": Shard((hidden,))}
    if not model.tie_word_embeddings:
        shards["lm_head.weight"] = vocab
    for layer, kind in enumerate(g.layer_kinds):
        prefix = f"model.layers.{layer}"
        shards[f"{prefix}.input_layernorm.weight"] = Shard((hidden,))
        shards[f"{prefix}.post_attention_layernorm.weight"] = Shard((hidden,))
        mixer = _full_attention(model, g, rank) if kind == "full_attention" else _linear_attention(model, g, rank)
        shards.update({f"{prefix}.{name}": shard for name, shard in mixer.items()})
        shards.update({f"{prefix}.mlp.{name}": shard for name, shard in _mlp(model, g, rank).items()})
    return shards


def _rows(full_shape: tuple[int, ...], start: int, count: int, axis: int = 0) -> Shard:
    return Shard(full_shape, axis, ((start, start + count),))


def _full_attention(model: ModelConfig, g: Geometry, rank: int) -> dict[str, Shard]:
    hidden, head_dim = model.hidden_size, model.head_dim
    q_rows_full = model.num_attention_heads * head_dim * (2 if model.attn_output_gate else 1)
    kv_rows_full = model.num_key_value_heads * head_dim
    first_q_head = rank * g.num_q_heads
    # The KV head of a query head h is h // (Hq / Hkv); a rank's query heads read g.num_kv_heads of them.
    first_kv_head = first_q_head // (model.num_attention_heads // model.num_key_value_heads)
    kv = _rows((kv_rows_full, hidden), first_kv_head * head_dim, g.kv_proj_rows)
    return {
        "self_attn.q_proj.weight": _rows((q_rows_full, hidden), rank * g.q_proj_rows, g.q_proj_rows),
        "self_attn.k_proj.weight": kv,
        "self_attn.v_proj.weight": kv,
        "self_attn.o_proj.weight": _rows((hidden, model.num_attention_heads * head_dim),
                                         first_q_head * head_dim, g.attn_out_width, axis=1),
        "self_attn.q_norm.weight": Shard((head_dim,)),
        "self_attn.k_norm.weight": Shard((head_dim,)),
    }


def _linear_attention(model: ModelConfig, g: Geometry, rank: int) -> dict[str, Shard]:
    lin, hidden = model.linear_attention, model.hidden_size
    assert lin is not None, "a linear_attention layer has its config (ModelConfig's validator)"
    key_width_full = lin.num_key_heads * lin.key_head_dim
    value_width_full = lin.num_value_heads * lin.value_head_dim
    conv_dim_full = 2 * key_width_full + value_width_full
    key_width = g.linear_num_key_heads * lin.key_head_dim
    key_start, value_start = rank * key_width, rank * g.linear_value_width
    qkv_ranges = ((key_start, key_start + key_width),  # q
                  (key_width_full + key_start, key_width_full + key_start + key_width),  # k
                  (2 * key_width_full + value_start, 2 * key_width_full + value_start + g.linear_value_width))  # v
    heads, first_head = lin.num_value_heads, rank * g.linear_num_value_heads
    per_head = lambda: _rows((heads,), first_head, g.linear_num_value_heads)  # noqa: E731
    return {
        "linear_attn.in_proj_qkv.weight": Shard((conv_dim_full, hidden), 0, qkv_ranges),
        "linear_attn.in_proj_z.weight": _rows((value_width_full, hidden), value_start, g.linear_value_width),
        "linear_attn.in_proj_b.weight": _rows((heads, hidden), first_head, g.linear_num_value_heads),
        "linear_attn.in_proj_a.weight": _rows((heads, hidden), first_head, g.linear_num_value_heads),
        "linear_attn.conv1d.weight": Shard((conv_dim_full, 1, lin.conv_kernel_size), 0, qkv_ranges),
        "linear_attn.A_log": per_head(),
        "linear_attn.dt_bias": per_head(),
        "linear_attn.norm.weight": Shard((lin.value_head_dim,)),
        "linear_attn.out_proj.weight": _rows((hidden, value_width_full), value_start, g.linear_value_width, axis=1),
    }


def _mlp(model: ModelConfig, g: Geometry, rank: int) -> dict[str, Shard]:
    hidden, inter = model.hidden_size, model.intermediate_size
    rows = _rows((inter, hidden), rank * g.intermediate_size, g.intermediate_size)
    return {
        "gate_proj.weight": rows,
        "up_proj.weight": rows,
        "down_proj.weight": _rows((hidden, inter), rank * g.intermediate_size, g.intermediate_size, axis=1),
    }
