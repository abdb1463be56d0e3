"""Tensor-core building blocks for Numba kernels: the bf16 ``mma.sync`` tile, bf16x2 packing, and
the ``ldmatrix`` fragment loads (``build_fragment_loads``, ``build_a_fragment_load``).

Numba exposes no tensor-core instruction, so on the GPU these are PTX through
llvmlite inline asm (as codec.py's bf16 store is):

    mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
        mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: one warp computes
        D[16, 8] = A[16, 16] @ B[16, 8] + C[16, 8], bf16 inputs, float32 accumulation.
    pack_bf16x2(low, high) -> int32
        cvt.rn.bf16x2.f32: two float32 rounded to nearest even into one word,
        ``low`` in the low half (the element at the lower address).

Fragments (PTX ISA, mma.m16n8k16 with .bf16), for lane l of the warp, g = l // 4 and
t = l % 4; an A or B register holds two bf16, the first in its low half:

    a0 = A[g, 2t:2t+2]     a1 = A[g+8, 2t:2t+2]     a2 = A[g, 2t+8:2t+10]    a3 = A[g+8, 2t+8:2t+10]
    b0 = B[2t:2t+2, g]     b1 = B[2t+8:2t+10, g]
    c0, c1 = C[g, 2t], C[g, 2t+1]                    c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

Every lane of the warp must execute ``mma_bf16`` together (it is a warp-wide instruction).

The simulator cannot run PTX. There ``pack_bf16x2`` is the codec's integer rounding,
and ``mma_bf16`` gathers the warp's fragments through shared memory. Lane 0 of each
warp then computes the tile in float64 and rounds it once to float32, which the
hardware's float32 accumulation agrees with to float32 rounding. Each lane reads
back its four values. This uses two block-wide barriers, so in the simulator every
thread of the block must make the same sequence of calls. The kernels here do
(their loops are uniform), and tests/kernels/test_mma.py holds the emulation and
the hardware to the same float64 reference.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from executor.kernels.primitives.codec import build_codec
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32, types, uint32  # noqa: E402  (after load_cuda's numpy fix)

#: Warps a simulated block may hold (the emulation's shared scratch is sized for a full 1024-thread block).
SIM_MAX_WARPS = 32


def build_pack_bf16x2() -> Callable[..., Any]:
    """Device function ``pack_bf16x2(low f32, high f32) -> int32``: both rounded to bf16, one word."""
    if simulator_enabled():
        store = build_codec("bfloat16").store

        @cuda.jit(device=True)
        def pack_bf16x2(low, high):
            return int32((int32(store(low)) & 0xFFFF) | (int32(store(high)) << 16))

        return pack_bf16x2

    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cvt_rn_bf16x2(typingctx, high, low):
        def codegen(context, builder, signature, args):
            convert = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            # PTX puts the first source in the upper half.
            return builder.asm(convert, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", list(args), side_effect=False)

        return types.int32(types.float32, types.float32), codegen

    @cuda.jit(device=True, inline=True)
    def pack_bf16x2(low, high):
        return cvt_rn_bf16x2(float32(high), float32(low))

    return pack_bf16x2


def build_mma_bf16() -> Callable[..., Any]:
    """Device function ``mma_bf16(a0..a3 int32, b0, b1 int32, c0..c3 f32) -> (d0, d1, d2, d3)`` (module docstring)."""
    if simulator_enabled():
        return _simulated_mma()

    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        result = types.UniTuple(types.float32, 4)
        signature = result(*([types.int32] * 6), *([types.float32] * 4))

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            outputs = ir.LiteralStructType([f32] * 4)
            function = ir.FunctionType(outputs, [ir.IntType(32)] * 6 + [f32] * 4)
            asm = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                   "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
            value = builder.asm(function, asm, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", list(args), side_effect=False)
            return context.make_tuple(builder, result, [builder.extract_value(value, i) for i in range(4)])

        return signature, codegen

    return mma_bf16


def _fragment_indices() -> tuple[np.ndarray, ...]:
    """Where each lane's fragment values sit in A [16, 16], B [16, 8] and C [16, 8]: row and column
    index arrays of shape [32 lanes, 8] (A, a register's two halves in order), [32, 4] (B) and [32, 4] (C)."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    a_rows = np.stack([g, g, g + 8, g + 8, g, g, g + 8, g + 8], axis=1)
    a_cols = np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9, 2 * t + 8, 2 * t + 9], axis=1)
    b_rows = np.stack([2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], axis=1)
    b_cols = np.stack([g, g, g, g], axis=1)
    c_rows = np.stack([g, g, g + 8, g + 8], axis=1)
    c_cols = np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1], axis=1)
    return a_rows, a_cols, b_rows, b_cols, c_rows, c_cols


