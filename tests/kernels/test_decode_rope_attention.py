"""decode_rope_attention.py: the q/k norm + RoPE + KV write run in decode attention's prologue, against
the two launches it replaces (qk_rope_kv.py's, then DecodeAttention's) on copies of the same inputs:
the attention output and the whole KV pool bit for bit.

Simulator shapes: D = 32 (two pair units a head, two threads a head in the prologue), 2 kv heads,
bf16, page size 4, two-warp blocks: the rows' new keys (kv lengths 37, 19, 1 and 8) sit at
positions 4, 2, 0 and 7 of their ring slots, one row's key is its only key, and split rows have
their new key in their last chunk. On the GPU,
Qwen3-8B's heads (D 128, 8 kv heads of 4) at batch 1 and 64, split as a decode step splits them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.attention.paged import PagedAttention
from executor.tiles import plan_tiles
from executor.kernels.primitives.codec import build_codec
from executor.kernels.attention.decode import DecodeAttention
from executor.kernels.attention.decode_mma import MmaShape
from executor.kernels.attention.decode_rope import DecodeRopeAttention, fused_shapes
from executor.kernels.primitives.launch import multiprocessor_count
from executor.kernels.rope.fused_kv_write import QkNormRopeWriteKv
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.test_attention import make_batch

EPS, THETA = 1e-6, 1_000_000.0
SIM_BATCH = [(1, 37), (1, 19), (1, 1), (1, 8)]  # (rows, kv_len): decode rows only


def inputs(batch: list[tuple[int, int]], head_dim: int, num_kv_heads: int, group: int, page_size: int,
           num_pages: int, seed: int, device: str, misaligned: bool = False) -> dict:
    """A decode step's qkv rows (the projection's output, before the norm), norm weights, a random
    KV pool (the new keys' slots hold stale bits) and its page tables, as torch tensors."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    meta = make_batch(batch, page_size, num_pages, rng)
    num_rows, num_q_heads = len(batch), num_kv_heads * group
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = (3 * torch.randn(num_rows, width, generator=gen)).to(torch.bfloat16)
    shift = int(misaligned)  # every cache row one element past a 16-byte boundary
    pool = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim + shift, generator=gen).to(torch.bfloat16)
    weights = (1 + 0.2 * torch.randn(2, head_dim, generator=gen)).to(torch.bfloat16)
    tensors = {name: torch.as_tensor(value) for name, value in meta.items() if isinstance(value, np.ndarray)}
    tensors.update(qkv=qkv, pool=pool, q_weight=weights[0], k_weight=weights[1])
    return {"meta": meta, **{name: t.to(device) for name, t in tensors.items()}}


