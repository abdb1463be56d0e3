"""The paged KV cache write: scatter a step's K/V rows into their cache slots.

The KV pool is page-first, ``kv_cache [num_pages, num_full_layers, 2, S, Hkv, D]``;
kernels receive one layer's strided views ``k_cache = kv_cache[:, layer, 0]`` and
``v_cache = kv_cache[:, layer, 1]``, each ``[num_pages, S, Hkv, D]``.

Row ``t`` of the step belongs to request ``b = batch_indices[t]`` at absolute
position ``p = positions[t]``; it lands in physical page
``page_indices[page_indptr[b] + p // S]`` at slot ``p % S``. The copy keeps the
storage dtype (float32, or bfloat16 bits seen as int16), so no codec is needed:
an element copy is bit-exact. Padding rows of a CUDA-graph slot point at the
reserved page 0, which is harmless to overwrite.

Two kernels, one copy: where every row of K, V and both caches is a whole number of
16-byte aligned chunks (the engine's layouts), a thread copies one chunk of a row's
head of K and of V (``write_kv_vector``: 16-byte loads and stores, the grid sized to
the chunks); otherwise a block per (row, head) copies element by element
(``write_kv_kernel``).
"""

from __future__ import annotations

from typing import Any

from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import threads_for
from executor.kernels.primitives.vector import VECTOR_BYTES, VECTOR_WORDS, build_vector_access, vector_aligned
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import int32  # noqa: E402  (after load_cuda's numpy fix)

#: The vector kernel's block: a thread per 16-byte chunk (16 threads a bf16 head of 128).
VECTOR_THREADS = 256


@cuda.jit(device=True, inline=True)
def cache_slot(t, batch_indices, positions, page_indices, page_indptr, page_size):
    """``(page, slot)`` of row t's K/V in the paged cache (the module docstring's formula); shared
    with the fused q/k norm + RoPE + KV write (rope/fused_kv_write.py), so both write the same slots."""
    p = positions[t]
    logical = p // page_size
    return page_indices[page_indptr[batch_indices[t]] + logical], p - logical * page_size


@cuda.jit
def write_kv_kernel(k, v, k_cache, v_cache, batch_indices, positions, page_indices, page_indptr):
    """Grid ``(T, Hkv)``, threads over ``D`` (strided loop, any blockDim).

    k, v:         [T, Hkv, D] storage dtype, may be strided views of a fused qkv output.
    k_cache, v_cache: [num_pages, S, Hkv, D] same storage dtype, strided per-layer views.
    batch_indices, positions: [T] int32.
    page_indices: [num_logical_pages] int32; page_indptr: [B + 1] int32.
    """
    t = cuda.blockIdx.x
    head = cuda.blockIdx.y
    head_dim = k.shape[2]
    page, slot = cache_slot(t, batch_indices, positions, page_indices, page_indptr, k_cache.shape[1])
    for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
        k_cache[page, slot, head, d] = k[t, head, d]
        v_cache[page, slot, head, d] = v[t, head, d]


def build_write_kv_vector() -> Any:
    """``write_kv_kernel``'s copy with a thread per 16-byte chunk: the same arguments plus ``lanes``
    (elements a chunk); every row of k, v and the caches 16-byte aligned, D a whole number of chunks.
    Grid ``ceil(T x Hkv x D / lanes / blockDim)``: chunks of a row's head are consecutive threads."""
    load_vector, store_vector = build_vector_access()

    @cuda.jit
    def write_kv_vector(k, v, k_cache, v_cache, batch_indices, positions, page_indices, page_indptr, lanes):
        heads, chunks = k.shape[1], k.shape[2] // lanes
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= k.shape[0] * heads * chunks:
            return
        t = i // (heads * chunks)
        rest = i - t * heads * chunks
        head = rest // chunks
        d = (rest - head * chunks) * lanes
        page, slot = cache_slot(t, batch_indices, positions, page_indices, page_indptr, k_cache.shape[1])
        words = cuda.local.array(VECTOR_WORDS, int32)
        load_vector(k, (t, head, d), words, 0)
        store_vector(k_cache, (page, slot, head, d), words, 0)
        load_vector(v, (t, head, d), words, 0)
        store_vector(v_cache, (page, slot, head, d), words, 0)

    return write_kv_vector


class WriteKv:
    """Launcher: write a step's K/V rows into the paged cache (in place on ``k_cache``/``v_cache``).

    Shapes: ``k, v [T, Hkv, D]``; ``k_cache, v_cache [num_pages, S, Hkv, D]`` of the
    same storage dtype as ``k``/``v`` (float32, bfloat16, or its int16 bits);
    ``batch_indices, positions [T]`` int32; ``page_indices [P]``, ``page_indptr [B+1]``
    int32. Runs the vector kernel where all four K/V arrays are 16-byte aligned
    (``vector_aligned``), else the element kernel (``T x Hkv`` blocks), on ``stream``;
    allocates nothing. T is taken from ``k.shape[0]``: the caller slices the row
    buffers to the active rows (or points padding rows at page 0).
    """

    def __init__(self) -> None:
        self.kernel = Kernel(write_kv_kernel)
        self.vector = Kernel(build_write_kv_vector())

    def __call__(self, k: Any, v: Any, k_cache: Any, v_cache: Any, batch_indices: Any, positions: Any,
                 page_indices: Any, page_indptr: Any, stream: Any = 0) -> None:
        num_rows, num_kv_heads, head_dim = k.shape
        if tuple(v.shape) != (num_rows, num_kv_heads, head_dim):
            raise ValueError(f"write_kv: v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
        if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"write_kv: cache [.., S, Hkv, D] = {tuple(k_cache.shape)} does not match "
                             f"k [T, Hkv, D] = {tuple(k.shape)}")
        if num_rows == 0:
            return
        if vector_aligned(k, v, k_cache, v_cache):
            lanes = VECTOR_BYTES // k.dtype.itemsize
            chunks = num_rows * num_kv_heads * (head_dim // lanes)
            self.vector[-(-chunks // VECTOR_THREADS), VECTOR_THREADS, stream](
                k, v, k_cache, v_cache, batch_indices, positions, page_indices, page_indptr, lanes)
            return
        self.kernel[(num_rows, num_kv_heads), threads_for(head_dim), stream](
            k, v, k_cache, v_cache, batch_indices, positions, page_indices, page_indptr
        )
