"""ChunkCopy: a copy between two strided 4-D views, 16 bytes at a time, or torch's copy when a
view is not made of aligned 16-byte chunks."""

from __future__ import annotations

import pytest
import torch

from executor.device import open_device
from executor.kernels.rows.chunk_copy import ChunkCopy
from tests.kernels.compile_check import compile_for_sm90


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_rows_by_kv_head_and_back(dtype):
    """The prefill attention's packing: rows [T, Hkv * G, D] of a wider fused buffer, as
    [Hkv, G, T, D], into contiguous scratch and back into another wide buffer; bytes outside the
    destination view keep their poison."""
    open_device("auto")
    rows, kv_heads, group, head_dim, width = 5, 2, 3, 16, 2 * 3 * 16 + 32
    fused = torch.randn(rows, width).to(dtype)
    q = fused[:, : kv_heads * group * head_dim].view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    packed = torch.full((kv_heads, group, rows, head_dim), float("nan"), dtype=dtype)
    ChunkCopy()(q, packed)
    assert torch.equal(packed, q)
    out = torch.full((rows, width), float("nan"), dtype=dtype)
    out_view = out[:, 16 : 16 + kv_heads * group * head_dim].view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    ChunkCopy()(packed, out_view)
    assert torch.equal(out_view, q)
    outside = torch.ones_like(out, dtype=torch.bool)
    outside[:, 16 : 16 + kv_heads * group * head_dim] = False
    assert bool(out[outside].isnan().all())


def test_views_not_made_of_aligned_chunks_are_copied_by_torch():
    open_device("auto")
    base = torch.randn(3, 2, 4, 9)
    src = base[..., 1:]  # rows start 4 bytes past a 16-byte boundary
    dst = torch.zeros(3, 2, 4, 8)
    ChunkCopy()(src, dst)
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="one shape"):
        ChunkCopy()(src, torch.zeros(3, 2, 4, 7))


@pytest.mark.ptx
def test_chunk_copy_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.rows.chunk_copy import build_strided_copy_kernel
        raw = types.Array(types.uint8, 4, "A")
        text = ptx(build_strided_copy_kernel(), raw, raw)
        assert "ld.global.v4" in text and "st.global.v4" in text, "16-byte loads and stores"
        assert ".local" not in text, "chunk buffers in local memory"
        """
    )
