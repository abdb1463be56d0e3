"""Prefill throughput: memplan vs HF transformers (eager SDPA), and memplan's GEMM rate vs the device's.

    python3 bench/prefill.py [--models qwen3-8b,qwen3.5-9b] [--prompts 512,4096,16384] [--out FILE]
    python3 bench/prefill.py --prefill-attention gemm,flash   # both long-chunk attention backends, side by side
    python3 bench/prefill.py --smoke     # tiny configs in the Numba CUDA simulator: proves the code paths, no GPU

One request per prompt length, random ids, random bf16 weights of the real shapes.

- memplan: the prompt in steps of the plan's max_prefill_tokens (one step when the prompt fits; the plan
  asks for max_prefill_tokens = the longest prompt), each ``model.step(plan_step(plan, [chunk]))``; the
  recurrent slot is reset between repeats. Time = the whole prefill, median of ``--repeats``.
- ``--prefill-attention``: the serving prefill_attention backend(s) of chunks of >= gemm_attention_min_tokens
  tokens: auto (the serving default, which plans flash where the kernel takes the model, else gemm), gemm
  (two batched GEMMs over a score tile) and/or flash (one FlashAttention launch over a step's long chunks; bf16 models with
  head_dim a multiple of 32, so not the float32 --smoke configs). One plan, arena and row set per backend,
  run one after the other in the same process; rows name the plan's backend.
- HF eager (SDPA): one forward of the prompt into a fresh DynamicCache, logits of the last row only (once
  per model and prompt, shown on every backend's row).
- GEMM rate: FLOPs of every GEMM of the prefill = 2 x tokens x (elements of every weight matrix but the
  embedding and lm_head) + 2 x (lm_head elements) per step (lm_head runs on each step's last row), over
  the memplan prefill time, compared with ``torch.matmul`` of two ``--matmul-size``^2 bf16 matrices
  measured in the same run. With the profiler (default on the GPU) also the share of GPU kernel time
  spent in GEMM kernels (cuBLAS/CUTLASS names) and the rate within those kernels.
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
from typing import TYPE_CHECKING, get_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    add_plan_arguments, bench_parser, build_hf, build_memplan, emit, fmt, free_device_memory, hf_dynamic_cache,
    hf_forward, int_list, kernel_breakdown, log, markdown_table, matmul_flops_per_s, median, open_bench_device,
    reset_slots, resolve_plan_arguments, run_info, sample_ms, sized_plan, str_list,
)
from planner.config import PrefillAttention  # noqa: E402

if TYPE_CHECKING:
    import torch

    from executor.device import Device
    from executor.models.decoder import DecoderModel
    from executor.step import RequestChunk
    from planner.plan import MemoryPlan

#: Substrings of GEMM kernel names (cuBLAS, cuBLASLt, CUTLASS; lower case). Everything else a step
#: launches is a Numba kernel (named from its module path, ``executor::kernels::...``, which may itself
#: contain "gemm": gemm_attention's gather) or a copy.
GEMM_KERNEL_MARKERS = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")
NUMBA_KERNEL_PREFIX = "executor::"


def is_gemm_kernel(name: str) -> bool:
    return not name.startswith(NUMBA_KERNEL_PREFIX) and any(m in name.lower() for m in GEMM_KERNEL_MARKERS)


@dataclass
class Cell:
    model: str
    prefill_attention: str  # the plan's serving prefill_attention backend
    prompt_tokens: int
    num_steps: int = 0
    gemm_flops: int = 0
    memplan_ms: float = math.nan
    memplan_samples_ms: list[float] = field(default_factory=list)  # every timed prefill, in order
    plan_step_ms: float = math.nan
    hf_ms: float = math.nan
    gemm_kernel_ms: float = math.nan
    softmax_kernel_ms: float = math.nan
    flash_kernel_ms: float = math.nan
    kernel_ms: float = math.nan
    notes: list[str] = field(default_factory=list)
    kernel_breakdown: str = ""  # the profiled prefill's top kernels (--top-kernels)


def prefill_gemm_flops(plan: MemoryPlan, prompt_tokens: int, num_steps: int) -> int:
    """FLOPs of the GEMMs of a prefill, from the planned weight shapes: every 2-D weight but the embedding
    (a lookup) and lm_head for every token, lm_head for one row per step (each step samples its last row)."""
    weights = plan.pool("weights")
    head_name = "model.embed_tokens.weight" if plan.model.tie_word_embeddings else "lm_head.weight"
    per_token = sum(math.prod(b.shape) for b in weights.buffers
                    if len(b.shape) == 2 and b.name not in ("model.embed_tokens.weight", "lm_head.weight"))
    return 2 * prompt_tokens * per_token + 2 * num_steps * math.prod(weights.buffer(head_name).shape)


def prefill_chunks(plan: MemoryPlan, prompt_ids: list[int]) -> list[RequestChunk]:
    """The prompt in chunks of max_prefill_tokens, one request on pages 1 .. pages_per_request, slot 0."""
    from executor.step import RequestChunk

    chunk = plan.capacity.max_prefill_tokens
    pages = list(range(1, 1 + plan.capacity.pages_per_request))
    slot = 0 if plan.geometry.num_linear_layers else -1
    return [RequestChunk(prompt_ids[start:start + chunk], start, pages, slot=slot)
            for start in range(0, len(prompt_ids), chunk)]


def run_prefill(model: DecoderModel, chunks: list[RequestChunk]) -> None:
    from executor.step import plan_step

    for chunk in chunks:
        model.step(plan_step(model.arena.plan, [chunk]))


def kernel_times_ms(model: DecoderModel, chunks: list[RequestChunk],
                    top_kernels: int) -> tuple[float, float, float, float, str]:
    """(GEMM kernel ms, causal-softmax kernel ms, FlashAttention kernel ms, all kernel ms, the ``top_kernels``
    breakdown) of one prefill under torch.profiler (CUPTI sees the Numba kernels too). The GEMMs include GEMM
    attention's two per tile, not only the weights'."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    reset_slots(model, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_prefill(model, chunks)
        torch.cuda.synchronize()
    gemm_us = softmax_us = flash_us = total_us = 0.0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        duration_us = event.time_range.elapsed_us()
        total_us += duration_us
        if is_gemm_kernel(event.name):
            gemm_us += duration_us
        elif "causal_softmax" in event.name:
            softmax_us += duration_us
        elif "flash_attention" in event.name:
            flash_us += duration_us
    breakdown = kernel_breakdown(prof.events(), top_kernels) if top_kernels > 0 else ""
    return gemm_us / 1e3, softmax_us / 1e3, flash_us / 1e3, total_us / 1e3, breakdown


