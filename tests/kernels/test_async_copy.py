"""Row copies through a cursor (async_copy.build_row_copy): the rows land where a plain slice puts
them, rows from the limit on land as zeros; on sm_90 the copies take no per-copy address conversion.
Chunk copies through a row's cursor (build_chunk_copy): the chunks of one row of a strided 4-d
source land where indexing puts them, invalid ones as zeros."""

from __future__ import annotations

import numpy as np
import pytest

from executor.kernels.primitives.async_copy import build_async_copy, build_chunk_copy, build_row_copy, build_shared_address
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90

cuda = load_cuda()
from numba import int32  # noqa: E402  (after load_cuda's numpy fix)

ROWS, WORDS = 8, 8  # the tile: 8 rows of two 16-byte chunks, one chunk a thread
THREADS = ROWS * WORDS // 4


def build_tile_access():
    """``(lanes, unload)``, the stage kernels' own 16 bytes of the tile: ``lanes(tile)`` fills thread t's
    (row t // 2, words (t % 2) * 4 on) with stale bits the copies must overwrite and returns that
    (row, word) after a barrier; ``unload(tile, row, word, out)`` waits for the thread's copies and,
    after a barrier, writes its 16 bytes to out."""
    _, copy_async_wait_all = build_async_copy()

    @cuda.jit(device=True)
    def lanes(tile):
        tid = cuda.threadIdx.x
        row, word = tid // 2, (tid % 2) * 4
        for w in range(4):
            tile[row, word + w] = -1
        cuda.syncthreads()
        return row, word

    @cuda.jit(device=True)
    def unload(tile, row, word, out):
        copy_async_wait_all()
        cuda.syncthreads()
        for w in range(4):
            out[row, word + w] = tile[row, word + w]

    return lanes, unload


def build_stage_kernel():
    """Kernel ``(src [H, C, WORDS] int32, head, first, limit, out [ROWS, WORDS] int32)``: out <- the
    shared tile after staging rows first.. of src[head] (zeros from row ``limit`` on)."""
    row_cursor, copy_row_async, fresh_address = build_row_copy(4 * WORDS)
    shared_address = build_shared_address()
    lanes, unload = build_tile_access()
    alignment = None if simulator_enabled() else 16

    @cuda.jit
    def stage(src, head, first, limit, out):
        tile = cuda.shared.array((ROWS, WORDS), int32, alignment=alignment)
        lane_row, col = lanes(tile)
        cursor = row_cursor(src, (head, 0, col))
        row = first + lane_row
        valid = row < limit
        copy_row_async(tile, fresh_address(shared_address(tile, (0, 0))), (lane_row, col), src, cursor,
                       row if valid else 0, valid)
        unload(tile, lane_row, col, out)

    return stage


@pytest.mark.parametrize("first,limit", [(0, 20), (14, 19), (12, 12)])
def test_rows_land_as_a_slice_and_zeros_past_the_limit(first, limit):
    src = np.arange(3 * 20 * WORDS, dtype=np.int32).reshape(3, 20, WORDS)
    out = np.full((ROWS, WORDS), 7, np.int32)
    build_stage_kernel()[1, THREADS](src, 1, first, limit, out)
    expected = np.zeros((ROWS, WORDS), np.int32)
    landed = max(0, min(ROWS, limit - first))
    expected[:landed] = src[1, first:first + landed]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.ptx
def test_row_copies_convert_the_cursor_once_on_sm90():
    compile_for_sm90(
        """
        from numba import types
        from tests.kernels.test_async_copy import build_stage_kernel
        text = ptx(build_stage_kernel(), arr("int32", 3), types.int32, types.int32, types.int32, arr("int32", 2))
        assert text.count("cp.async.cg.shared.global") == 1
        assert text.count("cvta.to.global") == 1
        """
    )


def build_chunk_stage_kernel():
    """Kernel ``(src [P, S, H, 2 * WORDS] int16, page, slot, head, valid_chunks, out [ROWS, WORDS] int32)``:
    thread t copies chunk t of src[page, slot, head] (16 bytes: 8 bf16 bits) into tile row t // 2
    through the row's cursor; chunks from ``valid_chunks`` on are copied as invalid (zeros)."""
    chunk_cursor, copy_chunk_async = build_chunk_copy()
    shared_address = build_shared_address()
    lanes, unload = build_tile_access()
    alignment = None if simulator_enabled() else 16

    @cuda.jit
    def stage(src, page, slot, head, valid_chunks, out):
        tile = cuda.shared.array((ROWS, WORDS), int32, alignment=alignment)
        lane_row, col = lanes(tile)
        row = chunk_cursor(src, (page, slot, head, 0))
        chunk = cuda.threadIdx.x
        copy_chunk_async(tile, shared_address(tile, (0, 0)), (lane_row, col), src, row, chunk, chunk < valid_chunks)
        unload(tile, lane_row, col, out)

    return stage


@pytest.mark.parametrize("valid_chunks", [THREADS, 5])
def test_chunks_of_a_strided_row_land_in_order(valid_chunks):
    """A [pages, slots, heads, 128] bf16 cache viewed with its last axis halved (strided, as the KV
    pool's per-layer views): thread t's chunk t of row (2, 1, 1) is elements 8 t .. 8 t + 7."""
    pool = np.arange(4 * 3 * 2 * 128, dtype=np.int32).astype(np.int16).reshape(4, 3, 2, 128)
    src = pool[..., : 8 * THREADS]  # 16 chunks of 8 elements a row, rows 256 bytes apart
    out = np.full((ROWS, WORDS), 7, np.int32)
    build_chunk_stage_kernel()[1, THREADS](src, 2, 1, 1, valid_chunks, out)
    expected = np.ascontiguousarray(src[2, 1, 1]).view(np.int32).reshape(THREADS, 4).copy()
    expected[valid_chunks:] = 0
    np.testing.assert_array_equal(out, expected.reshape(ROWS, WORDS))


@pytest.mark.ptx
def test_chunk_copies_take_the_row_cursor_once_on_sm90():
    compile_for_sm90(
        """
        from numba import types
        from tests.kernels.test_async_copy import build_chunk_stage_kernel
        i32 = types.int32
        text = ptx(build_chunk_stage_kernel(), types.Array(types.int16, 4, "A"), i32, i32, i32, i32,
                   arr("int32", 2))
        assert text.count("cp.async.cg.shared.global") == 1
        assert text.count("cvta.to.global") == 1
        """
    )
