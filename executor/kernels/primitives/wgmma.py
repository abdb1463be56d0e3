"""Warpgroup tensor-core products (sm_90a ``wgmma.mma_async``) over shared tiles in the core-matrix layouts.

One warpgroup (4 consecutive warps, 128 threads, warp w of the group owning rows 16 w .. 16 w + 15)
computes D[64, N] (+)= A[64, 16] @ B[16, N] per instruction, bf16 inputs and float32 accumulation.
Unlike ``mma.sync`` (primitives/mma.py), B is read from shared memory once for the whole group, not
once per warp through ``ldmatrix``: a prefill attention block of 64 query rows reads each staged key
and value once per key block instead of four times, which is what bounds the ``mma.sync`` kernel.

Operands in shared memory live in ``CoreTile``s: int32 words (two bf16 a word), arranged so that
each 8-row x 16-byte core matrix is 128 contiguous bytes, 16-byte chunks of one column of chunks
one after another:

    tile[j, 4 r + w] = word w of 16-byte chunk j (elements 8 j .. 8 j + 7) of row r

so the byte of (row r, element c) is ``(c // 8) * rows * 16 + r * 16 + (c % 8) * 2``. A row of a
source [rows, D] stages as D / 8 chunk copies (primitives/async_copy.py's ``copy_async`` at the tile
index ``chunk_word(r, j, rows, swizzle)`` gives). The same tile serves as

- a K-major operand (A[m, k] or B^T[n, k] with k along the row: queries, keys): its core matrices
  are 8 rows apart at 128 bytes (the stride byte offset) and 8 elements of k apart at rows * 16
  bytes (the leading byte offset); a k-step of 16 elements starts 2 rows * 16 bytes further;
- an MN-major B[k, n] (values: k the key, along the tile's rows; n the output column, along the
  row): core matrices 8 columns apart at rows * 16 bytes (stride) and 8 keys apart at 128 bytes
  (leading); a k-step of 16 keys starts 256 bytes further.

A swizzled tile (``CoreTile(..., swizzle=True)``, the 128-byte swizzle, rows of a multiple of 64
elements) is made of atoms of 8 rows x 128 bytes (64 elements), an atom's rows one after another and
chunk c of row r at chunk c ^ (r % 8), atoms down the rows 1,024 bytes apart, then columns of atoms
rows * 128 bytes apart:

    byte of (row r, element c) = (c // 64) * rows * 128 + r * 128 + (((c // 8) % 8) ^ (r % 8)) * 16 + (c % 8) * 2

As a K-major operand its 8-row groups are 1,024 bytes apart (stride) and a k-step is 32 bytes
further inside an atom column (four a column); as an MN-major B its 64-column atoms are rows * 128
bytes apart (leading) and its 8-key groups 1,024 (stride), a k-step 2,048 bytes further.
``OperandLayout`` (``tile.k_major()``, ``tile.mn_major()``) holds those numbers.

``descriptor(address, leading_bytes, stride_bytes, mode)`` packs the 64-bit shared-memory matrix
descriptor: address >> 4 in bits 0-13, leading >> 4 in 16-29, stride >> 4 in 32-45, the swizzle mode
(0 none, 1 the 128-byte swizzle) in 62-63.

Device functions (``build_wgmma(n, a_in_registers, b_k_major)``; ``acc`` a local float32 array of
n / 2 values, updated in place, in the layout of mma.py's C fragment per 8 columns: acc[4 j ..
4 j + 3] = D[16 w + g, 8 j + 2 t], D[16 w + g, 8 j + 2 t + 1], D[16 w + g + 8, 8 j + 2 t],
D[16 w + g + 8, 8 j + 2 t + 1] for lane (g, t) of warp w):

    wgmma_ss(acc, a_tile, a_descriptor, b_tile, b_descriptor, accumulate)
        acc (+)= A @ B, A and B in shared tiles (A K-major; B K-major or MN-major per b_k_major).
    wgmma_rs(acc, a0, a1, a2, a3, b_tile, b_descriptor, accumulate)
        acc (+)= A @ B, A in registers: warp w's rows 16 w .. as mma.py's A fragment (a probability
        tile packed straight from an accumulator's values).

``accumulate`` false overwrites acc (no zeroing needed). The product is asynchronous: between
``wgmma_fence()``, the issues, ``wgmma_commit()`` (``build_wgmma_sync``) and ``wgmma_wait(acc)``
(``build_wgmma_wait``), a
thread must not touch acc or overwrite the operand tiles. ``wgmma_fence`` goes before the first
issue after acc or an A register was written by other instructions; ``wgmma_wait(acc)`` waits for
every committed group and hands acc's values on through the wait, so no read of acc is scheduled
before it. ``proxy_fence()`` orders this thread's completed shared-memory writes (cp.async
included) before the tensor cores' reads; a barrier after it makes every thread's writes visible.
Every thread of the warpgroup calls each function together.

The simulator cannot run PTX: there ``wgmma_ss`` has each lane read its accumulator's rows and
columns from the tiles through the descriptors, swizzle included (so the layout and descriptor
arithmetic run as on the GPU) and compute in float64, rounded once to float32; ``wgmma_rs`` first gathers the warp's A
fragments through shared memory (two block-wide barriers, as mma.py's emulation). The fences and
waits are no-ops there. tests/kernels/test_wgmma.py holds both to a float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from executor.kernels.primitives.async_copy import bare_instruction
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32, int64, types, uint64  # noqa: E402  (after load_cuda's numpy fix)

#: Rows of one warpgroup product (the M of every wgmma shape).
WARPGROUP_ROWS = 64
WARPGROUP_THREADS = 128
#: Bytes of one core matrix (8 rows of 16 bytes) and of one 16-byte chunk.
CORE_MATRIX_BYTES = 128
CHUNK_BYTES = 16
#: The wgmma N sizes a build accepts: multiples of 8 from 8 to 256.
MAX_N = 256
#: The 128-byte swizzle: a row of an atom is 128 bytes (64 bf16), an atom 8 such rows, and chunk c of
#: row r of an atom lies at chunk c ^ (r % 8); atoms must start 1,024-byte aligned. Descriptor mode 1.
SWIZZLE_BYTES = 128
SWIZZLE_ELEMENTS = 64
SWIZZLE_ATOM_BYTES = 1024
SWIZZLE_MODE_128B = 1
#: Warps the simulator's fragment exchange holds (a full 1024-thread block).
SIM_MAX_WARPS = 32


class OperandLayout(NamedTuple):
    """How a tile reads as one wgmma operand: the descriptor's leading and stride byte offsets and
    swizzle mode, and where k-step s starts: ``(s // steps_per_group) * group_bytes + (s %
    steps_per_group) * step_bytes`` bytes into the tile."""

    leading: int
    stride: int
    mode: int
    steps_per_group: int
    group_bytes: int
    step_bytes: int

    def offset(self, step: int) -> int:
        return (step // self.steps_per_group) * self.group_bytes + (step % self.steps_per_group) * self.step_bytes


@dataclass(frozen=True)
class CoreTile:
    """A shared tile of ``rows`` rows of ``elements`` bf16 in the core-matrix layout, or with
    ``swizzle`` in the 128-byte swizzled layout (module docstring)."""

    rows: int
    elements: int
    swizzle: bool = False

    def __post_init__(self) -> None:
        if self.rows % 8 or self.elements % 8 or self.rows <= 0 or self.elements <= 0:
            raise ValueError(f"core tile of {self.rows} rows x {self.elements} elements: both must be multiples of 8")
        if self.swizzle and self.elements % SWIZZLE_ELEMENTS:
            raise ValueError(f"swizzled tile of {self.elements} elements a row: must be a multiple of {SWIZZLE_ELEMENTS}")

    @property
    def shape(self) -> tuple[int, int]:
        """The int32 array's shape: one row of words per column of 16-byte chunks (per 128-byte atom
        column when swizzled)."""
        if self.swizzle:
            return (self.elements // SWIZZLE_ELEMENTS, 32 * self.rows)
        return (self.elements // 8, 4 * self.rows)

    @property
    def bytes(self) -> int:
        return 2 * self.rows * self.elements

    @property
    def column_bytes(self) -> int:
        """Bytes between one column of chunks (of atoms, swizzled) and the next."""
        return self.rows * (SWIZZLE_BYTES if self.swizzle else CHUNK_BYTES)

    def k_major(self) -> OperandLayout:
        """This tile as a K-major operand, k along its rows' elements."""
        if self.swizzle:  # k-steps of 32 bytes inside an atom column, then the next column
            return OperandLayout(CHUNK_BYTES, SWIZZLE_ATOM_BYTES, SWIZZLE_MODE_128B, SWIZZLE_BYTES // 32,
                                 self.column_bytes, 32)
        return OperandLayout(self.column_bytes, CORE_MATRIX_BYTES, 0, 1, 2 * self.column_bytes, 0)

    def mn_major(self) -> OperandLayout:
        """This tile as an MN-major B, k along its rows (keys)."""
        if self.swizzle:  # atoms of 64 columns column_bytes apart, 8-key groups 1,024 bytes apart
            return OperandLayout(self.column_bytes, SWIZZLE_ATOM_BYTES, SWIZZLE_MODE_128B, 1, 2 * SWIZZLE_ATOM_BYTES, 0)
        return OperandLayout(CORE_MATRIX_BYTES, self.column_bytes, 0, 1, 2 * CORE_MATRIX_BYTES, 0)


