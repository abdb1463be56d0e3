"""Serving throughput and latency: memplan's engine against the workload's ideal time and HF transformers.

    python3 bench/serve.py --models qwen3-8b --max-batch 256 --max-prefill-tokens 8192    # 512 x (1,024 -> 128)
    python3 bench/serve.py --models qwen3-8b --workloads random --num-requests 1000 --input-range 128,2048 \\
        --output-range 64,512 --max-batch 256 --max-prefill-tokens 8192
    python3 bench/serve.py --workloads fixed,poisson --rate-fraction 0.7 --max-batch 256 --max-prefill-tokens 8192
    python3 bench/serve.py --models qwen3-8b --hf --max-batch 256 --max-prefill-tokens 8192 --out docs/benchmarks.md
    python3 bench/serve.py --smoke     # tiny random-weight configs in the Numba CUDA simulator, seconds, no GPU

Random bf16 weights of the real shapes (float32 tiny configs under --smoke), random prompt ids from
``--seed``, every request generating exactly its output length (EOS ignored).

Workloads (``--workloads``, comma-separated, run in that order on one served model):

- fixed: ``--num-requests`` prompts of ``--input-len`` ids, ``--output-len`` new tokens each, all at once;
- random: prompt and output lengths uniform in ``--input-range`` and ``--output-range`` (inclusive);
- shared-prefix: like fixed, every prompt starting with the same ``--shared-prefix`` ids; the first request
  arrives at step 0 and the others two steps later, as ``memplan run --shared-prefix`` has them (a page
  enters the prefix cache after the step that fills it);
- poisson: fixed's lengths, arriving with exponential gaps (seeded) at ``--request-rate`` requests/s, or at
  ``--rate-fraction`` of the requests/s the first fixed or random workload of this run measured: latency
  under load (TTFT counts the queueing from a request's arrival).

The engine runs as ``memplan run`` runs it: ``executor.serving.ServedModel`` (one materialized plan, the
decode graphs captured on the GPU, the same scheduler, overlap and prefix caching), with
``--warmup-requests`` requests of 2 new tokens run untimed first. The plan is the serving config's with
``--max-batch`` / ``--max-prefill-tokens`` / ``--max-prefill-tokens-beside-decode`` / ``--max-step-tokens``
over it, ``max_context`` the longest request of the run, and the memory share that holds ``max_batch`` such
requests (``--gpu-memory-utilization`` to set it). Lists of any of them (``--max-batch 64,128,256``) run every
workload at each combination, one plan and served model after the other: the serving defaults are chosen
from such a sweep.

Ideal time (planner/ideal_time.py): the workload's prefill FLOPs at the measured matmul rate (``torch.matmul``
of two ``--matmul-size``^2 matrices in the weights' dtype) plus, per decode step of at most max_batch rows in
admission order, the larger of its bytes (every weight but the embedding, the rows' KV, Qwen3.5's recurrent
state read and written) at the measured copy bandwidth (``dst.copy_(src)`` of ``--copy-bytes``) and its FLOPs.
A shared prefix counts once for either model (memplan's Qwen3.5 resumes from it once a snapshot holds its
recurrent state there: from the third request that shares it, executor/state_snapshots.py). "ideal / wall" is
the share of the ideal the engine reaches; an arrival workload's wall is set by its arrivals, so its row shows
none.

The matmul rate is the median of a few calls, a burst: a GPU at its power limit lowers its clocks within a
fraction of a second of back-to-back GEMMs (an H100 SXM at 700 W falls from 1,980 MHz to about 1,350), and a
workload of seconds of GEMMs runs at the lower clocks. The same GEMM held back to back for
``--sustain-seconds`` gives the sustained rate, measured after the burst; "at the sustained matmul rate" is the
share of the ideal priced at it. Both are reported; the ideal is the burst one.

The engine's own steps are priced the same way (``step_ideal_s``: a step's prefill FLOPs plus, with decode
rows, the decode step they make) and grouped by their prefill tokens: each group's measured seconds (the
steps' read-back gaps summed) against its ideal says which steps lose the time, and all steps' ideals summed
against the workload's ideal what the schedule itself adds.

Each memplan row's counters also give the garbage collector's pauses during the run (``gc.callbacks``)
and the gaps between the read-backs of the steps that carry decode rows, grouped by the step's prefill
tokens (a p99 per group: which steps make the ITL tail), with the host seconds their launches took.
``--profile-kernels N`` runs the first workload once more under torch.profiler and lists its N
longest-running kernels; ``--profile-host N`` runs the last one once more under cProfile and lists the N
functions the host spent the most of its own time in (where a launch's host time goes); with
``--profile-host-stats FILE`` the whole profile is written there too (``python3 -m pstats FILE``).
``--sample-stacks MS`` samples the host's stack every 2 ms during the first workload's timed run and lists
the runs of one unchanged stack of at least MS ms (bench/stack_sampler.py): a launch the host stalls in once,
which cProfile's totals hide.

``--hf``: HF transformers continuous batching (the manager ``generate_batch`` drives, SDPA, greedy, EOS off)
on the same prompts, output lengths and arrival times, after memplan's model is released; run outside
``torch.inference_mode`` (its background thread updates tensors in place). Its clock starts after the
manager's warm-up; TTFT, TPOT and ITL come from its per-token timestamps. "x HF" = HF's wall / memplan's.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    ROOT, add_plan_arguments, bench_parser, build_hf, copy_bandwidth_bytes_per_s, emit, fmt, free_device_memory,
    int_list, kernel_breakdown, log, markdown_table, matmul_flops_per_s, optional_int_list, resolve_plan_arguments,
    run_info, sized_plan, str_list, sustained_matmul_flops_per_s,
)
from bench.stack_sampler import StackSampler  # noqa: E402

if TYPE_CHECKING:
    import torch

    from executor.engine import EngineReport, StepTiming
    from executor.serving import ServedModel
    from executor.serving_figures import ServingFigures
    from planner.ideal_time import IdealTime, WorkloadCost
    from planner.plan import MemoryPlan

WORKLOADS = ("fixed", "random", "shared-prefix", "poisson")
THROUGHPUT_WORKLOADS = ("fixed", "random")
#: What --smoke changes (tiny lengths for the simulator's sim.yaml plan: max_context 64, pages of 4).
SMOKE_DEFAULTS = {"workloads": list(WORKLOADS), "num_requests": 3, "input_len": 5, "output_len": 2,
                  "input_range": [2, 8], "output_range": [1, 3], "shared_prefix": 4, "warmup_requests": 1,
                  "matmul_size": 64, "sustain_seconds": 0.05, "copy_bytes": 1 << 20}
#: The defaults on a GPU: 512 x (1,024 -> 128); random lengths 128-2,048 -> 64-512.
GPU_DEFAULTS = {"workloads": ["fixed"], "num_requests": 512, "input_len": 1024, "output_len": 128,
                "input_range": [128, 2048], "output_range": [64, 512], "shared_prefix": 512, "warmup_requests": 8,
                "matmul_size": 8192, "sustain_seconds": 3.0, "copy_bytes": 1 << 30}
#: New tokens of a warm-up request.
WARMUP_NEW_TOKENS = 2
#: Characters of an HF failure's message in its row.
NOTE_CHARS = 60
#: Seconds HF's result queue is polled between arrivals.
HF_POLL_S = 0.005


@dataclass(frozen=True)
class Workload:
    kind: str
    prompts: tuple[tuple[int, ...], ...]
    outputs: tuple[int, ...]
    shared_prefix: int = 0
    arrivals_s: tuple[float, ...] | None = None  # None: every request at once
    rate: float | None = None  # requests/s of the arrivals

    @property
    def label(self) -> str:
        lengths = sorted({len(p) for p in self.prompts}), sorted(set(self.outputs))
        shape = " -> ".join(f"{v[0]:,}" if len(v) == 1 else f"{v[0]:,}-{v[-1]:,}" for v in lengths)
        extra = f", prefix {self.shared_prefix:,}" if self.shared_prefix else ""
        extra += f", {self.rate:,.2f} req/s" if self.rate is not None else ""
        return f"{self.kind} {len(self.prompts):,} x ({shape}){extra}"

    @property
    def requests(self) -> list[tuple[int, int]]:
        return [(len(p), o) for p, o in zip(self.prompts, self.outputs)]


@dataclass
class Row:
    engine: str  # "memplan" or "HF <version>"
    model: str
    serving: str  # memplan's max_batch and max_prefill_tokens ("-" for HF)
    workload: Workload
    figures: ServingFigures | None
    ideal: IdealTime
    note: str = ""  # why an HF run has no figures
    sustained_ideal: IdealTime | None = None  # memplan's: the ideal at the sustained matmul rate
    counters: str = ""  # memplan's steps, batch, preemptions, prefix hits and allocations after warm-up
    step_groups: tuple[StepGroup, ...] = ()  # memplan's steps by prefill tokens, against their ideal


@dataclass(frozen=True)
class StepGroup:
    """Engine steps of one kind: how many, their read-back gaps summed, and their ideals summed (at the burst
    and at the sustained matmul rate)."""

    label: str
    steps: int
    measured_s: float
    ideal_s: float
    sustained_ideal_s: float


# -- workloads ------------------------------------------------------------------------------------------------------


def make_workload(kind: str, args: argparse.Namespace, vocab: int, seed: int, rate: float | None = None) -> Workload:
    import numpy as np

    rng = np.random.default_rng(seed)
    n = args.num_requests

    def ids(count: int) -> tuple[int, ...]:
        return tuple(int(i) for i in rng.integers(0, vocab, count))

    if kind == "random":
        lengths = rng.integers(args.input_range[0], args.input_range[1] + 1, n)
        outputs = rng.integers(args.output_range[0], args.output_range[1] + 1, n)
        return Workload(kind, tuple(ids(int(length)) for length in lengths), tuple(int(o) for o in outputs))
    if kind == "shared-prefix":
        prefix = ids(args.shared_prefix)
        return Workload(kind, tuple(prefix + ids(args.input_len - args.shared_prefix) for _ in range(n)),
                        (args.output_len,) * n, shared_prefix=args.shared_prefix)
    prompts, outputs = tuple(ids(args.input_len) for _ in range(n)), (args.output_len,) * n
    if kind == "fixed":
        return Workload(kind, prompts, outputs)
    assert kind == "poisson" and rate is not None
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])  # the first request at the start
    return Workload(kind, prompts, outputs, arrivals_s=tuple(float(t) for t in arrivals), rate=rate)


def check_args(args: argparse.Namespace) -> None:
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads {','.join(unknown)}: not one of {', '.join(WORKLOADS)}")
    for flag in ("input_range", "output_range"):
        low_high = getattr(args, flag)
        if len(low_high) != 2 or low_high[0] > low_high[1]:
            raise SystemExit(f"--{flag.replace('_', '-')} {low_high}: give LOW,HIGH with LOW <= HIGH")
    if "shared-prefix" in args.workloads and not 1 <= args.shared_prefix <= args.input_len:
        raise SystemExit(f"--shared-prefix {args.shared_prefix}: must be in [1, --input-len {args.input_len}]")
    if "poisson" in args.workloads and args.request_rate is None:
        first = min((args.workloads.index(w) for w in THROUGHPUT_WORKLOADS if w in args.workloads), default=None)
        if first is None or first > args.workloads.index("poisson"):
            raise SystemExit("--workloads poisson: give --request-rate, or run fixed or random before it (its "
                             "requests/s x --rate-fraction is the rate)")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SystemExit(f"--request-rate {args.request_rate}: must be > 0")


def longest_request(args: argparse.Namespace) -> int:
    """The most tokens (prompt + output) a request of the run's workloads holds."""
    lengths = [args.input_len + args.output_len]
    if "random" in args.workloads:
        lengths.append(args.input_range[1] + args.output_range[1])
    return max(lengths)


