"""Prefill attention of long chunks as one FlashAttention launch per chunk (plan capacity.prefill_attention flash).

The same chunks as GEMM attention (executor.models.prefill_attention: serving
gemm_attention_min_tokens) and the same first step, then one kernel instead of a
loop of GEMM tiles:

    keys, values <- its KV pages                      (GatherKv: [Hkv, kv_len, D] of the attn_keys/attn_values scratch)
    out rows      = softmax(q k^T D^-0.5, causal) v   (FlashAttention: every row of the chunk in one launch)

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
from executor.kernels.attention.gather import GatherKv
from executor.kernels.primitives.vector import as_words
from executor.models.context import StepViews


class FlashPrefillAttention:
    """One full-attention layer's FlashAttention over its KV cache views."""

    def __init__(self, gather: GatherKv, flash: FlashAttention, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.gather, self.flash = gather, flash
        self.k_cache, self.v_cache = as_words(k_cache), as_words(v_cache)  # [pages, S, Hkv, W]

    def __call__(self, step: StepViews, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``step.long_prefill_requests`` into their rows of ``out``.

        q [T, Hq, D] (a strided view of qkv), out [T, Hq, D] (attn_out), bf16; the KV pages already
        hold this step's keys and values.
        """
        keys, values = step.scratch("attn_keys"), step.scratch("attn_values")  # [Hkv, C, D]
        page_indices = step.meta("page_indices")
        key_words, value_words = as_words(keys), as_words(values)  # what the gather writes
        for request in step.long_prefill_requests:
            self.gather(self.k_cache, self.v_cache, page_indices, request.page_start, request.kv_len,
                        key_words, value_words, stream=step.stream)
            # The chunk's rows are the last num_rows of its kv_len tokens, as the kernel assumes.
            span = slice(request.q_start, request.q_start + request.num_rows)
            self.flash(q[span], keys, values, out[span], request.kv_len, stream=step.stream)
