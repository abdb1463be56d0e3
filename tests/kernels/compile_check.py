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
torch and lives for the whole test process: each check runs its body in a fresh
namespace in that one interpreter, so numba's import and NVVM's load are paid
once per test worker, not once per check.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.kernels.storage import DTYPES

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECK_TIMEOUT_S = 600

PRELUDE = f"""
import sys, types as pytypes
class NvvmMissing(Exception):
    pass
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
ALLOW_F64 = False  # each check sets its own (WORKER_LOOP)
def arr(dtype_name, ndim):
    return types.Array(ELEMENT[dtype_name], ndim, "A")
def ptx(kernel, *argtypes):
    try:
        text = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))[0]
    except Exception as exc:  # NVVM missing is the only expected failure; NvvmError is a compile error
        if isinstance(exc, NvvmSupportError) or ("nvvm" in str(exc).lower() and not isinstance(exc, NvvmError)):
            raise NvvmMissing(f"cuda.compile_ptx cannot find NVVM: {{exc}}") from exc
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


# The worker's loop: one JSON request per line on stdin ({"body", "allow_f64"}), one JSON
# reply per line on the saved stdout ({"status": "ok" | "failed" | "no-nvvm", "message"}).
# A body's own prints go to stderr so they cannot break the replies.
WORKER_LOOP = """
import json, traceback
replies = sys.stdout
sys.stdout = sys.stderr
prelude = dict(globals())
for line in sys.stdin:
    request = json.loads(line)
    ALLOW_F64 = request["allow_f64"]  # ptx() reads it from this module's globals
    namespace = dict(prelude, __name__="__check__")
    try:
        exec(compile(request["body"], "<check>", "exec"), namespace)
        reply = {"status": "ok", "message": ""}
    except NvvmMissing as exc:
        reply = {"status": "no-nvvm", "message": str(exc)}
    except BaseException:
        reply = {"status": "failed", "message": traceback.format_exc()[-4000:]}
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""


class CompileWorker:
    """One long-lived no-simulator interpreter that runs check bodies on request."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + WORKER_LOOP],
            cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self, body: str, allow_f64: bool) -> dict:
        self.proc.stdin.write(json.dumps({"body": body, "allow_f64": allow_f64}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CHECK_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:  # timed out or died (an NVVM crash): the next check starts a fresh worker
            self.proc.kill()
            return {"status": "failed", "message": f"the compile worker died or ran past {CHECK_TIMEOUT_S} s"}
        return json.loads(line)


@functools.cache
def _worker_slot() -> list[CompileWorker]:
    return []


def _worker() -> CompileWorker:
    slot = _worker_slot()
    if not slot or not slot[0].alive():
        slot[:] = [CompileWorker()]
    return slot[0]


def compile_for_sm90(body: str, *, allow_f64: bool = False) -> None:
    """Run body's ptx(...) compiles for sm_90 in the compile worker; skip the test where NVVM is missing.

    Each PTX must be free of float64 arithmetic unless allow_f64.
    """
    reply = _worker().check(textwrap.dedent(body), allow_f64)
    if reply["status"] == "no-nvvm":
        pytest.skip(reply["message"])
    assert reply["status"] == "ok", reply["message"]
