"""Kernel storage formats in tests: tensors <-> storage arrays, poison, tolerances, closeness.

Kernels see float32 data as float32 arrays and bfloat16 data as its bits in int16
arrays. Every helper names the logical dtype as the codecs do ("float32" or
"bfloat16", what ``build_codec`` takes).
"""

from __future__ import annotations

import numpy as np
import torch

DTYPES = ["float32", "bfloat16"]
TOL = {"float32": 1e-5, "bfloat16": 1e-2}  # max abs error / max abs reference against float64
#: pytest filter for the simulator's float32 cast of exp(100) (inf on the GPU too), which numpy warns about.
OVERFLOW_WARNING = "ignore:overflow encountered in cast:RuntimeWarning"
BF16_NAN_BITS = 0x7FC0  # a quiet bf16 NaN


def to_storage(t: torch.Tensor, dtype_name: str) -> np.ndarray:
    """A CPU tensor as the kernel's storage array (float32, or bf16 bits as int16)."""
    if dtype_name == "float32":
        return t.to(torch.float32).numpy().copy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().copy()


def from_storage(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """The kernel's storage array back as a float64 tensor of its logical values."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype_name == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.to(torch.float64)


def rounded(t: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """t's values as the storage dtype holds them, in float64."""
    return t.to(getattr(torch, dtype_name)).double()


def poisoned(shape: tuple[int, ...], dtype_name: str) -> np.ndarray:
    """A storage array of NaNs: what a kernel leaves unwritten stays NaN."""
    if dtype_name == "float32":
        return np.full(shape, np.nan, dtype=np.float32)
    return np.full(shape, BF16_NAN_BITS, dtype=np.int16)


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert torch.isfinite(got).all(), "an output element was not written (poison left)"
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err <= rel, f"max abs err / max abs ref = {err:.3g} > {rel}"


def assert_bf16_close(
    got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None, exact: float = 0.97
) -> None:
    """Within two bf16 ulps of scale (default |ref|) everywhere, and equal to ref on a fraction >= exact.

    ref is torch or HF in bf16: its exp, reduction order or cos/sin roundings differ from the
    kernel's by an ulp here and there, and an ulp of an intermediate (a norm's inv_rms from another
    summation order) that passes through a second rounding (normed, then times the weight) can land
    two ulps apart: measured on the H200 at real sizes, up to 1.74 x |ref| x 2^-7 on 73 of 67M
    elements. A cancelling sum (RoPE) passes the size of its terms as scale.
    """
    assert torch.isfinite(got).all(), "an output element was not written (poison left)"
    ref = ref.double()
    scale = ref.abs().clamp_min(1e-30) if scale is None else scale.double()
    assert ((got - ref).abs() <= scale * 2.0**-6).all()
    assert (got == ref).double().mean().item() >= exact
