"""Human-readable views of a plan: byte formatting and the ``--format table`` budget."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.kv_cache import recurrent_bytes_per_slot

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
    """The budget as a table: pools with bytes and share, KV capacity and concurrency, largest transient buffers."""
    budget, capacity, hardware = plan.budget, plan.capacity, plan.hardware
    tp = plan.serving.tensor_parallel_size
    measured = ("measured" if hardware.device_memory_source == "measured"
                else "declared, not measured")
    lines = [
        f"memplan: {plan.model.name} on {hardware.name}  (tp={tp}, "
        f"{plan.dtypes.weights} weights, {plan.dtypes.kv_cache} KV)",
        *([f"per GPU: every figure below is one of the {tp} ranks'"] if tp > 1 else []),
        f"device {format_bytes(budget.device_bytes)} ({measured}), usable {format_bytes(budget.usable_bytes)} "
        f"(gpu_memory_utilization {plan.serving.gpu_memory_utilization:g})",
        *(f"text-only: {tower.config_field} left out ({tower.parameters:,} parameters, {format_bytes(tower.bytes)}); "
          "neither planned nor loaded" for tower in plan.model.omitted_towers),
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
    lines += ["", *_kv_lines(plan)]
    lines.append(f"step capacity: batch {capacity.max_batch}, tokens {capacity.max_tokens_per_step:,}, "
                 f"logical pages {capacity.logical_pages:,}, tiles {capacity.tiles:,}, context {capacity.max_context:,}")
    if capacity.prefill_gather_tokens:
        tile = (f", score tile {capacity.prefill_score_elements:,} elements" if capacity.prefill_score_elements
                else ", no score scratch")
        lines.append(f"prefill attention of chunks >= {plan.serving.gemm_attention_min_tokens:,} tokens: "
                     f"{capacity.prefill_attention} (serving {plan.serving.prefill_attention}){tile}, "
                     f"gather scratch {capacity.prefill_gather_tokens:,} keys")
    lines.append(f"decode projections: fused GEMVs at batch <= {capacity.decode_gemv_batch} "
                 f"(serving decode_gemv_max_batch {plan.serving.decode_gemv_max_batch}), cuBLAS above"
                 if capacity.decode_gemv_batch else "decode projections: cuBLAS at every batch")
    rows = capacity.prefill_graph_rows
    lines.append(f"graphs: decode at batch {list(plan.serving.decode_graph_batch_sizes)}; prefill pieces at "
                 f"{len(rows)} row buckets {rows[0]:,}..{rows[-1]:,} (larger steps eager)"
                 if rows else f"graphs: decode at batch {list(plan.serving.decode_graph_batch_sizes)}; prefill eager")
    transient = sorted(
        ((pool.name, b) for pool in plan.pools if pool.name in ("decode", "prefill") for b in pool.buffers),
        key=lambda item: -item[1].bytes,
    )[:3]
    lines.append("largest transient buffers: " + ", ".join(
        f"{pool}/{b.name} {list(b.shape)} {format_bytes(b.bytes)}" for pool, b in transient))
    return "\n".join(lines)


def floor_hundredths(value: float) -> float:
    """``value`` rounded down to two decimals: 21.996 requests shows as 21.99, never as 22.00."""
    return math.floor(value * 100) / 100


def _kv_lines(plan: MemoryPlan) -> list[str]:
    """KV pool, concurrency at max_context, and how far batch and context go."""
    capacity = plan.capacity
    context = f"{capacity.max_context:,}" + (" (auto)" if plan.serving.max_context == "auto" else "")
    limit = {
        "kv_cache": "the KV pool is the limit",
        "max_batch": f"capped by max_batch {capacity.max_batch}",
        "recurrent_slots": f"capped by the {capacity.recurrent_slots} recurrent-state slots",
    }[capacity.concurrency_limit]
    lines = [
        f"KV pages: {capacity.kv_pages - 1:,} = {capacity.kv_tokens:,} tokens (+1 padding page), "
        f"{format_bytes(capacity.kv_bytes_per_token)} per token",
        f"max concurrency at max_context {context}: {floor_hundredths(capacity.max_concurrency):,.2f} requests ({limit})",
    ]
    if capacity.kv_pages_beyond_batch:
        use = ("only the prefix cache can use them" if not capacity.recurrent_slots or capacity.prefix_state_slots
               else "nothing uses them: raise max_batch or lower gpu_memory_utilization")
        lines.append(f"KV memory the batch leaves unused: {capacity.kv_pages_beyond_batch:,} pages "
                     f"({format_bytes(capacity.kv_pages_beyond_batch * plan.pool('kv_cache').bytes // capacity.kv_pages)}); "
                     f"{use}")
    batch = capacity.max_batch_at_context
    held = f"{batch:,} request{'s' * (batch != 1)}"
    if batch > math.floor(capacity.max_concurrency):  # a plan at that batch, whose other pools differ
        reason = ""
        if batch < capacity.max_batch:
            freed = "fewer recurrent-state slots" if capacity.recurrent_slots else "smaller step buffers"
            reason = f"; {freed} leave more KV pages"
        held += f" at --max-batch {batch} (now {capacity.max_batch}{reason})"
    lines.append(f"largest batch at max_context {capacity.max_context:,}: {held}; "
                 f"largest context at batch {capacity.max_batch}: "
                 + (f"{capacity.max_context_at_batch:,} tokens" if capacity.max_context_at_batch else "none fits"))
    if capacity.recurrent_slots:
        one = recurrent_bytes_per_slot(plan.geometry, plan.dtypes.activations)
        snapshots = capacity.prefix_state_slots
        lines.append(f"recurrent-state slots: {capacity.recurrent_slots} for requests + {snapshots} prefix-cache "
                     f"snapshot{'s' * (snapshots != 1)}, {format_bytes(one)} each")
    return lines
