"""The warpgroup tensor-core product (primitives/wgmma.py): operands staged by cp.async into core-matrix
tiles and read through their descriptors, A from shared memory or from registers, B K-major or
MN-major. The simulator's emulation here, the hardware on the GPU, both against float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.async_copy import build_async_copy, build_shared_address
from executor.kernels.primitives.wgmma import (WARPGROUP_THREADS, CoreTile, build_chunk_word, build_descriptor,
                                               build_step_offset, build_wgmma, build_wgmma_sync, build_wgmma_wait)
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90

cuda = load_cuda()


def build_product_kernel(n: int, k: int, a_in_registers: bool, b_k_major: bool, swizzle: bool = False):
    """Kernel ``(a [64, k/2], b [.., ..] int32 words, d [64, n] float32)``: one warpgroup computes
    d = A @ B + d over k / 16 k-steps. A is row-major [64, k]; B is given as B^T [n, k] (b_k_major)
    or as B [k, n] (MN-major), two bf16 a word. Both operands are staged into core tiles; A is read
    from its tile by descriptor, or (a_in_registers) each warp loads its rows' fragments from global
    memory as mma.py's A fragment. ``swizzle``: both tiles 128-byte swizzled."""
    a_tile_shape = CoreTile(64, k, swizzle)
    b_tile = CoreTile(n, k, swizzle) if b_k_major else CoreTile(k, n, swizzle)
    a_layout = a_tile_shape.k_major()
    b_layout = b_tile.k_major() if b_k_major else b_tile.mn_major()
    a_leading, a_stride, a_mode = a_layout.leading, a_layout.stride, a_layout.mode
    b_leading, b_stride, b_mode = b_layout.leading, b_layout.stride, b_layout.mode
    a_step, b_step = build_step_offset(a_layout), build_step_offset(b_layout)
    b_rows, b_chunks = b_tile.rows, b_tile.elements // 8
    a_shape, b_shape = a_tile_shape.shape, b_tile.shape
    wgmma = build_wgmma(n, a_in_registers, b_k_major)
    wgmma_fence, wgmma_commit, proxy_fence = build_wgmma_sync()
    wgmma_wait = build_wgmma_wait(n // 2)
    descriptor = build_descriptor()
    chunk_word = build_chunk_word()
    a_rows = a_tile_shape.rows
    copy_async, copy_async_wait_all = build_async_copy()
    shared_address = build_shared_address()
    alignment = None if simulator_enabled() else 1024  # a swizzle atom's alignment
    values, steps = n // 2, k // 16

    @cuda.jit
    def product(a, b, d):
        a_tile = cuda.shared.array(a_shape, np.int32, alignment=alignment)
        b_shared = cuda.shared.array(b_shape, np.int32, alignment=alignment)
        acc = cuda.local.array(values, np.float32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        a_address = shared_address(a_tile, (0, 0))
        b_address = shared_address(b_shared, (0, 0))
        for c in range(tid, 64 * (k // 8), WARPGROUP_THREADS):
            row, chunk = c % 64, c // 64
            copy_async(a_tile, a_address, chunk_word(row, chunk, a_rows, swizzle), a, (row, 4 * chunk), True)
        for c in range(tid, b_rows * b_chunks, WARPGROUP_THREADS):
            row, chunk = c % b_rows, c // b_rows
            copy_async(b_shared, b_address, chunk_word(row, chunk, b_rows, swizzle), b, (row, 4 * chunk), True)
        copy_async_wait_all()
        proxy_fence()
        cuda.syncthreads()
        row = 16 * warp + g
        for j in range(n // 8):
            acc[4 * j] = d[row, 8 * j + 2 * t]
            acc[4 * j + 1] = d[row, 8 * j + 2 * t + 1]
            acc[4 * j + 2] = d[row + 8, 8 * j + 2 * t]
            acc[4 * j + 3] = d[row + 8, 8 * j + 2 * t + 1]
        wgmma_fence()
        for s in range(steps):
            b_descriptor = descriptor(b_address, b_leading, b_stride, b_mode) + b_step(s)
            if a_in_registers:
                wgmma(acc, a[row, 8 * s + t], a[row + 8, 8 * s + t], a[row, 8 * s + 4 + t], a[row + 8, 8 * s + 4 + t],
                      b_shared, b_descriptor, True)
            else:
                wgmma(acc, a_tile, descriptor(a_address, a_leading, a_stride, a_mode) + a_step(s), b_shared,
                      b_descriptor, True)
        wgmma_commit()
        wgmma_wait(acc)
        for j in range(n // 8):
            d[row, 8 * j + 2 * t] = acc[4 * j]
            d[row, 8 * j + 2 * t + 1] = acc[4 * j + 1]
            d[row + 8, 8 * j + 2 * t] = acc[4 * j + 2]
            d[row + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]

    return product


def words(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().copy().view(np.int32)


def run_product(n: int, k: int, a_in_registers: bool, b_k_major: bool, seed: int,
                swizzle: bool = False) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(64, k, generator=gen).bfloat16()
    b = torch.randn(k, n, generator=gen).bfloat16()
    c = torch.randn(64, n, generator=gen)
    d = c.numpy().copy()
    b_words = words(b.t()) if b_k_major else words(b)
    build_product_kernel(n, k, a_in_registers, b_k_major, swizzle)[1, WARPGROUP_THREADS](words(a), b_words, d)
    return d, (a.double() @ b.double() + c.double()).numpy()


SIM_CASES = [(16, 32, False, True, False), (16, 32, False, False, False), (24, 16, True, False, False),
             (16, 32, True, True, False), (64, 128, False, True, True), (64, 64, True, False, True)]
GPU_CASES = [(64, 128, False, True, False), (64, 256, False, True, False), (256, 64, True, False, False),
             (256, 32, False, False, False), (128, 64, True, True, False), (64, 256, False, True, True),
             (256, 64, True, False, True), (128, 128, False, False, True)]


@pytest.mark.parametrize("n,k,a_in_registers,b_k_major,swizzle", SIM_CASES if simulator_enabled() else GPU_CASES)
def test_warpgroup_product_matches_float64(n, k, a_in_registers, b_k_major, swizzle):
    """Random operands: a transposed core matrix, a swapped descriptor offset, a wrong swizzle or a lane
    holding another row's values gives a wrong product; two k-steps or more check the descriptor's
    advance (past an atom column, swizzled K-major at k 128)."""
    d, expected = run_product(n, k, a_in_registers, b_k_major, seed=n + k, swizzle=swizzle)
    np.testing.assert_allclose(d, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_core_tile_offsets_are_the_layout_s():
    """The tile's strides against the byte of (row, element) the module docstring defines."""
    tile = CoreTile(16, 32)
    layout = tile.k_major()
    assert (layout.leading, layout.stride, layout.offset(1), layout.offset(3)) == (16 * 16, 128, 2 * 16 * 16, 6 * 16 * 16)
    layout = tile.mn_major()
    assert (layout.leading, layout.stride, layout.offset(1)) == (128, 16 * 16, 256)
    assert tile.shape == (4, 64) and tile.bytes == 16 * 32 * 2
    swizzled = CoreTile(16, 128, swizzle=True)
    layout = swizzled.k_major()
    assert (layout.stride, layout.mode, layout.offset(3), layout.offset(4)) == (1024, 1, 96, 16 * 128)
    layout = swizzled.mn_major()
    assert (layout.leading, layout.stride, layout.offset(1)) == (16 * 128, 1024, 2048)
    with pytest.raises(ValueError, match="multiple of 64"):
        CoreTile(16, 32, swizzle=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        CoreTile(12, 32)
    with pytest.raises(ValueError, match="N 260"):
        build_wgmma(260, False, True)


@pytest.mark.ptx
def test_warpgroup_products_are_wgmma_instructions_on_sm90a():
    compile_for_sm90(
        """
        from tests.kernels.test_wgmma import build_product_kernel
        for n, k, a_in_registers, b_k_major in ((64, 32, False, True), (256, 32, True, False)):
            kernel = build_product_kernel(n, k, a_in_registers, b_k_major)
            text = cuda.compile_ptx(kernel.py_func, (arr("int32", 2), arr("int32", 2), arr("float32", 2)),
                                    cc=(9, 0, "a"))[0]
            assert ".target sm_90a" in text
            assert text.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16") == k // 16, text[-4000:]
            assert "wgmma.wait_group.sync.aligned 0" in text and "wgmma.fence.sync.aligned" in text
            assert "fence.proxy.async.shared::cta" in text
            assert ".local" not in text, "the accumulator left registers"
        """
    )
