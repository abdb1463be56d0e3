"""Causal depthwise conv1d + SiLU with conv state (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.primitives.codec import build_codec
from executor.kernels.linear_attention.conv1d import CausalConv1d
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, TOL, assert_close_rel, from_storage, poisoned, rounded, to_storage

K = 4


# ---------------------------------------------------------------- helpers


def ref_conv(x, weight, conv_state, q_indptr, slot_ids):
    """float64 reference: (out [T, C], new conv_state) from logical float64 inputs."""
    out = torch.zeros_like(x)
    state = conv_state.clone()
    for b, slot in enumerate(list(slot_ids)):
        start, end = int(q_indptr[b]), int(q_indptr[b + 1])
        if end == start:
            continue
        full = torch.cat([state[slot], x[start:end].T], dim=1)  # [C, K-1+n]
        conv = F.conv1d(full[None], weight[:, None, :], groups=x.shape[1])[0]  # [C, n]
        out[start:end] = F.silu(conv).T
        state[slot] = full[:, -(K - 1) :]
    return out, state


def make_inputs(gen, rows, channels, slots, dtype_name):
    x = rounded(torch.randn(rows, channels, generator=gen) * 2.0, dtype_name)
    weight = rounded(torch.randn(channels, K, generator=gen) * 0.7, dtype_name)
    state = rounded(torch.randn(slots, channels, K - 1, generator=gen) * 2.0, dtype_name)
    return x, weight, state


def run_conv(conv, x, weight, state, q_indptr, slot_ids, dtype_name):
    """Launch on storage copies; return (out, new state) as float64 tensors."""
    state_store = to_storage(state, dtype_name)
    out = poisoned(tuple(x.shape), dtype_name)
    conv(
        to_storage(x, dtype_name),
        to_storage(weight, dtype_name),
        state_store,
        np.asarray(q_indptr, np.int32),
        np.asarray(slot_ids, np.int32),
        out,
    )
    return from_storage(out, dtype_name), from_storage(state_store, dtype_name)


# ---------------------------------------------------------------- simulator tests

CHANNELS = 2 * 2 * 8 + 4 * 8  # Hk=2, Hv=4, dk=dv=8


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("rows_per_tile", [1, 2, 16])
def test_batch_matches_reference(dtype_name, rows_per_tile):
    """Three requests (5, 1, 2 rows) in slots 2, 0, 3 of 4; slot 1 must stay as it was."""
    gen = torch.Generator().manual_seed(10 + rows_per_tile)
    q_indptr, slot_ids = [0, 5, 6, 8], [2, 0, 3]
    x, weight, state = make_inputs(gen, 8, CHANNELS, 4, dtype_name)
    conv = CausalConv1d(build_codec(dtype_name), rows_per_tile=rows_per_tile)
    got, got_state = run_conv(conv, x, weight, state, q_indptr, slot_ids, dtype_name)
    ref, ref_state = ref_conv(x, weight, state, q_indptr, slot_ids)
    assert_close_rel(got, ref, TOL[dtype_name])
    # The state holds copies of stored inputs: bit-exact.
    assert torch.equal(got_state, ref_state)
    assert torch.equal(got_state[1], state[1])


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_decode_rows_then_chunks_as_a_prefill_step_launches_them(dtype_name):
    """A prefill step's leading decode rows (slots 4, 1, 3: a row each) at one row a thread, then its
    chunks (slots 0, 2: 7 and 3 rows) over the same buffers with q_indptr starting at the first chunk
    row and 16 rows a thread, equal the reference over the whole batch; slot 5 stays as it was."""
    gen = torch.Generator().manual_seed(40)
    q_indptr, slot_ids, d = [0, 1, 2, 3, 10, 13], [4, 1, 3, 0, 2], 3
    x, weight, state = make_inputs(gen, 13, CHANNELS, 6, dtype_name)
    conv = CausalConv1d(build_codec(dtype_name))
    x_s, w_s, state_s = (to_storage(t, dtype_name) for t in (x, weight, state))
    out = poisoned(tuple(x.shape), dtype_name)
    indptr, slots = np.asarray(q_indptr, np.int32), np.asarray(slot_ids, np.int32)
    conv(x_s[:d], w_s, state_s, indptr[: d + 1], slots[:d], out[:d], rows_per_tile=1)
    conv(x_s, w_s, state_s, indptr[d:], slots[d:], out, rows_per_tile=16)
    ref, ref_state = ref_conv(x, weight, state, q_indptr, slot_ids)
    assert_close_rel(from_storage(out, dtype_name), ref, TOL[dtype_name])
    got_state = from_storage(state_s, dtype_name)
    assert torch.equal(got_state, ref_state)
    assert torch.equal(got_state[5], state[5])


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_channels_over_two_blocks_the_second_ragged(dtype_name):
    """133 chunks of channels: a full block of 128 threads, then one whose last threads have no channels
    (they still take part in the block's staging of the conv state); decode rows and a chunk."""
    lanes = 8 if dtype_name == "bfloat16" else 4
    gen = torch.Generator().manual_seed(50)
    q_indptr, slot_ids = [0, 1, 2, 7], [1, 2, 0]
    x, weight, state = make_inputs(gen, 7, lanes * 133, 3, dtype_name)
    conv = CausalConv1d(build_codec(dtype_name), rows_per_tile=2)
    got, got_state = run_conv(conv, x, weight, state, q_indptr, slot_ids, dtype_name)
    ref, ref_state = ref_conv(x, weight, state, q_indptr, slot_ids)
    assert_close_rel(got, ref, TOL[dtype_name])
    assert torch.equal(got_state, ref_state)


def test_rows_per_tile_below_one_is_refused_per_call():
    conv = CausalConv1d(build_codec("float32"))
    x = np.zeros((2, CHANNELS), np.float32)
    with pytest.raises(ValueError, match="rows_per_tile must be >= 1, got 0"):
        conv(x, np.zeros((CHANNELS, K), np.float32), np.zeros((1, CHANNELS, K - 1), np.float32),
             np.asarray([0, 2], np.int32), np.asarray([0], np.int32), np.zeros_like(x), rows_per_tile=0)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_chunk_a_thread_build_equals_channel_a_thread_build(dtype_name):
    """68 channels (not whole 16-byte chunks of bf16 or float32 rows) run the channel-a-thread build;
    their first 64 (whole chunks) through the chunk-a-thread build give the same bits, outputs and
    states, at a tile boundary inside a request."""
    gen = torch.Generator().manual_seed(30)
    q_indptr, slot_ids = [0, 5, 6, 11], [2, 0, 3]
    x, weight, state = make_inputs(gen, 11, 68, 4, dtype_name)
    scalar, vector = (CausalConv1d(build_codec(dtype_name), rows_per_tile=4) for _ in range(2))
    got, got_state = run_conv(scalar, x, weight, state, q_indptr, slot_ids, dtype_name)
    sub = (x[:, :64].contiguous(), weight[:64].contiguous(), state[:, :64].contiguous())
    got_vector, got_vector_state = run_conv(vector, *sub, q_indptr, slot_ids, dtype_name)
    assert torch.equal(got[:, :64], got_vector)
    assert torch.equal(got_state[:, :64], got_vector_state)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_chunks_continue_like_one_pass(dtype_name):
    """Chunks of 1, 2, 3, 1 rows carrying conv_state equal one pass over the 7 rows, exactly."""
    gen = torch.Generator().manual_seed(20)
    x, weight, state = make_inputs(gen, 7, CHANNELS, 2, dtype_name)
    state[1] = 0.0  # a freshly admitted request starts from a zeroed slot
    conv = CausalConv1d(build_codec(dtype_name), rows_per_tile=2)
    whole, whole_state = run_conv(conv, x, weight, state, [0, 7], [1], dtype_name)

    carried = state.clone()
    pieces, start = [], 0
    for n in (1, 2, 3, 1):
        out, carried = run_conv(conv, x[start : start + n], weight, carried, [0, n], [1], dtype_name)
        pieces.append(out)
        start += n
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(carried, whole_state)
    ref, _ = ref_conv(x, weight, state, [0, 7], [1])
    assert_close_rel(whole, ref, TOL[dtype_name])


def test_decode_batch_and_empty_request():
    """Decode (one row per request) with an empty request in the middle, which keeps its slot."""
    gen = torch.Generator().manual_seed(30)
    q_indptr, slot_ids = [0, 1, 1, 2, 3], [3, 1, 0, 2]
    x, weight, state = make_inputs(gen, 3, CHANNELS, 4, "float32")
    conv = CausalConv1d(build_codec("float32"))
    got, got_state = run_conv(conv, x, weight, state, q_indptr, slot_ids, "float32")
    ref, ref_state = ref_conv(x, weight, state, q_indptr, slot_ids)
    assert_close_rel(got, ref, TOL["float32"])
    assert torch.equal(got_state, ref_state)
    assert torch.equal(got_state[1], state[1])


def test_padding_rows_untouched():
    """Rows past q_indptr[B] (graph padding) are neither read nor written."""
    gen = torch.Generator().manual_seed(40)
    x, weight, state = make_inputs(gen, 4, CHANNELS, 1, "float32")
    conv = CausalConv1d(build_codec("float32"), rows_per_tile=1)
    got, _ = run_conv(conv, x, weight, state, [0, 2], [0], "float32")
    assert torch.isnan(got[2:]).all()
    ref, _ = ref_conv(x[:2], weight, state, [0, 2], [0])
    assert_close_rel(got[:2], ref, TOL["float32"])


def test_matches_hf_update_and_fn():
    """HF's torch causal_conv1d_fn (prefill) then causal_conv1d_update (decode) on the same inputs."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator().manual_seed(50)
    x, weight, _ = make_inputs(gen, 6, CHANNELS, 1, "float32")
    zero = torch.zeros(1, CHANNELS, K - 1, dtype=torch.float64)
    conv = CausalConv1d(build_codec("float32"))
    got, state = run_conv(conv, x[:5], weight, zero, [0, 5], [0], "float32")
    step, state = run_conv(conv, x[5:], weight, state, [0, 1], [0], "float32")

    xf, wf = x.float().T[None], weight.float()
    want = hf.causal_conv1d_fn(xf[:, :, :5], wf, None, activation="silu")[0].T
    hf_state = torch.cat([torch.zeros(1, CHANNELS, 1), xf[:, :, :5]], dim=-1)[:, :, -K:].clone()  # HF keeps K
    want_step = hf.causal_conv1d_update(xf[:, :, 5:], hf_state, wf, None, "silu")[0].T
    assert_close_rel(got, want.double(), 1e-5)
    assert_close_rel(step, want_step.double(), 1e-5)
    assert torch.equal(state[0].float(), hf_state[0, :, 1:])


def run_decode(conv, x, weight, state, slot_ids, dtype_name):
    """``conv.decode`` on storage copies (row b request b's one row); (out, new state) as float64."""
    state_store = to_storage(state, dtype_name)
    out = poisoned(tuple(x.shape), dtype_name)
    rows = x.shape[0]
    conv.decode(to_storage(x, dtype_name), to_storage(weight, dtype_name), state_store,
                np.arange(rows + 1, dtype=np.int32), np.asarray(slot_ids, np.int32), out)
    return from_storage(out, dtype_name), from_storage(state_store, dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_decode_build_matches_reference_and_the_general_build(dtype_name):
    """Decode rows in slots 4, 1, 3 and a padding row (slot -1) over two blocks of channels, the second
    ragged: the decode build runs (aligned chunks), equals the reference, and gives the general build's
    bits; the padding row's output and the untouched slots 0, 2 stay as they were."""
    lanes = 8 if dtype_name == "bfloat16" else 4
    gen = torch.Generator().manual_seed(60)
    slot_ids = [4, 1, -1, 3]
    x, weight, state = make_inputs(gen, 4, lanes * 133, 5, dtype_name)
    conv = CausalConv1d(build_codec(dtype_name))
    assert conv.decode_views(to_storage(x, dtype_name), to_storage(weight, dtype_name),
                             to_storage(state, dtype_name), poisoned(tuple(x.shape), dtype_name)) is not None
    got, got_state = run_decode(conv, x, weight, state, slot_ids, dtype_name)
    rows = [0, 1, 3]
    ref, ref_state = ref_conv(x[rows], weight, state, [0, 1, 2, 3], [4, 1, 3])
    assert_close_rel(got[rows], ref, TOL[dtype_name])
    assert torch.equal(got_state, ref_state)
    assert torch.isnan(got[2]).all()
    general, general_state = run_conv(conv, x, weight, state, [0, 1, 2, 3, 4], slot_ids, dtype_name)
    assert torch.equal(got[rows], general[rows])
    assert torch.equal(got_state, general_state)


def test_decode_of_misaligned_rows_runs_the_general_build():
    """Rows of 66 float32 channels (not whole 16-byte chunks) have no decode views; decode still gives the
    reference through the channel-a-thread build."""
    gen = torch.Generator().manual_seed(61)
    x, weight, state = make_inputs(gen, 3, 66, 3, "float32")
    conv = CausalConv1d(build_codec("float32"))
    stored = [to_storage(t, "float32") for t in (x, weight, state, x)]
    assert conv.decode_views(*stored) is None
    got, got_state = run_decode(conv, x, weight, state, [2, 0, 1], "float32")
    ref, ref_state = ref_conv(x, weight, state, [0, 1, 2, 3], [2, 0, 1])
    assert_close_rel(got, ref, TOL["float32"])
    assert torch.equal(got_state, ref_state)


def test_decode_state_slots_off_16_bytes_run_the_general_build():
    """conv_state slots of a wider buffer (each slot's channels contiguous, slots 198 bytes apart) have no
    decode views; decode gives the general build's bits and leaves the buffer's extra channel alone."""
    gen = torch.Generator().manual_seed(62)
    x, weight, state = make_inputs(gen, 2, 32, 2, "bfloat16")
    conv = CausalConv1d(build_codec("bfloat16"))
    # torch views (the simulator takes a strided torch view as it is; a strided numpy array it would copy)
    wide = torch.from_numpy(to_storage(torch.cat([state, torch.ones(2, 1, K - 1, dtype=state.dtype)], dim=1),
                                       "bfloat16"))
    slots = wide[:, :32, :]
    x_s, w_s, out = to_storage(x, "bfloat16"), to_storage(weight, "bfloat16"), poisoned((2, 32), "bfloat16")
    assert conv.decode_views(x_s, w_s, slots, out) is None
    conv.decode(x_s, w_s, slots, np.arange(3, dtype=np.int32), np.asarray([1, 0], np.int32), out)
    general, general_state = run_conv(conv, x, weight, state, [0, 1, 2], [1, 0], "bfloat16")
    assert torch.equal(from_storage(out, "bfloat16"), general)
    assert torch.equal(from_storage(wide.numpy(), "bfloat16")[:, :32], general_state)
    assert (from_storage(wide.numpy(), "bfloat16")[:, 32] == 1).all()


def test_decode_refuses_rows_that_are_not_one_a_request():
    conv = CausalConv1d(build_codec("float32"))
    x = np.zeros((3, CHANNELS), np.float32)
    with pytest.raises(ValueError, match="3 rows for 2 requests"):
        conv.decode(x, np.zeros((CHANNELS, K), np.float32), np.zeros((2, CHANNELS, K - 1), np.float32),
                    np.asarray([0, 1, 3], np.int32), np.asarray([0, 1], np.int32), np.zeros_like(x))


def test_shape_errors():
    conv = CausalConv1d(build_codec("float32"))
    x = np.zeros((2, 8), np.float32)
    ok = dict(weight=np.zeros((8, K), np.float32), conv_state=np.zeros((1, 8, K - 1), np.float32))
    ip, sl = np.array([0, 2], np.int32), np.array([0], np.int32)
    with pytest.raises(ValueError, match="weight"):
        conv(x, np.zeros((8, 3), np.float32), ok["conv_state"], ip, sl, x.copy())
    with pytest.raises(ValueError, match="conv_state"):
        conv(x, ok["weight"], np.zeros((1, 8, K), np.float32), ip, sl, x.copy())
    with pytest.raises(ValueError, match="q_indptr"):
        conv(x, ok["weight"], ok["conv_state"], np.array([0, 1, 2], np.int32), sl, x.copy())


# ---------------------------------------------------------------- real-GPU compilation (no GPU needed)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.linear_attention.conv1d import (build_causal_conv1d, build_causal_conv1d_decode,
                                                              build_causal_conv1d_vector)
        i32 = arr("int32", 1)
        for name in DTYPES:
            args = (arr(name, 2), arr(name, 2), arr(name, 3), i32, i32, arr(name, 2), types.int64)
            ptx(build_causal_conv1d(build_codec(name)), *args)
            text = ptx(build_causal_conv1d_vector(build_codec(name)), *args)
            assert ".local" not in text, f"{name}: local memory"
            text = ptx(build_causal_conv1d_decode(build_codec(name)), arr(name, 2), arr(name, 2), arr(name, 2), i32,
                       arr(name, 2))
            assert ".local" not in text, f"{name}: decode build, local memory"
        """
    )


# ---------------------------------------------------------------- GPU tests at real sizes (bf16)

GPU_CHANNELS = 2 * 16 * 128 + 48 * 128  # Hk=16, Hv=48, dk=dv=128


def gpu_inputs(rows, slots, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, GPU_CHANNELS, device="cuda", generator=gen) * 2).bfloat16()
    weight = (torch.randn(GPU_CHANNELS, K, device="cuda", generator=gen) * 0.5).bfloat16()
    state = (torch.randn(slots, GPU_CHANNELS, K - 1, device="cuda", generator=gen) * 2).bfloat16()
    return x, weight, state


def gpu_run(conv, x, weight, state, q_indptr, slot_ids):
    out = torch.full_like(x, float("nan"))
    ip = torch.tensor(q_indptr, dtype=torch.int32, device="cuda")
    sl = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    conv(x.view(torch.int16), weight.view(torch.int16), state.view(torch.int16), ip, sl, out.view(torch.int16))
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
def test_gpu_prefill_batch_bf16():
    """Requests of 300, 1, 37 and 700 rows, tiles of 16 rows: against the float64 reference."""
    q_indptr, slot_ids = [0, 300, 301, 338, 1038], [5, 0, 3, 1]
    x, weight, state = gpu_inputs(1038, 6, 60)
    before = state.clone()
    out = gpu_run(CausalConv1d(build_codec("bfloat16")), x, weight, state, q_indptr, slot_ids)
    ref, ref_state = ref_conv(x.double().cpu(), weight.double().cpu(), before.double().cpu(), q_indptr, slot_ids)
    assert_close_rel(out.double().cpu(), ref, 1e-2)
    assert torch.equal(state.double().cpu(), ref_state)


@pytest.mark.gpu
def test_gpu_decode_build_equals_the_general_build_bf16():
    """256 decode rows (the last a padding row) in permuted slots: the decode build gives the general
    build's bits, outputs and states."""
    rows = 256
    x, weight, state = gpu_inputs(rows, rows, 62)
    slots = torch.randperm(rows, generator=torch.Generator().manual_seed(62)).tolist()
    slots[-1] = -1
    conv = CausalConv1d(build_codec("bfloat16"))
    general_state = state.clone()
    general = gpu_run(conv, x, weight, general_state, list(range(rows + 1)), slots)
    out = torch.full_like(x, float("nan"))
    words = [t.view(torch.int16) for t in (x, weight, state)]
    assert conv.decode_views(words[0], words[1], words[2], out.view(torch.int16)) is not None
    conv.decode(*words, torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
                torch.tensor(slots, dtype=torch.int32, device="cuda"), out.view(torch.int16))
    torch.cuda.synchronize()
    assert torch.equal(out[:-1], general[:-1])
    assert torch.isnan(out[-1]).all()
    assert torch.equal(state, general_state)


@pytest.mark.gpu
def test_gpu_decode_continues_prefill_bf16():
    """A 300-token prompt then 3 decode steps equal one 303-row pass, bit for bit."""
    x, weight, state = gpu_inputs(303, 2, 61)
    state.zero_()
    conv = CausalConv1d(build_codec("bfloat16"))
    carried = state.clone()
    whole = gpu_run(conv, x, weight, state, [0, 303], [1])
    pieces = [gpu_run(conv, x[:300], weight, carried, [0, 300], [1])]
    pieces += [gpu_run(conv, x[t : t + 1], weight, carried, [0, 1], [1]) for t in range(300, 303)]
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(carried, state)
