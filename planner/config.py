"""The three frozen inputs of a plan: model, hardware and serving configs.

Every field is typed, bounded, defaulted where a default makes sense, and
documented; unknown fields are errors. Cross-field rules (head divisibility,
layer types, context limits, tensor parallelism) live in validators here, so a
config that loads is one the planner can lay out. Derived values (capacities,
per-rank shapes, byte counts) never live here: they belong to the plan.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from planner.dtypes import ActivationDtype
from planner.errors import ConfigError, FieldRule
from planner.kernel_limits import FLASH_DTYPE, FLASH_HEAD_DIM_MULTIPLE

LayerType = Literal["full_attention", "linear_attention"]
#: The most decoder layers a model may have.
MAX_LAYERS = 1024
#: Backends of long prefill chunks' attention (the plan's, after serving prefill_attention "auto").
PrefillAttention = Literal["gemm", "flash"]

# Bounds that keep every count a kernel indexes with inside i32 by a margin,
# and reject typos (a hidden size of 4e9) at the config instead of deep inside
# the layout.
_DIM = Annotated[int, Field(ge=1, le=1 << 20)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LinearAttentionConfig(_Frozen):
    """Gated DeltaNet geometry of Qwen3.5's linear-attention layers."""

    num_key_heads: _DIM = Field(description="Hk: key (and query) heads of the delta rule.")
    num_value_heads: _DIM = Field(description="Hv: value heads; a multiple of Hk.")
    key_head_dim: _DIM = Field(description="dk: key/query head size.")
    value_head_dim: _DIM = Field(description="dv: value head size.")
    conv_kernel_size: int = Field(4, ge=2, le=16, description="K: causal depthwise conv1d width.")

    @model_validator(mode="after")
    def _heads_divide(self) -> LinearAttentionConfig:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"num_key_heads ({self.num_key_heads})"
            )
        return self


class OmittedTower(_Frozen):
    """A part of the checkpoint the plan leaves out (a multimodal wrapper's vision tower): never planned,
    never loaded; the plan serves the text stack only."""

    config_field: str = Field(min_length=1, max_length=64, description="The HF config field it comes from, "
                              "e.g. vision_config.")
    parameters: Annotated[int, Field(ge=0, le=1 << 40)] = Field(description="Its parameter count.")
    bytes: Annotated[int, Field(ge=0, le=1 << 42)] = Field(description="Its weight bytes in the model's dtype.")


