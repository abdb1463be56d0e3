"""The chunked gated delta rule against a float64 recurrence (simulator at tiny shapes: the float32
build and the tensor-core build on emulated mma.sync; GPU: bf16 at Qwen3.5 sizes, against the
recurrent kernel, float64 and, where it is installed, flash-linear-attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.kernels.linear_attention.chunked_delta_rule import (
    GPU_SHAPE, ROW_SCALARS, ChunkScratch, ChunkShape, ChunkedGatedDeltaRule, check_shape, shared_layouts)
from executor.kernels.linear_attention.delta_rule import GatedDeltaRule
from executor.kernels.linear_attention.delta_rule_decode import GatedDeltaRuleDecode
from executor.kernels.primitives.codec import build_codec
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import TOL, assert_close_rel, from_storage, poisoned, to_storage

C = 8  # the float32 build's chunk in these tests
FLOAT32_SHAPE = ChunkShape(chunk=C, dv_tile=8, warps=1, solve_block=4)  # two diagonal blocks: the merge runs
LENGTHS = [1, C - 1, C, C + 1, 3 * C + 5]  # at chunk boundaries and off them


# ---------------------------------------------------------------- the reference


def recurrence(qkv, g, beta, state, q_indptr, slot_ids, hk, hv, dk, dv):
    """float64 outputs [T, Hv, dv] and states of delta_rule.py's recurrence, written from its docstring:
    q, k L2-normalised (eps 1e-6), q scaled by dk^-0.5, value head h reads key head h // (Hv // Hk);
    per row: S *= exp(g); delta = beta (v - S^T k); S += k delta^T; o = S^T q."""
    qkv, g, beta, state = qkv.double(), g.double(), beta.double(), state.double().clone()
    rows = qkv.shape[0]
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(rows, hk, dk), k.reshape(rows, hk, dk), v.reshape(rows, hv, dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    key_head = torch.arange(hv, device=qkv.device) // (hv // hk)
    out = torch.zeros(rows, hv, dv, dtype=torch.float64, device=qkv.device)
    for b, slot in enumerate(slot_ids):
        s = state[slot]  # [Hv, dk, dv], a view
        for t in range(int(q_indptr[b]), int(q_indptr[b + 1])):
            kt, qt = k[t, key_head], q[t, key_head]  # [Hv, dk]
            s *= g[t].exp()[:, None, None]
            delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, kt))
            s += kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qt)
    return out, state


def inputs(gen, rows, slots, dtype_name, hk, hv, dk, dv, device="cpu"):
    """Post-conv qkv (storage-rounded), g and beta in HF's ranges, a random float32 state per slot."""
    qkv = F.silu(torch.randn(rows, 2 * hk * dk + hv * dv, generator=gen, device=device) * 2).to(getattr(torch,
                                                                                                      dtype_name))
    g = -torch.rand(rows, hv, generator=gen, device=device) * 1.5  # exp(g) in (0.22, 1]
    beta = torch.rand(rows, hv, generator=gen, device=device)
    state = torch.randn(slots, hv, dk, dv, generator=gen, device=device) * 0.5
    return qkv, g, beta, state


SCRATCH_CHUNK = 64  # the plan's delta_rule_chunk: wider than the simulator's chunks, as in a plan


def scratch(rows, hv, chunk=SCRATCH_CHUNK, device=None):
    """The tensor-core build's scratch, poisoned (NaN bits): a value the scan reads that the prepare
    pass did not write shows up in the output. numpy arrays, or torch tensors on ``device``."""
    transform, gram = poisoned((rows, hv, chunk), "bfloat16"), poisoned((rows, hv, chunk), "bfloat16")
    scalars = np.full((rows, hv, ROW_SCALARS), np.nan, np.float32)
    if device is not None:
        return ChunkScratch(*(torch.from_numpy(a).to(device) for a in (transform, gram, scalars)))
    return ChunkScratch(transform, gram, scalars)


