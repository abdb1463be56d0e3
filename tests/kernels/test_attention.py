"""Paged causal attention against a float64 torch reference, plus plan_tiles.

Simulator tests use tiny shapes: page size 4, D = 16, 2 kv heads, 32 threads,
key blocks of 4 (so every row crosses several key blocks and pages). The batch
mixes a decode row (kv_len 7), a 5-row prefill chunk after 3 earlier tokens, a
first-token request (kv_len 1) and a decode row on a full last page; physical
pages are shuffled and one is listed by two requests (prefix sharing).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.attention.paged import PagedAttention
from executor.tiles import plan_decode_tiles, plan_tiles
from executor.kernels.primitives.codec import build_codec
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import TOL, assert_close_rel, from_storage, poisoned, to_storage

cuda = load_cuda()

# (rows in this step, kv_len after it) per request.
BATCH = [(1, 7), (5, 8), (1, 1), (1, 8)]
PAGE_SIZE = 4
HEAD_DIM = 16
NUM_KV_HEADS = 2


def make_batch(batch, page_size, num_pages, rng, shared_first_page=True):
    """Metadata for a batch: shuffled physical pages (page 0 reserved), the first page of
    requests 0 and 1 shared. Returns a dict of int32 numpy arrays and python lists."""
    physical = list(rng.permutation(np.arange(1, num_pages)))
    page_lists = []
    for b, (_, kv_len) in enumerate(batch):
        count = -(-kv_len // page_size)
        if shared_first_page and b == 1:
            page_lists.append([page_lists[0][0]] + [physical.pop() for _ in range(count - 1)])
        else:
            page_lists.append([physical.pop() for _ in range(count)])
    rows = [n for n, _ in batch]
    kv_lens = [kv for _, kv in batch]
    positions = np.concatenate([np.arange(kv - n, kv) for n, kv in batch]).astype(np.int32)
    return {
        "page_lists": page_lists,
        "kv_lens": kv_lens,
        "page_indices": np.array([p for pages in page_lists for p in pages], dtype=np.int32),
        "page_indptr": np.cumsum([0] + [len(p) for p in page_lists]).astype(np.int32),
        "last_page_len": np.array([kv - (len(p) - 1) * page_size for p, kv in zip(page_lists, kv_lens)], np.int32),
        "q_indptr": np.cumsum([0] + rows).astype(np.int32),
        "batch_indices": np.repeat(np.arange(len(batch)), rows).astype(np.int32),
        "positions": positions,
        "total_num_rows": np.array([sum(rows)], dtype=np.uint32),
    }


def reference(q, k_cache, v_cache, meta, scale):
    """float64 masked softmax attention per row, K/V gathered by each request's page list."""
    num_rows, num_q_heads, _ = q.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for t in range(num_rows):
        b, p = int(meta["batch_indices"][t]), int(meta["positions"][t])
        pages = torch.as_tensor(np.asarray(meta["page_lists"][b]), dtype=torch.long, device=q.device)
        keys = k_cache[pages].flatten(0, 1)[: p + 1].repeat_interleave(group, dim=1)  # [p+1, Hq, D]
        values = v_cache[pages].flatten(0, 1)[: p + 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[t], keys) * scale
        out[t] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values)
    return out