class ModelConfig(_Frozen):
    """A decoder-only text model: Qwen3 or the Qwen3.5 hybrid text stack."""

    name: str = Field(min_length=1, max_length=128, description="Short name, e.g. qwen3-8b.")
    architecture: Literal["qwen3", "qwen3_5"] = Field(description="Model family.")
    hidden_size: _DIM = Field(description="H: width of the residual stream.")
    num_layers: Annotated[int, Field(ge=1, le=MAX_LAYERS)] = Field(description="L: decoder layers.")
    intermediate_size: _DIM = Field(description="I: SwiGLU MLP width.")
    num_attention_heads: _DIM = Field(description="Hq: query heads of full attention.")
    num_key_value_heads: _DIM = Field(description="Hkv: key/value heads (GQA).")
    head_dim: _DIM = Field(description="D: attention head size, given explicitly (never hidden/heads).")
    vocab_size: Annotated[int, Field(ge=1, le=1 << 24)] = Field(description="V: vocabulary rows.")
    max_position_embeddings: Annotated[int, Field(ge=1, le=1 << 24)] = Field(
        description="Longest context the model supports, in tokens."
    )
    rms_norm_eps: float = Field(1e-6, gt=0.0, lt=1.0, description="RMSNorm epsilon.")
    rope_theta: float = Field(1_000_000.0, gt=0.0, description="RoPE base.")
    partial_rotary_factor: float = Field(
        1.0, gt=0.0, le=1.0, description="Fraction of head_dim that RoPE rotates (Qwen3.5: 0.25)."
    )
    tie_word_embeddings: bool = Field(False, description="lm_head shares the embedding matrix.")
    attn_output_gate: bool = Field(
        False, description="q_proj also emits a per-head sigmoid output gate (Qwen3.5)."
    )
    dtype: ActivationDtype = Field("bfloat16", description="Dtype of the checkpoint's weights.")
    layer_types: tuple[LayerType, ...] | None = Field(
        None, description="Per-layer kind; required for qwen3_5, all full_attention when omitted."
    )
    linear_attention: LinearAttentionConfig | None = Field(
        None, description="Gated DeltaNet geometry; required exactly when a layer is linear_attention."
    )
    omitted_towers: tuple[OmittedTower, ...] = Field(
        (), description="Parts of the checkpoint left out of the plan (a multimodal config's vision tower), "
        "with their bytes; the plan is text-only."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldRule("num_attention_heads", self.num_attention_heads,
                            f"must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise FieldRule("partial_rotary_factor", self.partial_rotary_factor,
                            f"head_dim x partial_rotary_factor = {self.head_dim} x {self.partial_rotary_factor} "
                            "must give an even, non-zero rotary dimension")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise FieldRule("layer_types", f"{len(self.layer_types)} entries",
                            f"needs one entry a layer: num_layers is {self.num_layers}")
        has_linear = "linear_attention" in self.kinds
        if has_linear and self.linear_attention is None:
            raise FieldRule("linear_attention", None, "layer_types lists linear_attention layers, which need it")
        if not has_linear and self.linear_attention is not None:
            raise FieldRule("linear_attention", "{...}", "is given but no layer is linear_attention")
        if self.architecture == "qwen3" and has_linear:
            raise FieldRule("architecture", self.architecture, "qwen3 has only full_attention layers")
        if self.architecture == "qwen3_5" and self.layer_types is None:
            raise FieldRule("layer_types", None, "architecture qwen3_5 needs layer_types")
        if "full_attention" not in self.kinds:
            raise FieldRule("layer_types", "no full_attention", "needs at least one full_attention layer (the KV "
                            "pool is sized by them)")
        return self

    @property
    def kinds(self) -> tuple[LayerType, ...]:
        """Layer kind of every layer, in order."""
        return self.layer_types or ("full_attention",) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates."""
        return round(self.head_dim * self.partial_rotary_factor)


class RuntimeLine(_Frozen):
    """One named device-memory cost outside the arena (CUDA context, GEMM workspace, ...)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")
    bytes: Annotated[int, Field(ge=0, le=1 << 40)]
    description: str = Field("", max_length=300)


class HardwareConfig(_Frozen):
    """One accelerator: its memory, bandwidth and the runtime's fixed costs."""

    name: str = Field(min_length=1, max_length=64)
    device_memory_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 44)] = Field(
        description="Total device memory as cudaMemGetInfo reports it, bytes."
    )
    device_memory_source: Literal["measured", "declared"] = Field(
        "declared", description="measured: device_memory_bytes is cudaMemGetInfo's total read on this card; "
        "declared: taken from a datasheet or nvidia-smi, not measured (tables say so)."
    )
    hbm_bandwidth_bytes_per_s: Annotated[int, Field(ge=1, le=1 << 50)] = Field(
        description="Datasheet memory bandwidth, bytes/s (a lead; benchmarks measure the real one)."
    )
    num_sms: Annotated[int, Field(ge=1, le=4096)] = Field(description="Streaming multiprocessors.")
    compute_capability: str = Field(pattern=r"^\d+\.\d+$", description="e.g. '9.0'.")
    cuda_graph_bytes: Annotated[int, Field(ge=0, le=1 << 36)] = Field(
        0, description="Device memory one captured decode graph's pool is budgeted, bytes."
    )
    cuda_graph_piece_bytes: Annotated[int, Field(ge=0, le=1 << 36)] = Field(
        0, description="Device memory one captured piece of a prefill step (the row-wise kernels between two "
        "attention launches, at one token bucket) is budgeted, bytes."
    )
    runtime_reserve: tuple[RuntimeLine, ...] = Field(
        (), description="Named fixed costs outside the arena (context, module images, workspace, margin)."
    )
    nccl_communicator_bytes: Annotated[int, Field(ge=0, le=1 << 36)] = Field(
        0, description="Device memory one rank's NCCL communicator takes (its channel buffers), bytes; "
        "budgeted as the nccl_communicator runtime line when tensor_parallel_size > 1."
    )
    default_serving: str = Field(
        "default", min_length=1, max_length=128, description="The serving config (file or shipped name) that "
        "memplan plan and memplan run use on this hardware when --serving is not given."
    )

    @model_validator(mode="after")
    def _unique_lines(self) -> HardwareConfig:
        names = [line.name for line in self.runtime_reserve]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"runtime_reserve names must be unique; repeated: {', '.join(duplicates)}")
        return self


