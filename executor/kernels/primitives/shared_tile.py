"""2-D tiles carved out of a kernel's dynamic shared memory.

Static shared arrays stop at 48 KiB a block (PTX's limit); past it a kernel must take its
tiles from the dynamic shared array (``cuda.shared.array(0, dtype)``), which Numba gives
only as one 1-D array. ``build_shared_tile(rows, words)`` returns

    shared_tile(dynamic, offset) -> [rows, words] C-contiguous view of dynamic[offset:]

so that a tile in dynamic memory indexes, stages (async_copy.py) and feeds ``ldmatrix``
(mma.py) exactly like a static 2-D tile. ``offset`` counts elements of ``dynamic``; the view
starts 16-byte aligned when the dynamic array is declared with ``alignment=16`` and
``offset`` is a multiple of 16 bytes.

Numba's own ``reshape`` would do it, but on the GPU it calls a runtime helper through local
memory on every use; here the view's shape and strides are constants, so indexing it costs
what indexing a static tile costs. The simulator slices and reshapes the numpy array.
"""

from __future__ import annotations

from typing import Any, Callable

from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import types  # noqa: E402  (after load_cuda's numpy fix)


def build_shared_tile(rows: int, words: int) -> Callable[..., Any]:
    """Device function ``shared_tile(dynamic 1-D shared array, offset int) -> [rows, words] view``."""
    if simulator_enabled():
        size = rows * words

        @cuda.jit(device=True)
        def simulated_shared_tile(dynamic, offset):
            return dynamic[offset:offset + size].reshape((rows, words))

        return simulated_shared_tile
    return _tile_intrinsic(rows, words)


def _tile_intrinsic(rows: int, words: int) -> Callable[..., Any]:
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shared_tile(typingctx, dynamic, offset):
        result = types.Array(dynamic.dtype, 2, "C")

        def codegen(context, builder, signature, args):
            dynamic_type, offset_type = signature.args
            base = context.make_array(dynamic_type)(context, builder, args[0])
            start = context.cast(builder, args[1], offset_type, types.intp)
            intp = context.get_value_type(types.intp)
            itemsize = context.get_abi_sizeof(context.get_data_type(dynamic_type.dtype))
            view = context.make_array(result)(context, builder)
            context.populate_array(view, data=builder.gep(base.data, [start], inbounds=True),
                                   shape=[intp(rows), intp(words)], strides=[intp(words * itemsize), intp(itemsize)],
                                   itemsize=intp(itemsize), meminfo=None)
            return view._getvalue()

        return result(dynamic, offset), codegen

    return shared_tile
