"""The one place that imports numba.cuda.

numba-cuda 0.30.4 registers an overload for ``np.row_stack`` when its array
module loads, and numpy 2.5 removed that function, so the first kernel compile
fails (upstream won't fix it). Aliasing the name to ``np.vstack`` before
numba.cuda loads restores it; every executor module gets numba.cuda from here.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np


def load_cuda() -> ModuleType:
    """Return ``numba.cuda``, made importable and compilable under numpy >= 2.5."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack  # numpy 2.5 removed it; numba-cuda 0.30.4 still touches it
    from numba import cuda

    return cuda


def simulator_enabled() -> bool:
    """True when kernels run in the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def launch_bounds(bounds: int | tuple[int, int] | None) -> dict[str, int | tuple[int, int]]:
    """``cuda.jit`` keyword arguments for a launch bound, ``threads`` or ``(threads, blocks an SM)``
    (ptxas then keeps a thread's registers within what that residency leaves): none for None, and
    none in the simulator, whose jit takes no launch_bounds (and has no registers to bound)."""
    return {} if bounds is None or simulator_enabled() else {"launch_bounds": bounds}


def inlined() -> dict[str, bool]:
    """``cuda.jit`` keyword arguments for a device function that NVVM inlines into its callers (LLVM's
    ``alwaysinline`` attribute) rather than Numba (``inline=True``, which deep-copies and retypes the
    function's IR at each call site). Numba types and lowers it once per signature, so a large
    function called from a kernel compiles in a fraction of the time. Only for device functions whose
    typing needs no constant from the call site (Numba-IR inlining is what propagates literal
    arguments and prunes branches on them). None in the simulator, whose jit takes no forceinline."""
    return {} if simulator_enabled() else {"forceinline": True}
