"""Where kernels run: a CUDA GPU, or the Numba CUDA simulator over host memory.

The executor is written once against torch tensors, which kernels take as they
are (executor.kernels.primitives.launch). A ``Device`` says which torch device holds the
arena and which stream kernels launch on, so the simulator runs the same code path.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from executor.numba_cuda import load_cuda, simulator_enabled
from executor.kernel_key import MIN_COMPUTE_CAPABILITY

TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}


class DeviceError(RuntimeError):
    """The requested device is not available."""




def check_compute_capability(name: str, capability: tuple[int, int]) -> None:
    """DeviceError unless ``capability`` is at least MIN_COMPUTE_CAPABILITY, naming the GPU and both."""
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        have = ".".join(map(str, capability))
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        raise DeviceError(f"{name} has compute capability {have}; the kernels need {need} or later "
                          "(bf16 conversion instructions)")


@dataclass(frozen=True)
class Device:
    """A place to run: ``kind`` is "cuda", "sim", or "meta" (torch's meta device: views with shapes,
    strides and offsets and no data, where launches only note what they would compile;
    executor/kernel_discovery.py)."""

    kind: str
    torch_device: torch.device
    # Numba handles of torch streams, made once per stream (not per launch).
    _numba_streams: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_sim(self) -> bool:
        return self.kind == "sim"

    def current_stream(self) -> Any:
        """The Numba stream of torch's current stream, where kernels must launch so that they order
        with the torch GEMMs around them and are recorded while a CUDA graph is captured (0 in the
        simulator and on the meta device)."""
        if self.kind != "cuda":
            return 0
        handle = torch.cuda.current_stream(self.torch_device).cuda_stream
        stream = self._numba_streams.get(handle)
        if stream is None:
            stream = self._numba_streams[handle] = load_cuda().external_stream(handle)
        return stream

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)


def speed_up_simulator() -> None:
    """Make the simulator fast and its shared arrays race-free.

    The simulator runs a block's threads as Python threads. Its block manager
    busy-polls every thread for "blocked or finished" while they run, taking
    the GIL from them; ``_event_driven_blocks`` makes the threads report
    instead, so a barrier costs one handoff and Python's default switch
    interval serves best (a shorter one makes the threads trade the GIL far
    more often than they reach barriers: 2x slower model steps).
    numba-cuda 0.30.4's simulator creates a block's shared array on first use
    by a check-then-insert without a lock, so two threads can each create their
    own copy and stop sharing. The replacement below does the same lookup (by
    the calling source line) under a lock.
    """
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    if not getattr(shared.array, "memplan_locked", False):
        lock = threading.Lock()
        unlocked = shared.array

        def array(self, shape, dtype, alignment=None):
            if shape == 0 or alignment is not None:
                return unlocked(self, shape, dtype, alignment)
            if isinstance(dtype, kernelapi.types.Type):
                dtype = kernelapi.numpy_support.as_dtype(dtype)
            caller = traceback.extract_stack(sys._getframe(1), limit=1)[0][0:2]
            with lock:
                allocation = self._allocations.get(caller)
                if allocation is None:
                    allocation = self._allocations[caller] = np.empty(shape, dtype)
            return allocation

        array.memplan_locked = True
        shared.array = array
    _event_driven_blocks()


class _BlockBarrier:
    """One simulated block's threads and who of them waits at the barrier or has finished, under one
    condition the threads notify (the manager sleeps on it rather than polling them)."""

    def __init__(self, size: int):
        self.size = size
        self.changed = threading.Condition()
        self.waiting: list[Any] = []
        self.finished = 0

    def arrive(self, thread: Any) -> None:
        with self.changed:
            thread.syncthreads_blocked = True
            self.waiting.append(thread)
            self.changed.notify()

    def finish(self) -> None:
        with self.changed:
            self.finished += 1
            self.changed.notify()


def _event_driven_blocks() -> None:
    """Replace numba-cuda's simulated block scheduling (BlockManager.run, BlockThread.run and
    .syncthreads) by the same protocol, reported rather than polled: a thread at the barrier or done
    tells the block's ``_BlockBarrier``; when every thread is at the barrier or done, the waiting ones
    go on; a thread's exception aborts the others and is raised from the launch, as before."""
    from numba.cuda.simulator import kernel as sim

    if getattr(sim.BlockManager.run, "memplan_event_driven", False):
        return
    thread_run = sim.BlockThread.run

    def run_block(manager, grid_point, *args):
        threads = [sim.BlockThread(lambda: manager._f(*args), manager, grid_point, point, manager._debug)
                   for point in np.ndindex(*manager._block_dim)]
        barrier = manager.memplan_barrier = _BlockBarrier(len(threads))
        for thread in threads:
            thread.start()
        with barrier.changed:
            while True:
                barrier.changed.wait_for(lambda: barrier.finished + len(barrier.waiting) == barrier.size
                                         or any(t.exception for t in threads))
                failed = next((t for t in threads if t.exception), None)
                if failed is not None:
                    for thread in threads:
                        thread.abort = True
                        thread.syncthreads_blocked = False
                        thread.syncthreads_event.set()
                    raise failed.exception[0].with_traceback(failed.exception[1])
                if barrier.finished == barrier.size:
                    break
                for thread in barrier.waiting:
                    thread.syncthreads_blocked = False
                    thread.syncthreads_event.set()
                barrier.waiting = []
        for thread in threads:
            thread.join()

    def run_thread(thread):
        try:
            thread_run(thread)
        finally:
            thread._manager.memplan_barrier.finish()

    def syncthreads(thread):
        if thread.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        thread._manager.memplan_barrier.arrive(thread)
        thread.syncthreads_event.wait()
        thread.syncthreads_event.clear()
        if thread.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    run_block.memplan_event_driven = True
    sim.BlockManager.run = run_block
    sim.BlockThread.run = run_thread
    sim.BlockThread.syncthreads = syncthreads


def open_device(kind: str = "auto") -> Device:
    """A CUDA device when one is present (or asked for), else the simulator.

    The simulator must be chosen before numba.cuda is first imported: set
    NUMBA_ENABLE_CUDASIM=1 in the environment (``memplan run --device sim`` does).
    """
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() and not simulator_enabled() else "sim"
    if kind == "sim":
        if not simulator_enabled():
            if "numba.cuda" in sys.modules:
                raise DeviceError("the Numba CUDA simulator must be enabled before numba.cuda loads: "
                                  "set NUMBA_ENABLE_CUDASIM=1")
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        speed_up_simulator()
        return Device("sim", torch.device("cpu"))
    if kind != "cuda":
        raise DeviceError(f"unknown device {kind!r}; use cuda, sim or auto")
    if not torch.cuda.is_available():
        raise DeviceError("no CUDA device: use --device sim with a tiny config")
    if simulator_enabled():
        raise DeviceError("NUMBA_ENABLE_CUDASIM=1 is set: unset it to run on the GPU")
    index = torch.cuda.current_device()
    check_compute_capability(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    load_cuda()
    return Device("cuda", torch.device("cuda", index))
