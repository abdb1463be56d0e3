"""Planned vs measured device memory for the decode benchmark's plans (no HF).

    python3 bench/memory.py [--models qwen3-8b,qwen3.5-9b] [--batches 1,8,32,64] [--contexts 512,4096] [--out FILE]
    python3 bench/memory.py --smoke     # tiny configs in the Numba CUDA simulator: planned lines only

Each model runs in a fresh child process (this script with ``--child MODEL``), so the CUDA context,
module loads and allocator start from nothing. The child, in order:

1. creates the CUDA context with a one-element tensor, then reads the device (``context``);
2. materializes the plan of bench/decode.py (``materialize``), fills random weights (``weights``);
3. warms up: one prefill step, then one decode step per (batch, context) cell (``warm-up``: every
   module the steps use is loaded now);
4. captures the decode CUDA graphs (``graphs``), then the prefill graphs' pieces (``prefill graphs``);
5. counts allocations over ``--steps`` more steps (decode cells in turn, then one prefill step):
   ``torch.cuda.memory_stats()["allocation.all.allocated"]`` after minus before.

At each checkpoint: ``torch.cuda.memory_allocated``, ``memory_reserved`` and the device's used bytes
(``mem_get_info`` total - free: this process plus anything else on the GPU). Measured lines:

- pools: each pool's allocation (arena), and the allocator growth over materialize for their sum;
- cuda_context: device used - reserved at ``context``;
- module_images: growth of (device used - reserved) from ``context`` to ``warm-up``: memory outside
  the caching allocator that the first steps brought (kernel images: cuBLAS, torch, Numba);
- gemm_workspace: allocator growth (allocated) from ``weights`` to ``warm-up``: cuBLAS workspaces and
  anything else the steps allocated;
- cuda_graphs: device used growth over the decode capture (graph memory pools and the driver's graph state);
- prefill_graphs: device used growth over the pieces' capture, the same way;
- safety_margin: reserved - allocated after the captures (the allocator slack the margin absorbs);
- total: device used after the captures vs the plan's non-KV + KV bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    add_plan_arguments, bench_parser, capture_decode_graphs, decode_chunks, emit, int_list, log, markdown_table,
    open_bench_device, reset_slots, resolve_plan_arguments, run_info,
)

if TYPE_CHECKING:
    import numpy as np

    from executor.device import Device
    from executor.models.decoder import DecoderModel
    from planner.plan import MemoryPlan

#: Marks the child's result line on its stdout.
RESULT_MARKER = "MEMPLAN_MEMORY_RESULT "
CHECKPOINTS = ("context", "materialize", "weights", "warm-up", "graphs", "prefill graphs")


# -- the child: one model, one fresh process ------------------------------------------------------------------------


def snapshot(device: Device) -> dict[str, int] | None:
    """Allocator and device view now; None in the simulator."""
    if device.is_sim:
        return None
    import torch

    torch.cuda.synchronize()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "used": total_bytes - free_bytes, "total": total_bytes}


def allocation_count(device: Device) -> int | None:
    if device.is_sim:
        return None
    import torch

    return torch.cuda.memory_stats()["allocation.all.allocated"]


def prefill_step(model: DecoderModel, rng: np.random.Generator) -> None:
    """One prefill chunk of request 0 (the largest the plan takes within max_context)."""
    from executor.step import RequestChunk, plan_step

    plan = model.arena.plan
    tokens = min(plan.capacity.max_prefill_tokens, plan.capacity.max_context)
    pages = list(range(1, 1 + plan.capacity.pages_per_request))
    reset_slots(model, 1)
    chunk = RequestChunk(rng.integers(0, plan.model.vocab_size, tokens).tolist(), 0, pages,
                         slot=0 if plan.geometry.num_linear_layers else -1)
    model.step(plan_step(plan, [chunk]))


def decode_step(model: DecoderModel, batch: int, context: int, rng: np.random.Generator) -> None:
    from executor.step import plan_step

    plan = model.arena.plan
    reset_slots(model, batch)
    model.step(plan_step(plan, decode_chunks(plan, batch, context, rng.integers(0, plan.model.vocab_size, batch))))


def measure(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything the parent prints for one model (JSON-serialisable)."""
    device = open_bench_device(args.smoke)  # first: the simulator must be chosen before numba.cuda loads
    import numpy as np

    from bench.decode import benchmark_plan
    from executor.arena import materialize
    from executor.models import build_model
    from executor.weights import fill_random

    snaps: dict[str, dict[str, int] | None] = {}
    if not device.is_sim:
        import torch

        torch.zeros(1, device=device.torch_device)  # the context, and nothing else of ours
    snaps["context"] = snapshot(device)
    plan = benchmark_plan(model_name, args, max(args.batches), max(args.contexts))
    arena = materialize(plan, device)
    snaps["materialize"] = snapshot(device)
    fill_random(arena, args.seed)
    snaps["weights"] = snapshot(device)
    model = build_model(arena)
    rng = np.random.default_rng(args.seed)
    cells = [(b, c) for c in sorted(args.contexts) for b in sorted(args.batches)]
    log(f"{model_name}: warm-up (1 prefill + {len(cells)} decode steps)")
    prefill_step(model, rng)
    for batch, context in cells:
        decode_step(model, batch, context, rng)
    snaps["warm-up"] = snapshot(device)
    graphs = capture_decode_graphs(model)
    snaps["graphs"] = snapshot(device)
    if not device.is_sim:
        model.capture_prefill_graphs()
    snaps["prefill graphs"] = snapshot(device)
    log(f"{model_name}: graphs {graphs}; counting allocations over {args.steps} steps")
    before, snap_before = allocation_count(device), snaps["prefill graphs"]
    for index in range(args.steps - 1):
        decode_step(model, *cells[index % len(cells)], rng)
    prefill_step(model, rng)
    after, snap_after = allocation_count(device), snapshot(device)
    return {
        "model": plan.model.name,
        "graphs": graphs,
        "utilization": plan.serving.gpu_memory_utilization,
        "rows": budget_rows(plan, {name: raw.numel() for name, raw in arena.pools.items()}, snaps),
        "checkpoints": [[name, snaps[name]] for name in CHECKPOINTS],
        "allocations": None if before is None else after - before,
        "used_change": None if snap_before is None else snap_after["used"] - snap_before["used"],
        "steps": args.steps,
    }


