"""``memplan run`` (its flags are parsed in planner.cli): build (or load) a plan, materialize it once, load
weights, run the requests through the engine (continuous batching), and report.

Weights: ``--model DIR`` serves DIR's safetensors when it holds them (``--checkpoint DIR`` says the same,
and gives the weights of a ``--plan``); ``--random-weights`` fills the planned shapes from ``--seed``.
The tokenizer is the weights' directory's (or ``--tokenizer DIR``'s); without one, requests are ids only
and text input is an error. The checkpoint's generation_config.json gives the EOS ids (``--ignore-eos``
keeps generating) and, with ``do_sample``, the sampling defaults that ``--temperature``, ``--top-p`` and
``--top-k`` replace field by field (executor.generation); a request's own fields come first.

stdout (or ``--out``): one JSONL line per request, written and flushed as it finishes: ``{"request",
"prompt_len", "output_ids", "text" (with a tokenizer), "finish_reason", "ttft_ms", "token_latencies_ms"}``
plus ``"error"`` for a rejected one. A single ``--prompt`` streams its text to stdout instead (the line
goes to ``--out`` only). stderr: a progress line every ~2 s and at the end, then planned vs allocated
bytes per pool, the device allocator's view (CUDA), requests and tokens/s, the weights, EOS ids and
sampling defaults, TTFT, TPOT and ITL p50/p99, the prefix-cache hit rate, peak KV pages and recurrent slots
vs the plan, preemptions and allocations after warm-up (CUDA).

A request the plan can never hold (prompt + max_new_tokens over max_context, more KV pages than the pool,
an empty prompt) is rejected by the scheduler, one with a value the plan or the kernels cannot serve (an id
outside the vocabulary, a seed outside u64, top_k over the vocabulary: executor.workload) here; either way
only that request's line says so (``finish_reason`` "rejected", ``error``) and the run goes on.

Every input is checked before the device is touched: ``--out`` (planner.output_file: its folder exists, it
is no directory and no input, nor is ``OUT.partial``), the plan, the request files and flags (executor.workload).
The checkpoint's safetensors headers are checked (executor.checkpoint_checks) before any tensor is read.
With ``--out`` the lines go to ``OUT.partial`` as requests finish, renamed to ``OUT`` when the run ends; a run
that fails leaves ``OUT`` untouched and what finished in ``OUT.partial``.

Exit codes: 0 ok (rejected requests included); 2 a bad config, plan file, checkpoint, tokenizer, request
file or flag (one line naming the file and line); 3 the plan does not fit (raised to planner.cli.main, which maps
ConfigError / PlanDoesNotFit / CheckedOverflowError).

Tensor parallelism (``--tensor-parallel-size N``): this process is rank 0 and spawns ranks 1 .. N - 1
(executor/workers.py: one GPU each, or the simulator on gloo); under ``torchrun`` each of its processes
runs this command and the ranks above 0 serve their part of rank 0's steps and write nothing. A rank that
fails ends the run with exit 2 and one line naming the rank and its error.

torch and numba are imported inside ``run``, after the plan is built and, bound for a GPU, the cold-start
compile is started (its processes import and discover while this one imports), and after the simulator is
chosen: NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from executor.checkpoint_checks import CheckpointError
from executor.serving import RANDOM_WEIGHTS, choose_simulator
from executor.workload import (
    OutputWriter, RequestFileError, RequestLimits, RunError, output_record, partial_path, read_requests)

if TYPE_CHECKING:
    from executor.compile import StartupCompile
    from executor.startup import StartupClock
    from executor.tokenizer import Tokenizer
    from planner.plan import MemoryPlan

EXIT_OK, EXIT_ERROR = 0, 2

#: Seconds between progress lines on stderr.
PROGRESS_INTERVAL_S = 2.0


def run(args: argparse.Namespace, overrides: dict[str, object]) -> int:
    """Run ``memplan run``; return the exit code (ConfigError and PlanDoesNotFit propagate).
    ``overrides``: the serving flags as ServingConfig fields, None where not given."""
    from executor.startup import StartupClock

    clock = StartupClock()
    if args.no_kernel_cache:  # read by every Kernel at its first launch (executor/kernel_cache.py)
        os.environ["MEMPLAN_KERNEL_CACHE"] = "0"
    try:
        out = _check_out(args)  # before any work
        plan = load_plan(args, overrides)
    except (RunError, CheckpointError) as error:
        return _failed(error, ((RunError, "error"), (CheckpointError, "checkpoint error")))
    compiling = start_early_compile(plan, args.device)  # its processes start while torch loads here
    clock.mark("plan")
    try:
        choose_simulator(args.device)
        from executor.device import DeviceError
        from executor.parallel import RankError
        from executor.step import CapacityError
        from executor.tokenizer import TokenizerError
        from executor.weights import WeightsError

        labels = ((CapacityError, "capacity error"), (WeightsError, "weights error"),
                  (CheckpointError, "checkpoint error"), (TokenizerError, "tokenizer error"),
                  (RequestFileError, "request error"),
                  (DeviceError, "device error"), (RankError, "tensor-parallel error"), (RunError, "error"))
        try:
            return _run(args, out, plan, clock, compiling)
        except tuple(kind for kind, _ in labels) as error:
            return _failed(error, labels)
    finally:
        if compiling is not None:
            compiling.close()


def _failed(error: Exception, labels: tuple[tuple[type, str], ...]) -> int:
    from planner.errors import one_line

    label = next(text for kind, text in labels if isinstance(error, kind))
    print(f"memplan: {label}: {one_line(str(error))}", file=sys.stderr)
    return EXIT_ERROR


def start_early_compile(plan: MemoryPlan, device: str) -> StartupCompile | None:
    """The cold-start compile of ``plan``'s kernels for the plan's hardware, started before this process
    imports torch, when the run looks bound for a GPU (a CUDA device node and visible devices, no
    simulator asked for, hardware the kernels compile for); ServedModel.open keeps it when the GPU
    matches that hardware, else starts one for the GPU. None otherwise."""
    from executor.compile import hardware_target
    from executor.kernel_key import MIN_COMPUTE_CAPABILITY
    from executor.numba_cuda import simulator_enabled
    from executor.serving import start_compile

    if device == "sim" or simulator_enabled() or not _gpu_present():
        return None
    if plan.serving.tensor_parallel_size > 1 and _torchrun_worker():
        return None  # rank 0's compile fills the cache the ranks share
    target = hardware_target(plan)
    if (target.arch.major, target.arch.minor) < MIN_COMPUTE_CAPABILITY:
        return None
    return start_compile(plan, sys.stderr, target)


def _gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU to this process, asked without loading CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return Path("/dev/nvidiactl").exists() and visible not in ("", "-1")


def _run(args: argparse.Namespace, out: Path | None, plan: MemoryPlan, clock: StartupClock,
         compiling: StartupCompile | None) -> int:
    from executor.generation import read_generation_defaults, resolve_sampling
    from executor.serving import ServedModel

    clock.mark("imports")
    weights = weights_source(args)
    directory = None if weights == RANDOM_WEIGHTS else weights
    tokenizer = load_tokenizer(args, directory)
    generation = read_generation_defaults(directory, plan.model.vocab_size)
    sampling = resolve_sampling(generation.sampling, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k)
    generation = replace(generation, sampling=sampling)
    limits = RequestLimits(plan.model.vocab_size, plan.capacity.max_context)
    specs = read_requests(args, limits, tokenizer, sampling)  # before anything is allocated
    clock.mark("requests")
    if plan.serving.tensor_parallel_size > 1 and _torchrun_worker():
        return _serve_torchrun_rank(plan, args.device, weights, args.seed)
    streaming = len(args.prompt or []) == 1 and len(specs) == 1  # a single --prompt: its text on the terminal
    writer = OutputWriter(out, None if streaming else sys.stdout)
    served = None
    try:
        served = ServedModel.open(plan, args.device, weights=weights, seed=args.seed, tokenizer=tokenizer,
                                  generation=generation, eager=args.eager, clock=clock, log=sys.stderr,
                                  compiling=compiling)
        print(f"memplan run: ready after {clock.elapsed_s():.1f} s: {clock.line()}", file=sys.stderr, flush=True)
        engine_start = time.perf_counter() - clock.origin
        progress: list[_Progress] = []

        def make_progress(requests: list, total: int):
            progress.append(_Progress(requests, total, sys.stderr))
            return progress[0].after_step

        def on_output(index, spec, result, text) -> None:
            record = output_record(index, spec, result, text)
            writer.write(record)
            if streaming and record["finish_reason"] == "rejected":  # its line may go nowhere: say why here
                print(f"memplan: the prompt was rejected: {record['error']}", file=sys.stderr)

        stream = _terminal_stream(sys.stdout) if streaming else None
        report = served.run(specs, on_output=on_output, stream=stream, ignore_eos=args.ignore_eos,
                            prefix_caching=not args.no_prefix_caching, overlap=not args.no_overlap,
                            progress=make_progress)
        writer.commit()  # OUT.partial becomes OUT; on an error above, OUT stays as it was
    finally:
        writer.close()
        if served is not None:
            served.close()  # tensor parallelism: the other ranks stop
    if streaming:
        print(file=sys.stdout, flush=True)  # end the streamed text's line
    if progress:
        progress[0].print_line(report.engine.steps, final=True)
    print(report.text, file=sys.stderr)
    first_tokens = [result.token_times_s[0] for result in report.engine.results if result.token_times_s]
    first_token_s = engine_start + min(first_tokens) if first_tokens else None
    print(f"start-up: {clock.line(first_token_s)}", file=sys.stderr)
    for phase in clock.phases:
        if phase.detail:
            print(f"  {phase.name}: {phase.detail}", file=sys.stderr)
    return EXIT_OK


def _torchrun_worker() -> bool:
    """Whether torchrun started this process as a rank other than 0."""
    from executor.workers import torchrun_rank, under_torchrun

    return under_torchrun() and torchrun_rank()[0] != 0


def _serve_torchrun_rank(plan: MemoryPlan, device: str, weights: str | Path, seed: int) -> int:
    """Under torchrun, rank > 0: serve this rank's part of every step rank 0 runs; rank 0 writes the output."""
    from executor.numba_cuda import simulator_enabled
    from executor.workers import serve_torchrun_rank

    choose_simulator(device)
    serve_torchrun_rank(plan, "sim" if simulator_enabled() else "cuda", str(weights), seed)
    return EXIT_OK


