"""Tensor parallelism: decode TPOT and prefill throughput at TP 1, 2, 4 beside each rank's planned memory.

    python3 bench/tensor_parallel.py [--models qwen3-32b] [--tps 1,2,4] [--batches 1,8,32] [--contexts 4096]
                                     [--out docs/benchmarks.md]
    python3 bench/tensor_parallel.py --smoke    # tiny-qwen3 at TP 1, 2 in the Numba CUDA simulator on gloo

Random bf16 weights of the real shapes. Each TP runs in its own process (``--only-tp``, started by this
script), which is rank 0 of a ``ServedModel`` (executor/serving.py: it spawns ranks 1 .. TP - 1, one GPU
each, NCCL with NVLink multicast off), materializes the per-rank plan, warms up and captures the decode
graphs as ``memplan run`` does, then drives rank 0's model step by step (every rank runs each step):

- prefill: for each context C, ``max(--batches)`` requests of C tokens each, prefilled one chunk of at
  most ``max_prefill_tokens`` a step; tokens / wall time of all those steps (each waited for), which
  fills the KV pages and recurrent slots the decode cells then read;
- decode: a step of B requests, each with C tokens cached and one new token (request r on its own
  pages and slot r); median of ``--repeats`` steps after ``--warmup``, each step waited for before the
  next (the engine's ``--no-overlap`` loop), graph replay where a bucket holds B;
- memory: each rank's planned bytes (the per-rank plan: weights, KV cache, the arena, the usable budget)
  and what it measured after the cells: its arena, torch's reserved bytes, the device's bytes in use
  (cudaMemGetInfo: its CUDA context and NCCL's communicator buffers included, against the plan's usable
  bytes, whose runtime lines declare them) and its allocations during the cells (0 expected: nothing
  allocates after warm-up on any rank).

The table gives each TP's TPOT against TP 1's in the same run (the issue's target: TP 2 at batch 1
<= 0.6x TP 1). The plan of every TP holds max(--batches) requests of max(--contexts) + 1 tokens at
``--gpu-memory-utilization`` (default: the smallest that does; the same KV requirement at every TP).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    add_plan_arguments, bench_parser, decode_chunks, emit, fmt, int_list, log, markdown_table, median, reset_slots,
    run_info, sample_ms, sized_plan, synchronize,
)

GIB = 1 << 30
#: The line prefix of an --only-tp process's result on stdout.
RESULT = "TP-RESULT "
#: The models the issue names (Qwen3-32B decode at TP 2 and 4 against TP 1).
DEFAULT_MODELS = ["qwen3-32b"]
SMOKE_MODELS = ["tiny-qwen3"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--tps", type=int_list, default=None, help="tensor-parallel sizes (default 1,2,4, as many as "
                        "the GPUs allow)")
    parser.add_argument("--batches", type=int_list, default=None, help="decode batches (default 1,8,32)")
    parser.add_argument("--contexts", type=int_list, default=None, help="cached tokens per request (default 4096)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only-tp", type=int, default=None, help=argparse.SUPPRESS)  # one TP's process
    add_plan_arguments(parser, "default: the smallest that holds max batch x max context at every TP",
                       "tiny-qwen3 at TP 1, 2 in the simulator, B 1,2, C 8")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models = args.models or SMOKE_MODELS
        args.tps, args.batches, args.contexts = args.tps or [1, 2], args.batches or [1, 2], args.contexts or [8]
        args.warmup, args.repeats = 1, 2
    args.models = args.models or DEFAULT_MODELS
    args.hardware = args.hardware or ("cpu-sim" if args.smoke else "h200")
    args.serving = args.serving or ("sim" if args.smoke else "default")
    args.tps, args.batches, args.contexts = args.tps or [1, 2, 4], args.batches or [1, 8, 32], args.contexts or [4096]
    return args


def benchmark_plan(model_name: str, tp: int, args: argparse.Namespace):
    overrides = {"max_batch": max(args.batches), "max_context": max(args.contexts) + 1, "tensor_parallel_size": tp}
    return sized_plan(model_name, args.hardware, args.serving, overrides, num_requests=max(args.batches),
                      utilization=args.gpu_memory_utilization)


def prefill(model: Any, plan: Any, batch: int, context: int, rng: Any) -> float:
    """Prefill ``batch`` requests of ``context`` tokens (request r: its pages, slot r), one chunk of at most
    max_prefill_tokens a step, each step waited for; returns tokens per second."""
    from executor.page_tables import PageTables
    from executor.step import RequestChunk, plan_step

    device = model.device.torch_device
    per_request, chunk = plan.capacity.pages_per_request, plan.serving.max_prefill_tokens
    recurrent = plan.geometry.num_linear_layers > 0
    page_tables = PageTables()
    reset_slots(model, batch)
    synchronize(device)
    start = time.perf_counter()
    for r in range(batch):
        ids = rng.integers(0, plan.model.vocab_size, context).tolist()
        pages = list(range(1 + r * per_request, 1 + (r + 1) * per_request))
        for first in range(0, context, chunk):
            piece = ids[first:first + chunk]
            step = plan_step(plan, [RequestChunk(piece, first, pages, slot=r if recurrent else -1,
                                                 page_table_key=r)], page_tables)
            model.step(step).tolist()  # waits for the step
    return batch * context / (time.perf_counter() - start)


def decode_ms(model: Any, plan: Any, batch: int, context: int, args: argparse.Namespace, rng: Any) -> float:
    from executor.page_tables import PageTables
    from executor.step import plan_step

    chunks = decode_chunks(plan, batch, context, rng.integers(0, plan.model.vocab_size, batch))
    page_tables = PageTables()
    return median(sample_ms(lambda: model.step(plan_step(plan, chunks, page_tables)), model.device.torch_device,
                            warmup=args.warmup, repeats=args.repeats))


def memory(served: Any) -> list[Any]:
    """Every rank's RankMemory now."""
    from executor.workers import RankMemory

    return served.ranks.measure(served.model) if served.ranks is not None else [RankMemory.of(served.model)]


