"""How a block's projections meet the residual stream: two backends behind one interface.

A block (blocks.py) calls three projections and knows nothing else of the stream:

- ``normed(step, weight, out)``: ``out = RMSNorm(hidden) @ weight^T``, the block's first projection;
- ``swiglu(step, gate_up_weight, act)``: the MLP's ``act = silu(normed @ gate^T) * (normed @ up^T)``;
- ``residual(step, x, weight)``: the block's last projection, ``x @ weight^T``, added to ``hidden``.

``GemmProjections`` (any step): cuBLAS GEMMs. The decoder's add + RMSNorm kernel between blocks
adds ``proj_out`` into ``hidden`` and writes ``normed``, so ``normed`` reads that buffer and
``residual`` leaves its product in ``proj_out``. ``GemvProjections`` (decode steps of at most the
plan's ``decode_gemv_batch`` requests): the fused GEMV kernels of executor/kernels/gemv.py, which
normalize ``hidden`` themselves and add into it, so nothing runs between blocks. The decoder runs
a step with one backend's layers throughout (decoder.py).

With tensor parallelism (``parallel``, executor/parallel.py) the last projection is row-parallel:
each rank's product is a partial sum over its input columns, and the block's output is their sum
over the ranks. GEMM: ``proj_out`` is all-reduced in place before the decoder adds it. GEMV, which
adds into ``hidden`` itself: rank 0 adds its partial into ``hidden``, every other rank writes its
partial over a zeroed ``hidden``, and ``hidden`` is all-reduced in place, giving every rank the old
stream plus the whole sum.
"""

from __future__ import annotations

import torch

from executor.models.context import StepViews
from executor.models.launchers import Kernels, NormStyle
from executor.parallel import TensorParallel


def gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, m] = x[n, k] @ weight[m, k]^T, into a planned view."""
    torch.matmul(x, weight.t(), out=out)


class GemmProjections:
    """cuBLAS GEMMs on ``normed``; the block's output stays in ``proj_out`` for the decoder's add."""

    def __init__(self, kernels: Kernels, parallel: TensorParallel | None = None):
        self.kernels, self.parallel = kernels, parallel

    def normed(self, step: StepViews, weight: torch.Tensor, out: torch.Tensor) -> None:
        gemm(step.role("normed"), weight, out)

    def swiglu(self, step: StepViews, gate_up_weight: torch.Tensor, act: torch.Tensor) -> None:
        gate_up = step.role("gate_up")
        gemm(step.role("normed"), gate_up_weight, gate_up)
        self.kernels.silu_mul(gate_up, act, stream=step.stream)

    def residual(self, step: StepViews, x: torch.Tensor, weight: torch.Tensor) -> None:
        proj_out = step.role("proj_out")
        gemm(x, weight, proj_out)
        if self.parallel is not None:
            self.parallel.all_reduce_(proj_out)


class GemvProjections:
    """Fused GEMVs: normalize ``hidden`` with this block's norm weight, add the output into ``hidden``."""

    def __init__(self, kernels: Kernels, norm_weight: torch.Tensor, norm: NormStyle, eps: float,
                 parallel: TensorParallel | None = None):
        self.gemv, self.norm_weight = kernels.gemv, norm_weight
        self.weight_offset, self.eps = norm.weight_offset, eps
        self.parallel = parallel

    def normed(self, step: StepViews, weight: torch.Tensor, out: torch.Tensor) -> None:
        self.gemv.norm_project(step.role("hidden"), self.norm_weight, self.eps, self.weight_offset, weight, out,
                               stream=step.stream)

    def swiglu(self, step: StepViews, gate_up_weight: torch.Tensor, act: torch.Tensor) -> None:
        self.gemv.norm_swiglu(step.role("hidden"), self.norm_weight, self.eps, self.weight_offset, gate_up_weight,
                              act, stream=step.stream)

    def residual(self, step: StepViews, x: torch.Tensor, weight: torch.Tensor) -> None:
        hidden = step.role("hidden")
        if self.parallel is not None and not self.parallel.is_driver:
            hidden.zero_()  # this rank adds only its partial sum; rank 0 keeps the stream (module docstring)
        self.gemv.project_add(x, weight, hidden, stream=step.stream)
        if self.parallel is not None:
            self.parallel.all_reduce_(hidden)


Projections = GemmProjections | GemvProjections