# -- memplan --------------------------------------------------------------------------------------------------------


#: The serving fields a run's lists sweep (``--max-batch 64,256`` ...), each a flag of the same name.
SWEPT_FIELDS = ("max_batch", "max_prefill_tokens", "max_prefill_tokens_beside_decode", "max_step_tokens")


def serving_configs(args: argparse.Namespace) -> list[dict[str, int | None]]:
    """Every combination of the swept fields' lists, in flag order (None: the serving config's value)."""
    configs: list[dict[str, int | None]] = [{}]
    for name in SWEPT_FIELDS:
        configs = [{**config, name: value} for config in configs for value in getattr(args, name) or [None]]
    return configs


def serving_plan(model_name: str, args: argparse.Namespace, sizes: dict[str, int | None]) -> MemoryPlan:
    """The serving config's plan with ``sizes`` (SWEPT_FIELDS) over it (None: the config's)."""
    from planner.loader import load_serving

    overrides = {"max_context": longest_request(args), **sizes}
    batch = sizes.get("max_batch") or load_serving(args.serving).max_batch
    return sized_plan(model_name, args.hardware, args.serving, overrides, min(batch, args.num_requests),
                      args.gpu_memory_utilization)


class CollectorPauses:
    """The garbage collector's pauses while it is entered (``gc.callbacks``): the serving loop's host
    thread stops for each, so a long one shows up in ITL p99."""

    def __init__(self) -> None:
        self.started = 0.0
        self.pauses_ms: dict[int, list[float]] = {}  # generation -> each collection's ms

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.pauses_ms.setdefault(info["generation"], []).append((time.perf_counter() - self.started) * 1e3)

    def line(self) -> str:
        parts = [f"gen {generation}: {len(ms):,} ({sum(ms):,.1f} ms, longest {max(ms):,.1f})"
                 for generation, ms in sorted(self.pauses_ms.items())]
        return "collector pauses " + ("; ".join(parts) if parts else "none")


