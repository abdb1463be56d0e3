"""Decode attention (one query row per request) against the float64 reference of test_attention.

Simulator shapes: D = 16, 2 kv heads, 32 threads, page size 4, rounds of 8 keys, so a row crosses
pages and softmax rounds and a lane group's unrolled keys run past a round's end; one request is
split into kv chunks. Cache rows that are not 16-byte chunks go to the general kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.attention.paged import PagedAttention
from executor.tiles import plan_tiles
from executor.kernels.primitives.codec import build_codec
from executor.kernels.attention.decode import DecodeAttention
from executor.kernels.primitives.launch import SHARED_LIMIT_BYTES
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import TOL, assert_close_rel, from_storage, poisoned, to_storage
from tests.kernels.test_attention import HEAD_DIM, NUM_KV_HEADS, PAGE_SIZE, make_batch, reference

cuda = load_cuda()

BATCH = [(1, 7), (1, 19), (1, 1), (1, 8)]  # (rows, kv_len): decode rows only
NUM_PAGES = 16


def run_decode(dtype_name: str, group: int, kv_chunk: int | None, seed: int, misaligned: bool = False,
               head_dim: int = HEAD_DIM, batch: list[tuple[int, int]] = BATCH, num_pages: int = NUM_PAGES,
               **launcher: object) -> DecodeAttention:
    """One decode call against the float64 reference; ``launcher``: DecodeAttention's keywords
    (default the CUDA-core kernel's small simulator blocks). Returns the launcher."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    meta = make_batch(batch, PAGE_SIZE, num_pages, rng)
    num_rows, num_q_heads = len(batch), NUM_KV_HEADS * group
    # misaligned: every cache row starts one element past a 16-byte boundary
    shift = int(misaligned)
    padded = to_storage(torch.randn(num_pages, 2, 2, PAGE_SIZE, NUM_KV_HEADS, head_dim + shift, generator=gen),
                        dtype_name)
    pool = np.ascontiguousarray(padded[..., shift:])
    pool_device = cuda.to_device(padded)[:, :, :, :, :, shift:]  # device arrays take no Ellipsis
    k_cache, v_cache = pool_device[:, 1, 0], pool_device[:, 1, 1]
    qproj = to_storage(torch.randn(num_rows, num_q_heads, 2 * head_dim, generator=gen), dtype_name)
    q = cuda.to_device(qproj)[:, :, :head_dim]  # strided, as the q part of the fused qkv buffer
    out = cuda.to_device(poisoned((num_rows, num_q_heads, head_dim), dtype_name))
    scale = head_dim**-0.5
    codec = build_codec(dtype_name)
    general = PagedAttention(codec, head_dim, group, threads=32, block_keys=4)
    attention = DecodeAttention(codec, head_dim, group, general, **(launcher or {"threads": 32, "round_keys": 8}))
    assert attention.uses_vector(k_cache, v_cache) == (not misaligned)
    max_splits = 3 if kv_chunk else 1
    capacity = num_rows * max_splits + 2  # a graph-sized grid: the -1 tail must be skipped
    buffers = tuple(np.zeros(capacity, np.int32) for _ in range(3)) + (np.zeros(num_rows, np.int32),)
    plan_tiles(meta["q_indptr"], meta["kv_lens"], kv_chunk=kv_chunk, max_splits=max_splits, out=buffers)
    partial_out = partial_lse = None
    if kv_chunk:
        partial_out = np.full((num_rows, max_splits, num_q_heads, head_dim), np.nan, np.float32)
        partial_lse = np.full((num_rows, max_splits, num_q_heads), np.nan, np.float32)
    attention(q, k_cache, v_cache, meta["page_indices"], meta["page_indptr"], meta["last_page_len"],
              meta["q_indptr"], meta["batch_indices"], meta["positions"], buffers[0], buffers[1], buffers[2],
              buffers[3], meta["total_num_rows"], out, scale, partial_out=partial_out, partial_lse=partial_lse)
    expected = reference(from_storage(np.ascontiguousarray(qproj[..., :head_dim]), dtype_name),
                         from_storage(pool[:, 1, 0], dtype_name), from_storage(pool[:, 1, 1], dtype_name),
                         meta, scale)
    assert_close_rel(from_storage(out.copy_to_host(), dtype_name), expected, TOL[dtype_name])
    return attention


@pytest.mark.parametrize("dtype_name,group,kv_chunk", [
    ("float32", 1, None), ("float32", 6, None), ("bfloat16", 5, None), ("float32", 2, 8), ("bfloat16", 6, 8),
])
def test_decode_attention_matches_reference(dtype_name, group, kv_chunk):
    run_decode(dtype_name, group, kv_chunk, seed=group + (kv_chunk or 0))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_unaligned_cache_rows_run_the_general_kernel(dtype_name):
    run_decode(dtype_name, 2, 8, seed=3, misaligned=True)


@pytest.mark.ptx
def test_decode_attention_compiles_for_sm90():
    """PTX for sm_90 at Qwen3 (D 128, G 4) and Qwen3.5 (D 256, G 6) shapes, both codecs' kernels:
    16-byte K/V loads, registers only."""
    compile_for_sm90(
        """
        from executor.kernels.attention.decode import build_decode_attention
        i32, u32 = arr("int32", 1), arr("uint32", 1)
        meta = (i32,) * 8 + (u32,)
        for name, head_dim, group, which in (("bfloat16", 128, 4, "split"), ("float32", 256, 6, "direct")):
            direct, split = build_decode_attention(build_codec(name), head_dim, group, 128)
            arr3, arr4 = arr(name, 3), arr(name, 4)
            if which == "direct":
                text = ptx(direct, arr3, arr4, arr4, *meta, arr3, types.float32)
            else:
                text = ptx(split, arr3, arr4, arr4, *meta, arr3, arr("float32", 4), arr("float32", 3), types.float32)
            assert "ld.global.v4" in text, f"{name}: no 16-byte K/V loads"
            assert ".local" not in text, f"{name}: q, accumulators or chunk buffers in local memory"
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cuda-cores", "tensor-cores", "tensor-cores-many-pairs"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 4, 256), (24, 4, 256)])
def test_decode_attention_gpu_bf16_long_contexts(num_q_heads, num_kv_heads, head_dim, kernel):
    """Real sizes in bf16, contexts up to 32k, unsplit and split into kv chunks, against float64 sdpa:
    the CUDA-core kernel, and the tensor-core kernel in its most warps a block (also at D 256, which
    the launcher leaves to CUDA cores by default) and in its shape for calls of many pairs."""
    from executor.kernels.attention.decode_mma import MANY_PAIRS_SHAPE, MmaShape, mma_warps, shared_bytes
    from planner.kernel_limits import MIN_KV_CHUNK_TOKENS

    device = torch.device("cuda")
    page_size, group, max_splits = 16, num_q_heads // num_kv_heads, 32
    batch = [(1, 32768), (1, 4097), (1, 1), (1, 700)]
    rng = np.random.default_rng(0)
    num_pages = sum(-(-kv // page_size) for _, kv in batch) + 4
    meta = make_batch(batch, page_size, num_pages, rng)
    torch.manual_seed(0)
    pool = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, device=device).to(torch.bfloat16)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    q = torch.randn(len(batch), num_q_heads, head_dim, device=device).to(torch.bfloat16)
    codec = build_codec("bfloat16")
    shape = {"tensor-cores": MmaShape(mma_warps(head_dim, group), 2), "tensor-cores-many-pairs": MANY_PAIRS_SHAPE,
             "cuda-cores": None}[kernel]
    if shape is not None and shared_bytes(head_dim, group, shape.warps, shape.slots) > SHARED_LIMIT_BYTES:
        pytest.skip(f"{shape} does not fit D {head_dim}, G {group}")
    launcher = {"mma_shape": shape} if shape else {"tensor_cores": False}
    attention = DecodeAttention(codec, head_dim, group, PagedAttention(codec, head_dim, group), **launcher)
    assert attention.uses_vector(k_cache, v_cache)
    assert (attention.mma_launch(len(batch), num_kv_heads) or (None, None, None))[2] == shape
    dev = {k: torch.as_tensor(v, device=device) for k, v in meta.items() if isinstance(v, np.ndarray)}
    dev["total_num_rows"] = cuda.to_device(meta["total_num_rows"])
    scale = head_dim**-0.5
    kv_chunk = -(-32768 // max_splits // MIN_KV_CHUNK_TOKENS) * MIN_KV_CHUNK_TOKENS
    for split in ({}, {"kv_chunk": kv_chunk, "max_splits": max_splits}):
        tiles = [torch.as_tensor(a, device=device) for a in plan_tiles(meta["q_indptr"], meta["kv_lens"], **split)]
        out = torch.full(q.shape, float("nan"), device=device, dtype=torch.bfloat16)
        scratch = {}
        if split:
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
            assert error <= 1e-2, (split, b, error)
