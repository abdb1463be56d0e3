"""Prefill attention of long chunks as FlashAttention launches over the step's long chunks together
(plan capacity.prefill_attention flash).

The same chunks as GEMM attention (executor.models.prefill_attention: serving
gemm_attention_min_tokens) and the same first step, then one kernel instead of a
loop of GEMM tiles, and one pair of launches for all of a step's long chunks
(``StepViews.long_prefill_groups``: one group wherever their keys fit the
scratch together):

    keys, values <- their KV pages, packed           (PackedGatherKv: [Hkv, kv_len sum, D] of the attn_keys/attn_values scratch)
    out rows      = softmax(q k^T D^-0.5, causal) v   (FlashAttention: every row of every packed chunk in one launch)

The kernel (executor.kernels.attention.flash) keeps the scores and probabilities
on chip and reads the query heads where they are (qkv's strided rows, Qwen3.5's
gated q included) and writes attn_out's rows, so there is no query packing, no
score tile and no row tiling: the plan reserves only the gather scratch
(capacity.prefill_gather_tokens; prefill_score_elements is 0). It is bf16 only,
with head_dim a multiple of 32; the planner refuses the backend otherwise.
"""

from __future__ import annotations

import torch

from executor.kernels.attention.flash import FlashAttention
from executor.kernels.attention.gather import PackedGatherKv
from executor.kernels.primitives.vector import as_words
from executor.models.context import StepViews


class FlashPrefillAttention:
    """One full-attention layer's FlashAttention over its KV cache views."""

    def __init__(self, gather: PackedGatherKv, flash: FlashAttention, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 min_rows: int):
        """``min_rows``: serving gemm_attention_min_tokens, the rows that make a chunk long (packed)."""
        self.gather, self.flash = gather, flash
        self.k_cache, self.v_cache = as_words(k_cache), as_words(v_cache)  # [pages, S, Hkv, W]
        self.min_rows = min_rows

    def __call__(self, step: StepViews, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``step.long_prefill_requests`` into their rows of ``out``.

        q [T, Hq, D] (a strided view of qkv), out [T, Hq, D] (attn_out), bf16; the KV pages already
        hold this step's keys and values.
        """
        keys, values = step.scratch("attn_keys"), step.scratch("attn_values")  # [Hkv, C, D]
        key_words, value_words = as_words(keys), as_words(values)  # what the gather writes
        page_indices, page_indptr = step.meta("page_indices"), step.meta("page_indptr")
        q_indptr, positions = step.meta("q_indptr"), step.meta("positions")
        for group in step.long_prefill_groups:
            self.gather(self.k_cache, self.v_cache, page_indices, page_indptr, q_indptr, positions,
                        group.first_request, group.num_requests, group.max_kv_len, group.kv_tokens, key_words,
                        value_words, min_rows=self.min_rows, stream=step.stream)
            self.flash(q, keys, values, out, q_indptr, positions, group.first_request, group.num_requests,
                       group.max_rows, group.kv_tokens, min_rows=self.min_rows, stream=step.stream)