def run_memplan(served: ServedModel, workload: Workload,
                args: argparse.Namespace) -> tuple[ServingFigures, str, list[StepTiming]]:
    """The workload's figures, the engine's counters (see ``counters``) with the collector's pauses, and the
    engine's step timings."""
    from executor.workload import SHARED_PREFIX_ARRIVAL_STEP, RequestSpec

    specs = [RequestSpec(list(prompt), output, seed=args.seed,
                         arrival_step=SHARED_PREFIX_ARRIVAL_STEP if workload.shared_prefix and index else 0,
                         arrival_s=None if workload.arrivals_s is None else workload.arrivals_s[index])
             for index, (prompt, output) in enumerate(zip(workload.prompts, workload.outputs))]
    with CollectorPauses() as pauses:
        report = served.run(specs, ignore_eos=True, prefix_caching=not args.no_prefix_caching,
                            overlap=not args.no_overlap)
    ran = report.figures
    if ran.requests != len(specs) or ran.output_tokens != sum(workload.outputs):
        raise SystemExit(f"{workload.label}: memplan ran {ran.requests} of {len(specs)} requests and "
                         f"{ran.output_tokens} of {sum(workload.outputs)} tokens (rejected: {report.rejected})")
    return (ran, f"{counters(report.engine)}, {pauses.line()}; {step_gaps(report.engine)}",
            report.engine.step_timings)


#: Upper ends of the prefill-token groups a serving run's step gaps fall in (past the last: one more).
GAP_GROUP_ENDS = (0, 512, 2048)


