"""Warm L2 with a byte range ahead of the kernel that will read it (``cp.async.bulk.prefetch.L2``, sm_90).

A batch-1 decode layer alternates two kinds of kernel. The projections stream their weights and
keep HBM busy; between the first and the last projection of a block sit kernels that move a few
megabytes at most (q/k norm + RoPE, paged attention and its merge; Qwen3.5's conv and delta rule)
and are bound by latency, so HBM idles for ~20 us a layer. Prefetching the block's last projection
weight into L2 during that gap lets the projection read L2 instead of HBM. Run on a side stream,
the prefetch only reads weights, so it cannot change any result.

    prefetch_l2(data uint8 [n], chunk_bytes int32)

Thread i asks for chunks i, i + threads, ... of ``chunk_bytes`` bytes (the last one shorter): one
``cp.async.bulk.prefetch.L2.global`` each, a fire-and-forget hint the TMA unit turns into L2 line
fills (no registers held, nothing to wait for). ``data`` must start 16-byte aligned and ``n`` be a
multiple of 16 (the launcher checks): the instruction's contract. The simulator has no cache: there
the kernel only walks its chunks.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from executor.kernels.launch import Kernel, multiprocessor_count
from executor.kernels.vector import element_pointer
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import int32, types  # noqa: E402  (after load_cuda's numpy fix)

#: Bytes one prefetch instruction asks for; 32 KiB keeps a 34 MB weight to ~1000 instructions.
CHUNK_BYTES = 32 << 10
#: Threads a block: one warp, so the prefetch takes little room beside the kernels it overlaps.
THREADS = 32
#: The instruction's alignment and size granule.
PREFETCH_ALIGN_BYTES = 16


def build_prefetch_kernel() -> Callable[..., Any]:
    """The ``prefetch_l2`` kernel (module docstring)."""
    prefetch = _simulated_prefetch() if simulator_enabled() else _prefetch_intrinsic()

    @cuda.jit
    def prefetch_l2(data, chunk_bytes):
        n = data.shape[0]
        stride = cuda.gridDim.x * cuda.blockDim.x * chunk_bytes
        start = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * chunk_bytes
        for first in range(start, n, stride):
            prefetch(data, first, int32(min(chunk_bytes, n - first)))

    return prefetch_l2


def _simulated_prefetch() -> Callable[..., Any]:
    @cuda.jit(device=True)
    def prefetch(data, first, num_bytes):
        pass

    return prefetch


def _prefetch_intrinsic() -> Callable[..., Any]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    # The pointer is generic; the instruction wants a global-window address.
    asm = "{ .reg .u64 from; cvta.to.global.u64 from, $0; cp.async.bulk.prefetch.L2.global [from], $1; }"

    @intrinsic
    def prefetch(typingctx, data, first, num_bytes):
        def codegen(context, builder, signature, args):
            data_type, first_type, _ = signature.args
            index_type = types.UniTuple(first_type, 1)
            index = context.make_tuple(builder, index_type, [args[1]])
            source = element_pointer(context, builder, data_type, args[0], index_type, index)
            function = ir.FunctionType(ir.VoidType(), [source.type, ir.IntType(32)])
            builder.asm(function, asm, "l,r,~{memory}", [source, args[2]], side_effect=True)
            return context.get_dummy_value()

        return types.void(data, first, types.int32), codegen

    return prefetch


class L2Prefetch:
    """Launcher: prefetch a byte range of device memory into L2 (module docstring)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.kernel = Kernel(build_prefetch_kernel())
        self.max_blocks = multiprocessor_count()

    @staticmethod
    def check(data: Any, name: str) -> None:
        """Raise ValueError unless ``data`` (uint8 [n]) is one the instruction takes: contiguous,
        16-byte aligned, n a multiple of 16. Callers check once, where they make the view."""
        if data.dim() != 1 or data.element_size() != 1 or not data.is_contiguous():
            raise ValueError(f"L2 prefetch of {name}: needs a contiguous uint8 [n] view, got {data.dtype} "
                             f"{tuple(data.shape)}")
        if data.data_ptr() % PREFETCH_ALIGN_BYTES or data.shape[0] % PREFETCH_ALIGN_BYTES:
            raise ValueError(f"L2 prefetch of {name}: address {data.data_ptr():#x} and size {data.shape[0]} bytes "
                             f"must be multiples of {PREFETCH_ALIGN_BYTES}")

    def __call__(self, data: Any, stream: Any = 0) -> None:
        """Prefetch ``data`` (uint8 [n], as ``check`` allows) into L2 on ``stream``."""
        threads_wanted = -(-data.shape[0] // self.chunk_bytes)
        blocks = max(1, min(-(-threads_wanted // THREADS), self.max_blocks))
        self.kernel[blocks, THREADS, stream](data, np.int32(self.chunk_bytes))