def run(rule, qkv, g, beta, state, q_indptr, slot_ids, dtype_name, hv, dv):
    """Launch on numpy copies; (out, new state) as float64 tensors."""
    state_np = state.numpy().copy()
    out = poisoned((qkv.shape[0], hv, dv), dtype_name)
    extra = {"scratch": scratch(qkv.shape[0], hv)} if getattr(rule, "tensor_cores", False) else {}
    rule(to_storage(qkv, dtype_name), g.numpy().copy(), beta.numpy().copy(), state_np,
         np.asarray(q_indptr, np.int32), np.asarray(slot_ids, np.int32), out, **extra)
    return from_storage(out, dtype_name), torch.from_numpy(state_np).double()


def indptr(lengths):
    return np.cumsum([0, *lengths]).tolist()


# ---------------------------------------------------------------- the float32 build (simulator)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_float32_build_matches_the_recurrence(group):
    """Five requests of 1, C - 1, C, C + 1 and 3C + 5 rows in one launch, in permuted slots from random
    states (slot 3 belongs to no request and stays untouched); Hv = group x Hk; dv 12 in tiles of 8
    (a ragged last tile)."""
    hk, dk, dv = 1, 8, 12
    hv = group * hk
    gen = torch.Generator().manual_seed(10 + group)
    slots = [4, 0, 2, 5, 1]
    qkv, g, beta, state = inputs(gen, sum(LENGTHS), 6, "float32", hk, hv, dk, dv)
    rule = ChunkedGatedDeltaRule(build_codec("float32"), dk, shape=FLOAT32_SHAPE)
    got, got_state = run(rule, qkv, g, beta, state, indptr(LENGTHS), slots, "float32", hv, dv)
    ref, ref_state = recurrence(qkv, g, beta, state, indptr(LENGTHS), slots, hk, hv, dk, dv)
    assert_close_rel(got, ref, TOL["float32"])
    assert_close_rel(got_state, ref_state, TOL["float32"])
    assert torch.equal(got_state[3], state[3].double())


def test_prefill_split_over_steps_then_decode():
    """Request A's 3C + 5 rows prefilled over three steps of 5, 13 and 11 rows (each step's rows start
    off a chunk boundary of the request), request B's 9 rows fresh from a zeroed slot in the second
    step; then two decode steps of both through the decode kernel (delta_rule_decode.py). Every
    output row and the final states against one float64 recurrence over the whole sequences."""
    hk, hv, dk, dv = 1, 2, 8, 8
    gen = torch.Generator().manual_seed(20)
    a_len, b_len = 3 * C + 5 + 2, 9 + 2
    qkv_a, g_a, beta_a, state = inputs(gen, a_len, 2, "float32", hk, hv, dk, dv)
    qkv_b, g_b, beta_b, _ = inputs(gen, b_len, 1, "float32", hk, hv, dk, dv)
    state[1] = 0.0  # B is admitted with no prior tokens
    codec = build_codec("float32")
    chunked = ChunkedGatedDeltaRule(codec, dk, shape=FLOAT32_SHAPE)
    decode = GatedDeltaRuleDecode(codec, dk, GatedDeltaRule(codec, dk, dk_split=1))
    # Steps as (rule, [(request, first row, rows)]); A is slot 0, B slot 1.
    steps = [(chunked, [("a", 0, 5)]), (chunked, [("b", 0, 9), ("a", 5, 13)]), (chunked, [("a", 18, 11)]),
             (decode, [("a", 29, 1), ("b", 9, 1)]), (decode, [("a", 30, 1), ("b", 10, 1)])]
    data = {"a": (qkv_a, g_a, beta_a, 0), "b": (qkv_b, g_b, beta_b, 1)}
    outs = {"a": [None] * a_len, "b": [None] * b_len}
    carried = state.clone()
    for rule, parts in steps:
        pick = lambda i: torch.cat([data[r][i][first:first + n] for r, first, n in parts])  # noqa: E731
        lengths = [n for _, _, n in parts]
        slots = [data[r][3] for r, _, _ in parts]
        out, new_state = run(rule, pick(0), pick(1), pick(2), carried, indptr(lengths), slots, "float32", hv, dv)
        carried = new_state.float()
        row = 0
        for r, first, n in parts:
            for i in range(n):
                outs[r][first + i] = out[row + i]
            row += n
    q_all = torch.cat([qkv_a, qkv_b])
    g_all, beta_all = torch.cat([g_a, g_b]), torch.cat([beta_a, beta_b])
    ref, ref_state = recurrence(q_all, g_all, beta_all, state, [0, a_len, a_len + b_len], [0, 1], hk, hv, dk, dv)
    got = torch.stack(outs["a"] + outs["b"])
    assert_close_rel(got, ref, TOL["float32"])
    assert_close_rel(carried.double(), ref_state, TOL["float32"])


