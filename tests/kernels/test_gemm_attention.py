"""GEMM prefill attention: its gather and softmax kernels, and the whole tiled attention
(executor.models.prefill_attention) against a float64 reference.

Simulator shapes: page size 4, D = 16 (8 words as bf16 pairs), 2 kv heads of group 3.
The whole-attention case is a 7-row chunk after 5 cached tokens on shuffled pages,
in tiles of 3 rows (3 + 3 + 1): each tile's GEMMs span only the keys its last row
sees, and the softmax masks the rest.

The softmax runs each of its kernels at tiny K by lowering the shared memory budget
(CausalSoftmax's shared_budget): the cached kernel at 8, 4, 2 and 1 rows a block, and
the streaming one (budget 0). Rows of odd K start at every offset within a 16-byte
chunk, of scores and of bf16 probabilities alike.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from executor.device import open_device
from executor.kernels.codec import build_codec
from executor.kernels.gemm_attention import CACHED_ROWS, SHARED_LIMIT_BYTES, CausalSoftmax, GatherKv
from executor.models.prefill_attention import GemmPrefillAttention
from executor.step import GemmRequest
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, TOL, assert_close_rel, from_storage, poisoned

PAGE_SIZE, HEAD_DIM, NUM_KV_HEADS, GROUP = 4, 16, 2, 3


def _paged(num_tokens: int, num_pages: int, dtype: torch.dtype, generator: torch.Generator, device="cpu"):
    """Random K and V caches [pages, S, Hkv, D] and the shuffled page list of one request (page 0 unused)."""
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(device)
    pages = (torch.randperm(num_pages - 1, generator=generator)[: -(-num_tokens // PAGE_SIZE)] + 1).to(torch.int32)
    return k_cache, v_cache, pages


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_gather_copies_a_requests_pages_in_token_order(dtype_name):
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype_name)
    k_cache, v_cache, pages = _paged(10, 8, dtype, generator)
    page_indices = torch.cat([torch.tensor([7, 7], dtype=torch.int32), pages])  # another request's entries first
    capacity = 12
    keys = torch.full((NUM_KV_HEADS, capacity, HEAD_DIM), float("nan"), dtype=dtype)
    values = keys.clone()
    words = lambda t: t.view(torch.int32).numpy()  # noqa: E731  (bf16 pairs as one int32)
    GatherKv()(words(k_cache), words(v_cache), page_indices.numpy(), 2, 10, words(keys), words(values))
    token_pages = pages.long()[torch.arange(10) // PAGE_SIZE]
    offsets = torch.arange(10) % PAGE_SIZE
    assert torch.equal(keys[:, :10], k_cache[token_pages, offsets].transpose(0, 1))
    assert torch.equal(values[:, :10], v_cache[token_pages, offsets].transpose(0, 1))
    assert keys[:, 10:].isnan().all()  # nothing past num_tokens written


#: (rows_per_head, first_position, num_keys, heads) of the softmax cases:
#: - 9 rows of 13 keys seeing 11..13: odd K puts row starts at every offset in a chunk, and the
#:   last block of 8, 4 or 2 rows has rows past the end;
#: - 8 rows seeing 1..4 of 11 keys: rows shorter than their head, and mostly masked;
#: - 2 rows seeing 281 and 282 of 299 keys: several sweeps of every kernel's loops.
SOFTMAX_CASES = [(3, 10, 13, 3), (4, 0, 11, 2), (2, 280, 299, 1)]


def _aligned(shape: tuple[int, ...], dtype: np.dtype, offset_bytes: int = 0) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts ``offset_bytes`` past a 16-byte boundary."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + 32, np.uint8)
    start = -buffer.ctypes.data % 16 + offset_bytes
    return buffer[start: start + nbytes].view(dtype).reshape(shape)


def _softmax_matches_float64(softmax: CausalSoftmax, dtype_name: str, rows_per_head: int, first_position: int,
                             num_keys: int, heads: int, offset_bytes: int = 0, seed: int = 1) -> None:
    """softmax of random scores (arrays ``offset_bytes`` past 16-byte boundaries) against float64:
    within the dtype's tolerance, exactly 0 past each row's position, every element written."""
    generator = torch.Generator().manual_seed(seed)
    rows = heads * rows_per_head
    values = torch.randn(rows, num_keys, generator=generator) * 4
    scores = _aligned((rows, num_keys), np.float32, offset_bytes)
    scores[:] = values.numpy()
    poison = poisoned((rows, num_keys), dtype_name)
    probs = _aligned((rows, num_keys), poison.dtype, offset_bytes)
    probs[:] = poison
    scale = 1 / math.sqrt(HEAD_DIM)
    softmax(scores, probs, rows_per_head, first_position, scale)
    visible = first_position + torch.arange(rows) % rows_per_head + 1
    masked = torch.arange(num_keys)[None, :] >= visible[:, None]
    reference = (values.double() * scale).masked_fill(masked, -math.inf).softmax(-1)
    got = from_storage(probs, dtype_name)
    assert_close_rel(got, reference, TOL[dtype_name])
    assert (got[masked] == 0).all()


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_softmax_matches_float64(dtype_name):
    """The default budget: the cached kernel at 8 rows a block."""
    softmax = CausalSoftmax(build_codec(dtype_name))
    assert softmax.cached_rows(9) == 8 and softmax.uses_vector(_aligned((9, 9), np.float32), _aligned((9, 9), np.int16))
    _softmax_matches_float64(softmax, dtype_name, 3, 6, 9, 3)  # rows see 7, 8, 9 keys


@pytest.mark.parametrize("rows_per_block", [*CACHED_ROWS, 0])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_softmax_kernels_match_float64(dtype_name, rows_per_block):
    """Each kernel (rows_per_block 0: streaming), forced by a budget that just fits its shared memory."""
    codec = build_codec(dtype_name)
    probe = CausalSoftmax(codec)
    for rows_per_head, first_position, num_keys, heads in SOFTMAX_CASES:
        budget = probe.shared_bytes(rows_per_block, num_keys) if rows_per_block else 0
        softmax = CausalSoftmax(codec, shared_budget=budget)
        assert softmax.cached_rows(num_keys) == rows_per_block
        _softmax_matches_float64(softmax, dtype_name, rows_per_head, first_position, num_keys, heads)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_causal_softmax_without_16_byte_alignment_runs_scalar(dtype_name):
    """Base addresses off a 16-byte boundary, or rows not contiguous: the streaming kernel one score at
    a time (the simulator's vector accesses would fail on a misaligned address)."""
    softmax = CausalSoftmax(build_codec(dtype_name))
    assert not softmax.uses_vector(_aligned((4, 8), np.float32, 4), _aligned((4, 8), np.int16))
    assert not softmax.uses_vector(_aligned((4, 8), np.float32), _aligned((4, 8), np.int16, 2))
    assert not softmax.uses_vector(_aligned((4, 16), np.float32)[:, :8], _aligned((4, 8), np.int16))
    _softmax_matches_float64(softmax, dtype_name, 3, 10, 13, 3, offset_bytes=4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_keys, rows_per_block", [(1000, 8), (2304, 4), (5000, 2), (9000, 1), (12500, 0)])
def test_causal_softmax_matches_float64_on_gpu(num_keys, rows_per_block):
    """bf16 on the H200 under the default budget: 4 heads of 64 query rows ending at key num_keys run the
    cached kernel at 8, 4, 2 and 1 rows a block, and past ~12,000 keys the streaming one."""
    device = open_device("cuda")
    softmax = CausalSoftmax(build_codec("bfloat16"))
    assert softmax.cached_rows(num_keys) == rows_per_block
    rows_per_head, heads = 64, 4
    first_position = num_keys - rows_per_head
    values = torch.randn(heads * rows_per_head, num_keys, generator=torch.Generator().manual_seed(4)) * 4
    scores = values.to(device.torch_device)
    probs = torch.full(scores.shape, float("nan"), dtype=torch.bfloat16, device=device.torch_device)
    assert softmax.uses_vector(scores, probs)
    scale = 1 / math.sqrt(128)
    softmax(scores, probs, rows_per_head, first_position, scale, stream=device.current_stream())
    device.synchronize()
    visible = first_position + torch.arange(heads * rows_per_head) % rows_per_head + 1
    masked = torch.arange(num_keys)[None, :] >= visible[:, None]
    reference = (values.double() * scale).masked_fill(masked, -math.inf).softmax(-1)
    got = probs.cpu().double()
    assert_close_rel(got, reference, TOL["bfloat16"])
    assert (got[masked] == 0).all()


def test_causal_softmax_rejects_a_budget_over_the_limit():
    with pytest.raises(ValueError, match=str(SHARED_LIMIT_BYTES)):
        CausalSoftmax(build_codec("float32"), shared_budget=SHARED_LIMIT_BYTES + 1)


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
    request = GemmRequest(request=1, q_start=2, num_rows=num_rows, kv_len=kv_len, page_start=1,
                          rows_per_tile=rows_per_tile)
    step = SimpleNamespace(scratch=scratch.__getitem__, meta={"page_indices": page_indices}.__getitem__,
                           arena=SimpleNamespace(device=device), stream=device.current_stream(),
                           gemm_requests=(request,))
    codec = build_codec("float32" if dtype == torch.float32 else "bfloat16")
    scale = 1 / math.sqrt(HEAD_DIM)
    attention = GemmPrefillAttention(GatherKv(), CausalSoftmax(codec), k_cache, v_cache, NUM_KV_HEADS, GROUP, scale)
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


def test_compiles_for_sm90():
    """The gather and every softmax build, both codecs, with float32 math only; the vector softmax builds
    with 16-byte global loads and stores and no local memory (their chunk buffers in registers)."""
    compile_for_sm90(
        """
        from executor.kernels.gemm_attention import (
            CACHED_ROWS, SOFTMAX_THREADS, SOFTMAX_WARP, STREAMING_ROWS_PER_BLOCK, build_cached_softmax,
            build_gather_kv, build_streaming_softmax,
        )
        i32 = arr("int32", 1)
        ptx(build_gather_kv(), arr("int32", 4), arr("int32", 4), i32, types.int32, types.int32, arr("int32", 3),
            arr("int32", 3))
        for name in DTYPES:
            codec = build_codec(name)
            args = (arr("float32", 2), arr(name, 2), types.int32, types.int32, types.float32)
            for rows in CACHED_ROWS:
                vector_ptx(build_cached_softmax(codec, SOFTMAX_THREADS, rows, SOFTMAX_WARP), *args)
            for vector in (True, False):
                build = build_streaming_softmax(codec, SOFTMAX_THREADS, STREAMING_ROWS_PER_BLOCK, SOFTMAX_WARP, vector)
                (vector_ptx if vector else ptx)(build, *args)
        """
    )
