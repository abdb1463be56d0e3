"""The ranks of a tensor-parallel run: rank 0 in the caller's process, the others as worker processes.

``Ranks.start(plan, device, weights, seed)`` starts ranks 1 .. tp - 1 as processes of this host
(spawned, one GPU each on CUDA), or, under ``torchrun`` (RANK, WORLD_SIZE and LOCAL_RANK in the
environment), takes this process's rank from it and leaves the others to torchrun. Rank 0 runs the
scheduler and the engine over its model (executor/serving.py); a worker (``serve_rank``)
materializes the same per-rank plan on its own device, loads its shards, and ``follow``s rank 0's
announced steps, slot resets and graph capture (executor/models/decoder.py), and answers rank 0's
memory measure (``RankMemory``, for the run report), until rank 0 says stop.

Rendezvous: rank 0 serves the group's store (a TCPStore on a free loopback port) before it spawns
the workers; each worker connects, sets its ready key, and joins. Rank 0 joins once every worker's
key is there, watching the workers meanwhile, so a worker that fails before it joins (an import, its
GPU, its plan) ends the start at once with its error instead of after the rendezvous timeout.

Failures: a worker that raises sends its rank and error to rank 0's process (a queue) and exits;
its peers' collectives then fail (its connections close, or the group's timeout passes), and rank
0 reports the first failed worker: ``RankError`` naming the rank and its error, never a hang.
A rank that stops answering ends rank 0's collective at the group's timeout, and the RankError
names the workers still running. ``Ranks.stop`` ends a run that went well with the stop message; on
a failure the worker processes are terminated (they may be waiting inside a step's collective).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from executor.parallel import COLLECTIVE_TIMEOUT_S, RankError, TensorParallel

if TYPE_CHECKING:
    from executor.models.decoder import DecoderModel
    from planner.plan import MemoryPlan

#: Seconds rank 0 waits for a failed worker's report (or exit) after its own collective failed (at most
#: the group's timeout: a short timeout asks for a quick verdict).
FAILURE_REPORT_S = 10.0
#: Seconds ``Ranks.stop`` waits for each worker to exit after the stop message.
STOP_WAIT_S = 30.0
#: The messages rank 0 announces (executor/models/decoder.py) and ``follow`` runs.
STEP, RESET_SLOT, COPY_SLOT, CAPTURE, STOP = "step", "reset_slot", "copy_slot", "capture_decode_graphs", "stop"
#: Rank 0's request for every rank's RankMemory (``Ranks.measure``).
MEASURE = "measure"
#: The store key a spawned worker sets once it reaches rank 0's store (its rank appended).
READY_KEY = "memplan/ready/"
#: Seconds between rank 0's looks at the ready count and the workers while they start.
START_POLL_S = 0.05
#: torchrun's environment.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class RankSpec:
    """What a worker needs to open its rank: the plan, the device kind, the weights, where to meet."""

    plan: MemoryPlan
    device: str  # "cuda" or "sim"
    weights: str  # a checkpoint directory, or serving.RANDOM_WEIGHTS
    seed: int
    address: str  # the group's rendezvous: tcp://host:port of rank 0's store, or env:// under torchrun
    timeout_s: float = COLLECTIVE_TIMEOUT_S  # the group's collectives
    start_timeout_s: float = COLLECTIVE_TIMEOUT_S  # reaching rank 0's store (a worker's imports, its GPU)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory as measured on its device: the bytes its plan materializes, the bytes its arena
    allocated, and on CUDA the bytes torch's allocator holds, its allocation count and the device's bytes
    in use (cudaMemGetInfo total - free: the rank's process, its CUDA context and NCCL's buffers, and any
    other process on that GPU), against the plan's usable bytes (None in the simulator)."""

    rank: int
    planned_bytes: int
    allocated_bytes: int
    reserved_bytes: int | None
    allocations: int | None
    device_used_bytes: int | None = None
    usable_bytes: int = 0

    @classmethod
    def of(cls, model: DecoderModel) -> RankMemory:
        import torch

        arena = model.arena
        planned = sum(pool.bytes for pool in arena.plan.pools if pool.materialized)
        usable = arena.plan.budget.usable_bytes
        if model.device.is_sim:
            return cls(arena.rank, planned, arena.allocated_bytes, None, None, None, usable)
        device = model.device.torch_device
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(arena.rank, planned, arena.allocated_bytes, torch.cuda.memory_reserved(device),
                   torch.cuda.memory_stats(device)["allocation.all.allocated"], total - free, usable)


