"""Gated DeltaNet (Qwen3.5 linear attention): the gates and the recurrent gated delta rule.

Formulas, checked against HF's ``Qwen3_5GatedDeltaNet`` and
``torch_recurrent_gated_delta_rule`` (transformers 5.x):

- gates, per token row t and value head h (float32)::

      beta[t, h] = sigmoid(b[t, h])          rounded to the activation dtype (HF: b.sigmoid() in bf16)
      g[t, h]    = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])   (softplus threshold 20, as torch)

- recurrence, per request and value head h, state S [dk, dv] float32, key head
  ``h // (Hv // Hk)`` (HF's repeat_interleave: consecutive value heads share one key head)::

      q, k <- x * rsqrt(sum x^2 + 1e-6);  q *= dk^-0.5
      for each row t of the request, in order:
          S *= exp(g[t, h]);  kv = S^T k;  delta = beta[t, h] * (v - kv)
          S += k delta^T;     o[t, h] = S^T q

  The final S is left in ``ssm_state[slot]`` (in place), so a prefill chunk and
  the decode steps after it continue exactly. A request admitted with no prior
  tokens must start from a zeroed slot: the caller zeroes ``ssm_state[slot]``
  (and the conv state) on admission.

The recurrent form serves prefill too (sequential over a request's rows) where executor/routing.py
does not send a step to chunked_delta_rule.py, and is the reference the other forms are held to; no
scratch beyond the state and the output (shared memory only, about
(rows_per_stage * (2 * dk + 132) + 256 * dk_split) * 4 bytes per block).
"""

from __future__ import annotations

import math
from typing import Any

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel
from executor.numba_cuda import load_cuda

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

GATE_THREADS = 256
MAX_DV_THREADS = 128  # most state columns per block (sizes the staged v rows)
DEFAULT_DV_TILE = 32  # state columns per block: decode (B=1, Hv=48) still fills ~200 blocks
DEFAULT_ROWS_PER_STAGE = 16  # token rows staged in shared memory per barrier round
DEFAULT_DK_SPLIT = 4  # threads sharing one state column: shorter per-row chains, fewer registers
L2_EPS = 1e-6  # HF's l2norm eps (FLA's value), not the model's rms_norm_eps
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus default: x above it returns x


@cuda.jit(device=True, inline=True)
def qkv_columns(qkv_width, v_heads, dk, dv, h):
    """First columns of value head h's q, k and v in a conv output row ``[q | k | v]`` of
    ``qkv_width`` columns (Hk key heads of dk, then Hv value heads of dv). HF's repeat_interleave:
    consecutive value heads share a key head, h // (Hv // Hk)."""
    k_heads = (qkv_width - v_heads * dv) // (2 * dk)
    kh = h // (v_heads // k_heads)
    return kh * dk, (k_heads + kh) * dk, 2 * k_heads * dk + h * dv


def build_gdn_gates(codec: Codec, param_codec: Codec | None = None) -> Any:
    """Kernel ``(a [T,Hv], b [T,Hv], A_log [Hv], dt_bias [Hv], g_out [T,Hv] f32, beta_out [T,Hv] f32)``.

    a, b in ``codec``'s storage; A_log, dt_bias in ``param_codec``'s (default:
    the same; checkpoints may keep them float32). One thread per element.
    """
    load, store = codec.load, codec.store
    pload = (param_codec or codec).load

    @cuda.jit
    def gdn_gates_kernel(a, b, A_log, dt_bias, g_out, beta_out):
        idx = cuda.grid(1)
        heads = a.shape[1]
        if idx >= a.shape[0] * heads:
            return
        t = idx // heads
        h = idx - t * heads
        x = load(a[t, h]) + pload(dt_bias[h])
        softplus = x
        if x <= float32(SOFTPLUS_THRESHOLD):
            softplus = float32(math.log1p(math.exp(x)))
        g_out[t, h] = -float32(math.exp(pload(A_log[h]))) * softplus
        sig = float32(1.0) / (float32(1.0) + float32(math.exp(-load(b[t, h]))))
        beta_out[t, h] = load(store(sig))  # HF's beta is sigmoid in the activation dtype

    return gdn_gates_kernel


