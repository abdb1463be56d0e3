"""``memplan run``: build (or load) a plan, materialize it once, load weights, run the requests
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
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from planner.errors import ConfigError

if TYPE_CHECKING:
    from executor.arena import Arena
    from executor.engine import EngineReport
    from planner.plan import MemoryPlan

EXIT_OK, EXIT_ERROR = 0, 2

#: The simulator keeps the arena in host memory; refuse plans bigger than this there.
SIM_MAX_MATERIALIZED_BYTES = 1 << 30
#: The serving config used when --hardware is cpu-sim and --serving is not given.
SIM_HARDWARE, SIM_SERVING = "cpu-sim", "sim"
#: Seconds between progress lines on stderr.
PROGRESS_INTERVAL_S = 2.0
#: Keys a --requests line may hold.
REQUEST_KEYS = ("prompt_ids", "prompt_len", "max_new_tokens", "stop_ids", "temperature", "top_k", "seed")


class RunError(RuntimeError):
    """A ``memplan run`` usage error (conflicting or missing arguments, an impossible device)."""


class RequestFileError(ValueError):
    """A request file cannot be read or holds a malformed line."""


@dataclass
class RequestSpec:
    """One request as read from the command line, before it becomes an engine ``Request``."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: list[int] = field(default_factory=list)
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    arrival_step: int = 0
    error: str | None = None  # rejected here (an id outside the vocabulary): never reaches the engine


def run(args: argparse.Namespace) -> int:
    """Run ``memplan run``; return the exit code (ConfigError and PlanDoesNotFit propagate)."""
    _choose_simulator(args.device)
    from executor.device import DeviceError
    from executor.step import CapacityError
    from executor.weights import WeightsError

    labels = ((CapacityError, "capacity error"), (WeightsError, "weights error"),
              (RequestFileError, "request error"), (DeviceError, "device error"), (RunError, "error"))
    try:
        return _run(args)
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


def _run(args: argparse.Namespace) -> int:
    from executor.arena import materialize
    from executor.device import open_device
    from executor.engine import Engine, warm_up
    from executor.models import build_model

    plan = load_plan(args)
    device = open_device(args.device)
    _check_fits_device(plan, device.is_sim)
    specs = read_requests(args, plan.model.vocab_size)  # before anything is allocated
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
    engine = Engine(model, prefix_caching=not args.no_prefix_caching)
    runnable = [index for index, spec in enumerate(specs) if spec.error is None]
    requests = [_engine_request(index, specs[index]) for index in runnable]
    progress = _Progress(requests, len(specs), sys.stderr)
    report = engine.run(requests, [specs[index].arrival_step for index in runnable], on_step=progress.after_step)
    progress.print_line(report.steps, final=True)
    _write_outputs(specs, dict(zip(runnable, report.results)), args.out)
    print(summary(plan, arena, report, specs, args.no_prefix_caching, graphs, warm_up_s), file=sys.stderr)
    return EXIT_OK


@dataclass(frozen=True)
class GraphCapture:
    """What capturing the decode graphs cost: wall time and the allocator bytes their pool reserved."""

    buckets: tuple[int, ...]
    seconds: float
    reserved_bytes: int


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


# -- the plan -----------------------------------------------------------------------------------------------------


def load_plan(args: argparse.Namespace) -> MemoryPlan:
    """The plan from ``--plan FILE`` (checked against the planner), or built from the config flags."""
    from planner.cli import plan_from_args, serving_overrides

    if args.plan:
        given = [flag for flag, value in (("--model", args.model), ("--serving", args.serving)) if value]
        given += [f"--{name.replace('_', '-')}" for name, value in serving_overrides(args).items() if value is not None]
        if given:
            raise RunError(f"--plan replaces --model, --serving and the serving flags; drop {', '.join(given)}")
        return read_plan_file(Path(args.plan))
    args = argparse.Namespace(**vars(args))
    if args.model is None:
        if not args.checkpoint:
            raise RunError("give --model, --checkpoint DIR (its config.json) or --plan FILE")
        args.model = args.checkpoint
    if args.serving is None and _hardware_name(args.hardware) == SIM_HARDWARE:
        args.serving = SIM_SERVING
    return plan_from_args(args)


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