def gap_group(prefill_tokens: int) -> int:
    """The group of a step with ``prefill_tokens``: the index of the first GAP_GROUP_ENDS it is within."""
    return next((i for i, end in enumerate(GAP_GROUP_ENDS) if prefill_tokens <= end), len(GAP_GROUP_ENDS))


def gap_group_label(group: int) -> str:
    if group == 0:
        return "no prefill"
    if group == len(GAP_GROUP_ENDS):
        return f"> {GAP_GROUP_ENDS[-1]:,} prefill tokens"
    return f"{GAP_GROUP_ENDS[group - 1] + 1:,}-{GAP_GROUP_ENDS[group]:,} prefill tokens"


def step_gaps(report: EngineReport) -> str:
    """The gaps between read-backs of the steps that carry decode rows (what their requests' ITL is
    made of), grouped by the step's prefill tokens: count, p50 and p99 ms a group, and the p50 and p99
    of the host's launch of those steps (a gap shorter than the next step's launch waits for it)."""
    from executor.serving_figures import percentile_ms

    groups: dict[int, list[StepTiming]] = {}
    for timing in report.step_timings:
        if timing.decode_rows:
            groups.setdefault(gap_group(timing.prefill_tokens), []).append(timing)

    def p50_p99(values: list[float]) -> str:
        return f"p50 {percentile_ms(values, 50):.1f}, p99 {percentile_ms(values, 99):.1f}"

    parts = [f"{gap_group_label(group)}: {len(timings):,} ({p50_p99([t.gap_s for t in timings])} ms; launch "
             f"{p50_p99([t.launch_s for t in timings])} ms)" for group, timings in sorted(groups.items())]
    return "step gaps with decode rows: " + ("; ".join(parts) if parts else "none")


def step_groups(timings: Sequence[StepTiming], plan: MemoryPlan, rates: Rates) -> tuple[StepGroup, ...]:
    """The run's steps in ``gap_group``'s prefill-token groups (decode-only steps first; in each other group the
    steps without decode rows apart from those with), each group's read-back gaps and ideals summed, then one
    group of all steps."""
    from planner.ideal_time import ModelCosts, step_ideal_s

    costs = ModelCosts.of(plan)
    by_group: dict[tuple[int, bool], list[StepTiming]] = {}
    for timing in timings:
        by_group.setdefault((gap_group(timing.prefill_tokens), timing.decode_rows > 0), []).append(timing)

    def ideal_s(steps: list[StepTiming], matmul_flops_per_s: float) -> float:
        return sum(step_ideal_s(costs, t.work, matmul_flops_per_s, rates.copy_bytes_per_s) for t in steps)

    def label(group: int, decode: bool) -> str:
        if group == 0:
            return "decode only"
        return gap_group_label(group) + ("" if decode else ", no decode rows")

    groups = [StepGroup(label(group, decode), len(steps), sum(t.gap_s for t in steps),
                        ideal_s(steps, rates.matmul_flops_per_s), ideal_s(steps, rates.sustained_matmul_flops_per_s))
              for (group, decode), steps in sorted(by_group.items(), key=lambda item: (item[0][0], not item[0][1]))]
    return (*groups, StepGroup("all steps", len(timings), sum(g.measured_s for g in groups),
                               sum(g.ideal_s for g in groups), sum(g.sustained_ideal_s for g in groups)))


def counters(report: EngineReport) -> str:
    """Where a serving run's time can go: steps, the largest batch, preemptions, prefix-cache hits, KV pages at
    peak, allocations after warm-up (CUDA) and kernel specializations readied after warm-up."""
    from executor.run_report import readied_line, snapshot_counts

    stats = report.stats
    allocations = "n/a" if report.allocations_after_warmup is None else f"{report.allocations_after_warmup:,}"
    prefix = f"prefix hits {stats.prefix_hit_rate:.1%}" if report.prefix_caching else "prefix caching off"
    if report.prefix_caching and stats.recurrent_slots:
        prefix += f" ({snapshot_counts(stats)})"
    return (f"{report.steps:,} steps, peak batch {stats.peak_running:,}, {stats.preemptions:,} preemptions, {prefix}, "
            f"peak KV pages {stats.peak_kv_pages_used:,} of "
            f"{stats.kv_pages_usable:,}, allocations after warm-up {allocations}, kernels readied after warm-up "
            f"{readied_line(report.kernels_readied_after_warmup)}")


def warm_up(served: ServedModel, workload: Workload, args: argparse.Namespace, vocab: int) -> None:
    """Untimed requests shaped like the workload's first ones (other ids, so no prefix is cached for it)."""
    if args.warmup_requests <= 0:
        return
    count = min(args.warmup_requests, len(workload.prompts))
    lengths = [len(p) for p in workload.prompts[:count]]
    warm = Workload("warm-up", tuple(tuple((i * 7919 + j) % vocab for j in range(n)) for i, n in enumerate(lengths)),
                    (WARMUP_NEW_TOKENS,) * count)
    run_memplan(served, warm, args)


# -- HF transformers ------------------------------------------------------------------------------------------------


