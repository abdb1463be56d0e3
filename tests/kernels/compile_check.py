"""Compile kernels to sm_90 (H200) PTX without a GPU, in a subprocess free of the simulator.

Tests run kernels in the Numba CUDA simulator, which replaces numba's compiler, so
``compile_for_sm90(body)`` runs ``body`` (Python source) in a fresh interpreter
without NUMBA_ENABLE_CUDASIM. The body builds kernels and calls
``ptx(kernel, *argtypes)``, which compiles ``kernel`` for sm_90 and returns the
PTX text, or ``vector_ptx(kernel, *argtypes)``, which also checks that a
16-byte vector kernel (executor/kernels/primitives/vector.py) loads and stores 16 bytes at
a time and keeps its chunk buffers out of local memory. The body also gets
``types`` (numba's), ``build_codec``, ``DTYPES`` and ``arr(dtype_name, ndim)``, the array type a kernel takes for that data
(bfloat16 as int16 bits):

    compile_for_sm90(
        '''
        from tests.kernels.add_inplace import build_add_inplace_kernel
        for name in DTYPES:
            ptx(build_add_inplace_kernel(build_codec(name)), arr(name, 2), arr(name, 2))
        '''
    )

No driver is needed: device functions ask the current device for its compute
capability, and the subprocess answers for an H200. The subprocess imports no
torch, so a check costs little more than its compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.kernels.storage import DTYPES

REPO_ROOT = Path(__file__).resolve().parents[2]
NO_NVVM = 3  # the subprocess's exit status when NVVM is missing

PRELUDE = f"""
import sys, types as pytypes
from executor.numba_cuda import load_cuda
cuda = load_cuda()
import numba.cuda.dispatcher as dispatcher
from numba import types
from numba.cuda.cudadrv.error import NvvmError, NvvmSupportError
from executor.kernels.primitives.codec import build_codec
# Without a driver, device functions ask the (absent) current device for its
# compute capability; pretend an H200 so NVVM compiles the whole kernel.
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
DTYPES = {tuple(DTYPES)!r}
ELEMENT = {{"float32": types.float32, "bfloat16": types.int16, "int32": types.int32, "uint32": types.uint32}}
ALLOW_F64 = sys.argv[1] == "allow-f64"
def arr(dtype_name, ndim):
    return types.Array(ELEMENT[dtype_name], ndim, "A")
def ptx(kernel, *argtypes):
    try:
        text = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))[0]
    except Exception as exc:  # NVVM missing is the only expected failure; NvvmError is a compile error
        if isinstance(exc, NvvmSupportError) or ("nvvm" in str(exc).lower() and not isinstance(exc, NvvmError)):
            print("cuda.compile_ptx cannot find NVVM:", exc)
            sys.exit({NO_NVVM})
        raise
    # A stray float64 literal silently turns float32 math into slow double math.
    signature = ", ".join(map(str, argtypes))
    assert ALLOW_F64 or ".f64" not in text, f"{{kernel.py_func.__name__}}({{signature}}): float64 arithmetic in PTX"
    return text
def vector_ptx(kernel, *argtypes, local_ok=False):
    # A vector kernel: 16-byte global loads and stores, and (unless local_ok) chunk buffers
    # in registers: no local memory.
    text = ptx(kernel, *argtypes)
    name = kernel.py_func.__name__
    assert "ld.global.v4" in text and "st.global.v4" in text, f"{{name}}: no 16-byte global access in PTX"
    assert local_ok or ".local" not in text, f"{{name}}: uses local memory"
    return text
"""


def compile_for_sm90(body: str, *, allow_f64: bool = False) -> None:
    """Run body's ptx(...) compiles for sm_90 in a subprocess; skip the test where NVVM is missing.

    Each PTX must be free of float64 arithmetic unless allow_f64.
    """
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    script = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script, "allow-f64" if allow_f64 else "no-f64"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode == NO_NVVM:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
