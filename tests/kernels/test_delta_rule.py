"""Gated DeltaNet gates and recurrent delta rule (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.primitives.codec import build_codec
from executor.kernels.linear_attention.delta_rule import GatedDeltaRule, GdnGates
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import DTYPES, TOL, assert_close_rel, from_storage, poisoned, rounded, to_storage

HK, HV, DK, DV = 2, 4, 8, 8  # simulator shapes


# ---------------------------------------------------------------- helpers


def ref_gates(a, b, A_log, dt_bias):
    """float64 gates: (g, beta)."""
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return g, torch.sigmoid(b.double())


def split_qkv(qkv, hk, hv, dk, dv):
    """[T, conv_dim] -> q, k [T, Hk, dk], v [T, Hv, dv]."""
    rows = qkv.shape[0]
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    return q.reshape(rows, hk, dk), k.reshape(rows, hk, dk), v.reshape(rows, hv, dv)


def ref_delta_rule(qkv, g, beta, state, q_indptr, slot_ids, hk, hv, dk, dv):
    """float64 recurrence from the formulas: (out [T, Hv, dv], new state)."""
    qkv, g, beta, state = qkv.double(), g.double(), beta.double(), state.double().clone()
    q, k, v = split_qkv(qkv, hk, hv, dk, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)  # [T, Hv, dk]
    out = torch.zeros(qkv.shape[0], hv, dv, dtype=torch.float64, device=qkv.device)
    for b, slot in enumerate(list(slot_ids)):
        s = state[slot]  # [Hv, dk, dv], a view: updated in place
        for t in range(int(q_indptr[b]), int(q_indptr[b + 1])):
            s.mul_(g[t].exp()[:, None, None])
            kv = torch.einsum("hkv,hk->hv", s, k[t])
            delta = beta[t][:, None] * (v[t] - kv)
            s.add_(k[t][:, :, None] * delta[:, None, :])
            out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, state


def make_inputs(gen, rows, slots, dtype_name, hk=HK, hv=HV, dk=DK, dv=DV, device="cpu"):
    """Post-conv qkv (storage-rounded), float32 g/beta in HF's ranges, a random float32 state."""
    conv_dim = 2 * hk * dk + hv * dv
    qkv = F.silu(torch.randn(rows, conv_dim, generator=gen, device=device) * 2).to(getattr(torch, dtype_name))
    g = -torch.rand(rows, hv, generator=gen, device=device) * 2.0  # exp(g) in (0.13, 1]
    beta = torch.rand(rows, hv, generator=gen, device=device)
    state = torch.randn(slots, hv, dk, dv, generator=gen, device=device) * 0.5
    return qkv, g, beta, state


def run_rule(rule, qkv, g, beta, state, q_indptr, slot_ids, dtype_name):
    """Launch on numpy copies; return (out, new state) as float64 tensors."""
    state_np = state.numpy().copy()
    out = poisoned((qkv.shape[0], HV, DV), dtype_name)
    rule(
        to_storage(qkv, dtype_name),
        g.numpy().copy(),
        beta.numpy().copy(),
        state_np,
        np.asarray(q_indptr, np.int32),
        np.asarray(slot_ids, np.int32),
        out,
    )
    return from_storage(out, dtype_name), torch.from_numpy(state_np).double()


