"""Asynchronous 16-byte copies from global into shared memory (``cp.async``, sm_80+).

A kernel that stages tiles in shared memory with plain loads holds each chunk in registers
between its load and its store, and waits for the load before the store can issue. With
``cp.async`` the copy engine moves the bytes while the warp goes on computing, so a tile for
the next step lands while the current one is in use:

    shared_address(tile, index) -> uint32
        the shared-memory address of tile[index] (0 in the simulator). A kernel takes its
        tile's address once; the copies (and mma.py's fragment loads) then add constant
        offsets in 32-bit arithmetic instead of converting a 64-bit pointer each time.
    copy_async(tile, tile_address, dst_index, src, src_index, valid)
        starts copying the 16 bytes from src[src_index] on (any element type: int32 words, the
        codec's int16 bf16 bits or float32) to tile[dst_index] in shared memory (tile 2-D, of the
        words the bytes make; tile_address = shared_address(tile, (0, 0))); when ``valid`` is
        false it writes 16 zero bytes and reads nothing (src_index must still name an element
        of src).
    copy_async_wait_all()
        waits until this thread's copies have landed. Other threads' copies are visible
        after a barrier (``cuda.syncthreads()``, or ``syncwarp`` among one warp's threads)
        that follows every thread's wait.

A pipeline that keeps several tiles in flight numbers its copies by group instead
(``build_copy_groups(pending)``):

    commit_group()
        closes this thread's copies issued since the last commit into one group.
    wait_groups()
        waits until at most ``pending`` of this thread's groups (the newest) are still in flight.

A loop that stages rows of one contiguous-row source each round takes a cursor once instead
(``build_row_copy(row_bytes)``), so a round's copies cost one multiply-add each and hold no
per-copy address across the loop:
    row_cursor(src, index) -> cursor
        src[index]'s place (on the GPU its global-window address, uint64).
    copy_row_async(tile, tile_address, dst_index, src, cursor, row, valid)
        copy_async of the 16 bytes ``row`` rows past the cursor (row_bytes apart; row >= 0 and
        a row of src even when ``valid`` is false, which reads nothing).
    fresh_address(tile_address) -> uint32
        the same address, opaque to the compiler: taken inside a loop it keeps the per-copy
        shared offsets in the loop (immediates of the copies) instead of in registers across it.

A kernel that copies several 16-byte chunks of one row of a strided source (a paged cache's
[page, slot, head, :] row) takes that row's cursor once (``build_chunk_copy()``): each chunk is then
an add to the cursor, where indexing the source computes every chunk's whole offset from its
strides:
    chunk_cursor(src, index) -> cursor
        src[index]'s place; src's last axis is contiguous.
    copy_chunk_async(tile, tile_address, dst_index, src, cursor, chunk, valid)
        copy_async of the 16 bytes ``chunk`` chunks past the cursor along src's last axis.

Both ends must be 16-byte aligned. On the GPU these are PTX through llvmlite inline asm
(``cp.async.cg.shared.global`` with a source size of 16 or 0, and ``cp.async.wait_all``).
The simulator copies at once, and waiting is a no-op there.
"""

from __future__ import annotations

from typing import Any, Callable

from executor.kernels.primitives.vector import build_vector_access, element_pointer
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import types, uint32  # noqa: E402  (after load_cuda's numpy fix)

CHUNK_WORDS = 4


def build_shared_address() -> Callable[..., Any]:
    """``shared_address(tile, index) -> uint32`` (module docstring)."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def no_address(tile, index):
            return uint32(0)

        return no_address
    return _shared_address_intrinsic()


def build_async_copy() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(copy_async, copy_async_wait_all)`` device functions (module docstring)."""
    if simulator_enabled():
        return _simulated()
    return _intrinsics()


def build_row_copy(row_bytes: int) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(row_cursor, copy_row_async, fresh_address)`` for a source whose rows lie ``row_bytes``
    apart (module docstring)."""
    if simulator_enabled():
        return _simulated_rows()
    return _row_intrinsics(row_bytes)


def build_chunk_copy() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(chunk_cursor, copy_chunk_async)`` (module docstring)."""
    if simulator_enabled():
        return _simulated_chunks()
    row_cursor, copy_row_async, _ = _row_intrinsics(4 * CHUNK_WORDS)  # a chunk is a 16-byte "row"
    return row_cursor, copy_row_async


