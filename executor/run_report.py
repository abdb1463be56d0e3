"""The closing report of ``memplan run`` (stderr): planned vs allocated bytes per pool, the device's view
(allocator and cudaMemGetInfo), warm-up and decode-graph capture, throughput, TTFT, TPOT and ITL percentiles, the
prefix cache, KV pages and recurrent slots at peak vs planned, preemptions, allocations after warm-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.serving_figures import ServingFigures

if TYPE_CHECKING:
    from executor.arena import Arena
    from executor.engine import EngineReport
    from executor.scheduler import SchedulerStats
    from executor.workload import RequestSpec
    from planner.plan import MemoryPlan


@dataclass(frozen=True)
class GraphCapture:
    """What capturing the decode graphs and the prefill graphs' pieces cost: wall time and the allocator
    bytes their pools reserved."""

    buckets: tuple[int, ...]
    seconds: float
    reserved_bytes: int
    prefill_buckets: tuple[int, ...] = ()
    prefill_pieces: int = 0
    prefill_seconds: float = 0.0
    prefill_reserved_bytes: int = 0


def materialized_bytes(plan: MemoryPlan) -> int:
    """Bytes of every pool the executor allocates (budget-only lines excluded)."""
    return sum(pool.bytes for pool in plan.pools if pool.materialized)


def summary(plan: MemoryPlan, arena: Arena, report: EngineReport, specs: list[RequestSpec],
            no_prefix_caching: bool, graphs: GraphCapture | None = None, warm_up_s: float | None = None,
            extra_lines: list[str] | None = None, figures: ServingFigures | None = None) -> str:
    """The stderr report: planned vs allocated bytes, the allocator's view, throughput, latency, capacities;
    ``extra_lines`` (weights, EOS and sampling defaults) after the requests' line, then the throughput and
    latency lines of ``figures`` (executor.serving_figures; computed from ``report`` when None)."""
    device, stats, cap = arena.device, report.stats, plan.capacity
    rejected = stats.rejected + sum(1 for spec in specs if spec.error is not None)
    lines = [f"memplan run: {plan.model.name} on {plan.hardware.name} (device {device.kind}), "
             f"{len(specs)} request(s) in {report.steps} step(s), {cap.kv_pages} KV pages",
             f"  {'pool':<16} {'planned bytes':>16} {'allocated bytes':>16}"]
    for pool in plan.pools:
        if pool.materialized:
            lines.append(f"  {pool.name:<16} {pool.bytes:>16,} {arena.pools[pool.name].numel():>16,}")
    lines.append(f"  {'total':<16} {materialized_bytes(plan):>16,} {arena.allocated_bytes:>16,}")
    lines.append(f"device allocator: {_allocator_line(plan, arena)}")
    lines.append(f"device memory in use: {_process_line(plan, arena)}")
    if warm_up_s is not None:
        lines.append(f"warm-up: scratch prefill and decode steps before the clock started, {warm_up_s:.2f} s "
                     "(first-call kernel loading or compilation)")
    lines.append(f"decode graphs: {_graphs_line(plan, arena, graphs)}")
    lines.append(f"prefill graphs: {_prefill_graphs_line(plan, arena, graphs)}")
    lines.append(f"requests: {len(specs)} ({len(specs) - rejected} run, {rejected} rejected); "
                 f"{report.generated_tokens} tokens generated")
    lines += extra_lines or []
    lines += (figures if figures is not None else ServingFigures.of(report)).lines()
    overlapped = "overlapped (the next step launched before the last one's ids are read)"
    if device.is_sim:  # a simulated launch runs to completion: the next step's ids are read after it
        overlapped += "; in the simulator a launch runs to completion, so token times are not a GPU's"
    lines.append("scheduling: " + (overlapped if report.overlap else "step by step (--no-overlap)"))
    lines.append(f"prefix cache: {_prefix_line(report, no_prefix_caching)}")
    lines.append(f"KV pages: peak {stats.peak_kv_pages_used} used of {cap.kv_pages - 1} usable "
                 f"(kv_pages {cap.kv_pages} - 1 padding page)")
    if plan.geometry.num_linear_layers > 0 or cap.recurrent_slots > 0:
        lines.append(f"recurrent slots: peak {stats.peak_slots_used} used of {cap.recurrent_slots} planned")
    lines.append(f"preemptions: {stats.preemptions}")
    lines.append(f"allocations after warm-up: {_allocations_line(report, device.is_sim)}")
    lines.append(f"kernels readied after warm-up: {readied_line(report.kernels_readied_after_warmup)}")
    return "\n".join(lines)


def readied_line(readied: dict[str, int]) -> str:
    """The kernel specializations a run loaded or compiled after its first step: a count, then each
    kernel's short name and count (a load or compile inside a step stalls the host)."""
    if not readied:
        return "0"
    names = ", ".join(f"{name.rsplit('.', 1)[-1]} {count}" for name, count in sorted(readied.items()))
    return f"{sum(readied.values())} ({names})"


