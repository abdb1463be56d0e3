"""executor.kernels.grid_dependency: programmatic dependent launch, held to what it promises.

On the GPU a producer kernel allows its dependents at once, then works for a while before it
writes; a consumer launched through ``Kernel(dependent_launch=True)`` stamps the global timer
before and after its wait. The consumer must start before the producer's write (the launches
overlapped), end its wait after it, and read every value the producer wrote (the wait is a real
barrier), on a stream and replayed from a CUDA graph alike; launched plainly it starts after.
Without PDL (the simulator) the same kernels run in stream order.
"""

from __future__ import annotations

import pytest
import torch

from executor.kernels.grid_dependency import build_grid_dependency, dependent_launch_supported
from executor.kernels.launch import Kernel
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import int64, types  # noqa: E402

BLOCKS = 8
THREADS = 64
PRODUCER_NS = 200_000  # how long the producer works after allowing its dependents


def _global_timer():
    """Device function: the global nanosecond timer (0 in the simulator)."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def zero():
            return int64(0)

        return zero
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def global_timer(typingctx):
        def codegen(context, builder, signature, args):
            return builder.asm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l", [],
                               side_effect=True)

        return types.int64(), codegen

    return global_timer


def _kernels(dependent_launch: bool) -> tuple[Kernel, Kernel]:
    wait, launch_dependents = build_grid_dependency()
    now = _global_timer()

    @cuda.jit
    def producer(values, stamps, work_ns):
        launch_dependents()
        wait()
        start = now()
        while now() - start < work_ns:  # busy, so the next kernel's blocks find the dependency open
            pass
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        values[i] = i + 1
        if cuda.threadIdx.x == 0:
            cuda.atomic.max(stamps, 0, now())  # the producer's last write

    @cuda.jit
    def consumer(values, copies, stamps):
        if cuda.threadIdx.x == 0:
            cuda.atomic.min(stamps, 1, now())  # the consumer's first start
        launch_dependents()
        wait()
        if cuda.threadIdx.x == 0:
            cuda.atomic.min(stamps, 2, now())  # its first return from the wait
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        copies[i] = values[i]

    return Kernel(producer, dependent_launch=True), Kernel(consumer, dependent_launch=dependent_launch)


def _run(producer: Kernel, consumer: Kernel, values, copies, stamps, stream, work_ns: int = PRODUCER_NS) -> None:
    producer[BLOCKS, THREADS, stream](values, stamps, int64(work_ns))
    consumer[BLOCKS, THREADS, stream](values, copies, stamps)


def _buffers(device: str):
    n = BLOCKS * THREADS
    values = torch.zeros(n, dtype=torch.int64, device=device)
    copies = torch.zeros(n, dtype=torch.int64, device=device)
    stamps = torch.tensor([0, 2**62, 2**62], dtype=torch.int64, device=device)
    return values, copies, stamps


def _reset(values, copies, stamps) -> None:
    values.zero_()
    copies.zero_()
    stamps.copy_(torch.tensor([0, 2**62, 2**62], dtype=torch.int64))


def test_kernels_run_in_stream_order_without_pdl():
    """The simulator (or a GPU before sm_90): no PDL; the wait and the trigger are no-ops."""
    if not simulator_enabled():
        pytest.skip("runs in the simulator")
    assert not dependent_launch_supported()
    producer, consumer = _kernels(dependent_launch=True)
    assert not consumer.dependent_launch
    values, copies, stamps = _buffers("cpu")
    _run(producer, consumer, values, copies, stamps, 0, work_ns=0)  # the simulator's timer stands still
    assert torch.equal(copies, torch.arange(1, BLOCKS * THREADS + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_dependent_launch_overlaps_and_waits(graph):
    assert dependent_launch_supported(), "the H200 is sm_90"
    producer, consumer = _kernels(dependent_launch=True)
    values, copies, stamps = _buffers("cuda")
    expected = torch.arange(1, BLOCKS * THREADS + 1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _run(producer, consumer, values, copies, stamps, stream)  # compiles both
        torch.cuda.synchronize()
        if graph:
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, stream=stream):
                _run(producer, consumer, values, copies, stamps, stream)
        for _ in range(3):
            _reset(values, copies, stamps)
            if graph:
                cuda_graph.replay()
            else:
                _run(producer, consumer, values, copies, stamps, stream)
            torch.cuda.synchronize()
            producer_end, consumer_start, consumer_waited = stamps.tolist()
            assert torch.equal(copies, expected)  # every value the producer wrote, after the wait
            assert consumer_start < producer_end, "the consumer did not start before the producer ended"
            assert consumer_waited >= producer_end


@pytest.mark.gpu
def test_plain_launch_starts_after_the_previous_kernel():
    producer, consumer = _kernels(dependent_launch=False)
    values, copies, stamps = _buffers("cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):  # the first call compiles
            _reset(values, copies, stamps)
            _run(producer, consumer, values, copies, stamps, stream)
            torch.cuda.synchronize()
    producer_end, consumer_start, _ = stamps.tolist()
    assert consumer_start >= producer_end
    assert torch.equal(copies, torch.arange(1, BLOCKS * THREADS + 1, device="cuda"))
