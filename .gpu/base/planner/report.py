"""Human-readable views of a plan: byte formatting and the ``--format table`` budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.plan import MemoryPlan


def format_bytes(count: int) -> str:
    """Binary units with three significant decimals: 1.500 GiB, 49.125 MiB, 256 B."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.3f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(plan: MemoryPlan) -> str:
    """The budget as a table: pools with bytes and share, KV capacity, largest transient buffers."""
    budget, capacity = plan.budget, plan.capacity
    lines = [
        f"memplan: {plan.model.name} on {plan.hardware.name}  (tp={plan.serving.tensor_parallel_size}, "
        f"{plan.dtypes.weights} weights, {plan.dtypes.kv_cache} KV)",
        f"device {format_bytes(budget.device_bytes)}, usable {format_bytes(budget.usable_bytes)} "
        f"(gpu_memory_utilization {plan.serving.gpu_memory_utilization:g})",
        "",
        f"{'pool':<18}{'bytes':>16}{'':>14}{'share':>8}",
    ]
    for pool in plan.pools:
        share = pool.bytes / budget.usable_bytes if budget.usable_bytes else 0.0
        note = "" if pool.materialized else "  (outside the arena)"
        lines.append(f"{pool.name:<18}{pool.bytes:>16,}{format_bytes(pool.bytes):>14}{share:>8.1%}{note}")
        if not pool.materialized:
            for line in pool.buffers:
                lines.append(f"  {line.name:<16}{line.bytes:>16,}{format_bytes(line.bytes):>14}")
    lines.append(f"{'free':<18}{budget.free_bytes:>16,}{format_bytes(budget.free_bytes):>14}")
    usable_pages = capacity.kv_pages - 1
    lines += [
        "",
        f"KV pages: {usable_pages:,} = {capacity.kv_tokens:,} tokens (+1 padding page); "
        f"max concurrency at full context: {capacity.kv_tokens / capacity.max_context:.2f}",
        f"step capacity: batch {capacity.max_batch}, tokens {capacity.max_tokens_per_step:,}, "
        f"logical pages {capacity.logical_pages:,}, tiles {capacity.tiles:,}, context {capacity.max_context:,}",
    ]
    if capacity.prefill_gather_tokens:
        tile = (f", score tile {capacity.prefill_score_elements:,} elements" if capacity.prefill_score_elements
                else ", no score scratch")
        lines.append(f"prefill attention of chunks >= {plan.serving.gemm_attention_min_tokens:,} tokens: "
                     f"{capacity.prefill_attention} (serving {plan.serving.prefill_attention}){tile}")
    lines.append(f"decode projections: fused GEMVs at batch <= {capacity.decode_gemv_batch} "
                 f"(serving decode_gemv_max_batch {plan.serving.decode_gemv_max_batch}), cuBLAS above"
                 if capacity.decode_gemv_batch else "decode projections: cuBLAS at every batch")
    if capacity.recurrent_slots:
        lines.append(f"recurrent-state slots: {capacity.recurrent_slots}")
    transient = sorted(
        ((pool.name, b) for pool in plan.pools if pool.name in ("decode", "prefill") for b in pool.buffers),
        key=lambda item: -item[1].bytes,
    )[:3]
    lines.append("largest transient buffers: " + ", ".join(
        f"{pool}/{b.name} {list(b.shape)} {format_bytes(b.bytes)}" for pool, b in transient))
    return "\n".join(lines)