def build_copy_groups(pending: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(commit_group, wait_groups)`` (module docstring); ``wait_groups`` leaves at most ``pending``
    groups in flight (a compile-time immediate in PTX). No-ops in the simulator."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def no_op():
            pass

        return no_op, no_op
    return bare_instruction("cp.async.commit_group;"), bare_instruction(f"cp.async.wait_group {int(pending)};")


def _simulated() -> tuple[Callable[..., Any], Callable[..., Any]]:
    load_vector = build_vector_access()[0]  # the same bytes, from any element type, alignment checked

    @cuda.jit(device=True)
    def copy_async(tile, tile_address, dst_index, src, src_index, valid):
        row, word = dst_index
        words = cuda.local.array(CHUNK_WORDS, tile.dtype)
        for w in range(CHUNK_WORDS):
            words[w] = 0
        if valid:
            load_vector(src, src_index, words, 0)
        for w in range(CHUNK_WORDS):
            tile[row, word + w] = words[w]

    @cuda.jit(device=True)
    def copy_async_wait_all():
        pass

    return copy_async, copy_async_wait_all


def _simulated_cursor(advance: Callable[..., tuple]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A simulated (cursor, copy) pair: the cursor is the index itself, and ``advance(index, step, src)``
    is the index ``step`` rows (or chunks) past it."""
    copy_async = _simulated()[0]

    @cuda.jit(device=True)
    def cursor_of(src, index):
        return index

    @cuda.jit(device=True)
    def copy_at(tile, tile_address, dst_index, src, cursor, step, valid):
        copy_async(tile, tile_address, dst_index, src, advance(cursor, step, src), valid)

    return cursor_of, copy_at


def _simulated_rows() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    row_cursor, copy_row_async = _simulated_cursor(lambda index, row, src: (index[0], index[1] + row, index[2]))

    @cuda.jit(device=True)
    def fresh_address(tile_address):
        return tile_address

    return row_cursor, copy_row_async, fresh_address


def _simulated_chunks() -> tuple[Callable[..., Any], Callable[..., Any]]:
    return _simulated_cursor(
        lambda index, chunk, src: index[:-1] + (index[-1] + chunk * (4 * CHUNK_WORDS // src.dtype.itemsize),))


def _row_intrinsics(row_bytes: int) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def row_cursor(typingctx, src, index):
        def codegen(context, builder, signature, args):
            pointer = element_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            function = ir.FunctionType(ir.IntType(64), [pointer.type])
            return builder.asm(function, "cvta.to.global.u64 $0, $1;", "=l,l", [pointer], side_effect=False)

        return types.uint64(src, index), codegen

    @intrinsic
    def copy_row(typingctx, to, cursor, row, valid):
        def codegen(context, builder, signature, args):
            to_value, cursor_value, row_value, valid_value = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            row64 = context.cast(builder, row_value, signature.args[2], types.int64)
            source = builder.add(cursor_value, builder.mul(row64, i64(row_bytes)))
            source_bytes = builder.select(valid_value, i32(4 * CHUNK_WORDS), i32(0))
            function = ir.FunctionType(ir.VoidType(), [i32, i64, i32])
            builder.asm(function, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                        [to_value, source, source_bytes], side_effect=True)
            return context.get_dummy_value()

        return types.void(types.uint32, types.uint64, row, types.boolean), codegen

    @intrinsic
    def fresh_address(typingctx, address):
        def codegen(context, builder, signature, args):
            function = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            # Volatile, so the compiler can neither hoist it out of a loop nor reuse an earlier value.
            return builder.asm(function, "mov.u32 $0, $1;", "=r,r", [args[0]], side_effect=True)

        return types.uint32(types.uint32), codegen

    @cuda.jit(device=True, inline=True)
    def copy_row_async(tile, tile_address, dst_index, src, cursor, row, valid):
        dst_row, word = dst_index
        copy_row(tile_address + uint32(4 * (dst_row * tile.shape[1] + word)), cursor, row, valid)

    return row_cursor, copy_row_async, fresh_address


def _shared_address_intrinsic() -> Callable[..., Any]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shared_address(typingctx, tile, index):
        def codegen(context, builder, signature, args):
            pointer = element_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            function = ir.FunctionType(ir.IntType(32), [pointer.type])
            # The tile's data pointer is generic: convert it to the shared window's 32-bit address.
            return builder.asm(function, "{ .reg .u64 window; cvta.to.shared.u64 window, $1; cvt.u32.u64 $0, window; }",
                               "=r,l", [pointer], side_effect=False)

        return types.uint32(tile, index), codegen

    return shared_address


def bare_instruction(asm: str) -> Callable[..., Any]:
    """A device function issuing one operand-less PTX instruction (a memory clobber: loads and
    stores do not move across it)."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def instruction(typingctx):
        def codegen(context, builder, signature, args):
            builder.asm(ir.FunctionType(ir.VoidType(), []), asm, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return types.void(), codegen

    return instruction


def _intrinsics() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    # The source pointer is generic; cp.async wants a global-window address.
    copy_asm = "{ .reg .u64 from; cvta.to.global.u64 from, $1; cp.async.cg.shared.global [$0], [from], 16, $2; }"

    @intrinsic
    def copy_to_shared(typingctx, to, src, src_index, valid):
        def codegen(context, builder, signature, args):
            _, src_type, src_index_type, _ = signature.args
            to_value, src_value, src_index_value, valid_value = args
            source = element_pointer(context, builder, src_type, src_value, src_index_type, src_index_value)
            i32 = ir.IntType(32)
            source_bytes = builder.select(valid_value, i32(4 * CHUNK_WORDS), i32(0))
            function = ir.FunctionType(ir.VoidType(), [i32, source.type, i32])
            builder.asm(function, copy_asm, "r,l,r,~{memory}", [to_value, source, source_bytes], side_effect=True)
            return context.get_dummy_value()

        return types.void(types.uint32, src, src_index, types.boolean), codegen

    @cuda.jit(device=True, inline=True)
    def copy_async(tile, tile_address, dst_index, src, src_index, valid):
        row, word = dst_index
        copy_to_shared(tile_address + uint32(4 * (row * tile.shape[1] + word)), src, src_index, valid)

    return copy_async, bare_instruction("cp.async.wait_all;")
