"""Decode attention with the q/k norm + RoPE + KV write in its prologue (decode_rope_attention.py),
held bit for bit to the two launches it replaces: qk_norm_rope_write_kv (qk_rope_kv.py), then
decode attention. Both the outputs and the KV cache must match exactly, with the rows split
over kv chunks or not, for both codecs and both norm styles. Shapes the prologue does not
take (partial rotary) must run the two launches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.attention import PagedAttention, plan_tiles
from executor.kernels.codec import build_codec
from executor.kernels.decode_attention import DecodeAttention
from executor.kernels.decode_rope_attention import DecodeRopeAttention
from executor.kernels.qk_rope_kv import QkNormRopeWriteKv
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import to_storage
from tests.kernels.test_attention import make_batch

cuda = load_cuda()

THETA = 1_000_000.0
EPS = 1e-6


def _case(dtype_name, batch, q_heads, kv_heads, head_dim, page_size, kv_chunk, max_splits, zero_centred, device,
          seed):
    """(launcher arguments for both paths, the KV pool) of one decode step: raw qkv rows, caches with
    random history, metadata and tiles."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-kv // page_size) for _, kv in batch) + 2
    meta = make_batch(batch, page_size, num_pages, rng, shared_first_page=False)
    rows = len(batch)
    storage = lambda t: torch.from_numpy(to_storage(t, dtype_name)).to(device)  # noqa: E731
    qkv = storage(torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=gen))
    q = qkv[:, : q_heads * head_dim].view(rows, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    offset = 1.0 if zero_centred else 0.0
    weights = storage(torch.randn(2, head_dim, generator=gen) * 0.1 + (0.0 if zero_centred else 1.0))
    pool = storage(torch.randn(num_pages, 2, page_size, kv_heads, head_dim, generator=gen))
    tiles = plan_tiles(meta["q_indptr"], meta["kv_lens"], **({"kv_chunk": kv_chunk, "max_splits": max_splits}
                                                            if kv_chunk else {}))
    ints = lambda a: torch.as_tensor(np.asarray(a), device=device)  # noqa: E731
    total_num_rows = meta["total_num_rows"] if device == "cpu" else cuda.to_device(meta["total_num_rows"])
    metadata = (ints(meta["page_indices"]), ints(meta["page_indptr"]), ints(meta["last_page_len"]),
                ints(meta["q_indptr"]), ints(meta["batch_indices"]), ints(meta["positions"]), *map(ints, tiles),
                total_num_rows)
    return (q, k, v, weights[0], weights[1], EPS, offset, head_dim, THETA), metadata, pool


def _run(launcher, qk_args, metadata, pool, out_shape, dtype, split_shape, device, stream):
    """One decode step through ``launcher``; returns (out, the pool after)."""
    q, k, v, *rest = qk_args
    q, k, v = q.clone(), k.clone(), v.clone()  # the two launches rotate them in place
    pool = pool.clone()
    out = torch.full(out_shape, -1, dtype=dtype, device=device)
    split = ()
    if split_shape:
        split = (torch.full(split_shape, float("nan"), device=device),
                 torch.full(split_shape[:3], float("nan"), device=device))
    launcher(q, k, v, *rest, pool[:, 0], pool[:, 1], *metadata, out, rest[-2] ** -0.5, *split, stream=stream)
    return out, pool


def _compare(dtype_name, batch, q_heads, kv_heads, head_dim, page_size, kv_chunk, zero_centred, device, stream,
             rotary_dim=None, threads=None, round_keys=None):
    codec = build_codec(dtype_name)
    group = q_heads // kv_heads
    max_splits = 4 if kv_chunk else 1
    sim = {"threads": 32, "round_keys": 8} if simulator_enabled() else {}
    general = PagedAttention(codec, head_dim, group, **({"threads": 32, "block_keys": 4} if sim else {}))
    attention = DecodeAttention(codec, head_dim, group, general, **sim)
    qk_rope = QkNormRopeWriteKv(codec, round_before_weight=not zero_centred)
    fused = DecodeRopeAttention(codec, not zero_centred, attention, qk_rope)
    qk_args, metadata, pool = _case(dtype_name, batch, q_heads, kv_heads, head_dim, page_size, kv_chunk, max_splits,
                                    zero_centred, device, seed=head_dim + group + int(zero_centred))
    if rotary_dim is not None:
        qk_args = (*qk_args[:7], rotary_dim, qk_args[8])
    q = qk_args[0]
    assert fused.fuses(*qk_args[:5], pool[:, 0], pool[:, 1], qk_args[7]) == (rotary_dim in (None, head_dim))
    out_shape, dtype = tuple(q.shape), q.dtype
    split_shape = (len(batch), max_splits, q_heads, head_dim) if kv_chunk else ()

    def two_launches(q, k, v, q_weight, k_weight, eps, offset, rotary, theta, k_cache, v_cache, *rest, stream=0):
        meta, out, scale, split = rest[:11], rest[11], rest[12], rest[13:]
        qk_rope(q, k, v, q_weight, k_weight, meta[5], eps, offset, rotary, theta, k_cache, v_cache, meta[4], meta[0],
                meta[1], stream=stream)
        attention(q, k_cache, v_cache, *meta, out, scale, *split, stream=stream)

    got = _run(fused, qk_args, metadata, pool, out_shape, dtype, split_shape, device, stream)
    expected = _run(two_launches, qk_args, metadata, pool, out_shape, dtype, split_shape, device, stream)
    assert torch.equal(got[0], expected[0]), "attention outputs differ"
    assert torch.equal(got[1], expected[1]), "KV caches differ"
    assert not torch.equal(got[1], pool), "the step wrote no K/V"


@pytest.mark.parametrize("dtype_name, kv_chunk, zero_centred", [
    ("float32", None, False), ("bfloat16", 8, False), ("bfloat16", None, True), ("float32", 8, True),
], ids=["f32-direct-qwen3-norm", "bf16-split-qwen3-norm", "bf16-direct-zero-centred", "f32-split-zero-centred"])
def test_one_launch_gives_the_bits_of_two(dtype_name, kv_chunk, zero_centred):
    """Rows of 7, 19 and 1 tokens (pages of 4; chunks of 8 split the 19 into three, the owner last)."""
    _compare(dtype_name, [(1, 7), (1, 19), (1, 1)], 4, 2, 16, 4, kv_chunk, zero_centred, "cpu", 0)


def test_partial_rotary_takes_the_two_launches():
    _compare("float32", [(1, 7), (1, 3)], 4, 2, 16, 4, None, False, "cpu", 0, rotary_dim=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_chunk", [None, 1024], ids=["direct", "split"])
def test_gpu_qwen3_8b_heads(kv_chunk):
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    _compare("bfloat16", [(1, 4097), (1, 1), (1, 700), (1, 2048)], 32, 8, 128, 16, kv_chunk, False, "cuda", stream)
    torch.cuda.synchronize()


def test_compiles_for_sm90():
    """PTX for sm_90 at Qwen3-8B's heads (D 128, G 4), bf16, both kernels and norm styles: 16-byte
    K/V loads and the 16-byte stores of the new K/V row."""
    compile_for_sm90(
        """
        from executor.kernels.decode_attention import build_decode_attention
        from executor.kernels.decode_rope_attention import RopeNorm, build_rope_kernels
        codec = build_codec("bfloat16")
        i32, u32, f32 = arr("int32", 1), arr("uint32", 1), types.float32
        x3, x4, x1 = arr("bfloat16", 3), arr("bfloat16", 4), arr("bfloat16", 1)
        head = (x3, x3, x3, x1, x1, f32, f32, f32, x4, x4, i32, i32) + (i32,) * 6 + (u32, x3)
        for round_before_weight in (True, False):
            direct, split = build_decode_attention(
                codec, 128, 4, 128, blocks_per_sm=4,
                finish=lambda parts: build_rope_kernels(codec, RopeNorm(round_before_weight), parts))
            for text in (ptx(direct, *head, f32), ptx(split, *head, arr("float32", 4), arr("float32", 3), f32)):
                assert "ld.global.v4" in text and "st.global.v4" in text
        """,
        allow_f64=True,  # rope_inv_freq's power, once a table entry (rope.py's kernels do the same)
    )
