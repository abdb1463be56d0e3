"""Continuous-batching scheduler over one plan's capacities (pure Python, no torch).

``Scheduler(capacity, prefix_caching=..., has_recurrent_state=...)`` turns a
stream of ``Request``s into steps that always fit the plan: every step it
builds satisfies rows <= ``max_tokens_per_step``, prefill tokens <=
``max_prefill_tokens``, requests <= ``max_batch``, listed pages <=
``logical_pages``, page ids in ``1 .. kv_pages - 1``, kv length <=
``max_context`` and distinct recurrent slots < ``recurrent_slots``. It never
raises for lack of room: it waits, shrinks a chunk or preempts.

Engine loop::

    scheduler.add(Request(rid, prompt_ids, max_new_tokens, stop_ids))  # False: rejected
    while (step := scheduler.schedule()) is not None:
        zero the recurrent slots in step.fresh_slots, copy step.restored's snapshots into their slots (Qwen3.5)
        meta = plan_step(plan, step.request_chunks())      # or step.chunks (same fields)
        ... run the model, sample one id per chunk (logits_indices: each request's last row) ...
        copy step.snapshots' slots into their snapshots (after the step's kernels, before the next step's)
        for request in scheduler.update(step, sampled_ids): report(request)

Tokens. A request feeds ``all_ids = prompt_ids + output_ids``; ``num_cached``
of them are in the KV cache / recurrent state or on their way there (it
advances when ``schedule`` hands out a chunk). A request is *prefilled* once
``num_cached`` reached its prefill target (its length at admission); after that
it feeds one token per step (the id it sampled last): a *decode row*. A chunk
samples when it feeds the request's last id (a decode row, or the chunk that
completes the prefill).

Overlapped scheduling (vLLM's async scheduling). ``schedule`` may run once more
before the last step's ``update``: one step in flight. A request whose sample
is still in flight then gets a decode row whose token id is ``-(r + 1)``, "the
id the step in flight samples for its chunk r", which the executor reads on
the device (kernels/rows/embedding.py); its RNG counter is ``StepChunk.sample_index``.
A request whose in-flight sample will make ``max_new_tokens`` gets no row; one
that stops on a stop id there has computed one row for nothing, dropped in
``update``. ``update`` takes steps in order and skips chunks of requests that
finished, were preempted or were readmitted since their step was scheduled
(their samples are dropped; a preempted request recomputes and samples that
id again). A step that would be empty while one is in flight is not built
(``schedule`` returns None): that step's update may finish requests or free
pages. Pages freed in ``update`` may still be written by the step in flight
(the finished request's extra row), and a page handed to another request is
written by a later step: device work runs in step order, and only full pages
of tokens whose step was updated enter the prefix cache.

Step building (FCFS):

1. decode rows of running requests, in admission order, one token each;
2. prefill chunks of running, partially prefilled requests, in admission
   order, within the budget ``min(max_prefill_tokens, max_tokens_per_step -
   decode rows)``, or ``prefill_tokens_beside_decode`` in place of
   max_prefill_tokens when the step has decode rows (a smaller chunk keeps
   their wait for the next token short); with serving ``max_step_tokens``
   the plan's max_tokens_per_step is that cap, so the chunk takes what the
   decode rows leave of it and a full step always holds that many rows;
3. admission of waiting requests from the head of the queue (strict FCFS: the
   first that cannot be admitted stops admission) while ``running <
   max_batch``, a recurrent slot is free (Qwen3.5) and budget and pages are
   left. Skipped in a step that preempted (as vLLM does), unless nothing else
   could be scheduled.

Pages (on demand). A request holds exactly ``ceil(tokens fed / page_size)``
pages, allocated as its chunks need them (with prefix caching its matched
prefix pages are shared, refcounted). A prefill chunk (running or admitted) is
shrunk to the pages available without preemption; with none available it waits
(admission stops). A decode row that needs a new page when none is available
preempts the most recently admitted running request, repeatedly, until the
page is there (or the request preempted is the one that needed it). A
preempted request frees its pages and slot and goes back to the head of the
waiting queue; readmitted, it recomputes ``prompt + generated ids`` from
scratch (with prefix caching, its own pages are likely still cached). If a step
would be empty while requests run (every one waiting for pages), the most
recently admitted is preempted until one can proceed. Since ``add`` rejects any
request that could not run alone, the oldest running request always progresses.

Rejection (``add`` returns False and finishes the request with
``finish_reason == "rejected"`` and ``error`` naming the dimension): an empty
prompt, ``max_new_tokens < 1``, ``prompt + max_new_tokens > max_context``,
more than ``kv_pages - 1`` pages for its ``prompt + max_new_tokens - 1`` fed
tokens (the last sampled id is never fed), or no recurrent slot in the plan.

Finishing: a sampled id in ``stop_ids`` ("stop"; the id is kept in
``output_ids``), else ``max_new_tokens`` outputs ("length"); ``abort`` gives
"abort". Pages are released tail first (refcount; cached ones stay evictable)
and the slot returns to the pool (the engine zeroes a slot when a fresh request
gets it: ``ScheduledStep.fresh_slots``).

Prefix caching: at admission the longest cached full-page prefix of
``all_ids[:-1]`` is matched (at least one token is always computed, for its
logits); after every step the request's newly full pages (prompt and generated)
are inserted. With recurrent state (Qwen3.5; the plan's ``prefix_state_slots``
>= 1, else ``prefix_caching`` is a ``ValueError``) a request keeps only the
matched pages up to the longest recurrent-state snapshot among them
(executor/state_snapshots.py), whose state ``step.restored`` copies into its
slot; where it matched pages past that, its chunks stop at the last matched
page and ``step.snapshots`` copies its state there into a snapshot.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from executor.page_allocator import PageAllocator
from executor.prefix_cache import CacheChain, PrefixCache
from executor.state_snapshots import StateSnapshots
from executor.step import RequestChunk
from planner.capacity import Capacity
from planner.ideal_time import StepWork, causal_pairs

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_REJECTED = "rejected"
FINISH_ABORT = "abort"


class RequestState(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its scheduling state (fields after ``stop_ids`` are the scheduler's)."""

    request_id: Hashable
    prompt_ids: Sequence[int]
    max_new_tokens: int
    stop_ids: Collection[int] = ()
    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 0  # <= 0: no restriction
    seed: int = 0  # the request's RNG key: its tokens depend on it, not on its batch
    top_p: float = 1.0  # >= 1: no restriction

    state: RequestState = field(default=RequestState.WAITING, init=False)
    output_ids: list[int] = field(default_factory=list, init=False)
    num_cached: int = field(default=0, init=False)  # tokens in (or scheduled into) the KV cache / recurrent state
    page_ids: list[int] = field(default_factory=list, init=False)  # page table: ceil(fed / page_size) pages
    slot: int = field(default=-1, init=False)  # recurrent-state slot, -1 for none
    finish_reason: str | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)  # why it was rejected
    num_preemptions: int = field(default=0, init=False)
    num_prefix_hit_tokens: int = field(default=0, init=False)  # over all admissions
    prefill_target: int = field(default=0, init=False)  # len(all_ids) at its last admission
    # The scheduler's count of admissions when this request was last admitted: it names the current
    # page list, which only grows until the request is released (executor.page_tables).
    admission: int = field(default=-1, init=False)
    # (step index, chunk row) of a sample scheduled but not yet given to update(): its id is not in
    # all_ids yet, and a decode row fed with it names it as -(row + 1).
    in_flight: tuple[int, int] | None = field(default=None, init=False)
    # Recurrent state (with prefix caching): the snapshot slot its first chunk starts from (-1: none),
    # and the token count whose state its chunks stop at for a snapshot under that prefix's entry uid.
    restore_from: int = field(default=-1, init=False)
    snapshot_at: int = field(default=0, init=False)
    snapshot_uid: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.prompt_ids = tuple(int(t) for t in self.prompt_ids)
        self.stop_ids = frozenset(int(t) for t in self.stop_ids)
        self._all: list[int] = list(self.prompt_ids)
        self._chain: CacheChain | None = None

    @property
    def all_ids(self) -> tuple[int, ...]:
        """Prompt then generated ids."""
        return tuple(self._all)

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def is_prefilled(self) -> bool:
        return self.state is RequestState.RUNNING and self.num_cached >= self.prefill_target

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass(frozen=True)
class StepChunk:
    """What one request feeds a step: ``executor.step.RequestChunk``'s fields plus who and whether it samples."""

    request_id: Hashable
    token_ids: tuple[int, ...]  # -(r + 1): the id the step in flight samples for its chunk r (overlap)
    num_cached: int
    page_ids: tuple[int, ...]  # covers num_cached + len(token_ids) tokens exactly
    slot: int
    sample: bool  # the chunk feeds the request's last id: its last row's logits give the next id
    sample_index: int = 0  # index in output_ids of the id it samples (the RNG counter)
    admission: int = -1  # the request's admission count when scheduled (update skips a later one's)