#: vLLM's names of serving fields, accepted as YAML keys (and as flags) beside memplan's own.
VLLM_SERVING_NAMES = {
    "max_num_seqs": "max_batch",
    "max_model_len": "max_context",
    "block_size": "page_size",
}
#: vLLM's max_num_batched_tokens bounds a step's tokens, decode rows included, and a step's prefill chunk takes
#: what its decode rows leave of it: memplan's max_step_tokens and max_prefill_tokens, both at its value.
VLLM_STEP_TOKENS = "max_num_batched_tokens"
VLLM_STEP_TOKENS_FIELDS = ("max_prefill_tokens", "max_step_tokens")
#: Default decode graph buckets stop at this batch (vLLM's default capture sizes stop at 512 too);
#: larger decode steps run eagerly.
MAX_DEFAULT_GRAPH_BATCH = 512
#: Default token buckets of the prefill graphs (ServingConfig.prefill_graph_token_sizes). A prefill or mixed
#: step's eager launches cost the H200's host about 19 ms at Qwen3-8B whatever its size, its GPU work about
#: 20 us a row (the GEMMs at ~750 TFLOP/s): steps of up to ~2,048 rows are launch-bound and replay pieces;
#: larger ones run eagerly. Steps of 64 up to 512 rows, then 128, then 256 keep the padding at most 1/8 of a
#: step of more than 512 rows (docs/benchmarks.md, "Serving throughput").
DEFAULT_PREFILL_GRAPH_TOKEN_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280,
                                     1536, 1792, 2048)
_TOKEN_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


#: The largest count a token-count string is read as: far past every bound, but a number Python prints.
MAX_TOKEN_COUNT = 10**18


def parse_token_count(text: str) -> int:
    """A token count written like vLLM's: ``40960``, ``32k`` (32,000), ``32K`` (32,768), ``1.5m``; lower-case
    units are decimal, upper-case binary. Raises ValueError naming the accepted forms."""
    match = _TOKEN_COUNT.match(text.strip())
    value = None
    if match:
        try:
            value = Decimal(match.group(1)) * _TOKEN_UNITS[match.group(2)]
        except InvalidOperation:
            value = None
    if value is None or value != value.to_integral_value() or abs(value) > MAX_TOKEN_COUNT:
        shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
        raise ValueError(f"{shown} is not a token count: use an integer (at most 10**18), 32k (32,000) or "
                         "32K (32,768)")
    return int(value)