def run_one_tp(args: argparse.Namespace) -> None:
    """This process is rank 0 of one TP: the cells of every model, one result line per model on stdout."""
    import numpy as np

    from executor.serving import RANDOM_WEIGHTS, ServedModel

    tp = args.only_tp
    for model_name in args.models:
        plan = benchmark_plan(model_name, tp, args)
        log(f"{model_name} TP {tp}: per-rank arena "
            f"{sum(p.bytes for p in plan.pools if p.materialized) / GIB:.2f} GiB, {plan.capacity.kv_pages} KV pages")
        served = ServedModel.open(plan, "sim" if args.smoke else "cuda", weights=RANDOM_WEIGHTS, seed=args.seed)
        try:
            rng = np.random.default_rng(args.seed)
            before = memory(served)
            cells = []
            for context in sorted(args.contexts):
                tokens_per_s = prefill(served.model, plan, max(args.batches), context, rng)
                log(f"{model_name} TP {tp} C={context}: prefill {tokens_per_s:,.0f} tokens/s")
                for batch in sorted(args.batches):
                    ms = decode_ms(served.model, plan, batch, context, args, rng)
                    log(f"{model_name} TP {tp} B={batch} C={context}: decode {ms:.3f} ms")
                    cells.append({"batch": batch, "context": context, "decode_ms": ms,
                                  "prefill_tokens_per_s": tokens_per_s})
            after = memory(served)
        finally:
            served.close()
        weights = plan.pool("weights").bytes
        kv = plan.pool("kv_cache").bytes
        planned = sum(p.bytes for p in plan.pools if p.materialized)
        result = {"model": plan.model.name, "tp": tp, "cells": cells,
                  "utilization": plan.serving.gpu_memory_utilization, "weights_bytes": weights, "kv_bytes": kv,
                  "planned_bytes": planned,
                  "usable_bytes": plan.budget.usable_bytes,
                  "ranks": [{"rank": a.rank, "allocated": a.allocated_bytes, "reserved": a.reserved_bytes,
                             "device_used": a.device_used_bytes,
                             "allocations": (None if a.allocations is None or b.allocations is None
                                             else a.allocations - b.allocations)} for b, a in zip(before, after)]}
        print(RESULT + json.dumps(result), flush=True)