def run_case(dtype_name, group, rows_per_tile=1, kv_chunk=None, strided=False, seed=0):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    meta = make_batch(BATCH, PAGE_SIZE, 10, rng)
    num_rows = int(meta["total_num_rows"][0])
    num_q_heads = NUM_KV_HEADS * group
    # A 2-layer page-first pool; the kernel sees layer 1's strided K and V views.
    # Strided views are taken on device arrays (the simulator only transfers contiguous numpy arrays).
    pool = to_storage(torch.randn(10, 2, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen), dtype_name)
    pool_device = cuda.to_device(pool)
    k_cache, v_cache = pool_device[:, 1, 0], pool_device[:, 1, 1]
    qproj = to_storage(torch.randn(num_rows, num_q_heads, 2 * HEAD_DIM, generator=gen), dtype_name)
    q_host = qproj[..., :HEAD_DIM] if strided else np.ascontiguousarray(qproj[..., HEAD_DIM:])
    q = cuda.to_device(qproj)[:, :, :HEAD_DIM] if strided else cuda.to_device(q_host)  # no Ellipsis on device arrays
    out = cuda.to_device(poisoned((num_rows, num_q_heads, HEAD_DIM), dtype_name))
    scale = HEAD_DIM**-0.5

    attention = PagedAttention(build_codec(dtype_name), HEAD_DIM, group,
                               rows_per_tile=rows_per_tile, threads=32, block_keys=4)
    # Capacity-sized tile buffers: the padded tail (request -1) must be skipped.
    capacity = len(plan_tiles(meta["q_indptr"], meta["kv_lens"], rows_per_tile=rows_per_tile, kv_chunk=kv_chunk,
                              max_splits=3)[0]) + 2
    buffers = (np.zeros(capacity, np.int32), np.zeros(capacity, np.int32), np.zeros(capacity, np.int32),
               np.zeros(len(BATCH) + 1, np.int32))
    max_splits = 3 if kv_chunk else 1
    attention.plan_tiles(meta["q_indptr"], meta["kv_lens"], kv_chunk=kv_chunk, max_splits=max_splits, out=buffers)
    request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size = buffers
    partial_out = partial_lse = None
    if kv_chunk:
        partial_out = np.full((num_rows, max_splits, num_q_heads, HEAD_DIM), np.nan, np.float32)
        partial_lse = np.full((num_rows, max_splits, num_q_heads), np.nan, np.float32)
    attention(q, k_cache, v_cache, meta["page_indices"], meta["page_indptr"], meta["last_page_len"],
              meta["q_indptr"], meta["batch_indices"], meta["positions"], request_indices, qo_tile_indices,
              kv_tile_indices, kv_chunk_size[: len(BATCH)], meta["total_num_rows"], out, scale,
              partial_out=partial_out, partial_lse=partial_lse)

    expected = reference(from_storage(q_host, dtype_name), from_storage(pool[:, 1, 0], dtype_name),
                         from_storage(pool[:, 1, 1], dtype_name), meta, scale)
    assert_close_rel(from_storage(out.copy_to_host(), dtype_name), expected, TOL[dtype_name])


@pytest.mark.parametrize(
    "dtype_name,group",
    [("float32", 1), ("float32", 2), ("float32", 5), ("float32", 6), ("bfloat16", 1), ("bfloat16", 6)],
)
def test_paged_attention_one_row_tiles(dtype_name, group):
    run_case(dtype_name, group, strided=group in (2, 6), seed=group)


@pytest.mark.parametrize("dtype_name,group,rows_per_tile", [("float32", 2, 3), ("bfloat16", 5, 2)])
def test_paged_attention_multi_row_tiles(dtype_name, group, rows_per_tile):
    run_case(dtype_name, group, rows_per_tile=rows_per_tile, strided=True, seed=11)


@pytest.mark.parametrize("dtype_name,rows_per_tile", [("float32", 1), ("bfloat16", 2)])
def test_paged_attention_split_kv(dtype_name, rows_per_tile):
    run_case(dtype_name, group=2, rows_per_tile=rows_per_tile, kv_chunk=3, seed=21)


def test_plan_tiles_one_chunk():
    request_indices, qo, kv, chunk = plan_tiles([0, 1, 6, 7], [7, 8, 1])
    assert request_indices.tolist() == [0, 1, 1, 1, 1, 1, 2]
    assert qo.tolist() == [0, 0, 1, 2, 3, 4, 0]
    assert kv.tolist() == [0] * 7
    assert chunk.tolist() == [7, 8, 1]
    assert all(a.dtype == np.int32 for a in (request_indices, qo, kv, chunk))


def test_plan_tiles_rows_per_tile_and_split():
    # Request 0: 5 rows at positions 3..7, R = 2 -> query tiles of rows {3,4}, {5,6}, {7};
    # chunk 3 -> their causal limits 5, 7, 8 need 2, 3, 3 chunks. Request 1: decode at 9 -> 4 chunks.
    request_indices, qo, kv, chunk = plan_tiles([0, 5, 6], [8, 10], rows_per_tile=2, kv_chunk=3, max_splits=4)
    assert request_indices.tolist() == [0] * 8 + [1] * 4
    assert qo.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0]
    assert kv.tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3]
    assert chunk.tolist() == [3, 3]


