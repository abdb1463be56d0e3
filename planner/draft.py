"""Drafts: every pool of a plan but the KV pool, and what the KV pool gets from the rest.

The fit rule, max_context auto, the advice after a plan that does not fit and the capacity answers (the
largest batch at this context, the largest context at this batch) all re-plan through drafts of the same
layout ``build_plan`` uses, never through a formula of their own. A ``Drafter`` lays out the weights pool,
the costly part that only dtype and tensor_parallel_size change, once per dtype and tp.
"""

from __future__ import annotations

from fractions import Fraction

from pydantic import BaseModel, ConfigDict, ValidationError

from planner import checked
from planner.attention_plan import build_attention_plan
from planner.capacity import Capacity, build_capacity, gemv_batch_limit
from planner.checked import CheckedOverflowError
from planner.config import (
    HardwareConfig, ModelConfig, ServingConfig, check_compatible, context_limit, resolve_prefill_attention,
    resolved_dtypes)
from planner.dtypes import dtype_bytes
from planner.errors import ConfigError
from planner.geometry import Geometry, build_geometry
from planner.kernel_limits import DELTA_RULE_SCRATCH_DTYPE
from planner.kv_cache import build_recurrent_state, kv_page_bytes
from planner.layout import ALIGNMENT_BYTES, Pool, budget_pool
from planner.sampling import build_sampling
from planner.step_buffers import build_step_pool
from planner.weights import build_weights