@dataclass(frozen=True)
class ScheduledStep:
    """One step: decode rows first, then prefill chunks."""

    index: int
    chunks: tuple[StepChunk, ...]
    num_decode_rows: int
    num_prefill_tokens: int
    preempted: tuple[Hashable, ...] = ()  # requests preempted while building this step
    restored: tuple[tuple[int, int], ...] = ()  # (snapshot slot, request slot): copied before the step
    snapshots: tuple[tuple[int, int], ...] = ()  # (request slot, snapshot slot): copied after the step

    @property
    def num_rows(self) -> int:
        return self.num_decode_rows + self.num_prefill_tokens

    @property
    def num_requests(self) -> int:
        return len(self.chunks)

    @property
    def num_pages(self) -> int:
        """Logical pages listed (shared pages count once per request)."""
        return sum(len(c.page_ids) for c in self.chunks)

    @property
    def sample_indices(self) -> list[int]:
        """Indices of the chunks that sample a token this step."""
        return [i for i, c in enumerate(self.chunks) if c.sample]

    @property
    def work(self) -> StepWork:
        """What the step computes, as planner/ideal_time.py prices it (its decode rows come first)."""
        decode, prefill = self.chunks[: self.num_decode_rows], self.chunks[self.num_decode_rows:]
        return StepWork(prefill_tokens=self.num_prefill_tokens,
                        prefill_pairs=sum(causal_pairs(c.num_cached, c.num_cached + len(c.token_ids)) for c in prefill),
                        prefill_sampled=sum(c.sample for c in prefill), decode_rows=len(decode),
                        decode_context=sum(c.num_cached + 1 for c in decode))

    @property
    def fresh_slots(self) -> list[int]:
        """Recurrent slots of requests starting from token 0 this step: the engine zeroes them first."""
        return [c.slot for c in self.chunks if c.num_cached == 0 and c.slot >= 0]

    def request_chunks(self) -> list[RequestChunk]:
        """The chunks as ``executor.step.RequestChunk``."""
        return [RequestChunk(c.token_ids, c.num_cached, c.page_ids, c.slot) for c in self.chunks]


