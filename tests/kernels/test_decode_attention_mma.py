"""Tensor-core decode attention (decode_attention_mma.py) against the float64 reference of test_attention.

Simulator shapes: D = 32 (the smallest head an ldmatrix.x4 load covers), 2 kv heads, bf16, page size
4, two warps a block with two ring slots each (and the launcher's default shape), so a warp's slots of
eight keys cross pages, refill ring slots they used, end past the chunk and, at one key, leave the
other warp no slot at all; one request is split into kv chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.attention import PagedAttention, plan_tiles
from executor.kernels.codec import build_codec
from executor.kernels.decode_attention import DecodeAttention
from executor.kernels.decode_attention_mma import MAX_GROUP, MmaShape, default_mma_shape, mma_warps, shared_bytes
from executor.kernels.launch import SHARED_LIMIT_BYTES
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import TOL, assert_close_rel, from_storage, poisoned, to_storage
from tests.kernels.test_attention import NUM_KV_HEADS, PAGE_SIZE, make_batch, reference

cuda = load_cuda()

HEAD_DIM = 32
BATCH = [(1, 37), (1, 19), (1, 1), (1, 8)]  # (rows, kv_len): decode rows only
NUM_PAGES = 24


def run_decode(group: int, kv_chunk: int | None, seed: int, tensor_cores: bool = True, **launcher: object) -> None:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    meta = make_batch(BATCH, PAGE_SIZE, NUM_PAGES, rng)
    num_rows, num_q_heads = len(BATCH), NUM_KV_HEADS * group
    pool = to_storage(torch.randn(NUM_PAGES, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen), "bfloat16")
    pool_device = cuda.to_device(pool)
    k_cache, v_cache = pool_device[:, 0], pool_device[:, 1]
    qproj = to_storage(torch.randn(num_rows, num_q_heads, 2 * HEAD_DIM, generator=gen), "bfloat16")
    q = cuda.to_device(qproj)[:, :, :HEAD_DIM]  # strided, as the q part of the fused qkv buffer
    out = cuda.to_device(poisoned((num_rows, num_q_heads, HEAD_DIM), "bfloat16"))
    scale = HEAD_DIM**-0.5
    codec = build_codec("bfloat16")
    general = PagedAttention(codec, HEAD_DIM, group, threads=32, block_keys=4)
    attention = DecodeAttention(codec, HEAD_DIM, group, general, **(launcher or {"mma_shape": MmaShape(2, 2)}))
    assert attention.uses_vector(k_cache, v_cache)
    assert attention.runs_tensor_cores(num_rows, NUM_KV_HEADS) == tensor_cores
    max_splits = 3 if kv_chunk else 1
    capacity = num_rows * max_splits + 2  # a graph-sized grid: the -1 tail must be skipped
    buffers = tuple(np.zeros(capacity, np.int32) for _ in range(3)) + (np.zeros(num_rows, np.int32),)
    plan_tiles(meta["q_indptr"], meta["kv_lens"], kv_chunk=kv_chunk, max_splits=max_splits, out=buffers)
    partial_out = partial_lse = None
    if kv_chunk:
        partial_out = np.full((num_rows, max_splits, num_q_heads, HEAD_DIM), np.nan, np.float32)
        partial_lse = np.full((num_rows, max_splits, num_q_heads), np.nan, np.float32)
    attention(q, k_cache, v_cache, meta["page_indices"], meta["page_indptr"], meta["last_page_len"],
              meta["q_indptr"], meta["batch_indices"], meta["positions"], buffers[0], buffers[1], buffers[2],
              buffers[3], meta["total_num_rows"], out, scale, partial_out=partial_out, partial_lse=partial_lse)
    expected = reference(from_storage(np.ascontiguousarray(qproj[..., :HEAD_DIM]), "bfloat16"),
                         from_storage(pool[:, 0], "bfloat16"), from_storage(pool[:, 1], "bfloat16"), meta, scale)
    assert_close_rel(from_storage(out.copy_to_host(), "bfloat16"), expected, TOL["bfloat16"])


@pytest.mark.parametrize("group,kv_chunk", [(1, None), (5, None), (8, None), (4, 16)])
def test_mma_decode_attention_matches_reference(group, kv_chunk):
    run_decode(group, kv_chunk, seed=group + (kv_chunk or 0))


@pytest.mark.parametrize("num_sms,tensor_cores", [(4, True), (3, False)])
def test_calls_of_many_pairs_run_the_cuda_core_kernel(num_sms, tensor_cores):
    """Four rows x two kv heads: 8 (row, kv head) pairs, within two an SM for 4 SMs (the default
    tensor-core shape, four warps of two slots) and past it for 3 (the CUDA-core kernel); both give
    the reference's output."""
    run_decode(3, None, seed=11, tensor_cores=tensor_cores, num_sms=num_sms)


