"""Kernel discovery: the kernel specializations a plan's start-up launches, found without a GPU or data.

The launchers pick a kernel and its argument types from tensor dtypes, shapes, strides and alignment
and from the plan, never from data. So the plan is materialized on torch's meta device (views with
the planned offsets, shapes and strides, and no memory), the model is built over it, and the start-up
passes run: ``warm_up_steps``, for each CUDA-graph bucket the padded decode step that graph
capture runs eagerly before recording, and for each prefill-graph bucket its pieces, which capture
runs the same way (executor/models/graphs.py). A ``Kernel`` launched with meta
tensors notes the argument types it would compile and launches nothing (executor/kernels/primitives/launch.py).
The passes run in a process with or without a GPU: the only device queries on the way are the SM
count (``multiprocessor_count``), which a process without a GPU answers for the plan's hardware
(``kernel_compiler.target_device``).

What discovery finds is what warm-up and graph capture would compile; steps of other shapes (a
prefill chunk whose key count picks another softmax build, say) may still compile on first use, and
those land in the cache too (launch.py's ``Kernel._compile``).
"""

from __future__ import annotations

import types as pytypes
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.kernels.primitives.launch import Kernel
    from executor.models.decoder import DecoderModel
    from planner.plan import MemoryPlan

#: The phase names of ``KernelNeed.phase``.
WARM_UP = "warm-up"
GRAPH_PHASE = "decode graph {bucket}"
PREFILL_GRAPH_PHASE = "prefill graph {bucket}"


@dataclass(frozen=True)
class KernelNeed:
    """One kernel specialization start-up launches: the launcher's kernel, the Numba argument types of
    the overload, and the first start-up pass that launches it."""

    kernel: Kernel
    argtypes: tuple
    phase: str

    @property
    def name(self) -> str:
        """The kernel function's module and qualified name (what ``memplan compile`` lists)."""
        return kernel_name(self.kernel)


def kernel_name(kernel: Kernel) -> str:
    """A kernel function's module and qualified name."""
    function = kernel.dispatcher.py_func
    return f"{function.__module__}.{function.__qualname__}"


def discover(plan: MemoryPlan) -> list[KernelNeed]:
    """The kernel specializations that warm-up and decode-graph capture of ``plan`` launch, in the order
    they are first launched (one entry per kernel and argument types)."""
    return [need for needs in discover_by_pass(plan) for need in needs]


def discover_by_pass(plan: MemoryPlan) -> Iterator[list[KernelNeed]]:
    """``discover``'s specializations a start-up pass at a time (warm-up, then each decode-graph bucket and
    each prefill-graph bucket, largest first as capture runs them): each list holds those the pass
    launches first, so a caller can compile them while the next pass runs."""
    model = meta_model(plan)
    seen: set[tuple[int, tuple]] = set()
    for phase in startup_passes(plan, model):
        found = []
        for kernel in find_kernels(model):
            for argtypes in kernel.discovered:
                if (id(kernel), argtypes) not in seen:
                    seen.add((id(kernel), argtypes))
                    found.append(KernelNeed(kernel, argtypes, phase))
        yield found


def meta_model(plan: MemoryPlan) -> DecoderModel:
    """``plan``'s model over an arena on torch's meta device: its launches note argument types only."""
    import torch

    from executor.arena import materialize
    from executor.device import Device
    from executor.models import build_model

    return build_model(materialize(plan, Device("meta", torch.device("meta"))))


def startup_passes(plan: MemoryPlan, model: DecoderModel) -> Iterator[str]:
    """Run start-up's passes on ``model`` (a ``meta_model``), yielding each pass's phase name after it:
    warm-up's steps, each decode-graph bucket's padded step and each prefill-graph bucket's pieces."""
    from executor.engine import warm_up_steps
    from executor.models.context import prefill_bucket_views
    from executor.step import plan_step

    for chunks in warm_up_steps(plan):
        model.step(plan_step(plan, chunks))
    yield WARM_UP
    empty = plan_step(plan, [])  # padded to a bucket: all padding, as graph capture runs it
    for bucket in sorted(plan.serving.decode_graph_batch_sizes, reverse=True):  # capture's order
        model.step(empty, pad_to=bucket)
        yield GRAPH_PHASE.format(bucket=bucket)
    if model.parallel is None:  # DecoderModel.capture_prefill_graphs: none with tensor parallelism
        for bucket in sorted(plan.capacity.prefill_graph_rows, reverse=True):
            views = prefill_bucket_views(model.arena, bucket)
            for index in range(len(model.layers) + 1):
                model._piece(index, views)
            yield PREFILL_GRAPH_PHASE.format(bucket=bucket)


def find_kernels(root: Any) -> list[Kernel]:
    """Every ``Kernel`` reachable from ``root`` (a model) through the attributes of executor objects and
    the containers they hold, each once, in the order first reached."""
    from executor.kernels.primitives.launch import Kernel

    found: dict[int, Kernel] = {}
    seen: set[int] = set()
    pending = [root]
    while pending:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Kernel):
            found.setdefault(id(obj), obj)
            continue
        pending.extend(reversed(list(_children(obj))))
    return list(found.values())


def _children(obj: Any) -> Iterator[Any]:
    """What ``find_kernels`` looks into: the values of containers, the attributes of executor objects,
    and what executor functions (a model's mixer builders, say) close over; not tensors, plans or
    anything else."""
    if isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, pytypes.FunctionType):
        if obj.__module__.startswith("executor."):
            yield from (cell.cell_contents for cell in obj.__closure__ or () if _bound(cell))
    elif isinstance(obj, pytypes.MethodType):
        yield obj.__self__
    elif type(obj).__module__.startswith("executor."):
        if is_dataclass(obj):
            yield from (getattr(obj, f.name) for f in fields(obj))
        elif hasattr(obj, "__dict__"):
            yield from vars(obj).values()


def _bound(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet bound
        return False
    return True


def argument_types(args: tuple) -> tuple:
    """The Numba types a launch with ``args`` compiles for, from meta tensors' dtypes and layouts (the
    types Numba gives ``cuda.as_cuda_array`` of such a tensor on the GPU: bf16 as its int16 bits, and
    launch.py's layout rule) and the scalars' own types."""
    import numpy as np
    import torch

    from executor.kernels.primitives.launch import _tensor_layout  # the layout rule the launch keys use
    from executor.numba_cuda import load_cuda

    load_cuda()
    from numba.cuda import types
    from numba.cuda.np.numpy_support import from_dtype
    from numba.cuda.typing.typeof import Purpose, typeof

    result = []
    for a in args:
        if isinstance(a, torch.Tensor):
            dtype = torch.int16 if a.dtype == torch.bfloat16 else a.dtype
            element = from_dtype(np.dtype(str(dtype).removeprefix("torch.")))
            result.append(types.Array(element, a.dim(), _tensor_layout(a)))
        else:
            result.append(typeof(a, Purpose.argument))  # as the dispatcher types a scalar
    return tuple(result)
