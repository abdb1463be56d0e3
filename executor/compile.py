"""Compiling a plan's kernels before their first launch, in parallel processes: ``memplan compile``
and the cold start of ``memplan run``.

Kernel discovery (executor/kernel_discovery.py) lists the specializations warm-up and decode-graph
capture launch; those the cache (executor/kernel_cache.py) lacks are compiled concurrently, one
process a core, each without a device (``kernel_compiler.target_device`` answers Numba's device
queries for the target; nvJitLink links on the host), so no compile ever opens a CUDA context on the
GPU the plan budgets. The compile processes are forked from the process that ran discovery, so each
inherits the dispatcher it compiles (no imports, no discovery of its own); the most complex kernels
go first (the longest compiles bound the wall time), and each entry lands in the cache, where the run
loads it at its first launch.

``memplan run`` starts its cold-start compile before it imports torch: one start-up process, spawned
right after the plan is built, discovers the plan's kernels for the plan's hardware a start-up pass
at a time and forks a compile as each pass ends, while the run imports, materializes and loads
weights.

A start-up manifest (in the cache, keyed by the plan, the executor's sources, the toolchain and the
arch) remembers the keys a plan's start-up needs, so a warm start checks the cache against it and
skips discovery.

``memplan compile --model M --hardware H [--serving S]`` fills the cache for the hardware's compute
capability without a GPU (a deployment image or a CI job can ship it warm); a second call compiles
nothing. ``memplan cache info`` and ``memplan cache clear`` show and empty the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from executor.kernel_cache import CachedKernel, KernelCache, cache_enabled, default_cache_dir
from executor.kernel_key import Arch, Uncacheable

if TYPE_CHECKING:
    from executor.kernel_discovery import KernelNeed
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

    def describe(self) -> str:
        return f"{self.arch.name}, {self.num_sms} SMs"


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

    def record(self, kernel: PlannedKernel, seconds: float, error: str | None) -> None:
        """Count one compile of ``kernel``: ``seconds`` long, failed with ``error`` unless None."""
        if error is None:
            self.compiled += 1
            self.compile_seconds[kernel.key] = seconds
            if self.slowest is None or seconds > self.slowest[1]:
                self.slowest = (kernel.name, seconds)
        else:
            self.failed.append(f"{kernel.name}: {error}")

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

    planned: dict[str, PlannedKernel] = {}
    sources: Sources = {}
    uncacheable = add_needs(discover(plan), target, planned, sources)
    return list(planned.values()), uncacheable, sources


def add_needs(needs: list[KernelNeed], target: Target, planned: dict[str, PlannedKernel], sources: Sources) -> int:
    """Key ``needs`` for ``target`` into ``planned`` and ``sources`` (those not there yet); returns how
    many cannot be cached."""
    from executor.kernel_key import describe_kernel, kernel_key

    uncacheable = 0
    for need in needs:
        try:
            description = describe_kernel(need.kernel.dispatcher)
            key = kernel_key(need.kernel.dispatcher, need.argtypes, target.arch, description)
        except Uncacheable:
            uncacheable += 1
            continue
        if key not in planned:
            planned[key] = PlannedKernel(key, need.name, need.phase, len(repr(description)))
            sources[key] = (need.kernel.dispatcher, need.argtypes)
    return uncacheable


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


def run_compile(job: CompileJob, plan: MemoryPlan, cache: KernelCache, target: Target, *, jobs: int,
                progress: TextIO | None = None, compile_function: CompileFunction | None = None,
                in_process: bool = False) -> CompileReport:
    """Compile ``job``'s missing kernels into ``cache``: in up to ``jobs`` children forked from this
    process (which ran the discovery: a child inherits what compiles its kernel), or here
    (``in_process``). Either way this process must be inside ``target_device``. ``compile_function``
    (default ``kernel_compiler.compile_image``) compiles one kernel. Writes the start-up manifest when
    nothing failed. Progress goes to ``progress``."""
    report, missing = job.report, job.missing
    if missing:
        bar = Progress(len(missing), progress)
        try:
            if in_process:
                for kernel in missing:
                    report.record(kernel, *_compile_into(cache, kernel.key, *job.sources[kernel.key], target.arch,
                                                         compile_function))
                    bar.advance()
            else:
                report.processes = min(jobs, len(missing))
                with ForkedCompiles(cache, target, jobs, compile_function) as forks:
                    forks.add([(kernel, *job.sources[kernel.key]) for kernel in missing])
                    for kernel, seconds, error in forks.results():
                        report.record(kernel, seconds, error)
                        bar.advance()
        finally:
            bar.finish()
    if job.manifest is not None and not report.failed:
        cache.store_manifest(job.manifest, [kernel.key for kernel in job.planned])
    report.seconds = time.perf_counter() - job.start
    return report


class ForkedCompiles:
    """Kernels compiled in children forked from this process, at most ``jobs`` at a time, the most
    complex pending one first. This process has discovered them (a child inherits the dispatcher and
    argument types it compiles: no imports, no discovery of its own) and runs inside
    ``target_device``; it must hold no CUDA context and start no threads before the forks. A child
    compiles one kernel into the cache and sends back (seconds, error)."""

    def __init__(self, cache: KernelCache, target: Target, jobs: int,
                 compile_function: CompileFunction | None = None) -> None:
        self.cache, self.target, self.jobs, self.compile_function = cache, target, max(1, jobs), compile_function
        self._context = multiprocessing.get_context("fork")
        self._pending: list[tuple[PlannedKernel, Any, tuple]] = []
        self._running: dict[Any, tuple[PlannedKernel, Any]] = {}  # receiving end -> (kernel, process)
        self._finished: list[tuple[PlannedKernel, float, str | None]] = []

    def add(self, kernels: list[tuple[PlannedKernel, Any, tuple]]) -> None:
        """Queue (kernel, dispatcher, argtypes) items; the most complex start at once while fewer than
        ``jobs`` children run."""
        self._pending.extend(kernels)
        self._pending.sort(key=lambda item: -item[0].weight)
        self._collect(timeout=0)

    def results(self) -> Iterator[tuple[PlannedKernel, float, str | None]]:
        """(kernel, seconds, error or None) of every added kernel, as each finishes."""
        while self._pending or self._running or self._finished:
            if not self._finished:
                self._collect(timeout=None)
            while self._finished:
                yield self._finished.pop(0)

    def _start(self) -> None:
        while self._pending and len(self._running) < self.jobs:
            kernel, dispatcher, argtypes = self._pending.pop(0)
            receive, send = self._context.Pipe(duplex=False)
            process = self._context.Process(
                target=_forked_compile, name=f"memplan-compile {kernel.key[:12]}", daemon=True,
                args=(send, str(self.cache.root), kernel.key, dispatcher, argtypes, self.target, self.compile_function))
            process.start()
            send.close()
            self._running[receive] = (kernel, process)

    def _collect(self, timeout: float | None) -> None:
        """Take the results of the children that have finished (waiting up to ``timeout`` seconds for
        one when none has), then start pending kernels."""
        self._start()
        if self._running:
            for receive in multiprocessing.connection.wait(list(self._running), timeout):
                kernel, process = self._running.pop(receive)
                try:
                    seconds, error = receive.recv()
                except EOFError:  # it died: out of memory, a crash in a compiler
                    process.join()
                    seconds, error = 0.0, f"its compile process exited with code {process.exitcode}"
                receive.close()
                process.join()
                self._finished.append((kernel, seconds, error))
        self._start()

    def __enter__(self) -> ForkedCompiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for receive, (_, process) in self._running.items():
            process.kill()
            process.join()
            receive.close()
        self._running.clear()


def _forked_compile(send: Any, cache_root: str, key: str, dispatcher: Any, argtypes: tuple, target: Target,
                    compile_function: CompileFunction | None) -> None:
    """A forked child's work: compile one kernel into the cache and send (seconds, error or None)."""
    from executor.kernel_compiler import target_device

    with target_device(target.arch, target.num_sms):
        result = _compile_into(KernelCache(Path(cache_root)), key, dispatcher, argtypes, target.arch, compile_function)
    send.send(result)
    send.close()


