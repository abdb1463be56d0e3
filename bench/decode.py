"""Decode time per output token (TPOT): memplan vs HF transformers vs the memory roofline.

    python3 bench/decode.py [--models qwen3-8b,qwen3.5-9b] [--batches 1,8,32,64] [--contexts 512,4096]
                            [--hf-compile-batches 1,32] [--hf-compile-contexts 512] [--no-hf-compile] [--out FILE]
    python3 bench/decode.py --smoke     # tiny configs in the Numba CUDA simulator: proves the code paths, no GPU

Random bf16 weights of the real shapes. A cell (batch B, context C) is one decode step of B requests, each
with C tokens already cached and one new token:

- memplan: ``model.step(plan_step(plan, chunks, page_tables))`` (host metadata included, page tables
  kept across steps as the engine keeps them), after ``capture_decode_graphs()`` when the executor has
  it; median of ``--repeats`` steps after ``--warmup``, each step waited for before the next: the
  engine step by step (``--no-overlap``).
- memplan overlapped: the engine's default loop without its scheduler. Step i + 1 is launched (its
  metadata planned, written and its graph replayed, each row fed the id step i sampled for it on
  the device, the engine's ``ReadBack`` started) before step i's ids are waited for and read; the
  median time per step over the same counts. The scheduler's own host time, hidden the same way,
  is not in it (bench/host_step.py measures it).
  Request r uses KV pages 1 + r * pages_per_request ... and recurrent slot r (reset once per cell); the
  KV pool is zeroed once (a zero numerator in the attention meet: the meet and the merge multiply by
  the reciprocal of the weight sum, so no division's slow path runs on it).
- HF eager (SDPA): one forward of B new tokens over a DynamicCache holding C tokens per request, the cache
  cropped back to C after every timed step. Filled once per cell by a chunked prefill.
- HF compiled: StaticCache + ``torch.compile(mode="reduce-overhead")``; positions advance one per step
  (C .. C + steps), the StaticCache spans them all. Only ``--hf-compile-batches`` x ``--hf-compile-contexts``
  (compiling costs about a minute of GPU time per shape).
- roofline: the bytes a decode step must move, from the plan's buffers: every weight (lm_head in full,
  the embedding only its B rows), the KV of B x (C + 1) tokens of the full-attention layers (C read, the
  new one written) and, for Qwen3.5, every request's recurrent state (ssm_state f32 + conv_state) read
  and written; divided by the copy bandwidth measured in the same run (``dst.copy_(src)``).

The plan is sized to the benchmark (max_batch = largest batch, max_context = largest context + 1, the
smallest gpu_memory_utilization whose KV pool holds every request), and freed before HF's model is built.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    add_plan_arguments, bench_parser, build_hf, build_memplan, capture_decode_graphs, copy_bandwidth_bytes_per_s,
    decode_chunks, emit, fmt, free_device_memory, graph_used, hf_crop, hf_dynamic_cache, hf_forward, hf_prefill,
    int_list, kv_token_bytes, log, markdown_table, median, open_bench_device, recurrent_slot_bytes, reset_slots,
    resolve_plan_arguments, run_info, sample_ms, sized_plan, synchronize,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from executor.device import Device
    from executor.models.decoder import DecoderModel
    from planner.plan import MemoryPlan

GIB = 1 << 30


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must move (the roofline's numerator)."""

    weights: int
    kv: int
    recurrent: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.recurrent


@dataclass
class Cell:
    model: str
    batch: int
    context: int
    step_bytes: StepBytes
    graph: str = "no"
    memplan_ms: float = math.nan
    overlapped_ms: float = math.nan
    plan_step_ms: float = math.nan
    hf_eager_ms: float = math.nan
    hf_compiled_ms: float = math.nan
    notes: list[str] = field(default_factory=list)


