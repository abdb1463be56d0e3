"""The key of a compiled kernel in the persistent cache: a SHA-256 over everything that changes its
machine code.

Kernels here are built by builder closures (``build_rms_norm_kernel(codec, round_before_weight)``
returns a fresh ``cuda.jit`` dispatcher whose body closes over the codec's device functions and the
specialization arguments), so the builder's arguments live in the closure of the kernel function.
The key covers:

- the kernel function: its module and qualified name (the builder's name is part of it, e.g.
  ``build_rms_norm_kernel.<locals>.rms_norm``) and, recursively, every value it closes over or
  reads as a global: specialization arguments (ints, floats, tuples), device functions and
  intrinsics (their own functions, closures, globals and jit options), codecs and other plain
  objects by their fields; a library module (``numba.cuda``, ``math``) by kind alone, its code
  being that of the Python and package versions the toolchain names;
- the SHA-256 of the source file of every module such a function is defined in (the kernel's
  builder, the codec, the device functions it calls);
- the dispatcher's jit options (launch bounds, fastmath, LTO, ...);
- the argument types of the overload (``array(int16, 2d, A)``, ``float32``);
- the target architecture (``sm_90a``: Numba compiles for the "a" variant from compute
  capability 9.0 on);
- the toolchain: Python, numpy, numba, numba-cuda, llvmlite, cuda-core and cuda-bindings versions,
  the NVVM and NVVM IR versions, and the linker that makes the cubin (nvJitLink and its version, or
  the driver's, with the driver version).

A value the walk cannot describe faithfully (an object of no known kind, a function with no source
file, a device array: its address would be compiled in) makes the kernel uncacheable
(``Uncacheable``); it then compiles on every start, as without the cache.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import sys
import types as pytypes
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

#: Bumped when the key's material or the entry's meaning changes.
KEY_VERSION = 2


class Uncacheable(Exception):
    """The kernel cannot be keyed faithfully (the message says which value); it is compiled, not cached."""


#: The oldest GPU the kernels compile for: bf16 stores are PTX ``cvt.rn.bf16.f32`` (executor/kernels/primitives/codec.py),
#: which needs sm_80 (A100 and later).
MIN_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Arch:
    """A compile target: compute capability ``major.minor`` and Numba's arch suffix ("a" from 9.0 on:
    ``sm_90a``, as numba-cuda's code library picks for the current device)."""

    major: int
    minor: int

    @classmethod
    def from_capability(cls, capability: str | Sequence[int]) -> Arch:
        """From "9.0" (a hardware config) or (9, 0) (a device)."""
        major, minor = (int(part) for part in (capability.split(".") if isinstance(capability, str) else capability))
        return cls(major, minor)

    @property
    def suffix(self) -> str:
        return "a" if (self.major, self.minor) >= (9, 0) else ""

    @property
    def numba_cc(self) -> tuple[int, int, str]:
        """The ``cc`` numba-cuda's code library compiles and links for."""
        return self.major, self.minor, self.suffix

    @property
    def name(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"


def kernel_key(dispatcher: Any, argtypes: Sequence[Any], arch: Arch, description: tuple | None = None) -> str:
    """The cache key (hex SHA-256) of ``dispatcher``'s overload for ``argtypes`` compiled for ``arch``
    (``description``: ``describe_kernel(dispatcher)`` when the caller has it); raises Uncacheable."""
    if description is None:
        description = describe_kernel(dispatcher)
    try:
        tools = toolchain()
    except Exception as error:  # no NVVM here: nothing to compile with, nothing to key
        raise Uncacheable(f"no toolchain ({type(error).__name__}: {error})") from None
    material = (KEY_VERSION, description, tuple(_type_name(t) for t in argtypes), arch.name, tools)
    return hashlib.sha256(repr(material).encode()).hexdigest()


def describe_kernel(dispatcher: Any) -> tuple:
    """The canonical description of a kernel dispatcher: its function, closures, globals, jit options and
    the digests of their modules' sources (see the module docstring). Raises Uncacheable."""
    return _Describer().value(dispatcher)


@functools.cache
def toolchain() -> tuple[tuple[str, str], ...]:
    """What compiles and links a kernel here: package versions, NVVM, and the linker."""
    from importlib.metadata import version

    import llvmlite
    import numpy as np

    from executor.numba_cuda import load_cuda

    load_cuda()
    import numba
    from numba.cuda.cudadrv import nvvm

    nvvm_handle = nvvm.NVVM()
    items = [
        ("python", ".".join(map(str, sys.version_info[:3]))),
        ("numpy", np.__version__),
        ("numba", numba.__version__),
        ("numba-cuda", version("numba-cuda")),
        ("llvmlite", llvmlite.__version__),
        ("cuda-core", version("cuda-core")),
        ("cuda-bindings", version("cuda-bindings")),
        ("nvvm", ".".join(map(str, nvvm_handle.get_version()))),
        ("nvvm-ir", ".".join(map(str, nvvm_handle.get_ir_version()))),
        ("linker", linker()),
    ]
    return tuple(items)


@functools.cache
def linker() -> str:
    """The linker that makes cubins here: "nvjitlink X.Y" (no device needed), else "driver N" (the
    driver's own linker, which needs one)."""
    from executor.numba_cuda import load_cuda

    load_cuda()
    from numba.cuda.cudadrv import driver

    if driver._have_nvjitlink():
        from cuda.bindings import nvjitlink

        return "nvjitlink " + ".".join(map(str, nvjitlink.version()))
    return f"driver {driver.driver.get_version()}"


def _type_name(numba_type: Any) -> str:
    return f"{type(numba_type).__name__}:{numba_type}"


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """SHA-256 of a source file (memoized by path, modification time and size)."""
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def module_digest(module_name: str) -> str:
    """SHA-256 of the source file of an imported module; Uncacheable without one."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        raise Uncacheable(f"module {module_name!r} has no Python source file")
    stat = os.stat(path)
    return _file_digest(path, stat.st_mtime_ns, stat.st_size)


class _Describer:
    """One description walk: functions and dispatchers already described become references."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # holds what ``seen`` indexes by id, so no id is reused mid-walk

    def value(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, repr(obj))
        if isinstance(obj, enum.Enum):
            return ("enum", _qualified(type(obj)), obj.name)
        if isinstance(obj, (tuple, list)):
            return (type(obj).__name__, tuple(self.value(item) for item in obj))
        if isinstance(obj, (set, frozenset)):
            return ("set", tuple(sorted(repr(self.value(item)) for item in obj)))
        if isinstance(obj, dict):
            return ("dict", tuple(sorted((repr(self.value(k)), self.value(v)) for k, v in obj.items())))
        if isinstance(obj, pytypes.ModuleType):
            # A project module's functions are reached by attribute: its source. A library module is its
            # package's code at the toolchain's versions, and its name is left out: one name in the source
            # can be bound to an alias module at run time (``from numba import types`` gives
            # numba.core.types until something imports the numba.types submodule, then numba.types).
            return ("module", obj.__name__, module_digest(obj.__name__)) if _is_project(obj) else ("library module",)
        if isinstance(obj, type):
            return ("class", _qualified(obj))
        if hasattr(obj, "__cuda_array_interface__"):
            raise Uncacheable(f"a device array ({type(obj).__name__}) is compiled in by address")
        return self._object(obj)

    def _object(self, obj: Any) -> Any:
        import numpy as np

        if isinstance(obj, np.dtype):
            return ("dtype", obj.str)
        if isinstance(obj, np.generic):
            return ("numpy", obj.dtype.str, repr(obj.item()))
        if isinstance(obj, np.ndarray):
            return ("ndarray", obj.dtype.str, obj.shape, obj.tobytes().hex())
        if isinstance(obj, np.ufunc):
            return ("ufunc", obj.__name__)
        if type(obj).__module__.startswith("llvmlite.ir"):  # an LLVM type an intrinsic closes over
            return ("llvm", type(obj).__name__, str(obj))
        numba_kind = _numba_kind(obj)
        if numba_kind is not None:
            return self._memo(obj, lambda: self._numba(numba_kind, obj))
        if isinstance(obj, pytypes.FunctionType):
            return self._memo(obj, lambda: self._function(obj))
        if isinstance(obj, (pytypes.BuiltinFunctionType, pytypes.MethodWrapperType)):
            return ("builtin", getattr(obj, "__module__", None) or "", obj.__qualname__)
        if isinstance(obj, functools.partial):
            return ("partial", self.value(obj.func), self.value(obj.args), self.value(obj.keywords))
        if is_dataclass(obj):
            return self._memo(obj, lambda: ("dataclass", _qualified(type(obj)),
                                            tuple((f.name, self.value(getattr(obj, f.name))) for f in fields(obj))))
        raise Uncacheable(f"cannot describe a {_qualified(type(obj))}")

    def _memo(self, obj: Any, describe: Any) -> Any:
        index = self.seen.get(id(obj))
        if index is not None:
            return ("ref", index)
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        return describe()

    def _numba(self, kind: str, obj: Any) -> Any:
        if kind == "dispatcher":
            return ("dispatcher", self.value(obj.py_func), self.value(dict(obj.targetoptions)))
        if kind == "intrinsic":
            return ("intrinsic", self.value(obj._defn), self.value(obj._ctor_kwargs), obj._prefer_literal)
        return ("numba type", _type_name(obj))

    def _function(self, function: pytypes.FunctionType) -> Any:
        code = function.__code__
        closure = tuple((name, self._cell(cell)) for name, cell in zip(code.co_freevars, function.__closure__ or ()))
        global_names = sorted(name for name in _names(code) if name in function.__globals__)
        used_globals = tuple((name, self.value(function.__globals__[name])) for name in global_names)
        return ("function", function.__module__, function.__qualname__, module_digest(function.__module__),
                closure, used_globals, self.value(function.__defaults__), self.value(function.__kwdefaults__))

    def _cell(self, cell: Any) -> Any:
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not yet bound
            return ("empty cell",)
        return self.value(contents)


def _numba_kind(obj: Any) -> str | None:
    """"dispatcher" (a cuda.jit kernel or device function), "intrinsic", "type" (a Numba type), or None."""
    from numba.core.types import Type as CoreType

    module = type(obj).__module__
    if not module.startswith("numba"):
        return None
    if hasattr(obj, "py_func") and hasattr(obj, "targetoptions"):
        return "dispatcher"
    if hasattr(obj, "_defn") and hasattr(obj, "_ctor_kwargs"):
        return "intrinsic"
    from numba.cuda.types import Type as CudaType

    if isinstance(obj, (CoreType, CudaType)):
        return "type"
    return None


def _names(code: pytypes.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code objects nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            names |= _names(const)
    return names


def _is_project(module: pytypes.ModuleType) -> bool:
    """Whether ``module`` is a source file outside the interpreter's and installed packages' directories."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    return not any(os.path.abspath(path).startswith(root + os.sep) for root in _library_roots())


@functools.cache
def _library_roots() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({os.path.abspath(paths[name]) for name in ("stdlib", "platstdlib", "purelib", "platlib")
                  if name in paths})


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