def build_step_offset(layout: OperandLayout) -> Callable[..., Any]:
    """``step_offset(s) -> int``: what k-step s adds to a descriptor of ``layout``'s tile (its byte offset
    >> 4, the descriptor's address unit); a constant once the caller's k-step loop unrolls."""
    per_group, group_bytes, step_bytes = layout.steps_per_group, layout.group_bytes, layout.step_bytes

    @cuda.jit(device=True, inline=True)
    def step_offset(s):
        return ((s // per_group) * group_bytes + (s % per_group) * step_bytes) >> 4

    return step_offset


def build_chunk_word() -> Callable[..., Any]:
    """``chunk_word(row, chunk, rows, swizzle) -> (i, j)``: the tile index (int32 words) of 16-byte chunk
    ``chunk`` of row ``row`` in a tile of ``rows`` rows, swizzled or not (compile-time constants)."""

    @cuda.jit(device=True, inline=True)
    def chunk_word(row, chunk, rows, swizzle):
        if swizzle:
            return chunk >> 3, 32 * row + 4 * ((chunk & 7) ^ (row & 7))
        return chunk, 4 * row

    return chunk_word


def build_descriptor() -> Callable[..., Any]:
    """``descriptor(address uint32, leading_bytes, stride_bytes, mode) -> int64`` (module docstring)."""

    @cuda.jit(device=True, inline=True)
    def descriptor(address, leading_bytes, stride_bytes, mode):
        value = (uint64(address) & uint64(0x3FFFF)) >> uint64(4)
        value |= (uint64(leading_bytes) >> uint64(4)) << uint64(16)
        value |= (uint64(stride_bytes) >> uint64(4)) << uint64(32)
        value |= uint64(mode) << uint64(62)
        return int64(value)

    return descriptor


def build_wgmma(n: int, a_in_registers: bool, b_k_major: bool) -> Callable[..., Any]:
    """``wgmma_rs`` (a_in_registers) or ``wgmma_ss`` for D[64, n] (module docstring)."""
    if n % 8 or not 8 <= n <= MAX_N:
        raise ValueError(f"wgmma: N {n} must be a multiple of 8 in 8..{MAX_N}")
    if simulator_enabled():
        return _simulated_rs(n, b_k_major) if a_in_registers else _simulated_ss(n, b_k_major)
    return _wgmma_intrinsic(n, a_in_registers, b_k_major)


def build_wgmma_sync() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(wgmma_fence, wgmma_commit, proxy_fence)`` (module docstring)."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def no_op():
            pass

        return no_op, no_op, no_op
    return (bare_instruction("wgmma.fence.sync.aligned;"), bare_instruction("wgmma.commit_group.sync.aligned;"),
            bare_instruction("fence.proxy.async.shared::cta;"))


def build_wgmma_wait(values: int, pending: int = 0) -> Callable[..., Any]:
    """``wgmma_wait(acc)`` for an accumulator of ``values`` float32 (module docstring): at most
    ``pending`` committed groups left in flight."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def no_wait(acc):
            pass

        return no_wait
    return _wait_intrinsic(values, pending)


def _accumulator_values(context: Any, builder: Any, array_type: Any, array: Any, count: int) -> tuple[Any, list]:
    """In codegen: the accumulator array's data pointer and its ``count`` values, loaded at constant
    indices (so that, inlined, the local array stays in registers)."""
    from llvmlite import ir

    data = context.make_array(array_type)(context, builder, value=array).data
    pointers = [builder.gep(data, [ir.Constant(ir.IntType(32), i)], inbounds=True) for i in range(count)]
    return pointers, [builder.load(pointer) for pointer in pointers]


def _wgmma_intrinsic(n: int, a_in_registers: bool, b_k_major: bool) -> Callable[..., Any]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    values = n // 2
    outputs = ", ".join(f"${i}" for i in range(values))
    tied = ",".join(str(i) for i in range(values))  # each input is the output register of the same index
    trans_b = 0 if b_k_major else 1
    if a_in_registers:
        a = ", ".join(f"${2 * values + i}" for i in range(4))
        b_at, scale_at = 2 * values + 4, 2 * values + 5
        operands = f"{{{a}}}, ${b_at}, p, 1, 1, {trans_b}"
        input_constraints = "r,r,r,r,l,r"
    else:
        b_at, scale_at = 2 * values + 1, 2 * values + 2
        operands = f"${2 * values}, ${b_at}, p, 1, 1, 0, {trans_b}"
        input_constraints = "l,l,r"
    asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${scale_at}, 0; "
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outputs}}}, {operands}; }}")
    constraints = ",".join(["=f"] * values) + "," + tied + "," + input_constraints

    def emit(context: Any, builder: Any, array_type: Any, array: Any, operands_in: list) -> Any:
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        pointers, loaded = _accumulator_values(context, builder, array_type, array, values)
        operand_types = [i32] * 4 + [i64, i32] if a_in_registers else [i64, i64, i32]
        function = ir.FunctionType(ir.LiteralStructType([f32] * values), [f32] * values + operand_types)
        result = builder.asm(function, asm, constraints, loaded + operands_in, side_effect=True)
        for i, pointer in enumerate(pointers):
            builder.store(builder.extract_value(result, i), pointer)
        return context.get_dummy_value()

    if a_in_registers:
        @intrinsic
        def issue_rs(typingctx, acc, a0, a1, a2, a3, b_descriptor, scale_d):
            def codegen(context, builder, signature, args):
                return emit(context, builder, signature.args[0], args[0], list(args[1:]))

            return types.void(acc, types.int32, types.int32, types.int32, types.int32, types.int64, types.int32), codegen

        @cuda.jit(device=True, inline=True)
        def wgmma_rs(acc, a0, a1, a2, a3, b_tile, b_descriptor, accumulate):
            issue_rs(acc, int32(a0), int32(a1), int32(a2), int32(a3), int64(b_descriptor), int32(1 if accumulate else 0))

        return wgmma_rs

    @intrinsic
    def issue_ss(typingctx, acc, a_descriptor, b_descriptor, scale_d):
        def codegen(context, builder, signature, args):
            return emit(context, builder, signature.args[0], args[0], list(args[1:]))

        return types.void(acc, types.int64, types.int64, types.int32), codegen

    @cuda.jit(device=True, inline=True)
    def wgmma_ss(acc, a_tile, a_descriptor, b_tile, b_descriptor, accumulate):
        issue_ss(acc, int64(a_descriptor), int64(b_descriptor), int32(1 if accumulate else 0))

    return wgmma_ss


def _wait_intrinsic(values: int, pending: int) -> Callable[..., Any]:
    """``wgmma_wait(acc)``: wgmma.wait_group with acc's values passed through the same asm statement."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    asm = f"wgmma.wait_group.sync.aligned {int(pending)};"
    constraints = ",".join(["=f"] * values) + "," + ",".join(str(i) for i in range(values)) + ",~{memory}"

    @intrinsic
    def wgmma_wait(typingctx, acc):
        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            pointers, loaded = _accumulator_values(context, builder, signature.args[0], args[0], values)
            function = ir.FunctionType(ir.LiteralStructType([f32] * values), [f32] * values)
            result = builder.asm(function, asm, constraints, loaded, side_effect=True)
            for i, pointer in enumerate(pointers):
                builder.store(builder.extract_value(result, i), pointer)
            return context.get_dummy_value()

        return types.void(acc), codegen

    return wgmma_wait


def _simulated_bf16(tile: Any, byte: int) -> float:
    """The bf16 at byte offset ``byte`` of a 2-D int32 tile, as float64."""
    word = byte // 4
    row, column = divmod(word, tile.shape[1])
    bits = (int(tile[row, column]) >> (16 * ((byte // 2) % 2))) & 0xFFFF
    return float(np.uint32(bits << 16).view(np.float32))


def _decode(descriptor: int) -> tuple[int, int, int, int]:
    """(start, leading, stride, mode) of a descriptor."""
    value = int(np.int64(descriptor).view(np.uint64))
    return ((value & 0x3FFF) << 4, ((value >> 16) & 0x3FFF) << 4, ((value >> 32) & 0x3FFF) << 4, value >> 62)


def _swizzled(byte: int) -> int:
    """The 128-byte swizzle of an address: its 16-byte chunk bits (4-6) XOR its row-in-atom bits (7-9)."""
    return byte ^ (((byte >> 7) & 7) << 4)


def _k_major_byte(start: int, leading: int, stride: int, mode: int, row: int, k: int) -> int:
    if mode == SWIZZLE_MODE_128B:
        return _swizzled(start + (row // 8) * stride + (row % 8) * SWIZZLE_BYTES + k * 2)
    return start + (row // 8) * stride + (row % 8) * CHUNK_BYTES + (k // 8) * leading + (k % 8) * 2


def _mn_major_byte(start: int, leading: int, stride: int, mode: int, k: int, column: int) -> int:
    if mode == SWIZZLE_MODE_128B:
        return _swizzled(start + (column // SWIZZLE_ELEMENTS) * leading + (k // 8) * stride + (k % 8) * SWIZZLE_BYTES
                         + (column % SWIZZLE_ELEMENTS) * 2)
    return start + (column // 8) * stride + (column % 8) * 2 + (k // 8) * leading + (k % 8) * CHUNK_BYTES


def _b_matrix(b_tile: Any, b_descriptor: int, n: int, b_k_major: bool) -> np.ndarray:
    """B [16, n] as float64, read through its descriptor."""
    start, leading, stride, mode = _decode(b_descriptor)
    b = np.zeros((16, n))
    for k in range(16):
        for column in range(n):
            byte = (_k_major_byte(start, leading, stride, mode, column, k) if b_k_major
                    else _mn_major_byte(start, leading, stride, mode, k, column))
            b[k, column] = _simulated_bf16(b_tile, byte)
    return b


def _lane_rows_columns() -> tuple[int, int, int, int]:
    tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
    warp = (tid % WARPGROUP_THREADS) // 32
    lane = tid % 32
    return tid // 32, 16 * warp + lane // 4, lane % 4, lane


def _store(acc: Any, d: np.ndarray, row: int, t: int, n: int, accumulate: bool) -> None:
    """acc (+)= the lane's values of d [64, n] (float64), rounded once to float32."""
    for j in range(n // 8):
        for i, (r, c) in enumerate(((row, 8 * j + 2 * t), (row, 8 * j + 2 * t + 1),
                                    (row + 8, 8 * j + 2 * t), (row + 8, 8 * j + 2 * t + 1))):
            base = float(acc[4 * j + i]) if accumulate else 0.0
            acc[4 * j + i] = float32(base + d[r, c])


def _simulated_ss(n: int, b_k_major: bool) -> Callable[..., Any]:
    @cuda.jit(device=True)
    def wgmma_ss(acc, a_tile, a_descriptor, b_tile, b_descriptor, accumulate):
        _, row, t, _ = _lane_rows_columns()
        start, leading, stride, mode = _decode(a_descriptor)
        a = np.zeros((WARPGROUP_ROWS, 16))
        for r in (row, row + 8):
            for k in range(16):
                a[r, k] = _simulated_bf16(a_tile, _k_major_byte(start, leading, stride, mode, r, k))
        _store(acc, a @ _b_matrix(b_tile, b_descriptor, n, b_k_major), row, t, n, accumulate)

    return wgmma_ss


def _simulated_rs(n: int, b_k_major: bool) -> Callable[..., Any]:
    def halves(word: int) -> tuple[float, float]:
        bits = int(np.int32(word).view(np.uint32))
        return tuple(float(np.uint32((half & 0xFFFF) << 16).view(np.float32)) for half in (bits, bits >> 16))

    @cuda.jit(device=True)
    def wgmma_rs(acc, a0, a1, a2, a3, b_tile, b_descriptor, accumulate):
        fragments = cuda.shared.array((SIM_MAX_WARPS, 32, 4), np.int32)
        warp, row, t, lane = _lane_rows_columns()
        fragments[warp, lane] = (a0, a1, a2, a3)
        cuda.syncthreads()
        g = lane // 4
        a = np.zeros((WARPGROUP_ROWS, 16))
        for quad in range(4):  # lanes 4 g + quad hold row g's and g + 8's columns 2 quad, 2 quad + 1 (+ 8)
            words = fragments[warp, 4 * g + quad]
            a[row, 2 * quad:2 * quad + 2] = halves(words[0])
            a[row + 8, 2 * quad:2 * quad + 2] = halves(words[1])
            a[row, 2 * quad + 8:2 * quad + 10] = halves(words[2])
            a[row + 8, 2 * quad + 8:2 * quad + 10] = halves(words[3])
        cuda.syncthreads()
        _store(acc, a @ _b_matrix(b_tile, b_descriptor, n, b_k_major), row, t, n, accumulate)

    return wgmma_rs
