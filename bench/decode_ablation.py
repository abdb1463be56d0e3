"""What each kernel family costs inside a decode CUDA graph: the graph captured again without it.

    python3 bench/decode_ablation.py [--model qwen3-8b] [--batch 1] [--context 512] [--rounds 40] [--out FILE]

GPU only. bench/profile_decode.py gives each kernel's own time; this script gives what the step
would save without the kernel, gaps and overlap included. Random weights in a plan sized to the
cell, one decode step's metadata written once, then one graph of the step's bucket per
configuration: all kernels, then each family left out (its launcher patched to do nothing while
that graph is captured; the step's outputs are then wrong, its timing is what is measured). The
graphs replay in turn, ``--rounds`` times each, between CUDA events; the table gives medians and
what leaving the family out saves, per step and per layer.

Two chains of empty kernels (one block of 384 threads, then 4 x SMs blocks of 128) replayed as
graphs of one launch a layer-kernel give the floor: what a launch costs in a graph when the kernel
does nothing.

A measurement tool: no configuration but the first is a decode step that produces tokens. Where
the decode attention kernel does the q/k norm + RoPE + KV write itself (attention/decode_rope.py:
Qwen3's heads), the first family has no launch to leave out; the decode attention path's row covers
both. (docs/benchmarks.md's "Decode ablation" table was measured on the two-launch path.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/x.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    build_memplan, decode_chunks, emit, fmt, interleaved_replay_us, launch_graph, markdown_table, open_bench_device,
    reset_slots, run_info, sized_plan,
)

#: (family, module, class, method): the launcher each configuration leaves out.
FAMILIES = (
    ("q/k norm + RoPE + KV write (its own launch)", "executor.kernels.rope.fused_kv_write", "QkNormRopeWriteKv", "__call__"),
    ("split merge", "executor.kernels.attention.merge", "SplitMerge", "__call__"),
    ("decode attention path (q/k norm + RoPE + KV write, attention, merge)", "executor.kernels.attention.decode_rope",
     "DecodeRopeAttention", "__call__"),
    ("qkv GEMV (+ RMSNorm)", "executor.kernels.gemv", "Gemv", "norm_project"),
    ("o_proj and down GEMVs (+ residual)", "executor.kernels.gemv", "Gemv", "project_add"),
    ("gate_up GEMV (+ SwiGLU)", "executor.kernels.gemv", "Gemv", "norm_swiglu"),
    ("sampler", "executor.kernels.sampling.sampler", "Sample", "__call__"),
)
EMPTY_CHAINS = ((1, 384), (4, 128))  # (blocks: 1 or that many per SM, threads)
#: Launches a Qwen3 decode layer makes at batch 1 with fused GEMVs: qkv, attention (with the q/k norm +
#: RoPE + KV write), merge, o_proj, gate_up, down.
LAYER_LAUNCHES = 6


def left_out(target: tuple[str, str, str], capture: Callable[[], Any]) -> Any:
    """``capture()`` with the target launcher replaced by a no-op, restored afterwards."""
    import importlib

    module, cls_name, method = target
    cls = getattr(importlib.import_module(module), cls_name)
    original = getattr(cls, method)
    setattr(cls, method, lambda *args, **kwargs: None)
    try:
        return capture()
    finally:
        setattr(cls, method, original)


def build_empty_kernel() -> tuple[Any, Any]:
    """A kernel that does nothing, and the argument it takes (keep both alive while a graph of it replays)."""
    import torch

    from executor.numba_cuda import load_cuda

    cuda = load_cuda()

    @cuda.jit
    def empty(flag):
        if cuda.threadIdx.x > 4096:  # never: the kernel must take an argument and store nothing
            flag[0] = 1

    return empty, torch.zeros(1, dtype=torch.int32, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per request")
    parser.add_argument("--rounds", type=int, default=40, help="replays of each graph (median)")
    parser.add_argument("--out", help="append the result section to this markdown file")
    args = parser.parse_args()
    from executor.device import DeviceError

    try:
        device = open_bench_device(False)  # before numba.cuda loads
    except DeviceError as error:
        sys.exit(f"{error} (this benchmark needs a GPU: it replays CUDA graphs)")
    import torch

    from executor.models.graphs import DecodeGraphs
    from executor.page_tables import PageTables
    from executor.step import pad_decode, plan_step

    plan = sized_plan(args.model, "h200", "default", {"max_batch": args.batch, "max_context": args.context + 1},
                      num_requests=args.batch)
    arena, model = build_memplan(plan, device, 0)
    arena.tensor("kv_cache", "kv_cache").zero_()
    reset_slots(model, args.batch)
    chunks = decode_chunks(plan, args.batch, args.context, [1] * args.batch)
    graphs = DecodeGraphs(arena, model.writer, model._forward, plan.serving.decode_graph_batch_sizes)
    bucket = graphs.bucket_for(args.batch)
    if bucket is None:
        sys.exit(f"batch {args.batch} has no decode graph bucket in {plan.serving.decode_graph_batch_sizes}")
    meta = pad_decode(plan, plan_step(plan, chunks, PageTables()), bucket)

    def capture() -> Any:
        one = DecodeGraphs(arena, model.writer, model._forward, [bucket])
        one.capture()
        model.writer.write(meta)  # capture wrote all-padding steps
        return one.graphs[bucket]

    layers = plan.geometry.num_layers
    configs: dict[str, Any] = {"all kernels": capture()}
    for family, *target in FAMILIES:
        configs[f"without {family}"] = left_out(tuple(target), capture)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    empty, flag = build_empty_kernel()
    for blocks, threads in EMPTY_CHAINS:
        grid = blocks if blocks == 1 else blocks * num_sms
        launches = LAYER_LAUNCHES * layers
        configs[f"{launches} empty kernels, {grid} x {threads} threads"] = launch_graph(
            lambda stream, grid=grid, threads=threads: empty[grid, threads, stream](flag), launches)

    samples = interleaved_replay_us(configs, args.rounds)
    base_us = statistics.median(samples["all kernels"])
    rows = []
    for name, values in samples.items():
        us = statistics.median(values)
        saved = base_us - us if name.startswith(("all", "without")) else None
        rows.append([name, fmt(us, 1), fmt(saved, 1), fmt(saved / layers if saved is not None else None, 2)])
    body = markdown_table(["graph", "replay us", "saved us", "saved us a layer"], rows, [False, True, True, True])
    emit(f"Decode graph ablation: {args.model}, {args.batch} x {args.context} (bucket {bucket})",
         run_info(torch.device("cuda")), body, args.out)


if __name__ == "__main__":
    main()
