"""Scheduler: admission at every capacity edge, rejection, chunk budgets, pages and slots back to free,
prefix sharing, preemption with recompute, and a randomized simulation over a fake paged KV pool."""

from __future__ import annotations

import hashlib
import random
import struct
from types import SimpleNamespace

import pytest

from executor.scheduler import Request, RequestState, ScheduledStep, Scheduler
from planner.capacity import Capacity, build_capacity, with_kv_pages

VOCAB = 64


def make_capacity(*, max_batch=4, max_context=64, page_size=4, max_prefill_tokens=16, kv_pages=65,
                  slots_per_request=0, recurrent_slots=None, max_step_tokens=None, snapshots=0) -> Capacity:
    capacity = with_kv_pages(build_capacity(
        max_batch=max_batch, max_context=max_context, page_size=page_size, max_prefill_tokens=max_prefill_tokens,
        gqa_group=2, recurrent_slots_per_request=slots_per_request, max_step_tokens=max_step_tokens,
        prefix_state_slots=snapshots,
    ), kv_pages)
    if recurrent_slots is not None:
        capacity = capacity.model_copy(update={"recurrent_slots": recurrent_slots})
    return capacity


def next_token(ids) -> int:
    """The fake model: a deterministic pseudo-random id from the whole sequence."""
    digest = hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def reference_output(prompt, max_new_tokens, stop_ids=()) -> list[int]:
    ids, out = list(prompt), []
    while len(out) < max_new_tokens:
        token = next_token(ids)
        ids.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


