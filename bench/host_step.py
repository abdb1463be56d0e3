"""Host time of a steady decode step, outside the GPU: the engine's scheduling and metadata work.

    python3 bench/host_step.py [--model qwen3-8b] [--cells 1x512,8x4096,64x4096] [--repeats 200] [--out FILE]

For each cell (B requests, C tokens cached each), B requests are admitted and prefilled on the host
(no model runs), then decode steps are timed piece by piece, as ``Engine.run`` does them:
``Scheduler.schedule``, the chunks with sampling parameters (``_request_chunk``), ``plan_step``
without and with the engine's kept page tables (``PageTables``), ``pad_decode`` to the cell's
graph bucket, and ``Scheduler.update``. Medians over ``--repeats`` steps, in microseconds. No GPU:
this is the CPU work of a step besides the metadata copy and replay launch (which need a GPU and are
not here). Step by step (``memplan run --no-overlap``) the GPU idles through all of it; the engine's
default overlapped loop runs it while the GPU computes the step before, so it shows only where it
exceeds that step's GPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/host_step.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import sized_plan  # noqa: E402

PARTS = ("schedule", "chunks", "plan_step (lists)", "plan_step (kept tables)", "pad_decode", "update")


def time_cell(model_name: str, batch: int, context: int, repeats: int) -> dict[str, float]:
    """Median microseconds of each part of a decode step at ``batch`` x ``context``."""
    from executor.engine import _request_chunk
    from executor.page_tables import PageTables
    from executor.scheduler import Request, Scheduler, can_cache_prefixes
    from executor.step import pad_decode, plan_step

    plan = sized_plan(model_name, "h200", "default", {"max_batch": batch, "max_context": context + repeats + 64},
                      num_requests=batch)
    recurrent = plan.geometry.num_linear_layers > 0
    scheduler = Scheduler(plan.capacity, prefix_caching=can_cache_prefixes(plan.capacity, recurrent),
                          has_recurrent_state=recurrent)
    new_tokens = repeats + 16  # no request finishes during the timed steps
    requests = {i: Request(i, [1 + (i * 7919 + t) % 1000 for t in range(context)], new_tokens) for i in range(batch)}
    for request in requests.values():
        assert scheduler.add(request), request.error
    while (step := scheduler.schedule()).num_prefill_tokens:  # prefill on the host only: no model
        scheduler.update(step, [0] * step.num_requests)
    scheduler.update(step, [0] * step.num_requests)
    bucket = min((b for b in plan.serving.decode_graph_batch_sizes if b >= batch), default=None)  # None: eager
    tables = PageTables()
    samples: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(repeats):
        marks = [time.perf_counter()]
        step = scheduler.schedule()
        marks.append(time.perf_counter())
        chunks = [_request_chunk(chunk, requests[chunk.request_id]) for chunk in step.chunks]
        marks.append(time.perf_counter())
        unkeyed = [replace(c, page_table_key=None) for c in chunks]  # not timed: the path before PageTables
        marks.append(time.perf_counter())
        plan_step(plan, unkeyed)
        marks.append(time.perf_counter())
        meta = plan_step(plan, chunks, tables)
        marks.append(time.perf_counter())
        if bucket is not None:
            pad_decode(plan, meta, bucket)
        marks.append(time.perf_counter())
        scheduler.update(step, [0] * step.num_requests)
        marks.append(time.perf_counter())
        durations = [marks[1] - marks[0], marks[2] - marks[1], marks[4] - marks[3], marks[5] - marks[4],
                     marks[6] - marks[5], marks[7] - marks[6]]
        for part, seconds in zip(PARTS, durations):
            samples[part].append(seconds * 1e6)
    return {part: statistics.median(values) for part, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--cells", default="1x512,8x4096,64x4096", help="BxC,...")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None, help="append the table to this file")
    args = parser.parse_args()
    lines = ["| batch | context | " + " | ".join(PARTS) + " | step total (kept tables) |",
             "| ---: | ---: | " + " | ".join("---:" for _ in PARTS) + " | ---: |"]
    for cell in args.cells.split(","):
        batch, context = (int(n) for n in cell.split("x"))
        medians = time_cell(args.model, batch, context, args.repeats)
        total = sum(v for part, v in medians.items() if part != "plan_step (lists)")
        lines.append(f"| {batch} | {context} | " + " | ".join(f"{medians[p]:.1f}" for p in PARTS) + f" | {total:.1f} |")
        print(lines[-1], file=sys.stderr)
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as stream:
            stream.write(f"\n`{' '.join([Path(sys.executable).name, *sys.argv])}`\n\n{table}\n")


if __name__ == "__main__":
    main()
