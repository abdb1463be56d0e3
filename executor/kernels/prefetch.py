"""An L2 prefetch hint for the cache line holding one array element (``prefetch.global.L2``).

A kernel that streams memory keeps as many bytes in flight as its registers can receive: a load
holds its destination registers until the data lands. A prefetch names an address and holds
nothing, so a kernel can ask for the rows it will load a batch from now while it waits on this
batch's loads; when it issues those loads they find their lines in L2 and return in L2 latency.

    prefetch_line(array, index)
        hint that the 128-byte line holding ``array[index]`` (a tuple index into a global array)
        is read soon. No effect on any value; the simulator has no cache and does nothing.
"""

from __future__ import annotations

from typing import Any, Callable

from executor.kernels.vector import element_pointer
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import types  # noqa: E402  (after load_cuda's numpy fix)


def build_prefetch_line() -> Callable[..., Any]:
    """``prefetch_line(array, index)`` (module docstring)."""
    if simulator_enabled():
        @cuda.jit(device=True, inline=True)
        def no_prefetch(array, index):
            pass

        return no_prefetch
    return _prefetch_intrinsic()


def _prefetch_intrinsic() -> Callable[..., Any]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    # The element pointer is generic; the instruction wants a global-window address.
    asm = "{ .reg .u64 line; cvta.to.global.u64 line, $0; prefetch.global.L2 [line]; }"

    @intrinsic
    def prefetch_line(typingctx, array, index):
        def codegen(context, builder, signature, args):
            pointer = element_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            builder.asm(ir.FunctionType(ir.VoidType(), [pointer.type]), asm, "l", [pointer], side_effect=True)
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch_line
