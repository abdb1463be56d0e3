"""``Kernel``: a Numba kernel launched with torch tensors as its arguments, at a small part of
Numba's host cost per launch.

Numba's own launch of a torch tensor pays three times on the host: the tensor becomes a
device array (``cuda.as_cuda_array``, ~29 us measured on the H200), the dispatcher types
every argument to find the compiled overload, and the launch re-derives each array's size,
pointer, shape and strides through several wrapper layers (~90 us for a five-argument
kernel, measured). A 36-layer Qwen3-8B prefill of 512 tokens spent 89 ms of host time on 17 ms of GPU
work that way. ``Kernel`` keeps Numba's call syntax, ``kernel[grid, block, stream,
shared_bytes](*args)``, and when every array argument is a torch tensor (the executor's
case) it:

- finds the compiled overload by a key of what Numba's typing depends on (dtype, rank and
  contiguity of each tensor, type of each scalar); a key's first launch asks Numba for the
  types of the converted arguments and loads that overload from the persistent kernel cache
  (executor/kernel_compiler.py), or compiles it (``Dispatcher.compile``) and stores it there;
- packs the arguments as Numba's ``_Kernel._prepare_args`` does: an array is (meminfo 0,
  parent 0, size, itemsize, data pointer, shape..., strides in bytes...), an integer or
  float scalar its ctypes value of the compiled type;
- launches through ``cuda.core.launch``, as Numba does.

A forward passes the same view objects to a launcher at every layer (StepViews slices a step's
buffers once), so each ``Kernel`` keeps, per tensor object, its key part and packed parameters
(``_TensorMemo``): a tensor seen before costs a dictionary lookup instead of a dozen attribute
reads. The memo holds the tensor, so its ``id`` is not reused while the entry lives; a torch view's
shape, strides and address never change (nothing here resizes a tensor in place).

The packing and the overload lookup follow numba-cuda 0.30.4's ``_Kernel`` (``argument_types``,
``_codelibrary``; the project's pinned, maintenance-mode target); tests/kernels/test_launch.py
holds both to Numba's own results on the GPU. bf16 tensors go in as their int16 bits (the
kernels' bf16 codec). Other arguments (Numba device arrays, numpy arrays) take Numba's own
path, unchanged. Tensors on torch's meta device launch nothing: their argument types are
noted in ``discovered`` (executor/kernel_discovery.py). In the simulator every tensor becomes a
wrapped numpy view of the same memory (not a copy: in-place kernels and strided views must see
the caller's tensor) and Numba's simulator runs the kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from executor.numba_cuda import load_cuda, simulator_enabled

#: Shared memory (static and dynamic together) a block may use without the opt-in attribute
#: (``Kernel(dynamic_shared_bytes=...)`` sets it).
SHARED_LIMIT_BYTES = 48 * 1024
#: sm_90's limits that launchers size blocks and launch bounds by.
WARP_THREADS = 32
BLOCK_THREADS = 1024  # threads a block
SM_THREADS = 2048  # resident threads an SM
SM_BLOCKS = 32  # resident blocks an SM
SM_REGISTERS = 65536  # 32-bit registers an SM
#: Scalar types a fast launch packs (anything else takes Numba's path).
_SCALARS = (np.integer, np.floating, np.bool_, int, float, bool)
#: Tensors a Kernel remembers the key part and parameters of (oldest dropped first): several steps' views
#: of every argument a launcher takes, across layers.
TENSOR_MEMO_ENTRIES = 1024

Packer = Callable[[Any, list], None]


class Kernel:
    """A Numba kernel (``cuda.jit`` dispatcher) that also launches cheaply with torch tensors.

    ``dynamic_shared_bytes``: the most dynamic shared memory a launch of it takes. Each compiled
    overload is allowed that much (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) before its first
    launch, so a block may use more than the SHARED_LIMIT_BYTES it gets without opting in.
    """

    def __init__(self, dispatcher: Any, dynamic_shared_bytes: int = 0) -> None:
        self.dispatcher = dispatcher
        self.dynamic_shared_bytes = dynamic_shared_bytes
        self.simulated = simulator_enabled()
        if not self.simulated:
            from cuda.core import LaunchConfig, launch  # what Numba launches through

            self._config, self._launch = LaunchConfig, launch
        # key -> (cuda.core kernel, one packer per argument), or None: the key takes Numba's path.
        self._launches: dict[tuple, tuple[Any, tuple[Packer, ...]] | None] = {}
        self._streams: dict[int, tuple[Any, Any]] = {}  # id(stream) -> (stream, its cuda.core stream)
        self._tensors = _TensorMemo()
        # The persistent kernel cache (executor/kernel_compiler.py): argument types -> "cache" (loaded) or
        # "compiled" (here), and the argument types a discovery pass over meta tensors asked for.
        self.origins: dict[tuple, str] = {}
        self.discovered: dict[tuple, None] = {}

    def __getitem__(self, config: tuple) -> Callable[..., None]:
        """``kernel[grid, block]``, ``[grid, block, stream]`` or ``[grid, block, stream, shared_bytes]``."""
        grid, block, *rest = config
        stream, shared_bytes = (*rest, 0, 0)[:2]
        return lambda *args: self.launch(grid, block, stream, shared_bytes, args)

    def launch(self, grid: Any, block: Any, stream: Any, shared_bytes: int, args: tuple) -> None:
        # Plain CUDA tensors and scalars: the key and the tensors' parameters from the memo.
        known = None if self.simulated else self._tensors.lookup(args)
        key, packed = known if known is not None else (None if self.simulated else _launch_key(args), None)
        entry = self._launches.get(key, False) if key is not None else None
        if entry is False:
            entry = self._launches[key] = self._compile(args)
        if entry is None:  # the simulator, an argument that is not a CUDA tensor or scalar, or an unpacked type
            if key is None and self._discovered(args):
                return
            if key is None and self.dynamic_shared_bytes and not self.simulated:
                self._compile(args, cached=False)  # opts the overload Numba launches in to the dynamic shared memory
            self.dispatcher[grid, block, stream, shared_bytes](*(_numba_argument(a, self.simulated) for a in args))
            return
        kernel, packers = entry
        params: list = []
        if packed is None:
            for pack, value in zip(packers, args):
                pack(value, params)
        else:
            for pack, value, ready in zip(packers, args, packed):
                if ready is None:
                    pack(value, params)
                else:
                    params += ready
        self._launch(self._core_stream(stream), self._config(grid=grid, block=block, shmem_size=shared_bytes), kernel,
                     *params)

    def prepare(self, *args: Any) -> None:
        """Ready the overload a launch with ``args`` runs (loaded from the kernel cache or compiled, as a
        first launch would), launching nothing; a discovery pass (meta tensors) notes its argument
        types. For a launcher that routes between kernels of the same arguments: the kernel it does
        not run yet is ready when a later step needs it."""
        key = None if self.simulated else _launch_key(args)
        if key is None:
            self._discovered(args)
        elif key not in self._launches:
            self._launches[key] = self._compile(args)

    def _discovered(self, args: tuple) -> bool:
        """Whether ``args`` are a discovery pass's (meta tensors, on the GPU's path): then their argument
        types are noted and nothing is launched or compiled."""
        if self.simulated or not _on_meta(args):
            return False
        from executor.kernel_discovery import argument_types

        self.discovered[argument_types(args)] = None
        return True

    def _compile(self, args: tuple, cached: bool = True) -> tuple[Any, tuple[Packer, ...]] | None:
        """The overload Numba would launch for ``args`` (from the kernel cache when ``cached`` and it has
        it, else compiled now if new) and its packers."""
        from executor.kernel_compiler import load_cached, store_compiled  # the persistent kernel cache

        converted = [_numba_argument(a, False) for a in args]
        argtypes = tuple(self.dispatcher.typeof_pyval(a) for a in converted)
        function, cache_key = load_cached(self.dispatcher, argtypes) if cached else (None, None)
        if function is not None:  # only launchable overloads are cached: the fast path takes it
            self.origins[argtypes] = "cache"
            if self.dynamic_shared_bytes:
                _allow_dynamic_shared(function, self.dynamic_shared_bytes)
            return function.kernel, tuple(_packer(t) for t in argtypes)
        overload = self.dispatcher.compile(argtypes)
        self.origins[argtypes] = "compiled"
        if self.dynamic_shared_bytes:
            _allow_dynamic_shared(overload._codelibrary.get_cufunc(), self.dynamic_shared_bytes)
        if overload.debug or overload.extensions or getattr(overload, "launch_config_sensitive", False):
            return None
        try:
            packers = tuple(_packer(t) for t in overload.argument_types)
        except NotImplementedError:
            return None
        store_compiled(cache_key, overload)
        return overload._codelibrary.get_cufunc().kernel, packers

    def _core_stream(self, stream: Any) -> Any:
        entry = self._streams.get(id(stream))
        if entry is None or entry[0] is not stream:
            from numba.cuda.cudadrv.driver import _to_core_stream  # Numba's own conversion

            entry = self._streams[id(stream)] = (stream, _to_core_stream(stream))
        return entry[1]


class _TensorMemo:
    """Per tensor object (by ``id``, holding the tensor): its launch-key part and packed array
    parameters, for launches whose arguments are all plain CUDA tensors and scalars."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[torch.Tensor, tuple, tuple]] = {}

    def lookup(self, args: tuple) -> tuple[tuple, tuple] | None:
        """``(launch key, per-argument parameters or None for a scalar)``, or None when an argument is
        neither a plain CUDA tensor nor a scalar (then the launch takes the general path)."""
        key, packed = [], []
        entries = self.entries
        for a in args:
            if type(a) is torch.Tensor:
                entry = entries.get(id(a))
                if entry is None or entry[0] is not a:
                    if not a.is_cuda:
                        return None
                    params: list = []
                    _pack_array(a, params)
                    entry = entries[id(a)] = (a, (a.dtype, a.dim(), _tensor_layout(a)), tuple(params))
                    if len(entries) > TENSOR_MEMO_ENTRIES:
                        del entries[next(iter(entries))]
                key.append(entry[1])
                packed.append(entry[2])
            elif isinstance(a, _SCALARS):
                key.append(type(a))
                packed.append(None)
            else:
                return None
        return tuple(key), tuple(packed)