def assert_step_fits(step: ScheduledStep, capacity: Capacity, recurrent: bool) -> None:
    """What executor.step.plan_step checks, asserted directly."""
    size = capacity.page_size
    assert 1 <= step.num_requests <= capacity.max_batch
    assert step.num_rows == sum(len(c.token_ids) for c in step.chunks) <= capacity.max_tokens_per_step
    assert step.num_prefill_tokens <= capacity.max_prefill_tokens
    assert len({c.request_id for c in step.chunks}) == step.num_requests
    pages = 0
    for chunk in step.chunks:
        assert len(chunk.token_ids) >= 1
        kv_len = chunk.num_cached + len(chunk.token_ids)
        assert kv_len <= capacity.max_context
        assert len(chunk.page_ids) == -(-kv_len // size)
        assert all(1 <= page < capacity.kv_pages for page in chunk.page_ids)
        pages += len(chunk.page_ids)
    assert pages == step.num_pages <= capacity.logical_pages
    slots = [c.slot for c in step.chunks]
    if recurrent:
        assert all(0 <= s < capacity.recurrent_slots for s in slots) and len(set(slots)) == len(slots)
    else:
        assert all(s == -1 for s in slots)
    decode = step.chunks[:step.num_decode_rows]
    assert all(len(c.token_ids) == 1 and c.sample for c in decode)


class FakeEngine:
    """Runs steps against a fake paged KV pool and fake recurrent slots, checking what it reads back.

    Each chunk writes its token ids into the pages of its page table; the next id is computed from
    the ids *read back through the page table*, so a wrong page table, a page overwritten while
    shared or a recurrent slot not zeroed / shared gives wrong outputs (compared with
    ``reference_output``).

    ``overlap`` (set for every test of this module by the ``engine_mode`` fixture): schedule the next
    step before updating the last one, as the engine's overlapped loop does. A step runs when it is
    scheduled (device work runs in step order), its negative token ids read the previous step's
    samples as the embedding kernel does, and its update comes after the next step has run.
    """

    overlap = False

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.in_flight: tuple[ScheduledStep, list[int]] | None = None
        self.last_sampled: list[int] = []
        cap = scheduler.capacity
        self.size = cap.page_size
        self.kv: list[list[int | None]] = [[None] * cap.page_size for _ in range(cap.kv_pages)]
        self.slots: list[list[int] | None] = [None] * (cap.recurrent_slots + cap.prefix_state_slots)
        self.steps: list[ScheduledStep] = []
        self.finished: list[Request] = []

    def run_step(self, step: ScheduledStep) -> list[int]:
        allocator = self.scheduler.allocator
        recurrent = self.scheduler.has_recurrent_state
        for slot in step.fresh_slots:
            self.slots[slot] = []
        for snapshot, slot in step.restored:
            assert slot < self.scheduler.capacity.recurrent_slots <= snapshot
            self.slots[slot] = list(self.slots[snapshot])
        sampled = []
        for chunk in step.chunks:
            for offset, token in enumerate(chunk.token_ids):
                if token < 0:  # the previous step's sample for its chunk -(token + 1)
                    token = self.last_sampled[-(token + 1)]
                position = chunk.num_cached + offset
                page = chunk.page_ids[position // self.size]
                assert allocator.refcount(page) == 1, "a step writes into a shared page"
                self.kv[page][position % self.size] = token
            kv_len = chunk.num_cached + len(chunk.token_ids)
            seen = [self.kv[chunk.page_ids[p // self.size]][p % self.size] for p in range(kv_len)]
            if recurrent:
                state = self.slots[chunk.slot]
                assert state == seen[:chunk.num_cached], "recurrent slot holds another request's state"
                self.slots[chunk.slot] = seen
            sampled.append(next_token(seen))
        for slot, snapshot in step.snapshots:  # after the step's work, as the engine queues it
            self.slots[snapshot] = list(self.slots[slot])
        self.last_sampled = sampled
        return sampled

    def step(self) -> ScheduledStep | None:
        """Schedule and run a step; update it (sync) or the one before it (overlap). None: nothing was
        scheduled and nothing is left in flight."""
        step = self.scheduler.schedule()
        if step is not None:
            assert_step_fits(step, self.scheduler.capacity, self.scheduler.has_recurrent_state)
            self.scheduler.check()
            launched = (step, self.run_step(step))
            self.steps.append(step)
        else:
            launched = None
        if not self.overlap and launched is not None:
            self.finished += self.scheduler.update(*launched)
            self.scheduler.check()
            return step
        if self.in_flight is not None:
            self.finished += self.scheduler.update(*self.in_flight)
            self.scheduler.check()
        done = self.in_flight
        self.in_flight = launched
        return step if step is not None else (done[0] if done is not None else None)

    def run(self, max_steps: int = 100_000) -> list[ScheduledStep]:
        for _ in range(max_steps):
            if self.step() is None:
                break
        assert not self.scheduler.has_unfinished
        return self.steps


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def engine_mode(request, monkeypatch):
    """Every test runs twice: the engine updating each step before scheduling the next, and overlapped."""
    if request.param and request.node.get_closest_marker("step_by_step"):
        pytest.skip("asserts the state after each synchronous step; overlapped runs update a step later")
    monkeypatch.setattr(FakeEngine, "overlap", request.param)
    return request.param


def assert_all_released(scheduler: Scheduler) -> None:
    allocator = scheduler.allocator
    assert allocator.num_used == 0
    assert all(allocator.refcount(p) == 0 for p in range(1, allocator.num_pages))
    assert scheduler.num_slots_used == 0 and not scheduler.running and not scheduler.waiting
    if scheduler.prefix_cache is not None:
        assert allocator.num_free + allocator.num_cached == allocator.capacity
        scheduler.prefix_cache.clear()
    assert allocator.num_free == allocator.capacity
    allocator.check()


def scheduler_for(capacity: Capacity, *, prefix=False, recurrent=False) -> Scheduler:
    return Scheduler(capacity, prefix_caching=prefix, has_recurrent_state=recurrent)


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base + 7 * i) % VOCAB for i in range(n)]


# ---------------------------------------------------------------------------- admission edges
@pytest.mark.step_by_step
def test_batch_edge_admits_max_batch_then_waits_for_a_finish():
    scheduler = scheduler_for(make_capacity(max_batch=2))
    for i, new in enumerate([1, 3, 2]):
        scheduler.add(Request(i, prompt(4, i), new))
    engine = FakeEngine(scheduler)
    first = engine.step()
    assert [c.request_id for c in first.chunks] == [0, 1] and scheduler.num_waiting == 1
    assert engine.finished[0].request_id == 0  # max_new_tokens 1: done at the end of its prefill
    second = engine.step()
    assert [c.request_id for c in second.chunks] == [1, 2]  # decode row first, then the admission
    assert second.num_decode_rows == 1
    engine.run()
    assert max(s.num_requests for s in engine.steps) == 2
    assert scheduler.stats().peak_running == 2
    assert_all_released(scheduler)


@pytest.mark.step_by_step
def test_page_edge_defers_admission_until_pages_are_free():
    # 4 usable pages of 4 tokens; each request feeds 8 tokens (2 pages).
    scheduler = scheduler_for(make_capacity(kv_pages=5))
    for i in range(3):
        assert scheduler.add(Request(i, prompt(8, i), 1))
    engine = FakeEngine(scheduler)
    first = engine.step()
    assert [c.request_id for c in first.chunks] == [0, 1]
    assert scheduler.stats().peak_kv_pages_used == 4
    second = engine.step()
    assert [c.request_id for c in second.chunks] == [2]
    engine.run()
    assert scheduler.stats().preemptions == 0
    assert_all_released(scheduler)


def test_page_edge_shrinks_an_admitted_chunk_to_the_free_pages():
    scheduler = scheduler_for(make_capacity(kv_pages=4))  # 3 usable pages
    scheduler.add(Request("a", prompt(8), 1))
    scheduler.add(Request("b", prompt(8, 1), 1))
    engine = FakeEngine(scheduler)
    first = engine.step()
    assert [(c.request_id, len(c.token_ids)) for c in first.chunks] == [("a", 8), ("b", 4)]
    assert not first.chunks[1].sample
    engine.run()
    assert [r.output_ids == reference_output(r.prompt_ids, 1) for r in engine.finished] == [True, True]
    assert_all_released(scheduler)


@pytest.mark.step_by_step
def test_slot_edge_admits_as_many_as_recurrent_slots():
    capacity = make_capacity(max_batch=4, slots_per_request=1, recurrent_slots=2)
    scheduler = scheduler_for(capacity, recurrent=True)
    for i in range(4):
        scheduler.add(Request(i, prompt(3, i), 2))
    engine = FakeEngine(scheduler)
    first = engine.step()
    assert [(c.request_id, c.slot) for c in first.chunks] == [(0, 0), (1, 1)]
    assert first.fresh_slots == [0, 1]
    engine.step()  # both decode, finish (2 tokens each)
    third = engine.step()
    assert [(c.request_id, c.slot) for c in third.chunks] == [(2, 0), (3, 1)]
    assert third.fresh_slots == [0, 1]
    engine.run()
    assert scheduler.stats().peak_slots_used == 2
    for request in engine.finished:
        assert request.output_ids == reference_output(request.prompt_ids, 2)
    assert_all_released(scheduler)


def test_token_budget_edge_splits_a_long_prompt_over_steps():
    scheduler = scheduler_for(make_capacity(max_prefill_tokens=8))
    scheduler.add(Request("long", prompt(20), 2))
    engine = FakeEngine(scheduler)
    engine.run()
    chunks = [(s.chunks[0].num_cached, len(s.chunks[0].token_ids), s.chunks[0].sample) for s in engine.steps]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]
    assert engine.finished[0].output_ids == reference_output(prompt(20), 2)
    assert_all_released(scheduler)


def test_decode_rows_share_a_step_with_a_prefill_chunk_within_max_tokens_per_step():
    capacity = make_capacity(max_batch=4, max_prefill_tokens=8)  # T = 8 + 4 - 1 = 11
    scheduler = scheduler_for(capacity)
    for i in range(3):
        scheduler.add(Request(f"short{i}", prompt(2, i), 10))
    engine = FakeEngine(scheduler)
    engine.step()  # the three short prompts (6 prefill tokens)
    scheduler.add(Request("long", prompt(30, 5), 2))
    step = engine.step()
    assert step.num_decode_rows == 3 and step.num_prefill_tokens == 8
    assert step.num_rows == capacity.max_tokens_per_step == 11
    assert [c.request_id for c in step.chunks] == ["short0", "short1", "short2", "long"]
    engine.run()
    assert_all_released(scheduler)


def test_the_steps_work_adds_up_to_the_workload():
    """ScheduledStep.work (what planner/ideal_time.py prices) over a run of split prompts and decode rows that
    share steps: every prompt position once with its causal keys (position p sees p + 1), one lm_head row a
    prompt, and output token j >= 2 of a request of prompt n as a decode row that reads n + j - 1 keys."""
    scheduler = scheduler_for(make_capacity(max_batch=2, max_prefill_tokens=8))
    requests = [(11, 4), (3, 6), (17, 2), (5, 1)]
    for index, (length, new) in enumerate(requests):
        scheduler.add(Request(index, prompt(length, index), new))
    engine = FakeEngine(scheduler)
    engine.run()
    works = [step.work for step in engine.steps]
    assert any(w.decode_rows and w.prefill_tokens for w in works)  # some steps carry both
    assert sum(w.prefill_tokens for w in works) == sum(n for n, _ in requests)
    assert sum(w.prefill_pairs for w in works) == sum(n * (n + 1) // 2 for n, _ in requests)
    assert sum(w.prefill_sampled for w in works) == len(requests)
    assert sum(w.decode_rows for w in works) == sum(new - 1 for _, new in requests)
    assert sum(w.decode_context for w in works) == sum(n + j - 1 for n, new in requests for j in range(2, new + 1))
    assert_all_released(scheduler)


def test_a_step_beside_decode_rows_takes_the_smaller_prefill_budget():
    """max_prefill_tokens 8 and 3 beside decode rows: the first step (no decode rows) prefills 8 of the
    long prompt, every later one 3 beside the running request's decode row."""
    capacity = make_capacity(max_batch=4, max_prefill_tokens=8)
    capacity = capacity.model_copy(update={"prefill_tokens_beside_decode": 3})
    scheduler = scheduler_for(capacity)
    scheduler.add(Request("short", prompt(2), 10))
    scheduler.add(Request("long", prompt(20, 5), 2))
    engine = FakeEngine(scheduler)
    first = engine.step()
    assert (first.num_decode_rows, first.num_prefill_tokens) == (0, 8)  # short's 2, long's first 6
    second = engine.step()
    assert (second.num_decode_rows, second.num_prefill_tokens) == (1, 3)
    engine.run()
    assert all(s.num_prefill_tokens <= 3 for s in engine.steps[1:] if s.num_decode_rows)
    assert {r.request_id: r.output_ids == reference_output(r.prompt_ids, r.max_new_tokens)
            for r in engine.finished} == {"short": True, "long": True}
    assert_all_released(scheduler)


def test_a_step_of_max_step_tokens_rows_gives_its_chunk_what_the_decode_rows_leave():
    """max_step_tokens 8 at max_prefill_tokens 8: while prompt tokens wait, every step holds exactly 8 rows
    (decode rows plus the chunk), where without it a step beside d decode rows holds 8 + d; outputs are
    unchanged."""
    lengths = (3, 30, 25, 2)

    def run(max_step_tokens):
        scheduler = scheduler_for(make_capacity(max_batch=4, max_prefill_tokens=8, max_step_tokens=max_step_tokens))
        for index, length in enumerate(lengths):
            scheduler.add(Request(index, prompt(length, index), 6))
        engine = FakeEngine(scheduler)
        engine.run()
        assert_all_released(scheduler)
        return engine

    capped, uncapped = run(8), run(None)
    rows = [s.num_decode_rows + s.num_prefill_tokens for s in capped.steps]
    prefilled = 0
    for step, count in zip(capped.steps, rows):
        prefilled += step.num_prefill_tokens
        assert count <= 8
        if prefilled < sum(lengths):  # prompt tokens still waited after this step: it was full
            assert count == 8, [(s.num_decode_rows, s.num_prefill_tokens) for s in capped.steps]
    assert any(s.num_decode_rows + s.num_prefill_tokens > 8 for s in uncapped.steps)
    assert {r.request_id: r.output_ids for r in capped.finished} == {r.request_id: r.output_ids
                                                                      for r in uncapped.finished}


def test_prefill_budget_is_shared_by_several_requests_in_arrival_order():
    scheduler = scheduler_for(make_capacity(max_prefill_tokens=10))
    for i, n in enumerate([4, 4, 5]):
        scheduler.add(Request(i, prompt(n, i), 1))
    step = FakeEngine(scheduler).step()
    chunks = [(c.request_id, len(c.token_ids), c.sample) for c in step.chunks]
    assert chunks == [(0, 4, True), (1, 4, True), (2, 2, False)]


# ---------------------------------------------------------------------------- rejection and finishing
@pytest.mark.parametrize("prompt_len, new, dimension", [
    (0, 4, "prompt"),
    (4, 0, "max_new_tokens"),
    (60, 5, "context"),  # 65 > max_context 64
])
def test_rejections_name_the_dimension(prompt_len, new, dimension):
    scheduler = scheduler_for(make_capacity())
    request = Request("r", prompt(prompt_len), new)
    assert not scheduler.add(request)
    assert request.is_finished and request.finish_reason == "rejected"
    assert request.error.startswith(dimension)
    assert scheduler.schedule() is None and scheduler.stats().rejected == 1


def test_rejects_a_request_needing_more_pages_than_the_pool_and_accepts_the_edge():
    scheduler = scheduler_for(make_capacity(kv_pages=4))  # 3 usable pages = 12 tokens
    edge = Request("edge", prompt(10), 3)  # feeds 10 + 3 - 1 = 12 tokens: fits
    over = Request("over", prompt(10), 4)  # feeds 13 tokens: 4 pages
    assert scheduler.add(edge)
    assert not scheduler.add(over) and over.error.startswith("kv_pages")
    engine = FakeEngine(scheduler)
    engine.run()
    assert edge.output_ids == reference_output(edge.prompt_ids, 3)
    assert_all_released(scheduler)


def test_rejects_everything_without_recurrent_slots():
    scheduler = scheduler_for(make_capacity(slots_per_request=0), recurrent=True)
    request = Request("r", prompt(4), 2)
    assert not scheduler.add(request) and request.error.startswith("recurrent_slots")


def test_a_duplicate_id_is_a_caller_error():
    scheduler = scheduler_for(make_capacity())
    scheduler.add(Request("r", prompt(4), 2))
    with pytest.raises(ValueError):
        scheduler.add(Request("r", prompt(4), 2))


def test_prefix_caching_with_recurrent_state_and_no_snapshot_slot_is_refused():
    with pytest.raises(ValueError, match="prefix_state_slots"):
        scheduler_for(make_capacity(slots_per_request=1), prefix=True, recurrent=True)


def test_stop_ids_and_length_finish_reasons():
    ids = prompt(5)
    expected = reference_output(ids, 8)
    scheduler = scheduler_for(make_capacity())
    stop = expected[2]
    first_stop = expected.index(stop)
    stopped = Request("stop", ids, 8, stop_ids=[stop])
    length = Request("length", ids, 8)
    scheduler.add(stopped)
    scheduler.add(length)
    FakeEngine(scheduler).run()
    assert stopped.finish_reason == "stop" and stopped.output_ids == expected[:first_stop + 1]
    assert length.finish_reason == "length" and length.output_ids == expected
    assert_all_released(scheduler)


@pytest.mark.step_by_step
def test_one_step_in_flight_while_scheduling_and_updates_in_order():
    """schedule() may run once more before update(): the second step feeds the first's sample as
    -(row + 1) with the next RNG counter; a third schedule() and out-of-order updates are refused."""
    scheduler = scheduler_for(make_capacity())
    scheduler.add(Request("r", prompt(4), 3))
    first = scheduler.schedule()
    second = scheduler.schedule()
    (chunk,) = second.chunks
    assert chunk.token_ids == (-1,) and chunk.num_cached == 4 and chunk.sample and chunk.sample_index == 1
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.update(second, [7])
    with pytest.raises(ValueError):
        scheduler.update(first, [1, 2])
    scheduler.update(first, [1])
    assert scheduler.request("r").all_ids == (*prompt(4), 1)
    third = scheduler.schedule()  # fed with the second's sample, it samples the last id
    assert third.chunks[0].token_ids == (-1,) and third.chunks[0].sample_index == 2
    assert scheduler.update(second, [2]) == []
    assert scheduler.schedule() is None  # the last id is in flight: nothing to feed until it is updated
    with pytest.raises(RuntimeError):
        scheduler.update(second, [2])
    (done,) = scheduler.update(third, [3])
    assert done.output_ids == [1, 2, 3] and done.finish_reason == "length"
    assert scheduler.schedule() is None and not scheduler.has_unfinished


def test_stop_with_a_step_in_flight_finishes_the_request_and_update_skips_its_chunk():
    """A stop string found after a step's update, with the next step already scheduled: stop() finishes the
    request as "stop" there and frees its pages and slot; the step in flight's sample for it is dropped."""
    scheduler = scheduler_for(make_capacity(slots_per_request=1), recurrent=True)
    scheduler.add(Request("s", prompt(5), 6))
    scheduler.add(Request("t", prompt(3, base=1), 2))
    first = scheduler.schedule()
    second = scheduler.schedule()  # in flight: both requests' next decode rows
    scheduler.update(first, [11, 12])
    stopped = scheduler.stop("s")
    assert stopped.finish_reason == "stop" and stopped.output_ids == [11] and stopped.slot == -1
    scheduler.check()
    (done,) = scheduler.update(second, [13, 14])
    assert stopped.output_ids == [11]  # its in-flight sample was dropped
    assert done.request_id == "t" and done.output_ids == [12, 14] and done.finish_reason == "length"
    assert_all_released(scheduler)


@pytest.mark.step_by_step
def test_abort_releases_pages_and_slot():
    scheduler = scheduler_for(make_capacity(slots_per_request=1), recurrent=True)
    scheduler.add(Request("a", prompt(6), 5))
    scheduler.add(Request("b", prompt(6), 5))
    engine = FakeEngine(scheduler)
    engine.step()
    assert scheduler.abort("a").finish_reason == "abort"
    assert scheduler.abort("b").finish_reason == "abort"
    assert_all_released(scheduler)


# ---------------------------------------------------------------------------- preemption
@pytest.mark.step_by_step
def test_decode_preempts_the_most_recently_admitted_and_recomputes_it():
    # 4 usable pages of 4 tokens. a and b: 4-token prompts, 6 new tokens each (9 fed tokens: 3 pages).
    scheduler = scheduler_for(make_capacity(kv_pages=5))
    a = Request("a", prompt(4, 1), 6)
    b = Request("b", prompt(4, 2), 6)
    scheduler.add(a)
    scheduler.add(b)
    engine = FakeEngine(scheduler)
    preempting = None
    while (step := engine.step()) is not None:
        if step.preempted and preempting is None:
            preempting = step
            assert step.preempted == ("b",)
            assert [c.request_id for c in step.chunks] == ["a"]
            assert scheduler.waiting[0] is b and b.state is RequestState.WAITING and b.page_ids == []
            generated = len(b.output_ids)
            assert generated > 0
    assert preempting is not None and b.num_preemptions >= 1
    # b came back with prompt + generated ids as its prefill, and its output is unchanged.
    recompute = [s for s in engine.steps if s.index > preempting.index and any(
        c.request_id == "b" and c.num_cached == 0 for c in s.chunks)]
    assert recompute and len(recompute[0].chunks[-1].token_ids) >= 4 + generated
    assert a.output_ids == reference_output(a.prompt_ids, 6)
    assert b.output_ids == reference_output(b.prompt_ids, 6)
    assert scheduler.stats().preemptions == b.num_preemptions
    assert_all_released(scheduler)


def test_preemption_frees_the_recurrent_slot_and_the_engine_zeroes_it_again():
    capacity = make_capacity(kv_pages=5, slots_per_request=1)
    scheduler = scheduler_for(capacity, recurrent=True)
    requests = [Request(i, prompt(4, i), 6) for i in range(2)]
    for request in requests:
        scheduler.add(request)
    engine = FakeEngine(scheduler)
    engine.run()
    assert scheduler.stats().preemptions >= 1
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, 6)
    assert_all_released(scheduler)


def test_a_step_where_every_running_prefill_waits_for_pages_preempts_to_progress():
    # 3 usable pages; budget 4. a (prompt 8) and b (prompt 8) are admitted with 4 tokens each (1 page
    # each + 1 more page), then both wait for pages: the youngest is preempted.
    scheduler = scheduler_for(make_capacity(kv_pages=4, max_prefill_tokens=4, max_batch=2))
    a = Request("a", prompt(8, 1), 5)  # feeds 12 tokens: 3 pages
    b = Request("b", prompt(8, 2), 5)
    scheduler.add(a)
    scheduler.add(b)
    FakeEngine(scheduler).run()
    assert a.output_ids == reference_output(a.prompt_ids, 5)
    assert b.output_ids == reference_output(b.prompt_ids, 5)
    assert_all_released(scheduler)


# ---------------------------------------------------------------------------- prefix caching
@pytest.mark.step_by_step
def test_prefix_hits_share_physical_pages_and_refcounts_drop_to_zero():
    scheduler = scheduler_for(make_capacity(), prefix=True)
    system = prompt(12, 3)
    first = Request("first", system + [1, 2], 20)
    scheduler.add(first)
    engine = FakeEngine(scheduler)
    engine.step()  # first's prefill: 14 tokens, 3 full pages inserted
    second = Request("second", system + [5, 6, 7], 3)
    scheduler.add(second)
    step = engine.step()
    (chunk,) = [c for c in step.chunks if c.request_id == "second"]
    shared = first.page_ids[:3]
    assert chunk.num_cached == 12 and chunk.token_ids == (5, 6, 7)
    assert list(chunk.page_ids[:3]) == shared
    assert [scheduler.allocator.refcount(p) for p in shared] == [2, 2, 2]
    assert step.num_pages == len(first.page_ids) + len(second.page_ids)  # logical: shared pages count twice
    assert scheduler.allocator.num_used == len(set(first.page_ids) | set(second.page_ids))
    engine.run()
    assert second.num_prefix_hit_tokens == 12
    assert second.output_ids == reference_output(second.prompt_ids, 3)
    assert first.output_ids == reference_output(first.prompt_ids, 20)
    stats = scheduler.stats()
    assert stats.prefix_hit_tokens == 12 and stats.prefix_query_tokens == 14 + 15
    assert stats.prefix_hit_rate == pytest.approx(12 / 29)
    assert all(scheduler.allocator.refcount(p) == 0 for p in shared)
    assert all(scheduler.prefix_cache.is_cached(p) for p in shared)
    assert_all_released(scheduler)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = scheduler_for(make_capacity(), prefix=True)
    ids = prompt(8)
    scheduler.add(Request("a", ids, 1))
    engine = FakeEngine(scheduler)  # one engine: its fake KV pool persists
    engine.run()
    again = Request("b", ids, 2)
    scheduler.add(again)
    step = engine.step()
    assert step.chunks[0].num_cached == 4 and len(step.chunks[0].token_ids) == 4  # max hit: len - 1 tokens
    engine.run()
    assert again.output_ids == reference_output(ids, 2)
    assert_all_released(scheduler)


def test_generated_pages_are_cached_too_and_evicted_lru_under_pressure():
    scheduler = scheduler_for(make_capacity(kv_pages=9), prefix=True)  # 8 usable pages of 4 tokens
    cache = scheduler.prefix_cache
    engine = FakeEngine(scheduler)
    old = Request("old", prompt(6, 1), 3)  # feeds 6 + 2 generated ids: its second page holds generated ids
    scheduler.add(old)
    engine.run()
    old_pages = cache.lookup(old.all_ids[:8])
    assert len(old_pages) == 2
    new = Request("new", prompt(8, 2), 1)
    scheduler.add(new)
    engine.run()
    new_pages = cache.lookup(prompt(8, 2))
    assert len(new_pages) == 2
    # Released tail first, requests in finishing order.
    assert cache.evictable_pages() == old_pages[::-1] + new_pages[::-1]
    assert scheduler.allocator.num_free == 4
    big = Request("big", prompt(24, 9), 1)  # 6 pages: the 4 free ones, then evicts old's two (LRU)
    scheduler.add(big)
    engine.run()
    assert cache.evictions == 2
    assert cache.lookup(old.all_ids[:8]) == []
    assert cache.lookup(prompt(8, 2)) == new_pages
    assert big.output_ids == reference_output(big.prompt_ids, 1)
    assert_all_released(scheduler)


def test_preempted_request_with_prefix_caching_hits_its_own_pages():
    scheduler = scheduler_for(make_capacity(kv_pages=5), prefix=True)
    a = Request("a", prompt(4, 1), 6)
    b = Request("b", prompt(4, 2), 6)
    scheduler.add(a)
    scheduler.add(b)
    FakeEngine(scheduler).run()
    assert scheduler.stats().preemptions >= 1
    assert a.output_ids == reference_output(a.prompt_ids, 6)
    assert b.output_ids == reference_output(b.prompt_ids, 6)
    assert_all_released(scheduler)


def test_recurrent_state_resumes_from_a_snapshot_taken_where_two_prompts_part():
    capacity = make_capacity(slots_per_request=1, snapshots=2)
    scheduler = scheduler_for(capacity, prefix=True, recurrent=True)
    engine = FakeEngine(scheduler)
    system = prompt(12, 3)  # three full pages
    first = Request("first", system + [1, 2], 2)
    scheduler.add(first)
    engine.run()
    # The second matches first's 3 pages but no snapshot holds the state there: it computes from token 0,
    # in a chunk that stops at token 12, whose state is copied into a snapshot after that step.
    second = Request("second", system + [5, 6, 7], 2)
    scheduler.add(second)
    step = engine.step()
    (chunk,) = step.chunks
    assert chunk.num_cached == 0 and len(chunk.token_ids) == 12 and chunk.slot in step.fresh_slots
    assert step.snapshots == ((chunk.slot, capacity.recurrent_slots),) and step.restored == ()
    engine.run()
    assert second.num_prefix_hit_tokens == 0
    # The third resumes there: the first 3 pages shared, the snapshot copied into its slot before its step.
    third = Request("third", system + [9], 2)
    scheduler.add(third)
    step = engine.step()
    (chunk,) = step.chunks
    assert chunk.num_cached == 12 and chunk.token_ids == (9,) and step.fresh_slots == []
    assert step.restored == ((capacity.recurrent_slots, chunk.slot),) and step.snapshots == ()
    assert list(chunk.page_ids[:3]) == scheduler.prefix_cache.lookup(system)
    engine.run()
    for request in (first, second, third):
        assert request.output_ids == reference_output(request.prompt_ids, 2)
    stats = scheduler.stats()
    assert third.num_prefix_hit_tokens == 12 == stats.prefix_hit_tokens
    assert stats.state_snapshots_taken == 1 and stats.state_snapshot_restores == 1
    assert_all_released(scheduler)


def test_a_request_resumes_from_the_longest_snapshot_and_snapshots_where_it_leaves_the_cache():
    capacity = make_capacity(slots_per_request=1, snapshots=1)  # one snapshot: the newer one evicts the older
    scheduler = scheduler_for(capacity, prefix=True, recurrent=True)
    engine = FakeEngine(scheduler)
    short, long = prompt(4, 1), prompt(12, 1)  # 1 and 3 full pages of one chain
    for name in ("a", "b"):  # a caches the page, b snapshots the state after it
        scheduler.add(Request(name, short + [60 + len(name)], 1))
        engine.run()
    scheduler.add(Request("c", long + [1], 1))  # caches 3 pages; resumes from b's snapshot at 4
    engine.run()
    d = Request("d", long + [2], 2)  # resumes at 4 again, snapshots at 12 (evicting the one at 4)
    scheduler.add(d)
    step = engine.step()
    (chunk,) = step.chunks
    assert chunk.num_cached == 4 and len(chunk.token_ids) == 8
    assert step.restored == ((capacity.recurrent_slots, chunk.slot),)
    assert step.snapshots == ((chunk.slot, capacity.recurrent_slots),)
    engine.run()
    e = Request("e", long + [3], 2)  # resumes at 12
    scheduler.add(e)
    assert engine.step().chunks[0].num_cached == 12
    engine.run()
    assert d.output_ids == reference_output(d.prompt_ids, 2) and e.output_ids == reference_output(e.prompt_ids, 2)
    assert [scheduler.stats().state_snapshots_taken, scheduler.stats().state_snapshot_restores] == [2, 3]
    assert_all_released(scheduler)


# ---------------------------------------------------------------------------- against plan_step
def test_every_step_passes_executor_plan_step():
    pytest.importorskip("torch")
    from executor.step import plan_step

    for recurrent in (False, True):
        capacity = make_capacity(max_batch=3, max_prefill_tokens=6, kv_pages=12, slots_per_request=1)
        plan = SimpleNamespace(capacity=capacity, hardware=SimpleNamespace(num_sms=1),
                               geometry=SimpleNamespace(num_linear_layers=3 if recurrent else 0, num_kv_heads=1))
        scheduler = scheduler_for(capacity, prefix=not recurrent, recurrent=recurrent)
        rng = random.Random(5)
        for i in range(12):
            scheduler.add(Request(i, [rng.randrange(4) for _ in range(rng.randint(1, 20))], rng.randint(1, 8)))
        engine = FakeEngine(scheduler)
        while (step := engine.step()) is not None:
            meta = plan_step(plan, step.request_chunks())
            assert meta.num_rows == step.num_rows and meta.num_requests == step.num_requests
            assert meta.page_indices.tolist() == [p for c in step.chunks for p in c.page_ids]
        assert_all_released(scheduler)


# ---------------------------------------------------------------------------- randomized simulation
@pytest.mark.parametrize("seed, prefix, recurrent, kv_pages", [
    (0, False, False, 40),
    (1, True, False, 40),
    (2, True, False, 14),  # tight pool: preemption and eviction
    (3, False, True, 20),
    (4, True, False, 200),  # roomy pool: many hits
    (5, True, True, 14),  # recurrent state with snapshots: preemption, eviction of pages and snapshots
    (6, True, True, 200),
])
def test_randomized_simulation(seed, prefix, recurrent, kv_pages):
    rng = random.Random(seed)
    capacity = make_capacity(max_batch=6, max_context=48, page_size=4, max_prefill_tokens=12, kv_pages=kv_pages,
                             slots_per_request=1 if recurrent else 0,
                             recurrent_slots=rng.choice([4, 6]) if recurrent else None,
                             snapshots=2 if recurrent and prefix else 0)
    scheduler = scheduler_for(capacity, prefix=prefix, recurrent=recurrent)
    engine = FakeEngine(scheduler)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    requests = []
    next_id = 0
    steps = 0
    while steps < 500 or scheduler.has_unfinished:
        if steps < 500:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
                head = rng.choice(systems) if rng.random() < 0.6 else []
                ids = head + [rng.randrange(VOCAB) for _ in range(rng.randint(0 if head else 1, 16))]
                request = Request(next_id, ids, rng.randint(1, 24), stop_ids=rng.sample(range(VOCAB), 1))
                next_id += 1
                if scheduler.add(request):
                    requests.append(request)
                else:
                    assert request.error.split(":")[0] in ("context", "kv_pages")
        step = engine.step()
        steps += 1
        if step is None:
            assert not scheduler.has_unfinished
        assert steps < 20_000
    assert len(requests) > 80
    for request in requests:
        assert request.is_finished and request.finish_reason in ("stop", "length")
        assert request.output_ids == reference_output(request.prompt_ids, request.max_new_tokens, request.stop_ids)
    stats = scheduler.stats()
    assert stats.finished == len(requests)
    assert stats.peak_kv_pages_used <= capacity.kv_pages - 1
    assert stats.peak_running <= capacity.max_batch
    if recurrent:
        assert 0 < stats.peak_slots_used <= capacity.recurrent_slots
    if prefix and kv_pages == 200:
        assert stats.prefix_hit_rate > (0.1 if recurrent else 0.2)
    if prefix and recurrent:
        assert stats.state_snapshot_restores > 0 and stats.state_snapshots_taken > 0
    if kv_pages == 14:
        assert stats.preemptions > 0
    assert_all_released(scheduler)
