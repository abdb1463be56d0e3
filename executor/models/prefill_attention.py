"""Prefill attention of long chunks as two batched GEMMs on the tensor cores.

The paged attention kernel computes Q K^T and P V with scalar FMAs; for a
chunk of thousands of tokens that is quadratic work at a few percent of the
GPU's matmul rate. Here a request's attention runs as

    keys, values   <- its KV pages                  (GatherKv: [Hkv, kv_len, D] scratch)
    scores[g]       = q[rows, g-th head of each kv group] @ keys^T     (torch.bmm, float32 out)
    probs           = causal softmax(scale * scores)                   (CausalSoftmax)
    out[rows, g-th head of each kv group] = probs[g] @ values          (torch.bmm, into attn_out)

over tiles of query rows sized by the plan (step.GemmRequest.rows_per_tile), a
tile's GEMMs spanning only the keys its last row sees. Every operand is a view
of a planned buffer: q and out are strided views of qkv and attn_out
(cuBLAS takes their row stride as the leading dimension; the batch over kv
heads is a strided batch), so nothing is copied or allocated. bf16 operands
accumulate in float32; the scores come out in float32 (``out_dtype``), the
probabilities are rounded to the activation dtype like FlashAttention's.
"""

from __future__ import annotations

import torch

from executor.kernels.gemm_attention import CausalSoftmax, GatherKv
from executor.models.context import StepViews
from executor.step import GemmRequest


class GemmPrefillAttention:
    """One full-attention layer's GEMM attention over its KV cache views."""

    def __init__(self, gather: GatherKv, softmax: CausalSoftmax, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 num_kv_heads: int, group: int, scale: float):
        self.gather, self.softmax = gather, softmax
        self.k_cache, self.v_cache = _as_words(k_cache), _as_words(v_cache)  # [pages, S, Hkv, W]
        self.num_kv_heads, self.group, self.scale = num_kv_heads, group, scale

    def __call__(self, step: StepViews, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``step.gemm_requests`` into their rows of ``out``.

        q [T, Hq, D] (a strided view of qkv), out [T, Hq, D] (attn_out), activation dtype; the KV
        pages already hold this step's keys and values.
        """
        keys, values = step.scratch("attn_keys"), step.scratch("attn_values")  # [Hkv, C, D]
        scores_flat, probs_flat = step.scratch("attn_scores"), step.scratch("attn_probs")
        page_indices = step.meta("page_indices")
        device = step.arena.device
        for request in step.gemm_requests:
            self.gather(device.array(self.k_cache), device.array(self.v_cache), device.array(page_indices),
                        request.page_start, request.kv_len, device.array(_as_words(keys)),
                        device.array(_as_words(values)), stream=step.stream)
            for first in range(0, request.num_rows, request.rows_per_tile):
                self._tile(step, request, first, min(first + request.rows_per_tile, request.num_rows), q, out,
                           keys, values, scores_flat, probs_flat)

    def _tile(self, step: StepViews, request: GemmRequest, first: int, end: int, q: torch.Tensor,
              out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scores_flat: torch.Tensor,
              probs_flat: torch.Tensor) -> None:
        """Query rows ``first .. end - 1`` of ``request``."""
        rows = end - first
        first_position = request.kv_len - request.num_rows + first
        num_keys = first_position + rows  # the tile's last row sees keys 0 .. num_keys - 1
        shape = (self.group, self.num_kv_heads, rows, num_keys)
        count = self.group * self.num_kv_heads * rows * num_keys
        scores, probs = scores_flat[:count].view(shape), probs_flat[:count].view(shape)
        span = slice(request.q_start + first, request.q_start + end)
        # [rows, Hkv, group, D]: head h * group + g is the g-th query head of kv head h.
        q_tile = q[span].unflatten(1, (self.num_kv_heads, self.group))
        out_tile = out[span].unflatten(1, (self.num_kv_heads, self.group))
        keys_t = keys[:, :num_keys].transpose(1, 2)  # [Hkv, D, keys]
        values_used = values[:, :num_keys]  # [Hkv, keys, D]
        widen = {} if q.dtype == torch.float32 else {"out_dtype": torch.float32}
        for g in range(self.group):
            torch.bmm(q_tile[:, :, g].transpose(0, 1), keys_t, out=scores[g], **widen)
        device = step.arena.device
        self.softmax(device.array(scores.view(-1, num_keys)), device.array(probs.view(-1, num_keys)), rows,
                     first_position, self.scale, stream=step.stream)
        for g in range(self.group):
            torch.bmm(probs[g], values_used, out=out_tile[:, :, g].transpose(0, 1))


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as 4-byte words (bf16 pairs): the gather copies half as many elements."""
    return tensor.view(torch.int32)