def isolate_compile_process() -> None:
    """A compile process compiles for a target and never touches a GPU: no visible devices (no CUDA
    context on the device the plan budgets) and never the simulator. Runs before numba loads there."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)


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


class Progress:
    """``compiling kernels: done/total, seconds`` on a stream: rewritten in place on a terminal, else a
    line every PROGRESS_INTERVAL_S and at the end. No stream: silent."""

    def __init__(self, total: int, stream: TextIO | None, start: float | None = None) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.start = start if start is not None else time.perf_counter()
        self.last = time.perf_counter()
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
    """The start-up compile of ``memplan run`` on a GPU: one start-up process (``startup_compile_main``,
    a fresh interpreter with no GPU) starts at once and checks the start-up manifest; on a cold start it
    discovers the plan's kernels a start-up pass at a time and compiles each missing one in a child it
    forks as soon as the pass that launches it ends, while this process imports torch, materializes and
    loads weights. A thread here reads its messages (the progress display and
    the report); ``wait`` joins it. Failures are reported, not raised: those kernels compile at their
    first launch. ``target`` is the GPU compiled for: the current device's unless given (``memplan
    run`` gives the plan's hardware, to start before torch loads, and ``matches`` checks it against
    the device once there is one). ``compile_function``: a module-level function the start-up process
    imports by name instead of ``kernel_compiler.compile_image``."""

    def __init__(self, plan: MemoryPlan, cache: KernelCache, progress: TextIO | None, jobs: int | None = None,
                 target: Target | None = None, compile_function: CompileFunction | None = None) -> None:
        self.target = target if target is not None else device_target()
        self.report: CompileReport | None = None
        self.error: str | None = None
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        start = time.perf_counter()
        jobs = jobs or available_cores()
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from executor.compile import startup_compile_main; startup_compile_main()",
             f"{self.target.arch.major}.{self.target.arch.minor}", str(self.target.num_sms), str(cache.root),
             str(jobs), _function_name(compile_function)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_startup_environment(), start_new_session=True,
            text=True)
        self._thread = threading.Thread(target=self._read, args=(plan, jobs, progress, start), name="memplan-compile",
                                        daemon=True)
        self._thread.start()

    def matches(self, target: Target) -> bool:
        return target == self.target

    def wait(self) -> CompileReport:
        if self._thread is not None:
            self._thread.join()
        self.close()
        if self.report is None:
            return CompileReport(failed=[f"start-up compile: {self.error or 'no report'}"])
        return self.report

    def close(self) -> None:
        """Stop the start-up process and its compile children (nothing when they are done)."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _read(self, plan: MemoryPlan, jobs: int, progress: TextIO | None, start: float) -> None:
        process = self._process
        assert process is not None and process.stdin is not None and process.stdout is not None
        report, bar, names = None, None, {}
        try:
            process.stdin.write(plan.model_dump_json())
            process.stdin.close()
            for line in process.stdout:
                message = json.loads(line)
                if "answered" in message:
                    report = CompileReport(needed=message["answered"], cached=message["answered"], from_manifest=True)
                elif "listed" in message:
                    planned = [PlannedKernel(**kernel) for kernel in message["listed"]]
                    names = {kernel.key: kernel for kernel in planned}
                    missing = message["missing"]
                    report = CompileReport(needed=len(planned) + message["uncacheable"],
                                           cached=len(planned) - missing, uncacheable=message["uncacheable"],
                                           processes=min(jobs, missing))
                    bar = Progress(missing, progress, start) if missing else None
                elif "done" in message and report is not None:
                    report.record(names[message["done"]], message["seconds"], message["error"])
                    if bar is not None:
                        bar.advance()
                elif "failed" in message:
                    self.error = message["failed"]
                elif "end" in message and report is not None and self.error is None:
                    report.seconds = time.perf_counter() - start
                    self.report = report
        except (OSError, ValueError, KeyError) as error:
            self.error = _one_line(error)
        finally:
            if bar is not None:
                bar.finish()
            code = process.wait()
            if self.report is None and self.error is None:
                self.error = f"the start-up compile process exited with code {code}"


