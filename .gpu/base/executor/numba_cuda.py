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
