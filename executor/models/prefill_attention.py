"""Prefill attention of long chunks as two batched GEMMs on the tensor cores.

The paged attention kernel computes Q K^T and P V with scalar FMAs; for a
chunk of thousands of tokens that is quadratic work at a few percent of the
GPU's matmul rate. Here a request's attention runs as

    keys, values <- its KV pages                     (GatherKv: [Hkv, kv_len, D] scratch)
    packed        = its query rows, by kv head        (ChunkCopy: [Hkv, rows, group, D])
    for each tile of query rows:
        scores    = packed tile @ keys^T              (torch.bmm over kv heads, float32 out)
        probs     = causal softmax(scale * scores)    (CausalSoftmax)
        packed tile = probs @ values                  (torch.bmm over kv heads, in place of the tile's q)
    out rows     <- packed                            (ChunkCopy back to [rows, Hq, D])

over tiles of query rows sized by the plan (step.LongPrefillRequest.rows_per_tile), a
tile's GEMMs spanning only the keys its last row sees. Packing the GQA group
into the GEMM's rows makes one GEMM per tile cover every head (M = group x rows,
a batch of Hkv): P V has a short output and a long reduction, and per-head
GEMMs of M = rows left most SMs idle. Packed as (kv head, row, group member), a
tile is one contiguous slab of each kv head's rows, so the request is packed and
unpacked once rather than per tile: a tile is three launches, which matters
because this loop's host time, not the GPU, bounded a 4096-token prefill (H200:
36 layers x 8 tiles; the host issued five launches and their views a tile in
about 0.2 ms). Every operand is a view of a planned buffer and the copies are
strided views, so nothing is allocated. bf16 operands accumulate in float32;
the scores come out in float32 (``out_dtype``), the probabilities are rounded to
the activation dtype like FlashAttention's.
"""

from __future__ import annotations

import torch

from executor.kernels.attention.causal_softmax import CausalSoftmax
from executor.kernels.rows.chunk_copy import ChunkCopy
from executor.kernels.attention.gather import GatherKv
from executor.kernels.primitives.vector import as_words
from executor.models.context import StepViews


class GemmPrefillAttention:
    """One full-attention layer's GEMM attention over its KV cache views."""

    def __init__(self, gather: GatherKv, softmax: CausalSoftmax, copy: ChunkCopy, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, num_kv_heads: int, group: int, scale: float):
        self.gather, self.softmax, self.copy = gather, softmax, copy
        self.k_cache, self.v_cache = as_words(k_cache), as_words(v_cache)  # [pages, S, Hkv, W]
        self.num_kv_heads, self.group, self.scale = num_kv_heads, group, scale

    def __call__(self, step: StepViews, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``step.long_prefill_requests`` into their rows of ``out``.

        q [T, Hq, D] (a strided view of qkv), out [T, Hq, D] (attn_out), activation dtype; the KV
        pages already hold this step's keys and values.
        """
        keys, values = step.scratch("attn_keys"), step.scratch("attn_values")  # [Hkv, C, D]
        page_indices = step.meta("page_indices")
        heads, group, head_dim = self.num_kv_heads, self.group, q.shape[2]
        key_words, value_words = as_words(keys), as_words(values)  # what the gather writes
        for request in step.long_prefill_requests:
            self.gather(self.k_cache, self.v_cache, page_indices, request.page_start, request.kv_len,
                        key_words, value_words, stream=step.stream)
            rows = request.num_rows
            packed = step.scratch("attn_packed").view(-1)[: heads * rows * group * head_dim]
            packed = packed.view(heads, rows, group, head_dim)
            span = slice(request.q_start, request.q_start + rows)
            # [Hkv, rows, group, D] views of the request's rows: head h * group + g is the g-th of kv head h.
            by_kv_head = lambda x: x[span].unflatten(1, (heads, group)).transpose(0, 1)  # noqa: E731
            self._copy(by_kv_head(q), packed, step)
            packed_rows = packed.view(heads, rows * group, head_dim)
            for first in range(0, rows, request.rows_per_tile):
                end = min(first + request.rows_per_tile, rows)
                tile_rows = packed_rows[:, first * group:end * group]
                self._tile(step, request.kv_len - rows + first, end - first, tile_rows, keys, values)
            self._copy(packed, by_kv_head(out), step)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, step: StepViews) -> None:
        """ChunkCopy of two [Hkv, rows, group, D] views; as [1, Hkv, rows, group x D] when both hold a
        row's group contiguously (Qwen3's q and attn_out, not Qwen3.5's gated q): ChunkCopy's rows are
        then long enough to keep its threads busy."""
        if all(x.stride(3) == 1 and x.stride(2) == x.shape[3] for x in (src, dst)):
            src, dst = src.flatten(2)[None], dst.flatten(2)[None]  # views: the strides above merge
        self.copy(src, dst, stream=step.stream)

    def _tile(self, step: StepViews, first_position: int, rows: int, packed_rows: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor) -> None:
        """Query rows at ``first_position .. + rows - 1``: ``packed_rows`` [Hkv, rows x group, D] in,
        their attention out in the same rows."""
        heads, group = self.num_kv_heads, self.group
        num_keys = first_position + rows  # the tile's last row sees keys 0 .. num_keys - 1
        count = heads * group * rows * num_keys
        scores = step.scratch("attn_scores")[:count].view(heads, group * rows, num_keys)
        probs = step.scratch("attn_probs")[:count].view(heads, group * rows, num_keys)
        widen = {} if packed_rows.dtype == torch.float32 else {"out_dtype": torch.float32}
        torch.bmm(packed_rows, keys[:, :num_keys].transpose(1, 2), out=scores, **widen)
        self.softmax(scores.view(-1, num_keys), probs.view(-1, num_keys), rows, first_position, self.scale,
                     group=group, stream=step.stream)
        torch.bmm(probs, values[:, :num_keys], out=packed_rows)