def _function_name(function: CompileFunction | None) -> str:
    return "" if function is None else f"{function.__module__}:{function.__qualname__}"


def _function_named(name: str) -> CompileFunction | None:
    if not name:
        return None
    module, qualname = name.split(":")
    return getattr(importlib.import_module(module), qualname)


def _startup_environment() -> dict[str, str]:
    """The start-up process's environment: this one, with the executor's package root first on its path."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def startup_compile_main() -> None:
    """The start-up process (``StartupCompile``): argv is (compute capability "9.0", SMs, cache root,
    jobs, the compile function's "module:name" or ""), stdin the plan's JSON; stdout carries one JSON
    message a line: ``answered`` (the start-up manifest's key count: everything is cached), ``listed``
    (the planned kernels, after discovery), ``done`` (one compiled kernel), ``failed`` (the manifest
    check or discovery failed), ``end``. Anything else the libraries print goes to stderr."""
    messages = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    isolate_compile_process()

    def send(**message: object) -> None:
        try:
            messages.write(json.dumps(message) + "\n")
        except BrokenPipeError:  # the run is gone: so are this process and its compile children
            os.killpg(0, signal.SIGKILL)

    capability, num_sms, cache_root, jobs, function = sys.argv[1:6]
    target = Target(Arch.from_capability(capability), int(num_sms))
    try:
        _startup_compile(sys.stdin.read(), target, KernelCache(Path(cache_root)), int(jobs),
                         _function_named(function), send)
    except Exception as error:  # an unreadable cache, a discovery that fails: the run compiles at first launch
        send(failed=_one_line(error))
    send(end=True)


def _startup_compile(plan_json: str, target: Target, cache: KernelCache, jobs: int,
                     compile_function: CompileFunction | None, send: Callable[..., None]) -> None:
    from planner.plan import MemoryPlan

    plan = MemoryPlan.model_validate_json(plan_json)
    digest = manifest_digest(plan, target)
    answered = answered_by_manifest(plan, cache, target, digest)
    if answered is not None:
        send(answered=answered.needed)
        return
    import torch

    torch.set_num_threads(1)  # no intra-op thread pool: this process forks
    from executor.kernel_compiler import target_device
    from executor.kernel_discovery import discover_by_pass

    planned: dict[str, PlannedKernel] = {}
    sources: Sources = {}
    uncacheable, missing, failed = 0, 0, False
    with target_device(target.arch, target.num_sms), ForkedCompiles(cache, target, jobs, compile_function) as forks:
        for needs in discover_by_pass(plan):
            known = len(planned)
            uncacheable += add_needs(needs, target, planned, sources)
            new = [key for key in list(planned)[known:] if not cache.contains(key)]
            missing += len(new)
            forks.add([(planned[key], *sources[key]) for key in new])
        send(listed=[asdict(kernel) for kernel in planned.values()], uncacheable=uncacheable, missing=missing)
        for kernel, seconds, error in forks.results():
            send(done=kernel.key, seconds=seconds, error=error)
            failed = failed or error is not None
    if not failed:
        cache.store_manifest(digest, list(planned))


def device_target() -> Target:
    """The current GPU as a compile target."""
    from executor.kernel_compiler import device_arch
    from executor.kernels.primitives.launch import multiprocessor_count

    return Target(device_arch(), multiprocessor_count())


def hardware_target(plan: MemoryPlan) -> Target:
    """The plan's hardware as a compile target (no GPU needed)."""
    return Target(Arch.from_capability(plan.hardware.compute_capability), plan.hardware.num_sms)


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
    from executor.kernel_key import MIN_COMPUTE_CAPABILITY
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
    _check_linker()
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


def _check_linker() -> None:
    """A CompileError where nothing here can link a cubin: no nvJitLink (numba-cuda's CUDA 13 extra) and no
    CUDA driver, as on a machine without a GPU that installed only the executor's extra."""
    from executor.kernel_key import linker
    from executor.numba_cuda import load_cuda

    load_cuda()
    from numba.cuda.cudadrv.error import CudaSupportError

    try:
        linker()
    except CudaSupportError:
        raise CompileError("no linker for cubins here: without a GPU, memplan compile links with nvJitLink; "
                           "pip install 'numba-cuda[cu13]' (the CUDA 13 bindings and nvJitLink)") from None


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