def build_gated_delta_rule(
    codec: Codec,
    head_k_dim: int,
    rows_per_stage: int = DEFAULT_ROWS_PER_STAGE,
    dk_split: int = DEFAULT_DK_SPLIT,
) -> Any:
    """Kernel ``(qkv, g, beta, ssm_state, q_indptr, slot_ids, out)``.

    qkv [T, 2*Hk*dk + Hv*dv] (post-conv, post-SiLU; columns [q | k | v]) and
    out [T, Hv, dv]: ``codec``'s storage. g, beta [T, Hv] float32;
    ssm_state [slots, Hv, dk, dv] float32, in place; q_indptr [B+1], slot_ids
    [B] int32 (-1: a padding request, skipped). Grid (ceil(dv / cols), Hv, B); block (cols, dk_split), cols a
    power of two <= MAX_DV_THREADS.

    Thread (x, y) owns rows ``y*dk/dk_split ...`` of state column j (registers).
    Per token row, S^T k and S^T q are dk_split partial dots combined through
    shared memory (two barriers a row). Rows go through shared memory in
    stages of ``rows_per_stage``: the block loads the stage's q, k, v, exp(g),
    beta at once (many loads in flight), computes each row's two L2 norms with
    one thread per row, then runs the stage's rows in order.
    """
    if head_k_dim % dk_split:
        raise ValueError(f"gated_delta_rule: dk_split {dk_split} must divide head_k_dim {head_k_dim}")
    load, store = codec.load, codec.store
    dk = head_k_dim
    stage = rows_per_stage
    splits = dk_split
    part_len = dk // dk_split  # state rows per thread
    lanes = 4 if part_len % 4 == 0 else (2 if part_len % 2 == 0 else 1)  # independent FMA chains
    scale = float(dk) ** -0.5

    @cuda.jit(device=True, inline=True)
    def combine(part):
        total = part[0]
        for u in range(1, lanes):
            total += part[u]
        return total

    @cuda.jit(device=True, inline=True)
    def sum_squares(x_sh, r):
        """sum_i x_sh[r, i]^2 over dk."""
        part = cuda.local.array(lanes, float32)
        for u in range(lanes):
            part[u] = float32(0.0)
        for i in range(0, dk, lanes):
            for u in range(lanes):
                part[u] += x_sh[r, i + u] * x_sh[r, i + u]
        return combine(part)

    @cuda.jit(device=True, inline=True)
    def decay_dot(s, k_sh, r, row0, decay):
        """s *= decay (in place); return this thread's part of S^T k (raw k)."""
        part = cuda.local.array(lanes, float32)
        for u in range(lanes):
            part[u] = float32(0.0)
        for i in range(0, part_len, lanes):
            for u in range(lanes):
                s[i + u] *= decay
                part[u] += s[i + u] * k_sh[r, row0 + i + u]
        return combine(part)

    @cuda.jit(device=True, inline=True)
    def update_dot(s, k_sh, q_sh, r, row0, k_delta):
        """s += k * k_delta (in place); return this thread's part of S^T q (raw q)."""
        part = cuda.local.array(lanes, float32)
        for u in range(lanes):
            part[u] = float32(0.0)
        for i in range(0, part_len, lanes):
            for u in range(lanes):
                s[i + u] += k_sh[r, row0 + i + u] * k_delta
                part[u] += s[i + u] * q_sh[r, row0 + i + u]
        return combine(part)

    @cuda.jit
    def gated_delta_rule_kernel(qkv, g, beta, ssm_state, q_indptr, slot_ids, out):
        q_sh = cuda.shared.array((stage, dk), float32)
        k_sh = cuda.shared.array((stage, dk), float32)
        v_sh = cuda.shared.array((stage, MAX_DV_THREADS), float32)
        decay_sh = cuda.shared.array(stage, float32)
        beta_sh = cuda.shared.array(stage, float32)
        q_scale_sh = cuda.shared.array(stage, float32)
        k_scale_sh = cuda.shared.array(stage, float32)
        kv_sh = cuda.shared.array((splits, MAX_DV_THREADS), float32)  # partial S^T k
        o_sh = cuda.shared.array((splits, MAX_DV_THREADS), float32)  # partial S^T q
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        cols = cuda.blockDim.x
        tid = ty * cols + tx
        step = cols * splits
        j = cuda.blockIdx.x * cols + tx
        h = cuda.blockIdx.y
        req = cuda.blockIdx.z
        v_heads = out.shape[1]
        dv = out.shape[2]
        q_col, k_col, v_col = qkv_columns(qkv.shape[1], v_heads, dk, dv, h)
        v_col += j
        row0 = ty * part_len
        start = q_indptr[req]
        end = q_indptr[req + 1]
        slot = slot_ids[req]
        # Uniform over the block, so nobody is left waiting at a barrier: an empty request, or a
        # graph's padding request (slot -1: no state, output unused).
        if end == start or slot < 0:
            return
        active = j < dv  # idle columns still help load and pass the barriers

        s = cuda.local.array(part_len, float32)
        if active:
            for i in range(part_len):
                s[i] = ssm_state[slot, h, row0 + i, j]
        for base in range(start, end, stage):
            n = min(stage, end - base)
            for idx in range(tid, n * dk, step):
                r = idx // dk
                i = idx - r * dk
                q_sh[r, i] = load(qkv[base + r, q_col + i])
                k_sh[r, i] = load(qkv[base + r, k_col + i])
            for r in range(tid, n, step):
                decay_sh[r] = float32(math.exp(g[base + r, h]))
                beta_sh[r] = beta[base + r, h]
            if active and ty == 0:
                for r in range(n):
                    v_sh[r, tx] = load(qkv[base + r, v_col])
            cuda.syncthreads()
            for r in range(tid, n, step):
                q_scale_sh[r] = float32(scale) / float32(math.sqrt(sum_squares(q_sh, r) + float32(L2_EPS)))
                k_scale_sh[r] = float32(1.0) / float32(math.sqrt(sum_squares(k_sh, r) + float32(L2_EPS)))
            cuda.syncthreads()
            for r in range(n):
                if active:
                    kv_sh[ty, tx] = decay_dot(s, k_sh, r, row0, decay_sh[r])
                cuda.syncthreads()
                if active:
                    kv = float32(0.0)
                    for y in range(splits):  # same order in every thread: identical kv
                        kv += kv_sh[y, tx]
                    k_scale = k_scale_sh[r]
                    k_delta = k_scale * (beta_sh[r] * (v_sh[r, tx] - kv * k_scale))  # k_n d^T = k (k_scale d)^T
                    o_sh[ty, tx] = update_dot(s, k_sh, q_sh, r, row0, k_delta)
                cuda.syncthreads()
                if active and ty == 0:
                    o = float32(0.0)
                    for y in range(splits):
                        o += o_sh[y, tx]
                    out[base + r, h, j] = store(o * q_scale_sh[r])
            cuda.syncthreads()  # the stage's shared rows are consumed before the next stage loads
        if active:
            for i in range(part_len):
                ssm_state[slot, h, row0 + i, j] = s[i]

    return gated_delta_rule_kernel


