"""Prefill attention of long chunks as two batched GEMMs on the tensor cores.

The paged attention kernel computes Q K^T and P V with scalar FMAs; for a
chunk of thousands of tokens that is quadratic work at a few percent of the
GPU's matmul rate. Here a request's attention runs as

    keys, values <- its KV pages                     (GatherKv: [Hkv, kv_len, D] scratch)
    packed        = its query rows, by kv head        (ChunkCopy: [Hkv, group x rows, D])
    scores        = packed @ keys^T                   (torch.bmm over kv heads, float32 out)
    probs         = causal softmax(scale * scores)    (CausalSoftmax)
    packed        = probs @ values                    (torch.bmm over kv heads)
    out rows     <- packed                            (ChunkCopy back to [rows, Hq, D])

over tiles of query rows sized by the plan (step.GemmRequest.rows_per_tile), a
tile's GEMMs spanning only the keys its last row sees. Packing the GQA group
into the GEMM's rows makes one GEMM per tile cover every head (M = group x rows,
a batch of Hkv): P V has a short output and a long reduction, and per-head
GEMMs of M = rows left most SMs idle. Every operand is a view of a planned
buffer and the copies are strided views, so nothing is allocated. bf16 operands
accumulate in float32; the scores come out in float32 (``out_dtype``), the
probabilities are rounded to the activation dtype like FlashAttention's.
"""

from __future__ import annotations

import torch

from executor.kernels.causal_softmax import CausalSoftmax
from executor.kernels.chunk_copy import ChunkCopy
from executor.kernels.gemm_attention import GatherKv
from executor.models.context import StepViews
from executor.step import GemmRequest


class GemmPrefillAttention:
    """One full-attention layer's GEMM attention over its KV cache views."""

    def __init__(self, gather: GatherKv, softmax: CausalSoftmax, copy: ChunkCopy, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, num_kv_heads: int, group: int, scale: float):
        self.gather, self.softmax, self.copy = gather, softmax, copy
        self.k_cache, self.v_cache = _as_words(k_cache), _as_words(v_cache)  # [pages, S, Hkv, W]
        self.num_kv_heads, self.group, self.scale = num_kv_heads, group, scale

    def __call__(self, step: StepViews, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``step.gemm_requests`` into their rows of ``out``.

        q [T, Hq, D] (a strided view of qkv), out [T, Hq, D] (attn_out), activation dtype; the KV
        pages already hold this step's keys and values.
        """
        keys, values = step.scratch("attn_keys"), step.scratch("attn_values")  # [Hkv, C, D]
        page_indices = step.meta("page_indices")
        for request in step.gemm_requests:
            self.gather(self.k_cache, self.v_cache, page_indices, request.page_start, request.kv_len,
                        _as_words(keys), _as_words(values), stream=step.stream)
            for first in range(0, request.num_rows, request.rows_per_tile):
                self._tile(step, request, first, min(first + request.rows_per_tile, request.num_rows), q, out,
                           keys, values)

    def _tile(self, step: StepViews, request: GemmRequest, first: int, end: int, q: torch.Tensor,
              out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Query rows ``first .. end - 1`` of ``request``."""
        rows, heads, group = end - first, self.num_kv_heads, self.group
        first_position = request.kv_len - request.num_rows + first
        num_keys = first_position + rows  # the tile's last row sees keys 0 .. num_keys - 1
        head_dim = q.shape[2]
        packed = step.scratch("attn_packed").view(-1)[: heads * group * rows * head_dim].view(heads, group, rows,
                                                                                                 head_dim)
        count = heads * group * rows * num_keys
        scores = step.scratch("attn_scores")[:count].view(heads, group * rows, num_keys)
        probs = step.scratch("attn_probs")[:count].view(heads, group * rows, num_keys)
        span = slice(request.q_start + first, request.q_start + end)
        # [Hkv, group, rows, D] views of the tile's rows: head h * group + g is the g-th of kv head h.
        by_kv_head = lambda x: x[span].unflatten(1, (heads, group)).permute(1, 2, 0, 3)  # noqa: E731
        self.copy(by_kv_head(q), packed, stream=step.stream)
        packed_rows = packed.view(heads, group * rows, head_dim)
        widen = {} if q.dtype == torch.float32 else {"out_dtype": torch.float32}
        torch.bmm(packed_rows, keys[:, :num_keys].transpose(1, 2), out=scores, **widen)
        # score row (h, g, t) is query row t of the tile
        self.softmax(scores.view(-1, num_keys), probs.view(-1, num_keys), rows, first_position, self.scale,
                     stream=step.stream)
        torch.bmm(probs, values[:, :num_keys], out=packed_rows)
        self.copy(packed, by_kv_head(out), stream=step.stream)


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as 4-byte words (bf16 pairs): the gather copies half as many elements."""
    return tensor.view(torch.int32)
