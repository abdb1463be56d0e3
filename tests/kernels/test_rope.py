"""qk_norm_rope_inplace against torch references, and the fused q/k norm + RoPE + KV cache write
(qk_rope_kv.py) against the launches it replaces (simulator at tiny shapes; bf16 GPU tests at real
sizes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.rows.kv_cache import WriteKv
from executor.kernels.primitives.launch import Kernel, multiprocessor_count
from executor.kernels.rope.fused_kv_write import QkNormRopeWriteKv, fused_launch
from executor.kernels.rows.norm import SCRATCH_BYTES_PER_THREAD
from executor.kernels.rope.qk_norm_rope import VECTOR_ROWS, QkNormRopeInplace, vector_shared_bytes
from executor.kernels.rope.layout import vector_group_threads
from executor.kernels.rope.unit_layout import cos_sin_slots
from executor.kernels.rope.specialized import (
    SpecializedLaunch,
    block_threads,
    build_qk_norm_rope_specialized_kernel,
    chunk_layout_fits,
    chunk_span,
    default_chunks_per_thread,
    specialized_launch,
)
from executor.numba_cuda import load_cuda, simulator_enabled
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import assert_bf16_close, assert_close_rel, from_storage, poisoned, to_storage
from tests.kernels.test_kv_cache import make_step

cuda = load_cuda()

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


@pytest.mark.parametrize("path", ["specialized", "vector", "scalar"])
@pytest.mark.parametrize("dtype_name,round_before_weight,offset,head_dim,rotary_dim,theta", CASES)
def test_qk_norm_rope_inplace(dtype_name, round_before_weight, offset, head_dim, rotary_dim, theta, path):
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
    vectorize = path != "scalar"
    specialized_min_rows = 1 if path == "specialized" else None
    rope = QkNormRopeInplace(codec, round_before_weight, SIM_THREADS, vectorize, specialized_min_rows)
    w_store = to_storage(w, dtype_name)
    chunk_half = (rotary_dim // 2) * np.dtype(codec.storage_numpy_dtype).itemsize % 16 == 0
    assert rope.uses_vector(buf[:, :, :head_dim], w_store, rotary_dim) == (vectorize and chunk_half)
    # The specialized kernel is bf16 only; float32 keeps the vector kernel.
    specialized = path == "specialized" and chunk_half and dtype_name == "bfloat16"
    assert rope.uses_specialized(buf[:, :, :head_dim], w_store, rotary_dim) == specialized
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
    and 2 rounds of heads plus one head. Three rows over three blocks: the first block takes a row
    pair, the second a row without a second, the third none. On the GPU the block is a full warp
    (the shuffles need one)."""
    threads, group = (4, 2) if simulator_enabled() else (32, 2)
    gen = torch.Generator().manual_seed(44)
    dt = getattr(torch, dtype_name)
    rows, head_dim, rotary_dim, theta, offset = 3, 32, 16, 1e7, 1.0
    heads = 2 * (threads // group) + 1
    x = (torch.randn(rows, heads, head_dim, generator=gen) * 3).to(dt)
    w = (torch.randn(head_dim, generator=gen) * 0.3).to(dt)
    positions = torch.tensor([5, 40959, 17], dtype=torch.int32)
    rope = QkNormRopeInplace(build_codec(dtype_name), False, SIM_THREADS)
    buf = load_cuda().to_device(to_storage(x, dtype_name))
    w_store = to_storage(w, dtype_name)
    assert rope.uses_vector(buf, w_store, rotary_dim)
    assert vector_group_threads(head_dim, rotary_dim, rope.lanes) > 2  # the launcher would give one unit each
    rope.vector_kernel[rows, threads, 0, vector_shared_bytes(threads, rotary_dim, VECTOR_ROWS)](
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


# ---------------------------------------------------------------- the specialized bf16 kernel

# (round_before_weight, weight_offset, head_dim, rotary_dim, heads, strided, theta). Qwen3-like: one pair
# unit a head (a 1-thread group). Qwen3.5-like: q strided in a per-head [q | gate] buffer, one pair unit
# and two pass-through chunks (3 units on a 4-thread group, one lane idle). Full rotary over two pair
# units, strided.
SPECIALIZED_CASES = [
    (True, 0.0, 16, 16, 4, False, 1e6),
    (False, 1.0, 32, 16, 2, True, 1e7),
    (True, 0.0, 32, 32, 2, True, 1e6),
]
SPECIALIZED_POSITIONS = [0, 1, 40959, 262143, 17]  # an odd row count
REVEALING_HEADS = 4  # heads of the inputs whose rounded norm shows the sum-of-squares order


def spread_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 values of many exponents (|x| in [2^-10, 2^5)): float32 sums of their squares round, so
    the order they are summed in can move inv_rms (randn * 3 values often sum exactly)."""
    magnitude = torch.exp2(torch.rand(shape, generator=gen) * 14 - 10) * (1 + torch.rand(shape, generator=gen))
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * magnitude).bfloat16()


def chain_sums(squares: np.ndarray) -> np.ndarray:
    """float32 sums over the last axis, one element after another."""
    return np.cumsum(squares, axis=-1, dtype=np.float32)[..., -1]


def kernel_order_sums(squares: np.ndarray, rotary_dim: int, group: int, adjacent_slots: int = 1) -> np.ndarray:
    """Heads' float32 sums of squares [N] from their squares [N, D] in rope.py's documented order
    (the vector and specialized kernels'): a unit lane's 8-square chain per chunk, a pair unit's
    first-half chunk plus its second-half chunk, then reduce.py's xor tree over the group's lanes.
    ``adjacent_slots`` > 1: a wrong order instead, as a chunk-layout thread holding units u + m *
    group / adjacent_slots (m < adjacent_slots) would get by adding its adjacent slots first (its
    own tree in the wrong level order) before the xor tree over its lanes."""
    lanes, half, head_dim = 8, rotary_dim // 2, squares.shape[-1]
    pairs = half // lanes
    partial = np.zeros((squares.shape[0], group), np.float32)
    for unit in range(pairs + (head_dim - rotary_dim) // lanes):
        partial[:, unit] = chain_sums(squares[:, half + unit * lanes:half + (unit + 1) * lanes])
        if unit < pairs:
            partial[:, unit] = chain_sums(squares[:, unit * lanes:(unit + 1) * lanes]) + partial[:, unit]
    if adjacent_slots > 1:  # [N, slot m, lane u] -> [N, lane u]: the slots' tree over m, m + 1 first
        slots = partial.reshape(squares.shape[0], adjacent_slots, group // adjacent_slots)
        width = 1
        while width < adjacent_slots:
            for m in range(0, adjacent_slots, 2 * width):
                slots[:, m] = slots[:, m] + slots[:, m + width]
            width *= 2
        partial = np.ascontiguousarray(slots[:, 0])
        group //= adjacent_slots
    width = group // 2
    while width:  # lane i takes lane i + width's value: lane 0 ends with the tree's sum
        partial[:, :width] = partial[:, :width] + partial[:, width:2 * width]
        width //= 2
    return partial[:, 0]


def normed_bits(x: np.ndarray, sums: np.ndarray, w: np.ndarray, offset: float, round_before_weight: bool):
    """HF's q_norm output [N, D] (bf16 values, as the bits of their float32) from float32 heads x [N, D],
    their sums of squares and the weight, in the kernels' float32 arithmetic (norm.inv_rms_from_sum,
    norm.build_normalize)."""
    def bf16(a: np.ndarray) -> np.ndarray:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().float().numpy()

    inv_rms = np.float32(1.0) / np.sqrt(sums / np.float32(x.shape[-1]) + np.float32(EPS))
    scaled = x * inv_rms[:, None]
    weight = np.float32(offset) + w
    normed = bf16(bf16(scaled) * weight) if round_before_weight else bf16(scaled * weight)
    return normed.view(np.int32)


def order_revealing_heads(case: tuple, group: int, w: torch.Tensor, count: int, seed: int,
                          other: Any = chain_sums) -> torch.Tensor:
    """``count`` bf16 heads [count, D] whose rounded q_norm output changes when their squares are
    summed in the order ``other`` (squares [N, D] -> sums [N]; default one chain) instead of rope.py's
    order: a kernel summing in that order gets other bits on them (tiny random inputs hardly ever
    show an order: an inv_rms ulp flips about one rounding in 2^15)."""
    round_before_weight, offset, head_dim, rotary_dim = case[:4]
    gen = torch.Generator().manual_seed(seed)
    found: list[torch.Tensor] = []
    for _ in range(64):  # batches of candidates until enough are found (about 1 in 20,000 reveals)
        heads = spread_bf16((1 << 14, head_dim), gen)
        x, w32 = heads.float().numpy(), w.float().numpy()
        squares = x * x  # exact: a bf16 square has 16 significant bits
        ours = normed_bits(x, kernel_order_sums(squares, rotary_dim, group), w32, offset, round_before_weight)
        chained = normed_bits(x, other(squares), w32, offset, round_before_weight)
        found += list(heads[torch.from_numpy(np.flatnonzero((ours != chained).any(axis=-1)))])
        if len(found) >= count:
            return torch.stack(found[:count])
    raise AssertionError(f"only {len(found)} order-revealing heads")


def specialized_inputs(case: tuple, heads: int, group: int, seed: int, positions: list[int] = SPECIALIZED_POSITIONS,
                       other: Any = None) -> tuple[torch.Tensor, ...]:
    """(buffer [T, heads, D or 2D] with x its [..., :D], norm weight [D], positions [T]), bf16 / int32;
    the first rows' heads are order-revealing (order_revealing_heads). ``other``: an order to reveal
    besides one chain: then one head of each row past those heads (head REVEALING_HEADS + k * heads)
    reveals that one, in the rows of both of a pipelined block's buffers."""
    _, offset, head_dim, _, _, strided, _ = case
    gen = torch.Generator().manual_seed(seed)
    rows = len(positions)
    buf = spread_bf16((rows, heads, (2 if strided else 1) * head_dim), gen)
    w = (torch.randn(head_dim, generator=gen) * 0.3 + (0.0 if offset else 1.0)).bfloat16()
    x = buf[..., :head_dim].reshape(rows * heads, head_dim)  # a copy when strided
    x[:REVEALING_HEADS] = order_revealing_heads(case, group, w, REVEALING_HEADS, seed)
    if other is not None:
        x[REVEALING_HEADS::heads] = order_revealing_heads(case, group, w, len(x[REVEALING_HEADS::heads]), seed, other)
    buf[..., :head_dim] = x.view(rows, heads, head_dim)
    return buf, w, torch.tensor(positions, dtype=torch.int32)


def run_in_place(launch, buf: torch.Tensor, head_dim: int) -> np.ndarray:
    """``launch(x)`` on a device copy of buf's bits, x its [..., :head_dim] view; buf's bits after."""
    device = cuda.to_device(to_storage(buf, "bfloat16"))
    launch(device[:, :, :head_dim])
    return device.copy_to_host()


@pytest.mark.parametrize("case", SPECIALIZED_CASES)
def test_specialized_matches_vector_and_hf(case):
    """The launcher's specialized kernel on order-sensitive inputs: bit for bit the vector kernel (the
    same sum-of-squares order and roundings), within the HF and float64 references, gate untouched."""
    round_before_weight, offset, head_dim, rotary_dim, heads, _, theta = case
    buf, w, positions = specialized_inputs(case, heads, vector_group_threads(head_dim, rotary_dim, 8), seed=50)
    x = buf[..., :head_dim]
    codec, w_bits = build_codec("bfloat16"), to_storage(w, "bfloat16")
    args = (w_bits, positions.numpy(), EPS, offset, rotary_dim, theta)
    outs = []
    for min_rows in (1, None):
        rope = QkNormRopeInplace(codec, round_before_weight, SIM_THREADS, specialized_min_rows=min_rows)

        def launch(view):
            assert rope.uses_specialized(view, w_bits, rotary_dim) == (min_rows is not None)
            rope(view, *args)

        outs.append(run_in_place(launch, buf, head_dim))
    specialized, vector = outs
    np.testing.assert_array_equal(specialized, vector)
    np.testing.assert_array_equal(specialized[..., head_dim:], to_storage(buf[..., head_dim:], "bfloat16"))
    got = from_storage(specialized[..., :head_dim], "bfloat16")
    scale = term_scale(hf_rms_norm(x, w, offset, round_before_weight).double(), rotary_dim)
    hf = hf_reference(x, w, positions, offset, round_before_weight, rotary_dim, theta)
    assert_bf16_close(got, hf, scale, exact=0.95)
    assert_close_rel(got, ref64(x, w, positions, offset, rotary_dim, theta), 2e-2)


# (case, heads, group_threads, heads_per_thread, threads, blocks), 5 rows each: the unit layout.
SPECIALIZED_LAYOUTS = [
    # 4 heads in one 1-thread slot; 2 blocks stride over the rows (3 and 2 rows).
    (SPECIALIZED_CASES[0], 4, 1, 4, 1, 2),
    # 2 head slots of 4 threads plus an idle slot (12 threads, 2 heads a thread); 7 blocks for 5 rows.
    (SPECIALIZED_CASES[1], 4, 4, 2, 12, 7),
    # A 4-thread group over 2 units (2 lanes idle, a wider xor tree than the vector kernel's); 3 blocks.
    (SPECIALIZED_CASES[2], 2, 4, 1, 8, 3),
]


@pytest.mark.parametrize("pipelined", [False, True], ids=["one_row", "pipelined"])
@pytest.mark.parametrize("case,heads,group,per_thread,threads,blocks", SPECIALIZED_LAYOUTS)
def test_specialized_kernel_layouts(case, heads, group, per_thread, threads, blocks, pipelined):
    """Unit layouts the simulator's launcher does not pick: several heads a thread, idle slots and
    lanes, grids smaller and larger than the row count (pipelined: a block's rows alternate between
    its two buffers, its last trip with one row or two, a block with one row, blocks with none).
    Against the vector kernel, bit for bit (idle lanes add zeros, which leave the xor tree's sum as
    it is)."""
    round_before_weight, offset, head_dim, rotary_dim, _, _, theta = case
    buf, w, positions = specialized_inputs(case, heads, group, seed=51)
    codec, w_bits = build_codec("bfloat16"), to_storage(w, "bfloat16")
    vector = QkNormRopeInplace(codec, round_before_weight, SIM_THREADS, specialized_min_rows=None)
    expected = run_in_place(lambda x: vector(x, w_bits, positions.numpy(), EPS, offset, rotary_dim, theta), buf,
                            head_dim)
    kernel = build_qk_norm_rope_specialized_kernel(codec, round_before_weight, head_dim, rotary_dim, heads, group,
                                                   per_thread, chunks_per_thread=0, pipelined=pipelined)

    def launch(x):
        kernel[blocks, threads, 0, threads * SCRATCH_BYTES_PER_THREAD](
            x, w_bits, positions.numpy(), np.float32(EPS), np.float32(offset), np.float32(theta))

    np.testing.assert_array_equal(run_in_place(launch, buf, head_dim), expected)


# Chunk-layout heads (round_before_weight, weight_offset, head_dim, rotary_dim, heads, strided, theta):
# Qwen3.5-like, 8 chunks of which 2 rotary (7 units on 8 vector lanes, as Qwen3.5's 28 on 32); 6
# chunks in a span of 8 (chunk slots past the head); 2 pair units on 4-lane groups (a lane's partner
# sum from the next lane's next slot).
CHUNK_CASES = [
    (False, 1.0, 64, 16, 4, True, 1e7),
    (False, 1.0, 48, 16, 2, True, 1e7),
    (True, 0.0, 64, 32, 2, False, 1e6),
]
PIPELINE_POSITIONS = [0, 1, 40959, 262143, 17, 5, 99]  # 7 rows: 3 blocks take 3, 2 and 2
# (case, heads, chunks_per_thread, heads_per_thread, pipelined, blocks).
CHUNK_LAYOUTS = [
    # As the launcher's Qwen3.5 q: 4 chunks a thread, every lane a rotary one on slot 0; a block's
    # rows alternate between its buffers, block 0's last trip has one row, the others' two.
    (CHUNK_CASES[0], 4, 4, 1, True, 3),
    # 2 chunks a thread, 2 heads (lanes 0-1 rotary, 2-3 pass-through); one block over all 7 rows.
    (CHUNK_CASES[0], 4, 2, 2, True, 1),
    # One chunk a lane, 4 heads a thread; more blocks than rows (blocks with no row).
    (CHUNK_CASES[0], 4, 1, 4, True, 9),
    (CHUNK_CASES[1], 2, 2, 1, True, 3),
    (CHUNK_CASES[2], 2, 2, 1, True, 3),
    # Lanes over 4 chunks for 2 units (the chunk tree wider than the vector kernel's, its top level zeros).
    (SPECIALIZED_CASES[2], 2, 1, 2, False, 2),
]


@pytest.mark.parametrize("case,heads,per_thread,heads_per_thread,pipelined,blocks", CHUNK_LAYOUTS)
def test_specialized_chunk_layouts(case, heads, per_thread, heads_per_thread, pipelined, blocks):
    """The chunk layout (a lane a 16-byte chunk, chunks_per_thread a thread) on order-revealing
    inputs, strided and partial-rotary shapes, one row and two in flight: bit for bit the vector
    kernel. With 4 chunks a thread, a head of each later row also reveals the order a thread adding
    its adjacent slots first would give (rope_specialized.py: the slots' tree is the xor tree's first
    levels, slots m and m + 2 first)."""
    round_before_weight, offset, head_dim, rotary_dim, _, _, theta = case
    assert chunk_layout_fits(head_dim, rotary_dim, per_thread)
    span = chunk_span(head_dim)
    group = span // per_thread
    other = None
    if per_thread > 2:  # with 2 slots, adding them first is the tree's own order
        other = lambda squares: kernel_order_sums(squares, rotary_dim, span, per_thread)  # noqa: E731
    buf, w, positions = specialized_inputs(case, heads, vector_group_threads(head_dim, rotary_dim, 8), 52,
                                           PIPELINE_POSITIONS, other)
    codec, w_bits = build_codec("bfloat16"), to_storage(w, "bfloat16")
    vector = QkNormRopeInplace(codec, round_before_weight, SIM_THREADS, specialized_min_rows=None)
    expected = run_in_place(lambda x: vector(x, w_bits, positions.numpy(), EPS, offset, rotary_dim, theta), buf,
                            head_dim)
    kernel = build_qk_norm_rope_specialized_kernel(codec, round_before_weight, head_dim, rotary_dim, heads, group,
                                                   heads_per_thread, chunks_per_thread=per_thread,
                                                   pipelined=pipelined)
    # Whole groups covering the frequency lanes (the first rotary_dim / 2 threads), as the launcher's.
    threads = -(-max(heads // heads_per_thread * group, rotary_dim // 2) // group) * group

    def launch(x):
        kernel[blocks, threads, 0, threads * SCRATCH_BYTES_PER_THREAD](
            x, w_bits, positions.numpy(), np.float32(EPS), np.float32(offset), np.float32(theta))

    np.testing.assert_array_equal(run_in_place(launch, buf, head_dim), expected)


def test_specialized_launch():
    assert specialized_launch(32, 128, 128) == SpecializedLaunch(8, 4, 64, 8)  # Qwen3-8B q: the H200's best
    assert specialized_launch(8, 128, 128) == SpecializedLaunch(8, 1, 64, 32)  # its k: NH 1 keeps two warps
    # Qwen3.5 q and k: the chunk layout, 4 chunks a thread on 8-lane groups, pipelined, 128 registers.
    assert specialized_launch(16, 256, 64) == SpecializedLaunch(8, 1, 128, 4, 4, True)
    assert specialized_launch(4, 256, 64) == SpecializedLaunch(8, 1, 32, 16, 4, True)
    assert specialized_launch(2, 16, 16) == SpecializedLaunch(1, 1, 32, 32)  # whole warps on the GPU
    assert specialized_launch(2, 16, 16, whole_warps=False) == SpecializedLaunch(1, 1, 2, 32)
    # The simulator: whole 2-lane groups covering the 8 frequency lanes.
    assert specialized_launch(2, 32, 16, whole_warps=False) == SpecializedLaunch(2, 1, 8, 16, 2, True)
    assert specialized_launch(16, 512, 64) is None  # 4 pair units + 56 pass-through chunks: over a warp
    assert specialized_launch(64, 256, 64) is None  # 512 threads over MAX_THREADS


def test_default_chunks_per_thread():
    """A builder call without chunks_per_thread (rope.py's launcher passes the launch's GT and NH only)
    builds the layout specialized_launch picked."""
    for heads, head_dim, rotary_dim in ((32, 128, 128), (8, 128, 128), (16, 256, 64), (4, 256, 64)):
        launch = specialized_launch(heads, head_dim, rotary_dim)
        assert default_chunks_per_thread(head_dim, rotary_dim, launch.group_threads) == launch.chunks_per_thread
    assert default_chunks_per_thread(256, 64, 32) == 0  # Qwen3.5's unit layout (the sweeps before the chunk one)
    assert not chunk_layout_fits(128, 128, 1)  # Qwen3-8B: 64 frequencies, more than a warp's lanes
    assert not chunk_layout_fits(128, 64, 4)  # 4-lane groups cannot hold 8 rotary chunks on their slot 0


def test_unit_layout_slots_share_cos_sin_within_a_warp():
    """Qwen3-8B's q and k (8-thread groups, 8 head slots): 4 slots a warp share each pair unit's cos/sin,
    2 frequencies each; sharing groups never straddle idle slots or a warp, and never split a chunk's 8
    frequencies unevenly."""
    for heads, heads_per_thread in ((32, 4), (8, 1)):
        launch = specialized_launch(heads, 128, 128)
        assert (launch.group_threads, launch.heads_per_thread) == (8, heads_per_thread)
        assert cos_sin_slots(heads // heads_per_thread, launch.group_threads) == 4
    assert cos_sin_slots(3, 8) == 1  # 3 slots: a pair would straddle the idle fourth
    assert cos_sin_slots(2, 4) == 2 and cos_sin_slots(16, 32) == 1 and cos_sin_slots(16, 1) == 8
    for slots in range(1, 17):
        for group in (1, 2, 4, 8, 16, 32):
            share = cos_sin_slots(slots, group)
            assert slots % share == 0 and 8 % share == 0 and share * group <= 32


def test_specialized_only_for_bf16_prefill_rows():
    """Which calls take the specialized kernel (no launch): bf16, vector-aligned, from
    specialized_min_rows rows; float32 and misfit shapes keep the vector kernel."""
    bf16 = QkNormRopeInplace(build_codec("bfloat16"), True, SIM_THREADS)
    w = np.zeros(16, np.int16)
    few, many = np.zeros((bf16.specialized_min_rows - 1, 2, 16), np.int16), np.zeros((256, 2, 16), np.int16)
    assert bf16.specialized_min_rows == 256
    assert bf16.uses_vector(few, w, 16) and not bf16.uses_specialized(few, w, 16)
    assert bf16.uses_specialized(many, w, 16)
    assert not bf16.uses_specialized(many, w, 8)  # a 4-element rotary half: the scalar kernel
    f32 = QkNormRopeInplace(build_codec("float32"), True, SIM_THREADS)
    many_f32 = np.zeros((256, 2, 16), np.float32)
    assert f32.uses_vector(many_f32, np.zeros(16, np.float32), 16)
    assert not f32.uses_specialized(many_f32, np.zeros(16, np.float32), 16)
    no_vector = QkNormRopeInplace(build_codec("bfloat16"), True, SIM_THREADS, vectorize=False)
    assert not no_vector.uses_specialized(many, w, 16)


# Builds a GPU sweep of the specialized kernel compares (rope_specialized.py's docstring), beside the
# launcher's: (shape, build_qk_norm_rope_specialized_kernel's options). Qwen3-8B's unit layout pipelined;
# Qwen3.5's chunk layout one row at a time, without launch bounds, with 2 chunks and 1 chunk a thread,
# and its unit layout as measured before the chunk layout (32-thread groups, 4 heads a thread).
SPECIALIZED_VARIANTS = [
    ("qwen3", dict(group_threads=8, heads_per_thread=4, pipelined=True)),
    ("qwen3_5", dict(group_threads=8, heads_per_thread=1, pipelined=False)),
    ("qwen3_5", dict(group_threads=8, heads_per_thread=1, min_blocks_per_sm=0)),
    ("qwen3_5", dict(group_threads=16, heads_per_thread=2, chunks_per_thread=2)),
    ("qwen3_5", dict(group_threads=16, heads_per_thread=1, chunks_per_thread=2)),
    ("qwen3_5", dict(group_threads=32, heads_per_thread=4, chunks_per_thread=1)),
    ("qwen3_5", dict(group_threads=32, heads_per_thread=2, chunks_per_thread=1)),
    ("qwen3_5", dict(group_threads=32, heads_per_thread=4, chunks_per_thread=0)),
]


@pytest.mark.ptx
def test_specialized_compiles_for_sm90():
    """PTX for sm_90 at Qwen3-8B's and Qwen3.5's q shapes, with the launcher's configurations and the
    pipelined unit layout (SPECIALIZED_VARIANTS' first): 16-byte global loads and stores, pair
    conversions, no block barrier, and no local memory but libdevice's sin/cos slow path (28 bytes,
    as in the other kernels): every buffer in registers. Where a ptxas is on the PATH, it also
    compiles each PTX under the kernel's launch bounds: no spills (ptxas's 32-byte frame is that
    slow path's buffer)."""
    compile_for_sm90(
        """
        import re, shutil, subprocess, tempfile
        from executor.kernels.rope.specialized import build_qk_norm_rope_specialized_kernel, specialized_launch
        f32 = types.float32
        argtypes = (arr("bfloat16", 3), arr("bfloat16", 1), arr("int32", 1), f32, f32, f32)
        shapes = {"qwen3": (True, 32, 128, 128), "qwen3_5": (False, 16, 256, 64)}
        # The launcher's configurations, and the one variant that is another path of the unit layout
        # (pipelined); the GPU test compiles and runs every variant.
        configs = [(name, None) for name in shapes] + VARIANTS[:1]
        for name, options in configs:
            round_before_weight, heads, head_dim, rotary_dim = shapes[name]
            launch = specialized_launch(heads, head_dim, rotary_dim)
            options = options or dict(group_threads=launch.group_threads, heads_per_thread=launch.heads_per_thread)
            kernel = build_qk_norm_rope_specialized_kernel(build_codec("bfloat16"), round_before_weight, head_dim,
                                                           rotary_dim, heads, **options)
            what = f"{name} {options}"
            bounds = kernel.targetoptions.get("launch_bounds")
            text = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0), launch_bounds=bounds)[0]
            assert "ld.global.v4" in text and "st.global.v4" in text, f"{what}: no 16-byte global access"
            depots = [int(n) for n in re.findall(r"__local_depot\\d+\\[(\\d+)\\]", text)]
            assert sum(depots) <= 28, f"{what}: {depots} bytes of local memory"
            assert ".local.v" not in text, f"{what}: a vector access to local memory"
            assert "cvt.rn.bf16x2.f32" in text, f"{what}: no pair conversion"
            assert "bar.sync" not in text and "barrier" not in text, f"{what}: a block barrier"
            if shutil.which("ptxas") is None:
                continue
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                # NVVM's PTX ISA may be newer than this ptxas; the kernels use nothing past ISA 8.0.
                f.write(re.sub(r"^\\.version \\d+\\.\\d+", ".version 8.0", text, flags=re.M))
                f.flush()
                out = subprocess.run(["ptxas", "-arch=sm_90", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                                     text=True)
            if out.returncode:
                print(f"{what}: ptxas could not compile the PTX, no spill check:", out.stderr[-300:])
                continue
            spills = [int(n) for n in re.findall(r"(\\d+) bytes spill stores", out.stderr)]
            frames = [int(n) for n in re.findall(r"(\\d+) bytes stack frame", out.stderr)]
            assert spills and not any(spills), f"{what}: ptxas spills {spills} bytes"
            assert max(frames) <= 32, f"{what}: {frames}-byte stack frames"
        """.replace("VARIANTS", repr(SPECIALIZED_VARIANTS)),
        allow_f64=True,  # inv_freq's power is taken in float64 on purpose (rope.py's docstring)
    )


@pytest.mark.ptx
def test_compiles_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.rope.qk_norm_rope import build_qk_norm_rope_kernel, build_qk_norm_rope_vector_kernel
        f32, i32 = types.float32, types.int32
        # Each codec with one rounding order (each order with one codec): the order moves where one
        # product is rounded, not an access or a buffer.
        for name, round_before_weight in zip(DTYPES, (False, True)):
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
@pytest.mark.parametrize("specialized", [True, False], ids=["specialized", "vector"])
@pytest.mark.parametrize("heads,head_dim,rotary_dim,theta,round_before_weight,offset,strided", GPU_CASES)
def test_gpu_qk_norm_rope_bf16(heads, head_dim, rotary_dim, theta, round_before_weight, offset, strided, specialized):
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
    reference = ref64(x, w, positions, offset, rotary_dim, theta)
    rope = QkNormRopeInplace(build_codec("bfloat16"), round_before_weight,
                             specialized_min_rows=rows if specialized else None)
    assert rope.uses_vector(x.view(torch.int16), w.view(torch.int16), rotary_dim)
    assert rope.uses_specialized(x.view(torch.int16), w.view(torch.int16), rotary_dim) == specialized
    rope(x.view(torch.int16), w.view(torch.int16), positions, EPS, offset, rotary_dim, theta)
    torch.cuda.synchronize()
    assert torch.equal(buf[..., head_dim:], before_gate)
    # HF's CPU powf is one ulp off for a few inv_freq entries (rope.py's docstring); at large
    # positions that flips some bf16 cos/sin roundings of those frequencies: >= 99% exact.
    assert_bf16_close(x.double().cpu(), expected.cpu(), scale.cpu(), exact=0.99)
    assert_close_rel(x.double().cpu(), reference.cpu(), 2e-2)


def gpu_inputs(seed, rows, heads, head_dim, offset, strided):
    """bf16 rows [rows, heads, head_dim or 2 head_dim] (strided: q beside its gate), a norm weight
    (near 0 with a weight offset, near 1 without) and int32 positions, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = 2 * head_dim if strided else head_dim
    buf = (torch.randn(rows, heads, width, device="cuda", generator=gen) * 3).bfloat16()
    w = (torch.randn(head_dim, device="cuda", generator=gen) * 0.3 + (0.0 if offset else 1.0)).bfloat16()
    positions = torch.randint(0, 262144, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    return buf, w, positions


def rope_on_copy(buf, head_dim, launch):
    """The bits of a copy of ``buf`` after ``launch(x)`` on its q heads x = copy[..., :head_dim] (int16 bits)."""
    copy = buf.clone()
    launch(copy[..., :head_dim].view(torch.int16))
    return copy.view(torch.int16)


def assert_vector_bits(specialized, vector):
    """The specialized kernel's bf16 bits are the vector kernel's, every one."""
    torch.cuda.synchronize()
    differ = (specialized != vector).sum().item()
    assert differ == 0, f"{differ} of {specialized.numel()} bf16 values differ from the vector kernel's"


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,rotary_dim,theta,round_before_weight,offset,strided", GPU_CASES)
def test_gpu_specialized_matches_vector_bf16(heads, head_dim, rotary_dim, theta, round_before_weight, offset,
                                             strided):
    """A prefill of 16384 rows (each block strides over 4 to 31 rows on an H200): the specialized
    kernel gives the vector kernel's bits, as it sums squares in the vector kernel's order (rope.py)."""
    rows = 16384
    buf, w, positions = gpu_inputs(47, rows, heads, head_dim, offset, strided)

    def launcher(min_rows):
        rope = QkNormRopeInplace(build_codec("bfloat16"), round_before_weight, specialized_min_rows=min_rows)

        def launch(x):
            assert rope.uses_specialized(x, w.view(torch.int16), rotary_dim) == (min_rows is not None)
            rope(x, w.view(torch.int16), positions, EPS, offset, rotary_dim, theta)

        return launch

    assert_vector_bits(rope_on_copy(buf, head_dim, launcher(rows)), rope_on_copy(buf, head_dim, launcher(None)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,options", SPECIALIZED_VARIANTS)
def test_gpu_specialized_variants_match_vector_bf16(shape, options):
    """The variants a sweep builds (SPECIALIZED_VARIANTS), each at 16384 rows of its q: the vector
    kernel's bits (grid-stride over many rows a block, both buffers of a pipelined block)."""
    heads, head_dim, rotary_dim, theta, round_before_weight, offset, strided = GPU_CASES[0 if shape == "qwen3" else 2]
    rows = 16384
    buf, w, positions = gpu_inputs(53, rows, heads, head_dim, offset, strided)
    kernel = Kernel(build_qk_norm_rope_specialized_kernel(build_codec("bfloat16"), round_before_weight, head_dim,
                                                          rotary_dim, heads, **options))
    threads = block_threads(heads // options["heads_per_thread"] * options["group_threads"])
    blocks = multiprocessor_count() * (options.get("min_blocks_per_sm") or 4)
    vector = QkNormRopeInplace(build_codec("bfloat16"), round_before_weight, specialized_min_rows=None)
    specialized = rope_on_copy(buf, head_dim, lambda x: kernel[blocks, threads, 0, 0](
        x, w.view(torch.int16), positions, np.float32(EPS), np.float32(offset), np.float32(theta)))
    expected = rope_on_copy(buf, head_dim, lambda x: vector(x, w.view(torch.int16), positions, EPS, offset,
                                                            rotary_dim, theta))
    assert_vector_bits(specialized, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,rotary_dim,theta,round_before_weight,offset,strided", GPU_CASES)
def test_gpu_vector_matches_scalar_bf16(heads, head_dim, rotary_dim, theta, round_before_weight, offset, strided):
    buf, w, positions = gpu_inputs(45, 4099, heads, head_dim, offset, strided)
    outs = []
    for vectorize in (True, False):
        copy = buf.clone()
        x = copy[..., :head_dim].view(torch.int16)
        rope = QkNormRopeInplace(build_codec("bfloat16"), round_before_weight, vectorize=vectorize,
                                 specialized_min_rows=None)
        assert rope.uses_vector(x, w.view(torch.int16), rotary_dim) == vectorize
        rope(x, w.view(torch.int16), positions, EPS, offset, rotary_dim, theta)
        outs.append(copy)
    torch.cuda.synchronize()
    vector, scalar = outs
    assert torch.equal(vector[..., head_dim:], scalar[..., head_dim:])
    scale = term_scale(hf_rms_norm(buf[..., :head_dim], w, offset, round_before_weight).double(), rotary_dim)
    # Same roundings; only the sum of squares' order differs (an inv_rms ulp flips a rare rounding).
    assert_bf16_close(vector[..., :head_dim].double().cpu(), scalar[..., :head_dim].cpu(), scale.cpu(), exact=0.999)


# ---------------------------------------------------------------- fused with the KV cache write (qk_rope_kv.py)

FUSED_Q_HEADS, FUSED_KV_HEADS, FUSED_PAGE_SIZE, FUSED_PAGES = 4, 2, 4, 9
# Decode at position 6, a 5-row chunk after 3 earlier tokens (crosses a page), a request's first
# token, a decode row filling the last slot of its page; pages shuffled (test_kv_cache.make_step).
FUSED_BATCH = [(1, 7), (5, 8), (1, 1), (1, 8)]
# name: (round_before_weight, weight_offset, head_dim, rotary_dim, theta, gated). Qwen3-like: q a
# plain view, full rotary. Qwen3.5-like: q strided in a per-head [q | gate] buffer, partial rotary
# (pass-through chunks after one or two pair chunks).
FUSED_CASES = {
    "qwen3": (True, 0.0, 16, 16, 1e6, False),
    "qwen3_5": (False, 1.0, 32, 16, 1e7, True),
}


def fused_inputs(dtype_name: str, case: str, seed: int) -> dict:
    """Host storage arrays: a fused qkv output [T, Hq * (D or 2D) + 2 Hkv * D], the two norm
    weights, and the step's page metadata."""
    _, offset, head_dim, _, _, gated = FUSED_CASES[case]
    gen = torch.Generator().manual_seed(seed)
    step = make_step(FUSED_BATCH, FUSED_PAGE_SIZE, FUSED_PAGES, np.random.default_rng(seed))
    q_width = (2 if gated else 1) * head_dim
    rows = len(step["positions"])
    qkv = torch.randn(rows, FUSED_Q_HEADS * q_width + 2 * FUSED_KV_HEADS * head_dim, generator=gen) * 3
    weights = [torch.randn(head_dim, generator=gen) * 0.3 + (0.0 if offset else 1.0) for _ in range(2)]
    return dict(step, qkv=to_storage(qkv, dtype_name), q_weight=to_storage(weights[0], dtype_name),
                k_weight=to_storage(weights[1], dtype_name))


def run_on_views(inputs: dict, dtype_name: str, case: str, launch, cache_shift: int = 0) -> tuple:
    """``launch(q, k, v, k_cache, v_cache)`` on device copies of the qkv buffer and of a poisoned
    page-first pool [pages, 2 layers, 2, S, Hkv, D] (layer 1's views; every cache row starts
    ``cache_shift`` elements past a 16-byte boundary). Returns (qkv, pool) after it, on the host."""
    head_dim, gated = FUSED_CASES[case][2], FUSED_CASES[case][5]
    rows = inputs["qkv"].shape[0]
    q_width = (2 if gated else 1) * head_dim
    shape = (FUSED_PAGES, 2, 2, FUSED_PAGE_SIZE, FUSED_KV_HEADS, head_dim + cache_shift)
    # Device arrays: the simulator transfers only contiguous host arrays; views come after.
    qkv, padded = cuda.to_device(inputs["qkv"]), cuda.to_device(poisoned(shape, dtype_name))
    q_end = FUSED_Q_HEADS * q_width
    q = qkv[:, :q_end].reshape(rows, FUSED_Q_HEADS, q_width)[..., :head_dim]
    kv = qkv[:, q_end:].reshape(rows, 2 * FUSED_KV_HEADS, head_dim)
    pool = padded[..., cache_shift:]
    launch(q, kv[:, :FUSED_KV_HEADS], kv[:, FUSED_KV_HEADS:], pool[:, 1, 0], pool[:, 1, 1])
    return qkv.copy_to_host(), padded.copy_to_host()[..., cache_shift:]


def separate_launches(inputs: dict, dtype_name: str, case: str, group: int | None = None):
    """What the fused launch replaces: the vector qk_norm_rope on q, then on k, then write_kv.
    ``group``: run the vector kernel with that many threads per head (4 threads a block) instead
    of the launcher's choice."""
    round_before_weight, offset, _, rotary_dim, theta, _ = FUSED_CASES[case]
    rope = QkNormRopeInplace(build_codec(dtype_name), round_before_weight, SIM_THREADS)
    positions = inputs["positions"]

    def launch(q, k, v, k_cache, v_cache):
        for x, weight in ((q, inputs["q_weight"]), (k, inputs["k_weight"])):
            assert rope.uses_vector(x, weight, rotary_dim)
            if group is None:
                rope(x, weight, positions, EPS, offset, rotary_dim, theta)
            else:
                rope.vector_kernel[x.shape[0], 4, 0, vector_shared_bytes(4, rotary_dim, VECTOR_ROWS)](
                    x, weight, positions, np.float32(EPS), np.float32(offset), np.int32(rotary_dim),
                    np.float32(theta), np.int32(group))
        WriteKv()(k, v, k_cache, v_cache, inputs["batch_indices"], positions, inputs["page_indices"],
                  inputs["page_indptr"])

    return launch


def assert_same_bits(got: tuple, expected: tuple, inputs: dict, dtype_name: str) -> None:
    """qkv and pool bit-identical; the pool's poison left exactly where no row wrote (layer 1's slots
    of the step's (page, slot) pairs are written)."""
    bits = np.int32 if dtype_name == "float32" else np.int16
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a.view(bits), b.view(bits))
    pool = got[1]
    written = np.zeros(pool.shape[:4], bool)  # [pages, layers, k/v, S]
    for b, p in zip(inputs["batch_indices"], inputs["positions"]):
        written[inputs["page_indices"][inputs["page_indptr"][b] + p // FUSED_PAGE_SIZE], 1, :, p % FUSED_PAGE_SIZE] = True
    poison = poisoned((1,), dtype_name).view(bits)[0]
    assert (pool.view(bits)[~written] == poison).all(), "a cache slot the step does not own was written"
    assert (pool.view(bits)[written] != poison).all(), "a cache slot of the step was not written"


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_fused_matches_separate_launches(dtype_name, case):
    """One fused launch gives q, k, the KV cache (and the untouched gate and v) bit for bit as the
    three launches it replaces."""
    inputs = fused_inputs(dtype_name, case, seed=46)
    round_before_weight, offset, _, rotary_dim, theta, _ = FUSED_CASES[case]
    fused = QkNormRopeWriteKv(build_codec(dtype_name), round_before_weight, SIM_THREADS)

    def launch(q, k, v, k_cache, v_cache):
        assert fused.uses_vector(q, k, v, inputs["q_weight"], inputs["k_weight"], k_cache, v_cache, rotary_dim)
        fused(q, k, v, inputs["q_weight"], inputs["k_weight"], inputs["positions"], EPS, offset, rotary_dim, theta,
              k_cache, v_cache, inputs["batch_indices"], inputs["page_indices"], inputs["page_indptr"])

    expected = run_on_views(inputs, dtype_name, case, separate_launches(inputs, dtype_name, case))
    assert_same_bits(run_on_views(inputs, dtype_name, case, launch), expected, inputs, dtype_name)


@pytest.mark.parametrize("dtype_name,case", [("float32", "qwen3_5"), ("bfloat16", "qwen3")])
def test_fused_misaligned_cache_falls_back(dtype_name, case):
    """Cache rows one element past a 16-byte boundary: the launcher makes the separate launches,
    with the fused kernel's results."""
    inputs = fused_inputs(dtype_name, case, seed=47)
    round_before_weight, offset, _, rotary_dim, theta, _ = FUSED_CASES[case]
    fused = QkNormRopeWriteKv(build_codec(dtype_name), round_before_weight, SIM_THREADS)

    def launch(q, k, v, k_cache, v_cache):
        assert not fused.uses_vector(q, k, v, inputs["q_weight"], inputs["k_weight"], k_cache, v_cache, rotary_dim)
        fused(q, k, v, inputs["q_weight"], inputs["k_weight"], inputs["positions"], EPS, offset, rotary_dim, theta,
              k_cache, v_cache, inputs["batch_indices"], inputs["page_indices"], inputs["page_indptr"])

    expected = run_on_views(inputs, dtype_name, case, separate_launches(inputs, dtype_name, case))
    assert_same_bits(run_on_views(inputs, dtype_name, case, launch, cache_shift=1), expected, inputs, dtype_name)


@pytest.mark.parametrize("grid", [3, (3, 2)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_fused_kernel_rounds_and_rows_per_block(dtype_name, grid):
    """The kernel's other paths: 2 threads per head own several units each (re-read in pass 2), a
    4-thread block walks the 4 + 2 + 2 heads in 4 rounds (or, two blocks a row, 2 rounds of every
    other head pair each), and 3 blocks stride over the 8 rows (the barrier between a block's rows).
    Against the vector kernel run with the same threads per head."""
    case, group, threads = "qwen3_5", 2, 4
    round_before_weight, offset, _, rotary_dim, theta, _ = FUSED_CASES[case]
    inputs = fused_inputs(dtype_name, case, seed=48)
    fused = QkNormRopeWriteKv(build_codec(dtype_name), round_before_weight, SIM_THREADS)

    def launch(q, k, v, k_cache, v_cache):
        fused.kernel[grid, threads, 0, (threads + 3 * rotary_dim // 2) * 4](
            q, k, v, inputs["q_weight"], inputs["k_weight"], inputs["positions"], np.float32(EPS),
            np.float32(offset), np.int32(rotary_dim), np.float32(theta), np.int32(group), k_cache, v_cache,
            inputs["batch_indices"], inputs["page_indices"], inputs["page_indptr"])

    expected = run_on_views(inputs, dtype_name, case, separate_launches(inputs, dtype_name, case, group=group))
    assert_same_bits(run_on_views(inputs, dtype_name, case, launch), expected, inputs, dtype_name)


def test_fused_launch():
    if simulator_enabled():
        assert fused_launch(2, 8, 32) == (16, 1)  # whole groups in the simulator
        assert fused_launch(2, 8, 4) == (4, 4)  # two heads a block
    else:
        assert fused_launch(8, 32 + 2 * 8, 512) == (64, 6)  # Qwen3-8B bf16: 8 heads a block
        assert fused_launch(32, 16 + 2 * 4, 512) == (64, 12)  # Qwen3.5-9B bf16: 2 heads a block
        assert fused_launch(2, 8, 512) == (32, 1)  # whole warps (the shuffles need them)


def test_fused_shape_errors():
    fused = QkNormRopeWriteKv(build_codec("float32"), True, SIM_THREADS)
    rows, heads, kv_heads, head_dim = 2, 4, 2, 8
    q = np.zeros((rows, heads, head_dim), np.float32)
    kv = np.zeros((rows, kv_heads, head_dim), np.float32)
    w = np.zeros(head_dim, np.float32)
    ids = np.zeros(rows, np.int32)
    cache = np.zeros((3, 4, kv_heads, head_dim), np.float32)

    def call(**changed):
        args = dict(q=q, k=kv, v=kv, q_weight=w, k_weight=w, positions=ids, eps=EPS, weight_offset=0.0,
                    rotary_dim=head_dim, theta=1e6, k_cache=cache, v_cache=cache, batch_indices=ids,
                    page_indices=ids, page_indptr=ids)
        fused(**(args | changed))

    for name, wrong, match in [
        ("v", np.zeros((rows, kv_heads + 1, head_dim), np.float32), r"v has shape \(2, 3, 8\), expected \(2, 2, 8\)"),
        ("k_weight", np.zeros(head_dim - 1, np.float32), r"k_weight has shape \(7,\), expected \(8,\)"),
        ("batch_indices", np.zeros(rows + 1, np.int32), r"batch_indices has shape \(3,\), expected \(2,\)"),
        ("k_cache", np.zeros((3, 4, kv_heads + 1, head_dim), np.float32), r"expected \(3, 4, 2, 8\)"),
        ("k_cache", np.zeros((4, kv_heads, head_dim), np.float32), r"expected \[pages, S, 2, 8\]"),
        ("v_cache", np.zeros((3, 5, kv_heads, head_dim), np.float32), r"v_cache has shape \(3, 5, 2, 8\)"),
        ("rotary_dim", 10, "rotary_dim"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(**{name: wrong})


@pytest.mark.ptx
def test_fused_compiles_for_sm90():
    """PTX for sm_90, both codecs: 16-byte global loads and stores, and no local memory but libdevice's
    sin/cos slow path (its 28-byte argument-reduction buffer, which the unfused kernels have too): no
    chunk buffer or spill in local memory."""
    compile_for_sm90(
        """
        import re
        from executor.kernels.rope.fused_kv_write import build_qk_norm_rope_write_kv_kernel
        f32, i32, ids = types.float32, types.int32, arr("int32", 1)
        for name, round_before_weight in (("bfloat16", True), ("float32", False)):
            kernel = build_qk_norm_rope_write_kv_kernel(build_codec(name), round_before_weight)
            rows, weight, cache = arr(name, 3), arr(name, 1), arr(name, 4)
            text = vector_ptx(kernel, rows, rows, rows, weight, weight, ids, f32, f32, i32, f32, i32, cache, cache,
                              ids, ids, ids, local_ok=True)
            depots = [int(n) for n in re.findall(r"__local_depot\\d+\\[(\\d+)\\]", text)]
            assert sum(depots) <= 28, f"{name}: {depots} bytes of local memory"
            assert ".local.v" not in text, f"{name}: a vector access to local memory"
            # A thread's lane, its block's head groups and its head (a remainder, two divisions) and the
            # cache slot's page (Numba divides int32 values in 64 bits); each has LLVM's 32-bit fast
            # path. A strided range() loop would add one a loop, for its trip count.
            divisions = sum(text.count(op) for op in ("div.s64", "div.u64", "rem.s64", "rem.u64"))
            assert divisions <= 4, f"{name}: {divisions} 64-bit divisions, at most 4 expected"
        """,
        allow_f64=True,  # inv_freq's power is taken in float64 on purpose (rope.py's docstring)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,rotary_dim,theta,round_before_weight,offset,gated", [
    (32, 8, 128, 128, 1e6, True, 0.0, False),  # Qwen3-8B
    (16, 4, 256, 64, 1e7, False, 1.0, True),  # Qwen3.5-9B
])
@pytest.mark.parametrize("rows", [1, 128, 4099])  # 4099 > MAX_FUSED_ROWS: the separate launches
def test_gpu_fused_matches_separate_launches_bf16(q_heads, kv_heads, head_dim, rotary_dim, theta,
                                                   round_before_weight, offset, gated, rows):
    """Real sizes: a decode row and a prefill chunk, bit for bit against the three launches."""
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(49)
    page_size = 16
    pages = -(-rows // page_size) + 2
    q_width = (2 if gated else 1) * head_dim
    qkv = (torch.randn(rows, q_heads * q_width + 2 * kv_heads * head_dim, device=device, generator=gen) * 3).bfloat16()
    weights = [(torch.randn(head_dim, device=device, generator=gen) * 0.3 + (0.0 if offset else 1.0)).bfloat16()
               for _ in range(2)]
    # One request whose rows start mid-page, its pages in reverse order (page 0 reserved).
    positions = torch.arange(5, 5 + rows, device=device, dtype=torch.int32)
    meta = dict(batch_indices=torch.zeros(rows, device=device, dtype=torch.int32),
                page_indices=torch.arange(pages - 1, 0, -1, device=device, dtype=torch.int32),
                page_indptr=torch.tensor([0, pages - 1], device=device, dtype=torch.int32))
    codec = build_codec("bfloat16")
    fused = QkNormRopeWriteKv(codec, round_before_weight)
    outs = []
    for use_fused in (True, False):
        buf = qkv.clone()
        pool = torch.full((pages, 2, 2, page_size, kv_heads, head_dim), float("nan"), device=device,
                          dtype=torch.bfloat16)
        q = buf[:, : q_heads * q_width].view(rows, q_heads, q_width)[..., :head_dim].view(torch.int16)
        kv = buf[:, q_heads * q_width :].view(rows, 2 * kv_heads, head_dim).view(torch.int16)
        k, v = kv[:, :kv_heads], kv[:, kv_heads:]
        k_cache, v_cache = pool[:, 1, 0].view(torch.int16), pool[:, 1, 1].view(torch.int16)
        w = [x.view(torch.int16) for x in weights]
        if use_fused:
            assert fused.uses_vector(q, k, v, *w, k_cache, v_cache, rotary_dim)
            fused(q, k, v, *w, positions, EPS, offset, rotary_dim, theta, k_cache, v_cache, meta["batch_indices"],
                  meta["page_indices"], meta["page_indptr"])
        else:
            for x, weight in ((q, w[0]), (k, w[1])):
                fused.qk_norm_rope(x, weight, positions, EPS, offset, rotary_dim, theta)
            fused.write_kv(k, v, k_cache, v_cache, meta["batch_indices"], positions, meta["page_indices"],
                           meta["page_indptr"])
        outs.append((buf, pool))
    torch.cuda.synchronize()
    (buf, pool), (ref_buf, ref_pool) = outs
    assert torch.equal(buf.view(torch.int16), ref_buf.view(torch.int16))
    assert torch.equal(pool.view(torch.int16), ref_pool.view(torch.int16))
