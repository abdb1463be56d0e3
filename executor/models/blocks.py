"""The blocks of a decoder layer: a mixer (attention or linear attention) and the MLP.

Blocks hold their layer's weight views, the shared launchers and their projections backend
(projections.py: cuBLAS GEMMs around the decoder's add + RMSNorm, or fused GEMVs that read and
update the residual stream themselves); a forward call only slices planned buffers and launches.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from executor.arena import Arena
from executor.kernels.linear_attention.chunked_delta_rule import ChunkScratch
from executor.models.context import StepViews
from executor.models.flash_prefill_attention import FlashPrefillAttention
from executor.models.launchers import Kernels, NormStyle
from executor.models.prefill_attention import GemmPrefillAttention
from executor.models.projections import Projections


class Mixer(Protocol):
    """A layer's token mixer. ``__call__`` is the whole block; the GEMM forward calls its three parts
    apart (decoder.py), so that the row-wise ``project`` and ``finish`` can replay in prefill graph
    pieces around the eager ``attend`` (graphs.py)."""

    def __call__(self, step: StepViews) -> None: ...
    def project(self, step: StepViews) -> None: ...
    def attend(self, step: StepViews) -> None: ...
    def finish(self, step: StepViews) -> None: ...


class FullAttention:
    """GQA attention over the paged KV cache: fused QKV GEMM, q/k norm + RoPE with the
    KV write (one launch), paged attention (at decode, one launch with the one before where
    kernels/attention/decode_rope.py can), optional sigmoid output gate (Qwen3.5), o_proj."""

    def __init__(self, arena: Arena, kernels: Kernels, proj: Projections, layer: int, norm: NormStyle,
                 output_gate: bool):
        plan, g = arena.plan, arena.plan.geometry
        self.proj = proj
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_weight = arena.tensor("weights", f"{prefix}.qkv_proj.weight")
        self.o_weight = arena.tensor("weights", f"{prefix}.o_proj.weight")
        self.q_norm = arena.tensor("weights", f"{prefix}.q_norm.weight")
        self.k_norm = arena.tensor("weights", f"{prefix}.k_norm.weight")
        kv = arena.tensor("kv_cache", "kv_cache")  # [pages, full layers, 2, S, Hkv, D]
        slot = g.layer_slots[layer]
        self.k_cache, self.v_cache = kv[:, slot, 0], kv[:, slot, 1]
        self.kernels = kernels
        self.norm, self.output_gate = norm, output_gate
        self.q_heads, self.kv_heads, self.head_dim = g.num_q_heads, g.num_kv_heads, g.head_dim
        self.q_rows, self.kv_rows = g.q_proj_rows, g.kv_proj_rows
        self.rotary_dim, self.theta = g.rotary_dim, plan.model.rope_theta
        self.eps = plan.model.rms_norm_eps
        self.scale = np.float32(1.0 / math.sqrt(g.head_dim))
        # Decode splits long kv ranges over several blocks (step.decode_kv_chunk) when the plan
        # has split scratch; one fixed choice per plan, so eager decode and its graphs agree.
        self.split_decode = plan.capacity.decode_kv_splits > 1
        # A prefill step's decode rows (at most max_batch) take the decode kernel's shape for max_batch
        # rows: one shape per plan, the one warm-up compiles, whatever the step's mix.
        self.mixed_decode_shape_rows = plan.capacity.max_batch
        # Long prefill chunks (step.long_prefill_requests) run in the plan's backend, chosen once here.
        self.long_prefill_attention = _long_prefill_attention(arena, kernels, self.k_cache, self.v_cache, self.scale)

    def __call__(self, step: StepViews) -> None:
        self.project(step)
        self.attend(step)
        self.finish(step)

    def project(self, step: StepViews) -> None:
        """The fused QKV projection of the block's normed input and, where a prefill step takes the separate
        q/k norm + RoPE launches (fused_kv_write.py ``separate``), those (row-wise: a prefill graph piece's)."""
        self.proj.normed(step, self.qkv_weight, step.role("qkv"))
        if self._rope_in_piece(step):
            q, k, _ = self._qkv(step)
            self.kernels.qk_norm_rope_write_kv.norm_rope(q, k, self.q_norm, self.k_norm, step.meta("positions"),
                                                         self.eps, self.norm.weight_offset, self.rotary_dim,
                                                         self.theta, stream=step.stream)

    def attend(self, step: StepViews) -> None:
        """q/k norm + RoPE (unless ``project`` ran it), the KV write and attention into ``attn_out`` (the
        step's requests decide the launches: eager between the prefill graph pieces)."""
        k_ = self.kernels
        q, k, v = self._qkv(step)
        attn_out = step.role("attn_out").view(step.num_rows, self.q_heads, self.head_dim)
        tile_meta = step.tile_meta
        if step.pool == "decode":  # one launch where it can (kernels/attention/decode_rope.py)
            split = (step.role("attn_partial_out"), step.role("attn_partial_lse")) if self.split_decode else ()
            k_.decode_rope_attention(q, k, v, self.q_norm, self.k_norm, self.eps, self.norm.weight_offset,
                                     self.rotary_dim, self.theta, self.k_cache, self.v_cache, *tile_meta, attn_out,
                                     self.scale, *split, stream=step.stream)
            return
        if self._rope_in_piece(step):  # q and k normed and rotated in place by the input piece
            k_.qk_norm_rope_write_kv.write_kv(k, v, self.k_cache, self.v_cache, step.meta("batch_indices"),
                                              step.meta("positions"), step.meta("page_indices"),
                                              step.meta("page_indptr"), stream=step.stream)
        else:
            k_.qk_norm_rope_write_kv(q, k, v, self.q_norm, self.k_norm, step.meta("positions"), self.eps,
                                     self.norm.weight_offset, self.rotary_dim, self.theta, self.k_cache, self.v_cache,
                                     step.meta("batch_indices"), step.meta("page_indices"), step.meta("page_indptr"),
                                     stream=step.stream)
        paged, decode_rows = step.split_tile_meta
        if step.num_tiles > step.num_decode_row_tiles:  # chunks of several rows short of the long backend
            k_.attention(q, self.k_cache, self.v_cache, *paged, attn_out, self.scale, stream=step.stream)
        if step.num_decode_row_tiles:  # decode rows beside prefill chunks: the decode kernel, unsplit
            k_.decode_rope_attention.attention(q, self.k_cache, self.v_cache, *decode_rows, attn_out, self.scale,
                                               shape_rows=self.mixed_decode_shape_rows, stream=step.stream)
        if step.long_prefill_requests:  # the long prefill chunks, which got no paged-attention tile
            self.long_prefill_attention(step, q, attn_out)

    def finish(self, step: StepViews) -> None:
        """The output gate (Qwen3.5) and o_proj into the residual stream (row-wise)."""
        if self.output_gate:
            n, d = step.num_rows, self.head_dim
            attn_out = step.role("attn_out").view(n, self.q_heads, d)
            gate = step.role("qkv")[:, : self.q_rows].view(n, self.q_heads, 2 * d)[..., d:]
            self.kernels.output_gate(attn_out, gate, stream=step.stream)
        self.proj.residual(step, step.role("attn_out"), self.o_weight)

    def _rope_in_piece(self, step: StepViews) -> bool:
        """Whether the prefill step's q/k norm + RoPE runs in the input piece, apart from the KV write: it
        does when the step's pieces run at rows that take the separate launches."""
        return step.pool == "prefill" and self.kernels.qk_norm_rope_write_kv.separate(step.piece_rows)

    def _qkv(self, step: StepViews) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, Hq, D] (per head [q | gate] with the output gate: its first half), k and v [n, Hkv, D]."""
        n, d, qkv = step.num_rows, self.head_dim, step.role("qkv")
        q_part = qkv[:, : self.q_rows]
        q = q_part.view(n, self.q_heads, 2 * d)[..., :d] if self.output_gate else q_part.view(n, self.q_heads, d)
        k = qkv[:, self.q_rows : self.q_rows + self.kv_rows].view(n, self.kv_heads, d)
        v = qkv[:, self.q_rows + self.kv_rows :].view(n, self.kv_heads, d)
        return q, k, v


def _long_prefill_attention(arena: Arena, kernels: Kernels, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            scale: np.float32) -> GemmPrefillAttention | FlashPrefillAttention | None:
    """The plan's prefill_attention backend (capacity) of long prefill chunks, or None when the plan has no
    gather scratch for them (no chunk reaches gemm_attention_min_tokens: none is ever routed there)."""
    plan, g = arena.plan, arena.plan.geometry
    if not plan.capacity.prefill_gather_tokens:
        return None
    if plan.capacity.prefill_attention == "flash":
        return FlashPrefillAttention(kernels.packed_gather_kv, kernels.flash_attention, k_cache, v_cache,
                                     plan.serving.gemm_attention_min_tokens)
    return GemmPrefillAttention(kernels.gather_kv, kernels.causal_softmax, kernels.chunk_copy, k_cache, v_cache,
                                g.num_kv_heads, g.gqa_group, scale)


class LinearAttention:
    """Gated DeltaNet (Qwen3.5): fused in_proj GEMM, causal conv1d with state,
    gates, the delta rule with state, gated RMSNorm, out_proj."""

    def __init__(self, arena: Arena, kernels: Kernels, proj: Projections, layer: int):
        plan, g = arena.plan, arena.plan.geometry
        self.proj = proj
        prefix = f"model.layers.{layer}.linear_attn"
        slot = g.layer_slots[layer]
        self.in_weight = arena.tensor("weights", f"{prefix}.in_proj.weight")
        self.out_weight = arena.tensor("weights", f"{prefix}.out_proj.weight")
        conv = arena.tensor("weights", f"{prefix}.conv1d.weight")
        self.conv_weight = conv.view(conv.shape[0], conv.shape[2])
        self.a_log = arena.tensor("weights", f"{prefix}.A_log")
        self.dt_bias = arena.tensor("weights", f"{prefix}.dt_bias")
        self.norm_weight = arena.tensor("weights", f"{prefix}.norm.weight")
        self.conv_state = arena.tensor("recurrent_state", "conv_state")[slot]
        self.ssm_state = arena.tensor("recurrent_state", "ssm_state")[slot]
        self.kernels = kernels
        self.conv_dim = g.conv_dim
        self.value_width = g.linear_value_width
        self.heads, self.dv = g.linear_num_value_heads, g.linear_value_head_dim
        self.eps = plan.model.rms_norm_eps
        self.has_chunk_scratch = bool(plan.capacity.delta_rule_chunk)

    def chunk_scratch(self, step: StepViews) -> ChunkScratch | None:
        """The chunked delta rule's planned scratch (prefill pool, bf16 plans), or None (float32 build)."""
        if not self.has_chunk_scratch:
            return None
        return ChunkScratch(step.role("delta_transform"), step.role("delta_gram"), step.role("delta_scalars"))

    def __call__(self, step: StepViews) -> None:
        self.project(step)
        self.attend(step)
        self.finish(step)

    def project(self, step: StepViews) -> None:
        """The fused in_proj of the block's normed input and the gates g, beta (row-wise: a prefill graph
        piece's)."""
        in_proj = step.role("in_proj")
        self.proj.normed(step, self.in_weight, in_proj)
        b, gate_a = self._gate_inputs(in_proj)
        self.kernels.gdn_gates(gate_a, b, self.a_log, self.dt_bias, step.role("gate_g"), step.role("gate_beta"),
                               stream=step.stream)

    def attend(self, step: StepViews) -> None:
        """The causal conv1d and the delta rule with their states, into ``delta_out`` (the step's requests
        decide the launches: eager between the prefill graph pieces)."""
        k_, stream = self.kernels, step.stream
        n = step.num_rows
        mixed = step.role("in_proj")[:, : self.conv_dim]
        q_indptr, slot_ids = step.meta("q_indptr"), step.slot_ids()
        conv_out = step.role("conv_out")
        g, beta = step.role("gate_g"), step.role("gate_beta")
        delta_out = step.role("delta_out").view(n, self.heads, self.dv)
        if step.pool == "decode":
            k_.conv1d.decode(mixed, self.conv_weight, self.conv_state, q_indptr, slot_ids, conv_out, stream=stream)
            k_.delta_rule_decode(conv_out, g, beta, self.ssm_state, q_indptr, slot_ids, delta_out, stream=stream)
            return
        d = step.leading_decode_rows  # executor/routing.py: the leading decode rows, then the chunks
        if d:
            k_.conv1d.decode(mixed[:d], self.conv_weight, self.conv_state, q_indptr[: d + 1], slot_ids[:d],
                             conv_out[:d], stream=stream)
        k_.conv1d(mixed, self.conv_weight, self.conv_state, q_indptr[d:], slot_ids[d:], conv_out, stream=stream)
        if d:
            k_.delta_rule_decode(conv_out, g, beta, self.ssm_state, q_indptr[: d + 1], slot_ids[:d], delta_out,
                                 stream=stream)
        if k_.delta_rule_chunked is not None and n - d >= k_.chunked_delta_rule_min_rows:  # CHUNKED_DELTA_RULE_MIN_ROWS
            k_.delta_rule_chunked(conv_out, g, beta, self.ssm_state, q_indptr[d:], slot_ids[d:], delta_out,
                                  self.chunk_scratch(step), stream=stream)
        else:
            k_.delta_rule(conv_out, g, beta, self.ssm_state, q_indptr[d:], slot_ids[d:], delta_out, stream=stream)

    def finish(self, step: StepViews) -> None:
        """The gated RMSNorm (gate z) and out_proj into the residual stream (row-wise)."""
        z = step.role("in_proj")[:, self.conv_dim : self.conv_dim + self.value_width]
        delta_out = step.role("delta_out").view(step.num_rows, self.heads, self.dv)
        gated = step.role("gated_out")
        self.kernels.gated_norm(delta_out, z, self.norm_weight, gated, self.eps, stream=step.stream)
        self.proj.residual(step, gated, self.out_weight)

    def _gate_inputs(self, in_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj's b and a columns (after the conv input and z)."""
        start = self.conv_dim + self.value_width
        return in_proj[:, start : start + self.heads], in_proj[:, start + self.heads :]


class Mlp:
    """SwiGLU: fused gate|up GEMM, silu(gate) * up, down_proj."""

    def __init__(self, arena: Arena, proj: Projections, layer: int):
        prefix = f"model.layers.{layer}.mlp"
        self.gate_up_weight = arena.tensor("weights", f"{prefix}.gate_up_proj.weight")
        self.down_weight = arena.tensor("weights", f"{prefix}.down_proj.weight")
        self.proj = proj

    def __call__(self, step: StepViews) -> None:
        act = step.role("act")
        self.proj.swiglu(step, self.gate_up_weight, act)
        self.proj.residual(step, act, self.down_weight)