def _simulated_mma() -> Callable[..., Any]:
    a_rows, a_cols, b_rows, b_cols, c_rows, c_cols = _fragment_indices()

    def halves(words: np.ndarray) -> np.ndarray:
        """int32 words [32, n] -> the bf16 values [32, 2n] as float64, low half first."""
        bits = words.astype(np.uint32)
        pairs = np.stack([bits & 0xFFFF, bits >> 16], axis=-1).reshape(words.shape[0], -1)
        return (pairs.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    @cuda.jit(device=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        registers = cuda.shared.array((SIM_MAX_WARPS, 32, 6), np.int32)
        accumulators = cuda.shared.array((SIM_MAX_WARPS, 32, 4), np.float32)
        results = cuda.shared.array((SIM_MAX_WARPS, 32, 4), np.float32)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        warp, lane = tid // 32, tid % 32
        registers[warp, lane] = (a0, a1, a2, a3, b0, b1)
        accumulators[warp, lane] = (c0, c1, c2, c3)
        cuda.syncthreads()
        if lane == 0:
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            c = np.zeros((16, 8))
            a[a_rows, a_cols] = halves(registers[warp, :, :4])
            b[b_rows, b_cols] = halves(registers[warp, :, 4:])
            c[c_rows, c_cols] = accumulators[warp]
            results[warp] = (a @ b + c)[c_rows, c_cols].astype(np.float32)
        cuda.syncthreads()
        d = results[warp, lane]
        return float32(d[0]), float32(d[1]), float32(d[2]), float32(d[3])

    return mma_bf16


def build_fragment_loads() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """Device functions loading four B fragments from a shared tile of int32 words (two bf16 a word),
    ``tile`` [rows, row_words], 16-byte aligned rows:

        lane_address(tile, transposed) -> uint32
            this lane's ldmatrix row address for the fragments at (0, 0) (0 in the simulator):
            computed once, so that every load below is one instruction at a constant offset.
        load_b_x4(tile, address, row0, word0) -> (r0, r1, r2, r3)
            register m = the 8x8 matrix at rows row0..row0+7, words word0+4m..word0+4m+3, as
            ``ldmatrix`` deals it: lane (g, t) gets tile[row0 + g, word0 + 4m + t]. For a
            tile of K rows (key-major), r0, r1 are the b0, b1 of the k-step at word0 and
            r2, r3 those of the next k-step.
        load_b_x4_trans(tile, address, row0, word0) -> (r0, r1, r2, r3)
            register m = the transposed 8x8 matrix at rows row0 + 8 (m % 2) .., words
            word0 + 4 (m // 2) ..: lane (g, t) gets the element pair (tile row row0 + 8 (m % 2)
            + 2t, then the row after it) of column g of that matrix. For a tile of V rows
            (key-major), r0, r1 are the b0, b1 of the 16 keys at row0 for the 8 output
            columns at word0, r2, r3 those of the next 8 columns: no transposed copy of V.

    ``address`` is lane_address(tile, False) for load_b_x4 and lane_address(tile, True) for
    load_b_x4_trans. Every lane of the warp must call the loads together. On the GPU each is one
    ``ldmatrix.sync.aligned.m8n8.x4`` (lanes 8m..8m+7 give matrix m's row addresses); in the
    simulator each lane reads its own words from ``tile``.
    """
    if simulator_enabled():
        return _simulated_fragment_loads()
    from executor.kernels.primitives.async_copy import build_shared_address

    shared_address = build_shared_address()
    ldmatrix_x4 = _ldmatrix_intrinsic(transposed=False)
    ldmatrix_x4_trans = _ldmatrix_intrinsic(transposed=True)

    @cuda.jit(device=True, inline=True)
    def lane_address(tile, transposed):
        lane = cuda.threadIdx.x % 32
        matrix = lane // 8
        if transposed:
            return shared_address(tile, (8 * (matrix % 2) + lane % 8, 4 * (matrix // 2)))
        return shared_address(tile, (lane % 8, 4 * matrix))

    @cuda.jit(device=True, inline=True)
    def offset_bytes(tile, row0, word0):
        return uint32(4 * (row0 * tile.shape[1] + word0))

    @cuda.jit(device=True, inline=True)
    def load_b_x4(tile, address, row0, word0):
        return ldmatrix_x4(address + offset_bytes(tile, row0, word0))

    @cuda.jit(device=True, inline=True)
    def load_b_x4_trans(tile, address, row0, word0):
        return ldmatrix_x4_trans(address + offset_bytes(tile, row0, word0))

    return lane_address, load_b_x4, load_b_x4_trans


def build_a_fragment_load() -> Callable[..., Any]:
    """``load_a_x4(tile, address, row0, word0) -> (a0, a1, a2, a3)``: the A fragment of one m16n8k16
    k-step from a shared tile of row-major A rows (int32 words of two bf16, 16-byte aligned rows),
    rows row0 .. row0 + 15 and words word0 .. word0 + 7 (the module docstring's a0..a3): lane (g, t)
    gets tile[row0 + g, word0 + t], tile[row0 + 8 + g, word0 + t], tile[row0 + g, word0 + 4 + t]
    and tile[row0 + 8 + g, word0 + 4 + t].

    ``address`` is ``lane_address(tile, True)`` (build_fragment_loads): its matrices are A's four
    8x8 quarters in a0..a3 order, so on the GPU this is one plain ``ldmatrix.sync.aligned.m8n8.x4``;
    in the simulator each lane reads its own words. Every lane of the warp calls it together.
    """
    if simulator_enabled():
        @cuda.jit(device=True)
        def simulated_load_a_x4(tile, address, row0, word0):
            lane = cuda.threadIdx.x % 32
            g, t = lane // 4, lane % 4
            return (int32(tile[row0 + g, word0 + t]), int32(tile[row0 + 8 + g, word0 + t]),
                    int32(tile[row0 + g, word0 + 4 + t]), int32(tile[row0 + 8 + g, word0 + 4 + t]))

        return simulated_load_a_x4
    return _load_at(_ldmatrix_intrinsic(transposed=False))


def build_eight_key_value_load() -> Callable[..., Any]:
    """``load_v8_x4(tile, address, row0, word0) -> (r0, r1, r2, r3)`` for a shared tile of value rows
    (key-major, int32 words of two bf16, 16-byte aligned rows), eight keys row0 .. row0 + 7 at a time:
    register m is the b0 of the k-step of those eight keys (``mma_bf16`` with b1 = 0 and A's columns
    8..15 zero) for the 8 output columns 2 word0 + 8m ..: lane (g, t) gets the pair (tile row
    row0 + 2t, then the row after it) of column 2 word0 + 8m + g.

    ``address`` is ``lane_address(tile, False)`` (build_fragment_loads): on the GPU this is one
    ``ldmatrix.sync.aligned.m8n8.x4.trans`` over the four 8x8 matrices side by side; in the
    simulator each lane reads its own words from ``tile``. Every lane of the warp calls it together.
    """
    if simulator_enabled():
        pair = _simulated_pair()

        @cuda.jit(device=True)
        def simulated_load_v8_x4(tile, address, row0, word0):
            lane = cuda.threadIdx.x % 32
            g, t = lane // 4, lane % 4
            row, word, high = row0 + 2 * t, word0 + g // 2, g % 2
            return (pair(tile, row, word, high), pair(tile, row, word + 4, high), pair(tile, row, word + 8, high),
                    pair(tile, row, word + 12, high))

        return simulated_load_v8_x4
    return _load_at(_ldmatrix_intrinsic(transposed=True))


def _load_at(ldmatrix_x4: Callable[..., Any]) -> Callable[..., Any]:
    """``load(tile, address, row0, word0)``: ``ldmatrix_x4`` at this lane's ``address`` plus the byte
    offset of tile[row0, word0] (a constant once the caller's loops unroll)."""

    @cuda.jit(device=True, inline=True)
    def load(tile, address, row0, word0):
        return ldmatrix_x4(address + uint32(4 * (row0 * tile.shape[1] + word0)))

    return load


def _ldmatrix_intrinsic(transposed: bool) -> Callable[..., Any]:
    """``ldmatrix_x4(address uint32) -> 4 x int32`` from this lane's shared-memory row address."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    layout = ".trans" if transposed else ""
    asm = f"ldmatrix.sync.aligned.m8n8.x4{layout}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

    @intrinsic
    def ldmatrix_x4(typingctx, address):
        result = types.UniTuple(types.int32, 4)

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            function = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
            # side_effect: the load must stay between the barriers that order it against the staging.
            value = builder.asm(function, asm, "=r,=r,=r,=r,r", list(args), side_effect=True)
            return context.make_tuple(builder, result, [builder.extract_value(value, i) for i in range(4)])

        return result(types.uint32), codegen

    return ldmatrix_x4


def _simulated_pair() -> Callable[..., Any]:
    """The simulator's ``pair(tile, row, word, high)``: half ``high`` (0 or 1) of the word in rows
    ``row`` and ``row + 1``, (that of row) | (that of row + 1) << 16, as ldmatrix's .trans deals it."""

    @cuda.jit(device=True)
    def pair(tile, row, word, high):
        shift = 16 * high
        first = (int(tile[row, word]) >> shift) & 0xFFFF
        second = (int(tile[row + 1, word]) >> shift) & 0xFFFF
        return int32(np.uint32(first | (second << 16)).view(np.int32))

    return pair


def _simulated_fragment_loads() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    @cuda.jit(device=True)
    def lane_address(tile, transposed):
        return uint32(0)

    @cuda.jit(device=True)
    def load_b_x4(tile, address, row0, word0):
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        row = tile[row0 + g]
        return int32(row[word0 + t]), int32(row[word0 + 4 + t]), int32(row[word0 + 8 + t]), int32(row[word0 + 12 + t])

    pair = _simulated_pair()

    @cuda.jit(device=True)
    def load_b_x4_trans(tile, address, row0, word0):
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        word, high = word0 + g // 2, g % 2
        return (pair(tile, row0 + 2 * t, word, high), pair(tile, row0 + 8 + 2 * t, word, high),
                pair(tile, row0 + 2 * t, word + 4, high), pair(tile, row0 + 8 + 2 * t, word + 4, high))

    return lane_address, load_b_x4, load_b_x4_trans