def test_plan_tiles_writes_capacity_buffers_and_checks_them():
    out = tuple(np.full(6, 99, np.int32) for _ in range(3)) + (np.full(4, 99, np.int32),)
    views = plan_tiles([0, 1, 3], [4, 2], out=out)
    assert [v.tolist() for v in views] == [[0, 1, 1], [0, 0, 1], [0, 0, 0], [4, 2]]
    assert out[0].tolist() == [0, 1, 1, -1, -1, -1]
    assert out[3].tolist() == [4, 2, 2**31 - 1, 2**31 - 1]
    with pytest.raises(ValueError, match="attention tiles: need 3, planned 2"):
        plan_tiles([0, 1, 3], [4, 2], out=tuple(np.zeros(2, np.int32) for _ in range(4)))
    with pytest.raises(ValueError, match="kv splits: need 3, planned 2"):
        plan_tiles([0, 1], [9], kv_chunk=4, max_splits=2)
    with pytest.raises(ValueError):
        plan_tiles([0, 3], [2])  # more rows than kv tokens


def test_merge_rejects_a_deeper_split_scratch_than_it_weighs():
    """The merge stages a row's log-sum-exps in shared memory of MAX_MERGE_CHUNKS; a deeper scratch is
    an error that names both depths, before any launch."""
    from executor.kernels.attention.merge import MAX_MERGE_CHUNKS

    attention = PagedAttention(build_codec("float32"), HEAD_DIM, 2, threads=32)
    depth = MAX_MERGE_CHUNKS + 1
    partial_out = np.zeros((1, depth, 4, HEAD_DIM), np.float32)
    partial_lse = np.zeros((1, depth, 4), np.float32)
    ints = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match=f"{depth} kv chunks.*at most {MAX_MERGE_CHUNKS}"):
        attention.merge(partial_out, partial_lse, ints, ints, np.ones(1, np.int32), np.ones(1, np.uint32),
                               np.zeros((1, 4, HEAD_DIM), np.float32))