class GdnGates:
    """Launcher: ``g_out, beta_out = gates(a, b, A_log, dt_bias)`` (not in place).

    a, b [T, Hv] (``in_proj_a`` / ``in_proj_b`` outputs, storage dtype);
    A_log, dt_bias [Hv] (param storage dtype); g_out, beta_out [T, Hv] float32.
    Every row of a/b is computed (padding rows too). No scratch.
    """

    def __init__(self, codec: Codec, param_codec: Codec | None = None) -> None:
        self.kernel = Kernel(build_gdn_gates(codec, param_codec))

    def __call__(self, a: Any, b: Any, A_log: Any, dt_bias: Any, g_out: Any, beta_out: Any, stream: Any = 0) -> None:
        if len(a.shape) != 2:
            raise ValueError(f"gdn_gates: a must be [T, Hv], got {tuple(a.shape)}")
        rows, heads = int(a.shape[0]), int(a.shape[1])
        for name, arr in (("b", b), ("g_out", g_out), ("beta_out", beta_out)):
            if tuple(arr.shape) != (rows, heads):
                raise ValueError(f"gdn_gates: {name} must be [{rows}, {heads}], got {tuple(arr.shape)}")
        for name, arr in (("A_log", A_log), ("dt_bias", dt_bias)):
            if tuple(arr.shape) != (heads,):
                raise ValueError(f"gdn_gates: {name} must be [{heads}], got {tuple(arr.shape)}")
        count = rows * heads
        if count == 0:
            return
        self.kernel[(count + GATE_THREADS - 1) // GATE_THREADS, GATE_THREADS, stream](
            a, b, A_log, dt_bias, g_out, beta_out
        )


