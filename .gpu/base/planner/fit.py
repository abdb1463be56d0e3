"""Why a plan does not fit, and which serving knob would make it fit.

For each knob a user can lower (or raise), search for the value closest to the
current one at which ``build_plan`` succeeds, by re-planning: the advice comes
from the same layout as the failure, never from an approximate formula.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.config import HardwareConfig, ModelConfig, ServingConfig
from planner.errors import ConfigError, PlanDoesNotFit
from planner.layout import Pool
from planner.report import format_bytes


def explain_does_not_fit(
    model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig,
    non_kv_bytes: int, usable_bytes: int, page_bytes: int, pools: tuple[Pool, ...],
) -> PlanDoesNotFit:
    """A PlanDoesNotFit naming the biggest consumers and the knobs that would fit."""
    required = non_kv_bytes + serving.min_kv_pages * page_bytes
    biggest = sorted(pools, key=lambda p: -p.bytes)[:3]
    consumers = ", ".join(f"{p.name} {format_bytes(p.bytes)}" for p in biggest)
    advice = _advice(model, hardware, serving)
    message = (
        f"{model.name} on {hardware.name} does not fit: needs {format_bytes(required)} "
        f"(non-KV {format_bytes(non_kv_bytes)} + {serving.min_kv_pages} KV pages x {format_bytes(page_bytes)}), "
        f"usable {format_bytes(usable_bytes)} ({serving.gpu_memory_utilization:g} x "
        f"{format_bytes(hardware.device_memory_bytes)}). Biggest: {consumers}. "
        + (f"Would fit with: {'; or '.join(advice)}." if advice else "No single serving knob makes it fit.")
    )
    return PlanDoesNotFit(message, required_bytes=required, usable_bytes=usable_bytes)


def _advice(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig) -> list[str]:
    advice = []
    for knob in ("max_batch", "max_prefill_tokens", "max_context"):
        current = getattr(serving, knob) or model.max_position_embeddings
        best = _largest_fitting(lambda v, k=knob: _fits(model, hardware, serving, **{k: v}), 1, current - 1)
        if best is not None:
            advice.append(f"--{knob.replace('_', '-')} {best} (now {current})")
    for utilization in (0.92, 0.95, 0.98):
        if utilization > serving.gpu_memory_utilization and _fits(model, hardware, serving, gpu_memory_utilization=utilization):
            advice.append(f"--gpu-memory-utilization {utilization} (now {serving.gpu_memory_utilization:g})")
            break
    for tp in (2, 4, 8, 16):
        if tp > serving.tensor_parallel_size and _fits(model, hardware, serving, tensor_parallel_size=tp):
            advice.append(f"--tensor-parallel-size {tp} (now {serving.tensor_parallel_size})")
            break
    return advice


def _fits(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig, **change: object) -> bool:
    from planner.checked import CheckedOverflowError
    from planner.plan import plan_fits

    data = {**serving.model_dump(), **change}
    buckets = data["decode_graph_batch_sizes"]
    data["decode_graph_batch_sizes"] = tuple(b for b in buckets if b <= data["max_batch"]) or (1,)
    try:
        return plan_fits(model, hardware, ServingConfig.model_validate(data, strict=False))
    except (ConfigError, CheckedOverflowError, ValueError):
        return False


def _largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """Largest v in [low, high] with fits(v), assuming fits is monotone (true below a threshold)."""
    if high < low or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
