"""Compiling a plan's kernels before their first launch, in parallel processes: ``memplan compile``
and the cold start of ``memplan run``.

Kernel discovery (executor/kernel_discovery.py) lists the specializations warm-up and decode-graph
capture launch; those the cache (executor/kernel_cache.py) lacks are compiled concurrently, one
process a core, each without a device (``kernel_compiler.target_device`` answers Numba's device
queries for the target; nvJitLink links on the host), so the processes never open a CUDA context on
the GPU the plan budgets. A process rebuilds the same launchers (discovery over the same plan) and
compiles the keys it is handed, the most complex kernels first (the longest compiles bound the wall
time); each entry lands in the cache, where the run loads it at its first launch.

A start-up manifest (in the cache, keyed by the plan, the executor's sources, the toolchain and the
arch) remembers the keys a plan's start-up needs, so a warm start checks the cache against it and
skips discovery.

``memplan compile --model M --hardware H [--serving S]`` fills the cache for the hardware's compute
capability without a GPU (a deployment image or a CI job can ship it warm); a second call compiles
nothing. ``memplan cache info`` and ``memplan cache clear`` show and empty the cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from executor.kernel_cache import CachedKernel, KernelCache, cache_enabled, default_cache_dir
from executor.kernel_key import Arch, Uncacheable

if TYPE_CHECKING:
    from planner.plan import MemoryPlan

#: How a kernel is compiled in a compile process: (dispatcher, argtypes, arch) -> entry.
CompileFunction = Callable[[Any, tuple, Arch], CachedKernel]
#: Seconds between progress lines when stderr is not a terminal.
PROGRESS_INTERVAL_S = 2.0
EXIT_OK, EXIT_COMPILE_FAILED = 0, 1


class CompileError(ValueError):
    """A ``memplan compile`` input that cannot be compiled for (one line)."""


@dataclass(frozen=True)
class Target:
    """What the kernels are compiled for: an architecture and the SM count the launchers size by."""

    arch: Arch
    num_sms: int


@dataclass(frozen=True)
class PlannedKernel:
    """A kernel specialization start-up needs: its cache key, name, first start-up pass, and the size of
    its description (how much code it pulls in: the compile order's estimate of its cost)."""

    key: str
    name: str
    phase: str
    weight: int


@dataclass
class CompileReport:
    """What a compile pass did: kernels needed, found in the cache, compiled, failed; wall seconds."""

    needed: int = 0
    cached: int = 0
    compiled: int = 0
    uncacheable: int = 0  # needed kernels that cannot be cached (they compile at their first launch)
    failed: list[str] = field(default_factory=list)  # "name: error"
    processes: int = 0
    seconds: float = 0.0
    from_manifest: bool = False  # the keys came from a start-up manifest (no discovery)
    slowest: tuple[str, float] | None = None  # (name, seconds) of the longest compile
    compile_seconds: dict[str, float] = field(default_factory=dict)  # key -> seconds, of those compiled

    def line(self) -> str:
        parts = [f"{self.needed} needed", f"{self.cached} in the cache"]
        if self.compiled or self.processes:
            where = f"{self.processes} process{'es' if self.processes != 1 else ''}" if self.processes else "here"
            parts.append(f"{self.compiled} compiled ({where})")
        if self.uncacheable:
            parts.append(f"{self.uncacheable} not cacheable (compiled at first launch)")
        if self.failed:
            parts.append(f"{len(self.failed)} failed (compiled at first launch)")
        text = ", ".join(parts) + f" in {self.seconds:.1f} s"
        if self.slowest is not None:
            text += f"; slowest {self.slowest[0].rsplit('.', 1)[-1]} {self.slowest[1]:.1f} s"
        return text + (" (start-up manifest)" if self.from_manifest else "")


# -- which kernels ------------------------------------------------------------------------------------------------


#: key -> (dispatcher, argtypes): what compiles a planned kernel.
Sources = dict[str, tuple[Any, tuple]]


def planned_kernels(plan: MemoryPlan, target: Target) -> tuple[list[PlannedKernel], int, Sources]:
    """(the cacheable kernel specializations ``plan``'s start-up needs, how many more cannot be cached,
    what compiles each), by discovery. Run it inside ``target_device(target...)`` in a process without
    a GPU, or on the GPU the target describes."""
    from executor.kernel_discovery import discover
    from executor.kernel_key import describe_kernel, kernel_key

    planned: dict[str, PlannedKernel] = {}
    sources: Sources = {}
    uncacheable = 0
    for need in discover(plan):
        try:
            description = describe_kernel(need.kernel.dispatcher)
            key = kernel_key(need.kernel.dispatcher, need.argtypes, target.arch, description)
        except Uncacheable:
            uncacheable += 1
            continue
        if key not in planned:
            planned[key] = PlannedKernel(key, need.name, need.phase, len(repr(description)))
            sources[key] = (need.kernel.dispatcher, need.argtypes)
    return list(planned.values()), uncacheable, sources


def manifest_digest(plan: MemoryPlan, target: Target) -> str:
    """The start-up manifest's key: the plan, every executor source file, the toolchain and the target."""
    from executor.kernel_key import toolchain

    digest = hashlib.sha256()
    digest.update(plan.model_dump_json().encode())
    digest.update(repr((toolchain(), target.arch.name, target.num_sms)).encode())
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def answered_by_manifest(plan: MemoryPlan, cache: KernelCache, target: Target,
                         digest: str | None = None) -> CompileReport | None:
    """The report of a start whose start-up manifest lists keys that are all in ``cache`` (nothing to
    compile, no discovery); None when there is no such manifest."""
    keys = cache.load_manifest(digest or manifest_digest(plan, target))
    if keys is None or not all(cache.contains(key) for key in keys):
        return None
    return CompileReport(needed=len(keys), cached=len(keys), from_manifest=True)


# -- compiling ----------------------------------------------------------------------------------------------------


@dataclass
class CompileJob:
    """What ``prepare_compile`` found: the report so far, the planned kernels (empty when the start-up
    manifest answered), those the cache lacks (most complex first) and the manifest to write."""

    report: CompileReport
    planned: list[PlannedKernel]
    missing: list[PlannedKernel]
    manifest: str | None
    start: float
    sources: Sources = field(default_factory=dict)  # what compiles each planned kernel here


def prepare_compile(plan: MemoryPlan, cache: KernelCache, target: Target, *,
                    select: Callable[[PlannedKernel], bool] | None = None, use_manifest: bool = False) -> CompileJob:
    """The kernels ``plan``'s start-up needs for ``target`` that ``cache`` lacks: by discovery, or, with
    ``use_manifest``, none when the start-up manifest lists keys that are all cached. ``select`` keeps a
    subset. Discovery runs here: in a process with no GPU inside ``target_device``, or on the GPU the
    target describes."""
    start = time.perf_counter()
    digest = manifest_digest(plan, target) if use_manifest and select is None else None
    if digest is not None:
        answered = answered_by_manifest(plan, cache, target, digest)
        if answered is not None:
            return CompileJob(answered, [], [], None, start)
    planned, uncacheable, sources = planned_kernels(plan, target)
    if select is not None:
        planned = [kernel for kernel in planned if select(kernel)]
    missing = sorted((kernel for kernel in planned if not cache.contains(kernel.key)), key=lambda k: -k.weight)
    report = CompileReport(needed=len(planned) + uncacheable, cached=len(planned) - len(missing),
                           uncacheable=uncacheable)
    return CompileJob(report, planned, missing, digest, start, sources)


def listed_by_pool(plan: MemoryPlan, cache: KernelCache, target: Target, pool: CompilePool, start: float) -> CompileJob:
    """``prepare_compile``'s job with discovery run by one of ``pool``'s processes, which discover as they
    start: this process, busy materializing and loading weights, runs none."""
    planned, uncacheable = pool.executor.submit(list_task, plan.model_dump_json(), target.arch.major,
                                                target.arch.minor, target.num_sms).result()
    missing = sorted((kernel for kernel in planned if not cache.contains(kernel.key)), key=lambda k: -k.weight)
    report = CompileReport(needed=len(planned) + uncacheable, cached=len(planned) - len(missing),
                           uncacheable=uncacheable)
    return CompileJob(report, planned, missing, manifest_digest(plan, target), start)


def run_compile(job: CompileJob, plan: MemoryPlan, cache: KernelCache, target: Target, *, jobs: int,
                progress: TextIO | None = None, compile_function: CompileFunction | None = None,
                in_process: bool = False, pool: CompilePool | None = None) -> CompileReport:
    """Compile ``job``'s missing kernels into ``cache``: in ``jobs`` processes (``pool``'s, when given,
    started early), or here (``in_process``: this process must be inside ``target_device``).
    ``compile_function`` (default ``kernel_compiler.compile_image``) compiles one kernel (a module-level
    function: processes get it by name). Writes the start-up manifest when nothing failed. Progress goes
    to ``progress``."""
    report = job.report
    if job.missing:
        _compile_missing(plan, cache, target, job, jobs, progress, compile_function, in_process, pool)
    elif pool is not None:
        pool.close()
    if job.manifest is not None and not report.failed:
        cache.store_manifest(job.manifest, [kernel.key for kernel in job.planned])
    report.seconds = time.perf_counter() - job.start
    return report


def _compile_missing(plan: MemoryPlan, cache: KernelCache, target: Target, job: CompileJob, jobs: int,
                     progress: TextIO | None, compile_function: CompileFunction | None, in_process: bool,
                     pool: CompilePool | None) -> None:
    report, missing = job.report, job.missing
    bar = Progress(len(missing), progress)
    names = {kernel.key: kernel.name for kernel in missing}

    def done(key: str, seconds: float, error: str | None) -> None:
        if error is None:
            report.compiled += 1
            report.compile_seconds[key] = seconds
            if report.slowest is None or seconds > report.slowest[1]:
                report.slowest = (names[key], seconds)
        else:
            report.failed.append(f"{names[key]}: {error}")
        bar.advance()

    task = functools.partial(compile_task, plan.model_dump_json(), target.arch.major, target.arch.minor,
                             target.num_sms, str(cache.root), compile_function)
    try:
        if in_process:
            for kernel in missing:
                done(kernel.key, *_compile_into(cache, kernel.key, *job.sources[kernel.key], target.arch,
                                                compile_function))
            return
        pool = pool or CompilePool(plan, target, min(jobs, len(missing)))
        report.processes = pool.processes
        with pool:
            futures = {pool.executor.submit(task, kernel.key): kernel.key for kernel in missing}
            for future in concurrent.futures.as_completed(futures):
                try:
                    done(*future.result())
                except Exception as error:  # a process died (memory, a crash in a compiler)
                    done(futures[future], 0.0, f"{type(error).__name__}: {error}")
    finally:
        bar.finish()


class CompilePool:
    """``processes`` compile processes (spawned, no GPU), started at once: each imports the executor
    and discovers ``plan``'s kernels for ``target`` as it starts, so a pool started before this
    process's own discovery has its processes ready when the first keys arrive."""

    def __init__(self, plan: MemoryPlan, target: Target, processes: int) -> None:
        self.processes = max(1, processes)
        context = multiprocessing.get_context("spawn")  # no fork after CUDA (or numba) initialized here
        self.executor = concurrent.futures.ProcessPoolExecutor(
            self.processes, mp_context=context, initializer=prepare_compile_process,
            initargs=(plan.model_dump_json(), target.arch.major, target.arch.minor, target.num_sms))
        for _ in range(self.processes):  # the executor spawns a process per submitted task, up to its size
            self.executor.submit(_ready)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.executor.shutdown(wait=True)


def _ready() -> None:
    """The task that makes a pool spawn its processes."""


def prepare_compile_process(plan_json: str, major: int, minor: int, num_sms: int) -> None:
    """A compile process's start: no GPU (``isolate_compile_process``), then discovery of the plan's
    kernels, which its compile tasks then find cached. A discovery that fails here fails again, with
    its error, in each task."""
    isolate_compile_process()
    import torch

    torch.set_num_threads(1)  # a core per process: intra-op threads would contend with the others
    from executor.kernel_compiler import target_device

    with target_device(Arch(major, minor), num_sms):
        try:
            _process_kernels(plan_json, major, minor, num_sms)
        except Exception:
            pass


def isolate_compile_process() -> None:
    """A compile process compiles for a target and never touches a GPU: no visible devices (no CUDA
    context on the device the plan budgets) and never the simulator. Runs before numba loads there."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)


def compile_task(plan_json: str, major: int, minor: int, num_sms: int, cache_root: str,
                 compile_function: CompileFunction | None, key: str) -> tuple[str, float, str | None]:
    """Compile the kernel of ``key`` (one of the plan's planned kernels) into the cache at ``cache_root``,
    unless it is there already: (key, seconds, error or None)."""
    from executor.kernel_compiler import target_device

    arch = Arch(major, minor)
    with target_device(arch, num_sms):
        try:
            kernels = _process_kernels(plan_json, major, minor, num_sms)
        except Exception as error:
            return key, 0.0, f"discovery failed: {_one_line(error)}"
        if key not in kernels:
            return key, 0.0, "not among this process's discovered kernels (the sources changed?)"
        return (key, *_compile_into(KernelCache(Path(cache_root)), key, *kernels[key], arch, compile_function))


def _compile_into(cache: KernelCache, key: str, dispatcher: Any, argtypes: tuple, arch: Arch,
                  compile_function: CompileFunction | None) -> tuple[float, str | None]:
    """Compile one kernel into ``cache`` unless it is there: (seconds, error or None)."""
    from executor.kernel_compiler import compile_image

    start = time.perf_counter()
    try:
        cache.get_or_build(key, lambda: (compile_function or compile_image)(dispatcher, argtypes, arch))
    except Exception as error:
        return time.perf_counter() - start, _one_line(error)
    return time.perf_counter() - start, None


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0] if text else type(error).__name__


@functools.cache
def _process_discovery(plan_json: str, major: int, minor: int, num_sms: int) -> tuple[list[PlannedKernel], int, Sources]:
    """``planned_kernels`` of a plan, discovered once per compile process."""
    from planner.plan import MemoryPlan

    return planned_kernels(MemoryPlan.model_validate_json(plan_json), Target(Arch(major, minor), num_sms))


def _process_kernels(plan_json: str, major: int, minor: int, num_sms: int) -> Sources:
    """What compiles each of a plan's planned kernels (this process's discovery)."""
    return _process_discovery(plan_json, major, minor, num_sms)[2]


def list_task(plan_json: str, major: int, minor: int, num_sms: int) -> tuple[list[PlannedKernel], int]:
    """In a compile process: the plan's cacheable planned kernels and the count of uncacheable ones."""
    from executor.kernel_compiler import target_device

    with target_device(Arch(major, minor), num_sms):
        planned, uncacheable, _ = _process_discovery(plan_json, major, minor, num_sms)
    return planned, uncacheable


class Progress:
    """``compiling kernels: done/total, seconds`` on a stream: rewritten in place on a terminal, else a
    line every PROGRESS_INTERVAL_S and at the end. No stream: silent."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.start = self.last = time.perf_counter()
        self._print(final=False)

    def advance(self) -> None:
        self.done += 1
        if self.tty or time.perf_counter() - self.last >= PROGRESS_INTERVAL_S:
            self._print(final=False)

    def finish(self) -> None:
        self._print(final=True)

    def _print(self, final: bool) -> None:
        if self.stream is None:
            return
        self.last = time.perf_counter()
        text = f"memplan: compiling kernels: {self.done}/{self.total}, {self.last - self.start:.1f} s"
        if self.tty:
            print("\r" + text, end="\n" if final else "", file=self.stream, flush=True)
        elif final or self.done < self.total:
            print(text, file=self.stream, flush=True)


# -- memplan run: the cold start ------------------------------------------------------------------------------------


class StartupCompile:
    """The cold-start compile of ``memplan run`` on a GPU: the manifest check here (on the caller's
    thread); on a cold start a background thread spawns the compile processes, one of them lists the
    kernels (discovery) while the others start, and they compile the missing ones, while the run
    materializes and loads weights; ``wait`` joins it. Failures are reported, not raised: those
    kernels compile at their first launch."""

    def __init__(self, plan: MemoryPlan, cache: KernelCache, progress: TextIO | None, jobs: int | None = None) -> None:
        from executor.kernel_compiler import device_arch
        from executor.kernels.primitives.launch import multiprocessor_count

        target = Target(device_arch(), multiprocessor_count())
        self.report: CompileReport | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        start, pool, job = time.perf_counter(), None, None
        try:
            answered = answered_by_manifest(plan, cache, target)
        except Exception as error:  # an unreadable cache: the run goes on, compiling at first launch
            self.error = error
            return
        if answered is not None:
            job = CompileJob(answered, [], [], None, start)

        def run() -> None:
            nonlocal pool
            try:
                if job is None:  # cold: spawn the processes here (seconds), one of them lists the kernels
                    pool = CompilePool(plan, target, jobs or available_cores())
                listed = job or listed_by_pool(plan, cache, target, pool, start)
                self.report = run_compile(listed, plan, cache, target, jobs=jobs or available_cores(),
                                          progress=progress, pool=pool)
            except BaseException as error:  # reported by wait(); the run goes on, compiling at first launch
                self.error = error
                if pool is not None:
                    pool.close()

        self._thread = threading.Thread(target=run, name="memplan-compile", daemon=True)
        self._thread.start()

    def wait(self) -> CompileReport:
        if self._thread is not None:
            self._thread.join()
        if self.report is None:
            message = f"{type(self.error).__name__}: {self.error}" if self.error else "no report"
            return CompileReport(failed=[f"start-up compile: {message}"])
        return self.report


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# -- memplan compile / memplan cache ------------------------------------------------------------------------------


def compile_command(args: argparse.Namespace, overrides: dict[str, object], out: TextIO | None = None,
                    err: TextIO | None = None) -> int:
    """``memplan compile``: fill the cache for the hardware's compute capability, no GPU needed (output to
    ``out`` and ``err``, stdout and stderr by default)."""
    out, err = out or sys.stdout, err or sys.stderr
    from executor.device import MIN_COMPUTE_CAPABILITY
    from executor.kernel_compiler import target_device
    from planner.loader import plan_from_configs

    if args.jobs is not None and args.jobs < 1:
        raise CompileError(f"--jobs must be at least 1, got {args.jobs}")
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        raise CompileError("memplan compile compiles for a GPU: unset NUMBA_ENABLE_CUDASIM")
    if not cache_enabled():
        raise CompileError("the kernel cache is off (MEMPLAN_KERNEL_CACHE=0): nothing to fill")
    plan = plan_from_configs(args.model, args.hardware, args.serving or "default", overrides)
    arch = Arch.from_capability(plan.hardware.compute_capability)
    if (arch.major, arch.minor) < MIN_COMPUTE_CAPABILITY:
        minimum = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        raise CompileError(f"hardware {plan.hardware.name} has compute capability {plan.hardware.compute_capability}; "
                           f"the kernels compile for {minimum} or later")
    target = Target(arch, plan.hardware.num_sms)
    cache = KernelCache(default_cache_dir())
    select = (lambda kernel: args.kernels in kernel.name) if args.kernels else None
    jobs = args.jobs or available_cores()
    with target_device(arch, target.num_sms):  # this process has no GPU, or must compile for another
        job = prepare_compile(plan, cache, target, select=select, use_manifest=select is None and not args.list)
        report = run_compile(job, plan, cache, target, jobs=jobs, progress=err, in_process=jobs == 1)
    planned = job.planned
    print(f"memplan compile: {plan.model.name} on {plan.hardware.name} ({arch.name}, {target.num_sms} SMs): "
          f"{report.line()}", file=out)
    if args.list:
        for kernel in planned:
            seconds = report.compile_seconds.get(kernel.key)
            state = "cached" if seconds is None else f"{seconds:.1f} s"
            print(f"  {kernel.key[:16]}  {kernel.phase:<16}  {state:>8}  {kernel.name}", file=out)
    for failure in report.failed:
        print(f"memplan compile: failed: {failure}", file=err)
    info = cache.info()
    print(f"kernel cache: {info.root} ({info.entries} entries, {info.bytes:,} bytes)", file=out)
    return EXIT_COMPILE_FAILED if report.failed else EXIT_OK


def cache_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``memplan cache info`` / ``memplan cache clear`` (output to ``out``, stdout by default)."""
    out = out or sys.stdout
    cache = KernelCache(default_cache_dir())
    if args.action == "clear":
        removed = cache.clear()
        print(f"memplan cache: removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.root}", file=out)
        return EXIT_OK
    info = cache.info()
    state = "on" if info.enabled else "off (MEMPLAN_KERNEL_CACHE=0, or the simulator)"
    print(f"kernel cache: {info.root} ({state})", file=out)
    print(f"entries: {info.entries} ({info.bytes:,} bytes)", file=out)
    for arch, count in sorted(info.by_arch.items()):
        print(f"  {arch}: {count}", file=out)
    for tools, count in sorted(info.by_toolchain.items()):
        print(f"  {tools}: {count}", file=out)
    print(f"corrupt entries: {info.corrupt}; temporary files: {info.temporary}", file=out)
    return EXIT_OK