def budget_rows(plan: MemoryPlan, pool_bytes: dict[str, int], snaps: dict[str, dict[str, int] | None]) -> list[list]:
    """[line, planned bytes, measured bytes or None, how measured] for every budget line."""
    from executor.run_report import materialized_bytes

    def delta(later: str, earlier: str, key: str) -> int | None:
        a, b = snaps[later], snaps[earlier]
        return None if a is None or b is None else a[key] - b[key]

    def outside_allocator(name: str) -> int | None:
        snap = snaps[name]
        return None if snap is None else snap["used"] - snap["reserved"]

    rows: list[list] = []
    for pool in plan.pools:
        if pool.materialized:
            rows.append([pool.name, pool.bytes, pool_bytes.get(pool.name), "the pool's allocation"])
    rows.append(["arena (all pools)", materialized_bytes(plan), delta("materialize", "context", "allocated"),
                 "memory_allocated growth over materialize"])
    rows.append(["weights load", 0, delta("weights", "materialize", "allocated"),
                 "memory_allocated growth while filling weights"])
    context, warm, graphs = outside_allocator("context"), outside_allocator("warm-up"), snaps["prefill graphs"]
    graph_reserved = fmt_bytes(delta("graphs", "warm-up", "reserved"))
    piece_reserved = fmt_bytes(delta("prefill graphs", "graphs", "reserved"))
    measured = {
        "cuda_context": (context, "device used - reserved after a 1-element tensor"),
        "module_images": (None if context is None or warm is None else warm - context,
                          "growth of device used - reserved over the warm-up steps"),
        "gemm_workspace": (delta("warm-up", "weights", "allocated"), "memory_allocated growth over the warm-up steps"),
        "cuda_graphs": (delta("graphs", "warm-up", "used"),
                        f"device used growth over the capture (reserved {graph_reserved})"),
        "prefill_graphs": (delta("prefill graphs", "graphs", "used"),
                           f"device used growth over the pieces' capture (reserved {piece_reserved})"),
        "safety_margin": (None if graphs is None else graphs["reserved"] - graphs["allocated"],
                          "allocator slack: reserved - allocated after the captures"),
    }
    for line in plan.pool("runtime").buffers:
        value, how = measured.get(line.name, (None, "not measured"))
        rows.append([line.name, line.bytes, value, how])
    planned_total = plan.budget.non_kv_bytes + plan.budget.kv_bytes
    total = None if snaps["prefill graphs"] is None else snaps["prefill graphs"]["used"]
    rows.append(["total", planned_total, total, "device used (total - free) after the captures vs non-KV + KV"])
    return rows