# ---------------------------------------------------------------- gates


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_gates(dtype_name):
    gen = torch.Generator().manual_seed(1)
    rows = 5
    a = rounded(torch.randn(rows, HV, generator=gen) * 4.0, dtype_name)
    a[0, 0] = 25.0  # past softplus's threshold of 20
    a[0, 1] = -30.0
    b = rounded(torch.randn(rows, HV, generator=gen) * 4.0, dtype_name)
    A_log = rounded(torch.empty(HV).uniform_(0.01, 16, generator=gen).log(), dtype_name)
    dt_bias = rounded(torch.rand(HV, generator=gen) * 2, dtype_name)
    g_out = np.full((rows, HV), np.nan, np.float32)
    beta_out = np.full((rows, HV), np.nan, np.float32)
    s = lambda t: to_storage(t, dtype_name)  # noqa: E731
    GdnGates(build_codec(dtype_name))(s(a), s(b), s(A_log), s(dt_bias), g_out, beta_out)
    g_ref, beta_ref = ref_gates(a, b, A_log, dt_bias)
    assert_close_rel(torch.from_numpy(g_out).double(), g_ref, 1e-6)
    assert_close_rel(torch.from_numpy(beta_out).double(), beta_ref, TOL[dtype_name] / 2)
    # HF: g in float32 from the stored a / A_log / dt_bias; beta = sigmoid in the activation dtype.
    dt = getattr(torch, dtype_name)
    hf_g = -A_log.to(dt).float().exp() * F.softplus(a.to(dt).float() + dt_bias.to(dt))
    torch.testing.assert_close(torch.from_numpy(g_out), hf_g, rtol=2e-6, atol=0)
    assert torch.equal(torch.from_numpy(beta_out), b.to(dt).sigmoid().float())


def test_gates_float32_params_with_bf16_activations():
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(3, HV, generator=gen).bfloat16() for _ in range(2))
    A_log = torch.rand(HV, generator=gen) * 2
    dt_bias = torch.rand(HV, generator=gen)
    g_out, beta_out = np.zeros((3, HV), np.float32), np.zeros((3, HV), np.float32)
    gates = GdnGates(build_codec("bfloat16"), param_codec=build_codec("float32"))
    gates(to_storage(a, "bfloat16"), to_storage(b, "bfloat16"), A_log.numpy(), dt_bias.numpy(), g_out, beta_out)
    g_ref, _ = ref_gates(a, b, A_log, dt_bias)
    assert_close_rel(torch.from_numpy(g_out).double(), g_ref, 1e-6)


# ---------------------------------------------------------------- delta rule


@pytest.mark.parametrize(
    "dtype_name,dv_tile,rows_per_stage,dk_split",
    [("bfloat16", 4, 2, 2), ("float32", 8, 3, 4), ("bfloat16", 32, 8, 1)],
)
def test_batch_matches_reference(dtype_name, dv_tile, rows_per_stage, dk_split):
    """Two requests (3 and 4 rows) in slots 2 and 0 of 3; column tiles smaller, equal and larger
    than dv; stages shorter than, or covering, a request; 1, 2 or 4 threads per state column."""
    gen = torch.Generator().manual_seed(3 + dv_tile)
    q_indptr, slot_ids = [0, 3, 7], [2, 0]
    qkv, g, beta, state = make_inputs(gen, 7, 3, dtype_name)
    rule = GatedDeltaRule(
        build_codec(dtype_name), DK, dv_tile=dv_tile, rows_per_stage=rows_per_stage, dk_split=dk_split
    )
    got, got_state = run_rule(rule, qkv, g, beta, state, q_indptr, slot_ids, dtype_name)
    ref, ref_state = ref_delta_rule(qkv, g, beta, state, q_indptr, slot_ids, HK, HV, DK, DV)
    assert_close_rel(got, ref, TOL[dtype_name])
    assert_close_rel(got_state, ref_state, 1e-5)  # the state is float32 in both codecs
    assert torch.equal(got_state[1], state[1].double())  # a slot of no request is untouched


def test_sequence_equals_decode_steps():
    """A 4-row prefill in one call equals 4 one-row decode calls carrying the state, exactly."""
    gen = torch.Generator().manual_seed(4)
    qkv, g, beta, state = make_inputs(gen, 4, 2, "float32")
    state[1] = 0.0  # a fresh request
    rule = GatedDeltaRule(build_codec("float32"), DK, dv_tile=8)
    whole, whole_state = run_rule(rule, qkv, g, beta, state, [0, 4], [1], "float32")
    carried = state.clone()
    steps = []
    for t in range(4):
        out, carried64 = run_rule(rule, qkv[t : t + 1], g[t : t + 1], beta[t : t + 1], carried, [0, 1], [1], "float32")
        carried = carried64.float()
        steps.append(out)
    assert torch.equal(torch.cat(steps), whole)
    assert torch.equal(carried.double(), whole_state)


