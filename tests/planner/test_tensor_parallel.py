"""Per-rank plans of tensor parallelism: padded vocab shards, sharded heads, the collectives' buffers,
against an independent count (HF's tensors cut by heads with torch: tests/shard_reference.py)."""

from __future__ import annotations

import math

import pytest

from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan
from planner.shards import weight_shards
from tests.hf_reference import hf_model
from tests.shard_reference import reference_shard

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ODD_VOCAB = 251  # prime: no tp > 1 divides it


def _odd(name: str, **change):
    return load_model(name).model_copy(update={"vocab_size": ODD_VOCAB, **change})


def _plan(model, tp: int):
    return build_plan(model, load_hardware("cpu-sim"), load_serving("sim", {"tensor_parallel_size": tp}))


CASES = [("tiny-qwen3", 1), ("tiny-qwen3", 2), ("tiny-qwen3", 4), ("tiny-qwen3.5", 1), ("tiny-qwen3.5", 2)]


@pytest.mark.parametrize("name,tp", CASES)
def test_every_rank_weight_shape_equals_hf_tensor_cut_by_heads(name, tp):
    """Each planned weight has the shape of the HF tensor's share cut by heads, intermediate rows and
    padded vocab rows (tp 4 on tiny-qwen3: 2 KV heads, each on two ranks)."""
    model = _odd(name)
    plan = _plan(model, tp)
    state = hf_model(model, device="meta").state_dict()
    planned = {b.name: b.shape for b in plan.pool("weights").buffers}
    assert set(planned) == set(state)
    for rank in range(tp):
        for tensor_name, full in state.items():
            expected = tuple(reference_shard(model, tensor_name, torch.zeros(full.shape), tp, rank).shape)
            assert planned[tensor_name] == expected, f"rank {rank} {tensor_name}"


@pytest.mark.parametrize("name,tp", CASES)
def test_weight_shards_select_the_reference_slices(name, tp):
    """planner.shards' ranges, applied to a full tensor of distinct values, select what cutting the HF
    tensor by heads selects, padding rows (zero) included."""
    model = _odd(name)
    plan = _plan(model, tp)
    state = hf_model(model, device="meta").state_dict()
    for rank in range(tp):
        shards = weight_shards(model, plan.geometry, rank)
        assert set(shards) == set(state)
        for tensor_name, meta in state.items():
            full = torch.arange(1, math.prod(meta.shape) + 1, dtype=torch.float64).view(meta.shape)
            shard = shards[tensor_name]
            assert shard.full_shape == tuple(meta.shape)
            view = torch.zeros(plan.pool("weights").buffer(tensor_name).shape, dtype=torch.float64)
            if shard.axis is None:
                view.copy_(full)
            else:
                filled = 0
                for start, stop in shard.ranges:
                    view.narrow(shard.axis, filled, stop - start).copy_(full.narrow(shard.axis, start, stop - start))
                    filled += stop - start
            assert torch.equal(view, reference_shard(model, tensor_name, full, tp, rank)), f"{rank} {tensor_name}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_shards_are_padded_and_cover_the_vocabulary_once(tp):
    """An odd vocabulary plans at every tp: ceil(V / tp) rows per rank, the slices tile [0, V) in rank
    order, and the gathered logits hold tp x ceil(V / tp) columns."""
    plan = _plan(_odd("tiny-qwen3"), tp)
    g = plan.geometry
    rows = -(-ODD_VOCAB // tp)
    assert g.vocab_size == rows and g.full_vocab_size == ODD_VOCAB and g.padded_vocab_size == rows * tp
    ids = [i for start, end in g.vocab_slices for i in range(start, end)]
    assert ids == list(range(ODD_VOCAB))
    assert all(end - start <= rows for start, end in g.vocab_slices)
    assert plan.pool("weights").buffer("model.embed_tokens.weight").shape == (rows, 64)
    sampling = plan.pool("sampling")
    batch = plan.capacity.max_batch
    if tp == 1:
        assert sampling.buffer("logits_raw").shape == (batch, ODD_VOCAB)
        assert sampling.buffer("logits").shape == (batch, ODD_VOCAB)
    else:
        assert sampling.buffer("logits_raw").shape == (tp, batch, rows)
        assert sampling.buffer("logits").shape == (batch, rows * tp)


def test_real_model_per_rank_bytes_against_hf_parameter_count():
    """Qwen3-32B at tp 4 (151,936 ids divide; 8 KV heads split 2 a rank): four ranks' weights hold
    HF's parameters once and the norm weights on every rank; at tp 16 each KV head sits on two
    ranks, so the ranks hold the KV projections twice."""
    model = load_model("qwen3-32b")
    reference = hf_model(model, device="meta")
    total = sum(p.numel() for p in reference.parameters())
    kv = sum(p.numel() for n, p in reference.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight")))
    norms = sum(p.numel() for n, p in reference.named_parameters() if n.endswith("norm.weight"))
    serving = load_serving("default", {"tensor_parallel_size": 4, "max_context": 4096})
    plan = build_plan(model, load_hardware("h200"), serving)
    per_rank = sum(b.bytes // 2 for b in plan.pool("weights").buffers)
    assert 4 * per_rank == total + 3 * norms
    serving16 = load_serving("default", {"tensor_parallel_size": 16, "max_context": 4096})
    plan16 = build_plan(model, load_hardware("h200"), serving16)
    per_rank16 = sum(b.bytes // 2 for b in plan16.pool("weights").buffers)
    assert 16 * per_rank16 == total + 15 * norms + kv


def test_linear_attention_heads_must_divide():
    """tiny-qwen3.5 has 2 linear-attention key heads: tp 4 is refused naming them."""
    from planner.errors import ConfigError

    with pytest.raises(ConfigError, match="linear_attention.num_key_heads"):
        _plan(_odd("tiny-qwen3.5"), 4)


def test_nccl_line_budgets_one_communicator_per_rank():
    """tp > 1 adds the hardware's nccl_communicator_bytes as a runtime line; tp 1 has none."""
    hardware = load_hardware("h200")
    model = load_model("qwen3-8b")
    one = build_plan(model, hardware, load_serving("default", {"max_context": 4096}))
    two = build_plan(model, hardware, load_serving("default", {"max_context": 4096, "tensor_parallel_size": 2}))
    assert "nccl_communicator" not in [b.name for b in one.pool("runtime").buffers]
    line = two.pool("runtime").buffer("nccl_communicator")
    assert line.bytes == hardware.nccl_communicator_bytes > 0