@pytest.mark.ptx
def test_compiles_for_sm90():
    """PTX for sm_90, both codecs, real tile shapes (also checks real-GPU compilation on CPU machines)."""
    compile_for_sm90(
        """
        from executor.kernels.attention.merge import build_merge_kernel
        from executor.kernels.attention.paged import build_paged_attention
        i32, u32 = arr("int32", 1), arr("uint32", 1)
        meta = (i32,) * 9 + (u32,)
        part = (arr("float32", 4), arr("float32", 3))
        # (dtype, D, group, rows per tile, kernels): each kernel of each codec at least
        # once, at Qwen3 / Qwen3.5 tile shapes (~3 s per attention kernel compile).
        cases = (("bfloat16", 128, 4, 1, "direct merge"), ("bfloat16", 256, 6, 1, "split"),
                 ("float32", 256, 2, 4, "direct"))
        for name, head_dim, group, rows, which in cases:
            direct, split = build_paged_attention(build_codec(name), head_dim, group, rows)
            merge = build_merge_kernel(build_codec(name), head_dim)
            arr3, arr4 = arr(name, 3), arr(name, 4)
            if "direct" in which:
                ptx(direct, arr3, arr4, arr4, *meta, arr3, types.float32)
            if "split" in which:
                ptx(split, arr3, arr4, arr4, *meta, arr3, *part, types.float32)
            if "merge" in which:  # its batch of chunk partials stays in registers
                text = ptx(merge, arr("float32", 1), part[1], i32, i32, i32, u32, arr3)
                assert ".local" not in text, f"{name}: merge uses local memory"
                # One 64-bit division, the row's chunk count: a strided range() loop would add one for
                # its trip count, and at batch 1 every instruction of a warp's chain is latency.
                divisions = text.count("div.s64") + text.count("div.u64")
                assert divisions <= 1, f"{name}: merge has {divisions} 64-bit divisions, at most 1 expected"
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim",
    [(32, 8, 128), (8, 2, 256), (24, 4, 256)],  # Qwen3-8B, Qwen3.5-9B-like, group 6 (Qwen3.5-27B)
)
@pytest.mark.parametrize("kv_chunk,rows_per_tile", [(None, 1), (1024, 1), (None, 4)])
def test_paged_attention_gpu_bf16(num_q_heads, num_kv_heads, head_dim, kv_chunk, rows_per_tile):
    """Real sizes in bf16 on the GPU against torch sdpa over gathered K/V."""
    device = torch.device("cuda")
    page_size, group = 16, num_q_heads // num_kv_heads
    batch = [(1, 4096), (1, 517), (300, 1500), (64, 64), (1, 2048)]
    rng = np.random.default_rng(0)
    num_pages = sum(-(-kv // page_size) for _, kv in batch) + 4
    meta = make_batch(batch, page_size, num_pages, rng)
    num_rows = int(meta["total_num_rows"][0])
    torch.manual_seed(0)
    pool = torch.randn(num_pages, 2, 2, page_size, num_kv_heads, head_dim, device=device).to(torch.bfloat16)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    qproj = torch.randn(num_rows, num_q_heads, 2 * head_dim, device=device).to(torch.bfloat16)
    q = qproj[..., :head_dim]
    out = torch.full((num_rows, num_q_heads, head_dim), float("nan"), device=device, dtype=torch.bfloat16)
    attention = PagedAttention(build_codec("bfloat16"), head_dim, group, rows_per_tile=rows_per_tile)
    max_splits = 4 if kv_chunk else 1
    tiles = attention.plan_tiles(meta["q_indptr"], meta["kv_lens"], kv_chunk=kv_chunk, max_splits=max_splits)
    dev = {k: torch.as_tensor(v, device=device) for k, v in meta.items() if isinstance(v, np.ndarray)}
    dev["total_num_rows"] = cuda.to_device(meta["total_num_rows"])  # uint32: a numba device array
    tiles = [torch.as_tensor(a, device=device) for a in tiles]
    partial_out = partial_lse = None
    if kv_chunk:
        partial_out = torch.empty(num_rows, max_splits, num_q_heads, head_dim, device=device)
        partial_lse = torch.empty(num_rows, max_splits, num_q_heads, device=device)
    scale = head_dim**-0.5
    attention(q.view(torch.int16), k_cache.view(torch.int16), v_cache.view(torch.int16), dev["page_indices"],
              dev["page_indptr"], dev["last_page_len"], dev["q_indptr"], dev["batch_indices"], dev["positions"],
              *tiles, dev["total_num_rows"], out.view(torch.int16), scale,
              partial_out=partial_out, partial_lse=partial_lse)
    torch.cuda.synchronize()
    for b, (rows, kv_len) in enumerate(batch):
        pages = torch.as_tensor(meta["page_lists"][b], device=device, dtype=torch.long)
        keys = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1).double()  # [Hkv, kv, D]
        values = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1).double()
        rows_q = q[int(meta["q_indptr"][b]) : int(meta["q_indptr"][b + 1])].transpose(0, 1).double()
        mask = torch.ones(rows, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - rows)
        expected = torch.nn.functional.scaled_dot_product_attention(
            rows_q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        got = out[int(meta["q_indptr"][b]) : int(meta["q_indptr"][b + 1])].double()
        assert torch.isfinite(got).all()
        error = (got - expected).abs().max().item() / expected.abs().max().item()
        assert error <= 1e-2, (b, error)


def test_decode_tiles_are_plan_tiles_of_one_row_per_request():
    rng = np.random.default_rng(7)
    for _ in range(200):
        batch = int(rng.integers(1, 9))
        kv_lens = rng.integers(1, 300, batch).astype(np.int64)
        chunk = int(rng.choice([1, 7, 64, 512]))
        splits = int(((kv_lens - 1) // np.minimum(chunk, kv_lens) + 1).max())
        q_indptr = np.arange(batch + 1)
        expected = plan_tiles(q_indptr, kv_lens, kv_chunk=chunk, max_splits=splits)
        got = plan_decode_tiles(kv_lens, chunk, splits)
        for want, have in zip(expected, got):
            assert have.dtype == np.int32 and np.array_equal(want, have)
        if splits > 1:
            with pytest.raises(ValueError, match="kv splits"):
                plan_decode_tiles(kv_lens, chunk, splits - 1)