def test_padding_and_empty_requests_are_skipped():
    """A graph's padding request (slot -1) and an empty request leave their rows and slots alone."""
    hk, hv, dk, dv = 1, 1, 8, 8
    gen = torch.Generator().manual_seed(21)
    qkv, g, beta, state = inputs(gen, 12, 3, "float32", hk, hv, dk, dv)
    lengths, slots = [9, 0, 3], [2, 0, -1]
    got, got_state = run(ChunkedGatedDeltaRule(build_codec("float32"), dk, shape=FLOAT32_SHAPE), qkv, g, beta, state,
                         indptr(lengths), slots, "float32", hv, dv)
    ref, ref_state = recurrence(qkv[:9], g[:9], beta[:9], state, [0, 9], [2], hk, hv, dk, dv)
    assert_close_rel(got[:9], ref, TOL["float32"])
    assert torch.isnan(got[9:]).all()
    assert_close_rel(got_state, ref_state, TOL["float32"])
    assert torch.equal(got_state[:2], state[:2].double())


# ---------------------------------------------------------------- the tensor-core build (simulator, emulated mma)


@pytest.mark.parametrize("hk,hv,lengths,slots", [(1, 2, [1, 15, 16, 17, 53], [3, 1, 0, 4, 2]),
                                                 (1, 3, [17, 5], [1, 0])])
def test_tensor_core_build_matches_the_recurrence_in_the_simulator(hk, hv, lengths, slots):
    """bf16 on (emulated) mma.sync: one warp, 16-row chunks, dk = dv = 16, requests from random states:
    of 1, 15, 16, 17 and 53 rows at Hv / Hk = 2, and of 17 and 5 rows at Hv / Hk = 3 (value head h
    reads key head h // 3)."""
    dk, dv = 16, 16
    gen = torch.Generator().manual_seed(30)
    qkv, g, beta, state = inputs(gen, sum(lengths), len(lengths), "bfloat16", hk, hv, dk, dv)
    rule = ChunkedGatedDeltaRule(build_codec("bfloat16"), dk, shape=ChunkShape(16, 16, 1, 8))
    got, got_state = run(rule, qkv, g, beta, state, indptr(lengths), slots, "bfloat16", hv, dv)
    ref, ref_state = recurrence(qkv, g, beta, state, indptr(lengths), slots, hk, hv, dk, dv)
    assert_close_rel(got, ref, TOL["bfloat16"])
    assert_close_rel(got_state, ref_state, TOL["bfloat16"])


@pytest.mark.parametrize("buffers", [2, 1])
def test_tensor_core_warps_share_the_tiles_in_the_simulator(buffers):
    """Four warps: two row groups of the chunk's 16-row tiles and two column halves of every product
    (the GPU shape's split); 32-row chunks, dk = dv = 32, one request of 40 rows (a full and a partial
    chunk); the scan with two buffers and with one."""
    hk, hv, dk, dv = 1, 1, 32, 32
    gen = torch.Generator().manual_seed(31)
    qkv, g, beta, state = inputs(gen, 40, 1, "bfloat16", hk, hv, dk, dv)
    shape = ChunkShape(chunk=32, dv_tile=32, warps=4, solve_block=8, buffers=buffers)
    got, got_state = run(ChunkedGatedDeltaRule(build_codec("bfloat16"), dk, shape=shape), qkv, g, beta, state,
                         [0, 40], [0], "bfloat16", hv, dv)
    ref, ref_state = recurrence(qkv, g, beta, state, [0, 40], [0], hk, hv, dk, dv)
    assert_close_rel(got, ref, TOL["bfloat16"])
    assert_close_rel(got_state, ref_state, TOL["bfloat16"])