def default_graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Decode graph buckets when none are given: the powers of two below max_batch, then max_batch itself
    (up to MAX_DEFAULT_GRAPH_BATCH): 64 gives 1, 2, 4, 8, 16, 32, 64; 48 gives 1, ..., 32, 48."""
    top = min(max_batch, MAX_DEFAULT_GRAPH_BATCH)
    return (*(1 << i for i in range(top.bit_length()) if (1 << i) < top), top)


def graph_buckets_for_batch(buckets: tuple[int, ...], old_batch: int, new_batch: int) -> tuple[int, ...]:
    """The decode graph buckets after max_batch changes from ``old_batch`` to ``new_batch``: default buckets
    follow the batch; given ones lose those above it (like vLLM's capture sizes), keeping at least (1,)."""
    if tuple(buckets) == default_graph_batch_sizes(old_batch):
        return default_graph_batch_sizes(new_batch)
    return tuple(b for b in buckets if b <= new_batch) or (1,)


def vllm_name_clash(data: dict[str, Any]) -> tuple[str, str] | None:
    """(vLLM name, memplan name) of a field given under both names, or None."""
    named = [*VLLM_SERVING_NAMES.items(), *((VLLM_STEP_TOKENS, field) for field in VLLM_STEP_TOKENS_FIELDS)]
    for vllm_name, field in named:
        if vllm_name in data and field in data:
            return vllm_name, field
    return None


def with_memplan_names(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with vLLM's field names replaced by memplan's (callers refuse a vllm_name_clash first)."""
    renamed = {VLLM_SERVING_NAMES.get(key, key): value for key, value in data.items() if key != VLLM_STEP_TOKENS}
    if VLLM_STEP_TOKENS in data:
        renamed.update(dict.fromkeys(VLLM_STEP_TOKENS_FIELDS, data[VLLM_STEP_TOKENS]))
    return renamed


def _vllm_alias(field: str) -> AliasChoices:
    """memplan's name of ``field`` or vLLM's; the loader (and the schema) refuse both at once."""
    return AliasChoices(field, *(vllm for vllm, name in VLLM_SERVING_NAMES.items() if name == field))


def _serving_schema_extra(schema: dict[str, Any]) -> None:
    """The published schema accepts what the loader accepts: vLLM's names (never both names of one field)
    and human-readable token counts."""
    properties = schema["properties"]
    count = {"type": "string", "pattern": _TOKEN_COUNT.pattern}
    properties["max_context"]["anyOf"][1:1] = [count, {"const": -1, "type": "integer"}]
    properties["max_prefill_tokens"] = {"anyOf": [{k: v for k, v in properties["max_prefill_tokens"].items()
                                                   if k not in ("default", "description", "title")}, count],
                                        **{k: v for k, v in properties["max_prefill_tokens"].items()
                                           if k in ("default", "description", "title")}}
    for optional in ("max_prefill_tokens_beside_decode", "max_step_tokens"):  # anyOf [integer, null] already
        properties[optional]["anyOf"].insert(1, count)
    for vllm_name, field in VLLM_SERVING_NAMES.items():
        alias = {k: v for k, v in properties[field].items() if k not in ("default", "title")}
        properties[vllm_name] = {**alias, "description": f"vLLM's name of {field}."}
    step_tokens = {k: v for k, v in properties["max_prefill_tokens"].items() if k not in ("default", "title")}
    properties[VLLM_STEP_TOKENS] = {**step_tokens, "description": "vLLM's tokens a step holds, decode rows "
                                    "included: sets max_prefill_tokens and max_step_tokens both."}
    schema["dependentSchemas"] = {
        **{vllm_name: {"not": {"required": [field]}} for vllm_name, field in VLLM_SERVING_NAMES.items()},
        VLLM_STEP_TOKENS: {"not": {"anyOf": [{"required": [field]} for field in VLLM_STEP_TOKENS_FIELDS]}},
    }


class ServingConfig(_Frozen):
    """How the model is served: batch, context, paging and memory share (vLLM names in parentheses; those
    names are accepted as keys too)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra=_serving_schema_extra)

    max_batch: Annotated[int, Field(ge=1, le=1 << 16)] = Field(
        64, validation_alias=_vllm_alias("max_batch"), description="Most concurrent requests in a step (max_num_seqs)."
    )
    max_context: Annotated[int, Field(ge=1, le=1 << 24)] | Literal["auto"] | None = Field(
        None, validation_alias=_vllm_alias("max_context"),
        description="Longest request, prompt plus output, in tokens (max_model_len); 32k (32,000) and 32K (32,768)"
        " are accepted. null: the model's max_position_embeddings. auto (or -1): the largest context up "
        "to the model's limit of which one request fits the KV pool (vLLM's auto); the plan's capacity says "
        "which."
    )
    page_size: Annotated[int, Field(ge=1, le=1 << 12)] = Field(
        16, validation_alias=_vllm_alias("page_size"), description="Tokens per KV page (block_size).")
    max_prefill_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        2048, description="Prefill tokens per step, the chunk size. vLLM's max_num_batched_tokens sets it and "
        "max_step_tokens both."
    )
    max_prefill_tokens_beside_decode: Annotated[int, Field(ge=1, le=1 << 20)] | None = Field(
        None, description="Prefill tokens a step takes while it also carries decode rows, at most "
        "max_prefill_tokens: fewer bound how long running requests wait for their next token (TPOT under load) "
        "at the cost of prefill tokens a step. null: max_prefill_tokens."
    )
    max_step_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = Field(
        None, description="Rows a step holds, decode rows included, as vLLM's max_num_batched_tokens counts them: "
        "a step's prefill chunk takes what its decode rows leave, so a step that has prompt tokens to take holds "
        "this many rows whatever its decode rows. At least max_batch and max_prefill_tokens, at most "
        "max_prefill_tokens + max_batch - 1. null: max_prefill_tokens + max_batch - 1 (a whole chunk beside "
        "any decode rows)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Share of device memory the plan may use (gpu_memory_utilization)."
    )
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Ranks the model is sharded over; the plan is per rank (tensor_parallel_size)."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight and activation dtype; auto: the model's."
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="KV cache dtype; auto: the activation dtype (kv_cache_dtype)."
    )
    min_kv_pages: Annotated[int, Field(ge=1, le=1 << 24)] = Field(
        1, description="Usable KV pages (the padding page 0 not counted) a plan needs at the least. A plan fits "
        "only when its KV pool also holds one request of max_context: ceil(max_context / page_size) pages."
    )
    states_per_slot: Annotated[int, Field(ge=1, le=4)] = Field(
        1, description="Recurrent states kept per decode slot (Qwen3.5); 2 lets a prefill run beside a graph slot."
    )
    prefix_state_slots: Annotated[int, Field(ge=0, le=4096)] = Field(
        16, description="Recurrent-state snapshots the prefix cache keeps (Qwen3.5; ignored without linear-attention "
        "layers): a cached KV prefix resumes a request only where a snapshot holds the recurrent state at its end. "
        "A snapshot is taken where a request's prompt leaves the cached prefix, so the third request sharing a "
        "prefix resumes from it; least recently used first out. Each costs one request's recurrent state; 0 turns "
        "prefix caching off for such models."
    )
    gemm_attention_min_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        256, description="A prefill chunk of at least this many tokens computes attention over its keys and values "
        "gathered from the KV pages, with the prefill_attention backend; shorter chunks and decode rows use the "
        "paged attention kernel. Above max_prefill_tokens: never, and no gather or score scratch is planned."
    )
    prefill_attention: Literal["auto", "gemm", "flash"] = Field(
        "auto", description="Backend of those long prefill chunks' attention. gemm: two batched GEMMs (cuBLAS) "
        "with a causal softmax between them, over a planned float32 score tile. flash: one tensor-core "
        "FlashAttention-2 kernel launch over a step's long chunks, no score scratch; needs bfloat16 activations and KV cache "
        f"and a head_dim that is a multiple of {FLASH_HEAD_DIM_MULTIPLE}. auto: flash where the model and dtypes "
        "allow it (faster on the H200: docs/benchmarks.md), else gemm; the plan's capacity says which."
    )
    decode_gemv_max_batch: Annotated[int, Field(ge=0, le=8)] = Field(
        1, description="Decode steps of at most this many requests run their projections as fused GEMV kernels "
        "(RMSNorm, SwiGLU and the residual add folded into them) instead of cuBLAS GEMMs and separate row "
        "kernels; 0: never. Faster at batch 1 on the H200, slower from batch 4 (docs/benchmarks.md). The plan's "
        "capacity decode_gemv_batch says what applies: also capped by max_batch and by the normalized rows "
        "fitting a block's shared memory."
    )
    decode_graph_batch_sizes: tuple[Annotated[int, Field(ge=1, le=1 << 16)], ...] = Field(
        default_factory=lambda data: default_graph_batch_sizes(data.get("max_batch", 64)),
        description="Batch buckets captured as decode CUDA graphs; each <= max_batch. Omitted: the powers of two "
        f"below max_batch, then max_batch (up to {MAX_DEFAULT_GRAPH_BATCH}), following max_batch when a flag "
        "changes it.",
    )
    prefill_graph_token_sizes: tuple[Annotated[int, Field(ge=1, le=1 << 20)], ...] = Field(
        DEFAULT_PREFILL_GRAPH_TOKEN_SIZES,
        description="Row buckets of prefill and mixed steps captured as piecewise CUDA graphs: each layer's "
        "row-wise kernels (norms, projections, SwiGLU, gates) replay at the smallest bucket that holds the "
        "step's rows, and attention (whose launches depend on the step's requests) runs eagerly between them. "
        "Buckets above the step's row capacity are dropped (the plan's capacity prefill_graph_rows lists the "
        "rest); steps of more rows than the largest run eagerly; empty: none. With tensor_parallel_size > 1 "
        "prefill steps run eagerly.",
    )

    @field_validator("max_context", mode="before")
    @classmethod
    def _context_length(cls, value: Any) -> Any:
        if value == -1:
            return "auto"
        if isinstance(value, str) and value != "auto":
            return parse_token_count(value)
        return value

    @field_validator("max_prefill_tokens", "max_prefill_tokens_beside_decode", "max_step_tokens", mode="before")
    @classmethod
    def _token_counts(cls, value: Any) -> Any:
        return parse_token_count(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _beside_decode(self) -> ServingConfig:
        beside = self.max_prefill_tokens_beside_decode
        if beside is not None and beside > self.max_prefill_tokens:
            raise FieldRule("max_prefill_tokens_beside_decode", beside,
                            f"max_prefill_tokens_beside_decode ({beside}) exceeds max_prefill_tokens "
                            f"({self.max_prefill_tokens}): a step beside decode rows takes at most a step's chunk")
        return self

    @model_validator(mode="after")
    def _step_tokens(self) -> ServingConfig:
        rows, chunk, batch = self.max_step_tokens, self.max_prefill_tokens, self.max_batch
        if rows is None:
            return self
        if rows < max(batch, chunk):
            raise FieldRule("max_step_tokens", rows,
                            f"max_step_tokens ({rows}) is below max_batch ({batch}) or max_prefill_tokens ({chunk}): "
                            f"a step holds a decode row of every request and a whole chunk; at least "
                            f"{max(batch, chunk)} (vLLM's max_num_batched_tokens sets it)")
        if rows > chunk + batch - 1:
            raise FieldRule("max_step_tokens", rows,
                            f"max_step_tokens ({rows}) exceeds max_prefill_tokens + max_batch - 1 "
                            f"({chunk + batch - 1}), the most rows a step can fill; null plans that many")
        return self

    @model_validator(mode="after")
    def _buckets(self) -> ServingConfig:
        too_big = [b for b in self.decode_graph_batch_sizes if b > self.max_batch]
        if too_big:
            raise ValueError(
                f"decode_graph_batch_sizes {list(too_big)} exceed max_batch ({self.max_batch})"
            )
        if list(self.decode_graph_batch_sizes) != sorted(set(self.decode_graph_batch_sizes)):
            raise ValueError("decode_graph_batch_sizes must be strictly increasing")
        if list(self.prefill_graph_token_sizes) != sorted(set(self.prefill_graph_token_sizes)):
            raise ValueError("prefill_graph_token_sizes must be strictly increasing")
        return self


def serving_with(serving: ServingConfig, **change: Any) -> ServingConfig:
    """``serving`` with some fields changed, validated; a new max_batch moves the graph buckets like a
    --max-batch flag does (graph_buckets_for_batch). Raises pydantic's ValidationError (a ValueError)."""
    if "max_batch" in change and "decode_graph_batch_sizes" not in change:
        change["decode_graph_batch_sizes"] = graph_buckets_for_batch(
            serving.decode_graph_batch_sizes, serving.max_batch, change["max_batch"])
    return ServingConfig.model_validate({**serving.model_dump(), **change})


def context_limit(model: ModelConfig, serving: ServingConfig) -> int:
    """The context the plan is laid out for: serving max_context when it is a number, else the model's
    max_position_embeddings (for auto: the largest the planner tries)."""
    return serving.max_context if isinstance(serving.max_context, int) else model.max_position_embeddings


def resolved_dtypes(model: ModelConfig, serving: ServingConfig) -> tuple[str, str]:
    """(activation dtype, KV cache dtype) after "auto": the model's dtype, then the activations'."""
    activations = model.dtype if serving.dtype == "auto" else serving.dtype
    return activations, activations if serving.kv_cache_dtype == "auto" else serving.kv_cache_dtype


def check_compatible(model: ModelConfig, serving: ServingConfig, source: str = "serving") -> None:
    """Rules that involve both the model and the serving config; raises ConfigError naming ``source``
    (the serving config's file, when the caller knows it)."""
    if isinstance(serving.max_context, int) and serving.max_context > model.max_position_embeddings:
        raise ConfigError(
            source, "max_context", serving.max_context,
            f"exceeds the model's max_position_embeddings ({model.max_position_embeddings})",
        )
    tp = serving.tensor_parallel_size
    sharded = {
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.intermediate_size,
    }  # the vocabulary need not divide: its shards are padded (planner/geometry.py)
    if model.linear_attention is not None:
        sharded["linear_attention.num_key_heads"] = model.linear_attention.num_key_heads
        sharded["linear_attention.num_value_heads"] = model.linear_attention.num_value_heads
    for field, value in sharded.items():
        if value % tp:
            raise ConfigError(source, "tensor_parallel_size", tp, f"must divide the model's {field} ({value})")
    kv = model.num_key_value_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            source, "tensor_parallel_size", tp,
            f"must divide num_key_value_heads ({kv}) or be a multiple of it (KV heads are split or replicated)",
        )
    if serving.prefill_attention == "flash":
        _check_flash_attention(model, serving, source)
    _check_kv_cache_dtype(model, serving, source)