def _allow_dynamic_shared(function: Any, shared_bytes: int) -> None:
    """Let launches of ``function`` (a loaded overload: Numba's launch path runs the same one, so it is
    allowed too) take ``shared_bytes`` of dynamic shared memory."""
    from numba.cuda.cudadrv.driver import binding, driver

    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, int(shared_bytes), function.handle, function.device.id)


def _on_meta(args: tuple) -> bool:
    """Whether a launch is part of a discovery pass (executor/kernel_discovery.py: tensors on torch's
    meta device, which have a layout and no data)."""
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in args)


def _launch_key(args: tuple) -> tuple | None:
    """What Numba's typing of ``args`` depends on, or None when an argument is neither a CUDA tensor
    nor a scalar (a host tensor goes to Numba, which refuses it with its own error)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cuda:
                return None
            key.append((a.dtype, a.dim(), _tensor_layout(a)))
        elif isinstance(a, _SCALARS):
            key.append(type(a))
        else:
            return None
    return tuple(key)


def _tensor_layout(a: torch.Tensor) -> str:
    """The layout Numba types ``cuda.as_cuda_array(a)`` with: C for a contiguous tensor (its array
    interface has no strides, so Numba takes C strides), else ``_strided_layout``."""
    return "C" if a.is_contiguous() else _strided_layout(a)


def _strided_layout(a: torch.Tensor) -> str:
    """Numba's layout of a tensor torch calls non-contiguous (so it has elements): "F" when
    Fortran-contiguous by Numba's rule (``dummyarray``: axes of length 1 are skipped, any zero
    stride breaks it), else "A". It cannot be "C": torch's and Numba's C rules agree."""
    expected = 1
    for size, stride in zip(a.shape, a.stride()):
        if stride == 0:
            return "A"
        if size != 1:
            if stride != expected:
                return "A"
            expected *= size
    return "F"


def _packer(numba_type: Any) -> Packer:
    """How one argument of ``numba_type`` becomes kernel parameters (``_Kernel._prepare_args``)."""
    from numba.cuda import types

    if isinstance(numba_type, types.Array):
        return _pack_array
    if isinstance(numba_type, types.Integer):
        c_type = getattr(ctypes, f"c_{numba_type}")
        return lambda value, params: params.append(c_type(value))
    if numba_type == types.float32:
        return lambda value, params: params.append(ctypes.c_float(value))
    if numba_type == types.float64:
        return lambda value, params: params.append(ctypes.c_double(value))
    if numba_type == types.boolean:
        return lambda value, params: params.append(value)
    raise NotImplementedError(numba_type)


def _pack_array(a: torch.Tensor, params: list) -> None:
    itemsize = a.element_size()
    shape = a.shape
    if a.is_contiguous():  # Numba's C strides from the shape (the interface gives none)
        strides, step = [], itemsize
        for size in reversed(shape):
            strides.append(step)
            step *= size
        strides.reverse()
    else:
        strides = [s * itemsize for s in a.stride()]
    params += (0, 0, a.numel(), itemsize, a.data_ptr(), *shape, *strides)


def _numba_argument(a: Any, simulated: bool) -> Any:
    """A torch tensor as Numba takes it, a view of the same memory with bf16 as int16 bits: a device
    array on the GPU, the simulator's wrapped numpy view (not a copy) in the simulator. Anything else
    as is."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.dtype == torch.bfloat16:
        a = a.view(torch.int16)
    if simulated:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(a.numpy())
    return load_cuda().as_cuda_array(a, sync=False)


#: The simulator has no SM count; a small grid keeps its Python threads few.
SIM_MULTIPROCESSORS = 2


def multiprocessor_count() -> int:
    """The current device's SM count (SIM_MULTIPROCESSORS in the simulator); a launcher that sizes its
    grid by SMs asks once and keeps the answer."""
    if simulator_enabled():
        return SIM_MULTIPROCESSORS
    return int(load_cuda().get_current_device().MULTIPROCESSOR_COUNT)
