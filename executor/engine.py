"""The engine: a workload of requests lives inside the plan's capacities.

Each iteration asks the scheduler for a step (decode rows, prefill chunks,
admissions within the planned batch, tokens, KV pages and recurrent slots),
zeroes the recurrent slots it hands out, refills the step metadata in place,
runs the model, reads back the sampled ids (the one host sync) and gives them
to the scheduler. Capacity limits surface as scheduler decisions (deferral,
preemption, rejection at arrival); the arena never grows.

Overlapped (``overlap=True``, the default; vLLM's async scheduling): the engine
schedules and launches step N + 1 before it waits for step N's sampled ids, so
the host's scheduling, metadata and launch work runs while the GPU computes
step N instead of between two steps. Step N + 1's decode rows take their
tokens from step N's sampled ids on the device (scheduler.py's overlapped
scheduling; kernels/rows/embedding.py); each step's ids go to one of two pinned
host buffers by an asynchronous copy ordered after the step, so the next
step's sampler cannot overwrite them before they are read. A request that
stops on a stop id has computed one more row, which is dropped. Outputs are
the same as without overlap.

Arrivals: by step (``arrival_steps``: request i joins the scheduler before step
``arrival_steps[i]``) or by wall clock (``arrival_times_s``: request i joins once
the engine's clock, seconds since ``run`` started, passes ``arrival_times_s[i]``).
Arrivals are checked before every step is scheduled, with a step in flight or
not; when nothing runs or is in flight and the next arrival is in the future,
the engine sleeps until it. A request's ``arrival_s`` is its arrival time, so
its TTFT counts the time it waited for a place in a step.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from executor import routing
from executor.models.decoder import DecoderModel
from executor.page_tables import PageTables
from executor.scheduler import (FINISH_STOP, Request, ScheduledStep, Scheduler, SchedulerStats, StepChunk,
                                can_cache_prefixes)
from executor.serving_figures import percentile_ms, request_tpot_s, token_gaps_s
from executor.step import RequestChunk, plan_step
from planner.ideal_time import StepWork
from planner.plan import MemoryPlan


@dataclass
class RequestResult:
    """What a request produced and when (seconds since the engine started)."""

    request_id: object
    prompt_len: int
    output_ids: list[int]
    finish_reason: str | None
    error: str | None
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def token_latencies_s(self) -> list[float]:
        times = [self.arrival_s, *self.token_times_s]
        return [later - earlier for earlier, later in zip(times, times[1:])]


@dataclass(frozen=True)
class StepTiming:
    """One step as the engine read it back: its decode rows and prefill tokens, and the seconds from
    its launch, or from the read-back before it when that came later, to its read-back: the gap each
    of its decode rows' requests saw between two tokens; and the host seconds its launch took (metadata,
    kernel launches or the graph replay), which the step before it waits behind when longer than it."""

    decode_rows: int
    prefill_tokens: int
    gap_s: float
    launch_s: float
    work: StepWork  # what it computed, for its ideal time (planner/ideal_time.py's step_ideal_s)


@dataclass
class EngineReport:
    results: list[RequestResult]
    stats: SchedulerStats
    prefix_caching: bool
    overlap: bool  # steps scheduled one ahead of the read-back (Engine's overlap)
    steps: int
    wall_s: float
    allocations_after_warmup: int | None  # CUDA only: allocations from the second step to the end
    # Kernel specializations first readied (loaded from the kernel cache or compiled) from the end of the
    # first step to the end, by kernel name: each is a host stall of its load or compile inside a step.
    kernels_readied_after_warmup: dict[str, int] = field(default_factory=dict)
    step_timings: list[StepTiming] = field(default_factory=list)  # one a step, in step order

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.results)

    def percentile_ms(self, values: Sequence[float], q: int) -> float:
        return percentile_ms(values, q)

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.results if r.ttft_s is not None]

    @property
    def tpots(self) -> list[float]:
        """Per request of two or more tokens: its mean gap after the first token (vLLM's TPOT)."""
        return [tpot for r in self.results if (tpot := request_tpot_s(r.token_times_s)) is not None]

    @property
    def itls(self) -> list[float]:
        """Every gap between two consecutive tokens of a request, pooled (vLLM's inter-token latency)."""
        return [gap for r in self.results for gap in token_gaps_s(r.token_times_s)]


class Engine:
    """Continuous batching of requests over one materialized model."""

    def __init__(self, model: DecoderModel, *, prefix_caching: bool = True, overlap: bool = True):
        plan = model.arena.plan
        recurrent = plan.geometry.num_linear_layers > 0
        # Qwen3.5's recurrent state is not paged: a cached KV prefix resumes it only from a planned snapshot.
        self.prefix_caching = prefix_caching and can_cache_prefixes(plan.capacity, recurrent)
        self.model, self.plan = model, plan
        self.scheduler = Scheduler(plan.capacity, prefix_caching=self.prefix_caching, has_recurrent_state=recurrent)
        self.page_tables = PageTables()  # the running requests' page lists as arrays, extended step by step
        self.overlap = overlap
        self.read_back = ReadBack(model, plan.capacity.max_batch)

    def run(self, requests: Sequence[Request], arrival_steps: Sequence[int] | None = None,
            on_step: Callable[[int], None] | None = None,
            on_tokens: Callable[[Request, list[int]], bool] | None = None,
            on_finish: Callable[[RequestResult], None] | None = None, *,
            arrival_times_s: Sequence[float] | None = None) -> EngineReport:
        """Run ``requests`` to completion. ``arrival_steps[i]``: the step before which request i arrives;
        ``arrival_times_s[i]``: the second (since the run started) from which it does (give at most one of
        the two; all at step 0 by default). ``on_step(steps_done)`` runs after every step (progress reports).
        ``on_tokens(request, new_ids)`` runs when a step gave a request ids (text, streaming); True
        finishes the request there as "stop" (a stop string in its text). ``on_finish(result)`` runs
        once per request as it finishes (a rejected one at its arrival), its result complete.
        Returns one result per request, in input order.

        While it runs, the objects that exist at its start (the model, its views, kernels and graphs) are
        out of the collector's generations (``gc.freeze``), so a full collection does not walk them again;
        afterwards they are collectable as before (a released model frees its memory)."""
        gc.freeze()
        try:
            return self._run(requests, Arrivals.of(len(requests), arrival_steps, arrival_times_s), on_step,
                             on_tokens, on_finish)
        finally:
            gc.unfreeze()

    def _run(self, requests: Sequence[Request], arrivals: Arrivals, on_step: Callable[[int], None] | None,
             on_tokens: Callable[[Request, list[int]], bool] | None,
             on_finish: Callable[[RequestResult], None] | None) -> EngineReport:
        results = {id(r): RequestResult(r.request_id, len(r.prompt_ids), [], None, None, 0.0) for r in requests}
        by_id = {r.request_id: r for r in requests}
        start, steps, allocations_start, kernels_start = time.perf_counter(), 0, None, None
        # A launched step, its read-back buffer, when its launch started and how long it took (s).
        in_flight: tuple[ScheduledStep, int, float, float] | None = None
        timings: list[StepTiming] = []
        last_read_s = 0.0
        while arrivals.pending or self.scheduler.has_unfinished or in_flight is not None:
            now = time.perf_counter() - start
            for index in arrivals.due(steps, now):
                request = requests[index]
                results[id(request)].arrival_s = arrivals.arrival_s(index, now)
                if not self.scheduler.add(request):  # rejected: finished at its arrival
                    _finish_result(results[id(request)], request, on_finish)
            step = self.scheduler.schedule() if self.overlap or in_flight is None else None
            launched = None
            if step is not None:
                for slot in step.fresh_slots:
                    self.model.reset_slot(slot)
                for source, target in step.restored:
                    self.model.copy_slot(source, target)
                chunks = [_request_chunk(chunk, by_id[chunk.request_id]) for chunk in step.chunks]
                launch_s = time.perf_counter() - start
                sampled = self.model.step(plan_step(self.plan, chunks, self.page_tables))
                for source, target in step.snapshots:  # queued after the step's kernels
                    self.model.copy_slot(source, target)
                launched = (step, self.read_back.start(sampled, steps), launch_s,
                            time.perf_counter() - start - launch_s)
                steps += 1
            elif in_flight is None:  # idle until the next arrival
                steps = arrivals.idle(steps, time.perf_counter() - start)
                continue
            if in_flight is not None:
                done, buffer, done_launch_s, done_launch_took_s = in_flight
                sampled_ids = self.read_back.wait(buffer, done.num_requests)
                now = time.perf_counter() - start
                timings.append(StepTiming(done.num_decode_rows, done.num_prefill_tokens,
                                          now - max(done_launch_s, last_read_s), done_launch_took_s, done.work))
                last_read_s = now
                # Stamp the ids update() keeps (it drops those of requests finished or preempted since).
                counts = {c.request_id: len(by_id[c.request_id].output_ids) for c in done.chunks if c.sample}
                finished = self.scheduler.update(done, sampled_ids)
                for request_id, count in counts.items():
                    request = by_id[request_id]
                    if len(request.output_ids) > count:
                        results[id(request)].token_times_s.append(now)
                        stop = on_tokens is not None and on_tokens(request, request.output_ids[count:])
                        if stop and request.is_finished:  # its last id also made max_new_tokens
                            request.finish_reason = FINISH_STOP
                        elif stop:
                            self.scheduler.stop(request_id)
                            finished.append(request)
                for request in finished:
                    _finish_result(results[id(request)], request, on_finish)
                if on_step is not None:
                    on_step(done.index + 1)
                if allocations_start is None:  # after the first step run (warm-up: compiles, cuBLAS set-up)
                    allocations_start = _allocation_count(self.model)
                    kernels_start = kernel_specializations(self.model)
            in_flight = launched
        for request in requests:
            _finish_result(results[id(request)], request, None)
        end_count = _allocation_count(self.model)
        grown = None if allocations_start is None or end_count is None else end_count - allocations_start
        wall_s = time.perf_counter() - start
        readied = {} if kernels_start is None else readied_since(kernels_start, kernel_specializations(self.model))
        return EngineReport([results[id(r)] for r in requests], self.scheduler.stats(), self.prefix_caching,
                            self.overlap, steps, wall_s, grown, readied, timings)


class Arrivals:
    """When each request of a run joins the scheduler: before a step index, or from a second of the
    engine's clock; requests arrive earliest first (ties in input order)."""

    def __init__(self, steps: Sequence[int] | None, times_s: Sequence[float] | None):
        self.steps, self.times_s = steps, times_s
        keys = steps if steps is not None else times_s
        self._order = sorted(range(len(keys)), key=lambda i: keys[i])
        self._next = 0  # requests in _order before this one have arrived

    @classmethod
    def of(cls, count: int, steps: Sequence[int] | None, times_s: Sequence[float] | None) -> Arrivals:
        """The arrivals of ``count`` requests; ValueError when both kinds are given, when one has the wrong
        length, or when a time is negative or not finite."""
        if steps is not None and times_s is not None:
            raise ValueError("give arrival_steps or arrival_times_s, not both")
        if times_s is not None:
            times = [float(t) for t in times_s]
            if len(times) != count or not all(math.isfinite(t) and t >= 0 for t in times):
                raise ValueError(f"arrival_times_s: {count} finite times >= 0 needed, got {times}")
            return cls(None, times)
        given = [0] * count if steps is None else [int(step) for step in steps]
        if len(given) != count:
            raise ValueError(f"arrival_steps: {len(given)} values for {count} requests")
        return cls(given, None)

    @property
    def pending(self) -> bool:
        """Whether a request is yet to arrive."""
        return self._next < len(self._order)

    def due(self, steps: int, now_s: float) -> list[int]:
        """Take the requests that have arrived before step ``steps`` at ``now_s`` seconds, in arrival order."""
        keys, clock = (self.steps, steps) if self.steps is not None else (self.times_s, now_s)
        first = self._next
        while self._next < len(self._order) and keys[self._order[self._next]] <= clock:
            self._next += 1
        return self._order[first:self._next]

    def arrival_s(self, index: int, now_s: float) -> float:
        """Request ``index``'s arrival on the engine's clock: its arrival time, or now for a step arrival."""
        return self.times_s[index] if self.times_s is not None else now_s

    def idle(self, steps: int, now_s: float) -> int:
        """Nothing runs and nothing is in flight: wait for the next arrival. By step, the step counter
        jumps to it (returned); by time, sleep until it."""
        if not self.pending:
            return steps
        upcoming = self._order[self._next]
        if self.steps is not None:
            return max(steps, self.steps[upcoming])
        wait_s = self.times_s[upcoming] - now_s
        if wait_s > 0:
            time.sleep(wait_s)
        return steps


def warm_up(model: DecoderModel) -> None:
    """Run ``warm_up_steps`` (a prefill step and a decode step on scratch data, then a short prefill step
    where it routes apart) before serving, so that first-call work (loading or compiling kernels, cuBLAS
    set-up) is not charged to the first requests' latencies."""
    plan = model.arena.plan
    steps = warm_up_steps(plan)
    for chunk in steps[0] if steps else ():
        model.reset_slot(chunk.slot)  # a no-op without recurrent state
    sampled = None
    for chunks in steps:
        sampled = model.step(plan_step(plan, chunks))
    if sampled is not None:
        sampled.tolist()  # waits for the device


#: Rows of the warm-up step's short prefill chunk: more than a decode row, fewer than any long chunk.
SHORT_CHUNK_ROWS = 2


def warm_up_steps(plan: MemoryPlan) -> list[list[RequestChunk]]:
    """The scratch steps ``warm_up`` runs (kernel discovery runs the same ones): a prefill step that
    feeds a chunk long enough for the long-chunk attention backend (serving gemm_attention_min_tokens
    and prefill_attention, when the KV pool has the pages) after a one-token chunk (a prefill step's
    decode row: the decode kernels' path there) and a chunk of SHORT_CHUNK_ROWS rows (a chunk short of
    the long backend: the paged attention kernel's path), then a decode step that continues the long
    one; none when the KV pool has fewer than two usable pages. The decode row and the short chunk join
    the step only where the batch, the step's tokens and the KV pages have room for them. Where the first
    step is long enough to route apart from a short one (``_short_step_routes_apart``), a third step runs
    a chunk of SHORT_CHUNK_ROWS rows alone, over the long chunk's first pages and slot.

    They write KV pages from 1 and recurrent slots from 0 and leave them: no request owns a page yet,
    the prefix cache is empty, and a slot is zeroed on admission.
    """
    cap = plan.capacity
    page_size, usable_pages = cap.page_size, cap.kv_pages - 1
    long_len = min(plan.serving.gemm_attention_min_tokens, cap.max_prefill_tokens, cap.max_context - 1,
                   (usable_pages - 1) * page_size - 1)
    if long_len < 1:
        return []
    recurrent = plan.geometry.num_linear_layers > 0
    long_pages = list(range(1, 2 + long_len // page_size))  # room for the decode step's token too
    long_chunk = RequestChunk([0] * long_len, 0, long_pages, slot=0 if recurrent else -1)
    chunks = [long_chunk]
    next_page, rows, decode_rows = long_pages[-1] + 1, long_len, 0
    if cap.max_batch > len(chunks) and rows + 1 <= cap.max_tokens_per_step:  # first, as the scheduler puts decode rows
        chunks.insert(0, RequestChunk([0], 0, [next_page], slot=1 if recurrent else -1))
        next_page, rows, decode_rows = next_page + 1, rows + 1, 1
    short_pages = -(-SHORT_CHUNK_ROWS // page_size)
    if (cap.max_batch > len(chunks) and rows + SHORT_CHUNK_ROWS <= cap.max_tokens_per_step
            and next_page + short_pages - 1 <= usable_pages and SHORT_CHUNK_ROWS < long_len):
        chunks.insert(len(chunks) - 1, RequestChunk([0] * SHORT_CHUNK_ROWS, 0,
                                                    list(range(next_page, next_page + short_pages)),
                                                    slot=len(chunks) if recurrent else -1))
        rows += SHORT_CHUNK_ROWS
    steps = [chunks, [RequestChunk([0], long_len, long_pages, slot=long_chunk.slot)]]
    if _short_step_routes_apart(plan, rows, rows - decode_rows):
        steps.append([RequestChunk([0] * SHORT_CHUNK_ROWS, 0, long_pages[:short_pages], slot=long_chunk.slot)])
    return steps


def _short_step_routes_apart(plan: MemoryPlan, rows: int, prefill_rows: int) -> bool:
    """Whether a prefill step of SHORT_CHUNK_ROWS rows takes a kernel that a step of ``rows`` rows, of
    which ``prefill_rows`` are chunks' rows, does not (executor/routing.py): the fused q/k norm + RoPE +
    KV write (at most FUSED_ROPE_KV_MAX_ROWS rows) or the recurrent delta rule (Qwen3.5's linear layers,
    prefill rows short of CHUNKED_DELTA_RULE_MIN_ROWS)."""
    g = plan.geometry
    fused_rope = g.num_full_layers > 0 and SHORT_CHUNK_ROWS <= routing.FUSED_ROPE_KV_MAX_ROWS < rows
    chunked_min_rows = routing.CHUNKED_DELTA_RULE_MIN_ROWS
    recurrent = (g.num_linear_layers > 0 and chunked_min_rows is not None
                 and SHORT_CHUNK_ROWS < chunked_min_rows <= prefill_rows)
    return fused_rope or recurrent


class ReadBack:
    """A step's sampled ids to the host: an asynchronous copy into one of two pinned buffers, ordered
    after the step on torch's current stream, and an event to wait on. Two buffers, so that with one
    step in flight the next step's copy never lands in the buffer still to be read. In the simulator
    (no streams) the ids are read at once."""

    def __init__(self, model: DecoderModel, max_batch: int):
        self.simulated = model.device.is_sim
        self.device = model.device.torch_device
        self.buffers = [torch.empty(max_batch, dtype=torch.int32, pin_memory=not self.simulated) for _ in range(2)]
        self.copied = [None if self.simulated else torch.cuda.Event() for _ in range(2)]

    def start(self, sampled: torch.Tensor, step_index: int) -> int:
        """Start reading ``sampled`` (the model's sampled ids view [B]); returns the buffer to wait on."""
        buffer = step_index % 2
        self.buffers[buffer][: sampled.shape[0]].copy_(sampled, non_blocking=not self.simulated)
        if not self.simulated:
            self.copied[buffer].record(torch.cuda.current_stream(self.device))
        return buffer

    def wait(self, buffer: int, count: int) -> list[int]:
        """The ``count`` ids of ``buffer``, once its copy has landed."""
        if not self.simulated:
            self.copied[buffer].synchronize()
        return self.buffers[buffer][:count].tolist()


def _request_chunk(chunk: StepChunk, request: Request) -> RequestChunk:
    """The scheduler's chunk with the request's sampling parameters; the RNG counter is the index
    of the token being sampled (``StepChunk.sample_index``), so a request's tokens do not depend on
    its batch or on overlap. Its page list is keyed by admission: it only grows until the request is
    released."""
    return RequestChunk(chunk.token_ids, chunk.num_cached, chunk.page_ids, chunk.slot, request.temperature,
                        request.top_k, request.seed, chunk.sample_index, top_p=request.top_p,
                        page_table_key=request.admission)


def _finish_result(result: RequestResult, request: Request,
                   on_finish: Callable[[RequestResult], None] | None) -> None:
    """Fill ``result`` from its finished request (ids, reason, one time stamp per kept id); report it."""
    result.output_ids = list(request.output_ids)
    result.finish_reason, result.error = request.finish_reason, request.error
    result.token_times_s = result.token_times_s[: len(result.output_ids)]
    if on_finish is not None:
        on_finish(result)


def kernel_specializations(model: DecoderModel) -> dict[int, tuple[str, set[tuple]]]:
    """Every kernel the model launches (by identity: two builds of one kernel function are two kernels),
    with its name and the argument types it has an overload ready for (loaded from the kernel cache or
    compiled, on the fast launch path or Numba's own)."""
    from executor.kernel_discovery import find_kernels, kernel_name

    return {id(kernel): (kernel_name(kernel), {*kernel.origins, *kernel.dispatcher.overloads})
            for kernel in find_kernels(model)}


def readied_since(before: dict[int, tuple[str, set[tuple]]],
                  after: dict[int, tuple[str, set[tuple]]]) -> dict[str, int]:
    """How many specializations the kernels of each name gained from ``before`` to ``after`` (names that
    gained none left out)."""
    gained: dict[str, int] = {}
    for key, (name, types) in after.items():
        count = len(types - before.get(key, (name, set()))[1])
        if count:
            gained[name] = gained.get(name, 0) + count
    return gained


def _allocation_count(model: DecoderModel) -> int | None:
    if model.device.is_sim:
        return None
    return torch.cuda.memory_stats(model.device.torch_device)["allocation.all.allocated"]
