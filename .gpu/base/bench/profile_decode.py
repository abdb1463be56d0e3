"""Where a decode step's time goes: kernels of one captured decode graph by name, with the step's wall time.

    python3 bench/profile_decode.py [--model qwen3-8b] [--batch 1] [--context 512] [--decode-gemv-max-batch N]

GPU only (CUDA graphs). Random weights in a plan sized to the cell (bench/decode.py's plan, zeroed KV),
decode graphs captured, then:

- step: wall time of ``model.step(plan_step(...))`` plus reading the sampled ids back, the synchronous
  engine's step (host metadata, copy-in, replay, read-back); median of 30 after 5 warm-up steps;
- replay: the bucket's graph alone between CUDA events; median of 30;
- plan_step: host time of the step's metadata (page tables kept across steps, as the engine keeps
  them); median of 30;
- kernels: torch.profiler's CUDA time over 5 replays, per step in total and per kernel name (us a
  step, launches a step, us a launch), largest first.

The step minus the replay is the host's share; the replay minus the kernels, the graph's gaps. The
host parts time each piece of a step on its own (plan_step, pad_decode, the metadata write, the
replay call, the wait plus read-back).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/profile_decode.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import build_memplan, decode_chunks, open_bench_device, reset_slots, sized_plan  # noqa: E402

PROFILED_REPLAYS = 5
TIMED = 30


def host_parts(model: Any, plan: Any, chunks: list, page_tables: Any, bucket: int, graph: Any) -> dict[str, float]:
    """Median host microseconds of each piece of a graph step, timed one by one as model.step runs
    them: plan_step, pad_decode, the metadata write (StepWriter), the replay call, then the wait for
    the GPU plus the sampled ids' read-back."""
    import torch

    from executor.step import pad_decode, plan_step

    samples: dict[str, list[float]] = collections.defaultdict(list)
    sampled = model.arena.tensor("sampling", "sampled_ids")[: len(chunks)]
    for _ in range(TIMED):
        torch.cuda.synchronize()
        clock = [time.perf_counter()]
        meta = plan_step(plan, chunks, page_tables)
        clock.append(time.perf_counter())
        padded = pad_decode(plan, meta, bucket)
        clock.append(time.perf_counter())
        model.writer.write(padded)
        clock.append(time.perf_counter())
        graph.replay()
        clock.append(time.perf_counter())
        sampled.tolist()
        clock.append(time.perf_counter())
        for name, start_s, end_s in zip(("plan_step", "pad_decode", "write", "replay call", "wait + read-back"),
                                        clock, clock[1:]):
            samples[name].append((end_s - start_s) * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per request")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--serving", default="default")
    parser.add_argument("--decode-gemv-max-batch", type=int, default=None, help="serving override")
    parser.add_argument("--top", type=int, default=25, help="kernel names listed")
    args = parser.parse_args()
    from executor.device import DeviceError

    try:
        device = open_bench_device(False)  # before numba.cuda loads
    except DeviceError as error:
        sys.exit(f"{error} (this benchmark needs a GPU: it profiles CUDA graphs)")
    import torch

    from executor.page_tables import PageTables
    from executor.step import plan_step

    overrides = {"max_batch": args.batch, "max_context": args.context + 1}
    if args.decode_gemv_max_batch is not None:
        overrides["decode_gemv_max_batch"] = args.decode_gemv_max_batch
    plan = sized_plan(args.model, args.hardware, args.serving, overrides, num_requests=args.batch)
    arena, model = build_memplan(plan, device, 0)
    arena.tensor("kv_cache", "kv_cache").zero_()
    model.capture_decode_graphs()
    chunks = decode_chunks(plan, args.batch, args.context, [1] * args.batch)
    page_tables = PageTables()  # kept across steps, as the engine keeps them (decode_chunks keys them)
    reset_slots(model, args.batch)
    for _ in range(5):
        model.step(plan_step(plan, chunks, page_tables)).tolist()
    walls = []
    for _ in range(TIMED):
        torch.cuda.synchronize()
        start_s = time.perf_counter()
        model.step(plan_step(plan, chunks, page_tables)).tolist()
        walls.append((time.perf_counter() - start_s) * 1e3)
    bucket = model.graphs.bucket_for(args.batch)
    graph = model.graphs.graphs[bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(TIMED):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end))
    host = []
    for _ in range(TIMED):
        start_s = time.perf_counter()
        plan_step(plan, chunks, page_tables)
        host.append((time.perf_counter() - start_s) * 1e3)
    parts = host_parts(model, plan, chunks, page_tables, bucket, graph)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
            counts[event.name] += 1
    kernel_us = sum(totals.values()) / PROFILED_REPLAYS
    print(f"{args.model} B={args.batch} C={args.context} bucket {bucket}: step {statistics.median(walls):.3f} ms, "
          f"replay {statistics.median(replays):.3f} ms, kernels {kernel_us / 1e3:.3f} ms, "
          f"plan_step {statistics.median(host):.3f} ms")
    print("  host parts of a step (median us): " + ", ".join(f"{name} {us:.1f}" for name, us in parts.items()))
    for name, total in sorted(totals.items(), key=lambda item: -item[1])[: args.top]:
        print(f"  {total / PROFILED_REPLAYS:9.1f} us/step  {counts[name] // PROFILED_REPLAYS:4d}x  "
              f"{total / counts[name]:7.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