def test_matches_hf_recurrent_and_chunked():
    """HF's torch_recurrent_gated_delta_rule and torch_chunk_gated_delta_rule (chunk 4) on the same inputs."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator().manual_seed(5)
    rows = 7
    qkv, g, beta, state = make_inputs(gen, rows, 1, "float32")
    got, got_state = run_rule(GatedDeltaRule(build_codec("float32"), DK), qkv, g, beta, state, [0, rows], [0], "float32")
    q, k, v = split_qkv(qkv, HK, HV, DK, DV)
    q, k = q.repeat_interleave(HV // HK, dim=1), k.repeat_interleave(HV // HK, dim=1)  # as the HF layer does
    args = (q[None], k[None], v[None])
    kwargs = dict(g=g[None], beta=beta[None], initial_state=state.clone(), output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    rec_out, rec_state = hf.torch_recurrent_gated_delta_rule(*args, **kwargs)
    chunk_out, chunk_state = hf.torch_chunk_gated_delta_rule(*args, chunk_size=4, **kwargs)
    for out, st in ((rec_out, rec_state), (chunk_out, chunk_state)):
        assert_close_rel(got, out[0].double(), 1e-5)
        assert_close_rel(got_state, st.double(), 1e-5)


def test_empty_request_and_decode_batch():
    """Decode rows of three requests around an empty one; the empty request's slot is untouched."""
    gen = torch.Generator().manual_seed(6)
    q_indptr, slot_ids = [0, 1, 1, 2, 3], [3, 1, 0, 2]
    qkv, g, beta, state = make_inputs(gen, 3, 4, "float32")
    got, got_state = run_rule(GatedDeltaRule(build_codec("float32"), DK), qkv, g, beta, state, q_indptr, slot_ids, "float32")
    ref, ref_state = ref_delta_rule(qkv, g, beta, state, q_indptr, slot_ids, HK, HV, DK, DV)
    assert_close_rel(got, ref, 1e-5)
    assert_close_rel(got_state, ref_state, 1e-5)
    assert torch.equal(got_state[1], state[1].double())


def test_shape_errors():
    rule = GatedDeltaRule(build_codec("float32"), DK)
    qkv = np.zeros((2, 2 * HK * DK + HV * DV), np.float32)
    g = np.zeros((2, HV), np.float32)
    state = np.zeros((1, HV, DK, DV), np.float32)
    ip, sl = np.array([0, 2], np.int32), np.array([0], np.int32)
    out = np.zeros((2, HV, DV), np.float32)
    with pytest.raises(ValueError, match="qkv"):
        rule(qkv[:, 1:], g, g, state, ip, sl, out)
    with pytest.raises(ValueError, match="ssm_state"):
        rule(qkv, g, g, state[:, :, :4], ip, sl, out)
    with pytest.raises(ValueError, match="beta"):
        rule(qkv, g, g[:1], state, ip, sl, out)
    with pytest.raises(ValueError, match="dv_tile"):
        GatedDeltaRule(build_codec("float32"), DK, dv_tile=48)
    with pytest.raises(ValueError, match="must divide"):
        GatedDeltaRule(build_codec("float32"), 6, dk_split=4)


