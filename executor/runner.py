"""``memplan run`` (its flags are parsed in planner.cli): build (or load) a plan, materialize it once, load weights, run the requests
through the engine (continuous batching), and report.

stdout (or ``--out``): one JSONL line per request, in input order: ``{"request", "prompt_len",
"output_ids", "finish_reason", "ttft_ms", "token_latencies_ms"}`` plus ``"error"`` for a rejected one.
stderr: a progress line every ~2 s and at the end, then planned vs allocated bytes per pool, the device
allocator's view (CUDA), requests and tokens/s, TTFT and TPOT p50/p99, the prefix-cache hit rate, peak KV
pages and recurrent slots vs the plan, preemptions and allocations after warm-up (CUDA).

A request the plan can never hold (prompt + max_new_tokens over max_context, more KV pages than the pool,
an empty prompt) is rejected by the scheduler, one with a value the plan or the kernels cannot serve (an id
outside the vocabulary, a seed outside u64, top_k over the vocabulary: executor.workload) here; either way
only that request's line says so (``finish_reason`` "rejected", ``error``) and the run goes on.

Every input is checked before the device is touched: ``--out`` (planner.output_file: its folder exists, it
is no directory and no input; the result is written atomically at the end), the plan, the request files and
flags, the checkpoint's safetensors headers (executor.checkpoint_checks).

Exit codes: 0 ok (rejected requests included); 2 a bad config, plan file, checkpoint, request file or flag
(one line naming the file and line); 3 the plan does not fit (raised to planner.cli.main, which maps
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

from executor.checkpoint_checks import CheckpointError, check_checkpoint_dir
from executor.run_report import GraphCapture, materialized_bytes, summary
from executor.workload import (
    RequestFileError, RequestLimits, RequestSpec, RunError, engine_seed, read_requests, write_outputs)

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


def run(args: argparse.Namespace, overrides: dict[str, object]) -> int:
    """Run ``memplan run``; return the exit code (ConfigError and PlanDoesNotFit propagate).
    ``overrides``: the serving flags as ServingConfig fields, None where not given."""
    _choose_simulator(args.device)
    from executor.device import DeviceError
    from executor.step import CapacityError
    from executor.weights import WeightsError
    from planner.errors import one_line

    labels = ((CapacityError, "capacity error"), (WeightsError, "weights error"),
              (CheckpointError, "checkpoint error"), (RequestFileError, "request error"),
              (DeviceError, "device error"), (RunError, "error"))
    try:
        return _run(args, overrides)
    except tuple(kind for kind, _ in labels) as error:
        label = next(text for kind, text in labels if isinstance(error, kind))
        print(f"memplan: {label}: {one_line(str(error))}", file=sys.stderr)
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

    out = _check_out(args)  # before any work
    plan = load_plan(args, overrides)
    device = open_device(args.device)
    _check_fits_device(plan, device.is_sim)
    specs = read_requests(args, RequestLimits(plan.model.vocab_size, plan.capacity.max_context))
    _check_weight_source(args)  # before anything is allocated
    try:
        arena = materialize(plan, device)
    except ValueError as error:  # e.g. tensor_parallel_size != 1
        raise RunError(str(error)) from None
    _load_weights(arena, args)
    model = build_model(arena)
    warm_up_s = None
    if not device.is_sim:  # on a GPU: keep the kernels' first-call compilation out of the latencies
        start = time.perf_counter()
        warm_up(model)
        warm_up_s = time.perf_counter() - start
    graphs = None if args.eager or device.is_sim else capture_graphs(model)
    engine = Engine(model, prefix_caching=not args.no_prefix_caching, overlap=not args.no_overlap)
    runnable = [index for index, spec in enumerate(specs) if spec.error is None]
    requests = [_engine_request(index, specs[index]) for index in runnable]
    progress = _Progress(requests, len(specs), sys.stderr)
    report = engine.run(requests, [specs[index].arrival_step for index in runnable], on_step=progress.after_step)
    progress.print_line(report.steps, final=True)
    write_outputs(specs, dict(zip(runnable, report.results)), out)
    print(summary(plan, arena, report, specs, args.no_prefix_caching, graphs, warm_up_s), file=sys.stderr)
    return EXIT_OK


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
                   stop_ids=spec.stop_ids, temperature=spec.temperature, top_k=spec.top_k,
                   seed=engine_seed(spec.seed))


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
    if args.model is None:
        _checkpoint_folder(args.checkpoint)
    serving = args.serving
    if serving is None:
        serving = SIM_SERVING if _hardware_name(args.hardware) == SIM_HARDWARE else "default"
    return plan_from_configs(model, args.hardware, serving, overrides)


def read_plan_file(path: Path) -> MemoryPlan:
    """A plan JSON file, validated and equal to what this planner builds from its own configs."""
    from planner.validate import load_plan_file

    return load_plan_file(path)


def _check_out(args: argparse.Namespace) -> Path | None:
    """--out checked against the run's inputs (planner.output_file), or None for stdout."""
    if not args.out:
        return None
    from planner.output_file import check_out_path, config_inputs

    inputs = [(flag, Path(value)) for flag, value in (("--requests", args.requests),
                                                       ("--prompt-ids", args.prompt_ids), ("--plan", args.plan))
              if value]
    inputs += config_inputs(args.model, args.hardware, args.serving)
    if args.checkpoint and _is_dir(Path(args.checkpoint)):
        inputs += [("--checkpoint", path) for path in sorted(Path(args.checkpoint).iterdir())]
    return check_out_path(args.out, inputs)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _checkpoint_folder(checkpoint: str) -> None:
    if not _is_dir(Path(checkpoint)):
        raise CheckpointError(f"--checkpoint {checkpoint}: not a directory (an HF checkpoint directory holds "
                              "config.json and *.safetensors)")


def _check_weight_source(args: argparse.Namespace) -> None:
    """Exactly one weight source, and a checkpoint whose safetensors headers are sound."""
    from executor.weights import WeightsError

    if args.checkpoint and args.random_weights:
        raise RunError("give --checkpoint DIR or --random-weights, not both")
    if not args.checkpoint and not args.random_weights:
        raise WeightsError("no weights: give --checkpoint DIR or --random-weights")
    if args.checkpoint:
        _checkpoint_folder(args.checkpoint)
        check_checkpoint_dir(Path(args.checkpoint))


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
    from executor.weights import fill_random, load_checkpoint

    if args.checkpoint:
        load_checkpoint(arena, args.checkpoint)
    else:
        fill_random(arena, args.seed)
