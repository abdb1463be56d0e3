"""Gathering a request's keys and values for GEMM prefill attention; the GEMMs run through torch.

A long prefill chunk computes attention as ``softmax(scale * Q K^T, causal) V``
with two batched GEMMs on the tensor cores (executor.models.prefill_attention).
Their operands must be contiguous, the KV cache is paged:

- ``GatherKv``: one request's first ``num_tokens`` keys and values, copied out
  of their KV pages into the contiguous ``[Hkv, C, D]`` scratch a GEMM reads.
  A pure copy of storage elements (any 4-byte element type; callers pass bf16
  pairs as int32): a thread per 16-byte chunk where every row of the caches and
  the scratch is whole 16-byte aligned chunks (the engine's layouts), a thread per
  element otherwise.
- ``PackedGatherKv``: FlashAttention's gather, every packed request of a range of
  the step's (packed.py) in one launch, their keys one after another in the
  scratch; a thread per 16-byte chunk (the flash backend's layouts are aligned).

Between the two GEMMs runs the causal softmax (causal_softmax.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from executor.kernels.attention.packed import build_packed_request
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.vector import VECTOR_WORDS, build_vector_access, vector_aligned
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import int32  # noqa: E402  (after load_cuda's numpy fix)

#: gather: elements each thread copies (consecutive threads take consecutive elements).
GATHER_PER_THREAD = 4


def build_gather_kv() -> Any:
    """Kernel ``(k_cache, v_cache [pages, S, Hkv, W], page_indices [P] i32, page_start, num_tokens,
    keys, values [Hkv, C, W])``: keys[h, j, :] = k_cache[page_indices[page_start + j // S], j % S, h, :]
    for j < num_tokens (and the same for values). A flat grid over num_tokens x Hkv x W elements,
    ordered as the pages are (token, head, element): reads are coalesced, writes within a head row."""

    @cuda.jit
    def gather_kv_kernel(k_cache, v_cache, page_indices, page_start, num_tokens, keys, values):
        page_size, heads, width = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        total = num_tokens * heads * width
        base = cuda.blockIdx.x * cuda.blockDim.x * GATHER_PER_THREAD
        end = min(total, base + cuda.blockDim.x * GATHER_PER_THREAD)
        for e in range(base + cuda.threadIdx.x, end, cuda.blockDim.x):
            w = e % width
            h = (e // width) % heads
            j = e // (width * heads)
            page = page_indices[page_start + j // page_size]
            keys[h, j, w] = k_cache[page, j % page_size, h, w]
            values[h, j, w] = v_cache[page, j % page_size, h, w]

    return gather_kv_kernel


def _build_copy_chunk() -> Any:
    """Device function ``copy_chunk(k_cache, v_cache, page_indices, page_start, e, keys, values, first_row)``:
    chunk ``e`` of a request's tokens in the pages' order (token j = e // (Hkv x chunks a row), then head,
    then chunk) from its KV pages, listed from ``page_indices[page_start]``, to row ``first_row + j`` of
    the scratch; the caller checks e < tokens x Hkv x chunks."""
    load_vector, store_vector = build_vector_access()

    @cuda.jit(device=True, inline=True)
    def copy_chunk(k_cache, v_cache, page_indices, page_start, e, keys, values, first_row):
        page_size, heads = k_cache.shape[1], k_cache.shape[2]
        chunks = k_cache.shape[3] // VECTOR_WORDS
        w = (e % chunks) * VECTOR_WORDS
        h = (e // chunks) % heads
        j = e // (chunks * heads)
        page = page_indices[page_start + j // page_size]
        slot = j % page_size
        words = cuda.local.array(VECTOR_WORDS, int32)
        load_vector(k_cache, (page, slot, h, w), words, 0)
        store_vector(keys, (h, first_row + j, w), words, 0)
        load_vector(v_cache, (page, slot, h, w), words, 0)
        store_vector(values, (h, first_row + j, w), words, 0)

    return copy_chunk


def build_gather_kv_vector() -> Any:
    """``build_gather_kv``'s kernel with a thread per 16-byte chunk (VECTOR_WORDS words): the same
    arguments, 4-byte elements, every row of the caches and the scratch 16-byte aligned and W a whole
    number of chunks. A flat grid over num_tokens x Hkv x W / VECTOR_WORDS chunks in the pages'
    order."""
    copy_chunk = _build_copy_chunk()

    @cuda.jit
    def gather_kv_vector(k_cache, v_cache, page_indices, page_start, num_tokens, keys, values):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if e < num_tokens * k_cache.shape[2] * (k_cache.shape[3] // VECTOR_WORDS):
            copy_chunk(k_cache, v_cache, page_indices, page_start, e, keys, values, 0)

    return gather_kv_vector


def build_gather_kv_packed() -> Any:
    """Kernel ``(k_cache, v_cache [pages, S, Hkv, W], page_indices, page_indptr [R + 1], q_indptr [R + 1],
    positions [T] int32, first_request, min_rows int32, keys, values [Hkv, C, W])``: for each packed
    request r of the range (packed.py), keys[h, kv_offset + j, :] = k_cache[page_indices[page_indptr[r] +
    j // S], j % S, h, :] for j < kv_len (and the same for values). Grid (ceil(longest kv_len x Hkv x
    W / VECTOR_WORDS / threads), requests of the range): a thread per 16-byte chunk in the pages' order."""
    copy_chunk = _build_copy_chunk()
    chunk_of, kv_offset_of = build_packed_request()

    @cuda.jit
    def gather_kv_packed(k_cache, v_cache, page_indices, page_indptr, q_indptr, positions, first_request, min_rows,
                         keys, values):
        request = first_request + cuda.blockIdx.y
        _, rows, kv_len = chunk_of(q_indptr, positions, request)
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if rows >= min_rows and e < kv_len * k_cache.shape[2] * (k_cache.shape[3] // VECTOR_WORDS):
            copy_chunk(k_cache, v_cache, page_indices, page_indptr[request], e, keys, values,
                       kv_offset_of(q_indptr, positions, first_request, request, min_rows))

    return gather_kv_packed


class GatherKv:
    """Launcher: copy one request's ``num_tokens`` keys and values from the paged cache.

    - k_cache, v_cache [pages, S, Hkv, W]: one layer's cache (any element type; W = D, or D / 2
      for bf16 viewed as int32 pairs).
    - page_indices [P] int32: the step's page table; the request's pages start at ``page_start``.
    - keys, values [Hkv, C, W]: the planned gather scratch, same element type; C >= num_tokens.
    """

    def __init__(self) -> None:
        self.kernel = Kernel(build_gather_kv())
        self.vector = Kernel(build_gather_kv_vector())
        self.threads = 32 if simulator_enabled() else 256

    def __call__(self, k_cache: Any, v_cache: Any, page_indices: Any, page_start: int, num_tokens: int,
                 keys: Any, values: Any, stream: Any = 0) -> None:
        _, page_size, heads, width = _check_scratch(k_cache, keys, values, num_tokens, "")
        if page_start + -(-num_tokens // page_size) > page_indices.shape[0]:
            raise ValueError(f"gather_kv: {num_tokens} tokens from page entry {page_start} run past the "
                             f"{page_indices.shape[0]}-entry page table")
        if num_tokens == 0:
            return
        if vector_aligned(k_cache, v_cache, keys, values):
            blocks = -(-num_tokens * heads * (width // VECTOR_WORDS) // self.threads)
            self.vector[blocks, self.threads, stream](k_cache, v_cache, page_indices, np.int32(page_start),
                                                      np.int32(num_tokens), keys, values)
            return
        per_block = self.threads * GATHER_PER_THREAD
        blocks = -(-num_tokens * heads * width // per_block)
        self.kernel[blocks, self.threads, stream](k_cache, v_cache, page_indices, np.int32(page_start),
                                                  np.int32(num_tokens), keys, values)


class PackedGatherKv:
    """Launcher: the keys and values of a packed range of a step's requests (packed.py) into the scratch,
    one launch.

    - k_cache, v_cache [pages, S, Hkv, W]: one layer's cache, 4-byte elements (bf16 pairs as int32).
    - page_indices, page_indptr, q_indptr, positions: the step's int32 metadata.
    - keys, values [Hkv, C, W]: the planned gather scratch; C >= ``kv_tokens``, the packed requests'
      kv_len summed; ``max_kv_len`` the longest of them (the grid).
    """

    def __init__(self) -> None:
        self.kernel = Kernel(build_gather_kv_packed())
        self.threads = 32 if simulator_enabled() else 256

    def __call__(self, k_cache: Any, v_cache: Any, page_indices: Any, page_indptr: Any, q_indptr: Any,
                 positions: Any, first_request: int, num_requests: int, max_kv_len: int, kv_tokens: int,
                 keys: Any, values: Any, min_rows: int = 1, stream: Any = 0) -> None:
        _, _, heads, width = _check_scratch(k_cache, keys, values, kv_tokens, "the packed requests' ")
        if not vector_aligned(k_cache, v_cache, keys, values):
            raise ValueError("gather_kv: the packed gather needs 16-byte aligned rows of whole 16-byte chunks")
        if num_requests == 0 or max_kv_len == 0:
            return
        blocks = -(-max_kv_len * heads * (width // VECTOR_WORDS) // self.threads)
        self.kernel[(blocks, num_requests), self.threads, stream](
            k_cache, v_cache, page_indices, page_indptr, q_indptr, positions, np.int32(first_request),
            np.int32(min_rows), keys, values)


def _check_scratch(k_cache: Any, keys: Any, values: Any, tokens: int, whose: str) -> tuple[int, int, int, int]:
    """The cache's [pages, S, Hkv, W] after checking that keys and values are [Hkv, C, W] with C >= tokens."""
    pages, page_size, heads, width = (int(n) for n in k_cache.shape)
    if tuple(keys.shape[::2]) != (heads, width) or keys.shape != values.shape:
        raise ValueError(f"gather_kv: keys/values must be [{heads}, C, {width}], got {tuple(keys.shape)} "
                         f"and {tuple(values.shape)}")
    if tokens > keys.shape[1]:
        raise ValueError(f"gather_kv: {whose}{tokens} tokens, scratch holds {keys.shape[1]}")
    return pages, page_size, heads, width
