"""Checked integer arithmetic with declared widths.

Every element and byte count of a plan goes through these functions. Python's
integers never wrap, so "checked" means: each intermediate result is compared
with the bounds of the width the quantity will have where it is used (u64 for
byte counts, i32 for anything a kernel indexes with), and a result outside them
raises ``CheckedOverflowError`` naming the quantity, the operation, its
operands and the width.
"""

from __future__ import annotations

from enum import Enum


class Width(Enum):
    """An integer width: name, inclusive minimum, inclusive maximum."""

    I32 = ("i32", -(2**31), 2**31 - 1)
    U32 = ("u32", 0, 2**32 - 1)
    I64 = ("i64", -(2**63), 2**63 - 1)
    U64 = ("u64", 0, 2**64 - 1)

    def __init__(self, label: str, low: int, high: int):
        # Plain attributes, not properties over .value: every count of a plan reads them.
        self.label, self.min, self.max = label, low, high


I32, U32, I64, U64 = Width.I32, Width.U32, Width.I64, Width.U64


class CheckedOverflowError(ValueError):
    """An integer quantity left the range of its declared width."""

    def __init__(self, quantity: str, operation: str, operands: tuple[int, ...], result: int, width: Width):
        self.quantity = quantity
        self.operation = operation
        self.operands = operands
        self.result = result
        self.width = width
        shown = ", ".join(f"{x:,}" for x in operands)
        super().__init__(
            f"{quantity} overflows {width.label}: {operation}({shown}) = {result:,}, "
            f"allowed {width.min:,}..{width.max:,}"
        )


def fit(quantity: str, value: int, width: Width = U64) -> int:
    """Return ``value`` if it lies in ``width``; raise naming ``quantity`` otherwise."""
    return _check(quantity, "value", (value,), value, width)


def add(quantity: str, *terms: int, width: Width = U64) -> int:
    """Sum of ``terms``; every partial sum is checked against ``width``."""
    total = 0
    for term in terms:
        fit(quantity, term, width)
        total = _check(quantity, "add", terms, total + term, width)
    return total


def mul(quantity: str, *factors: int, width: Width = U64) -> int:
    """Product of ``factors``; every partial product is checked against ``width``."""
    product = 1
    for factor in factors:
        fit(quantity, factor, width)
        product = _check(quantity, "mul", factors, product * factor, width)
    return product


def sub(quantity: str, minuend: int, subtrahend: int, width: Width = U64) -> int:
    """``minuend - subtrahend``, checked (a negative result fails an unsigned width)."""
    return _check(quantity, "sub", (minuend, subtrahend), minuend - subtrahend, width)


def floordiv(quantity: str, dividend: int, divisor: int, width: Width = U64) -> int:
    """``dividend // divisor`` for a positive divisor."""
    if divisor <= 0:
        raise ValueError(f"{quantity}: divisor must be positive, got {divisor}")
    return _check(quantity, "floordiv", (dividend, divisor), dividend // divisor, width)


def ceil_div(quantity: str, dividend: int, divisor: int, width: Width = U64) -> int:
    """Smallest integer >= dividend / divisor, for a non-negative dividend and positive divisor."""
    if divisor <= 0:
        raise ValueError(f"{quantity}: divisor must be positive, got {divisor}")
    return _check(quantity, "ceil_div", (dividend, divisor), -(-dividend // divisor), width)


def align_up(quantity: str, value: int, alignment: int, width: Width = U64) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return mul(quantity, ceil_div(quantity, value, alignment, width), alignment, width=width)


def _check(quantity: str, operation: str, operands: tuple[int, ...], result: int, width: Width) -> int:
    if not width.min <= result <= width.max:
        raise CheckedOverflowError(quantity, operation, operands, result, width)
    return result