def run_tp_process(tp: int, argv: list[str]) -> list[dict]:
    """One TP's results, from its own process (its ranks, communicators and arena end with it)."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--only-tp", str(tp)]
    log(f"TP {tp}: {' '.join(command[1:])}")
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    results = [json.loads(line[len(RESULT):]) for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0:
        log(f"TP {tp}: exited with code {done.returncode}; {len(results)} model(s) finished")
    return results


def table(results: list[dict]) -> str:
    base = {(r["model"], c["batch"], c["context"]): c["decode_ms"] for r in results if r["tp"] == 1 for c in r["cells"]}
    headers = ["model", "TP", "batch", "context", "decode ms", "x TP 1", "tok/s", "prefill tok/s"]
    rows = []
    for result in results:
        for cell in result["cells"]:
            one = base.get((result["model"], cell["batch"], cell["context"]))
            rows.append([result["model"], str(result["tp"]), str(cell["batch"]), f"{cell['context']:,}",
                         fmt(cell["decode_ms"], 3), fmt(cell["decode_ms"] / one if one else None, 2),
                         fmt(cell["batch"] / cell["decode_ms"] * 1e3, 0), fmt(cell["prefill_tokens_per_s"], 0)])
    return markdown_table(headers, rows, [False, True, True, True, True, True, True, True])


def _size(value: int | None) -> str:
    """Bytes in GiB, or MiB below one GiB (the tiny configs of --smoke)."""
    if value is None:
        return "n/a"
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / (1 << 20):.2f} MiB"


def memory_table(results: list[dict]) -> str:
    headers = ["model", "TP", "utilization", "weights / rank", "KV cache / rank", "planned arena / rank",
               "plan usable / rank", "rank: allocated arena, allocator reserved, device in use, allocations during "
               "the cells"]
    rows = []
    for result in results:
        measured = "; ".join(f"{rank['rank']}: {_size(rank['allocated'])}, {_size(rank['reserved'])}, "
                             f"{_size(rank['device_used'])}, "
                             f"{'n/a' if rank['allocations'] is None else rank['allocations']}"
                             for rank in result["ranks"])
        rows.append([result["model"], str(result["tp"]), f"{result['utilization']:.2f}",
                     _size(result["weights_bytes"]), _size(result["kv_bytes"]), _size(result["planned_bytes"]),
                     _size(result["usable_bytes"]), measured])
    return markdown_table(headers, rows, [False, True, True, True, True, True, True, False])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.only_tp is not None:
        os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
        if args.smoke:
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        run_one_tp(args)
        return
    import torch

    gpus = 0 if args.smoke else torch.cuda.device_count()
    tps = [tp for tp in args.tps if args.smoke or tp <= gpus]
    if len(tps) < len(args.tps):
        log(f"{gpus} GPU(s): TP {', '.join(str(tp) for tp in args.tps if tp not in tps)} left out")
    results = [result for tp in tps for result in run_tp_process(tp, argv)]
    if args.smoke:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    info = run_info(torch.device("cpu") if args.smoke else torch.device("cuda", 0))
    body = (table(results) + "\n\n" + memory_table(results) + "\n\nDecode steps are waited for one by one (no "
            "overlap); x TP 1 is the decode time over TP 1's at the same batch and context in this run. Memory is "
            "per rank: every rank materializes the same per-rank plan.")
    emit("Tensor-parallel decode and prefill (bench/tensor_parallel.py)", info, body, args.out)


if __name__ == "__main__":
    main()