def decode_step_bytes(plan: MemoryPlan, batch: int, context: int) -> StepBytes:
    """The roofline bytes of a decode step of ``batch`` requests over ``context`` cached tokens each,
    from the planned buffers. The embedding is read only at the B looked-up rows; a tied lm_head reads
    the whole matrix anyway, so then every weight byte counts once."""
    weights = plan.pool("weights")
    weight_bytes = sum(buffer.bytes for buffer in weights.buffers)
    if not plan.model.tie_word_embeddings:
        embed = weights.buffer("model.embed_tokens.weight")
        weight_bytes += batch * (embed.bytes // embed.shape[0]) - embed.bytes
    kv_bytes = batch * (context + 1) * kv_token_bytes(plan)
    recurrent_bytes = 2 * batch * recurrent_slot_bytes(plan)  # read, then written back
    return StepBytes(weight_bytes, kv_bytes, recurrent_bytes)


# -- memplan --------------------------------------------------------------------------------------------------------


def time_memplan(model: DecoderModel, cell: Cell, args: argparse.Namespace, rng: np.random.Generator) -> None:
    """memplan's TPOT (the whole step: host metadata, copy-in, forward, sampling) and plan_step's host share."""
    from executor.page_tables import PageTables
    from executor.step import plan_step

    plan = model.arena.plan
    chunks = decode_chunks(plan, cell.batch, cell.context, rng.integers(0, plan.model.vocab_size, cell.batch))
    page_tables = PageTables()
    reset_slots(model, cell.batch)
    samples = sample_ms(lambda: model.step(plan_step(plan, chunks, page_tables)), model.device.torch_device,
                        warmup=args.warmup, repeats=args.repeats)
    cell.memplan_ms = median(samples)
    cell.overlapped_ms = median(overlapped_ms(model, chunks, page_tables, args.warmup, args.repeats))
    host_ms = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan_step(plan, chunks, page_tables)
        host_ms.append((time.perf_counter() - start) * 1e3)
    cell.plan_step_ms = median(host_ms)


def overlapped_ms(model: DecoderModel, chunks: list, page_tables: Any, warmup: int, repeats: int) -> list[float]:
    """Wall time per step, in ms, of decode steps launched one ahead of their read-back, as the engine's
    overlapped loop runs them: each iteration launches step i + 1 (fed step i's ids on the device:
    token -(r + 1) for row r) and then waits for step i's ids."""
    from dataclasses import replace

    from executor.engine import ReadBack
    from executor.step import plan_step

    plan = model.arena.plan
    fed = [replace(chunk, token_ids=[-(row + 1)]) for row, chunk in enumerate(chunks)]
    read_back = ReadBack(model, len(chunks))
    synchronize(model.device.torch_device)
    buffer = read_back.start(model.step(plan_step(plan, chunks, page_tables)), 0)
    samples = []
    for index in range(1, warmup + repeats + 1):
        start = time.perf_counter()
        launched = read_back.start(model.step(plan_step(plan, fed, page_tables)), index)
        read_back.wait(buffer, len(chunks))
        buffer = launched
        if index > warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    read_back.wait(buffer, len(chunks))
    return samples


def run_memplan(plan: MemoryPlan, cells: list[Cell], args: argparse.Namespace, device: Device) -> None:
    import numpy as np

    model_name = plan.model.name
    log(f"{model_name}: plan at gpu_memory_utilization {plan.serving.gpu_memory_utilization}, "
        f"{plan.capacity.kv_pages} KV pages, arena {sum(p.bytes for p in plan.pools if p.materialized) / GIB:.1f} GiB")
    arena, model = build_memplan(plan, device, args.seed)
    # materialize poisons the pool with NaN; zeros keep the cells' attention and sampling on finite numbers
    arena.tensor("kv_cache", "kv_cache").zero_()
    graphs = capture_decode_graphs(model)
    log(f"{model_name}: memplan built; decode graphs: {graphs}")
    rng = np.random.default_rng(args.seed)
    for cell in cells:
        cell.graph = graph_used(model, cell.batch)
        try:
            time_memplan(model, cell, args, rng)
        except Exception as error:
            cell.notes.append(f"memplan error: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            traceback.print_exc()
        log(f"{model_name} B={cell.batch} C={cell.context}: memplan {fmt(cell.memplan_ms, 3)} ms "
            f"(graph {cell.graph})")
    del arena, model
    free_device_memory(device.torch_device)


def benchmark_plan(model_name: str, args: argparse.Namespace, max_batch: int, max_context: int) -> MemoryPlan:
    """The plan every decode cell of a model runs in (memory.py measures the same plan)."""
    overrides = {"max_batch": max_batch, "max_context": max_context + 1}
    gemv_batch = getattr(args, "decode_gemv_max_batch", None)  # bench/memory.py's arguments have none
    if gemv_batch is not None:
        overrides["decode_gemv_max_batch"] = gemv_batch
    return sized_plan(model_name, args.hardware, args.serving, overrides, num_requests=max_batch,
                      utilization=args.gpu_memory_utilization)


# -- Hugging Face ---------------------------------------------------------------------------------------------------


def time_hf_eager(hf: torch.nn.Module, cell: Cell, args: argparse.Namespace, plan: MemoryPlan,
                  device: torch.device) -> None:
    import torch

    vocab = plan.model.vocab_size
    cache = hf_dynamic_cache(hf)
    hf_prefill(hf, cache, cell.batch, cell.context, args.hf_prefill_rows, vocab, device)
    token_ids = torch.randint(0, vocab, (cell.batch, 1), device=device)
    samples = sample_ms(lambda: hf_forward(hf, token_ids, cache), device, warmup=args.hf_warmup,
                        repeats=args.hf_repeats, between=lambda: hf_crop(cache, cell.context))
    cell.hf_eager_ms = median(samples)
    if cache.get_seq_length() != cell.context:  # the crop must hold the context fixed, or the cell lies
        raise RuntimeError(f"HF cache holds {cache.get_seq_length()} tokens after cropping, expected {cell.context}")
    del cache


def time_hf_compiled(hf: torch.nn.Module, cell: Cell, args: argparse.Namespace, plan: MemoryPlan,
                     device: torch.device) -> None:
    """StaticCache + torch.compile(mode="reduce-overhead") (CUDA graphs), as generate() runs a compiled model.
    dynamic=False: one specialised graph per batch, no dynamic-shape guards."""
    import torch
    from transformers import StaticCache

    vocab = plan.model.vocab_size
    steps = args.hf_compile_warmup + args.hf_repeats
    cache = StaticCache(config=hf.config, max_cache_len=cell.context + steps)
    hf_prefill(hf, cache, cell.batch, cell.context, args.hf_prefill_rows, vocab, device)
    if device.type == "cuda":
        compiled = torch.compile(hf, mode="reduce-overhead", dynamic=False)
    else:  # --smoke on CPU: dynamo traces the same StaticCache forward, without inductor or CUDA graphs
        compiled = torch.compile(hf, backend="eager", dynamic=False)
    token_ids = torch.randint(0, vocab, (cell.batch, 1), device=device)

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten
        hf_forward(hf, token_ids, cache, call=compiled)

    start = time.perf_counter()
    try:
        samples = sample_ms(step, device, warmup=args.hf_compile_warmup, repeats=args.hf_repeats)
    finally:
        del compiled, cache
        torch._dynamo.reset()  # drop the graphs and their memory pools before the next shape (or after a failure)
    cell.hf_compiled_ms = median(samples)
    cell.notes.append(f"HF compile + warm-up {time.perf_counter() - start - sum(samples) / 1e3:.0f} s")


def run_hf(plan: MemoryPlan, cells: list[Cell], args: argparse.Namespace, device: torch.device) -> None:
    import torch

    start = time.perf_counter()
    hf = build_hf(plan, device, args.seed)
    log(f"{plan.model.name}: HF model built in {time.perf_counter() - start:.1f} s "
        f"(attn_implementation {hf.config._attn_implementation})")
    compile_shapes = set() if args.no_hf_compile else {
        (b, c) for b in args.hf_compile_batches for c in args.hf_compile_contexts}
    with torch.no_grad():
        for cell in cells:
            compiled = (cell.batch, cell.context) in compile_shapes
            for label, timer, wanted in (("HF eager", time_hf_eager, True),
                                         ("HF compiled", time_hf_compiled, compiled)):
                if not wanted:
                    continue
                try:
                    timer(hf, cell, args, plan, device)
                except Exception as error:  # e.g. out of memory, or a compile failure: report it in the cell
                    cell.notes.append(f"{label} error: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                    traceback.print_exc()
                free_device_memory(device)
            log(f"{plan.model.name} B={cell.batch} C={cell.context}: HF eager {fmt(cell.hf_eager_ms, 3)} ms, "
                f"compiled {fmt(cell.hf_compiled_ms, 3)} ms")
    del hf
    free_device_memory(device)


# -- report ---------------------------------------------------------------------------------------------------------


def table(cells: list[Cell], bandwidth_bytes_per_s: float) -> str:
    headers = ["model", "batch", "context", "graph", "memplan ms", "memplan tok/s", "plan_step ms (host)",
               "memplan overlapped ms", "step GB", "roofline ms", "memplan / roofline", "overlapped / roofline",
               "HF eager ms", "HF eager / memplan", "HF compiled ms", "HF compiled / memplan"]
    rows = []
    for c in cells:
        roofline_ms = c.step_bytes.total / bandwidth_bytes_per_s * 1e3
        rows.append([
            c.model, str(c.batch), str(c.context), c.graph, fmt(c.memplan_ms, 3),
            fmt(c.batch / c.memplan_ms * 1e3, 0), fmt(c.plan_step_ms, 3), fmt(c.overlapped_ms, 3),
            fmt(c.step_bytes.total / 1e9, 2), fmt(roofline_ms, 3), fmt(c.memplan_ms / roofline_ms, 2),
            fmt(c.overlapped_ms / roofline_ms, 2), fmt(c.hf_eager_ms, 3),
            fmt(c.hf_eager_ms / c.memplan_ms, 2), fmt(c.hf_compiled_ms, 3), fmt(c.hf_compiled_ms / c.memplan_ms, 2),
        ])
    numeric = [False, True, True, False] + [True] * (len(headers) - 4)
    return markdown_table(headers, rows, numeric)


def notes(cells: list[Cell], plans: dict[str, MemoryPlan], bandwidth_bytes_per_s: float, copy_bytes: int,
          simulated: bool) -> str:
    lines = [f"Copy bandwidth (roofline denominator): {bandwidth_bytes_per_s / 1e9:,.0f} GB/s "
             f"(`dst.copy_(src)` of {copy_bytes / GIB:g} GiB bf16, read + write bytes over the median time)."]
    for name, plan in plans.items():
        kinds = "weights (embedding: B rows) + KV of B x (C + 1) tokens"
        if plan.geometry.num_linear_layers:
            kinds += " + recurrent state read and written"
        lines.append(f"{name}: plan max_batch {plan.capacity.max_batch}, max_context {plan.capacity.max_context}, "
                     f"gpu_memory_utilization {plan.serving.gpu_memory_utilization}, "
                     f"{plan.capacity.kv_pages} KV pages, fused GEMV projections at batch <= "
                     f"{plan.capacity.decode_gemv_batch}; step bytes = {kinds}; KV {kv_token_bytes(plan):,} B/token, recurrent "
                     f"{recurrent_slot_bytes(plan):,} B/request.")
    if simulated:
        lines.append("Simulator run: the HF compiled cells ran dynamo with the eager backend on the CPU.")
    for c in cells:
        for note in c.notes:
            lines.append(f"{c.model} B={c.batch} C={c.context}: {note}")
    return "\n".join(f"- {line}" for line in lines)


# -- main -----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int_list, default=None, help="default 1,8,32,64")
    parser.add_argument("--contexts", type=int_list, default=None, help="cached tokens per request; default 512,4096")
    parser.add_argument("--hf-compile-batches", type=int_list, default=[1, 32],
                        help="compiled HF cells, among --batches (default 1,32)")
    parser.add_argument("--hf-compile-contexts", type=int_list, default=[512],
                        help="compiled HF cells, among --contexts (default 512)")
    parser.add_argument("--no-hf-compile", action="store_true", help="skip the torch.compile cells")
    parser.add_argument("--no-hf", action="store_true", help="memplan and the roofline only")
    parser.add_argument("--warmup", type=int, default=5, help="memplan steps before timing")
    parser.add_argument("--repeats", type=int, default=20, help="memplan timed steps (median)")
    parser.add_argument("--hf-warmup", type=int, default=3)
    parser.add_argument("--hf-repeats", type=int, default=10)
    parser.add_argument("--hf-compile-warmup", type=int, default=5, help="includes the compiling calls")
    parser.add_argument("--hf-prefill-rows", type=int, default=16384,
                        help="token rows per HF forward while filling a cache")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of each buffer of the bandwidth copy")
    parser.add_argument("--decode-gemv-max-batch", type=int, default=None,
                        help="serving decode_gemv_max_batch (default: the serving config's; 0: cuBLAS at every batch)")
    add_plan_arguments(parser, "default: the smallest that holds max batch x max context",
                       "tiny configs (tiny-qwen3, tiny-qwen3.5) in the simulator, B 1,2, C 8, HF on CPU "
                       "(the compiled cell B 1 C 8 with dynamo's eager backend)")
    args = parser.parse_args(argv)
    resolve_plan_arguments(args)
    if args.smoke:
        args.batches, args.contexts = args.batches or [1, 2], args.contexts or [8]
        args.hf_compile_batches, args.hf_compile_contexts = [1], [8]  # on CPU: dynamo with the eager backend
        args.hf_compile_warmup = 2
        args.hf_prefill_rows = 4  # several HF prefill forwards per cache: the chunked path
        args.warmup, args.repeats, args.hf_warmup, args.hf_repeats = 1, 2, 1, 2
        args.copy_gib = min(args.copy_gib, 1 / 64)
    args.batches, args.contexts = args.batches or [1, 8, 32, 64], args.contexts or [512, 4096]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = open_bench_device(args.smoke)  # before numba.cuda loads: the simulator is chosen here
    torch_device = device.torch_device
    info = run_info(torch_device)
    log(f"decode benchmark on {info.device_name}")
    copy_bytes = int(args.copy_gib * GIB)
    bandwidth = copy_bandwidth_bytes_per_s(torch_device, copy_bytes)
    log(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s")
    all_cells, plans = [], {}
    for model_name in args.models:
        from planner.loader import load_model

        plan = benchmark_plan(model_name, args, max(args.batches), max(args.contexts))
        cells = [Cell(load_model(model_name).name, b, c, decode_step_bytes(plan, b, c))
                 for c in sorted(args.contexts) for b in sorted(args.batches)]
        plans[model_name] = plan
        run_memplan(plan, cells, args, device)
        if not args.no_hf:
            run_hf(plan, cells, args, torch_device)
        all_cells += cells
    body = table(all_cells, bandwidth) + "\n\n" + notes(all_cells, plans, bandwidth, copy_bytes, device.is_sim)
    emit("Decode TPOT vs HF transformers and the roofline (bench/decode.py)", info, body, args.out)


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")  # small-batch launches warn on every step
    main()