def test_mma_shapes_and_shared_memory():
    """Qwen3 (D 128, G 4) gets four warps and Qwen3.5 (D 256, G 4) two, each within the shared-memory
    limit; heads the tile cannot hold, or not a multiple of 32, get none (the CUDA-core kernel), and
    by default only heads of at most 128 run on tensor cores."""
    assert mma_warps(128, 4) == 4 and mma_warps(256, 4) == 2
    assert default_mma_shape(128, 4) == MmaShape(4, 2) and default_mma_shape(256, 4) is None
    for head_dim, group in ((128, 4), (256, 4), (256, 6), (128, 8)):
        warps = mma_warps(head_dim, group)
        assert shared_bytes(head_dim, group, warps, 2) <= SHARED_LIMIT_BYTES
        assert warps == 4 or shared_bytes(head_dim, group, warps + 1, 2) > SHARED_LIMIT_BYTES
    assert mma_warps(128, MAX_GROUP + 1) is None and mma_warps(80, 4) is None and mma_warps(16, 1) is None


def test_mma_decode_attention_compiles_for_sm90():
    """PTX for sm_90 at Qwen3 (D 128, G 4) and Qwen3.5 (D 256, G 4): K/V staged by cp.async, read
    by ldmatrix (V transposed), bf16 MMAs, registers only."""
    compile_for_sm90(
        """
        from executor.kernels.decode_attention_mma import build_decode_attention_mma, mma_warps
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


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 4, 256)])
def test_mma_decode_attention_gpu_bf16_long_contexts(num_q_heads, num_kv_heads, head_dim):
    """Real sizes in bf16, contexts up to 32k, unsplit and split into kv chunks, against float64 sdpa."""
    device = torch.device("cuda")
    page_size, group = 16, num_q_heads // num_kv_heads
    batch = [(1, 32768), (1, 4097), (1, 1), (1, 700)]
    rng = np.random.default_rng(0)
    num_pages = sum(-(-kv // page_size) for _, kv in batch) + 4
    meta = make_batch(batch, page_size, num_pages, rng)
    torch.manual_seed(0)
    pool = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, device=device).to(torch.bfloat16)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    q = torch.randn(len(batch), num_q_heads, head_dim, device=device).to(torch.bfloat16)
    codec = build_codec("bfloat16")
    shape = MmaShape(mma_warps(head_dim, group), 2)
    attention = DecodeAttention(codec, head_dim, group, PagedAttention(codec, head_dim, group), mma_shape=shape)
    assert attention.runs_tensor_cores(len(batch), num_kv_heads)
    dev = {k: torch.as_tensor(v, device=device) for k, v in meta.items() if isinstance(v, np.ndarray)}
    dev["total_num_rows"] = cuda.to_device(meta["total_num_rows"])
    scale = head_dim**-0.5
    for kv_chunk, max_splits in ((None, 1), (1024, 32)):
        split = {"kv_chunk": kv_chunk, "max_splits": max_splits} if kv_chunk else {}
        tiles = [torch.as_tensor(a, device=device) for a in plan_tiles(meta["q_indptr"], meta["kv_lens"], **split)]
        out = torch.full(q.shape, float("nan"), device=device, dtype=torch.bfloat16)
        scratch = {}
        if kv_chunk:
            scratch = {"partial_out": torch.empty(len(batch), max_splits, num_q_heads, head_dim, device=device),
                       "partial_lse": torch.empty(len(batch), max_splits, num_q_heads, device=device)}
        attention(q.view(torch.int16), k_cache.view(torch.int16), v_cache.view(torch.int16), dev["page_indices"],
                  dev["page_indptr"], dev["last_page_len"], dev["q_indptr"], dev["batch_indices"], dev["positions"],
                  *tiles, dev["total_num_rows"], out.view(torch.int16), scale, **scratch,
                  stream=cuda.external_stream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        for b, (_, kv_len) in enumerate(batch):
            pages = torch.as_tensor(meta["page_lists"][b], device=device, dtype=torch.long)
            keys = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1).double()
            values = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1).double()
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1].transpose(0, 1).double(), keys, values, scale=scale, enable_gqa=True).transpose(0, 1)
            got = out[b : b + 1].double()
            assert torch.isfinite(got).all()
            error = (got - expected).abs().max().item() / expected.abs().max().item()
            assert error <= 1e-2, (kv_chunk, b, error)