def _check_kv_cache_dtype(model: ModelConfig, serving: ServingConfig, source: str) -> None:
    """The executor's kernels read and write the KV cache in the activation dtype: refuse another one."""
    activations, kv_cache = resolved_dtypes(model, serving)
    if kv_cache != activations:
        raise ConfigError(
            source, "kv_cache_dtype", serving.kv_cache_dtype,
            f"must equal the activation dtype (the executor keeps the KV cache in it): dtype {serving.dtype!r} over "
            f"model {model.name} ({model.dtype}) gives {activations} activations; set kv_cache_dtype: auto or "
            f"{activations}",
        )


def resolve_prefill_attention(model: ModelConfig, serving: ServingConfig) -> PrefillAttention:
    """serving prefill_attention with "auto" decided: flash when the kernel takes this model and these
    dtypes, else gemm. An explicit choice stands (check_compatible refuses a flash it cannot run)."""
    if serving.prefill_attention != "auto":
        return serving.prefill_attention
    return "flash" if _flash_refusal(model, serving) is None else "gemm"


def _flash_refusal(model: ModelConfig, serving: ServingConfig) -> str | None:
    """Why the FlashAttention kernel cannot run this model and dtypes, or None when it can."""
    if model.head_dim % FLASH_HEAD_DIM_MULTIPLE:
        return (f"needs head_dim a multiple of {FLASH_HEAD_DIM_MULTIPLE} (the kernel's Q K^T fragment loads); model "
                f"{model.name} has head_dim {model.head_dim}; use prefill_attention: gemm or auto")
    activations, kv_cache = resolved_dtypes(model, serving)
    if (activations, kv_cache) != (FLASH_DTYPE, FLASH_DTYPE):
        return (f"needs {FLASH_DTYPE} activations and KV cache (the kernel is bf16 only); dtype {serving.dtype!r} and "
                f"kv_cache_dtype {serving.kv_cache_dtype!r} over model {model.name} ({model.dtype}) give {activations} "
                f"and {kv_cache}; set dtype: {FLASH_DTYPE} and kv_cache_dtype: auto, or use prefill_attention: gemm "
                "or auto")
    return None


def _check_flash_attention(model: ModelConfig, serving: ServingConfig, source: str) -> None:
    """The FlashAttention kernel's limits: head_dim a multiple of FLASH_HEAD_DIM_MULTIPLE, bf16 activations
    and KV cache."""
    refusal = _flash_refusal(model, serving)
    if refusal is not None:
        raise ConfigError(source, "prefill_attention", serving.prefill_attention, refusal)