def snapshot_counts(stats: SchedulerStats) -> str:
    """The prefix cache's recurrent-state snapshots of a run (Qwen3.5): taken, and requests resumed from one."""
    return (f"recurrent-state snapshots {stats.state_snapshots_taken:,} taken, "
            f"{stats.state_snapshot_restores:,} resumed from")


def _prefix_line(report: EngineReport, no_prefix_caching: bool) -> str:
    if no_prefix_caching:
        return "off (--no-prefix-caching)"
    if not report.prefix_caching:
        return "off: the plan keeps no recurrent-state snapshot (serving prefix_state_slots 0)"
    stats = report.stats
    line = (f"hit rate {stats.prefix_hit_rate:.1%} ({stats.prefix_hit_tokens} of {stats.prefix_query_tokens} "
            f"looked-up tokens), {stats.prefix_evictions} evictions")
    if stats.recurrent_slots:
        line += f"; {snapshot_counts(stats)}"
    return line


def _allocator_line(plan: MemoryPlan, arena: Arena) -> str:
    if arena.device.is_sim:
        return "n/a (simulator)"
    import torch

    allocated = torch.cuda.memory_allocated(arena.device.torch_device)
    planned = materialized_bytes(plan)
    return (f"torch.cuda.memory_allocated {allocated:,} bytes vs plan materialized {planned:,} bytes "
            f"({allocated - planned:+,})")


def _process_line(plan: MemoryPlan, arena: Arena) -> str:
    if arena.device.is_sim:
        return "n/a (simulator)"
    import torch

    free, total = torch.cuda.mem_get_info(arena.device.torch_device)
    used = total - free
    return (f"{used:,} bytes (cudaMemGetInfo total - free; every process on the device) vs plan usable "
            f"{plan.budget.usable_bytes:,} bytes ({used / plan.budget.usable_bytes:.1%})")


def _graphs_line(plan: MemoryPlan, arena: Arena, graphs: GraphCapture | None) -> str:
    if arena.device.is_sim:
        return "off (the simulator has no CUDA graphs)"
    if graphs is None:
        return "off (--eager)"
    planned = _runtime_line_bytes(plan, "cuda_graphs")
    return (f"buckets {list(graphs.buckets)} captured in {graphs.seconds:.2f} s; their pool reserved "
            f"{graphs.reserved_bytes:,} bytes vs {planned:,} planned (cuda_graphs)")


def _runtime_line_bytes(plan: MemoryPlan, name: str) -> int:
    return next(b.bytes for b in plan.pool("runtime").buffers if b.name == name)


def _prefill_graphs_line(plan: MemoryPlan, arena: Arena, graphs: GraphCapture | None) -> str:
    if arena.device.is_sim:
        return "off (the simulator has no CUDA graphs)"
    if graphs is None:
        return "off (--eager)"
    if not graphs.prefill_buckets:
        return "none (the plan lists no prefill_graph_rows)"
    planned = _runtime_line_bytes(plan, "prefill_graphs")
    return (f"{graphs.prefill_pieces} pieces a step at rows {list(graphs.prefill_buckets)} captured in "
            f"{graphs.prefill_seconds:.2f} s; their pool reserved {graphs.prefill_reserved_bytes:,} bytes vs "
            f"{planned:,} planned (prefill_graphs)")


def _allocations_line(report: EngineReport, simulator: bool) -> str:
    if simulator:
        return "n/a (simulator)"
    if report.allocations_after_warmup is None:
        return "n/a (no step ran)"
    return f"{report.allocations_after_warmup} (allocation.all.allocated, from the end of the first step to the end)"