def run_memplan(plan: MemoryPlan, cells: list[Cell], args: argparse.Namespace, device: Device) -> None:
    import numpy as np

    from executor.step import plan_step

    arena, model = build_memplan(plan, device, args.seed)
    rng = np.random.default_rng(args.seed)
    for cell in cells:
        try:
            chunks = prefill_chunks(plan, rng.integers(0, plan.model.vocab_size, cell.prompt_tokens).tolist())
            cell.num_steps = len(chunks)
            cell.gemm_flops = prefill_gemm_flops(plan, cell.prompt_tokens, cell.num_steps)
            reset_slots(model, 1)
            samples = sample_ms(lambda: run_prefill(model, chunks), device.torch_device, warmup=args.warmup,
                                repeats=args.repeats, between=lambda: reset_slots(model, 1))
            cell.memplan_ms, cell.memplan_samples_ms = median(samples), samples
            host_ms = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for chunk in chunks:
                    plan_step(plan, [chunk])
                host_ms.append((time.perf_counter() - start) * 1e3)
            cell.plan_step_ms = median(host_ms)
            if args.profile and not device.is_sim:
                (cell.gemm_kernel_ms, cell.softmax_kernel_ms, cell.flash_kernel_ms,
                 cell.kernel_ms, cell.kernel_breakdown) = kernel_times_ms(model, chunks, args.top_kernels)
        except Exception as error:
            cell.notes.append(f"memplan error: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            traceback.print_exc()
        log(f"{cell.model} ({cell.prefill_attention}) prompt {cell.prompt_tokens}: memplan "
            f"{fmt(cell.memplan_ms, 2)} ms in {cell.num_steps} step(s)")
    del arena, model
    free_device_memory(device.torch_device)


def run_hf(plan: MemoryPlan, cells: list[Cell], args: argparse.Namespace, device: torch.device) -> None:
    import torch

    hf = build_hf(plan, device, args.seed)
    with torch.no_grad():
        for cell in cells:
            token_ids = torch.randint(0, plan.model.vocab_size, (1, cell.prompt_tokens), device=device)
            try:
                samples = sample_ms(lambda: hf_forward(hf, token_ids, hf_dynamic_cache(hf)), device,
                                    warmup=args.hf_warmup, repeats=args.hf_repeats)
                cell.hf_ms = median(samples)
            except Exception as error:
                cell.notes.append(f"HF error: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                traceback.print_exc()
            free_device_memory(device)
            log(f"{cell.model} prompt {cell.prompt_tokens}: HF eager {fmt(cell.hf_ms, 2)} ms")
    del hf
    free_device_memory(device)


def prefill_plan(model_name: str, prefill_attention: str, args: argparse.Namespace) -> MemoryPlan:
    """One request of the longest prompt; max_prefill_tokens = that prompt (one step) unless given; long
    chunks' attention in the ``prefill_attention`` backend."""
    longest = max(args.prompts)
    overrides = {"max_batch": 1, "max_context": longest, "max_prefill_tokens": args.max_prefill_tokens or longest,
                 "prefill_attention": prefill_attention}
    return sized_plan(model_name, args.hardware, args.serving, overrides, num_requests=1,
                      utilization=args.gpu_memory_utilization)


def table(cells: list[Cell], matmul_flops_per_s: float) -> str:
    headers = ["model", "prefill attention", "prompt tokens", "memplan steps", "memplan ms", "memplan tok/s",
               "plan_step ms (host)", "HF eager ms", "HF tok/s", "HF / memplan", "GEMM TFLOP",
               "GEMM TFLOP/s over the prefill", "share of matmul peak", "GEMM kernel ms", "GEMM share of prefill time",
               "GEMM share of kernel time", "kernel time / prefill time", "TFLOP/s inside GEMM kernels",
               "softmax kernel ms", "flash kernel ms"]
    rows = []
    for c in cells:
        rate = c.gemm_flops / (c.memplan_ms * 1e-3)
        rows.append([
            c.model, c.prefill_attention, str(c.prompt_tokens), str(c.num_steps), fmt(c.memplan_ms, 2),
            fmt(c.prompt_tokens / c.memplan_ms * 1e3, 0), fmt(c.plan_step_ms, 2), fmt(c.hf_ms, 2),
            fmt(c.prompt_tokens / c.hf_ms * 1e3, 0), fmt(c.hf_ms / c.memplan_ms, 2), fmt(c.gemm_flops / 1e12, 2),
            fmt(rate / 1e12, 1), fmt(rate / matmul_flops_per_s, 2), fmt(c.gemm_kernel_ms, 2),
            fmt(c.gemm_kernel_ms / c.memplan_ms, 2), fmt(c.gemm_kernel_ms / c.kernel_ms, 2),
            fmt(c.kernel_ms / c.memplan_ms, 2), fmt(c.gemm_flops / (c.gemm_kernel_ms * 1e-3) / 1e12, 1),
            fmt(c.softmax_kernel_ms, 2), fmt(c.flash_kernel_ms, 2),
        ])
    return markdown_table(headers, rows, [False, False] + [True] * (len(headers) - 2))


def notes(cells: list[Cell], plans: dict[tuple[str, str], MemoryPlan], matmul_rate: float,
          args: argparse.Namespace) -> str:
    lines = [f"{args.matmul_dtype} matmul peak: {matmul_rate / 1e12:,.0f} TFLOP/s (`torch.matmul` of two "
             f"{args.matmul_size}^2 matrices, median)."]
    for (name, _), plan in plans.items():
        lines.append(f"{name} ({plan.capacity.prefill_attention}): plan max_prefill_tokens "
                     f"{plan.capacity.max_prefill_tokens}, max_context "
                     f"{plan.capacity.max_context}, gpu_memory_utilization {plan.serving.gpu_memory_utilization}, "
                     f"prefill pool {plan.pool('prefill').bytes / 2**20:,.1f} MiB; {_long_chunks(plan)}")
    if not args.profile:
        lines.append("Profiler off: no kernel-time columns.")
    lines += [f"{c.model} ({c.prefill_attention}) prompt {c.prompt_tokens}: memplan's timed prefills in order, ms: "
              + ", ".join(f"{ms:,.2f}" for ms in c.memplan_samples_ms) for c in cells if len(c.memplan_samples_ms) > 1]
    lines += [f"{c.model} ({c.prefill_attention}) prompt {c.prompt_tokens}: {note}" for c in cells for note in c.notes]
    return "\n".join(f"- {line}" for line in lines)


def _long_chunks(plan: MemoryPlan) -> str:
    """What the plan does with chunks of >= gemm_attention_min_tokens tokens."""
    threshold = f"chunks of >= {plan.serving.gemm_attention_min_tokens} tokens"
    if not plan.capacity.prefill_gather_tokens:
        return f"no {threshold} fit a step: every chunk runs the paged kernel."
    if plan.capacity.prefill_attention == "flash":
        return f"{threshold} run FlashAttention, one launch over a step's long chunks, no score scratch."
    return (f"{threshold} run attention as GEMMs over {plan.capacity.prefill_score_elements:,} planned score "
            "elements per tile.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--prompts", type=int_list, default=None, help="prompt lengths; default 512,4096,16384")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="the plan's prefill chunk; default the longest prompt (one step)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hf-warmup", type=int, default=1)
    parser.add_argument("--hf-repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the torch.profiler run")
    parser.add_argument("--top-kernels", type=int, default=0,
                        help="with the profiler: also each prompt's N longest-running kernels (default 0: none)")
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--prefill-attention", type=str_list, default=["auto"],
                        help="comma-separated serving prefill_attention backends to run side by side: auto, gemm, "
                             "flash (default auto, the serving default: flash where the kernel takes the model)")
    add_plan_arguments(parser, "default: the smallest that holds the longest prompt",
                       "tiny configs in the simulator, prompts 8,24 in chunks of 16, HF on CPU")
    args = parser.parse_args(argv)
    choices = ("auto", *get_args(PrefillAttention))
    unknown = sorted(set(args.prefill_attention) - set(choices))
    if unknown or not args.prefill_attention:
        parser.error(f"--prefill-attention {','.join(args.prefill_attention)}: each must be one of {', '.join(choices)}")
    resolve_plan_arguments(args)
    if args.smoke:
        args.prompts = args.prompts or [8, 24]
        args.max_prefill_tokens = args.max_prefill_tokens or 16  # 24 tokens: two steps, the chunked path
        args.warmup, args.repeats, args.hf_warmup, args.hf_repeats = 0, 1, 0, 1
        args.matmul_size = min(args.matmul_size, 256)
    args.prompts = args.prompts or [512, 4096, 16384]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = open_bench_device(args.smoke)
    info = run_info(device.torch_device)
    log(f"prefill benchmark on {info.device_name}")
    from planner.loader import load_model

    args.matmul_dtype = load_model(args.models[0]).dtype  # the weights' dtype (bf16 for the real models)
    matmul_rate = matmul_flops_per_s(device.torch_device, args.matmul_size, args.matmul_dtype)
    log(f"{args.matmul_dtype} matmul {args.matmul_size}^3: {matmul_rate / 1e12:,.1f} TFLOP/s")
    all_cells, plans = [], {}
    for model_name in args.models:
        by_backend = {}
        for backend in args.prefill_attention:
            plan = plans[(model_name, backend)] = prefill_plan(model_name, backend, args)
            # The plan's backend: "auto" resolved (flash or gemm).
            cells = by_backend[backend] = [Cell(plan.model.name, plan.capacity.prefill_attention, n)
                                           for n in sorted(args.prompts)]
            run_memplan(plan, cells, args, device)
            all_cells += cells
        if not args.no_hf:  # once per model: the same HF forward is every backend's reference
            first, *others = by_backend.values()
            run_hf(plan, first, args, device.torch_device)
            for cells in others:
                for cell, measured in zip(cells, first):
                    cell.hf_ms = measured.hf_ms
    body = table(all_cells, matmul_rate) + "\n\n" + notes(all_cells, plans, matmul_rate, args)
    for cell in all_cells:
        if cell.kernel_breakdown:
            body += (f"\n\n### {cell.model} ({cell.prefill_attention}), prompt {cell.prompt_tokens:,}: the "
                     f"{args.top_kernels} longest-running kernels\n\n{cell.kernel_breakdown}")
    emit("Prefill throughput and GEMM rate (bench/prefill.py)", info, body, args.out)


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    main()
