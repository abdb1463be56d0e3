"""Causal flash attention against float64 attention (simulator at tiny shapes; GPU at model sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.attention.flash import (
    STATIC_SHARED_BYTES, BlockShape, FlashAttention, block_shape, query_tile_bytes, single_request, staged_bytes)
from executor.numba_cuda import simulator_enabled
from tests.kernels.attention_reference import causal_attention
from tests.kernels.compile_check import compile_for_sm90

# P is rounded to bf16 and out is bf16: errors of a few bf16 ulps of |out| <= max |v|.
TOLERANCE = 0.02


def run_case(rows, kv_len, q_heads, kv_heads, head_dim, device, strided_q=False, seed=0, shape=None, attention=None):
    """One request's causal attention through ``attention`` (FlashAttention(shape) if None) against float64."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 2 * head_dim if strided_q else head_dim  # Qwen3.5: q heads sit 2 D apart (q | gate)
    q_buffer = torch.randn(rows, q_heads, width, generator=gen, device=device).bfloat16()
    q = q_buffer[..., :head_dim]
    # Later keys larger: a row's running maximum grows from key block to key block, so the online
    # softmax's rescaling of the earlier blocks' sums and outputs is exercised (alpha < 1).
    # k, v as GatherKv leaves them: [Hkv, capacity, D], the request's keys first, stale ones after.
    capacity = kv_len + 7
    ramp = torch.linspace(1.0, 2.0, capacity, device=device)[None, :, None]
    k = (torch.randn(kv_heads, capacity, head_dim, generator=gen, device=device) * ramp).bfloat16()
    v = torch.randn(kv_heads, capacity, head_dim, generator=gen, device=device).bfloat16()
    k[:, kv_len:] = 1e4  # stale keys past kv_len: reading one would swamp the softmax
    out = torch.full((rows, q_heads, head_dim), float("nan"), device=device).bfloat16()
    q_indptr, positions = (torch.as_tensor(a, device=device) for a in single_request(rows, kv_len))
    (attention or FlashAttention(shape))(*[t.view(torch.int16) for t in (q, k, v, out)], q_indptr, positions, 0, 1,
                                         rows, kv_len)  # the simulator takes torch views too
    expected = causal_attention(q, k, v, kv_len)
    error = (out.double() - expected).abs().max().item()
    assert error <= TOLERANCE, f"max |out - float64| = {error:.4f} > {TOLERANCE}"


def test_matches_float64_in_the_simulator():
    """Head dim 32's own shape: 32 keys a round, two m-tiles a warp, 128 rows a block. A 70-row
    prompt: three key blocks (the online softmax rescales), ragged ends. GQA group 2. (A chunk
    after cached tokens: the packed test below.)"""
    run_case(70, 70, q_heads=2, kv_heads=1, head_dim=32, device="cpu" if simulator_enabled() else "cuda")


@pytest.mark.parametrize("shape", [
    BlockShape(warps=2, keys=16, m_tiles=1, query_in_shared=False),
    BlockShape(warps=2, keys=16, m_tiles=1, query_in_shared=True),
    BlockShape(warps=1, keys=16, m_tiles=2, query_in_shared=True),
])
def test_small_blocks_match_float64_in_the_simulator(shape):
    """Blocks of 32 rows (two one-tile warps, Q in registers or in the shared tile; one warp of two
    m-tiles): a 70-row prompt takes three query blocks, the last launched first, and five key blocks,
    the diagonal ones masked."""
    run_case(70, 70, q_heads=2, kv_heads=1, head_dim=32, device="cpu" if simulator_enabled() else "cuda",
             shape=shape)


def check_packed_launch(attention, head_dim=32):
    """One launch over a step of four requests: a decode row (skipped), a 40-row prompt (packed first),
    a 3-row chunk short of min_rows 4 (skipped: the paged kernel's), and a 9-row chunk after 91 cached
    tokens (packed second, its keys right after the prompt's 40: whole key blocks before its diagonal).
    The packed chunks' rows match float64 attention over their own keys; the skipped requests' rows
    stay untouched."""
    device = "cpu" if simulator_enabled() else "cuda"
    gen = torch.Generator(device=device).manual_seed(3)
    chunks = [(1, 12), (40, 40), (3, 20), (9, 100)]  # (rows, kv_len) of each request, in step order
    packed = [1, 3]
    q_heads, kv_heads = 1, 1  # one head: a simulated block costs seconds
    num_rows = sum(rows for rows, _ in chunks)
    q = torch.randn(num_rows, q_heads, head_dim, generator=gen, device=device).bfloat16()
    capacity = sum(chunks[i][1] for i in packed) + 5
    k = torch.randn(kv_heads, capacity, head_dim, generator=gen, device=device).bfloat16()
    v = torch.randn(kv_heads, capacity, head_dim, generator=gen, device=device).bfloat16()
    k[:, capacity - 5:] = 1e4  # past the packed keys: reading one would swamp the softmax
    q_indptr = torch.tensor([0, *np.cumsum([rows for rows, _ in chunks])], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(kv - rows, kv, dtype=torch.int32, device=device) for rows, kv in chunks])
    out = torch.full((num_rows, q_heads, head_dim), float("nan"), device=device).bfloat16()
    kv_tokens = sum(chunks[i][1] for i in packed)
    attention(*[t.view(torch.int16) for t in (q, k, v, out)], q_indptr, positions, 1, 3, 40, kv_tokens, min_rows=4)
    offset = 0
    for index, (rows, kv_len) in enumerate(chunks):
        span = slice(int(q_indptr[index]), int(q_indptr[index + 1]))
        if index not in packed:
            assert out[span].isnan().all(), f"request {index} is not packed: its rows must stay untouched"
            continue
        expected = causal_attention(q[span], k[:, offset:], v[:, offset:], kv_len)
        error = (out[span].double() - expected).abs().max().item()
        assert error <= TOLERANCE, f"request {index}: max |out - float64| = {error:.4f} > {TOLERANCE}"
        offset += kv_len