# ---------------------------------------------------------------- real-GPU compilation (no GPU needed)


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.linear_attention.delta_rule import build_gdn_gates, build_gated_delta_rule
        i32 = arr("int32", 1)
        f32 = lambda ndim: arr("float32", ndim)
        for name in DTYPES:
            c = build_codec(name)
            for param in (name, "float32"):
                pc = build_codec(param)
                ptx(build_gdn_gates(c, pc), arr(name, 2), arr(name, 2), arr(param, 1), arr(param, 1), f32(2), f32(2))
            for split in ((4, 8) if name == "bfloat16" else (4,)):
                text = ptx(build_gated_delta_rule(c, 128, dk_split=split), arr(name, 2), f32(2), f32(2), f32(4),
                           i32, i32, arr(name, 3))
                # Each thread's part of the state column must live in registers, not local memory.
                assert ".local" not in text, f"dk_split={split} spills its state to local memory"
        """
    )


# ---------------------------------------------------------------- GPU tests at real sizes (bf16)

G_HK, G_HV, G_DK, G_DV = 16, 48, 128, 128


def gpu_run(rule, qkv, g, beta, state, q_indptr, slot_ids):
    out = torch.full((qkv.shape[0], G_HV, G_DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    ip = torch.tensor(q_indptr, dtype=torch.int32, device="cuda")
    sl = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    rule(qkv.view(torch.int16), g, beta, state, ip, sl, out.view(torch.int16))
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
def test_gpu_gates_bf16():
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = (torch.randn(1000, G_HV, device="cuda", generator=gen) * 4).bfloat16()
    b = (torch.randn(1000, G_HV, device="cuda", generator=gen) * 4).bfloat16()
    A_log = torch.empty(G_HV, device="cuda").uniform_(0.01, 16, generator=gen).log().bfloat16()
    dt_bias = torch.rand(G_HV, device="cuda", generator=gen).bfloat16()
    g_out = torch.full((1000, G_HV), float("nan"), device="cuda")
    beta_out = torch.full((1000, G_HV), float("nan"), device="cuda")
    i16 = lambda t: t.view(torch.int16)  # noqa: E731
    GdnGates(build_codec("bfloat16"))(i16(a), i16(b), i16(A_log), i16(dt_bias), g_out, beta_out)
    torch.cuda.synchronize()
    hf_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    torch.testing.assert_close(g_out, hf_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta_out, b.sigmoid().float(), rtol=0, atol=2**-8)


@pytest.mark.gpu
def test_gpu_batch_bf16_against_float64():
    """Prefill (300 rows) and decode (1 row) requests in one batch, real head sizes."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    q_indptr, slot_ids = [0, 300, 301, 320], [2, 0, 5]
    qkv, g, beta, state = make_inputs(gen, 320, 6, "bfloat16", G_HK, G_HV, G_DK, G_DV, device="cuda")
    before = state.clone()
    out = gpu_run(GatedDeltaRule(build_codec("bfloat16"), G_DK), qkv, g, beta, state, q_indptr, slot_ids)
    ref, ref_state = ref_delta_rule(qkv, g, beta, before, q_indptr, slot_ids, G_HK, G_HV, G_DK, G_DV)
    assert_close_rel(out.double(), ref, 1e-2)
    assert_close_rel(state.double(), ref_state, 1e-4)
    assert torch.equal(state[1], before[1])


@pytest.mark.gpu
def test_gpu_prompt_against_hf_chunked_then_decode():
    """A 300-token prompt against HF's chunked function, then 2 decode steps against the recurrent one."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator(device="cuda").manual_seed(9)
    qkv, g, beta, state = make_inputs(gen, 302, 1, "bfloat16", G_HK, G_HV, G_DK, G_DV, device="cuda")
    state.zero_()
    rule = GatedDeltaRule(build_codec("bfloat16"), G_DK)
    q, k, v = split_qkv(qkv, G_HK, G_HV, G_DK, G_DV)
    q, k = q.repeat_interleave(G_HV // G_HK, dim=1), k.repeat_interleave(G_HV // G_HK, dim=1)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = gpu_run(rule, qkv[:300], g[:300], beta[:300], state, [0, 300], [0])
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q[None, :300], k[None, :300], v[None, :300], g=g[None, :300], beta=beta[None, :300], **kwargs
    )
    assert_close_rel(out.double(), want[0].double(), 1e-2)
    assert_close_rel(state.double(), want_state[0].double(), 1e-3)
    for t in (300, 301):
        step = gpu_run(rule, qkv[t : t + 1], g[t : t + 1], beta[t : t + 1], state, [0, 1], [0])
        want, want_state = hf.torch_recurrent_gated_delta_rule(
            q[None, t : t + 1], k[None, t : t + 1], v[None, t : t + 1], g=g[None, t : t + 1],
            beta=beta[None, t : t + 1], initial_state=want_state, **kwargs
        )
        assert_close_rel(step.double(), want[0].double(), 1e-2)
