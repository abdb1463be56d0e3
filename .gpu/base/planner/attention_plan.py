"""The eleven attention-plan metadata buffers, sized by capacity.

The executor refills them in place every step (page lists, positions, work
tiles) and the attention kernels read them. Their lengths are listed once,
here; the pool's bytes are the sum of the same requests.
"""

from __future__ import annotations

from planner.capacity import Capacity
from planner.layout import BufferRequest, Pool, pack_sequential


def attention_plan_requests(capacity: Capacity) -> list[BufferRequest]:
    """Name, dtype and length of each metadata buffer (B batch, T tokens, P pages, N tiles)."""
    b, t = capacity.max_batch, capacity.max_tokens_per_step
    p, n = capacity.logical_pages, capacity.tiles
    lengths = [
        ("page_indices", p),  # concatenated logical page lists of the step's requests
        ("page_indptr", b + 1),  # request r's pages: page_indices[page_indptr[r]:page_indptr[r+1]]
        ("last_page_len", b),  # tokens in request r's last page after this step, 1..S
        ("batch_indices", t),  # request of each token row
        ("positions", t),  # absolute position of each token row
        ("q_indptr", b + 1),  # request r's token rows: q_indptr[r]:q_indptr[r+1]
        ("request_indices", n),  # work tile -> request
        ("qo_tile_indices", n),  # work tile -> query row tile
        ("kv_tile_indices", n),  # work tile -> KV chunk
        ("kv_chunk_size", b),  # KV tokens per chunk of request r
    ]
    requests = [BufferRequest(name, "int32", (length,)) for name, length in lengths]
    requests.append(BufferRequest("total_num_rows", "uint32", (1,)))  # active token rows
    return requests


def build_attention_plan(capacity: Capacity) -> Pool:
    """The attention-plan pool: one aligned int32/uint32 buffer per metadata array."""
    return pack_sequential("attention_plan", attention_plan_requests(capacity))