def fmt_bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value:+,} B"


# -- the parent: one child per model, then the tables ---------------------------------------------------------------


def run_child(model_name: str, argv: list[str]) -> dict[str, Any]:
    """Run this script for one model in a fresh process; its stderr passes through."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", model_name]
    log(f"{model_name}: child process {' '.join(command[1:])}")
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise SystemExit(f"{model_name}: the child exited with {done.returncode} and no result")


def ratio(measured: int | None, planned: int) -> str:
    if measured is None or planned == 0:
        return "n/a"
    return f"{measured / planned:.3f}"


def report(results: list[dict[str, Any]]) -> str:
    parts = []
    for result in results:
        rows = [[name, f"{planned:,}", "n/a" if measured is None else f"{measured:,}", ratio(measured, planned), how]
                for name, planned, measured, how in result["rows"]]
        parts.append(f"### {result['model']} (gpu_memory_utilization {result['utilization']}, "
                     f"decode graphs: {result['graphs']})\n")
        parts.append(markdown_table(["line", "planned bytes", "measured bytes", "measured / planned", "how measured"],
                                    rows, [False, True, True, True, False]))
        checkpoints = [[name, *(("n/a",) * 3 if snap is None else
                                (f"{snap['allocated']:,}", f"{snap['reserved']:,}", f"{snap['used']:,}"))]
                       for name, snap in result["checkpoints"]]
        headers = ["after", "memory_allocated", "memory_reserved", "device used (total - free)"]
        parts.append("\n" + markdown_table(headers, checkpoints, [False, True, True, True]))
        allocations = "n/a (simulator)" if result["allocations"] is None else str(result["allocations"])
        used = "n/a" if result["used_change"] is None else f"{result['used_change']:+,} B"
        parts.append(f"\nAllocations over {result['steps']} steps after warm-up and capture "
                     f"(`allocation.all.allocated` delta): {allocations}; device used changed by {used}.\n")
    return "\n".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int_list, default=None, help="as bench/decode.py; default 1,8,32,64")
    parser.add_argument("--contexts", type=int_list, default=None, help="as bench/decode.py; default 512,4096")
    parser.add_argument("--steps", type=int, default=20, help="steps counted for allocations after warm-up")
    add_plan_arguments(parser, "default: as bench/decode.py, the smallest that holds max batch x max context",
                       "tiny configs in the simulator (measured lines n/a)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    resolve_plan_arguments(args)
    if args.smoke:
        args.batches, args.contexts = args.batches or [1, 2], args.contexts or [8]
        args.steps = min(args.steps, 2)
    args.batches, args.contexts = args.batches or [1, 8, 32, 64], args.contexts or [512, 4096]
    return args


def child_argv(args: argparse.Namespace) -> list[str]:
    """The flags a child needs to build the same plan and steps."""
    argv = ["--batches", ",".join(map(str, args.batches)), "--contexts", ",".join(map(str, args.contexts)),
            "--steps", str(args.steps), "--hardware", args.hardware, "--serving", args.serving,
            "--seed", str(args.seed)]
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return argv + (["--smoke"] if args.smoke else [])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(RESULT_MARKER + json.dumps(measure(args.child, args)), flush=True)
        return
    results = [run_child(model, child_argv(args)) for model in args.models]
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    emit("Planned vs measured memory (bench/memory.py)", run_info(device), report(results), args.out)


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    main()
