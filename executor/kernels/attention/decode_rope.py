"""A decode step's attention path: q/k norm + RoPE + KV write, then paged decode attention.

``DecodeRopeAttention`` is what a full-attention layer calls at decode. Where the tensor-core decode
kernel serves the heads (bf16, D <= 128) and the step's q/k norm + RoPE + KV write fits its
prologue (full rotary, rope/decode_prologue.py), one launch does both (and the merge launch
follows for split rows); otherwise rope/fused_kv_write.py's launch and then DecodeAttention's. Both ways
give the same bits: the fused kernels run the same device functions in the same order
(tests/kernels/test_decode_rope_attention.py). The fused launch leaves q, k in the qkv buffer as
the projection wrote them; nothing reads them after attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from executor.kernels.attention.paged import check_heads
from executor.kernels.attention.decode import DecodeAttention
from executor.kernels.attention.decode_mma import MmaShape, build_decode_attention_mma
from executor.kernels.attention.decode_mma import shared_bytes as mma_shared_bytes
from executor.kernels.rope.decode_prologue import prologue_fits
from executor.kernels.rope.decode_prologue import shared_bytes as prologue_shared_bytes
from executor.kernels.primitives.launch import SHARED_LIMIT_BYTES, WARP_THREADS, Kernel
from executor.kernels.rope.fused_kv_write import QkNormRopeWriteKv


def fused_shapes(attention: DecodeAttention, head_dim: int, group_size: int, rotary_dim: int) -> list[MmaShape]:
    """The tensor-core shapes of ``attention`` whose blocks also fit the rope prologue (threads and
    shared memory); none for partial rotary heads or heads the tensor-core kernel does not serve."""
    if attention.mma_few is None or rotary_dim != head_dim:
        return []
    shapes = dict.fromkeys(launch[2] for launch in (attention.mma_few, attention.mma_many))
    return [shape for shape in shapes
            if prologue_fits(head_dim, group_size, WARP_THREADS * shape.warps)
            and mma_shared_bytes(head_dim, group_size, shape.warps, shape.slots)
            + prologue_shared_bytes(head_dim, group_size) <= SHARED_LIMIT_BYTES]


class DecodeRopeAttention:
    """Launcher for a decode step's q/k norm + RoPE + KV write and attention (module docstring).

    ``rope`` and ``attention`` are the step's launchers for the two halves, built for the same
    codec and heads; ``round_before_weight`` is the q/k norm's rounding (NormStyle) and
    ``rotary_dim`` the model's.
    """

    def __init__(self, rope: QkNormRopeWriteKv, attention: DecodeAttention, round_before_weight: bool,
                 head_dim: int, group_size: int, rotary_dim: int) -> None:
        self.rope, self.attention = rope, attention
        self.head_dim, self.group_size = head_dim, group_size
        self.fused: dict[MmaShape, tuple[Kernel, Kernel]] = {}
        for shape in fused_shapes(attention, head_dim, group_size, rotary_dim):
            direct, split = build_decode_attention_mma(head_dim, group_size, shape.warps, shape.slots,
                                                       attention.mma_blocks_per_sm, rope=round_before_weight,
                                                       page_size=attention.page_size)
            self.fused[shape] = (Kernel(direct), Kernel(split))

    def fused_launch(self, q: Any, k: Any, v: Any, q_weight: Any, k_weight: Any, k_cache: Any, v_cache: Any,
                     rotary_dim: int, num_rows: int, num_kv_heads: int) -> tuple[tuple[Kernel, Kernel], int] | None:
        """(kernels, threads a block) of the fused launch for this call, or None: the two launches."""
        mma = self.attention.mma_launch(num_rows, num_kv_heads)
        kernels = self.fused.get(mma[2]) if mma is not None else None
        aligned = self.attention.uses_vector(k_cache, v_cache) and self.rope.uses_vector(
            q, k, v, q_weight, k_weight, k_cache, v_cache, rotary_dim)
        if kernels is None or not aligned:
            return None
        self.attention.check_page_size(k_cache)
        return kernels, mma[1]

    def __call__(self, q: Any, k: Any, v: Any, q_weight: Any, k_weight: Any, eps: float, weight_offset: float,
                 rotary_dim: int, theta: float, k_cache: Any, v_cache: Any, page_indices: Any, page_indptr: Any,
                 last_page_len: Any, q_indptr: Any, batch_indices: Any, positions: Any, request_indices: Any,
                 qo_tile_indices: Any, kv_tile_indices: Any, kv_chunk_size: Any, total_num_rows: Any, out: Any,
                 scale: float, partial_out: Any = None, partial_lse: Any = None, stream: Any = 0) -> None:
        """Normalize and rotate q [B, Hq, D] and k [B, Hkv, D] (the qkv projection's views), write k
        and v [B, Hkv, D] into the caches at the rows' positions and write ``out [B, Hq, D]``.
        QkNormRopeWriteKv's arguments, then DecodeAttention's from the caches on (one query row per
        request)."""
        num_rows, _, num_kv_heads = check_heads("decode_rope_attention", out, k_cache, self.head_dim,
                                                self.group_size)
        num_tiles = request_indices.shape[0]
        fused = None
        if num_rows and num_tiles:
            fused = self.fused_launch(q, k, v, q_weight, k_weight, k_cache, v_cache, rotary_dim, num_rows,
                                      num_kv_heads)
        if fused is None:
            self.rope(q, k, v, q_weight, k_weight, positions, eps, weight_offset, rotary_dim, theta, k_cache, v_cache,
                      batch_indices, page_indices, page_indptr, stream=stream)
            self.attention(q, k_cache, v_cache, page_indices, page_indptr, last_page_len, q_indptr, batch_indices,
                           positions, request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size,
                           total_num_rows, out, scale, partial_out, partial_lse, stream=stream)
            return
        (direct, split), threads = fused
        grid = (num_kv_heads, num_tiles)
        rope_args = (q, k, v, q_weight, k_weight, np.float32(eps), np.float32(weight_offset), np.float32(theta),
                     k_cache, v_cache)
        meta = (page_indices, page_indptr, last_page_len, q_indptr, positions, request_indices, kv_tile_indices,
                kv_chunk_size, total_num_rows)
        if partial_out is None:
            direct[grid, threads, stream](*rope_args, *meta, out, np.float32(scale))
            return
        split[grid, threads, stream](*rope_args, *meta, out, partial_out, partial_lse, np.float32(scale))
        self.attention.merge(partial_out, partial_lse, batch_indices, positions, kv_chunk_size,
                                             total_num_rows, out, stream)