def memory_lines(before: list[RankMemory], after: list[RankMemory]) -> list[str]:
    """The report's lines of each rank's planned vs allocated bytes, with (CUDA) the allocator's reserved
    bytes and the allocations made between ``before`` and ``after``."""
    lines = []
    for start, end in zip(before, after):
        line = f"rank {end.rank}: planned {end.planned_bytes:,} bytes, allocated {end.allocated_bytes:,}"
        if end.reserved_bytes is not None and start.allocations is not None and end.allocations is not None:
            line += (f", allocator reserved {end.reserved_bytes:,}, allocations during the run "
                     f"{end.allocations - start.allocations}")
        if end.device_used_bytes is not None and end.usable_bytes:
            line += (f", device in use {end.device_used_bytes:,} vs plan usable {end.usable_bytes:,} "
                     f"({end.device_used_bytes / end.usable_bytes:.1%})")
        lines.append(line)
    return lines


def under_torchrun() -> bool:
    """Whether torchrun started this process (its rank variables are set)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def torchrun_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    return tuple(int(os.environ[name]) for name in TORCHRUN_VARIABLES)  # type: ignore[return-value]


def select_gpu(local_rank: int, device: str) -> None:
    """On CUDA, make GPU ``local_rank`` this process's current device (before anything touches CUDA)."""
    if device == "cuda":
        import torch

        if local_rank >= torch.cuda.device_count():
            raise RankError(local_rank, f"needs GPU {local_rank}, the host has {torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)


def follow(model: DecoderModel, parallel: TensorParallel) -> None:
    """A worker's loop: run each message rank 0 announces, in order, until STOP."""
    while True:
        message = parallel.receive()
        kind = message[0]
        if kind == STEP:
            model.step(message[1], pad_to=message[2])
        elif kind == RESET_SLOT:
            model.reset_slot(message[1])
        elif kind == COPY_SLOT:
            model.copy_slot(message[1], message[2])
        elif kind == CAPTURE:
            model.capture_decode_graphs()
        elif kind == MEASURE:
            parallel.gather_to_driver(RankMemory.of(model))
        elif kind == STOP:
            return
        else:
            raise ValueError(f"rank {parallel.rank}: unknown message {kind!r} from rank 0")


def open_rank(spec: RankSpec, parallel: TensorParallel) -> DecoderModel:
    """Rank ``parallel.rank``'s model: the plan materialized on this process's device, its weight shards
    loaded. It compiles nothing at start: every rank runs the same per-rank plan, so rank 0's start-up
    compile (executor/compile.py) fills the persistent kernel cache with this rank's kernels too before
    rank 0 announces the first step, where this rank's first launch loads them from the cache."""
    from executor.arena import materialize
    from executor.device import open_device
    from executor.models import build_model
    from executor.serving import RANDOM_WEIGHTS
    from executor.weights import fill_random, load_checkpoint

    device = open_device(spec.device)
    arena = materialize(spec.plan, device, parallel.rank)
    if spec.weights == RANDOM_WEIGHTS:
        fill_random(arena, spec.seed)
    else:
        load_checkpoint(arena, spec.weights)
    model = build_model(arena, parallel)
    device.synchronize()
    return model


#: A worker rank's body: (spec, rank, local rank) -> None once rank 0 says stop; raises on failure.
Worker = Callable[[RankSpec, int, int], None]


def serve_rank(spec: RankSpec, rank: int, local_rank: int) -> None:
    """A worker rank from start to stop: join the group, open the rank, follow rank 0, leave. On an error
    the group is left as it is (the process exits and its connections close, which ends the peers' waits)."""
    from executor.serving import choose_simulator

    choose_simulator(spec.device)
    select_gpu(local_rank, spec.device)
    tp = spec.plan.serving.tensor_parallel_size
    store = None
    if spec.address.startswith("tcp://"):  # rank 0's store (not torchrun's env://)
        store = connect_store(spec.address, tp, spec.start_timeout_s)
        store.set(f"{READY_KEY}{rank}", "1")
    parallel = TensorParallel.join(rank, tp, spec.address, spec.device, spec.timeout_s, store=store)
    follow(open_rank(spec, parallel), parallel)
    parallel.close()


def serve_torchrun_rank(plan: MemoryPlan, device: str, weights: str, seed: int) -> None:
    """Under torchrun, a process of rank > 0: serve that rank until rank 0 stops the run. A failure is a
    RankError naming this rank (torchrun then ends the other processes)."""
    rank, world, local_rank = torchrun_rank()
    tp = plan.serving.tensor_parallel_size
    if world != tp:
        raise RankError(rank, f"torchrun started {world} ranks, the plan's tensor_parallel_size is {tp}")
    try:
        serve_rank(RankSpec(plan, device, str(weights), seed, "env://"), rank, local_rank)
    except RankError:
        raise
    except Exception as error:
        raise RankError(rank, describe(error)) from error


def describe(error: BaseException) -> str:
    """``error`` in one line with the place it was raised: what a failed rank reports."""
    last = traceback.extract_tb(error.__traceback__)[-1:]
    where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def _worker_main(worker: Worker, spec: RankSpec, rank: int, errors: Any) -> None:
    """A spawned worker's entry: ``worker``; an error goes to rank 0's queue, then the process exits 1."""
    try:
        worker(spec, rank, rank)
    except BaseException as error:  # noqa: BLE001 (every failure must reach rank 0, KeyboardInterrupt included)
        errors.put((rank, describe(error)))
        raise SystemExit(1) from None


def _collective_error(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective (gloo raises plain RuntimeErrors, NCCL torch's DistErrors)."""
    import torch.distributed as dist

    return type(error) is RuntimeError or isinstance(error, dist.DistError)


def _abort_group() -> None:
    """Abort this process's process group, so that its pending collectives fail (where torch can)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except RuntimeError:
            pass


def serve_store(world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store: a TCPStore server on a free port of this host's loopback."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect_store(address: str, world_size: int, timeout_s: float) -> Any:
    """A worker's client of rank 0's store at ``tcp://host:port``."""
    import torch.distributed as dist

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=timeout_s))


@dataclass
class Ranks:
    """Rank 0's handle on a tensor-parallel run: its group, and the worker processes it started (none
    under torchrun)."""

    parallel: TensorParallel
    processes: list[Any] = field(default_factory=list)  # multiprocessing Processes of ranks 1 .. tp - 1
    errors: Any = None  # the workers' error queue
    stopped: bool = False
    first_failure: RankError | None = None
    timeout_s: float = COLLECTIVE_TIMEOUT_S  # the group's collectives' timeout
    store: Any = None  # the rendezvous store rank 0 serves (kept for the group's lifetime)

    @classmethod
    def start(cls, plan: MemoryPlan, device: str, weights: str, seed: int,
              timeout_s: float = COLLECTIVE_TIMEOUT_S, worker: Worker = serve_rank,
              start_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Ranks:
        """Start the workers of ``plan``'s tensor_parallel_size on ``device`` ("cuda" or "sim") and join
        the group as rank 0; under torchrun join as rank 0 of torchrun's group (its other processes run
        ``serve_torchrun_rank``). ``timeout_s``: the collectives' timeout; ``start_timeout_s``: how long
        the workers may take to reach rank 0's store; ``worker``: each spawned rank's body (a module-level
        function)."""
        import multiprocessing

        tp = plan.serving.tensor_parallel_size
        if under_torchrun():
            rank, world, local_rank = torchrun_rank()
            if world != tp:
                raise RankError(rank, f"torchrun started {world} ranks, the plan's tensor_parallel_size is {tp}")
            if rank != 0:
                raise RankError(rank, "under torchrun only rank 0 serves requests; the others serve_torchrun_rank")
            select_gpu(local_rank, device)
            return cls(TensorParallel.join(rank, world, "env://", device, timeout_s), timeout_s=timeout_s)
        store = serve_store(tp, start_timeout_s)
        spec = RankSpec(plan, device, str(weights), seed, f"tcp://127.0.0.1:{store.port}", timeout_s,
                        start_timeout_s)
        context = multiprocessing.get_context("spawn")
        errors = context.Queue()
        processes = [context.Process(target=_worker_main, args=(worker, spec, rank, errors),
                                     name=f"memplan rank {rank}", daemon=True) for rank in range(1, tp)]
        for process in processes:
            process.start()
        ranks = cls(None, processes, errors, timeout_s=timeout_s, store=store)  # type: ignore[arg-type]
        try:
            select_gpu(0, device)
            ranks.parallel = ranks._join(spec, store)
        except BaseException as error:
            reported = ranks.reported(ranks.report_wait_s)
            ranks.stop(force=True)
            raise (reported or error) from error
        if device == "cuda":
            ranks.watch()
        return ranks

    def measure(self, model: DecoderModel) -> list[RankMemory]:
        """Every rank's RankMemory now (rank 0's from ``model``), in rank order."""
        self.parallel.announce((MEASURE,))
        return self.parallel.gather_to_driver(RankMemory.of(model))

    def _join(self, spec: RankSpec, store: Any) -> TensorParallel:
        """Join the group as rank 0 once every worker set its ready key in ``store``; a worker that fails
        first is raised (its RankError), and a worker still missing after the timeout is a RankError
        naming it."""
        tp = spec.plan.serving.tensor_parallel_size
        deadline = time.monotonic() + spec.start_timeout_s
        missing = list(range(1, tp))
        while missing:
            missing = [rank for rank in missing if not store.check([f"{READY_KEY}{rank}"])]
            reported = self.reported(0.0)
            if reported is not None:
                raise reported
            if missing and time.monotonic() > deadline:
                raise RankError(missing[0], f"did not reach rank 0's store within {spec.start_timeout_s:g} s (ranks "
                                f"missing: {', '.join(map(str, missing))})")
            time.sleep(START_POLL_S if missing else 0.0)
        return TensorParallel.join(0, tp, spec.address, spec.device, spec.timeout_s, store=store)

    @property
    def report_wait_s(self) -> float:
        """Seconds to wait for a failed worker's report: FAILURE_REPORT_S, at most the group's timeout."""
        return min(FAILURE_REPORT_S, self.timeout_s)

    def failure(self, error: BaseException) -> BaseException:
        """What to raise for ``error`` of rank 0's process, with the run stopped on every rank (the workers
        terminated: they may be inside a step's collective, where no stop message reaches them). The first
        failed worker's RankError when a worker failed (after a collective failed, it waits up to
        FAILURE_REPORT_S for the worker's report); a collective that failed with no worker failed (one
        stopped answering: the group's timeout) is a RankError naming the workers still running; any other
        error is ``error`` itself."""
        collective = _collective_error(error)
        reported = self.reported(self.report_wait_s if collective and self.processes else 0.0)
        running = [rank for rank, process in enumerate(self.processes, start=1) if process.is_alive()]
        self.stop(force=True)
        if reported is not None:
            return reported
        if not collective:
            return error
        if not self.processes:  # under torchrun: another process of it stopped
            return RankError(self.parallel.rank, f"{describe(error)} (torchrun names the rank that stopped)")
        detail = (f"did not answer within the collectives' timeout of {self.timeout_s:g} s (its process was still "
                  f"running; rank 0's collective: {describe(error)})")
        if len(running) == 1:
            return RankError(running[0], detail)
        ranks = ", ".join(map(str, running))
        return RankError(0, f"a collective waited past its timeout of {self.timeout_s:g} s; ranks {ranks} were "
                         f"still running and none reported an error ({describe(error)})")

    def reported(self, wait_s: float) -> RankError | None:
        """The first worker failure (kept once found): its queued report, or a worker that exited with an
        error code and none."""
        deadline = time.monotonic() + wait_s
        while self.first_failure is None:
            try:
                if self.errors is not None:
                    self.first_failure = RankError(*self.errors.get(timeout=0.1))
                    break
            except queue.Empty:
                pass
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode not in (None, 0):
                    try:  # its report may land just after its exit
                        self.first_failure = RankError(*self.errors.get(timeout=0.5))
                    except queue.Empty:
                        self.first_failure = RankError(rank, f"its process exited with code {process.exitcode}")
                    break
            if time.monotonic() >= deadline:
                break
        return self.first_failure

    def watch(self) -> None:
        """On CUDA: a thread that waits for a worker to fail while rank 0 may be blocked on the device
        (an NCCL collective of a dead peer waits on the GPU, not in a host call that raises). It aborts
        the group, so that rank 0's collectives fail and ``failure`` reports the worker; if rank 0 has
        not stopped the run FAILURE_REPORT_S later, it prints the failure and ends the process."""
        import sys
        from multiprocessing.connection import wait

        def watching() -> None:
            alive = {process.sentinel: process for process in self.processes}
            while alive and not self.stopped:
                for sentinel in wait(list(alive), timeout=1.0):
                    process = alive.pop(sentinel)
                    if process.exitcode != 0 and not self.stopped:
                        failure = self.reported(self.report_wait_s)
                        _abort_group()
                        time.sleep(self.report_wait_s)
                        if not self.stopped:
                            print(f"memplan: error: {failure}", file=sys.stderr, flush=True)
                            for other in self.processes:
                                if other.is_alive():
                                    other.terminate()
                            os._exit(2)

        threading.Thread(target=watching, name="memplan rank watch", daemon=True).start()

    def stop(self, force: bool = False) -> None:
        """End the run on every rank: the stop message (unless ``force``: the group may be broken), then
        leave the group and wait for the workers (terminated after STOP_WAIT_S, or at once when forced)."""
        if self.stopped:
            return
        self.stopped = True
        if self.parallel is not None and not force:
            try:
                self.parallel.announce((STOP,))
            except RuntimeError:
                force = True
        for process in self.processes:
            process.join(0.0 if force else STOP_WAIT_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_WAIT_S)
        if self.parallel is not None:
            if force:
                _abort_group()  # a broken group's communicators may not shut down cleanly
            self.parallel.close()
