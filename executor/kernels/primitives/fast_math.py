"""The softmax exponent as two instructions: ``exp2_scaled(x, scale, bias) = 2^(x * scale - bias)``.

Numba compiles ``math.exp2(x * scale - bias)`` to a multiply, a subtract (it does not contract
them into an FMA) and ``ex2.approx.f32``, whose denormal handling adds compare-and-scale
instructions around the MUFU op in SASS. In a tensor-core attention loop those instructions,
issued for every score, compete for issue slots with the MMAs. On the GPU this is PTX through
llvmlite inline asm:

    fma.rn.f32 t, x, scale, -bias;  ex2.approx.ftz.f32 result, t;

``.ftz`` flushes results below 2^-126 to zero: a probability that small adds nothing to a float32
row sum of at least 1 (the row maximum's own term). The simulator computes ``math.exp2`` of the
same expression in float32.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, types  # noqa: E402  (after load_cuda's numpy fix)


def build_exp2_scaled() -> Callable[..., Any]:
    """Device function ``exp2_scaled(x f32, scale f32, bias f32) -> f32``: 2^(x * scale - bias)."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def simulated_exp2_scaled(x, scale, bias):
            return float32(math.exp2(float32(x * scale) - bias))

        return simulated_exp2_scaled

    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def exp2_scaled(typingctx, x, scale, bias):
        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            function = ir.FunctionType(f32, [f32, f32, f32])
            asm = "{ .reg .f32 t; neg.f32 t, $3; fma.rn.f32 t, $1, $2, t; ex2.approx.ftz.f32 $0, t; }"
            return builder.asm(function, asm, "=f,f,f,f", list(args), side_effect=False)

        return types.float32(types.float32, types.float32, types.float32), codegen

    return exp2_scaled
