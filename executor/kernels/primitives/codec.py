"""Storage codecs: how a kernel reads and writes one element as float32.

Kernels are written once against a codec's ``load``/``store`` device functions
and built per codec (``build_*(codec)``). Two codecs exist:

- ``F32``: float32 storage, the identity.
- ``BF16``: bfloat16 storage seen as int16 bits. Loads widen the bits into a
  float32; stores round to nearest even. Bit-exact with torch's casts, cacheable,
  and the simulator runs the very same arithmetic on numpy int16 arrays
  (numba's bf16 type exists on neither path we need).

On the GPU, ``store`` is the hardware's own round-to-nearest-even conversion
(PTX ``cvt.rn.bf16.f32``, sm_80 and later: one instruction where the integer
rounding takes eight, and bf16 row kernels that round every product, such as
q/k norm + RoPE, are bound by those instructions rather than by memory). The
simulator cannot run PTX, so there ``store`` is the same rounding in integer
arithmetic on the float's bits; the two agree on every finite value and on
infinities (tests/kernels/test_codec.py compares them on the GPU). The raw bit
casts differ too: libdevice on the GPU, numpy scalar views in the simulator
(whose libdevice functions are stubs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int16, int32  # noqa: E402  (after load_cuda's numpy fix)


def _bit_casts() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return (int32 bits -> float32, float32 -> int32 bits) device functions."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def int_as_float(bits):
            return np.int32(bits).view(np.float32)

        @cuda.jit(device=True)
        def float_as_int(value):
            return np.float32(value).view(np.int32)

        return int_as_float, float_as_int

    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def int_as_float(bits):
        return libdevice.int_as_float(bits)

    @cuda.jit(device=True, inline=True)
    def float_as_int(value):
        return libdevice.float_as_int(value)

    return int_as_float, float_as_int


@dataclass(frozen=True)
class Codec:
    """A storage format: ``load(x) -> float32`` and ``store(f) -> element``."""

    name: str
    torch_dtype_name: str  # "float32" | "bfloat16": the logical dtype of the data
    storage_numpy_dtype: Any  # what the kernel's array holds (np.float32 | np.int16)
    load: Callable[..., Any]
    store: Callable[..., Any]


def _build_f32() -> Codec:
    @cuda.jit(device=True, inline=True)
    def load(x):
        return float32(x)

    @cuda.jit(device=True, inline=True)
    def store(value):
        return float32(value)

    return Codec("f32", "float32", np.float32, load, store)


def _integer_bf16_store(float_as_int: Callable[..., Any]) -> Callable[..., Any]:
    """``store`` for the simulator: round to nearest even on the 16 dropped bits of the float's bits."""

    @cuda.jit(device=True, inline=True)
    def store(value):
        bits = int32(float_as_int(float32(value)))
        # NaN never reaches here (the GPU's cvt would give the canonical NaN).
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        if rounded >= 0x8000:
            rounded -= 0x10000
        return int16(rounded)

    return store


def _hardware_bf16_store() -> Callable[..., Any]:
    """``store`` on the GPU: PTX ``cvt.rn.bf16.f32`` (round to nearest even), its 16 bits as an int16."""
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cvt_rn_bf16(typingctx, value):
        if value != types.float32:
            raise TypingError(f"cvt_rn_bf16 takes a float32, got {value}")

        def codegen(context, builder, signature, args):
            convert = ir.FunctionType(ir.IntType(16), [ir.FloatType()])
            return builder.asm(convert, "cvt.rn.bf16.f32 $0, $1;", "=h,f", [args[0]], side_effect=False)

        return types.int16(types.float32), codegen

    @cuda.jit(device=True, inline=True)
    def store(value):
        return cvt_rn_bf16(float32(value))

    return store


def _build_bf16() -> Codec:
    int_as_float, float_as_int = _bit_casts()

    @cuda.jit(device=True, inline=True)
    def load(bits):
        return int_as_float(int32((int32(bits) & 0xFFFF) << 16))

    store = _integer_bf16_store(float_as_int) if simulator_enabled() else _hardware_bf16_store()
    return Codec("bf16", "bfloat16", np.int16, load, store)


def build_codec(dtype_name: str) -> Codec:
    """The codec for a plan dtype name: "float32" or "bfloat16"."""
    if dtype_name == "float32":
        return _build_f32()
    if dtype_name == "bfloat16":
        return _build_bf16()
    raise ValueError(f"no kernel codec for dtype {dtype_name!r}; supported: float32, bfloat16")