def weights_source(args: argparse.Namespace) -> str | Path:
    """Where the weights come from: ``--checkpoint DIR``, ``--random-weights``, or ``--model DIR`` holding
    safetensors; anything else is a WeightsError saying what to give."""
    from executor.weights import WeightsError, has_weights

    if args.checkpoint and args.random_weights:
        raise RunError("give --checkpoint DIR or --random-weights, not both")
    if args.checkpoint:
        _checkpoint_folder(args.checkpoint)
        return Path(args.checkpoint)
    if args.random_weights:
        return RANDOM_WEIGHTS
    if args.model and has_weights(args.model):
        return Path(args.model)
    if args.model and Path(args.model).is_dir():
        raise WeightsError(f"{args.model} holds no *.safetensors (or model.safetensors.index.json): give "
                           "--checkpoint DIR or --random-weights")
    raise WeightsError("no weights: give --model DIR (a checkpoint with safetensors), --checkpoint DIR or "
                       "--random-weights")


def load_tokenizer(args: argparse.Namespace, weights_directory: Path | None) -> Tokenizer | None:
    """``--tokenizer DIR``'s tokenizer (which must have one), else the weights' directory's, else --model
    DIR's; None where there is none."""
    from executor.tokenizer import Tokenizer, TokenizerError

    if args.tokenizer:
        tokenizer = Tokenizer.from_directory(args.tokenizer)
        if tokenizer is None:
            raise TokenizerError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
        return tokenizer
    for directory in (weights_directory, args.model):
        if directory is not None and Path(directory).is_dir():
            return Tokenizer.from_directory(directory)
    return None