@pytest.mark.parametrize("lengths,narrow", [([20], True), ([20, 3, 9], False)])
def test_tensor_core_scan_routes_by_the_wide_grid(lengths, narrow):
    """A launcher with a narrow scan shape (16 state columns a block to the shape's 32) runs it where
    the wide scan's grid leaves two SMs a block (the simulator has 2): one request at one value head
    is 1 wide block, three requests 3. Either way the result is the recurrence's."""
    hk, hv, dk, dv = 1, 1, 16, 32
    gen = torch.Generator().manual_seed(32)
    qkv, g, beta, state = inputs(gen, sum(lengths), len(lengths), "bfloat16", hk, hv, dk, dv)
    wide, thin = ChunkShape(16, 32, 1, 8), ChunkShape(16, 16, 1, 8)
    rule = ChunkedGatedDeltaRule(build_codec("bfloat16"), dk, shape=wide, narrow_shape=thin)
    assert rule.scan_shape(dv, hv, len(lengths)) == (thin if narrow else wide)
    slots = list(range(len(lengths)))
    got, got_state = run(rule, qkv, g, beta, state, indptr(lengths), slots, "bfloat16", hv, dv)
    ref, ref_state = recurrence(qkv, g, beta, state, indptr(lengths), slots, hk, hv, dk, dv)
    assert_close_rel(got, ref, TOL["bfloat16"])
    assert_close_rel(got_state, ref_state, TOL["bfloat16"])


def test_narrow_scan_shape_must_share_the_prepare_pass():
    with pytest.raises(ValueError, match="must share the chunk, warps and solve block"):
        ChunkedGatedDeltaRule(build_codec("bfloat16"), 16, shape=ChunkShape(16, 16, 1, 8),
                              narrow_shape=ChunkShape(16, 16, 1, 4))


def test_launches_are_named_in_order():
    """What bench/delta_rule.py times apart: bf16 on aligned rows runs prepare then scan, the float32
    build one chunked launch, misaligned rows the recurrent fallback, an empty call nothing."""
    hk, hv, dk, dv = 1, 1, 16, 16
    gen = torch.Generator().manual_seed(33)
    qkv, g, beta, state = inputs(gen, 5, 1, "bfloat16", hk, hv, dk, dv)
    state_np, g_np, beta_np = state.numpy().copy(), g.numpy().copy(), beta.numpy().copy()
    out = poisoned((5, hv, dv), "bfloat16")
    batch = (np.asarray([0, 5], np.int32), np.asarray([0], np.int32))
    codec = build_codec("bfloat16")
    tensor_cores = ChunkedGatedDeltaRule(codec, dk, fallback=GatedDeltaRule(codec, dk), shape=ChunkShape(16, 16, 1, 8))
    stored = to_storage(qkv, "bfloat16")
    names = [name for name, _ in tensor_cores.launches(stored, g_np, beta_np, state_np, *batch, out,
                                                       scratch=scratch(5, hv))]
    assert names == ["prepare", "scan"]
    wide = np.zeros((5, stored.shape[1] + 1), np.int16)[:, 1:]
    assert [name for name, _ in tensor_cores.launches(wide, g_np, beta_np, state_np, *batch, out)] == ["recurrent"]
    float32 = ChunkedGatedDeltaRule(build_codec("float32"), dk, shape=FLOAT32_SHAPE)
    qkv32 = to_storage(qkv, "float32")
    assert [name for name, _ in float32.launches(qkv32, g_np, beta_np, state_np, *batch,
                                                 poisoned((5, hv, dv), "float32"))] == ["chunked"]
    empty = (np.asarray([0, 0], np.int32), np.asarray([0], np.int32))
    assert float32.launches(qkv32[:0], g_np[:0], beta_np[:0], state_np, *empty,
                            poisoned((0, hv, dv), "float32")) == []


