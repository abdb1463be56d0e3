"""Argmax's tie rule as device functions, shared by the sampler and the test-only argmax kernel.

torch.argmax's rule: the first (lowest) index of the maximum wins, and a NaN counts as larger than
every number (the first NaN wins), so a poisoned row shows up instead of a plausible token.
"""

from __future__ import annotations

from executor.numba_cuda import load_cuda

cuda = load_cuda()


@cuda.jit(device=True, inline=True)
def beats(value, index, best_value, best_index):
    """True when candidate ``(value, index)`` replaces ``(best_value, best_index)`` under argmax's rule."""
    if value != value:  # NaN: the maximum; among NaNs the lowest index
        return best_value == best_value or index < best_index
    if best_value != best_value:
        return False
    return value > best_value or (value == best_value and index < best_index)


@cuda.jit(device=True, inline=True)
def better(value, index, best_value, best_index):
    """The winner of a candidate and the current best, as ``(value, index)``."""
    if beats(value, index, best_value, best_index):
        return value, index
    return best_value, best_index