def _terminal_stream(stream: TextIO):
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


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
    return plan_from_configs(model, args.hardware, args.serving, overrides)  # None: the hardware's default_serving


def read_plan_file(path: Path) -> MemoryPlan:
    """A plan JSON file, validated and equal to what this planner builds from its own configs."""
    from planner.validate import load_plan_file

    return load_plan_file(path)


def _check_out(args: argparse.Namespace) -> Path | None:
    """--out checked against the run's inputs (planner.output_file), and so is the ``OUT.partial`` its lines go
    to until the run ends; None for stdout."""
    if not args.out:
        return None
    from planner.output_file import check_out_path, config_inputs

    inputs = [(flag, Path(value)) for flag, value in (("--requests", args.requests),
                                                       ("--prompt-ids", args.prompt_ids), ("--plan", args.plan))
              if value]
    inputs += config_inputs(args.model, args.hardware, args.serving)
    for flag, folder in (("--checkpoint", args.checkpoint), ("--model", args.model), ("--tokenizer", args.tokenizer)):
        if folder and _is_dir(Path(folder)):
            inputs += [(flag, path) for path in sorted(Path(folder).iterdir())]
    out = check_out_path(args.out, inputs)
    check_out_path(str(partial_path(out)), inputs)
    return out


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _checkpoint_folder(checkpoint: str) -> None:
    if not _is_dir(Path(checkpoint)):
        raise CheckpointError(f"--checkpoint {checkpoint}: not a directory (an HF checkpoint directory holds "
                              "config.json and *.safetensors)")