@dataclass(frozen=True)
class SchedulerStats:
    """Counters for the engine's summary."""

    steps: int
    admitted: int
    finished: int
    rejected: int
    preemptions: int
    peak_kv_pages_used: int  # pages with refcount >= 1 (physical), at the end of a schedule()
    peak_logical_pages: int  # page-table entries of one step (shared pages per request)
    peak_slots_used: int
    peak_running: int
    kv_pages_usable: int
    recurrent_slots: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prefix_evictions: int
    state_snapshots_taken: int = 0  # recurrent-state snapshots written (Qwen3.5 prefix caching)
    state_snapshot_restores: int = 0  # requests resumed from one

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def can_cache_prefixes(capacity: Capacity, has_recurrent_state: bool) -> bool:
    """Whether a plan's prefix cache can resume requests: always without recurrent state, with it only where
    the plan keeps a recurrent-state snapshot (``capacity.prefix_state_slots``)."""
    return not has_recurrent_state or capacity.prefix_state_slots > 0


class Scheduler:
    """FCFS continuous batching with chunked prefill, on-demand pages, preemption and prefix caching."""

    def __init__(self, capacity: Capacity, *, prefix_caching: bool, has_recurrent_state: bool):
        if prefix_caching and not can_cache_prefixes(capacity, has_recurrent_state):
            raise ValueError("prefix caching with recurrent state (Qwen3.5) needs the plan's prefix_state_slots >= 1: "
                             "a KV prefix resumes a request only with a snapshot of its recurrent state")
        for name in ("max_batch", "page_size", "max_prefill_tokens", "max_tokens_per_step"):
            if getattr(capacity, name) < 1:
                raise ValueError(f"capacity.{name} must be >= 1, got {getattr(capacity, name)}")
        self.capacity = capacity
        self.has_recurrent_state = has_recurrent_state
        self.allocator = PageAllocator(capacity.kv_pages)
        self.prefix_cache = PrefixCache(self.allocator, capacity.page_size) if prefix_caching else None
        self._num_slots = capacity.recurrent_slots if has_recurrent_state else 0
        self._free_slots = list(range(self._num_slots))  # a heap: lowest slot first
        self.snapshots = (StateSnapshots(self._num_slots, capacity.prefix_state_slots)
                          if prefix_caching and has_recurrent_state else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (oldest first)
        self._requests: dict[Hashable, Request] = {}  # unfinished
        self._in_flight: deque[ScheduledStep] = deque()  # scheduled, not yet updated (oldest first)
        self._steps = 0
        self._admitted = 0
        self._finished = 0
        self._rejected = 0
        self._preemptions = 0
        self._peak_pages = 0
        self._peak_logical = 0
        self._peak_slots = 0
        self._peak_running = 0

    # ------------------------------------------------------------------ queries
    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_slots_used(self) -> int:
        return self._num_slots - len(self._free_slots)

    def request(self, request_id: Hashable) -> Request:
        """An unfinished request by id."""
        return self._requests[request_id]

    def stats(self) -> SchedulerStats:
        cache = self.prefix_cache
        return SchedulerStats(
            steps=self._steps,
            admitted=self._admitted,
            finished=self._finished,
            rejected=self._rejected,
            preemptions=self._preemptions,
            peak_kv_pages_used=self._peak_pages,
            peak_logical_pages=self._peak_logical,
            peak_slots_used=self._peak_slots,
            peak_running=self._peak_running,
            kv_pages_usable=self.allocator.capacity,
            recurrent_slots=self._num_slots,
            prefix_hit_tokens=cache.hits if cache else 0,
            prefix_query_tokens=cache.queries if cache else 0,
            prefix_evictions=cache.evictions if cache else 0,
            state_snapshots_taken=self.snapshots.taken if self.snapshots else 0,
            state_snapshot_restores=self.snapshots.restores if self.snapshots else 0,
        )

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> bool:
        """Queue a request; False (and the request finished as "rejected") if the plan can never hold it."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if request.state is not RequestState.WAITING or request.output_ids:
            raise ValueError(f"request {request.request_id!r} was already scheduled")
        error = self._rejection(request)
        if error is not None:
            request.state = RequestState.FINISHED
            request.finish_reason = FINISH_REJECTED
            request.error = error
            self._rejected += 1
            return False
        self._requests[request.request_id] = request
        self.waiting.append(request)
        return True

    def abort(self, request_id: Hashable) -> Request:
        """Finish an unfinished request now ("abort"), releasing its pages and slot."""
        if self._in_flight:
            raise RuntimeError("abort between schedule() and update() is not supported")
        request = self._requests[request_id]
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        self._finish(request, FINISH_ABORT)
        return request

    def stop(self, request_id: Hashable) -> Request:
        """Finish an unfinished request now as "stop" (its caller found a stop string in its text), also
        with a step in flight: update() skips that step's chunk of it, as it does for a request that
        sampled a stop id there."""
        request = self._requests[request_id]
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        self._finish(request, FINISH_STOP)
        return request

    def _rejection(self, request: Request) -> str | None:
        cap = self.capacity
        prompt = len(request.prompt_ids)
        if prompt == 0:
            return "prompt: empty"
        if request.max_new_tokens < 1:
            return f"max_new_tokens: must be >= 1, got {request.max_new_tokens}"
        total = prompt + request.max_new_tokens
        if total > cap.max_context:
            return (f"context: prompt {prompt} + max_new_tokens {request.max_new_tokens} = {total} tokens, "
                    f"plan max_context {cap.max_context}")
        fed = total - 1  # the last sampled id is never fed
        pages = -(-fed // cap.page_size)
        if pages > self.allocator.capacity:
            return (f"kv_pages: {fed} tokens need {pages} pages of {cap.page_size}, plan has "
                    f"{self.allocator.capacity} usable (kv_pages {cap.kv_pages}, page 0 is padding)")
        if self.has_recurrent_state and self._num_slots < 1:
            return "recurrent_slots: the plan has no recurrent-state slot"
        return None

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when no request is waiting or running, or when the step in flight
        must be updated first (nothing could be scheduled beside it)."""
        if len(self._in_flight) > 1:
            raise RuntimeError("update() the oldest step first: at most one step in flight while scheduling")
        if not self.running and not self.waiting:
            return None
        preempted: list[Request] = []
        while True:
            decode, prefill = self._build(preempted)
            if decode or prefill or not self.running or self._in_flight:
                break
            # Every running request waits for pages: free the most recently admitted.
            self._preempt(self.running[-1], preempted)
        if not decode and not prefill:
            if self._in_flight:
                return None
            raise AssertionError("scheduler: requests wait but none can be scheduled (a rejection rule is missing)")
        size = self.capacity.page_size
        index = self._steps
        chunks = []
        restored: list[tuple[int, int]] = []
        snapshots: list[tuple[int, int]] = []
        for row, (request, count) in enumerate(decode + prefill):
            start = request.num_cached
            end = start + count
            if request.restore_from >= 0:
                restored.append((request.restore_from, request.slot))
                request.restore_from = -1
            if request.snapshot_at and end >= request.snapshot_at:
                assert end == request.snapshot_at and self.snapshots is not None
                slot = self.snapshots.take(request.snapshot_uid)
                if slot is not None:  # else another request's step already took it
                    snapshots.append((request.slot, slot))
                request.snapshot_at = 0
            assert len(request.page_ids) == -(-end // size)
            known = len(request._all)
            if request.in_flight is not None:  # its last id is the step in flight's sample
                assert count == 1 and start == known and request.in_flight[0] == index - 1
                token_ids, sample_index = (-(request.in_flight[1] + 1),), len(request.output_ids) + 1
            else:
                token_ids, sample_index = tuple(request._all[start:end]), len(request.output_ids)
            sample = end >= known
            chunks.append(StepChunk(
                request_id=request.request_id,
                token_ids=token_ids,
                num_cached=start,
                page_ids=tuple(request.page_ids),
                slot=request.slot,
                sample=sample,
                sample_index=sample_index,
                admission=request.admission,
            ))
            request.num_cached = end
            request.in_flight = (index, row) if sample else None
        step = ScheduledStep(
            index=index,
            chunks=tuple(chunks),
            num_decode_rows=len(decode),
            num_prefill_tokens=sum(count for _, count in prefill),
            preempted=tuple(r.request_id for r in preempted),
            restored=tuple(restored),
            snapshots=tuple(snapshots),
        )
        self._steps += 1
        self._in_flight.append(step)
        self._peak_pages = max(self._peak_pages, self.allocator.num_used)
        self._peak_logical = max(self._peak_logical, step.num_pages)
        self._peak_slots = max(self._peak_slots, self.num_slots_used)
        self._peak_running = max(self._peak_running, len(self.running))
        return step

    def _build(self, preempted: list[Request]) -> tuple[list[tuple[Request, int]], list[tuple[Request, int]]]:
        cap = self.capacity
        size = cap.page_size
        allocator = self.allocator
        decode: list[tuple[Request, int]] = []
        prefill: list[tuple[Request, int]] = []

        # 1. Decode rows, oldest first; a missing page preempts the youngest running request.
        for request in list(self.running):
            if request.state is not RequestState.RUNNING or not request.is_prefilled:
                continue
            if request.in_flight is not None and len(request.output_ids) + 1 >= request.max_new_tokens:
                continue  # the sample in flight is its last ("length"): update() finishes it
            need = -(-(request.num_cached + 1) // size) - len(request.page_ids)
            while need > allocator.num_available:
                victim = self.running[-1]
                self._preempt(victim, preempted)
                if victim is request:
                    break
            if request.state is not RequestState.RUNNING:
                continue
            request.page_ids += allocator.allocate(need)
            decode.append((request, 1))

        # 2. Prefill chunks of running requests, oldest first, shrunk to the pages available.
        chunk = cap.prefill_tokens_beside_decode if decode and cap.prefill_tokens_beside_decode else \
            cap.max_prefill_tokens
        budget = min(chunk, cap.max_tokens_per_step - len(decode))
        for request in self.running:
            if budget <= 0:
                break
            if request.is_prefilled:
                continue
            room = (len(request.page_ids) + allocator.num_available) * size - request.num_cached
            count = min(request.prefill_target - request.num_cached, budget, room)
            if request.snapshot_at:  # its chunk stops where its state is snapshotted
                count = min(count, request.snapshot_at - request.num_cached)
            if count < 1:
                continue
            request.page_ids += allocator.allocate(-(-(request.num_cached + count) // size) - len(request.page_ids))
            prefill.append((request, count))
            budget -= count

        # 3. Admission, strict FCFS from the head of the waiting queue.
        if preempted and (decode or prefill):
            return decode, prefill
        while self.waiting and budget > 0 and len(self.running) < cap.max_batch:
            if self.has_recurrent_state and not self._free_slots:
                break
            request = self.waiting[0]
            ids = request._all
            target = len(ids)
            matched = self.prefix_cache.lookup(ids, target - 1) if self.prefix_cache else []
            resume, snapshot_at, snapshot_uid = 0, 0, 0
            if self.snapshots is not None and matched:  # keep the pages up to the longest snapshot
                uids = [self.prefix_cache.entry_uid(page) for page in matched]
                resume = self.snapshots.longest(uids)
                if resume < len(matched):  # the prompt leaves the cached prefix past the snapshot
                    snapshot_at, snapshot_uid = len(matched) * size, uids[-1]
                matched = matched[:resume]
            reclaimed = sum(1 for page in matched if allocator.refcount(page) == 0)
            available = allocator.num_available - reclaimed
            cached = len(matched) * size
            count = min(target - cached, budget, (len(matched) + available) * size - cached)
            if snapshot_at:
                count = min(count, snapshot_at - cached)
            if count < 1:
                break
            self.waiting.popleft()
            if self.prefix_cache is not None:
                pages = self.prefix_cache.match(ids, cached)
                assert pages == matched
            else:
                pages = []
            if resume:
                request.restore_from = self.snapshots.use(uids[resume - 1])
            request.snapshot_at, request.snapshot_uid = snapshot_at, snapshot_uid
            request.page_ids = pages + allocator.allocate(-(-(cached + count) // size) - len(pages))
            request.num_cached = cached
            request.num_prefix_hit_tokens += cached
            request.prefill_target = target
            request._chain = None
            if self.has_recurrent_state:
                request.slot = heapq.heappop(self._free_slots)
            request.state = RequestState.RUNNING
            self.running.append(request)
            request.admission = self._admitted
            self._admitted += 1
            prefill.append((request, count))
            budget -= count
        return decode, prefill

    # ------------------------------------------------------------------ update
    def update(self, step: ScheduledStep, sampled_ids: Sequence[int]) -> list[Request]:
        """Apply a step's results; returns the requests it finished. Steps are updated in the order
        they were scheduled; a chunk whose request finished, was preempted or was readmitted since
        its step was scheduled is skipped (its sample dropped).

        ``sampled_ids``: one id per chunk (ids of non-sampling chunks are ignored)
        or one per sampling chunk (``step.sample_indices`` order).
        """
        if not self._in_flight or step is not self._in_flight[0]:
            raise RuntimeError("update() takes the oldest step schedule() returned and update() has not taken")
        sampling = step.sample_indices
        if len(sampled_ids) == len(step.chunks):
            ids = [sampled_ids[i] for i in sampling]
        elif len(sampled_ids) == len(sampling):
            ids = list(sampled_ids)
        else:
            raise ValueError(f"update: {len(sampled_ids)} sampled ids for {len(step.chunks)} chunks "
                             f"of which {len(sampling)} sample")
        self._in_flight.popleft()
        sampled = dict(zip(sampling, ids))
        finished: list[Request] = []
        size = self.capacity.page_size
        for row, chunk in enumerate(step.chunks):
            request = self._requests.get(chunk.request_id)
            if request is None or request.state is not RequestState.RUNNING or request.admission != chunk.admission:
                continue  # finished, preempted or readmitted since: its sample (if any) is dropped
            computed = chunk.num_cached + len(chunk.token_ids)  # tokens whose KV this step wrote
            assert request.num_cached >= computed
            reason = None
            if chunk.sample:
                assert len(request._all) == computed, "updates come in step order"
                if request.in_flight == (step.index, row):  # else the step after this one samples too
                    request.in_flight = None
                token = int(sampled[row])
                request._all.append(token)
                request.output_ids.append(token)
                if token in request.stop_ids:
                    reason = FINISH_STOP
                elif len(request.output_ids) >= request.max_new_tokens:
                    reason = FINISH_LENGTH
            cache = self.prefix_cache
            if cache is not None:
                done = request._chain.num_pages if request._chain is not None else 0
                if computed // size > done:
                    request._chain = cache.insert(request._all, request.page_ids, request._chain, computed)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    # ------------------------------------------------------------------ internals
    def _release(self, request: Request) -> None:
        for page in reversed(request.page_ids):  # tail first: a chain's last pages are evicted first
            self.allocator.release(page)
        request.page_ids = []
        request._chain = None
        if request.slot >= 0:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = -1

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        self._release(request)
        self.running.remove(request)
        request.num_cached = 0
        request.in_flight = None  # a sample in flight is dropped: readmitted, it is computed again
        request.restore_from, request.snapshot_at = -1, 0  # readmitted, it looks them up again
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)  # the youngest is preempted first: admission order is kept
        self._preemptions += 1
        preempted.append(request)

    def _finish(self, request: Request, reason: str) -> None:
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
        self._release(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        self._finished += 1

    def check(self) -> None:
        """Assert the scheduler's invariants (tests): refcounts equal page-table references, slots distinct."""
        self.allocator.check()
        if self.prefix_cache is not None:
            self.prefix_cache.check()
        if self.snapshots is not None:
            self.snapshots.check()
        size = self.capacity.page_size
        references = [0] * max(self.allocator.num_pages, 1)
        for request in self.running:
            assert request.state is RequestState.RUNNING
            fed = request.num_cached
            assert len(request.page_ids) == -(-fed // size), (request.request_id, len(request.page_ids), fed)
            for page in request.page_ids:
                references[page] += 1
        for request in self.waiting:
            assert request.state is RequestState.WAITING and not request.page_ids and request.slot == -1
        refcounts = [self.allocator.refcount(page) for page in range(1, self.allocator.num_pages)]
        assert refcounts == references[1:self.allocator.num_pages], "refcounts differ from page-table references"
        slots = [r.slot for r in self.running if r.slot >= 0]
        assert len(set(slots)) == len(slots)
        assert len(slots) + len(self._free_slots) == self._num_slots
        assert len(self.running) <= self.capacity.max_batch