def run_hf(hf: torch.nn.Module, workload: Workload) -> ServingFigures:
    """The workload through HF's continuous-batching manager (see the module docstring)."""
    from transformers import GenerationConfig

    from executor.serving_figures import ServingFigures, request_tpot_s, token_gaps_s

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(workload.outputs))
    options = {"generation_config": config, "block": True, "timeout": 30}
    if "workload_hints" in inspect.signature(hf.continuous_batching_context_manager).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        options["workload_hints"] = WorkloadHints(max(len(p) for p in workload.prompts), max(workload.outputs),
                                                  len(workload.prompts))
    arrivals = workload.arrivals_s or (0.0,) * len(workload.prompts)
    submitted: dict[str, tuple[int, float]] = {}  # request id -> (index, submit time)
    finished = {}
    with hf.continuous_batching_context_manager(**options) as manager:
        start = time.perf_counter()
        pending = 0
        while len(finished) < len(workload.prompts):
            now = time.perf_counter() - start
            while pending < len(arrivals) and arrivals[pending] <= now:
                request_id = manager.add_request(list(workload.prompts[pending]), request_id=f"r{pending}",
                                                 max_new_tokens=workload.outputs[pending], record_timestamps=True)
                submitted[request_id] = (pending, time.perf_counter())
                pending += 1
            result = manager.get_result(timeout=HF_POLL_S)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"HF request {result.request_id}: {result.error}")
                finished[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"HF's generation loop stopped with {len(finished)} of "
                                   f"{len(workload.prompts)} requests finished")
        wall_s = time.perf_counter() - start
    ttfts, tpots, itls = [], [], []
    for request_id, result in finished.items():
        stamps = result.timestamps or []
        if stamps:
            ttfts.append(stamps[0] - submitted[request_id][1])
        itls += token_gaps_s(stamps)
        if (tpot := request_tpot_s(stamps)) is not None:
            tpots.append(tpot)
    outputs = sum(len(r.generated_tokens) for r in finished.values())
    if outputs != sum(workload.outputs):
        raise RuntimeError(f"HF generated {outputs} of {sum(workload.outputs)} tokens")
    return ServingFigures.from_samples(len(finished), sum(len(p) for p in workload.prompts), outputs, wall_s,
                                       ttfts, tpots, itls)


