"""GEMM prefill attention: its gather kernel, and the whole tiled attention
(executor.models.prefill_attention) against a float64 reference.

Simulator shapes: page size 4, D = 16 (8 words as bf16 pairs), 2 kv heads of group 3.
The whole-attention case is a 7-row chunk after 5 cached tokens on shuffled pages,
in tiles of 3 rows (3 + 3 + 1): each tile's GEMMs span only the keys its last row
sees, and the softmax masks the rest.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from executor.device import open_device
from executor.kernels.primitives.codec import build_codec
from executor.kernels.attention.causal_softmax import CausalSoftmax
from executor.kernels.rows.chunk_copy import ChunkCopy
from executor.kernels.attention.gather import GatherKv, PackedGatherKv
from executor.models.prefill_attention import GemmPrefillAttention
from executor.step import LongPrefillRequest
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, TOL, assert_close_rel

PAGE_SIZE, HEAD_DIM, NUM_KV_HEADS, GROUP = 4, 16, 2, 3


def _paged(num_tokens: int, num_pages: int, dtype: torch.dtype, generator: torch.Generator, device="cpu",
           head_dim: int = HEAD_DIM):
    """Random K and V caches [pages, S, Hkv, D] and the shuffled page list of one request (page 0 unused)."""
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    pages = (torch.randperm(num_pages - 1, generator=generator)[: -(-num_tokens // PAGE_SIZE)] + 1).to(torch.int32)
    return k_cache, v_cache, pages


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 6])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_gather_copies_a_requests_pages_in_token_order(dtype_name, head_dim):
    """D = 16: rows of whole 16-byte chunks, the vector kernel; D = 6 (3 or 6 words): the element kernel."""
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype_name)
    k_cache, v_cache, pages = _paged(10, 8, dtype, generator, head_dim=head_dim)
    page_indices = torch.cat([torch.tensor([7, 7], dtype=torch.int32), pages])  # another request's entries first
    capacity = 12
    keys = torch.full((NUM_KV_HEADS, capacity, head_dim), float("nan"), dtype=dtype)
    values = keys.clone()
    words = lambda t: t.view(torch.int32).numpy()  # noqa: E731  (bf16 pairs as one int32)
    GatherKv()(words(k_cache), words(v_cache), page_indices.numpy(), 2, 10, words(keys), words(values))
    token_pages = pages.long()[torch.arange(10) // PAGE_SIZE]
    offsets = torch.arange(10) % PAGE_SIZE
    assert torch.equal(keys[:, :10], k_cache[token_pages, offsets].transpose(0, 1))
    assert torch.equal(values[:, :10], v_cache[token_pages, offsets].transpose(0, 1))
    assert keys[:, 10:].isnan().all()  # nothing past num_tokens written


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_packed_gather_lays_the_packed_requests_keys_one_after_another(dtype_name):
    """One launch over a step of four requests: a 10-token chunk after 0 cached (packed), a decode row
    (skipped: below min_rows 2), a 3-row chunk after 4 cached tokens (packed: kv_len 7) and a 5-row
    chunk (packed). Their keys land at scratch rows 0, 10 and 17 in token order; nothing else is
    written."""
    generator = torch.Generator().manual_seed(1)
    dtype = getattr(torch, dtype_name)
    chunks = [(10, 10), (1, 9), (3, 7), (5, 5)]  # (rows, kv_len)
    shape = (16, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    page_lists = []
    free = (torch.randperm(15, generator=generator) + 1).tolist()
    for _, kv_len in chunks:
        count = -(-kv_len // PAGE_SIZE)
        page_lists.append(free[:count])
        free = free[count:]
    page_indices = torch.tensor([p for pages in page_lists for p in pages], dtype=torch.int32)
    page_indptr = torch.tensor([0, *torch.cumsum(torch.tensor([len(p) for p in page_lists]), 0).tolist()],
                               dtype=torch.int32)
    q_indptr = torch.tensor([0, *torch.cumsum(torch.tensor([rows for rows, _ in chunks]), 0).tolist()],
                            dtype=torch.int32)
    positions = torch.cat([torch.arange(kv - rows, kv, dtype=torch.int32) for rows, kv in chunks])
    capacity = 25
    keys = torch.full((NUM_KV_HEADS, capacity, HEAD_DIM), float("nan"), dtype=dtype)
    values = keys.clone()
    words = lambda t: t.view(torch.int32).numpy()  # noqa: E731  (bf16 pairs as one int32)
    PackedGatherKv()(words(k_cache), words(v_cache), page_indices.numpy(), page_indptr.numpy(), q_indptr.numpy(),
                     positions.numpy(), 0, 4, 10, 22, words(keys), words(values), min_rows=2)
    offset = 0
    for index in (0, 2, 3):
        kv_len = chunks[index][1]
        pages = torch.tensor(page_lists[index])
        token_pages, slots = pages[torch.arange(kv_len) // PAGE_SIZE], torch.arange(kv_len) % PAGE_SIZE
        assert torch.equal(keys[:, offset:offset + kv_len], k_cache[token_pages, slots].transpose(0, 1)), index
        assert torch.equal(values[:, offset:offset + kv_len], v_cache[token_pages, slots].transpose(0, 1)), index
        offset += kv_len
    assert offset == 22 and keys[:, offset:].isnan().all() and values[:, offset:].isnan().all()
    with pytest.raises(ValueError, match="23 tokens, scratch holds 22"):
        PackedGatherKv()(words(k_cache), words(v_cache), page_indices.numpy(), page_indptr.numpy(),
                         q_indptr.numpy(), positions.numpy(), 0, 4, 10, 23, words(keys[:, :22]),
                         words(values[:, :22]), min_rows=2)


def _reference_attention(q, k_cache, v_cache, pages, kv_len, scale):
    """float64 causal attention of q [n, Hq, D] (the last n of kv_len positions)."""
    n = q.shape[0]
    index = torch.arange(kv_len)
    keys = k_cache[pages.long()[index // PAGE_SIZE], index % PAGE_SIZE].double()  # [kv, Hkv, D]
    values = v_cache[pages.long()[index // PAGE_SIZE], index % PAGE_SIZE].double()
    keys = keys.repeat_interleave(GROUP, dim=1)  # [kv, Hq, D]
    values = values.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    positions = torch.arange(kv_len - n, kv_len)
    scores = scores.masked_fill(index[None, None, :] > positions[None, :, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _run_gemm_attention(device, dtype, num_rows, kv_len, rows_per_tile, generator):
    """A step of one GEMM request whose rows sit after another request's 2 rows; returns (out, reference)."""
    num_q_heads = NUM_KV_HEADS * GROUP
    k_cache, v_cache, pages = _paged(kv_len, -(-kv_len // PAGE_SIZE) + 3, dtype, generator, device.torch_device)
    page_indices = torch.cat([torch.tensor([1], dtype=torch.int32), pages]).to(device.torch_device)
    qkv = torch.randn(2 + num_rows, 2 * num_q_heads * HEAD_DIM, generator=generator).to(dtype).to(device.torch_device)
    q = qkv[:, : num_q_heads * HEAD_DIM].view(-1, num_q_heads, HEAD_DIM)  # a strided view, as in the model
    out = torch.full((2 + num_rows, num_q_heads, HEAD_DIM), float("nan"), dtype=dtype, device=device.torch_device)
    score_elements = num_q_heads * rows_per_tile * kv_len
    scratch = {
        "attn_packed": torch.empty(2 + num_rows, num_q_heads, HEAD_DIM, dtype=dtype, device=device.torch_device),
        "attn_keys": torch.empty(NUM_KV_HEADS, kv_len + 5, HEAD_DIM, dtype=dtype, device=device.torch_device),
        "attn_values": torch.empty(NUM_KV_HEADS, kv_len + 5, HEAD_DIM, dtype=dtype, device=device.torch_device),
        "attn_scores": torch.empty(score_elements, dtype=torch.float32, device=device.torch_device),
        "attn_probs": torch.empty(score_elements, dtype=dtype, device=device.torch_device),
    }
    request = LongPrefillRequest(request=1, q_start=2, num_rows=num_rows, kv_len=kv_len, page_start=1,
                                 rows_per_tile=rows_per_tile)
    step = SimpleNamespace(scratch=scratch.__getitem__, meta={"page_indices": page_indices}.__getitem__,
                           arena=SimpleNamespace(device=device), stream=device.current_stream(),
                           long_prefill_requests=(request,))
    codec = build_codec("float32" if dtype == torch.float32 else "bfloat16")
    scale = 1 / math.sqrt(HEAD_DIM)
    attention = GemmPrefillAttention(GatherKv(), CausalSoftmax(codec), ChunkCopy(), k_cache, v_cache, NUM_KV_HEADS,
                                     GROUP, scale)
    attention(step, q, out)
    reference = _reference_attention(q[2:].cpu(), k_cache.cpu(), v_cache.cpu(), pages.cpu(), kv_len, scale)
    assert out[:2].isnan().all()  # the other request's rows are not touched
    return out[2:].double().cpu(), reference


def test_tiled_gemm_attention_matches_float64():
    """7 rows after 5 cached tokens in tiles of 3, float32 (bf16 scores need CUDA's bmm out_dtype)."""
    got, reference = _run_gemm_attention(open_device("sim"), torch.float32, 7, 12, 3, torch.Generator().manual_seed(2))
    assert_close_rel(got, reference, TOL["float32"])


@pytest.mark.gpu
def test_tiled_gemm_attention_matches_float64_on_gpu_at_qwen3_8b_tiles():
    """bf16 on the H200: 1,000 rows after 3,100 cached tokens in tiles of 384 rows (GQA group 3 here)."""
    got, reference = _run_gemm_attention(open_device("cuda"), torch.bfloat16, 1000, 4100, 384,
                                         torch.Generator().manual_seed(3))
    assert_close_rel(got, reference, TOL["bfloat16"])


@pytest.mark.ptx
def test_compiles_for_sm90():
    """The gather kernels, with float32 math only; the vector and packed ones with 16-byte accesses."""
    compile_for_sm90(
        """
        from executor.kernels.attention.gather import build_gather_kv, build_gather_kv_packed, build_gather_kv_vector
        i32 = arr("int32", 1)
        caches, scratch = (arr("int32", 4), arr("int32", 4)), (arr("int32", 3), arr("int32", 3))
        args = (*caches, i32, types.int32, types.int32, *scratch)
        ptx(build_gather_kv(), *args)
        vector_ptx(build_gather_kv_vector(), *args)
        vector_ptx(build_gather_kv_packed(), *caches, i32, i32, i32, i32, types.int32, types.int32, *scratch)
        """
    )