def run(launch, data: dict, launcher: DecodeRopeAttention, head_dim: int, num_kv_heads: int,
        kv_chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, pool) after ``launch(rope_args, tile_args, out, scale, partials)`` on copies of the inputs;
    split rows (``kv_chunk``) get scratch as deep as the longest row needs."""
    meta, device = data["meta"], data["qkv"].device
    max_splits = max(-(-n // kv_chunk) for n in meta["kv_lens"]) if kv_chunk else 1
    num_rows, group = data["qkv"].shape[0], launcher.group_size
    qkv, pool = data["qkv"].clone(), data["pool"].clone()
    q_rows, kv_rows = num_kv_heads * group * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_rows].view(num_rows, -1, head_dim)
    k = qkv[:, q_rows:q_rows + kv_rows].view(num_rows, num_kv_heads, head_dim)
    v = qkv[:, q_rows + kv_rows:].view(num_rows, num_kv_heads, head_dim)
    shift = pool.shape[-1] - head_dim
    k_cache, v_cache = pool[:, 0, ..., shift:], pool[:, 1, ..., shift:]
    capacity = num_rows * max_splits + 2  # a graph-sized grid: the -1 tail must be skipped
    tiles = tuple(np.zeros(capacity, np.int32) for _ in range(3)) + (np.zeros(num_rows, np.int32),)
    plan_tiles(meta["q_indptr"], meta["kv_lens"], kv_chunk=kv_chunk, max_splits=max_splits, out=tiles)
    request_indices, qo_tile_indices, kv_tile_indices, kv_chunk_size = (torch.as_tensor(t).to(device) for t in tiles)
    out = torch.full((num_rows, num_kv_heads * group, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    partials = ()
    if kv_chunk:
        partials = (torch.full((num_rows, max_splits, num_kv_heads * group, head_dim), float("nan"), device=device),
                    torch.full((num_rows, max_splits, num_kv_heads * group), float("nan"), device=device))
    rope_args = (q, k, v, data["q_weight"], data["k_weight"], EPS, 0.0, head_dim, THETA, k_cache, v_cache)
    tile_args = (data["page_indices"], data["page_indptr"], data["last_page_len"], data["q_indptr"],
                 data["batch_indices"], data["positions"], request_indices, qo_tile_indices, kv_tile_indices,
                 kv_chunk_size, data["total_num_rows"])
    launch(rope_args, tile_args, out, head_dim**-0.5, partials)
    return out, pool


def assert_fused_matches_two_launches(launcher: DecodeRopeAttention, data: dict, head_dim: int, num_kv_heads: int,
                                      kv_chunk: int | None, fused: bool = True) -> None:
    def one_launch(rope_args, tile_args, out, scale, partials):
        q, k, v, q_weight, k_weight, eps, offset, rotary_dim, theta, k_cache, v_cache = rope_args
        taken = launcher.fused_launch(q, k, v, q_weight, k_weight, k_cache, v_cache, rotary_dim, out.shape[0],
                                      num_kv_heads)
        assert (taken is not None) == fused
        launcher(*rope_args, *tile_args, out, scale, *partials)

    def two_launches(rope_args, tile_args, out, scale, partials):
        q, k, v, q_weight, k_weight, eps, offset, rotary_dim, theta, k_cache, v_cache = rope_args
        positions, batch_indices, page_indices, page_indptr = tile_args[5], tile_args[4], tile_args[0], tile_args[1]
        launcher.rope(q, k, v, q_weight, k_weight, positions, eps, offset, rotary_dim, theta, k_cache, v_cache,
                      batch_indices, page_indices, page_indptr)
        launcher.attention(q, k_cache, v_cache, *tile_args, out, scale, *partials)

    expected_out, expected_pool = run(two_launches, data, launcher, head_dim, num_kv_heads, kv_chunk)
    got_out, got_pool = run(one_launch, data, launcher, head_dim, num_kv_heads, kv_chunk)
    assert not torch.isnan(expected_out.float()).any()
    assert torch.equal(got_out.view(torch.int16), expected_out.view(torch.int16)), "attention output differs"
    assert torch.equal(got_pool.view(torch.int16), expected_pool.view(torch.int16)), "KV pool differs"
    assert not torch.equal(got_pool, data["pool"]), "no key was written"


def build(head_dim: int, group: int, round_before_weight: bool = True, **attention: object) -> DecodeRopeAttention:
    codec = build_codec("bfloat16")
    general = PagedAttention(codec, head_dim, group, threads=32, block_keys=4)
    decode = DecodeAttention(codec, head_dim, group, general, **attention)
    rope = QkNormRopeWriteKv(codec, round_before_weight, 32)
    return DecodeRopeAttention(rope, decode, round_before_weight, head_dim, group, head_dim)


# Group 4 unsplit, group 2 split in chunks of 8 without the pre-weight rounding, group 5 split in chunks of 16
# (the GPU tests split Qwen3-8B's group 4 at real sizes).
@pytest.mark.parametrize("group,kv_chunk,round_before_weight", [(4, None, True), (2, 8, False), (5, 16, True)])
def test_fused_matches_two_launches(group, kv_chunk, round_before_weight):
    launcher = build(32, group, round_before_weight, mma_shape=MmaShape(2, 2))
    data = inputs(SIM_BATCH, 32, 2, group, 4, 24, seed=group + (kv_chunk or 0), device="cpu")
    assert_fused_matches_two_launches(launcher, data, 32, 2, kv_chunk)


def test_many_pairs_shape_and_misaligned_caches():
    """Eight (row, kv head) pairs on 3 SMs run the many-pairs shape (two warps of three slots) fused;
    cache rows off the 16-byte grid take the two launches."""
    launcher = build(32, 3, num_sms=3)
    assert fused_shapes(launcher.attention, 32, 3, 32) == [MmaShape(4, 2), MmaShape(2, 3)]
    data = inputs(SIM_BATCH, 32, 2, 3, 4, 24, seed=7, device="cpu")
    assert_fused_matches_two_launches(launcher, data, 32, 2, 16)
    misaligned = inputs(SIM_BATCH, 32, 2, 3, 4, 24, seed=8, device="cpu", misaligned=True)
    assert_fused_matches_two_launches(launcher, misaligned, 32, 2, 16, fused=False)


def test_partial_rotary_and_wide_heads_take_two_launches():
    """Qwen3.5's heads (D 256, rotary 64) are not fused: the CUDA-core kernel serves D 256 by default,
    and the prologue is built for full rotary heads."""
    assert fused_shapes(build(256, 4).attention, 256, 4, 64) == []
    assert fused_shapes(build(128, 4).attention, 128, 4, 64) == []
    assert fused_shapes(build(128, 4).attention, 128, 4, 128) != []


@pytest.mark.ptx
def test_fused_compiles_for_sm90():
    """PTX for sm_90 at Qwen3-8B's heads (D 128, G 4), both block shapes, built for pages of 16 tokens as
    the launcher builds them: no local memory but libdevice's sin/cos slow path (28 bytes, for angles past
    105,615 radians), as qk_rope_kv.py's kernel; one 64-bit division."""
    compile_for_sm90(
        """
        import re
        from executor.kernels.attention.decode_mma import build_decode_attention_mma, MmaShape
        i32, u32, f32 = arr("int32", 1), arr("uint32", 1), types.float32
        bits1, bits3, bits4 = arr("bfloat16", 1), arr("bfloat16", 3), arr("bfloat16", 4)
        meta = (i32,) * 8 + (u32,)
        rope = (bits3, bits3, bits3, bits1, bits1, f32, f32, f32, bits4, bits4)
        for shape in (MmaShape(4, 2), MmaShape(2, 3)):
            direct, split = build_decode_attention_mma(128, 4, shape.warps, shape.slots, rope=True, page_size=16)
            split_text = ptx(split, *rope, *meta, bits3, arr("float32", 4), arr("float32", 3), f32)
            for text in (ptx(direct, *rope, *meta, bits3, f32), split_text):
                assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
                depots = [int(n) for n in re.findall(r"__local_depot\\d+\\[(\\d+)\\]", text)]
                assert sum(depots) <= 28, f"{depots} bytes of local memory"
                assert ".local.v" not in text, "a vector access to local memory"
            if shape == MmaShape(4, 2):
                # With the plan's page size compiled in (as the launcher builds it), a key's page and slot
                # take no division: the one 64-bit division left is the row's chunk count (at batch 1
                # every instruction of a warp's chain is latency).
                divisions = split_text.count("div.s64") + split_text.count("div.u64")
                assert divisions == 1, f"{divisions} 64-bit divisions"
        """,
        allow_f64=True,  # inv_freq's power is taken in float64 on purpose (rope.py's docstring)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("batch,kv_chunk", [
    ([(1, 513)], 64), ([(1, 4097)], 192), ([(1, 300)], None), ([(1, 100 + 61 * b) for b in range(64)], 128),
])
def test_gpu_fused_matches_two_launches(batch, kv_chunk):
    """Qwen3-8B's heads at decode step shapes: batch 1 split in chunks of 64 (513 keys) and 192
    (4,097 keys), batch 1 unsplit, and 64 rows of 100-3,943 keys (the many-pairs shape)."""
    launcher = build(128, 4, num_sms=multiprocessor_count())
    num_pages = sum(-(-n // 16) for _, n in batch) + 2
    data = inputs(batch, 128, 8, 4, 16, num_pages, seed=len(batch), device="cuda")
    assert_fused_matches_two_launches(launcher, data, 128, 8, kv_chunk)
