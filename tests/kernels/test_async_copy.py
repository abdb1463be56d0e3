"""Row copies through a cursor (async_copy.build_row_copy): the rows land where a plain slice puts
them, rows from the limit on land as zeros; on sm_90 the copies take no per-copy address conversion."""

from __future__ import annotations

import numpy as np
import pytest

from executor.kernels.async_copy import build_async_copy, build_row_copy, build_shared_address
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90

cuda = load_cuda()
from numba import int32  # noqa: E402  (after load_cuda's numpy fix)

ROWS, WORDS = 8, 8  # the tile: 8 rows of two 16-byte chunks, one chunk a thread
THREADS = ROWS * WORDS // 4


def build_stage_kernel():
    """Kernel ``(src [H, C, WORDS] int32, head, first, limit, out [ROWS, WORDS] int32)``: out <- the
    shared tile after staging rows first.. of src[head] (zeros from row ``limit`` on)."""
    row_cursor, copy_row_async, fresh_address = build_row_copy(4 * WORDS)
    _, copy_async_wait_all = build_async_copy()
    shared_address = build_shared_address()
    alignment = None if simulator_enabled() else 16

    @cuda.jit
    def stage(src, head, first, limit, out):
        tile = cuda.shared.array((ROWS, WORDS), int32, alignment=alignment)
        tid = cuda.threadIdx.x
        lane_row, col = tid // 2, (tid % 2) * 4
        for w in range(4):
            tile[lane_row, col + w] = -1  # stale bits the zero fill must overwrite
        cuda.syncthreads()
        cursor = row_cursor(src, (head, 0, col))
        row = first + lane_row
        valid = row < limit
        copy_row_async(tile, fresh_address(shared_address(tile, (0, 0))), (lane_row, col), src, cursor,
                       row if valid else 0, valid)
        copy_async_wait_all()
        cuda.syncthreads()
        for w in range(4):
            out[lane_row, col + w] = tile[lane_row, col + w]

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


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
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
