"""``memplan run`` (its flags are parsed in planner.cli): build (or load) a plan, materialize it once, load weights, run the requests
through the engine (continuous batching), and report.

stdout (or ``--out``): one JSONL line per request, in input order: ``{"request", "prompt_len",
"output_ids", "finish_reason", "ttft_ms", "token_latencies_ms"}`` plus ``"error"`` for a rejected one.
stderr: a progress line every ~2 s and at the end, then planned vs allocated bytes per pool, the device
allocator's view (CUDA), requests and tokens/s, TTFT and TPOT p50/p99, the prefix-cache hit rate, peak KV
pages and recurrent slots vs the plan, preemptions and allocations after warm-up (CUDA).

A request the plan can never hold (prompt + max_new_tokens over max_context, more KV pages than the pool,
an empty prompt) is rejected by the scheduler, one with an id outside the vocabulary here; either way only
that request's line says so (``finish_reason`` "rejected", ``error``) and the run goes on.

Exit codes: 0 ok (rejected requests included); 2 a bad config, plan file, checkpoint or request file (one
line naming the file and line); 3 the plan does not fit (raised to planner.cli.main, which maps
ConfigError / PlanDoesNotFit / CheckedOverflowError).

torch and numba are imported inside ``run``, after the simulator is chosen:
NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from executor.run_report import GraphCapture, materialized_bytes, summary
from executor.workload import RequestFileError, RequestSpec, RunError, read_requests, write_outputs
from planner.errors import ConfigError

if TYPE_CHECKING:
    from executor.arena import Arena
    from planner.plan import MemoryPlan

EXIT_OK, EXIT_ERROR = 0, 2

#: The simulator keeps the arena in host memory; refuse plans bigger than this there.
SIM_MAX_MATERIALIZED_BYTES = 1 << 30
#: The serving config used when --hardware is cpu-sim and --serving is not given.
SIM_HARDWARE, SIM_SERVING = "cpu-sim", "sim"
#: Seconds between progress lines on stderr.
PROGRESS_INTERVAL_S = 2.0
#: Failed start-up compiles named on stderr (the report counts them all).
MAX_FAILURE_LINES = 3


def run(args: argparse.Namespace, overrides: dict[str, object]) -> int:
    """Run ``memplan run``; return the exit code (ConfigError and PlanDoesNotFit propagate).
    ``overrides``: the serving flags as ServingConfig fields, None where not given."""
    _choose_simulator(args.device)
    if args.no_kernel_cache:  # read by every Kernel at its first launch (executor/kernel_cache.py)
        os.environ["MEMPLAN_KERNEL_CACHE"] = "0"
    from executor.device import DeviceError
    from executor.step import CapacityError
    from executor.weights import WeightsError

    labels = ((CapacityError, "capacity error"), (WeightsError, "weights error"),
              (RequestFileError, "request error"), (DeviceError, "device error"), (RunError, "error"))
    try:
        return _run(args, overrides)
    except tuple(kind for kind, _ in labels) as error:
        label = next(text for kind, text in labels if isinstance(error, kind))
        print(f"memplan: {label}: {error}", file=sys.stderr)
        return EXIT_ERROR


def _choose_simulator(device: str) -> None:
    """Enable the Numba CUDA simulator for ``--device sim`` (or auto without CUDA), before numba.cuda loads."""
    if device == "sim":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    elif device == "auto":
        import torch

        if not torch.cuda.is_available():
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _run(args: argparse.Namespace, overrides: dict[str, object]) -> int:
    from executor.arena import materialize
    from executor.device import open_device
    from executor.engine import Engine, warm_up
    from executor.models import build_model
    from executor.startup import KernelCensus, StartupClock

    clock = StartupClock()
    plan = load_plan(args, overrides)
    device = open_device(args.device)
    _check_fits_device(plan, device.is_sim)
    specs = read_requests(args, plan.model.vocab_size)  # before anything is allocated
    clock.mark("plan")
    # On a GPU, the kernels start-up needs that the cache lacks compile in processes meanwhile.
    compiling = None if device.is_sim else _start_compile(plan)
    if compiling is not None:
        clock.mark("kernel discovery")
    try:
        arena = materialize(plan, device)
    except ValueError as error:  # e.g. tensor_parallel_size != 1
        raise RunError(str(error)) from None
    device.synchronize()
    clock.mark("materialize")
    _load_weights(arena, args)
    model = build_model(arena)
    device.synchronize()
    clock.mark("weights")
    if compiling is not None:
        compiled = compiling.wait()
        clock.mark("kernels", compiled.line())
        for failure in compiled.failed[:MAX_FAILURE_LINES]:
            print(f"memplan run: kernel compile failed, it compiles at its first launch: {failure}", file=sys.stderr)
    warm_up_s = None
    if not device.is_sim:  # on a GPU: keep the kernels' first-call loading or compilation out of the latencies
        warm_up(model)
        warm_up_s = clock.mark("warm-up", KernelCensus.of(model).text())
    before_capture = KernelCensus.of(model)
    graphs = None if args.eager or device.is_sim else capture_graphs(model)
    if graphs is not None:
        clock.mark("graph capture", KernelCensus.of(model).since(before_capture).text())
    engine = Engine(model, prefix_caching=not args.no_prefix_caching, overlap=not args.no_overlap)
    runnable = [index for index, spec in enumerate(specs) if spec.error is None]
    requests = [_engine_request(index, specs[index]) for index in runnable]
    progress = _Progress(requests, len(specs), sys.stderr)
    print(f"memplan run: ready after {clock.elapsed_s():.1f} s: {clock.line()}", file=sys.stderr, flush=True)
    engine_start = time.perf_counter() - clock.origin
    report = engine.run(requests, [specs[index].arrival_step for index in runnable], on_step=progress.after_step)
    progress.print_line(report.steps, final=True)
    write_outputs(specs, dict(zip(runnable, report.results)), args.out)
    first_tokens = [result.token_times_s[0] for result in report.results if result.token_times_s]
    first_token_s = engine_start + min(first_tokens) if first_tokens else None
    print(summary(plan, arena, report, specs, args.no_prefix_caching, graphs, warm_up_s), file=sys.stderr)
    print(f"start-up: {clock.line(first_token_s)}", file=sys.stderr)
    for phase in clock.phases:
        if phase.detail:
            print(f"  {phase.name}: {phase.detail}", file=sys.stderr)
    return EXIT_OK


def _start_compile(plan: MemoryPlan):
    """The cold-start compile (executor/compile.py) of the kernels ``plan``'s start-up needs that the
    persistent cache lacks, running in processes; None when the cache is off."""
    from executor.compile import StartupCompile
    from executor.kernel_cache import KernelCache

    cache = KernelCache.from_environment()
    return None if cache is None else StartupCompile(plan, cache, sys.stderr)


def capture_graphs(model) -> GraphCapture:
    import torch

    device = model.device.torch_device
    torch.cuda.synchronize(device)
    reserved, start = torch.cuda.memory_reserved(device), time.perf_counter()
    model.capture_decode_graphs()
    return GraphCapture(model.graphs.buckets, time.perf_counter() - start,
                        torch.cuda.memory_reserved(device) - reserved)


def _engine_request(index: int, spec: RequestSpec):
    from executor.scheduler import Request

    return Request(request_id=index, prompt_ids=spec.prompt_ids, max_new_tokens=spec.max_new_tokens,
                   stop_ids=spec.stop_ids, temperature=spec.temperature, top_k=spec.top_k, seed=spec.seed)


class _Progress:
    """A progress line on stderr after a step when ~2 s passed since the last one."""

    def __init__(self, requests: list, total: int, stream: TextIO):
        self._requests, self._total, self._stream = requests, total, stream
        self._start = self._last = time.perf_counter()

    def after_step(self, steps: int) -> None:
        if time.perf_counter() - self._last >= PROGRESS_INTERVAL_S:
            self.print_line(steps)

    def print_line(self, steps: int, final: bool = False) -> None:
        self._last = time.perf_counter()
        done = sum(1 for r in self._requests if r.is_finished) + (self._total - len(self._requests))
        tokens = sum(len(r.output_ids) for r in self._requests)
        state = "done" if final else "running"
        print(f"memplan run: {state}: {steps} step(s), {done}/{self._total} requests finished, "
              f"{tokens} tokens generated, {self._last - self._start:.1f} s", file=self._stream, flush=True)


# -- the plan ---------------------------------------------------------------------------------------------------------


def load_plan(args: argparse.Namespace, overrides: dict[str, object]) -> MemoryPlan:
    """The plan from ``--plan FILE`` (checked against the planner), or built from the config flags."""
    from planner.loader import plan_from_configs

    if args.plan:
        given = [flag for flag, value in (("--model", args.model), ("--serving", args.serving)) if value]
        given += [f"--{name.replace('_', '-')}" for name, value in overrides.items() if value is not None]
        if given:
            raise RunError(f"--plan replaces --model, --serving and the serving flags; drop {', '.join(given)}")
        return read_plan_file(Path(args.plan))
    model = args.model if args.model is not None else args.checkpoint
    if model is None:
        raise RunError("give --model, --checkpoint DIR (its config.json) or --plan FILE")
    serving = args.serving
    if serving is None:
        serving = SIM_SERVING if _hardware_name(args.hardware) == SIM_HARDWARE else "default"
    return plan_from_configs(model, args.hardware, serving, overrides)


def read_plan_file(path: Path) -> MemoryPlan:
    """A plan JSON file, validated and equal to what this planner builds from its own configs."""
    from pydantic import ValidationError

    from planner.plan import MemoryPlan
    from planner.validate import plan_difference

    try:
        plan = MemoryPlan.model_validate_json(path.read_text())
    except OSError as error:
        raise ConfigError(str(path), "", "", f"cannot read: {error.strerror}") from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ConfigError(str(path), field, first.get("input"), first["msg"]) from None
    difference = plan_difference(plan)
    if difference is not None:
        where, value, expected = difference
        raise ConfigError(str(path), where.lstrip("."), value,
                          f"differs from the plan this planner builds from the file's configs ({expected!r}); re-plan")
    return plan


def _hardware_name(spec: str) -> str:
    from planner.loader import load_hardware

    return load_hardware(spec).name


def _check_fits_device(plan: MemoryPlan, simulator: bool) -> None:
    total = materialized_bytes(plan)
    if simulator and total > SIM_MAX_MATERIALIZED_BYTES:
        raise RunError(f"the simulator runs tiny configs in host memory; this plan ({plan.model.name} on "
                       f"{plan.hardware.name}) materializes {total:,} bytes: use --hardware {SIM_HARDWARE} "
                       f"and a tiny model, or --device cuda")


def _load_weights(arena: Arena, args: argparse.Namespace) -> None:
    from executor.weights import WeightsError, fill_random, load_checkpoint

    if args.checkpoint and args.random_weights:
        raise RunError("give --checkpoint DIR or --random-weights, not both")
    if args.checkpoint:
        load_checkpoint(arena, args.checkpoint)
    elif args.random_weights:
        fill_random(arena, args.seed)
    else:
        raise WeightsError("no weights: give --checkpoint DIR or --random-weights")