# -- the run --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """The device's rates, measured just before a serving config's workloads: the ideal's matmul rate (a short
    median), the rate the same GEMM holds over ``sustain_s`` (at a power limit, lower), and the copy bandwidth."""

    matmul_flops_per_s: float
    sustained_matmul_flops_per_s: float
    copy_bytes_per_s: float
    dtype: str
    matmul_size: int
    sustain_s: float
    copy_bytes: int

    def line(self) -> str:
        return (f"measured: {self.dtype} matmul {self.matmul_size}^3 {self.matmul_flops_per_s / 1e12:,.1f} TFLOP/s "
                f"({self.sustained_matmul_flops_per_s / 1e12:,.1f} held over {self.sustain_s:g} s), "
                f"copy ({self.copy_bytes:,} B) {self.copy_bytes_per_s / 1e9:,.0f} GB/s")


def measure_rates(device: torch.device, dtype: str, args: argparse.Namespace) -> Rates:
    matmul = matmul_flops_per_s(device, args.matmul_size, dtype)  # first: the sustained run would lower it
    sustained = sustained_matmul_flops_per_s(device, args.matmul_size, dtype, args.sustain_seconds)
    copy = copy_bandwidth_bytes_per_s(device, args.copy_bytes)
    return Rates(matmul, sustained, copy, dtype, args.matmul_size, args.sustain_seconds, args.copy_bytes)


@dataclass(frozen=True)
class ServingRun:
    """One model at one serving config: its rows, the work of each workload and the rates it was measured at."""

    model: str
    serving: str
    rows: list[Row]
    costs: list[tuple[str, WorkloadCost]]
    rates: Rates
    kernel_breakdown: str = ""  # --profile-kernels: the first workload's top kernels, a second (untimed) run
    host_breakdown: str = ""  # --profile-host: the last workload's top host functions, another (untimed) run
    stack_runs: str = ""  # --sample-stacks: the first workload's longest host stalls, sampled in its timed run


def bench_model(model_name: str, args: argparse.Namespace, sizes: dict[str, int | None], with_hf: bool) -> ServingRun:
    """Every workload through memplan at one serving config, then (``with_hf``) through HF."""
    from executor.serving import RANDOM_WEIGHTS, ServedModel
    from planner.ideal_time import workload_cost

    plan = serving_plan(model_name, args, sizes)
    name, serving = plan.model.name, serving_label(plan)
    log(f"{name}: {serving}, max_context {plan.capacity.max_context}, gpu_memory_utilization "
        f"{plan.serving.gpu_memory_utilization}")
    served = ServedModel.open(plan, "sim" if args.smoke else "cuda", weights=RANDOM_WEIGHTS, seed=args.seed,
                              eager=args.eager, log=sys.stderr)
    if served.graphs is not None:
        g = served.graphs
        log(f"{name}: decode graphs {list(g.buckets)} in {g.seconds:.2f} s ({g.reserved_bytes:,} B reserved); "
            f"prefill graphs {g.prefill_pieces} pieces x {list(g.prefill_buckets)} rows in {g.prefill_seconds:.2f} s "
            f"({g.prefill_reserved_bytes:,} B reserved)")
    device = served.model.device.torch_device
    rates = measure_rates(device, plan.dtypes.weights, args)
    log(f"{name}: {rates.line()}")
    rows, costs, workloads = [], [], []
    stack_runs = ""
    vocab = plan.model.vocab_size
    for index, kind in enumerate(args.workloads):
        rate = None
        if kind == "poisson":
            measured = next((r.figures.requests_per_s for r in rows if r.workload.kind in THROUGHPUT_WORKLOADS), None)
            rate = args.request_rate if args.request_rate is not None else args.rate_fraction * measured
        workload = make_workload(kind, args, vocab, args.seed + index, rate)
        cost = workload_cost(plan, workload.requests, workload.shared_prefix)
        ideal = cost.ideal(rates.matmul_flops_per_s, rates.copy_bytes_per_s)
        sustained_ideal = cost.ideal(rates.sustained_matmul_flops_per_s, rates.copy_bytes_per_s)
        if index == 0:
            warm_up(served, workload, args, vocab)
        log(f"{name}: memplan {workload.label}")
        if index == 0 and args.sample_stacks > 0:
            with StackSampler() as sampler:
                figures, engine_counters, timings = run_memplan(served, workload, args)
            stack_runs = sampler.report(args.sample_stacks)
            log(f"{name}, {workload.label}: host stack runs\n{stack_runs}")
        else:
            figures, engine_counters, timings = run_memplan(served, workload, args)
        log(f"{name}: {figures.lines()[0]}; ideal {ideal.total_s:.3f} s, {sustained_ideal.total_s:.3f} s at the "
            f"sustained matmul rate; {engine_counters}")
        rows.append(Row("memplan", name, serving, workload, figures, ideal, counters=engine_counters,
                        step_groups=step_groups(timings, plan, rates), sustained_ideal=sustained_ideal))
        costs.append((workload.label, cost))
        workloads.append(workload)
    # Each profile is logged as it finishes: a run cut short by a time limit keeps what it measured.
    breakdown = profile_kernels(served, workloads[0], args) if args.profile_kernels > 0 and not args.smoke else ""
    if breakdown:
        log(f"{name}, {workloads[0].label}: the longest-running kernels\n{breakdown}")
    host = profile_host(served, workloads[-1], args) if args.profile_host > 0 else ""
    if host:
        log(f"{name}, {workloads[-1].label}: host functions with the most time of their own\n{host}")
    del served
    free_device_memory(device)
    if with_hf:
        rows += hf_rows(plan, workloads, [r.ideal for r in rows], args, device)
    return ServingRun(name, serving, rows, costs, rates, breakdown, host, stack_runs)


def profile_host(served: ServedModel, workload: Workload, args: argparse.Namespace) -> str:
    """The workload once more, untimed, under cProfile: a table of the ``--profile-host`` functions with
    the most host time of their own (calls, own ms, cumulative ms; the profiler slows every call)."""
    import cProfile
    import pstats

    log(f"{workload.label}: host-profiled run")
    profiler = cProfile.Profile()
    profiler.enable()
    run_memplan(served, workload, args)
    profiler.disable()
    if args.profile_host_stats:
        profiler.dump_stats(args.profile_host_stats)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, _)
    top = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[: args.profile_host]
    lines = ["| function | calls | own ms | cumulative ms |", "| --- | ---: | ---: | ---: |"]
    for (file, line, function), (calls, _, own_s, cumulative_s, _) in top:
        where = f"{os.path.relpath(file) if os.path.isabs(file) else file}:{line} {function}"
        lines.append(f"| `{where[-100:]}` | {calls:,} | {1e3 * own_s:,.1f} | {1e3 * cumulative_s:,.1f} |")
    return "\n".join(lines)


def profile_kernels(served: ServedModel, workload: Workload, args: argparse.Namespace) -> str:
    """The workload once more, untimed, under torch.profiler: its ``--profile-kernels`` longest-running
    kernels (where the serving run's GPU time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    log(f"{workload.label}: profiled run")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_memplan(served, workload, args)
        torch.cuda.synchronize()
    return kernel_breakdown(prof.events(), args.profile_kernels)


def serving_label(plan: MemoryPlan) -> str:
    beside, rows = plan.serving.max_prefill_tokens_beside_decode, plan.serving.max_step_tokens
    return (f"batch {plan.capacity.max_batch}, prefill {plan.serving.max_prefill_tokens:,}"
            + (f" ({beside:,} beside decode)" if beside is not None else "")
            + (f", steps of {rows:,} rows" if rows is not None else ""))


def hf_rows(plan: MemoryPlan, workloads: Sequence[Workload], ideals: Sequence[IdealTime], args: argparse.Namespace,
            device: torch.device) -> list[Row]:
    import transformers

    hf = build_hf(plan, device, args.seed)
    engine, model = f"HF {transformers.__version__}", plan.model.name
    rows = []
    for workload, ideal in zip(workloads, ideals):
        log(f"{engine} {model}: {workload.label}")
        try:
            figures = run_hf(hf, workload)
            log(f"{engine} {model}: {figures.lines()[0]}")
            rows.append(Row(engine, model, "-", workload, figures, ideal))
        except Exception as error:  # report it beside memplan's figures rather than lose them
            log(f"{engine} {model}: {type(error).__name__}: {error}")
            message = str(error).splitlines()[0][:NOTE_CHARS] if str(error) else ""
            rows.append(Row(engine, model, "-", workload, None, ideal, f"failed: {type(error).__name__}: {message}"))
    del hf
    free_device_memory(device)
    return rows


# -- output ---------------------------------------------------------------------------------------------------------


def figures_table(rows: Sequence[Row]) -> str:
    from executor.serving_figures import MARKDOWN_HEADERS, markdown_header, markdown_line

    hf_wall = {(r.model, r.workload.label): r.figures.wall_s for r in rows
               if r.engine != "memplan" and r.figures is not None}
    lines = [markdown_header(["engine", "model", "serving", "workload"],
                             ["ideal s", "ideal / wall", "at the sustained matmul rate", "x HF"])]
    for row in rows:
        leading = [row.engine, row.model, row.serving, row.workload.label]
        if row.figures is None:
            lines.append(markdown_line([*leading, *(["-"] * len(MARKDOWN_HEADERS)), seconds(row.ideal.total_s),
                                        "-", "-", row.note]))
            continue
        share = sustained_share = versus = "-"  # an arrival workload's wall is its arrivals'
        reference = hf_wall.get((row.model, row.workload.label))
        if row.workload.arrivals_s is None:
            share = f"{row.ideal.total_s / row.figures.wall_s:.1%}"
            if row.sustained_ideal is not None:
                sustained_share = f"{row.sustained_ideal.total_s / row.figures.wall_s:.1%}"
            versus = f"{reference / row.figures.wall_s:,.1f}x" if row.engine == "memplan" and reference else "-"
        lines.append(row.figures.markdown_row(leading, [seconds(row.ideal.total_s), share, sustained_share, versus]))
    return "\n".join(lines)


def step_group_table(rows: Sequence[Row]) -> str:
    """Each memplan row's step groups against their ideal (see ``step_groups``)."""
    lines = []
    for row in rows:
        total = row.step_groups[-1].measured_s if row.step_groups else 0.0
        for group in row.step_groups:
            lines.append([row.model, row.serving, row.workload.label, group.label, f"{group.steps:,}",
                          seconds(group.measured_s), f"{group.measured_s / total:.1%}" if total else "-",
                          seconds(group.ideal_s),
                          f"{group.ideal_s / group.measured_s:.1%}" if group.measured_s else "-",
                          f"{group.sustained_ideal_s / group.measured_s:.1%}" if group.measured_s else "-"])
    headers = ["model", "serving", "workload", "step group", "steps", "measured s", "share", "ideal s",
               "ideal / measured", "at the sustained matmul rate"]
    return markdown_table(headers, lines, [False] * 4 + [True] * 6)


def seconds(value: float) -> str:
    """Seconds with two decimals, or three significant digits below one second (the simulator's tiny ideals)."""
    return f"{value:,.2f}" if value >= 1 else f"{value:.3g}"


def ideal_table(runs: Sequence[ServingRun]) -> str:
    rows = []
    for run, (label, cost) in ((run, item) for run in runs for item in run.costs):
        ideal = cost.ideal(run.rates.matmul_flops_per_s, run.rates.copy_bytes_per_s)
        sustained = cost.ideal(run.rates.sustained_matmul_flops_per_s, run.rates.copy_bytes_per_s)
        rows.append([run.model, run.serving, label, f"{cost.prefill_tokens:,}", fmt(cost.prefill_flops / 1e12, 1),
                     seconds(ideal.prefill_s), f"{ideal.decode_steps:,}", fmt(cost.decode_bytes / 1e9, 1),
                     seconds(ideal.decode_s), f"{ideal.compute_bound_steps:,}", seconds(ideal.total_s),
                     seconds(sustained.total_s)])
    headers = ["model", "serving", "workload", "prefill tokens", "prefill TFLOP", "prefill s", "decode steps",
               "decode GB", "decode s", "compute-bound steps", "ideal s", "at the sustained matmul rate s"]
    return markdown_table(headers, rows, [False, False, False] + [True] * 9)


def tree() -> str:
    """The commit the code ran from, "-dirty" when the working tree differs from it (a copy of a checkout
    with changes of its own, as on a GPU machine that received a working tree)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    add_plan_arguments(parser, "default: the share that holds max_batch requests of the longest length",
                       "tiny configs in the Numba CUDA simulator (seconds, no GPU)", hardware_serving=True)
    parser.add_argument("--workloads", type=str_list, default=None,
                        help=f"of {', '.join(WORKLOADS)} (default fixed; all four with --smoke)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 512 (5 with --smoke)")
    parser.add_argument("--input-len", type=int, default=None, help="fixed, shared-prefix, poisson; default 1024")
    parser.add_argument("--output-len", type=int, default=None, help="default 128")
    parser.add_argument("--input-range", type=int_list, default=None, help="random: LOW,HIGH (default 128,2048)")
    parser.add_argument("--output-range", type=int_list, default=None, help="random: LOW,HIGH (default 64,512)")
    parser.add_argument("--shared-prefix", type=int, default=None, help="shared-prefix: tokens (default 512)")
    parser.add_argument("--request-rate", type=float, default=None, help="poisson: requests/s")
    parser.add_argument("--rate-fraction", type=float, default=0.7,
                        help="poisson without --request-rate: this share of the measured requests/s (default 0.7)")
    parser.add_argument("--max-batch", type=int_list, default=None,
                        help="serving max_batch over the serving config's; a list (64,128,256) runs each")
    parser.add_argument("--max-prefill-tokens", type=int_list, default=None,
                        help="serving max_prefill_tokens; a list runs each (with each --max-batch)")
    parser.add_argument("--max-prefill-tokens-beside-decode", type=optional_int_list, default=None,
                        help="serving max_prefill_tokens_beside_decode; a list runs each (with each of the others), "
                             "none: unset (none,512)")
    parser.add_argument("--max-step-tokens", type=optional_int_list, default=None,
                        help="serving max_step_tokens (a step's rows, decode rows included); a list runs each (with "
                             "each of the others), none: unset (none,8192 compares the two in one run)")
    parser.add_argument("--warmup-requests", type=int, default=None, help="untimed requests first (default 8)")
    parser.add_argument("--matmul-size", type=int, default=None, help="default 8192")
    parser.add_argument("--sustain-seconds", type=float, default=None,
                        help="the matmul held back to back this long for its sustained rate (default 3; 0.05 "
                             "with --smoke)")
    parser.add_argument("--copy-bytes", type=int, default=None, help="default 1 GiB")
    parser.add_argument("--hf", action="store_true", help="also run HF transformers continuous batching")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (decode graphs or prefill pieces)")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--profile-kernels", type=int, default=0,
                        help="run the first workload once more under torch.profiler and list its N longest-running "
                             "kernels (default 0: no profiled run)")
    parser.add_argument("--profile-host", type=int, default=0,
                        help="run the last workload once more under cProfile and list the N functions with the most "
                             "host time of their own (default 0: no profiled run)")
    parser.add_argument("--sample-stacks", type=float, default=0, metavar="MS",
                        help="sample the host's stack every 2 ms during the first workload's timed run (which "
                             "the sampling perturbs) and list the runs of one stack of at least MS ms: the "
                             "launches the host stalls in (default 0: off)")
    parser.add_argument("--profile-host-stats", default=None, metavar="FILE",
                        help="with --profile-host: also write the cProfile statistics to FILE (pstats format)")
    args = parser.parse_args(argv)
    for key, value in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    resolve_plan_arguments(args, hardware_serving=True)
    check_args(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from executor.serving import choose_simulator

    choose_simulator("sim" if args.smoke else "cuda")  # before numba.cuda loads
    from executor.device import DeviceError, open_device

    try:
        open_device("sim" if args.smoke else "cuda")
    except DeviceError as error:
        raise SystemExit(f"bench/serve.py: {error} (--smoke runs tiny configs in the simulator)") from None
    runs = []
    for model_name in args.models:
        for index, sizes in enumerate(serving_configs(args)):  # HF once a model: no such config
            runs.append(bench_model(model_name, args, sizes, args.hf and index == 0))
    import torch

    info = run_info(torch.device("cpu" if args.smoke else "cuda"))
    rows = [row for run in runs for row in run.rows]
    rates = "; ".join(f"{run.model} ({run.serving}): {run.rates.line()}" for run in runs)
    engine_lines = "\n".join(f"- {r.model} ({r.serving}), {r.workload.label}: {r.counters}" for r in rows if r.counters)
    body = "\n\n".join([f"tree {tree()}; {rates}", figures_table(rows), "memplan's engine counters:", engine_lines,
                        "Ideal time of each workload (planner/ideal_time.py):", ideal_table(runs),
                        "memplan's steps against their own ideal (the read-back gaps of a group's steps summed, "
                        "and planner/ideal_time.py's step_ideal_s of each summed):",
                        step_group_table([r for r in rows if r.step_groups])])
    for run in runs:
        if run.kernel_breakdown:
            body += (f"\n\n### {run.model} ({run.serving}), {run.rows[0].workload.label}: the "
                     f"{args.profile_kernels} longest-running kernels\n\n{run.kernel_breakdown}")
        if run.stack_runs:
            body += (f"\n\n### {run.model} ({run.serving}), {run.rows[0].workload.label}: where the host "
                     f"stalled (--sample-stacks {args.sample_stacks:g})\n\n{run.stack_runs}")
        if run.host_breakdown:
            last = next(row for row in reversed(run.rows) if row.engine == "memplan")
            body += (f"\n\n### {run.model} ({run.serving}), {last.workload.label}: the {args.profile_host} "
                     f"host functions with the most time of their own (cProfile)\n\n{run.host_breakdown}")
    emit("Serving throughput against the ideal time (bench/serve.py)", info, body, args.out)


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    main()
