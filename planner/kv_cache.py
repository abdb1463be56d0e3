"""The KV pool (full-attention layers) and the recurrent-state pool (Qwen3.5 linear layers)."""

from __future__ import annotations

from planner import checked
from planner.checked import U64
from planner.geometry import Geometry
from planner.layout import BufferRequest, Pool, buffer_bytes, pack_sequential


def kv_page_shape(geometry: Geometry, page_size: int) -> tuple[int, ...]:
    """Shape of one page: [full layers, K|V, S, Hkv, D], page-first so a page holds every layer."""
    g = geometry
    return (g.num_full_layers, 2, page_size, g.num_kv_heads, g.head_dim)


def kv_page_bytes(geometry: Geometry, page_size: int, kv_dtype: str) -> int:
    """Bytes of one KV page; from the same request the pool is built from."""
    return buffer_bytes(BufferRequest("kv_cache page", kv_dtype, kv_page_shape(geometry, page_size)))


def build_kv_cache(geometry: Geometry, page_size: int, kv_dtype: str, kv_pages: int) -> Pool:
    """The KV pool: ``kv_cache [pages, full layers, 2, S, Hkv, D]``; page 0 is the padding page."""
    shape = (kv_pages, *kv_page_shape(geometry, page_size))
    return pack_sequential("kv_cache", [BufferRequest("kv_cache", kv_dtype, shape)])


def build_recurrent_state(geometry: Geometry, num_slots: int, conv_dtype: str, max_batch: int) -> Pool:
    """Per-slot Gated DeltaNet state of every linear layer, layer-major so a layer's view is contiguous.
    ``num_slots`` counts the requests' slots, then the prefix cache's snapshots (capacity.prefix_state_slots).

    ssm_state  [linear layers, slots, Hv, dk, dv] float32
    conv_state [linear layers, slots, conv_dim, K - 1] in the activation dtype
    slot_ids   [max_batch] int32: each request's slot in the current step
    """
    g = geometry
    return pack_sequential(
        "recurrent_state",
        [
            BufferRequest(
                "ssm_state", "float32",
                (g.num_linear_layers, num_slots, g.linear_num_value_heads, g.linear_key_head_dim, g.linear_value_head_dim),
            ),
            BufferRequest("conv_state", conv_dtype, (g.num_linear_layers, num_slots, g.conv_dim, g.conv_kernel_size - 1)),
            BufferRequest("slot_ids", "int32", (max_batch,)),
        ],
    )


def recurrent_bytes_per_slot(geometry: Geometry, conv_dtype: str) -> int:
    """Bytes one slot holds over all linear layers (a figure for reports and tests)."""
    one = build_recurrent_state(geometry, 1, conv_dtype, max_batch=1)
    states = (one.buffer("ssm_state").bytes, one.buffer("conv_state").bytes)
    return checked.add("recurrent bytes per slot", *states, width=U64)


def kv_bytes_per_token(geometry: Geometry, kv_dtype: str) -> int:
    """KV bytes one token takes over all full-attention layers."""
    return kv_page_bytes(geometry, 1, kv_dtype)
