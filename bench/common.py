"""Shared pieces of the GPU benchmarks (decode.py, prefill.py, memory.py).

Nothing here imports torch, numba or the executor at module import: a script's
``--help`` works anywhere, and ``--smoke`` can enable the Numba CUDA simulator
(NUMBA_ENABLE_CUDASIM) before numba.cuda is first loaded.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/x.py` puts bench/ first; tests.hf_reference lives at the root
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    import torch

    from executor.arena import Arena
    from executor.device import Device
    from executor.models.decoder import DecoderModel
    from executor.step import RequestChunk
    from planner.plan import MemoryPlan

#: The real shapes and the tiny configs that stand in for them under --smoke.
DEFAULT_MODELS = ("qwen3-8b", "qwen3.5-9b")
SMOKE_MODELS = {"qwen3-8b": "tiny-qwen3", "qwen3.5-9b": "tiny-qwen3.5"}
GPU_HARDWARE, GPU_SERVING = "h200", "default"
SIM_HARDWARE, SIM_SERVING = "cpu-sim", "sim"
#: gpu_memory_utilization steps when a plan is sized to a benchmark (see sized_plan).
UTILIZATION_STEP = 0.01
#: Extra share of device memory over the smallest utilization that holds the benchmark's KV pages.
UTILIZATION_MARGIN = 0.01

_START_S = time.perf_counter()


def log(message: str) -> None:
    """A progress line on stderr, stamped with seconds since the script started."""
    print(f"[bench +{time.perf_counter() - _START_S:7.1f} s] {message}", file=sys.stderr, flush=True)


def int_list(text: str) -> list[int]:
    """argparse type: "1,8,32" -> [1, 8, 32]."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive ints, got {text!r}")
    return values


def optional_int_list(text: str) -> list[int | None]:
    """argparse type: "none,512" -> [None, 512] (none: the field unset, as its config leaves it)."""
    values = [None if part.strip().lower() == "none" else int(part) for part in text.split(",") if part.strip()]
    if not values or min((v for v in values if v is not None), default=1) < 1:
        raise ValueError(f"expected a comma-separated list of positive ints or none, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


# -- device -------------------------------------------------------------------------------------------------------


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser (its docstring as help) with ``--models``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    parser.add_argument("--models", type=str_list, default=None, help="comma-separated (default: qwen3-8b,qwen3.5-9b)")
    return parser


def add_plan_arguments(parser: argparse.ArgumentParser, utilization_help: str, smoke_help: str, *,
                       hardware_serving: bool = False) -> None:
    """The arguments every benchmark shares: configs, memory share, seed, --smoke and --out.

    hardware_serving: --serving defaults to the hardware's default_serving (what memplan run serves),
    not GPU_SERVING (the fixed sizes the kernel benchmarks are read at)."""
    parser.add_argument("--hardware", default=None, help=f"default {GPU_HARDWARE} ({SIM_HARDWARE} with --smoke)")
    gpu_serving = "the hardware's default_serving" if hardware_serving else GPU_SERVING
    parser.add_argument("--serving", default=None, help=f"default {gpu_serving} ({SIM_SERVING} with --smoke)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help=utilization_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--out", default=None, help="append the result as a markdown section to this file")


def resolve_plan_arguments(args: argparse.Namespace, *, hardware_serving: bool = False) -> None:
    """Fill the shared defaults after parsing: the models (tiny ones under --smoke), hardware, serving
    (hardware_serving: the hardware's default_serving, as add_plan_arguments says)."""
    if args.smoke:
        args.models = [SMOKE_MODELS.get(m, m) for m in (args.models or DEFAULT_MODELS)]
    args.models = args.models or list(DEFAULT_MODELS)
    args.hardware = args.hardware or (SIM_HARDWARE if args.smoke else GPU_HARDWARE)
    if args.serving is None and hardware_serving and not args.smoke:
        from planner.loader import load_hardware

        args.serving = load_hardware(args.hardware).default_serving
    args.serving = args.serving or (SIM_SERVING if args.smoke else GPU_SERVING)


def open_bench_device(smoke: bool) -> Device:
    """The GPU, or (``smoke``) the Numba CUDA simulator; must run before anything imports numba.cuda."""
    from executor.device import open_device

    return open_device("sim" if smoke else "cuda")


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
              between: Callable[[], Any] | None = None) -> list[float]:
    """Wall time of ``fn()`` in ms, device-synchronized before and after, ``repeats`` samples after
    ``warmup`` untimed calls. ``between()`` runs untimed after every call (e.g. to crop a cache back)."""
    samples = []
    for index in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if between is not None:
            between()
        if index >= warmup:
            samples.append(elapsed_ms)
    return samples