def materialized_bytes(plan: MemoryPlan) -> int:
    """Bytes of every pool the executor allocates (budget-only lines excluded)."""
    return sum(pool.bytes for pool in plan.pools if pool.materialized)


# -- weights and prompts ------------------------------------------------------------------------------------------


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


def read_requests(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    """The requests of ``--requests``, ``--prompt-ids`` and the synthetic workload, in that order; with none of
    them, ``--batch`` (default 1) random prompts of ``--prompt-len`` ids. Ids outside the vocabulary mark that
    request rejected; a malformed file line is a ``RequestFileError``."""
    import numpy as np

    specs: list[RequestSpec] = []
    if args.requests:
        specs += read_request_file(Path(args.requests), args.max_new_tokens, vocab_size, args.seed)
    if args.prompt_ids:
        specs += [RequestSpec(ids, args.max_new_tokens) for ids in read_prompt_file(Path(args.prompt_ids))]
    if args.num_requests is not None:
        specs += synthetic_requests(args, vocab_size)
    elif any(value is not None for value in (args.input_len, args.output_len)) or args.shared_prefix:
        raise RunError("--input-len, --output-len and --shared-prefix need --num-requests N")
    if args.batch is not None or not specs:
        batch = 1 if args.batch is None else args.batch
        if batch < 1 or args.prompt_len < 1:
            raise RunError(f"--batch and --prompt-len must be >= 1, got {batch} and {args.prompt_len}")
        rng = np.random.default_rng(args.seed)
        specs += [RequestSpec(rng.integers(0, vocab_size, args.prompt_len).tolist(), args.max_new_tokens)
                  for _ in range(batch)]
    for spec in specs:
        bad = next(((i, t) for i, t in enumerate(spec.prompt_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            spec.error = f"prompt: id {bad[1]} at position {bad[0]} is outside the vocabulary [0, {vocab_size})"
    return specs


def synthetic_requests(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    """``--num-requests`` prompts of ``--input-len`` random ids sharing their first ``--shared-prefix`` ids.

    With a shared prefix the first request arrives at step 0 and the others at step 1: pages enter the prefix
    cache after the step that fills them, so requests admitted together could not share them."""
    import numpy as np

    count = args.num_requests
    length = args.prompt_len if args.input_len is None else args.input_len
    new_tokens = args.max_new_tokens if args.output_len is None else args.output_len
    prefix = args.shared_prefix
    if count < 1 or length < 1 or new_tokens < 1:
        raise RunError(f"--num-requests, --input-len and --output-len must be >= 1, got {count}, {length} "
                       f"and {new_tokens}")
    if not 0 <= prefix <= length:
        raise RunError(f"--shared-prefix must be in [0, --input-len {length}], got {prefix}")
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, vocab_size, prefix).tolist()
    return [RequestSpec(shared + rng.integers(0, vocab_size, length - prefix).tolist(), new_tokens,
                        arrival_step=1 if prefix and index else 0)
            for index in range(count)]


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError as error:
        raise RequestFileError(f"{path}: cannot read: {error.strerror}") from None


def _json_line(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise RequestFileError(f"{path} line {number}: not JSON: {error.msg}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def read_request_file(path: Path, max_new_tokens: int, vocab_size: int, seed: int) -> list[RequestSpec]:
    """One request object per non-blank line (see ``REQUEST_KEYS``); ``prompt_len`` draws random ids from the
    line's ``seed`` (else ``--seed``) and its line number."""
    import numpy as np

    specs = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        record = _json_line(path, number, line)

        def bad(message: str) -> RequestFileError:
            return RequestFileError(f"{path} line {number}: {message}")

        if not isinstance(record, dict):
            raise bad("expected a JSON object")
        unknown = sorted(set(record) - set(REQUEST_KEYS))
        if unknown:
            raise bad(f"unknown field {unknown[0]!r} (expected {', '.join(REQUEST_KEYS)})")
        if ("prompt_ids" in record) == ("prompt_len" in record):
            raise bad("give exactly one of \"prompt_ids\": [int, ...] and \"prompt_len\": int")
        if "prompt_ids" in record and not _is_int_list(record["prompt_ids"]):
            raise bad("prompt_ids: expected a list of ints")
        if "prompt_len" in record and not (_is_int(record["prompt_len"]) and record["prompt_len"] >= 0):
            raise bad("prompt_len: expected an int >= 0")
        for key in ("max_new_tokens", "seed"):
            if key in record and not _is_int(record[key]):
                raise bad(f"{key}: expected an int")
        if "stop_ids" in record and not _is_int_list(record["stop_ids"]):
            raise bad("stop_ids: expected a list of ints")
        temperature = record.get("temperature", 0.0)
        if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                and math.isfinite(temperature) and temperature >= 0):
            raise bad("temperature: expected a number >= 0")
        top_k = record.get("top_k", 0)
        if not (_is_int(top_k) and top_k >= 0):
            raise bad("top_k: expected an int >= 0")
        request_seed = record.get("seed", seed)
        if "prompt_ids" in record:
            ids = list(record["prompt_ids"])
        else:
            ids = np.random.default_rng((abs(request_seed), number)).integers(
                0, vocab_size, record["prompt_len"]).tolist()
        specs.append(RequestSpec(ids, record.get("max_new_tokens", max_new_tokens), list(record.get("stop_ids", [])),
                                 float(temperature), top_k, request_seed))
    if not specs:
        raise RequestFileError(f"{path}: no requests")
    return specs


def read_prompt_file(path: Path) -> list[list[int]]:
    """One ``{"prompt_ids": [int, ...]}`` object per non-blank line."""
    prompts = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        record = _json_line(path, number, line)
        ids = record.get("prompt_ids") if isinstance(record, dict) else None
        if not _is_int_list(ids):
            raise RequestFileError(f"{path} line {number}: expected {{\"prompt_ids\": [int, ...]}}")
        prompts.append(ids)
    if not prompts:
        raise RequestFileError(f"{path}: no prompts")
    return prompts


# -- output -------------------------------------------------------------------------------------------------------


def _write_outputs(specs: list[RequestSpec], results: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as stream:
            write_jsonl(specs, results, stream)
    else:
        write_jsonl(specs, results, sys.stdout)
        sys.stdout.flush()


def output_record(index: int, spec: RequestSpec, result: Any | None) -> dict:
    """One request's output line; ``result`` is the engine's RequestResult (None: rejected here)."""
    if result is None:
        return {"request": index, "prompt_len": len(spec.prompt_ids), "output_ids": [], "finish_reason": "rejected",
                "ttft_ms": None, "token_latencies_ms": [], "error": spec.error}
    record = {"request": index, "prompt_len": result.prompt_len, "output_ids": list(result.output_ids),
              "finish_reason": result.finish_reason,
              "ttft_ms": None if result.ttft_s is None else round(result.ttft_s * 1e3, 3),
              "token_latencies_ms": [round(latency * 1e3, 3) for latency in result.token_latencies_s]}
    if result.error is not None:
        record["error"] = result.error
    return record


def write_jsonl(specs: list[RequestSpec], results: dict, stream: TextIO) -> None:
    for index, spec in enumerate(specs):
        stream.write(json.dumps(output_record(index, spec, results.get(index))) + "\n")


def summary(plan: MemoryPlan, arena: Arena, report: EngineReport, specs: list[RequestSpec],
            no_prefix_caching: bool, graphs: GraphCapture | None = None, warm_up_s: float | None = None) -> str:
    """The stderr report: planned vs allocated bytes, the allocator's view, throughput, latency, capacities."""
    device, stats, cap = arena.device, report.stats, plan.capacity
    rejected = stats.rejected + sum(1 for spec in specs if spec.error is not None)
    lines = [f"memplan run: {plan.model.name} on {plan.hardware.name} (device {device.kind}), "
             f"{len(specs)} request(s) in {report.steps} step(s), {cap.kv_pages} KV pages",
             f"  {'pool':<16} {'planned bytes':>16} {'allocated bytes':>16}"]
    for pool in plan.pools:
        if pool.materialized:
            lines.append(f"  {pool.name:<16} {pool.bytes:>16,} {arena.pools[pool.name].numel():>16,}")
    lines.append(f"  {'total':<16} {materialized_bytes(plan):>16,} {arena.allocated_bytes:>16,}")
    lines.append(f"device allocator: {_allocator_line(plan, arena)}")
    lines.append(f"device memory in use: {_process_line(plan, arena)}")
    if warm_up_s is not None:
        lines.append(f"warm-up: one prefill and one decode step before the clock started, {warm_up_s:.2f} s "
                     "(first-call kernel compilation)")
    lines.append(f"decode graphs: {_graphs_line(plan, arena, graphs)}")
    tokens_per_s = report.generated_tokens / report.wall_s if report.wall_s > 0 else float("nan")
    lines.append(f"requests: {len(specs)} ({len(specs) - rejected} run, {rejected} rejected); "
                 f"{report.generated_tokens} tokens generated in {report.wall_s:.3f} s = {tokens_per_s:,.1f} tokens/s")
    lines.append(f"TTFT: {_percentiles(report, report.ttfts)}")
    lines.append(f"TPOT: {_percentiles(report, report.tpots)}")
    lines.append(f"prefix cache: {_prefix_line(report, no_prefix_caching)}")
    lines.append(f"KV pages: peak {stats.peak_kv_pages_used} used of {cap.kv_pages - 1} usable "
                 f"(kv_pages {cap.kv_pages} - 1 padding page)")
    if plan.geometry.num_linear_layers > 0 or cap.recurrent_slots > 0:
        lines.append(f"recurrent slots: peak {stats.peak_slots_used} used of {cap.recurrent_slots} planned")
    lines.append(f"preemptions: {stats.preemptions}")
    lines.append(f"allocations after warm-up: {_allocations_line(report, device.is_sim)}")
    return "\n".join(lines)


def _percentiles(report: EngineReport, values: list[float]) -> str:
    if not values:
        return "n/a (no samples)"
    return (f"p50 {report.percentile_ms(values, 50):,.3f} ms, p99 {report.percentile_ms(values, 99):,.3f} ms "
            f"({len(values)} samples)")


def _prefix_line(report: EngineReport, no_prefix_caching: bool) -> str:
    if no_prefix_caching:
        return "off (--no-prefix-caching)"
    if not report.prefix_caching:
        return "off: Qwen3.5 recurrent state is not paged"
    stats = report.stats
    return (f"hit rate {stats.prefix_hit_rate:.1%} ({stats.prefix_hit_tokens} of {stats.prefix_query_tokens} "
            f"looked-up tokens), {stats.prefix_evictions} evictions")


def _allocator_line(plan: MemoryPlan, arena: Arena) -> str:
    if arena.device.is_sim:
        return "n/a (simulator)"
    import torch

    allocated = torch.cuda.memory_allocated(arena.device.torch_device)
    planned = materialized_bytes(plan)
    return (f"torch.cuda.memory_allocated {allocated:,} bytes vs plan materialized {planned:,} bytes "
            f"({allocated - planned:+,})")


def _process_line(plan: MemoryPlan, arena: Arena) -> str:
    if arena.device.is_sim:
        return "n/a (simulator)"
    import torch

    free, total = torch.cuda.mem_get_info(arena.device.torch_device)
    used = total - free
    return (f"{used:,} bytes (cudaMemGetInfo total - free; every process on the device) vs plan usable "
            f"{plan.budget.usable_bytes:,} bytes ({used / plan.budget.usable_bytes:.1%})")


def _graphs_line(plan: MemoryPlan, arena: Arena, graphs: GraphCapture | None) -> str:
    if arena.device.is_sim:
        return "off (the simulator has no CUDA graphs)"
    if graphs is None:
        return "off (--eager)"
    planned = next(b.bytes for pool in plan.pools if pool.name == "runtime" for b in pool.buffers
                   if b.name == "cuda_graphs")
    return (f"buckets {list(graphs.buckets)} captured in {graphs.seconds:.2f} s; their pool reserved "
            f"{graphs.reserved_bytes:,} bytes vs {planned:,} planned (cuda_graphs)")


def _allocations_line(report: EngineReport, simulator: bool) -> str:
    if simulator:
        return "n/a (simulator)"
    if report.allocations_after_warmup is None:
        return "n/a (no step ran)"
    return f"{report.allocations_after_warmup} (allocation.all.allocated, from the end of the first step to the end)"
