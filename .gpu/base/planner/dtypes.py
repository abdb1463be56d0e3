"""Element sizes of the dtypes a plan may name."""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal

#: Dtypes of weights and activations a model may be served in.
ActivationDtype = Literal["bfloat16", "float16", "float32"]

#: Bytes per element, for every dtype a planned buffer can have.
DTYPE_BYTES = MappingProxyType(
    {
        "bfloat16": 2,
        "float16": 2,
        "float32": 4,
        "int32": 4,
        "uint32": 4,
        "int64": 8,
        "uint8": 1,
    }
)


def dtype_bytes(dtype: str) -> int:
    """Size of one element of ``dtype`` in bytes."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None