def event_median_us(fn: Callable[[], Any], repeats: int, calls_per_fn: int = 1) -> float:
    """Median GPU time of ``fn()`` between CUDA events on the current stream, in microseconds per
    call (``fn`` issues ``calls_per_fn`` calls); the caller warms ``fn`` up first."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls_per_fn)
    return statistics.median(samples)


def launch_graph(launch: Callable[[Any], Any], launches: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``launches`` calls of ``launch(stream)``, a Numba kernel launch on the Numba
    stream it is given; one call runs (and compiles) first, outside the graph."""
    import torch

    from executor.numba_cuda import load_cuda

    cuda = load_cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch(cuda.external_stream(stream.cuda_stream))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            capture_stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            for _ in range(launches):
                launch(capture_stream)
    return graph


def interleaved_replay_us(graphs: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each graph's replay times in microseconds between CUDA events, ``rounds`` of them, the graphs
    replayed in turn (so drift touches every one alike) after one untimed replay each."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3)
    return samples


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else math.nan


def copy_bandwidth_bytes_per_s(device: torch.device, buffer_bytes: int, *, warmup: int = 3,
                               repeats: int = 20) -> float:
    """Achievable DRAM bandwidth: ``dst.copy_(src)`` of two bf16 buffers of ``buffer_bytes`` each,
    (read + write bytes) over the median time. The decode roofline divides by this, not the datasheet."""
    import torch

    numel = buffer_bytes // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median(sample_ms(lambda: dst.copy_(src), device, warmup=warmup, repeats=repeats))
    moved_bytes = 2 * numel * 2
    del src, dst
    return moved_bytes / (ms * 1e-3)


def matmul_flops_per_s(device: torch.device, size: int, dtype_name: str, *, warmup: int = 3,
                       repeats: int = 20) -> float:
    """Achievable dense GEMM rate: ``torch.matmul`` of two size x size matrices, 2 size^3 / median time."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, dtype=dtype, device=device)
    ms = median(sample_ms(lambda: torch.matmul(a, b, out=out), device, warmup=warmup, repeats=repeats))
    del a, b, out
    return 2 * size**3 / (ms * 1e-3)


def sustained_matmul_flops_per_s(device: torch.device, size: int, dtype_name: str, seconds: float, *,
                                 calls_per_sync: int = 10) -> float:
    """The dense GEMM rate the device holds: ``torch.matmul`` of two size x size matrices back to back for
    ``seconds``, 2 size^3 over the mean time of the calls in the second half.

    A GPU at its power limit lowers its clocks within a fraction of a second of sustained GEMMs (an H100 SXM
    at 700 W: 1,980 MHz falls to about 1,350), so the short median of ``matmul_flops_per_s`` measures a
    burst rate that a workload of seconds of GEMMs does not get. Calls are queued ``calls_per_sync`` at a
    time, so the device never idles between them.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, dtype=dtype, device=device)
    synchronize(device)
    start = time.perf_counter()
    batches: list[tuple[float, float]] = []  # (end, seconds) of each batch of calls
    while not batches or batches[-1][0] - start < seconds:
        begin = time.perf_counter()
        for _ in range(calls_per_sync):
            torch.matmul(a, b, out=out)
        synchronize(device)
        end = time.perf_counter()
        batches.append((end, end - begin))
    del a, b, out
    second_half = [elapsed for end, elapsed in batches if end - start >= seconds / 2] or [batches[-1][1]]
    return 2 * size**3 * calls_per_sync * len(second_half) / sum(second_half)


