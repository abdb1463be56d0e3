"""Tensor-core decode attention (decode_attention_mma.py) against the float64 reference of test_attention
(test_decode_attention's ``run_decode``; its GPU test covers this kernel at real sizes too).

Simulator shapes: D = 32 (the smallest head an ldmatrix.x4 load covers), 2 kv heads, bf16, page size
4, two warps a block with two ring slots each (and the launcher's default shape), so a warp's slots of
eight keys cross pages, refill ring slots they used, end past the chunk and, at one key, leave the
other warp no slot at all; one request is split into kv chunks.
"""

from __future__ import annotations

import pytest

from executor.kernels.attention.decode import DecodeAttention
from executor.kernels.attention.decode_mma import (MANY_PAIRS_SHAPE, MAX_GROUP, MmaShape, default_mma_shapes, mma_warps,
                                                  shared_bytes)
from executor.kernels.primitives.launch import SHARED_LIMIT_BYTES
from tests.kernels import test_decode_attention
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.test_attention import NUM_KV_HEADS, PAGE_SIZE

HEAD_DIM = 32
BATCH = [(1, 37), (1, 19), (1, 1), (1, 8)]  # (rows, kv_len): decode rows only
NUM_PAGES = 24


def run_decode(group: int, kv_chunk: int | None, seed: int, shape: MmaShape = MmaShape(2, 2),
               **launcher: object) -> DecodeAttention:
    attention = test_decode_attention.run_decode("bfloat16", group, kv_chunk, seed, head_dim=HEAD_DIM, batch=BATCH,
                                                 num_pages=NUM_PAGES, **(launcher or {"mma_shape": shape}))
    assert attention.mma_launch(len(BATCH), NUM_KV_HEADS)[2] == shape
    return attention


@pytest.mark.parametrize("group,kv_chunk", [(1, None), (5, None), (8, None), (4, 16)])
def test_mma_decode_attention_matches_reference(group, kv_chunk):
    run_decode(group, kv_chunk, seed=group + (kv_chunk or 0))


def test_page_size_compiled_in():
    """Built for the plan's page size (the model's launchers are), a split call gives the reference's
    output; a cache of other pages is refused before any launch, naming both sizes."""
    attention = run_decode(4, 16, 5, page_size=PAGE_SIZE, mma_shape=MmaShape(2, 2))
    assert attention.page_size == PAGE_SIZE
    with pytest.raises(ValueError, match=f"built for KV pages of {2 * PAGE_SIZE} tokens, got a cache of {PAGE_SIZE}"):
        run_decode(4, 16, 5, page_size=2 * PAGE_SIZE, mma_shape=MmaShape(2, 2))


@pytest.mark.parametrize("num_sms,shape", [(4, MmaShape(4, 2)), (3, MANY_PAIRS_SHAPE)])
def test_calls_of_many_pairs_run_the_many_pairs_shape(num_sms, shape):
    """Four rows x two kv heads: 8 (row, kv head) pairs, within two an SM for 4 SMs (the few-pairs
    shape, four warps of two slots) and past it for 3 (two warps of three slots); both give the
    reference's output."""
    run_decode(3, None, 11, shape, num_sms=num_sms)


def test_mma_shapes_and_shared_memory():
    """Qwen3 (D 128, G 4) gets four warps and Qwen3.5 (D 256, G 4) two, each within the shared-memory
    limit; heads the tile cannot hold, or not a multiple of 32, get none (the CUDA-core kernel), and
    by default only heads of at most 128 run on tensor cores."""
    assert mma_warps(128, 4) == 4 and mma_warps(256, 4) == 2
    assert default_mma_shapes(128, 4) == (MmaShape(4, 2), MANY_PAIRS_SHAPE) and default_mma_shapes(256, 4) is None
    for head_dim, group in ((128, 4), (256, 4), (256, 6), (128, 8)):
        warps = mma_warps(head_dim, group)
        assert shared_bytes(head_dim, group, warps, 2) <= SHARED_LIMIT_BYTES
        assert warps == 4 or shared_bytes(head_dim, group, warps + 1, 2) > SHARED_LIMIT_BYTES
    assert mma_warps(128, MAX_GROUP + 1) is None and mma_warps(80, 4) is None and mma_warps(16, 1) is None


@pytest.mark.ptx
def test_mma_decode_attention_compiles_for_sm90():
    """PTX for sm_90 at Qwen3 (D 128, G 4) and Qwen3.5 (D 256, G 4): K/V staged by cp.async, read
    by ldmatrix (V transposed), bf16 MMAs, registers only."""
    compile_for_sm90(
        """
        from executor.kernels.attention.decode_mma import build_decode_attention_mma, mma_warps
        i32, u32, bits3, bits4 = arr("int32", 1), arr("uint32", 1), arr("bfloat16", 3), arr("bfloat16", 4)
        meta = (i32,) * 8 + (u32,)
        for head_dim, group in ((128, 4), (256, 4)):
            direct, split = build_decode_attention_mma(head_dim, group, mma_warps(head_dim, group))
            for text in (ptx(direct, bits3, bits4, bits4, *meta, bits3, types.float32),
                         ptx(split, bits3, bits4, bits4, *meta, bits3, arr("float32", 4), arr("float32", 3),
                             types.float32)):
                assert "cp.async.cg.shared.global" in text and "cp.async.wait_group 1" in text
                assert "ldmatrix.sync.aligned.m8n8.x4.shared" in text and "ldmatrix.sync.aligned.m8n8.x4.trans" in text
                assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
                assert ".local" not in text, "q fragments or accumulators in local memory"
        """
    )