def test_one_launch_serves_packed_chunks_and_skips_the_others():
    check_packed_launch(FlashAttention())


def test_block_shapes_fit_shared_memory():
    assert block_shape(32) == block_shape(128) == BlockShape(warps=4, keys=32, m_tiles=2, query_in_shared=True)
    assert block_shape(256) == BlockShape(warps=4, keys=32, m_tiles=1, query_in_shared=True)
    assert staged_bytes(256, 64) > STATIC_SHARED_BYTES  # 64 keys of D 256 would not fit
    # The query tile is dynamic: D 256's is past the 48 KiB a block gets without opting in, which the launcher does.
    assert query_tile_bytes(256, block_shape(256)) + staged_bytes(256, 32) > 48 * 1024
    assert query_tile_bytes(128, BlockShape(warps=4, keys=64)) == 0  # Q in registers
    with pytest.raises(ValueError, match="2 m-tiles a warp need the shared query tile"):
        BlockShape(warps=4, keys=32, m_tiles=2, query_in_shared=False)


def test_shape_errors_name_the_shapes():
    flash = FlashAttention()
    q = np.zeros((4, 2, 32), np.int16)
    kv = np.zeros((1, 6, 32), np.int16)
    q_indptr, positions = single_request(4, 6)
    with pytest.raises(ValueError, match="7 keys do not fit the 6 keys"):
        flash(q, kv, kv, q.copy(), q_indptr, positions, 0, 1, 4, 7)
    with pytest.raises(ValueError, match="requests 0..1 outside the step's 1"):
        flash(q, kv, kv, q.copy(), q_indptr, positions, 0, 2, 4, 6)
    with pytest.raises(ValueError, match="head_dim 24"):
        flash(np.zeros((4, 2, 24), np.int16), np.zeros((1, 4, 24), np.int16), np.zeros((1, 4, 24), np.int16),
              np.zeros((4, 2, 24), np.int16), q_indptr, positions, 0, 1, 4, 4)
    with pytest.raises(ValueError, match="must match"):
        flash(q, kv, kv, np.zeros((4, 2, 16), np.int16), q_indptr, positions, 0, 1, 4, 4)
    with pytest.raises(ValueError, match="a chunk of 5 rows must be 1..kv_len 4"):
        single_request(5, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,kv_len,q_heads,kv_heads,head_dim,strided", [
    (1031, 1031, 32, 8, 128, False),   # Qwen3-8B heads, a ragged prompt
    (700, 4099, 32, 8, 128, False),    # a chunk after 3399 cached tokens
    (517, 517, 16, 4, 256, True),      # Qwen3.5-9B: D 256, gated (strided) q
])
def test_matches_float64_at_model_sizes(rows, kv_len, q_heads, kv_heads, head_dim, strided):
    run_case(rows, kv_len, q_heads, kv_heads, head_dim, "cuda", strided_q=strided)


@pytest.mark.ptx
def test_compiles_to_unrolled_mmas_in_registers_on_sm90():
    """Every fragment loop unrolled (one MMA per tile and k-step of both products) and no local memory:
    an O or S accumulator indexed at run time would spill to local memory."""
    compile_for_sm90(
        """
        from executor.kernels.attention.flash import block_shape, build_flash_attention
        for head_dim, group in ((128, 4), (256, 4)):
            shape = block_shape(head_dim)
            text = ptx(build_flash_attention(head_dim, group, shape),
                       *[arr("int32", 3)] * 4, arr("int32", 1), arr("int32", 1), types.int32, types.int32,
                       types.float32)
            mmas = text.count("mma.sync.aligned")
            assert mmas == 2 * head_dim * shape.keys * shape.m_tiles // 128, (head_dim, mmas)
            # A K or V ldmatrix.x4 feeds two MMAs of each m-tile; a shared Q's fragments load once a key
            # block (D / 16 k-steps an m-tile); K, V (and a shared Q) arrive by cp.async, 16 bytes a copy.
            loads = mmas // (2 * shape.m_tiles) + (shape.m_tiles * head_dim // 16 if shape.query_in_shared else 0)
            assert text.count("ldmatrix.sync.aligned.m8n8.x4") == loads, (head_dim, text.count("ldmatrix"))
            assert "cp.async.cg.shared.global" in text and "cp.async.wait_all" in text
            assert ".local" not in text, f"head_dim {head_dim}: local memory"
            # The exponent is one FMA and one flush-to-zero ex2 a score (fast_math.py).
            assert text.count("ex2.approx.ftz.f32") >= shape.m_tiles * shape.keys // 2, (head_dim, "ex2")
        """
    )