def free_device_memory(device: torch.device) -> None:
    """Return freed blocks to the device, so the next model starts from an empty allocator."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# -- plans and memplan models -----------------------------------------------------------------------------------


def sized_plan(model_name: str, hardware_name: str, serving_name: str, overrides: dict[str, Any],
               num_requests: int, utilization: float | None = None) -> MemoryPlan:
    """A plan whose KV pool holds ``num_requests`` requests of ``max_context`` tokens each.

    With ``utilization`` None it is the smallest gpu_memory_utilization (in steps of 0.01, plus a
    0.01 margin) that does, so HF's model and caches fit beside the arena in the same process. The
    non-KV bytes and the page size come from a probe plan at utilization 1.0 (neither depends on it).
    """
    from planner.layout import ALIGNMENT_BYTES
    from planner.loader import load_hardware, load_model, load_serving
    from planner.plan import build_plan

    model, hardware = load_model(model_name), load_hardware(hardware_name)
    probe = build_plan(model, hardware, load_serving(serving_name, {**overrides, "gpu_memory_utilization": 1.0}))
    pages_needed = max(1 + num_requests * probe.capacity.pages_per_request, probe.serving.min_kv_pages)
    if utilization is None:
        page_bytes = kv_token_bytes(probe) * probe.capacity.page_size
        needed_bytes = probe.budget.non_kv_bytes + pages_needed * page_bytes + ALIGNMENT_BYTES
        steps = math.ceil(needed_bytes / hardware.device_memory_bytes / UTILIZATION_STEP)
        utilization = min(1.0, round(steps * UTILIZATION_STEP + UTILIZATION_MARGIN, 4))
    plan = build_plan(model, hardware, load_serving(serving_name, {**overrides, "gpu_memory_utilization": utilization}))
    if plan.capacity.kv_pages < pages_needed:
        raise SystemExit(f"{model_name}: gpu_memory_utilization {utilization} gives {plan.capacity.kv_pages} KV pages; "
                         f"the benchmark needs {pages_needed}")
    return plan


def kv_token_bytes(plan: MemoryPlan) -> int:
    """KV bytes one token takes over all full-attention layers (K and V), from the planned pool:
    ``kv_cache [pages, full layers, 2, S, Hkv, D]``."""
    kv = plan.pool("kv_cache").buffer("kv_cache")
    return kv.bytes // (kv.shape[0] * kv.shape[3])


def recurrent_slot_bytes(plan: MemoryPlan) -> int:
    """Recurrent-state bytes one request's slot holds (ssm_state f32 + conv_state, every linear layer);
    0 for a model without linear layers. Both buffers are [linear layers, slots, ...]."""
    if not plan.geometry.num_linear_layers:
        return 0
    pool = plan.pool("recurrent_state")
    return sum(pool.buffer(name).bytes // pool.buffer(name).shape[1] for name in ("ssm_state", "conv_state"))


def build_memplan(plan: MemoryPlan, device: Device, seed: int) -> tuple[Arena, DecoderModel]:
    """Materialize ``plan``, fill random weights of its shapes, and wire the model."""
    from executor.arena import materialize
    from executor.models import build_model
    from executor.weights import fill_random

    arena = materialize(plan, device)
    fill_random(arena, seed)
    return arena, build_model(arena)


def capture_decode_graphs(model: DecoderModel) -> str:
    """Capture the decode CUDA graphs (not in the simulator); says what happened."""
    if model.device.is_sim:
        return "no (simulator)"
    start = time.perf_counter()
    try:
        model.capture_decode_graphs()
    except Exception as error:  # report, then measure the eager path
        log(f"capture_decode_graphs failed: {type(error).__name__}: {error}")
        return f"no (capture failed: {type(error).__name__})"
    buckets = ",".join(str(b) for b in model.arena.plan.serving.decode_graph_batch_sizes)
    return f"yes (buckets {buckets}, captured in {time.perf_counter() - start:.1f} s)"


def graph_used(model: DecoderModel, batch: int) -> str:
    """Whether a decode step of ``batch`` requests replays a captured graph, and which bucket."""
    bucket = model.graphs.bucket_for(batch) if model.graphs is not None else None
    return "no" if bucket is None else f"yes ({bucket})"


def decode_chunks(plan: MemoryPlan, batch: int, context: int, token_ids: Sequence[int]) -> list[RequestChunk]:
    """One decode token per request over ``context`` cached tokens. Request r owns pages
    1 + r * pages_per_request ... (page 0 is padding) and, for Qwen3.5, recurrent slot r; its page
    table key is r (plan_step's PageTables, as the engine keys its requests).
    The KV contents stay whatever the pages hold: timing does not depend on them."""
    from executor.step import RequestChunk

    per_request = plan.capacity.pages_per_request
    recurrent = plan.geometry.num_linear_layers > 0
    return [RequestChunk([int(token_ids[r])], context, list(range(1 + r * per_request, 1 + (r + 1) * per_request)),
                         slot=r if recurrent else -1, page_table_key=r)
            for r in range(batch)]


def reset_slots(model: DecoderModel, count: int) -> None:
    for slot in range(count if model.arena.plan.geometry.num_linear_layers else 0):
        model.reset_slot(slot)


# -- Hugging Face reference ---------------------------------------------------------------------------------------


def build_hf(plan: MemoryPlan, device: torch.device, seed: int) -> torch.nn.Module:
    """A randomly initialised HF causal LM of the plan's model, built straight in the plan's weight
    dtype on ``device`` (building in float32 and casting would need 1.5x the memory) with SDPA attention."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    from tests.hf_reference import hf_config

    config = hf_config(plan.model)
    config._attn_implementation = "sdpa"
    cls = Qwen3ForCausalLM if plan.model.architecture == "qwen3" else Qwen3_5ForCausalLM
    dtype = getattr(torch, plan.dtypes.weights)
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return module.eval()


def hf_cache_kwarg(hf: torch.nn.Module) -> str:
    """The forward's cache argument: ``past_key_values`` (transformers <= 5.2x), ``cache`` in later 5.x."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def hf_forward(hf: torch.nn.Module, token_ids: torch.Tensor, cache: Any,
               call: Callable[..., Any] | None = None) -> None:
    """One forward of ``token_ids [B, n]`` appending to ``cache``; logits of the last row only, as
    generate() asks for them. ``call``: a compiled ``hf`` to run instead (its signature is not hf's)."""
    (hf if call is None else call)(input_ids=token_ids, use_cache=True, logits_to_keep=1, **{hf_cache_kwarg(hf): cache})


def hf_dynamic_cache(hf: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=hf.config)


def hf_prefill(hf: torch.nn.Module, cache: Any, batch: int, context: int, max_rows_per_forward: int,
               vocab_size: int, device: torch.device) -> None:
    """Fill ``cache`` with ``context`` random tokens for each of ``batch`` requests, in forwards of at most
    ``max_rows_per_forward`` token rows (a whole 64 x 4096 batch at once would need tens of GB of activations)."""
    import torch

    tokens_per_forward = max(1, min(context, max_rows_per_forward // batch))
    done = 0
    while done < context:
        count = min(tokens_per_forward, context - done)
        hf_forward(hf, torch.randint(0, vocab_size, (batch, count), device=device), cache)
        done += count


def hf_crop(cache: Any, length: int) -> None:
    """Drop the tokens past ``length`` from every attention layer of a DynamicCache. Per layer, because
    Cache.crop also crops linear-attention layers, which refuse unless they recorded their past;
    a recurrent state needs no crop (its size does not grow)."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and not hasattr(layer, "recurrent_states"):
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)  # negative: tokens to remove (the meaning in every 5.x)


# -- output -------------------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool]) -> str:
    """A markdown table; ``numeric`` columns are right-aligned."""
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---:" if right else "---" for right in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


#: A kernel breakdown's name column: the first characters of a kernel's name (Numba's carry the module path).
KERNEL_NAME_CHARS = 96


def kernel_breakdown(events: Sequence[Any], top: int) -> str:
    """The ``top`` GPU kernels of a torch.profiler run by total time, as a markdown table: name (argument list
    dropped), launches, total ms, mean us and share of all kernel time. CUPTI reports the kernels a CUDA graph
    replays one by one, so decode steps count too."""
    from torch.autograd import DeviceType

    totals: dict[str, list[float]] = {}
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name.split("(")[0][:KERNEL_NAME_CHARS]
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    all_us = sum(us for _, us in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    rows = [[f"`{name}`", f"{int(count):,}", fmt(us / 1e3, 2), fmt(us / count, 1), f"{us / all_us:.1%}"]
            for name, (count, us) in ranked]
    table = markdown_table(["kernel", "launches", "ms", "us / launch", "share"], rows, [False, True, True, True, True])
    return f"{table}\n\nall kernels: {all_us / 1e3:,.2f} ms in {sum(int(c) for c, _ in totals.values()):,} launches"


@dataclass(frozen=True)
class RunInfo:
    command: str
    device_name: str
    torch_version: str
    transformers_version: str
    numba_cuda_version: str
    date: str

    def line(self) -> str:
        return (f"{self.device_name}, torch {self.torch_version}, transformers {self.transformers_version}, "
                f"numba-cuda {self.numba_cuda_version}, {self.date}")


def run_info(device: torch.device) -> RunInfo:
    """What a result section records: the exact command, the GPU, library versions and the date (UTC)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (Numba CUDA simulator, CPU)"
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return RunInfo(command, name, torch.__version__, installed("transformers"), installed("numba-cuda"), date)


def emit(title: str, info: RunInfo, body: str, out: str | None) -> None:
    """Print the result on stdout and, with ``--out FILE``, append it to FILE as a section."""
    section = f"## {title}\n\n`{info.command}`\n\n{info.line()}\n\n{body.rstrip()}\n"
    print(section)
    if out:
        with open(out, "a") as stream:
            stream.write("\n" + section)
        log(f"appended to {out}")
