"""The decode delta rule (one row per request) against the float64 recurrence and delta_rule.py's kernel.

Simulator shapes are test_delta_rule's (Hk 2, Hv 4: two value heads per key head, dk = dv = 8).
Blocks: the simulator's default of 2 row groups x 2 chunks (4 threads, 4 state rows each), 4 row
groups x 4 chunks (a tile wider than dv: idle chunks), 8 row groups x 2 chunks (one row each). The
general kernel takes the calls whose state is not contiguous in aligned 16-byte chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.linear_attention.delta_rule import GatedDeltaRule
from executor.kernels.linear_attention.delta_rule_decode import GatedDeltaRuleDecode
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, TOL, assert_close_rel, from_storage, poisoned, to_storage
from tests.kernels.test_delta_rule import DK, DV, HK, HV, make_inputs, ref_delta_rule

cuda = load_cuda()


def launch(rule, qkv, g, beta, state_np, q_indptr, slot_ids, dtype_name, dv=DV):
    """Run ``rule`` on storage copies of the inputs, ``state_np`` in place; return out as float64."""
    out = poisoned((qkv.shape[0], HV, dv), dtype_name)
    rule(to_storage(qkv, dtype_name), g.numpy().copy(), beta.numpy().copy(), state_np,
         np.asarray(q_indptr, np.int32), np.asarray(slot_ids, np.int32), out)
    return from_storage(out, dtype_name)


def decode_rules(dtype_name, **knobs):
    codec = build_codec(dtype_name)
    general = GatedDeltaRule(codec, DK, dk_split=1)
    return GatedDeltaRuleDecode(codec, DK, general, **knobs), general


@pytest.mark.parametrize("dtype_name,knobs", [
    ("float32", {}), ("bfloat16", {}), ("float32", {"row_groups": 4, "dv_tile": 16}), ("bfloat16", {"row_groups": 8}),
])
def test_decode_batch_matches_reference_and_general_kernel(dtype_name, knobs):
    """Four decode requests in slots 4, 0, 2 and a padding request (slot -1) between them; slots 1 and
    3 belong to no request. Grouped heads (Hv 4 over Hk 2); the state is updated in place."""
    gen = torch.Generator().manual_seed(11)
    q_indptr, slot_ids = [0, 1, 2, 3, 4], [4, 0, -1, 2]
    qkv, g, beta, state = make_inputs(gen, 4, 5, dtype_name)
    ours, general = decode_rules(dtype_name, **knobs)
    state_np = state.numpy().copy()
    assert ours.uses_vector(state_np)
    got = launch(ours, qkv, g, beta, state_np, q_indptr, slot_ids, dtype_name)
    got_state = torch.from_numpy(state_np).double()
    real = [0, 1, 3]  # the padding request's row is left as it was (poison): compare the real rows
    ref, ref_state = ref_delta_rule(qkv[real], g[real], beta[real], state, [0, 1, 2, 3], [4, 0, 2], HK, HV, DK, DV)
    assert_close_rel(got[real], ref, TOL[dtype_name])
    assert torch.isnan(got[2]).all()
    assert_close_rel(got_state, ref_state, 1e-5)
    for untouched in (1, 3):
        assert torch.equal(got_state[untouched], state[untouched].double())

    general_state = state.numpy().copy()
    want = launch(general, qkv, g, beta, general_state, q_indptr, slot_ids, dtype_name)
    assert_close_rel(got[real], want[real], TOL[dtype_name] if dtype_name == "bfloat16" else 1e-6)
    assert_close_rel(got_state, torch.from_numpy(general_state).double(), 1e-6)


def test_decode_steps_carry_the_state():
    """Three decode steps of one request carry the state through the slot, as the recurrence does;
    an empty request (q_indptr repeats) beside it is skipped like the general kernel skips it."""
    gen = torch.Generator().manual_seed(12)
    qkv, g, beta, state = make_inputs(gen, 3, 2, "float32")
    state[1] = 0.0  # a fresh request
    ours, _ = decode_rules("float32")
    state_np = state.numpy().copy()
    outs = []
    for t in range(3):
        outs.append(launch(ours, qkv[t : t + 1], g[t : t + 1], beta[t : t + 1], state_np, [0, 1, 1], [1, 0],
                           "float32"))
    ref, ref_state = ref_delta_rule(qkv, g, beta, state, [0, 3], [1], HK, HV, DK, DV)
    assert_close_rel(torch.cat(outs), ref, 1e-5)
    assert_close_rel(torch.from_numpy(state_np).double(), ref_state, 1e-5)
    assert torch.equal(torch.from_numpy(state_np[0]), state[0])  # the empty request's slot


def test_request_of_several_rows_is_set_to_nan():
    """A request of 3 rows is outside the contract (prefill steps take the general kernel): its rows
    become NaN and its state is untouched; the one-row request beside it runs as usual."""
    gen = torch.Generator().manual_seed(13)
    q_indptr, slot_ids = [0, 3, 4], [1, 0]
    qkv, g, beta, state = make_inputs(gen, 4, 2, "float32")
    ours, _ = decode_rules("float32")
    state_np = state.numpy().copy()
    got = launch(ours, qkv, g, beta, state_np, q_indptr, slot_ids, "float32")
    assert torch.isnan(got[:3]).all()
    assert torch.equal(torch.from_numpy(state_np[1]), state[1])
    ref, ref_state = ref_delta_rule(qkv[3:], g[3:], beta[3:], state, [0, 1], [0], HK, HV, DK, DV)
    assert_close_rel(got[3:], ref, 1e-5)
    assert_close_rel(torch.from_numpy(state_np[0]).double(), ref_state[0], 1e-5)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_state_without_16_byte_chunks_runs_the_general_kernel(dtype_name):
    """dv = 6 (rows of 24 bytes) cannot be read in 16-byte chunks: the general kernel runs the call."""
    dv = 6
    gen = torch.Generator().manual_seed(14)
    qkv, g, beta, state = make_inputs(gen, 2, 3, dtype_name, dv=dv)
    ours, _ = decode_rules(dtype_name)
    state_np = state.numpy().copy()
    assert not ours.uses_vector(state_np)
    got = launch(ours, qkv, g, beta, state_np, [0, 1, 2], [2, 0], dtype_name, dv=dv)
    ref, ref_state = ref_delta_rule(qkv, g, beta, state, [0, 1, 2], [2, 0], HK, HV, DK, dv)
    assert_close_rel(got, ref, TOL[dtype_name])
    assert_close_rel(torch.from_numpy(state_np).double(), ref_state, 1e-5)
    assert torch.equal(torch.from_numpy(state_np[1]), state[1])


@pytest.mark.parametrize("layout", ["misaligned", "strided"])
def test_state_not_in_aligned_contiguous_chunks_runs_the_general_kernel(layout):
    """A state view starting 4 bytes past a 16-byte boundary, or one whose rows are padded (aligned
    chunks, but no flat view), goes to the general kernel."""
    gen = torch.Generator().manual_seed(15)
    qkv, g, beta, state = make_inputs(gen, 1, 1, "float32")
    if layout == "misaligned":
        backing = np.zeros(state.numel() + 8, np.float32)
        offset = next(k for k in range(1, 4) if backing[k:].ctypes.data % 16)
        state_arg = backing[offset : offset + state.numel()].reshape(state.shape)
        state_arg[...] = state.numpy()
        result = lambda: state_arg  # noqa: E731
    else:  # a device array: the simulator passes no strided numpy array
        padded = np.zeros((*state.shape[:-1], DV + 4), np.float32)
        padded[..., :DV] = state.numpy()
        backing = cuda.to_device(padded)
        state_arg = backing[:, :, :, :DV]  # device arrays take no Ellipsis
        result = lambda: backing.copy_to_host()[..., :DV]  # noqa: E731
    ours, _ = decode_rules("float32")
    assert not ours.uses_vector(state_arg)
    got = launch(ours, qkv, g, beta, state_arg, [0, 1], [0], "float32")
    ref, ref_state = ref_delta_rule(qkv, g, beta, state, [0, 1], [0], HK, HV, DK, DV)
    assert_close_rel(got, ref, 1e-5)
    assert_close_rel(torch.from_numpy(np.ascontiguousarray(result())).double(), ref_state, 1e-5)


def test_errors_name_the_values():
    codec = build_codec("float32")
    general = GatedDeltaRule(codec, DK)
    with pytest.raises(ValueError, match="row_groups .* head_k_dim 8, got 16"):
        GatedDeltaRuleDecode(codec, DK, general, row_groups=16)
    with pytest.raises(ValueError, match="dv_tile .* got 12"):
        GatedDeltaRuleDecode(codec, DK, general, dv_tile=12)
    ours = GatedDeltaRuleDecode(codec, DK, general)
    qkv = np.zeros((2, 2 * HK * DK + HV * DV), np.float32)
    g = np.zeros((2, HV), np.float32)
    state = np.zeros((1, HV, DK, DV), np.float32)
    ip, sl = np.array([0, 1, 2], np.int32), np.array([0, -1], np.int32)
    out = np.zeros((2, HV, DV), np.float32)
    with pytest.raises(ValueError, match=r"qkv \(2, 63\)"):
        ours(qkv[:, 1:], g, g, state, ip, sl, out)
    with pytest.raises(ValueError, match=r"ssm_state must be \[slots, 4, 8, 8\], got \(1, 4, 4, 8\)"):
        ours(qkv, g, g, state[:, :, :4], ip, sl, out)
    with pytest.raises(ValueError, match="beta"):
        ours(qkv, g, g[:1], state, ip, sl, out)


# ---------------------------------------------------------------- real-GPU compilation (no GPU needed)


@pytest.mark.ptx
def test_decode_delta_rule_compiles_for_sm90():
    """Qwen3.5's dk = dv = 128 in both codecs, the default block (16 row groups x 16 chunks) and two
    others: 16-byte state loads and stores, the state chunks in registers (no local memory)."""
    compile_for_sm90(
        """
        from executor.kernels.linear_attention.delta_rule_decode import build_gated_delta_rule_decode
        i32 = arr("int32", 1)
        f32 = lambda ndim: arr("float32", ndim)
        for name in DTYPES:
            for row_groups, threads in ((16, 256), (16, 512), (32, 256)):
                kernel = build_gated_delta_rule_decode(build_codec(name), 128, 128, row_groups, threads)
                vector_ptx(kernel, arr(name, 2), f32(2), f32(2), f32(1), i32, i32, arr(name, 3))
        """
    )


# ---------------------------------------------------------------- GPU tests at real sizes (bf16)

G_HK, G_HV, G_DK, G_DV = 16, 32, 128, 128  # Qwen3.5-9B's linear heads


@pytest.mark.gpu
def test_gpu_qwen3_5_9b_decode_bf16():
    """8 decode requests (one padding, slot -1) at Qwen3.5-9B's shape against float64 and the general kernel."""
    gen = torch.Generator(device="cuda").manual_seed(16)
    slot_ids = [3, 0, 7, -1, 5, 1, 8, 2]
    rows = len(slot_ids)
    qkv, g, beta, state = make_inputs(gen, rows, 9, "bfloat16", G_HK, G_HV, G_DK, G_DV, device="cuda")
    codec = build_codec("bfloat16")
    general = GatedDeltaRule(codec, G_DK)
    ours = GatedDeltaRuleDecode(codec, G_DK, general)
    assert ours.uses_vector(state)
    ip = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    sl = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    results = []
    for rule in (ours, general):
        st = state.clone()
        out = torch.full((rows, G_HV, G_DV), float("nan"), dtype=torch.bfloat16, device="cuda")
        rule(qkv.view(torch.int16), g, beta, st, ip, sl, out.view(torch.int16))
        torch.cuda.synchronize()
        results.append((out, st))
    (out, st), (general_out, general_st) = results
    real = [r for r, slot in enumerate(slot_ids) if slot >= 0]
    ref, ref_state = ref_delta_rule(qkv[real], g[real], beta[real], state, list(range(len(real) + 1)),
                                    [slot_ids[r] for r in real], G_HK, G_HV, G_DK, G_DV)
    assert_close_rel(out[real].double(), ref, 1e-2)
    assert_close_rel(st.double(), ref_state, 1e-4)
    assert torch.isnan(out[3].float()).all()  # the padding request's row is not written
    for untouched in (4, 6):
        assert torch.equal(st[untouched], state[untouched])
    assert_close_rel(out[real].double(), general_out[real].double(), 1e-2)
    assert_close_rel(st.double(), general_st.double(), 1e-5)
