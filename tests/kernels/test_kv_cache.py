"""The paged KV cache write against a numpy reference (bit-exact: it is a copy).

Simulator shapes: page size 4, 2 kv heads, D = 16, a 2-layer page-first pool
poisoned beforehand; K/V arrive as strided views of a fused qkv output and the
cache as strided per-layer views. Every written slot must match, every other
slot (other pages, other layer, slots past the step) must keep its poison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.rows.kv_cache import WriteKv
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, poisoned, to_storage

cuda = load_cuda()

PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 4, 2, 16, 4


def make_step(batch, page_size, num_pages, rng):
    """Shuffled distinct physical pages (page 0 reserved) for (rows, kv_len) requests."""
    physical = list(rng.permutation(np.arange(1, num_pages)))
    page_lists = [[physical.pop() for _ in range(-(-kv // page_size))] for _, kv in batch]
    rows = [n for n, _ in batch]
    return {
        "page_lists": page_lists,
        "page_indices": np.array([p for pages in page_lists for p in pages], dtype=np.int32),
        "page_indptr": np.cumsum([0] + [len(p) for p in page_lists]).astype(np.int32),
        "batch_indices": np.repeat(np.arange(len(batch)), rows).astype(np.int32),
        "positions": np.concatenate([np.arange(kv - n, kv) for n, kv in batch]).astype(np.int32),
    }


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 6])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_write_kv_scatters_rows_into_pages(dtype_name, head_dim):
    """D = 16: rows of whole 16-byte chunks, the vector kernel; D = 6 (12 or 24 bytes): the element kernel."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    # Decode at position 6, a 5-row chunk after 3 earlier tokens (crosses a page), the
    # first token of a request, a decode row filling the last slot of its page.
    batch = [(1, 7), (5, 8), (1, 1), (1, 8)]
    step = make_step(batch, PAGE_SIZE, 9, rng)
    num_rows = len(step["positions"])
    fused = to_storage(torch.randn(num_rows, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * head_dim, generator=gen), dtype_name)
    pool = poisoned((9, 2, 2, PAGE_SIZE, NUM_KV_HEADS, head_dim), dtype_name)

    # Strided views on device arrays (the simulator transfers only contiguous numpy arrays).
    fused_device, pool_device = cuda.to_device(fused), cuda.to_device(pool)
    heads = fused_device.reshape(num_rows, NUM_Q_HEADS + 2 * NUM_KV_HEADS, head_dim)
    k = heads[:, NUM_Q_HEADS : NUM_Q_HEADS + NUM_KV_HEADS]
    v = heads[:, NUM_Q_HEADS + NUM_KV_HEADS :]
    WriteKv()(k, v, pool_device[:, 1, 0], pool_device[:, 1, 1], step["batch_indices"], step["positions"],
              step["page_indices"], step["page_indptr"])
    got = pool_device.copy_to_host()

    expected = pool.copy()
    rows = fused.reshape(num_rows, NUM_Q_HEADS + 2 * NUM_KV_HEADS, head_dim)
    for t in range(num_rows):
        b, p = step["batch_indices"][t], step["positions"][t]
        page = step["page_lists"][b][p // PAGE_SIZE]
        expected[page, 1, 0, p % PAGE_SIZE] = rows[t, NUM_Q_HEADS : NUM_Q_HEADS + NUM_KV_HEADS]
        expected[page, 1, 1, p % PAGE_SIZE] = rows[t, NUM_Q_HEADS + NUM_KV_HEADS :]
    bits = np.int32 if dtype_name == "float32" else np.int16
    np.testing.assert_array_equal(got.view(bits), expected.view(bits))


def test_write_kv_rejects_mismatched_shapes():
    k = np.zeros((2, NUM_KV_HEADS, HEAD_DIM), np.float32)
    cache = np.zeros((3, PAGE_SIZE, NUM_KV_HEADS + 1, HEAD_DIM), np.float32)
    ids = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="does not match"):
        WriteKv()(k, k, cache, cache, ids, ids, ids, ids)


@pytest.mark.ptx
def test_compiles_for_sm90():
    """PTX for sm_90 with both storage dtypes, both kernels."""
    compile_for_sm90(
        """
        from executor.kernels.rows.kv_cache import build_write_kv_vector, write_kv_kernel
        i32 = arr("int32", 1)
        vector = build_write_kv_vector()
        for name in DTYPES:
            rows, cache = arr(name, 3), arr(name, 4)
            ptx(write_kv_kernel, rows, rows, cache, cache, i32, i32, i32, i32)
            vector_ptx(vector, rows, rows, cache, cache, i32, i32, i32, i32, types.int64)
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (2, 256)])
def test_write_kv_gpu_bf16(num_kv_heads, head_dim):
    """Real sizes on the GPU: a 4096-row prefill chunk plus 63 decode rows, page size 16."""
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    batch = [(4096, 5000)] + [(1, int(kv)) for kv in rng.integers(1, 3000, size=63)]
    num_pages = sum(-(-kv // 16) for _, kv in batch) + 1
    step = make_step(batch, 16, num_pages, rng)
    num_rows = len(step["positions"])
    num_q_heads = 4 * num_kv_heads
    qkv = torch.randn(num_rows, num_q_heads + 2 * num_kv_heads, head_dim, device=device).to(torch.bfloat16)
    pool = torch.zeros(num_pages, 3, 2, 16, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    k, v = qkv[:, num_q_heads : num_q_heads + num_kv_heads], qkv[:, num_q_heads + num_kv_heads :]
    dev = {name: torch.as_tensor(step[name], device=device)
           for name in ("batch_indices", "positions", "page_indices", "page_indptr")}
    WriteKv()(k.view(torch.int16), v.view(torch.int16), pool[:, 2, 0].view(torch.int16),
              pool[:, 2, 1].view(torch.int16), dev["batch_indices"], dev["positions"], dev["page_indices"],
              dev["page_indptr"])
    torch.cuda.synchronize()
    expected = torch.zeros_like(pool)
    pages = dev["page_indices"][dev["page_indptr"][dev["batch_indices"]] + dev["positions"] // 16].long()
    slots = (dev["positions"] % 16).long()
    expected[pages, 2, 0, slots] = k
    expected[pages, 2, 1, slots] = v
    assert torch.equal(pool.view(torch.int16), expected.view(torch.int16))
