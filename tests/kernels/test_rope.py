"""qk_norm_rope_inplace against torch references (simulator at tiny shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.codec import build_codec
from executor.kernels.rope import QkNormRopeInplace, vector_group_threads
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import assert_bf16_close, assert_close_rel, from_storage, to_storage

EPS = 1e-6
SIM_THREADS = 32
POSITIONS = [0, 1, 40959, 262143]  # up to Qwen3.5's max_position_embeddings - 1


def hf_angles(positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """HF's float32 RoPE angles [T, rotary_dim / 2] (inv_freq built on the CPU, as at model init)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    return positions.float()[:, None] * inv_freq.to(positions.device)[None, :]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, offset: float, round_before_weight: bool) -> torch.Tensor:
    """HF's Qwen3RMSNorm (round before weight) / Qwen3_5RMSNorm, in x's dtype."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if round_before_weight:
        return (w + offset) * n.to(x.dtype)
    return (n * (offset + w.float())).to(x.dtype)


def rotate(n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on the first rotary_dim dims of n [T, heads, D]; cos/sin [T, rotary_dim/2]."""
    cos = torch.cat((cos, cos), -1)[:, None, :]
    sin = torch.cat((sin, sin), -1)[:, None, :]
    rot, passed = n[..., :rotary_dim], n[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), -1)
    return torch.cat((rot * cos + rotated * sin, passed), -1)


def hf_reference(x, w, positions, offset, round_before_weight, rotary_dim, theta):
    """HF's q_norm + rotary in x's dtype: cos/sin cast to that dtype, every op rounded."""
    angles = hf_angles(positions, rotary_dim, theta)
    n = hf_rms_norm(x, w, offset, round_before_weight)
    return rotate(n, angles.cos().to(x.dtype), angles.sin().to(x.dtype), rotary_dim)


def ref64(x, w, positions, offset, rotary_dim, theta):
    """float64 math on HF's float32 angles (float32 angles at position 262143 are what HF computes)."""
    x = x.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.double())
    angles = hf_angles(positions, rotary_dim, theta).double()
    return rotate(n, angles.cos(), angles.sin(), rotary_dim)


