"""Compiling kernel overloads to cubins, with or without a GPU, and loading cached ones.

On a GPU, ``Kernel._compile`` (executor/kernels/primitives/launch.py) asks ``load_cached`` for the overload of a
dispatcher and argument types: a cache hit is a cubin loaded into the current context
(``cuModuleLoadData`` through Numba's context and cuda.core), with no typing, lowering, NVVM or
linking; a miss compiles through Numba as before, and ``store_compiled`` writes the cubin Numba
linked for the device.

Without a GPU (``memplan compile``, and the cold-start compile processes, which must not open a
CUDA context on the device the plan budgets), ``compile_image`` builds the same overload as Numba's
dispatcher does (``_Kernel`` with the dispatcher's jit options), for a target architecture
given by ``target_device``, and links it with nvJitLink, which runs on the host. Numba asks the
current device for its compute capability (to type and lower for it, and to pick the NVVM arch)
and the launchers ask it for the SM count; ``target_device`` answers both for the plan's hardware,
in a process that has no GPU or must not use it. The cubin is the one Numba would link on the device
with the same toolchain (the key holds the toolchain: executor/kernel_key.py).

Only overloads the fast launch path takes are cached (no debug build, no extensions, not
launch-configuration sensitive, no cooperative launch, no module set-up functions or linked
objects with set-up state): a cached entry is a cubin and its entry point, nothing more.
"""

from __future__ import annotations

import contextlib
import types as pytypes
from collections.abc import Iterator, Sequence
from typing import Any

from executor.kernel_cache import CachedKernel, KernelCache
from executor.kernel_key import Arch, Uncacheable, kernel_key, toolchain


def load_cached(dispatcher: Any, argtypes: Sequence[Any]) -> tuple[Any | None, str | None]:
    """(the overload loaded from the cache, its key): (function, key) on a hit, (None, key) on a miss,
    (None, None) when the cache is off or the kernel cannot be keyed. ``function`` is Numba's loaded
    function object (``.kernel`` is what cuda.core launches)."""
    cache = KernelCache.from_environment()
    if cache is None:
        return None, None
    try:
        key = kernel_key(dispatcher, argtypes, device_arch())
    except Uncacheable:
        return None, None
    except Exception as error:  # a value the key walk trips on: compile as without the cache, and say so
        function = dispatcher.py_func
        cache.warn(f"cannot key {function.__module__}.{function.__qualname__} ({type(error).__name__}: {error}); "
                   "compiling it without the cache")
        return None, None
    entry = cache.load(key)
    if entry is None:
        return None, key
    try:
        return load_image(entry), key
    except Exception as error:  # the driver refused the image (another driver, a damaged cubin)
        cache.discard(key, f"the driver did not load it ({type(error).__name__}: {error})")
        return None, key


def store_compiled(key: str | None, overload: Any) -> None:
    """Write a launchable overload Numba just compiled on the device to the cache under ``key`` (from
    ``load_cached``; None: nothing to do)."""
    cache = KernelCache.from_environment()
    if key is None or cache is None:
        return
    try:
        _check_launchable(overload, overload.argument_types)
        entry = _entry(overload, device_arch(), overload._codelibrary.get_cubin())
    except Uncacheable:
        return
    cache.store(key, entry)


def compile_image(dispatcher: Any, argtypes: Sequence[Any], arch: Arch) -> CachedKernel:
    """Compile ``dispatcher`` for ``argtypes`` and link a cubin for ``arch`` without touching a device
    (call it inside ``target_device(arch, ...)``); raises Uncacheable for an overload the fast launch
    path would not take."""
    from executor.numba_cuda import load_cuda

    load_cuda()
    from numba.cuda.dispatcher import _Kernel

    overload = _Kernel(dispatcher.py_func, tuple(argtypes), **dispatcher.targetoptions)  # as Dispatcher.compile
    _check_launchable(overload, argtypes)
    return _entry(overload, arch, overload._codelibrary.get_cubin(cc=arch.numba_cc))


def load_image(entry: CachedKernel) -> Any:
    """Load ``entry``'s cubin into the current CUDA context (Numba's, which torch shares) and return
    Numba's function object of its entry point."""
    from cuda.core import ObjectCode

    from executor.numba_cuda import load_cuda

    context = load_cuda().current_context()
    module = context.create_module_image(ObjectCode.from_cubin(entry.image))
    return module.get_function(entry.entry_name)


def device_arch() -> Arch:
    """The current device's architecture."""
    from executor.numba_cuda import load_cuda

    return Arch.from_capability(load_cuda().get_current_device().compute_capability)


@contextlib.contextmanager
def target_device(arch: Arch, num_sms: int) -> Iterator[None]:
    """Make Numba's device queries answer for a GPU of ``arch`` with ``num_sms`` SMs, in a process with
    no GPU (or one it must not touch): the compute capability Numba types, lowers and picks its NVVM
    arch by, and the SM count the launchers size grids and kernel shapes by
    (``executor.kernels.primitives.launch.multiprocessor_count``). numba-cuda 0.30.4 reads both through
    ``numba.cuda.get_current_device`` (the launchers, by way of ``load_cuda()``), the name
    ``get_current_device`` in ``numba.cuda.dispatcher`` (``_Kernel``) and
    ``numba.cuda.cudadrv.devices.get_context`` (the code library's default arch)."""
    from executor.numba_cuda import load_cuda

    cuda = load_cuda()
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda.cudadrv import devices

    device = pytypes.SimpleNamespace(compute_capability=(arch.major, arch.minor), MULTIPROCESSOR_COUNT=num_sms, id=0,
                                     name=f"target {arch.name}")
    context = pytypes.SimpleNamespace(device=device)
    patches = [(cuda, "get_current_device", lambda: device), (dispatcher, "get_current_device", lambda: device),
               (devices, "get_context", lambda devnum=None: context)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _check_launchable(overload: Any, argtypes: Sequence[Any]) -> None:
    """Uncacheable unless the fast launch path (launch.py) takes ``overload`` as a cubin and an entry
    point alone."""
    from executor.kernels.primitives.launch import _packer  # what the fast path can pack

    if overload.debug or overload.extensions or getattr(overload, "launch_config_sensitive", False):
        raise Uncacheable("a debug, extended or launch-configuration sensitive overload")
    if overload.shared_memory_carveout is not None:
        raise Uncacheable("an overload with a shared memory carveout (set when Numba binds it)")
    try:
        for numba_type in argtypes:
            _packer(numba_type)
    except NotImplementedError as error:
        raise Uncacheable(f"an argument the fast launch path does not pack: {error}") from None


def _entry(overload: Any, arch: Arch, cubin: Any) -> CachedKernel:
    from numba.cuda.memory_management.nrt import NRT_LIBRARY

    library = overload._codelibrary
    if overload.cooperative or library._setup_functions or library._teardown_functions:
        raise Uncacheable("a cooperative kernel or one whose module needs set-up")
    if NRT_LIBRARY in library._linking_files:
        raise Uncacheable("a kernel linked with Numba's runtime (its module needs set-up)")
    if any(hasattr(obj, "__cuda_array_interface__") for obj in library.referenced_objects.values()):
        raise Uncacheable("a kernel that references device arrays")
    function = overload.py_func
    return CachedKernel(entry_name=overload.entry_name, image=bytes(getattr(cubin, "code", cubin)),
                        kernel=f"{function.__module__}.{function.__qualname__}",
                        argtypes=tuple(str(t) for t in overload.argument_types), arch=arch.name,
                        toolchain=dict(toolchain()))