class Dtypes(BaseModel):
    """Resolved dtypes of the plan's data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: str
    activations: str
    kv_cache: str
    recurrent_state: str = "float32"


def resolve_dtypes(model: ModelConfig, serving: ServingConfig) -> Dtypes:
    activations, kv = resolved_dtypes(model, serving)
    return Dtypes(weights=activations, activations=activations, kv_cache=kv)


class Draft(BaseModel):
    """Everything but the KV pool, the one non-KV total, and the KV pages the rest leaves."""

    model_config = ConfigDict(frozen=True)

    serving: ServingConfig
    dtypes: Dtypes
    geometry: Geometry
    capacity: Capacity  # kv_pages still 0
    pools: tuple[Pool, ...]
    non_kv_bytes: int
    usable_bytes: int
    available_bytes: int  # usable - non_kv; negative when even the non-KV pools do not fit
    page_bytes: int  # one KV page

    @property
    def kv_pages(self) -> int:
        """Pages of the KV pool, page 0 (padding) included: the most whose aligned pool fits."""
        return kv_pages_fitting(self.available_bytes, self.page_bytes) if self.available_bytes >= 0 else 0

    @property
    def usable_kv_pages(self) -> int:
        """Pages requests can hold: the padding page 0 does not count."""
        return max(self.kv_pages - 1, 0)

    def pages_needed(self, requests: int) -> int:
        """Usable pages ``requests`` requests of max_context hold at once (at least serving min_kv_pages)."""
        pages = checked.mul("pages of the requests", requests, self.capacity.pages_per_request, width=checked.I64)
        return max(pages, self.serving.min_kv_pages)

    def holds(self, requests: int = 1) -> bool:
        """Whether the KV pool holds ``requests`` requests of max_context at once (the recurrent slots hold
        max_batch x states_per_slot states by construction). ``holds(1)`` is the fit rule."""
        return self.available_bytes >= 0 and self.usable_kv_pages >= self.pages_needed(requests)


class Drafter:
    """Drafts of one model on one hardware at any serving settings."""

    def __init__(self, model: ModelConfig, hardware: HardwareConfig, serving_source: str = "serving"):
        self.model = model
        self.hardware = hardware
        self.serving_source = serving_source
        self._weights: dict[tuple[int, str], Pool] = {}

    def draft(self, serving: ServingConfig, max_context: int | None = None) -> Draft:
        """The draft at ``serving``, laid out for ``max_context`` tokens (None: context_limit). Raises
        ConfigError for configs that do not go together, CheckedOverflowError when a count leaves its width."""
        model, hardware = self.model, self.hardware
        check_compatible(model, serving, self.serving_source)
        dtypes = resolve_dtypes(model, serving)
        geometry = build_geometry(model, serving)
        gemv_inputs = (geometry.hidden_size, geometry.attn_out_width, geometry.intermediate_size,
                       *((geometry.linear_value_width,) if geometry.num_linear_layers else ()))
        capacity = build_capacity(
            max_batch=serving.max_batch,
            max_context=context_limit(model, serving) if max_context is None else max_context,
            page_size=serving.page_size,
            max_prefill_tokens=serving.max_prefill_tokens,
            gqa_group=geometry.gqa_group,
            num_q_heads=geometry.num_q_heads if geometry.num_full_layers else 0,
            gemm_attention_min_tokens=serving.gemm_attention_min_tokens,
            prefill_attention=resolve_prefill_attention(model, serving),
            recurrent_slots_per_request=serving.states_per_slot if geometry.num_linear_layers else 0,
            prefix_state_slots=serving.prefix_state_slots,
            decode_gemv_batch=gemv_batch_limit(serving.decode_gemv_max_batch, serving.max_batch,
                                               geometry.hidden_size, gemv_inputs, dtype_bytes(dtypes.activations)),
            delta_rule_scratch=bool(geometry.num_linear_layers) and dtypes.activations == DELTA_RULE_SCRATCH_DTYPE,
            prefill_tokens_beside_decode=serving.max_prefill_tokens_beside_decode,
            max_step_tokens=serving.max_step_tokens,
            prefill_graph_token_sizes=serving.prefill_graph_token_sizes if serving.tensor_parallel_size == 1 else (),
        )
        act = dtypes.activations
        pools = [self._weights_pool(geometry, serving.tensor_parallel_size, dtypes.weights)]
        if geometry.num_linear_layers:
            slots = checked.add("recurrent states", capacity.recurrent_slots, capacity.prefix_state_slots,
                                width=checked.I32)
            pools.append(build_recurrent_state(geometry, slots, act, capacity.max_batch))
        pools += [
            build_attention_plan(capacity),
            build_step_pool("decode", geometry, capacity.max_batch, act, capacity.decode_kv_splits),
            build_step_pool("prefill", geometry, capacity.max_tokens_per_step, act,
                            gather_tokens=capacity.prefill_gather_tokens,
                            score_elements=capacity.prefill_score_elements,
                            delta_rule_chunk=capacity.delta_rule_chunk),
            build_sampling(geometry, capacity.max_batch, act),
            budget_pool("runtime", runtime_lines(hardware, serving, capacity, geometry.num_layers)),
        ]
        non_kv = checked.add("non-KV bytes", *(p.bytes for p in pools))
        usable = usable_bytes(hardware.device_memory_bytes, serving.gpu_memory_utilization)
        return Draft(serving=serving, dtypes=dtypes, geometry=geometry, capacity=capacity, pools=tuple(pools),
                     non_kv_bytes=non_kv, usable_bytes=usable,
                     available_bytes=checked.sub("bytes left for KV", usable, non_kv, width=checked.I64),
                     page_bytes=kv_page_bytes(geometry, serving.page_size, dtypes.kv_cache))

    def draft_or_none(self, serving: ServingConfig, max_context: int | None = None) -> Draft | None:
        """``draft``, or None for settings that do not go together or overflow a width (for searches)."""
        try:
            return self.draft(serving, max_context)
        except (ValueError, CheckedOverflowError):
            return None

    def holds(self, serving: ServingConfig, requests: int = 1, max_context: int | None = None) -> bool:
        """Whether the draft at these settings holds ``requests`` requests of its max_context; settings that
        do not go together (or overflow a width) hold nothing. For searches over a knob."""
        try:
            return self.draft(serving, max_context).holds(requests)
        except (ConfigError, CheckedOverflowError, ValidationError):
            return False

    def _weights_pool(self, geometry: Geometry, tp: int, dtype: str) -> Pool:
        key = (tp, dtype)
        if key not in self._weights:
            self._weights[key] = build_weights(geometry, dtype, self.model.tie_word_embeddings)
        return self._weights[key]


def runtime_lines(hardware: HardwareConfig, serving: ServingConfig, capacity: Capacity,
                  num_layers: int) -> list[tuple[str, int]]:
    """The runtime pool's lines: the hardware's reserve, the decode graphs, the prefill graphs' pieces (one per
    layer and one more, executor/models/graphs.py, at each bucket) and with tensor parallelism the communicator."""
    lines = [(line.name, line.bytes) for line in hardware.runtime_reserve]
    graphs = checked.mul("cuda_graphs bytes", len(serving.decode_graph_batch_sizes), hardware.cuda_graph_bytes)
    lines.append(("cuda_graphs", graphs))
    pieces = checked.mul("prefill graph pieces", len(capacity.prefill_graph_rows), num_layers + 1)
    lines.append(("prefill_graphs", checked.mul("prefill_graphs bytes", pieces, hardware.cuda_graph_piece_bytes)))
    if serving.tensor_parallel_size > 1:  # one communicator per rank: the collectives of executor/parallel.py
        lines.append(("nccl_communicator", hardware.nccl_communicator_bytes))
    return lines


def usable_bytes(device_bytes: int, utilization: float) -> int:
    """floor(device_bytes x utilization), exact: the float's decimal text as a fraction."""
    share = Fraction(repr(utilization))
    return checked.fit("usable bytes", (device_bytes * share.numerator) // share.denominator)


def kv_pool_bytes(pages: int, page_bytes: int) -> int:
    """Bytes of a KV pool of ``pages`` pages: whole pages, aligned like every pool."""
    return checked.align_up("kv pool bytes", checked.mul("kv pool bytes", pages, page_bytes), ALIGNMENT_BYTES)


def kv_pages_fitting(available_bytes: int, page_bytes: int) -> int:
    """Most pages whose aligned pool fits in ``available_bytes``."""
    pages = checked.floordiv("kv pages", available_bytes, page_bytes, width=checked.I32)
    while kv_pool_bytes(pages, page_bytes) > available_bytes:
        pages -= 1
    return pages
