"""A served model: a plan materialized once with its weights, tokenizer and generation defaults,
running workloads of requests through the engine. ``memplan run`` (executor.runner) and the Python
API (executor.api) both stand on it.

``ServedModel.open(plan, device, weights=..., tokenizer=...)`` materializes the plan (one allocation
per pool), loads the weights (a checkpoint directory, or random ones from a seed), builds the model
and, on a GPU, runs the warm-up step pair and captures the decode graphs and the prefill graphs' pieces.
``run(specs, ...)`` serves ``RequestSpec``s: rejected-here ones are reported first, the others go through
one ``Engine`` run;
each request's output (its result and text) reaches ``on_output`` as it finishes, and a request's
text can stream to ``stream`` while it is generated. ``RunReport`` is the run's report as an object;
its ``text`` is what ``memplan run`` prints on stderr.

With ``tensor_parallel_size`` > 1 this process is rank 0: ``open`` starts the other ranks
(executor/workers.py; or joins torchrun's), which materialize the same per-rank plan on their own
devices and follow the steps rank 0 runs; a failure on any rank ends ``open`` or ``run`` with an
error naming the rank, and ``close`` ends the other ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from executor.generation import GenerationDefaults, RequestText, finished_text, read_generation_defaults
from executor.run_report import GraphCapture, materialized_bytes, summary
from executor.serving_figures import ServingFigures
from executor.workload import RequestSpec, RunError, add_eos, engine_seed

if TYPE_CHECKING:
    from executor.arena import Arena
    from executor.compile import StartupCompile, Target
    from executor.device import Device
    from executor.engine import EngineReport, RequestResult
    from executor.models.decoder import DecoderModel
    from executor.parallel import TensorParallel
    from executor.startup import StartupClock
    from executor.tokenizer import Tokenizer
    from executor.workers import RankMemory, Ranks
    from planner.plan import MemoryPlan

#: The simulator keeps the arena in host memory; refuse plans bigger than this there.
SIM_MAX_MATERIALIZED_BYTES = 1 << 30
#: Failed start-up compiles named on the log (the compile's own line counts them all).
MAX_FAILURE_LINES = 3
#: ``ServedModel.open``'s ``weights`` for random weights of the planned shapes.
RANDOM_WEIGHTS = "random"

#: on_output(input index, spec, engine result or None when rejected before the engine, text or None)
OutputCallback = Callable[[int, RequestSpec, "RequestResult | None", "str | None"], None]


def choose_simulator(device: str) -> None:
    """Enable the Numba CUDA simulator for ``device`` "sim" (or "auto" without CUDA), before numba.cuda loads."""
    if device == "sim":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    elif device == "auto":
        import torch

        if not torch.cuda.is_available():
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


@dataclass(frozen=True)
class PoolBytes:
    name: str
    planned: int
    allocated: int


@dataclass(frozen=True)
class RunReport:
    """One run's report: the engine's (``engine``: per-request results, scheduler counters), the bytes
    planned and allocated per pool, throughput and latency, the generation defaults that applied, and
    ``text``, the report ``memplan run`` prints."""

    engine: EngineReport
    pools: tuple[PoolBytes, ...]
    requests: int
    rejected: int
    generated_tokens: int
    wall_s: float
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    preemptions: int
    peak_kv_pages: int
    sampling_defaults: str  # what requests that set no sampling parameter sampled with, and why
    eos: str
    text: str
    figures: ServingFigures  # throughput and latency as memplan run and bench/serve.py report them
    ranks: tuple[RankMemory, ...] = ()  # tensor parallelism: every rank's memory after the run

    @property
    def tokens_per_s(self) -> float:
        return self.figures.output_tokens_per_s


@dataclass
class ServedModel:
    """A materialized plan with its weights and model; see the module docstring."""

    plan: MemoryPlan
    arena: Arena
    model: DecoderModel
    tokenizer: Tokenizer | None
    generation: GenerationDefaults
    graphs: GraphCapture | None = None
    warm_up_s: float | None = None
    weights_source: str = ""
    clock: StartupClock | None = None  # the start-up phases of open()
    ranks: Ranks | None = None  # tensor parallelism: the group and the other ranks' processes

    @classmethod
    def open(cls, plan: MemoryPlan, device: str = "auto", *, weights: str | Path, seed: int = 0,
             tokenizer: Tokenizer | None = None, generation: GenerationDefaults | None = None,
             eager: bool = False, clock: StartupClock | None = None, log: TextIO | None = None,
             compiling: StartupCompile | None = None, ranks: Ranks | None = None) -> ServedModel:
        """Materialize ``plan`` on ``device`` ("auto", "cuda", "sim"), fill its weights from ``weights`` (a
        checkpoint directory, or RANDOM_WEIGHTS from ``seed``), build the model; on a GPU warm it up and
        capture the decode graphs and the prefill graphs' pieces unless ``eager``. ``generation``: the
        checkpoint's defaults (read from the weights' directory when None). On a GPU the kernels start-up
        needs that the persistent kernel
        cache lacks compile in processes while the plan materializes and the weights load (executor/compile.py):
        ``compiling``, when the caller started that compile (for the plan's hardware, before torch
        loaded), else started here for the device. ``clock`` records the start-up phases, and ``log``
        gets the compile's progress and failures. With tensor parallelism it starts the other ranks
        first (this process is rank 0), unless ``ranks`` holds them already started (``Ranks.start``)."""
        choose_simulator(device)
        if plan.serving.tensor_parallel_size > 1 and ranks is None:
            from executor.numba_cuda import simulator_enabled
            from executor.workers import Ranks

            check_fits_device(plan, simulator_enabled())
            ranks = Ranks.start(plan, "sim" if simulator_enabled() else "cuda", str(weights), seed)
        try:
            return cls._open(plan, device, weights=weights, seed=seed, tokenizer=tokenizer, generation=generation,
                             eager=eager, clock=clock, log=log, compiling=compiling, ranks=ranks)
        except BaseException as error:
            if compiling is not None:
                compiling.close()
            if ranks is None:
                raise
            raise ranks.failure(error) from error

    @classmethod
    def _open(cls, plan: MemoryPlan, device: str, *, weights: str | Path, seed: int, tokenizer: Tokenizer | None,
              generation: GenerationDefaults | None, eager: bool, clock: StartupClock | None, log: TextIO | None,
              compiling: StartupCompile | None, ranks: Ranks | None) -> ServedModel:
        from executor.device import open_device
        from executor.engine import warm_up
        from executor.startup import KernelCensus, StartupClock

        opened = open_device(device)
        check_fits_device(plan, opened.is_sim)
        if not opened.is_sim:
            check_fits_gpu(plan, opened)
        if generation is None:
            directory = None if weights == RANDOM_WEIGHTS else weights
            generation = read_generation_defaults(directory, plan.model.vocab_size)
        clock = clock if clock is not None else StartupClock()
        compiling = compile_for(opened, plan, compiling, log)
        if compiling is not None:
            clock.mark("kernel cache")
        parallel = ranks.parallel if ranks is not None else None
        try:
            arena, model, source = _materialize_and_fill(plan, opened, weights, seed, clock, parallel)
        except BaseException:
            if compiling is not None:
                compiling.close()
            raise
        if compiling is not None:
            compiled = compiling.wait()
            clock.mark("kernels", compiled.line())
            for failure in compiled.failed[:MAX_FAILURE_LINES]:
                print(f"memplan: kernel compile failed, it compiles at its first launch: {failure}", file=log)
        served = cls(plan, arena, model, tokenizer, generation, weights_source=source, ranks=ranks)
        if not opened.is_sim:  # on a GPU: keep the kernels' first-call loading or compilation out of the latencies
            warm_up(model)
            served.warm_up_s = clock.mark("warm-up", KernelCensus.of(model).text())
            if not eager:
                before_capture = KernelCensus.of(model)
                served.graphs = capture_graphs(model)
                clock.mark("graph capture", KernelCensus.of(model).since(before_capture).text())
        served.clock = clock
        return served

    def run(self, specs: Sequence[RequestSpec], *, on_output: OutputCallback | None = None,
            stream: Callable[[str], None] | None = None, ignore_eos: bool = False, prefix_caching: bool = True,
            overlap: bool = True, progress: Callable[[list, int], Callable[[int], None]] | None = None) -> RunReport:
        """Serve ``specs`` (see the module docstring); the checkpoint's EOS ids join their stop ids unless
        ``ignore_eos`` (or a spec's own). ``stream``: where the text of the only request goes while it is
        generated (needs a tokenizer and exactly one spec). ``progress(requests, total)`` makes the
        engine's per-step callback from its requests."""
        from executor.engine import Engine
        from executor.scheduler import FINISH_REJECTED, Request

        if stream is not None and (self.tokenizer is None or len(specs) != 1):
            raise RunError("streaming text needs a tokenizer and exactly one request")
        add_eos(list(specs), self.generation.eos_ids, ignore_eos)
        for index, spec in enumerate(specs):
            if spec.error is not None and on_output is not None:
                on_output(index, spec, None, None)
        runnable = [index for index, spec in enumerate(specs) if spec.error is None]
        requests = [Request(request_id=index, prompt_ids=specs[index].prompt_ids,
                            max_new_tokens=specs[index].max_new_tokens, stop_ids=specs[index].stop_ids,
                            temperature=specs[index].temperature, top_k=specs[index].top_k,
                            seed=engine_seed(specs[index].seed), top_p=specs[index].top_p) for index in runnable]
        texts = {index: RequestText(self.tokenizer, specs[index].stop, stream) for index in runnable
                 if self.tokenizer is not None and (specs[index].stop or stream is not None)}

        def on_tokens(request: Request, new_ids: list[int]) -> bool:
            text = texts.get(request.request_id)
            return text is not None and text.add(new_ids)

        def on_finish(result: RequestResult) -> None:
            index = result.request_id
            text = None
            if result.finish_reason == FINISH_REJECTED:
                pass  # it generated nothing: its line has the error, not a text
            elif index in texts:
                text = texts[index].finish(result.output_ids)
            elif self.tokenizer is not None:
                text = finished_text(self.tokenizer, result.output_ids, specs[index].stop)
            if on_output is not None:
                on_output(index, specs[index], result, text)

        engine = Engine(self.model, prefix_caching=prefix_caching, overlap=overlap)
        on_step = progress(requests, len(specs)) if progress is not None else None
        steps, times_s = arrivals([specs[index] for index in runnable])
        try:
            before = self.ranks.measure(self.model) if self.ranks is not None else []
            report = engine.run(requests, steps, on_step=on_step, on_tokens=on_tokens if texts else None,
                                on_finish=on_finish, arrival_times_s=times_s)
            after = self.ranks.measure(self.model) if self.ranks is not None else []
        except BaseException as error:
            if self.ranks is None:
                raise
            raise self.ranks.failure(error) from error
        return self.report(report, specs, not prefix_caching, ignore_eos, tuple(before), tuple(after))

    def close(self) -> None:
        """End the other tensor-parallel ranks (their processes exit) and leave the group; nothing to do on
        one device. The model serves no more runs after it."""
        if self.ranks is not None:
            self.ranks.stop()

    def report(self, report: EngineReport, specs: Sequence[RequestSpec], no_prefix_caching: bool,
               ignore_eos: bool = False, ranks_before: tuple[RankMemory, ...] = (),
               ranks_after: tuple[RankMemory, ...] = ()) -> RunReport:
        """The RunReport of an engine run over ``specs``; ``ranks_before`` / ``ranks_after``: every
        tensor-parallel rank's memory around the engine run (empty on one device)."""
        from executor.workers import memory_lines

        sampling = self.generation.sampling.describe()
        if self.generation.unapplied:
            sampling += f"; not applied: {', '.join(self.generation.unapplied)} (generation_config.json)"
        eos = self.generation.describe_eos(ignore_eos)
        lines = [f"weights: {self.weights_source}", f"EOS ids: {eos}", f"sampling defaults: {sampling}"]
        figures = ServingFigures.of(report)
        if ranks_after:
            tp = self.plan.serving.tensor_parallel_size
            lines += [f"tensor parallel: {tp} ranks, the pools above are rank 0's (every rank plans the same bytes)",
                      *(f"  {line}" for line in memory_lines(list(ranks_before), list(ranks_after)))]
        text = summary(self.plan, self.arena, report, list(specs), no_prefix_caching, self.graphs, self.warm_up_s,
                       extra_lines=lines, figures=figures)
        pools = tuple(PoolBytes(pool.name, pool.bytes, self.arena.pools[pool.name].numel())
                      for pool in self.plan.pools if pool.materialized)
        rejected = report.stats.rejected + sum(1 for spec in specs if spec.error is not None)
        return RunReport(report, pools, len(specs), rejected, report.generated_tokens, report.wall_s,
                         figures.ttft_ms_p50, figures.ttft_ms_p99, figures.tpot_ms_p50, figures.tpot_ms_p99,
                         report.stats.preemptions, report.stats.peak_kv_pages_used, sampling, eos, text, figures,
                         ranks_after)


def arrivals(specs: Sequence[RequestSpec]) -> tuple[list[int] | None, list[float] | None]:
    """The engine's (arrival_steps, arrival_times_s) of ``specs``: by time when a spec sets ``arrival_s``
    (then every one arrives by time, those without one at 0 s), else by step; RunError when a spec gives
    a step beside another's time."""
    if all(spec.arrival_s is None for spec in specs):
        return [spec.arrival_step for spec in specs], None
    if any(spec.arrival_step for spec in specs):
        raise RunError("requests arrive by step (arrival_step) or by time (arrival_s), not both in one run")
    return None, [0.0 if spec.arrival_s is None else spec.arrival_s for spec in specs]


def _materialize_and_fill(plan: MemoryPlan, opened: Device, weights: str | Path, seed: int, clock: StartupClock,
                          parallel: TensorParallel | None) -> tuple[Arena, DecoderModel, str]:
    """Materialize ``plan`` on ``opened`` (``parallel``'s rank of it, rank 0 without), fill its weights (a
    checkpoint directory, or RANDOM_WEIGHTS from ``seed``) and build the model: (arena, model, what the
    weights are)."""
    from executor.arena import materialize
    from executor.models import build_model
    from executor.weights import fill_random, load_checkpoint

    try:
        arena = materialize(plan, opened, parallel.rank if parallel is not None else 0)
    except ValueError as error:  # a rank outside the plan's tensor_parallel_size
        raise RunError(str(error)) from None
    opened.synchronize()
    clock.mark("materialize")
    if weights == RANDOM_WEIGHTS:
        fill_random(arena, seed)
        source = f"random (seed {seed})"
    else:
        load_checkpoint(arena, weights)
        source = str(weights)
    model = build_model(arena, parallel)
    opened.synchronize()
    clock.mark("weights")
    return arena, model, source


def check_fits_device(plan: MemoryPlan, simulator: bool) -> None:
    total = materialized_bytes(plan)
    if simulator and total > SIM_MAX_MATERIALIZED_BYTES:
        raise RunError(f"the simulator runs tiny configs in host memory; this plan ({plan.model.name} on "
                       f"{plan.hardware.name}) materializes {total:,} bytes: use --hardware cpu-sim "
                       f"and a tiny model, or --device cuda")


def gpu_shortfall(plan: MemoryPlan, gpu: str, free_bytes: int, total_bytes: int) -> str | None:
    """Why ``plan``'s arena cannot be allocated on a GPU with ``free_bytes`` of ``total_bytes`` free (a plan
    made for another card, or memory other processes hold), or None when it fits."""
    need = materialized_bytes(plan)
    if need <= free_bytes:
        return None
    gib = 2**30
    return (f"the plan ({plan.model.name} on hardware {plan.hardware.name}, gpu_memory_utilization "
            f"{plan.serving.gpu_memory_utilization}) materializes {need / gib:,.2f} GiB ({need:,} bytes); this GPU "
            f"({gpu}) has {free_bytes / gib:,.2f} GiB free of {total_bytes / gib:,.2f} GiB: plan for this card "
            f"(--hardware, a config of configs/hardware/ or a YAML file) or lower --gpu-memory-utilization")


def check_fits_gpu(plan: MemoryPlan, device: Device) -> None:
    """RunError when the plan's arena is larger than the GPU's free memory (counting what torch's allocator
    holds unused in this process, which the arena can reuse): say so before allocating it."""
    import torch

    where = device.torch_device
    free, total = torch.cuda.mem_get_info(where)
    cached = torch.cuda.memory_reserved(where) - torch.cuda.memory_allocated(where)
    shortfall = gpu_shortfall(plan, torch.cuda.get_device_name(where), free + cached, total)
    if shortfall is not None:
        raise RunError(shortfall)


def start_compile(plan: MemoryPlan, log: TextIO | None, target: Target | None = None) -> StartupCompile | None:
    """The cold-start compile (executor/compile.py) of the kernels ``plan``'s start-up needs that the
    persistent cache lacks, running in processes, for ``target`` (the current GPU when None); None when
    the cache is off."""
    from executor.compile import StartupCompile
    from executor.kernel_cache import KernelCache

    cache = KernelCache.from_environment()
    return None if cache is None else StartupCompile(plan, cache, log, target=target)


def compile_for(opened: Device, plan: MemoryPlan, started: StartupCompile | None,
                log: TextIO | None) -> StartupCompile | None:
    """The start-up compile for the ``opened`` device: none in the simulator; ``started`` when it compiles
    for this GPU; else one started now for it (saying why when ``started`` was for other hardware)."""
    from executor.compile import device_target

    if opened.is_sim:
        if started is not None:
            started.close()
        return None
    target = device_target()
    if started is not None and started.matches(target):
        return started
    if started is not None:
        started.close()
        print(f"memplan: the plan's hardware {plan.hardware.name} ({started.target.describe()}) is not this GPU "
              f"({target.describe()}): compiling the kernels for this GPU", file=log)
    return start_compile(plan, log, target)


def capture_graphs(model: DecoderModel) -> GraphCapture:
    """Capture the decode graphs, then the prefill graphs' pieces, timing each and the bytes its pool reserved."""
    import torch

    device = model.device.torch_device
    torch.cuda.synchronize(device)
    reserved, start = torch.cuda.memory_reserved(device), time.perf_counter()
    model.capture_decode_graphs()
    decode_s, decode_bytes = time.perf_counter() - start, torch.cuda.memory_reserved(device) - reserved
    reserved, start = torch.cuda.memory_reserved(device), time.perf_counter()
    model.capture_prefill_graphs()
    prefill = model.prefill_graphs
    return GraphCapture(model.graphs.buckets, decode_s, decode_bytes,
                        prefill_buckets=prefill.buckets if prefill is not None else (),
                        prefill_pieces=prefill.num_pieces if prefill is not None else 0,
                        prefill_seconds=time.perf_counter() - start,
                        prefill_reserved_bytes=torch.cuda.memory_reserved(device) - reserved)