def term_scale(n: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """|n| + |rotate_half(n)| on the rotary dims, |n| elsewhere: the size of the terms an output sums."""
    half = rotary_dim // 2
    partner = torch.zeros_like(n)
    partner[..., :half] = n[..., half:rotary_dim]
    partner[..., half:rotary_dim] = n[..., :half]
    return n.abs() + partner.abs()


# (dtype, round_before_weight, weight_offset, head_dim, rotary_dim, theta): Qwen3-like and Qwen3.5-like.
# The bf16 rotary_dim 8 case has a 4-element rotary half, less than a 16-byte chunk: scalar kernel only.
CASES = [
    ("float32", True, 0.0, 16, 16, 1e6),
    ("float32", False, 1.0, 32, 8, 1e7),
    ("bfloat16", True, 0.0, 16, 16, 1e6),
    ("bfloat16", False, 1.0, 32, 8, 1e7),
    ("bfloat16", False, 1.0, 32, 16, 1e7),
]


@pytest.mark.parametrize("vectorize", [True, False], ids=["vector", "scalar"])
@pytest.mark.parametrize("dtype_name,round_before_weight,offset,head_dim,rotary_dim,theta", CASES)
def test_qk_norm_rope_inplace(dtype_name, round_before_weight, offset, head_dim, rotary_dim, theta, vectorize):
    gen = torch.Generator().manual_seed(41)
    dt = getattr(torch, dtype_name)
    rows, heads = len(POSITIONS), 2
    # x is q of a per-head [q | gate] buffer: a strided view, as for Qwen3.5.
    q_gate = (torch.randn(rows, heads, 2 * head_dim, generator=gen) * 3).to(dt)
    x = q_gate[..., :head_dim]
    w = (torch.randn(head_dim, generator=gen) * 0.3 + (0.0 if offset else 1.0)).to(dt)
    positions = torch.tensor(POSITIONS, dtype=torch.int32)
    # Device arrays: the simulator transfers only contiguous host arrays.
    buf = load_cuda().to_device(to_storage(q_gate, dtype_name))
    codec = build_codec(dtype_name)
    rope = QkNormRopeInplace(codec, round_before_weight, SIM_THREADS, vectorize=vectorize)
    w_store = to_storage(w, dtype_name)
    chunk_half = (rotary_dim // 2) * np.dtype(codec.storage_numpy_dtype).itemsize % 16 == 0
    assert rope.uses_vector(buf[:, :, :head_dim], w_store, rotary_dim) == (vectorize and chunk_half)
    rope(buf[:, :, :head_dim], w_store, positions.numpy(), EPS, offset, rotary_dim, theta)
    after = buf.copy_to_host()
    np.testing.assert_array_equal(after[..., head_dim:], to_storage(q_gate[..., head_dim:], dtype_name))
    got = from_storage(after[..., :head_dim], dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x, w, positions, offset, rotary_dim, theta), 1e-5)
    else:
        scale = term_scale(hf_rms_norm(x, w, offset, round_before_weight).double(), rotary_dim)
        hf = hf_reference(x, w, positions, offset, round_before_weight, rotary_dim, theta)
        assert_bf16_close(got, hf, scale, exact=0.95)
        assert_close_rel(got, ref64(x, w, positions, offset, rotary_dim, theta), 2e-2)


def test_qk_norm_rope_contiguous_host_array():
    """A contiguous host array (Qwen3's k): every element, pass-through ones included, ends normed."""
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(2, 3, 12, generator=gen)
    buf = to_storage(x, "float32")
    positions = np.array([3, 7], dtype=np.int32)
    QkNormRopeInplace(build_codec("float32"), True, SIM_THREADS)(
        buf, np.ones(12, np.float32), positions, EPS, 0.0, 8, 1e6
    )
    ref = ref64(x, torch.ones(12), torch.from_numpy(positions), 0.0, 8, 1e6)
    assert_close_rel(from_storage(buf, "float32"), ref, 1e-5)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_vector_kernel_with_several_units_per_thread(dtype_name):
    """Threads owning several units (re-read in pass 2) and a last head round with idle groups:
    head_dim 32, rotary_dim 16 is 6 (float32) or 3 (bf16) units per head, here 2 threads per head,
    and 2 rounds of heads plus one head. On the GPU the block is a full warp (the shuffles need one)."""
    threads, group = (4, 2) if simulator_enabled() else (32, 2)
    gen = torch.Generator().manual_seed(44)
    dt = getattr(torch, dtype_name)
    rows, head_dim, rotary_dim, theta, offset = 2, 32, 16, 1e7, 1.0
    heads = 2 * (threads // group) + 1
    x = (torch.randn(rows, heads, head_dim, generator=gen) * 3).to(dt)
    w = (torch.randn(head_dim, generator=gen) * 0.3).to(dt)
    positions = torch.tensor([5, 40959], dtype=torch.int32)
    rope = QkNormRopeInplace(build_codec(dtype_name), False, SIM_THREADS)
    buf = load_cuda().to_device(to_storage(x, dtype_name))
    w_store = to_storage(w, dtype_name)
    assert rope.uses_vector(buf, w_store, rotary_dim)
    assert vector_group_threads(head_dim, rotary_dim, rope.lanes) > 2  # the launcher would give one unit each
    rope.vector_kernel[rows, threads, 0, (threads + 3 * rotary_dim // 2) * 4](
        buf, w_store, positions.numpy(), np.float32(EPS), np.float32(offset), np.int32(rotary_dim),
        np.float32(theta), np.int32(group),
    )
    got = from_storage(buf.copy_to_host(), dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, ref64(x, w, positions, offset, rotary_dim, theta), 1e-5)
    else:
        scale = term_scale(hf_rms_norm(x, w, offset, False).double(), rotary_dim)
        assert_bf16_close(got, hf_reference(x, w, positions, offset, False, rotary_dim, theta), scale, exact=0.95)


def test_vector_group_threads():
    assert vector_group_threads(128, 128, 8) == 8  # Qwen3 bf16: 8 pair units
    assert vector_group_threads(256, 64, 8) == 32  # Qwen3.5 bf16: 4 pair units + 24 pass-through chunks
    assert vector_group_threads(256, 64, 4) == 32  # float32: 56 units, at most a warp
    assert vector_group_threads(16, 16, 8) == 1


def test_shape_errors():
    rope = QkNormRopeInplace(build_codec("float32"), True, SIM_THREADS)
    x = np.zeros((2, 3, 8), np.float32)
    pos = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="norm_weight"):
        rope(x, np.zeros(7, np.float32), pos, EPS, 0.0, 8, 1e6)
    with pytest.raises(ValueError, match="positions"):
        rope(x, np.zeros(8, np.float32), np.zeros(3, np.int32), EPS, 0.0, 8, 1e6)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope(x, np.zeros(8, np.float32), pos, EPS, 0.0, 10, 1e6)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope(x, np.zeros(8, np.float32), pos, EPS, 0.0, 5, 1e6)


@pytest.mark.skipif(simulator_enabled(), reason="compiles for sm_90; the simulator replaces the compiler")
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.rope import build_qk_norm_rope_kernel, build_qk_norm_rope_vector_kernel
        f32, i32 = types.float32, types.int32
        for name in DTYPES:
            for round_before_weight in (True, False):
                kernel = build_qk_norm_rope_kernel(build_codec(name), round_before_weight)
                ptx(kernel, arr(name, 3), arr(name, 1), arr("int32", 1), f32, f32, i32, f32)
                # Local memory: only libdevice's sin/cos slow path for large angles (the scalar kernel's too).
                vector = build_qk_norm_rope_vector_kernel(build_codec(name), round_before_weight)
                vector_ptx(vector, arr(name, 3), arr(name, 1), arr("int32", 1), f32, f32, i32, f32, i32, local_ok=True)
        """,
        allow_f64=True,  # inv_freq's power is taken in float64 on purpose (rope.py's docstring)
    )


# (heads, head_dim, rotary_dim, theta, round_before_weight, offset, strided): Qwen3 q/k, Qwen3.5 q (strided)/k.
GPU_CASES = [
    (32, 128, 128, 1e6, True, 0.0, False),
    (8, 128, 128, 5e6, True, 0.0, False),
    (16, 256, 64, 1e7, False, 1.0, True),
    (4, 256, 64, 1e7, False, 1.0, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,rotary_dim,theta,round_before_weight,offset,strided", GPU_CASES)
def test_gpu_qk_norm_rope_bf16(heads, head_dim, rotary_dim, theta, round_before_weight, offset, strided):
    gen = torch.Generator(device="cuda").manual_seed(43)
    rows = 1031
    width = 2 * head_dim if strided else head_dim
    buf = (torch.randn(rows, heads, width, device="cuda", generator=gen) * 3).bfloat16()
    x = buf[..., :head_dim]
    w = (torch.randn(head_dim, device="cuda", generator=gen) * 0.3 + (0.0 if offset else 1.0)).bfloat16()
    positions = torch.randint(0, 262144, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    positions[:4] = torch.tensor([0, 1, 40959, 262143], dtype=torch.int32)
    expected = hf_reference(x, w, positions, offset, round_before_weight, rotary_dim, theta)
    scale = term_scale(hf_rms_norm(x, w, offset, round_before_weight).double(), rotary_dim)
    before_gate = buf[..., head_dim:].clone()
    rope = QkNormRopeInplace(build_codec("bfloat16"), round_before_weight)
    assert rope.uses_vector(x.view(torch.int16), w.view(torch.int16), rotary_dim)
    rope(x.view(torch.int16), w.view(torch.int16), positions, EPS, offset, rotary_dim, theta)
    torch.cuda.synchronize()
    assert torch.equal(buf[..., head_dim:], before_gate)
    # HF's CPU powf is one ulp off for a few inv_freq entries (rope.py's docstring); at large
    # positions that flips some bf16 cos/sin roundings of those frequencies: >= 99% exact.
    assert_bf16_close(x.double().cpu(), expected.cpu(), scale.cpu(), exact=0.99)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,rotary_dim,theta,round_before_weight,offset,strided", GPU_CASES)
def test_gpu_vector_matches_scalar_bf16(heads, head_dim, rotary_dim, theta, round_before_weight, offset, strided):
    gen = torch.Generator(device="cuda").manual_seed(45)
    rows = 4099
    width = 2 * head_dim if strided else head_dim
    buf = (torch.randn(rows, heads, width, device="cuda", generator=gen) * 3).bfloat16()
    w = (torch.randn(head_dim, device="cuda", generator=gen) * 0.3 + (0.0 if offset else 1.0)).bfloat16()
    positions = torch.randint(0, 262144, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    outs = []
    for vectorize in (True, False):
        copy = buf.clone()
        x = copy[..., :head_dim].view(torch.int16)
        rope = QkNormRopeInplace(build_codec("bfloat16"), round_before_weight, vectorize=vectorize)
        assert rope.uses_vector(x, w.view(torch.int16), rotary_dim) == vectorize
        rope(x, w.view(torch.int16), positions, EPS, offset, rotary_dim, theta)
        outs.append(copy)
    torch.cuda.synchronize()
    vector, scalar = outs
    assert torch.equal(vector[..., head_dim:], scalar[..., head_dim:])
    scale = term_scale(hf_rms_norm(buf[..., :head_dim], w, offset, round_before_weight).double(), rotary_dim)
    # Same roundings; only the sum of squares' order differs (an inv_rms ulp flips a rare rounding).
    assert_bf16_close(vector[..., :head_dim].double().cpu(), scalar[..., :head_dim].cpu(), scale.cpu(), exact=0.999)