def test_misaligned_qkv_runs_the_fallback():
    """A qkv view whose rows are not 16-byte aligned goes to the recurrent launcher, unchanged."""
    calls = []
    rule = ChunkedGatedDeltaRule(build_codec("bfloat16"), 16, fallback=lambda *args, **kw: calls.append(args),
                                 shape=ChunkShape(16, 16, 1, 8))
    qkv = np.zeros((2, 2 * 16 + 16 + 1), np.int16)[:, 1:]
    g = np.zeros((2, 1), np.float32)
    rule(qkv, g, g, np.zeros((1, 1, 16, 16), np.float32), np.array([0, 2], np.int32), np.array([0], np.int32),
         np.zeros((2, 1, 16), np.int16))
    assert len(calls) == 1 and calls[0][0] is qkv


def test_shape_errors_name_the_shape():
    with pytest.raises(ValueError, match="solve_block 6 must be a multiple of 4"):
        check_shape(16, ChunkShape(16, 16, 1, 6), tensor_cores=False)
    with pytest.raises(ValueError, match="dividing chunk 24"):
        check_shape(16, ChunkShape(24, 16, 1, 16), tensor_cores=False)
    with pytest.raises(ValueError, match="head_k_dim 24 must be a multiple of 16"):
        check_shape(24, ChunkShape(16, 16, 1, 8), tensor_cores=True)
    with pytest.raises(ValueError, match="2 warps cannot take one of 3 row tiles each"):
        check_shape(16, ChunkShape(48, 16, 2, 16), tensor_cores=True)
    with pytest.raises(ValueError, match="shared memory"):
        check_shape(256, ChunkShape(128, 128, 16, 16), tensor_cores=True)
    rule = ChunkedGatedDeltaRule(build_codec("bfloat16"), 16, shape=ChunkShape(16, 16, 1, 8))
    with pytest.raises(ValueError, match="dv 24 must be a multiple of the dv tile 16"):
        rule.kernel(24)


def test_gpu_shape_fits_the_sm():
    """Qwen3.5's heads (dk 128) at the GPU shape: the scan in one block's shared memory (227 KiB),
    the prepare pass twice an SM (228 KiB less 1 KiB a block)."""
    check_shape(128, GPU_SHAPE, tensor_cores=True)
    prepare, scan = shared_layouts(128, GPU_SHAPE, True)
    assert scan.bytes <= 227 * 1024
    assert 2 * (prepare.bytes + 1024) <= 228 * 1024


def test_missing_or_short_scratch_is_refused():
    """The tensor-core build names the scratch it lacks, or the array too small and the shape it needs."""
    rule = ChunkedGatedDeltaRule(build_codec("bfloat16"), 16, shape=ChunkShape(16, 16, 1, 8))
    qkv = np.zeros((4, 3 * 16), np.int16)
    g = np.zeros((4, 1), np.float32)
    args = (qkv, g, g, np.zeros((1, 1, 16, 16), np.float32), np.array([0, 4], np.int32), np.array([0], np.int32),
            np.zeros((4, 1, 16), np.int16))
    with pytest.raises(ValueError, match="needs its ChunkScratch"):
        rule(*args)
    short = scratch(4, 1, chunk=8)
    with pytest.raises(ValueError, match=r"scratch transform \(4, 1, 8\) must be \[>= 4, 1, >= 16\]"):
        rule(*args, scratch=short)


# ---------------------------------------------------------------- real-GPU compilation (no GPU needed)


@pytest.mark.ptx
def test_compiles_for_sm90():
    """The tensor-core build compiles for sm_90 with mma.sync, ldmatrix and cp.async and keeps its
    fragments and state in registers (no local memory): the prepare pass (the same code at every dv
    tile and buffer count) at the GPU shape, the scan at the two shapes the launcher routes between
    (GPU_SHAPE and GPU_NARROW_SHAPE's 32 state columns a block)."""
    compile_for_sm90(
        """
        from executor.kernels.linear_attention.chunked_delta_rule import (
            GPU_NARROW_SHAPE, GPU_SHAPE, build_chunked_delta_rule)
        i32 = arr("int32", 1)
        f32 = lambda ndim: arr("float32", ndim)
        words = arr("int32", 3)
        c = build_codec("bfloat16")
        for index, shape in enumerate((GPU_SHAPE, GPU_NARROW_SHAPE)):
            prepare, scan = build_chunked_delta_rule(c, 128, 128, shape, True)
            texts = {"scan": ptx(scan, arr("bfloat16", 2), f32(4), i32, i32, words, words, f32(3), words)}
            if index == 0:
                texts["prepare"] = ptx(prepare, arr("bfloat16", 2), f32(2), f32(2), i32, i32, words, words, f32(3))
            for name, text in texts.items():
                for instruction in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg.shared.global"):
                    assert instruction in text, (shape, name, instruction)
                assert ".local" not in text, f"{shape} {name}: local memory"
        """
    )