class GatedDeltaRule:
    """Launcher of the recurrent gated delta rule; ``ssm_state`` is updated in place.

    - qkv [T, 2*Hk*dk + Hv*dv]: the conv1d output (post-SiLU), storage dtype.
    - g, beta [T, Hv] float32 (from ``GdnGates``).
    - ssm_state [num_slots, Hv, dk, dv] float32: read and written per slot.
    - q_indptr [B+1], slot_ids [B] int32: slots distinct within a batch.
    - out [T, Hv, dv] storage dtype; must not alias qkv. Rows >= q_indptr[B] untouched.

    ``dv_tile`` (power of two <= 128): state columns per block; ``dk_split``:
    threads per column (divides dk); ``rows_per_stage``: rows staged in shared
    memory per round. No global scratch.
    """

    def __init__(
        self,
        codec: Codec,
        head_k_dim: int,
        dv_tile: int = DEFAULT_DV_TILE,
        rows_per_stage: int = DEFAULT_ROWS_PER_STAGE,
        dk_split: int = DEFAULT_DK_SPLIT,
    ) -> None:
        if dv_tile < 1 or dv_tile > MAX_DV_THREADS or dv_tile & (dv_tile - 1):
            raise ValueError(f"gated_delta_rule: dv_tile must be a power of two <= {MAX_DV_THREADS}, got {dv_tile}")
        if rows_per_stage < 1:
            raise ValueError(f"gated_delta_rule: rows_per_stage must be >= 1, got {rows_per_stage}")
        self.head_k_dim = head_k_dim
        self.dv_tile = dv_tile
        if dv_tile * dk_split > 1024:
            raise ValueError(f"gated_delta_rule: dv_tile * dk_split must be <= 1024, got {dv_tile * dk_split}")
        self.dk_split = dk_split
        self.kernel = Kernel(build_gated_delta_rule(codec, head_k_dim, rows_per_stage, dk_split))

    def __call__(
        self,
        qkv: Any,
        g: Any,
        beta: Any,
        ssm_state: Any,
        q_indptr: Any,
        slot_ids: Any,
        out: Any,
        stream: Any = 0,
    ) -> None:
        v_heads, dv, requests = check_delta_rule_shapes(qkv, g, beta, ssm_state, q_indptr, slot_ids, out,
                                                        self.head_k_dim)
        if requests == 0 or int(qkv.shape[0]) == 0:
            return
        cols = min(self.dv_tile, pow2_at_least(dv))
        grid = ((dv + cols - 1) // cols, v_heads, requests)
        self.kernel[grid, (cols, self.dk_split), stream](qkv, g, beta, ssm_state, q_indptr, slot_ids, out)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_delta_rule_shapes(
    qkv: Any, g: Any, beta: Any, ssm_state: Any, q_indptr: Any, slot_ids: Any, out: Any, dk: int
) -> tuple[int, int, int]:
    """Validate the delta rule's shapes; return (Hv, dv, B)."""
    if len(out.shape) != 3 or len(qkv.shape) != 2:
        raise ValueError(f"gated_delta_rule: need qkv [T, C] and out [T, Hv, dv], got {tuple(qkv.shape)}, {tuple(out.shape)}")
    rows, v_heads, dv = (int(n) for n in out.shape)
    key_cols = int(qkv.shape[1]) - v_heads * dv
    k_heads = key_cols // (2 * dk) if key_cols > 0 else 0
    if int(qkv.shape[0]) != rows or k_heads == 0 or key_cols != 2 * k_heads * dk or v_heads % k_heads:
        raise ValueError(
            f"gated_delta_rule: qkv {tuple(qkv.shape)} is not [{rows}, 2*Hk*{dk} + {v_heads}*{dv}] with Hv % Hk == 0"
        )
    for name, arr in (("g", g), ("beta", beta)):
        if tuple(arr.shape) != (rows, v_heads):
            raise ValueError(f"gated_delta_rule: {name} must be [{rows}, {v_heads}], got {tuple(arr.shape)}")
    if len(ssm_state.shape) != 4 or tuple(ssm_state.shape[1:]) != (v_heads, dk, dv):
        raise ValueError(f"gated_delta_rule: ssm_state must be [slots, {v_heads}, {dk}, {dv}], got {tuple(ssm_state.shape)}")
    if len(slot_ids.shape) != 1 or tuple(q_indptr.shape) != (int(slot_ids.shape[0]) + 1,):
        raise ValueError(
            f"gated_delta_rule: need q_indptr [B+1] and slot_ids [B], got {tuple(q_indptr.shape)}, {tuple(slot_ids.shape)}"
        )
    return v_heads, dv, int(slot_ids.shape[0])
