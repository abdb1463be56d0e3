"""One serving-shaped prefill step, its decode rows on the step's stream or on a side stream.

    python3 bench/mixed_step.py [--models qwen3-8b,qwen3.5-9b] [--chunks 8] [--chunk-tokens 1024]
        [--decode-rows 248] [--context 1100] [--repeats 10] [--hardware h200] [--out FILE]

The steady state of bench/serve.py's fixed workload at batch 256 and 8,192 prefill tokens: a step of
``--chunks`` fresh prompts of ``--chunk-tokens`` tokens beside ``--decode-rows`` decode rows of
``--context`` cached tokens (the decode rows first, as the scheduler orders them). Random weights; the
prefill graph pieces captured as the engine serves them. Each round times, between CUDA events and in
turn: the chunks alone, the decode rows alone (eager), and the mixed step with its decode rows on each
of the routes of executor/models/decode_rows_stream.py (the step's own stream; a side stream of high
priority; a side stream of normal priority). The table gives medians over ``--repeats`` rounds and each
route's saving against the step's own stream; routing.DECODE_ROWS_SIDE_STREAM is chosen from it.

``--smoke`` runs the tiny models in the Numba CUDA simulator, where there is one stream: it checks the
script, not the routes.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/x.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    add_plan_arguments, bench_parser, build_memplan, emit, fmt, free_device_memory, log, markdown_table,
    open_bench_device, resolve_plan_arguments, run_info, sized_plan,
)

MIXED_ROUTES = ("step stream", "side stream, high priority", "side stream, normal priority")


def step_chunks(plan: Any, chunks: int, chunk_tokens: int, decode_rows: int, context: int) -> dict[str, list]:
    """The RequestChunks of each timed step: the decode rows (request r on pages 1 + r x pages_per_request ..
    and recurrent slot r), the fresh chunks (the requests after them), and both, decode rows first."""
    from executor.step import RequestChunk

    per_request = plan.capacity.pages_per_request
    recurrent = plan.geometry.num_linear_layers > 0

    def pages(r: int) -> list[int]:
        return list(range(1 + r * per_request, 1 + (r + 1) * per_request))

    decode = [RequestChunk([1 + r % 1000], context, pages(r), slot=r if recurrent else -1)
              for r in range(decode_rows)]
    prefill = [RequestChunk([1 + (t * 7919) % 1000 for t in range(chunk_tokens)], 0, pages(r),
                            slot=r if recurrent else -1)
               for r in range(decode_rows, decode_rows + chunks)]
    return {"chunks alone": prefill, "decode rows alone": decode, "mixed": decode + prefill}


def time_model(model_name: str, args: Any, device: Any) -> tuple[list[list[str]], str]:
    """The table rows of one model and a note on its plan."""
    import torch

    from executor.models.decode_rows_stream import SideStream, StepStream
    from executor.step import plan_step

    requests = args.decode_rows + args.chunks
    overrides = {"max_batch": requests, "max_context": max(args.context + 1, args.chunk_tokens),
                 "max_prefill_tokens": args.chunks * args.chunk_tokens}
    plan = sized_plan(model_name, args.hardware, args.serving, overrides, num_requests=requests,
                      utilization=args.gpu_memory_utilization)
    arena, model = build_memplan(plan, device, args.seed)
    graphs = "no (simulator)"
    if not device.is_sim and plan.capacity.prefill_graph_rows:
        model.capture_prefill_graphs()
        graphs = f"rows {','.join(map(str, plan.capacity.prefill_graph_rows))}"
    steps = {name: plan_step(plan, chunks)
             for name, chunks in step_chunks(plan, args.chunks, args.chunk_tokens, args.decode_rows,
                                             args.context).items()}
    routes: dict[str, Any] = {MIXED_ROUTES[0]: StepStream()}
    if not device.is_sim:
        routes[MIXED_ROUTES[1]] = SideStream(device, high_priority=True)
        routes[MIXED_ROUTES[2]] = SideStream(device, high_priority=False)
    runs = [("chunks alone", "chunks alone", None), ("decode rows alone", "decode rows alone", None)]
    runs += [(f"mixed, {route}", "mixed", stream) for route, stream in routes.items()]
    chunk_slots = range(args.decode_rows, requests) if plan.geometry.num_linear_layers else range(0)
    samples: dict[str, list[float]] = {label: [] for label, _, _ in runs}

    def run(step_name: str, stream: Any) -> None:
        if stream is not None:
            model.decode_rows_stream = stream
        model.step(steps[step_name])

    for round_index in range(args.warmup + args.repeats):
        for label, step_name, stream in runs:
            for slot in chunk_slots:  # fresh prompts: zero state, outside the timed span
                model.reset_slot(slot)
            if device.is_sim:
                run(step_name, stream)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(step_name, stream)
            end.record()
            end.synchronize()
            if round_index >= args.warmup:
                samples[label].append(start.elapsed_time(end))
    del arena, model
    free_device_memory(device.torch_device)
    if device.is_sim:
        return [[model_name, label, "-", "-"] for label, _, _ in runs], f"{model_name}: simulator, untimed"
    medians = {label: statistics.median(values) for label, values in samples.items()}
    baseline = medians[f"mixed, {MIXED_ROUTES[0]}"]
    rows = []
    for label, _, _ in runs:
        saved = fmt(baseline - medians[label], 2) if label.startswith("mixed") else "-"
        rows.append([model_name, label, fmt(medians[label], 2), saved])
    alone = medians["chunks alone"] + medians["decode rows alone"]
    note = (f"{model_name}: the two steps alone sum to {fmt(alone, 2)} ms; prefill graph pieces {graphs}; "
            f"{plan.capacity.kv_pages:,} KV pages")
    return rows, note


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    add_plan_arguments(parser, "default: the smallest share that holds the step's requests",
                       "tiny models in the Numba CUDA simulator (checks the script, times nothing)")
    parser.add_argument("--chunks", type=int, default=8, help="fresh prompts in the step (default 8)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="tokens of each prompt (default 1,024)")
    parser.add_argument("--decode-rows", type=int, default=248, help="decode rows beside them (default 248)")
    parser.add_argument("--context", type=int, default=1100, help="cached tokens of a decode row (default 1,100)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args(argv)
    if args.smoke:
        args.chunks, args.chunk_tokens, args.decode_rows, args.context = 2, 24, 3, 20
        args.repeats, args.warmup = 1, 0
    resolve_plan_arguments(args)
    device = open_bench_device(args.smoke)
    rows, notes = [], []
    for model_name in args.models:
        model_rows, note = time_model(model_name, args, device)
        rows += model_rows
        notes.append(note)
        log(note)
    body = markdown_table(["model", "step", "ms", "saved against the step stream, ms"], rows,
                          [False, False, True, True])
    body += "\n\n" + "\n".join(f"- {note}" for note in notes)
    title = (f"A step of {args.chunks} x {args.chunk_tokens:,} prefill tokens beside {args.decode_rows} decode rows "
             f"of {args.context:,} tokens")
    emit(title, run_info(device.torch_device), body, args.out)


if __name__ == "__main__":
    main()