# ---------------------------------------------------------------- GPU tests at real sizes (bf16)

GPU_DK = GPU_DV = 128
QWEN3_5_HEADS = {"9b": (16, 32), "27b": (16, 48)}  # (Hk, Hv)


def gpu_launch(rule, qkv, g, beta, state, lengths, slots, hv):
    out = torch.full((qkv.shape[0], hv, GPU_DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    ip = torch.tensor(indptr(lengths), dtype=torch.int32, device="cuda")
    sl = torch.tensor(slots, dtype=torch.int32, device="cuda")
    extra = {"scratch": scratch(qkv.shape[0], hv, device="cuda")} if isinstance(rule, ChunkedGatedDeltaRule) else {}
    rule(qkv.view(torch.int16), g, beta, state, ip, sl, out.view(torch.int16), **extra)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(QWEN3_5_HEADS))
def test_gpu_bf16_against_float64_and_the_recurrent_kernel(model):
    """Requests of 1, 63, 64, 65, 300 and 1,000 rows from random states, Qwen3.5 heads: the chunked
    kernel against the float64 recurrence and against GatedDeltaRule on the same inputs."""
    hk, hv = QWEN3_5_HEADS[model]
    lengths, slots = [1, 63, 64, 65, 300, 1000], [5, 0, 3, 1, 6, 2]
    gen = torch.Generator(device="cuda").manual_seed(40)
    qkv, g, beta, state = inputs(gen, sum(lengths), 7, "bfloat16", hk, hv, GPU_DK, GPU_DV, device="cuda")
    codec = build_codec("bfloat16")
    chunked_state, recurrent_state = state.clone(), state.clone()
    out = gpu_launch(ChunkedGatedDeltaRule(codec, GPU_DK), qkv, g, beta, chunked_state, lengths, slots, hv)
    recurrent = gpu_launch(GatedDeltaRule(codec, GPU_DK), qkv, g, beta, recurrent_state, lengths, slots, hv)
    ref, ref_state = recurrence(qkv, g, beta, state, indptr(lengths), slots, hk, hv, GPU_DK, GPU_DV)
    assert_close_rel(out.double(), ref, TOL["bfloat16"])
    assert_close_rel(chunked_state.double(), ref_state, TOL["bfloat16"])
    assert_close_rel(out.double(), recurrent.double(), TOL["bfloat16"])
    assert_close_rel(chunked_state.double(), recurrent_state.double(), TOL["bfloat16"])
    assert torch.equal(chunked_state[4], state[4])


@pytest.mark.gpu
def test_gpu_prefill_split_over_steps_then_decode():
    """A 700-token prompt over steps of 100, 333 and 267 rows (chunks off the 64-row grid), then three
    decode steps through the decode kernel, against the float64 recurrence of the whole sequence."""
    hk, hv = QWEN3_5_HEADS["9b"]
    gen = torch.Generator(device="cuda").manual_seed(41)
    qkv, g, beta, state = inputs(gen, 703, 1, "bfloat16", hk, hv, GPU_DK, GPU_DV, device="cuda")
    state.zero_()
    codec = build_codec("bfloat16")
    recurrent = GatedDeltaRule(codec, GPU_DK)
    chunked, decode = ChunkedGatedDeltaRule(codec, GPU_DK, recurrent), GatedDeltaRuleDecode(codec, GPU_DK, recurrent)
    carried, outs, first = state.clone(), [], 0
    for rule, n in ((chunked, 100), (chunked, 333), (chunked, 267), (decode, 1), (decode, 1), (decode, 1)):
        rows = slice(first, first + n)
        outs.append(gpu_launch(rule, qkv[rows], g[rows], beta[rows], carried, [n], [0], hv))
        first += n
    ref, ref_state = recurrence(qkv, g, beta, state, [0, 703], [0], hk, hv, GPU_DK, GPU_DV)
    assert_close_rel(torch.cat(outs).double(), ref, TOL["bfloat16"])
    assert_close_rel(carried.double(), ref_state, TOL["bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(QWEN3_5_HEADS))
def test_gpu_bf16_against_fla(model):
    """flash-linear-attention's chunk_gated_delta_rule (q, k repeated to the value heads, as HF's layer
    calls it) on eight requests of 1 to 2,048 rows from random states: outputs and final states."""
    chunk_fla = pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    hk, hv = QWEN3_5_HEADS[model]
    lengths = [2048, 1, 64, 65, 777, 1500, 129, 300]
    gen = torch.Generator(device="cuda").manual_seed(42)
    qkv, g, beta, state = inputs(gen, sum(lengths), len(lengths), "bfloat16", hk, hv, GPU_DK, GPU_DV, device="cuda")
    slots = list(range(len(lengths)))
    ours_state = state.clone()
    ours = gpu_launch(ChunkedGatedDeltaRule(build_codec("bfloat16"), GPU_DK), qkv, g, beta, ours_state, lengths, slots,
                      hv)
    rows = qkv.shape[0]
    q, k, v = torch.split(qkv, [hk * GPU_DK, hk * GPU_DK, hv * GPU_DV], dim=-1)
    group = hv // hk
    q = q.reshape(rows, hk, GPU_DK).repeat_interleave(group, dim=1)[None]
    k = k.reshape(rows, hk, GPU_DK).repeat_interleave(group, dim=1)[None]
    v = v.reshape(rows, hv, GPU_DV)[None]
    cu_seqlens = torch.tensor(indptr(lengths), dtype=torch.long, device="cuda")
    theirs, theirs_state = chunk_fla(q, k, v, g=g[None], beta=beta[None].bfloat16(), initial_state=state.clone(),
                                     output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    # Both are bf16 computations of the float64 recurrence: ours is held to it as tightly as fla is
    # (or TOL, whichever is looser), and the two to each other within both errors.
    ref, ref_state = recurrence(qkv, g, beta, state, indptr(lengths), slots, hk, hv, GPU_DK, GPU_DV)
    for got, fla, want in ((ours, theirs[0], ref), (ours_state, theirs_state, ref_state)):
        fla_error = relative_error(fla.double(), want)
        assert relative_error(got.double(), want) <= max(TOL["bfloat16"], 1.25 * fla_error)
        assert_close_rel(got.double(), fla.double(), 2 * max(TOL["bfloat16"], fla_error))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, assert_close_rel's measure."""
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.gpu
def test_gpu_float32_build_against_float64():
    """float32 storage (the float32 build, GPU_FLOAT32_SHAPE) at Qwen3.5-9B heads: requests of 1, 17 and
    300 rows from random states against the float64 recurrence."""
    hk, hv = QWEN3_5_HEADS["9b"]
    lengths, slots = [1, 17, 300], [2, 0, 1]
    gen = torch.Generator(device="cuda").manual_seed(43)
    qkv, g, beta, state = inputs(gen, sum(lengths), 3, "float32", hk, hv, GPU_DK, GPU_DV, device="cuda")
    got_state = state.clone()
    out = torch.full((qkv.shape[0], hv, GPU_DV), float("nan"), device="cuda")
    ChunkedGatedDeltaRule(build_codec("float32"), GPU_DK)(
        qkv, g, beta, got_state, torch.tensor(indptr(lengths), dtype=torch.int32, device="cuda"),
        torch.tensor(slots, dtype=torch.int32, device="cuda"), out)
    torch.cuda.synchronize()
    ref, ref_state = recurrence(qkv, g, beta, state, indptr(lengths), slots, hk, hv, GPU_DK, GPU_DV)
    assert_close_rel(out.double(), ref, 1e-4)
    assert_close_rel(got_state.double(), ref_state, 1e-4)
