"""sigmoid_mul_inplace (output_gate.py) against torch and its own scalar kernel (simulator at tiny
shapes; bf16 GPU tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.kernels.primitives.codec import build_codec
from executor.kernels.rows.output_gate import (
    GATE_BLOCKS_PER_SM,
    GATE_ROWS_UNROLL,
    GATE_THREADS,
    MAX_GATE_ROWS_UNROLL,
    SigmoidMulInplace,
    build_sigmoid_mul_inplace_vector_kernel,
    gate_grid,
)
from executor.kernels.primitives.grid import MAX_COLUMN_BLOCKS
from executor.numba_cuda import load_cuda
from tests.kernels.compile_check import compile_for_sm90
from tests.kernels.storage import (
    DTYPES, OVERFLOW_WARNING, assert_bf16_close, assert_close_rel, from_storage, to_storage,
)

SIM_THREADS = 32  # rows wider than the block exercise the stride loops


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_sigmoid_mul_inplace_strided(dtype_name):
    gen = torch.Generator().manual_seed(32)
    rows, heads, head_dim = 2, 3, 136  # a full tile of 4 x 32, then a ragged end
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, heads, head_dim, generator=gen) * 2).to(dt)
    q_gate = (torch.randn(rows, heads, 2 * head_dim, generator=gen) * 3).to(dt)  # per head [q | gate]
    q_gate[0, 0, head_dim : head_dim + 2] = torch.tensor([-150.0, 150.0])  # exp overflow both ways
    # Device arrays: the simulator transfers only contiguous host arrays, and
    # strided device views are what the executor passes on the GPU too.
    cuda = load_cuda()
    q_gate_dev = cuda.to_device(to_storage(q_gate, dtype_name))
    x_dev = cuda.to_device(to_storage(torch.cat([x, x], dim=-1), dtype_name))  # x as a strided view too
    gate_mul = SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS)
    assert gate_mul.uses_vector(x_dev[:, :, :head_dim], q_gate_dev[:, :, head_dim:])
    gate_mul(x_dev[:, :, :head_dim], q_gate_dev[:, :, head_dim:])
    x_big = x_dev.copy_to_host()
    np.testing.assert_array_equal(x_big[..., head_dim:], to_storage(x, dtype_name))  # untouched
    got = from_storage(x_big[..., :head_dim], dtype_name)
    gate = q_gate[..., head_dim:]
    if dtype_name == "float32":
        assert_close_rel(got, x.double() * torch.sigmoid(gate.double()), 1e-5)
    else:  # HF: attn_output * torch.sigmoid(gate) in bf16
        assert_bf16_close(got, x * torch.sigmoid(gate))
        assert_close_rel(got, x.double() * torch.sigmoid(gate.double()), 1e-2)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_sigmoid_mul_inplace_gate_is_x(dtype_name):
    gen = torch.Generator().manual_seed(33)
    dt = getattr(torch, dtype_name)
    a = torch.randn(1, 2, 130, generator=gen).to(dt)
    # One device array passed twice: the simulator copies each host argument separately.
    buf = load_cuda().to_device(to_storage(a, dtype_name))
    gate_mul = SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS)
    assert not gate_mul.uses_vector(buf, buf)  # 130-element heads are not whole 16-byte chunks
    gate_mul(buf, buf)
    got = from_storage(buf.copy_to_host(), dtype_name)
    if dtype_name == "float32":
        assert_close_rel(got, a.double() * torch.sigmoid(a.double()), 1e-5)
    else:
        assert_bf16_close(got, a * torch.sigmoid(a))


def gate_inputs(rows, heads, head_dim, dtype_name, seed):
    """(x [rows, heads, D], q_gate [rows, heads, 2D]) in the dtype: per head [q | gate], gate = q_gate[..., D:];
    the first gate elements overflow exp both ways and hit sigmoid(0) and sigmoid(-0)."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype_name)
    x = (torch.randn(rows, heads, head_dim, generator=gen) * 2).to(dt)
    q_gate = (torch.randn(rows, heads, 2 * head_dim, generator=gen) * 3).to(dt)
    q_gate[0, 0, head_dim : head_dim + 4] = torch.tensor([-150.0, 150.0, 0.0, -0.0])
    return x, q_gate


def gate_reference(x, gate):
    """HF's ``x * torch.sigmoid(gate)`` in the inputs' dtype from float64 math: the sigmoid rounded to the
    dtype, then the product rounded (torch's float64 -> bf16 cast goes through float32, as HF's does)."""
    s = torch.sigmoid(gate.double()).to(gate.dtype).double()
    return (x.double() * s).to(x.dtype).double()


def run_gate(gate_mul, x, q_gate, dtype_name):
    """gate_mul on device copies: x contiguous, the gate the strided q_gate[..., D:]; x's result in float64."""
    cuda = load_cuda()
    head_dim = x.shape[-1]
    x_dev = cuda.to_device(to_storage(x, dtype_name))
    q_gate_dev = cuda.to_device(to_storage(q_gate, dtype_name))
    gate_mul(x_dev, q_gate_dev[:, :, head_dim:])
    np.testing.assert_array_equal(q_gate_dev.copy_to_host(), to_storage(q_gate, dtype_name))  # gate untouched
    return from_storage(x_dev.copy_to_host(), dtype_name)


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("rows,heads,head_dim,several_turns", [
    (13, 3, 96, True),  # 36 bf16 / 72 f32 chunks a row: 2 or 3 column tiles of 32, a ragged last one
    (7, 3, 16, False),  # 6 bf16 / 12 f32 chunks a row: several rows side by side in a block, idle threads
    (1, 2, 8, False),  # one row (decode)
])
@pytest.mark.parametrize("blocks_per_sm,rows_unroll", [(GATE_BLOCKS_PER_SM, GATE_ROWS_UNROLL), (1, 3), (2, 1)])
def test_sigmoid_mul_vector_launch_matches_scalar_and_reference(
    dtype_name, rows, heads, head_dim, several_turns, blocks_per_sm, rows_unroll
):
    """The launcher's vector kernel with a strided gate: the scalar kernel's bits, and bf16 HF's rounding
    of the float64 reference bit for bit. On the simulator's small grid (2 SMs), 13 rows take several
    turns of the row loop, and the last is ragged where a turn covers more than one row."""
    x, q_gate = gate_inputs(rows, heads, head_dim, dtype_name, seed=40)
    codec = build_codec(dtype_name)
    vector = SigmoidMulInplace(codec, SIM_THREADS, blocks_per_sm=blocks_per_sm, rows_unroll=rows_unroll)
    scalar = SigmoidMulInplace(codec, SIM_THREADS, vectorize=False)
    gate_view = to_storage(q_gate, dtype_name)[:, :, head_dim:]
    assert vector.uses_vector(to_storage(x, dtype_name), gate_view)
    if several_turns:  # one row slot a block (rows wider than the block)
        rows_a_turn = vector.vector_grid(rows, heads, head_dim)[0] * rows_unroll
        assert rows_a_turn < rows and (rows_a_turn == 1 or rows % rows_a_turn)
    got = run_gate(vector, x, q_gate, dtype_name)
    expected = run_gate(scalar, x, q_gate, dtype_name)
    assert torch.equal(got, expected)
    reference = gate_reference(x, q_gate[..., head_dim:])
    if dtype_name == "bfloat16":
        assert torch.equal(got, reference)
    else:  # float32 rounds exp, 1 + exp and the reciprocal on the way: ulps from the float64 value
        assert_close_rel(got, reference, 1e-6)


@pytest.mark.filterwarnings(OVERFLOW_WARNING)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("grid,threads,rows_unroll", [
    ((2, 2), 4, GATE_ROWS_UNROLL),  # 9 bf16 chunks a row: column tiles of 4, a column loop past the grid
    ((1, 1), 32, 3),  # 9 or 18 chunks a row, 32 threads: 3 or 1 rows side by side
    ((3, 5), 8, 2),  # more column blocks than tiles: the extra ones idle
    ((5, 1), 4, 1),
])
def test_sigmoid_mul_vector_kernel_matches_scalar(dtype_name, grid, threads, rows_unroll):
    """The vector kernel launched directly on any grid and block, strided x and gate views: the scalar
    kernel's bits, and the x halves of the [x | gate] buffer only."""
    rows, heads, head_dim = 11, 3, 24
    x, q_gate = gate_inputs(rows, heads, head_dim, dtype_name, seed=37)
    cuda = load_cuda()
    expected = cuda.to_device(to_storage(torch.cat([x, q_gate[..., head_dim:]], dim=-1), dtype_name))
    gate_mul = SigmoidMulInplace(build_codec(dtype_name), SIM_THREADS, vectorize=False)
    gate_mul(expected[:, :, :head_dim], expected[:, :, head_dim:])
    buf = cuda.to_device(to_storage(torch.cat([x, q_gate[..., head_dim:]], dim=-1), dtype_name))
    build_sigmoid_mul_inplace_vector_kernel(build_codec(dtype_name), rows_unroll)[grid, threads](
        buf[:, :, :head_dim], buf[:, :, head_dim:]
    )
    np.testing.assert_array_equal(buf.copy_to_host(), expected.copy_to_host())


def test_gate_grid():
    # Qwen3.5-9B prefill on 132 SMs x 3 blocks: 2 column tiles of a 512-chunk row, 198 row blocks.
    assert gate_grid(16384, 512, 256, 132 * 3) == (198, 2)
    assert gate_grid(1, 512, 256, 132 * 3) == (1, 2)  # no more row blocks than rows
    assert gate_grid(7, 6, 32, 6) == (2, 1)  # 5 rows side by side a block
    assert gate_grid(100, 40 * 256, 256, 8) == (1, 40)  # more tiles than blocks: one row block
    assert gate_grid(3, (MAX_COLUMN_BLOCKS + 5) * 32, 32, 4) == (1, MAX_COLUMN_BLOCKS)


def test_gate_knob_errors():
    codec = build_codec("bfloat16")
    with pytest.raises(ValueError, match=r"blocks_per_sm must be in \[1, 8\] for 256-thread blocks, got 9"):
        SigmoidMulInplace(codec, vector_threads=256, blocks_per_sm=9)
    with pytest.raises(ValueError, match=r"blocks_per_sm must be in \[1, 32\] for 32-thread blocks, got 0"):
        SigmoidMulInplace(codec, 32, blocks_per_sm=0)
    too_many = MAX_GATE_ROWS_UNROLL + 1
    with pytest.raises(ValueError, match=rf"rows_unroll must be in \[1, {MAX_GATE_ROWS_UNROLL}\], got {too_many}"):
        SigmoidMulInplace(codec, rows_unroll=too_many)
    with pytest.raises(ValueError, match=r"vector_threads must be a power of two in \[32, 1024\], got 96"):
        SigmoidMulInplace(codec, vector_threads=96)
    gate_mul = SigmoidMulInplace(codec, 64)
    assert (gate_mul.vector_threads, gate_mul.blocks_per_sm) == (min(GATE_THREADS, 64), GATE_BLOCKS_PER_SM)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,heads", [(1, 16), (300, 24), (4096, 16)])
def test_gpu_sigmoid_mul_inplace_bf16(rows, heads):
    head_dim = 256
    gen = torch.Generator(device="cuda").manual_seed(35)
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 2).bfloat16()
    q_gate = (torch.randn(rows, heads, 2 * head_dim, device="cuda", generator=gen) * 3).bfloat16()
    gate = q_gate[..., head_dim:]
    expected = x * torch.sigmoid(gate)
    gate_mul = SigmoidMulInplace(build_codec("bfloat16"))
    assert gate_mul.uses_vector(x.view(torch.int16), gate.view(torch.int16))
    gate_mul(x.view(torch.int16), gate.view(torch.int16))
    torch.cuda.synchronize()
    assert_bf16_close(x.double().cpu(), expected.cpu())


@pytest.mark.gpu
def test_gpu_sigmoid_mul_vector_matches_scalar_bf16():
    gen = torch.Generator(device="cuda").manual_seed(39)
    rows, heads, head_dim = 1025, 16, 256
    q_gate = (torch.randn(rows, heads, 2 * head_dim, device="cuda", generator=gen) * 3).bfloat16()
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 2).bfloat16()
    outs = []
    for vectorize in (True, False):
        y = x.clone()
        gate_mul = SigmoidMulInplace(build_codec("bfloat16"), vectorize=vectorize)
        gate = q_gate[..., head_dim:].view(torch.int16)
        assert gate_mul.uses_vector(y.view(torch.int16), gate) == vectorize
        gate_mul(y.view(torch.int16), gate)
        outs.append(y)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("vector_threads,blocks_per_sm,rows_unroll", [
    (GATE_THREADS, GATE_BLOCKS_PER_SM, GATE_ROWS_UNROLL),  # the defaults
    (256, 3, 4),  # other swept settings (output_gate.py's docstring)
    (256, 4, 1),
    (128, 6, 4),
    (512, 2, 2),
])
def test_gpu_sigmoid_mul_vector_matches_scalar_prefill_bf16(vector_threads, blocks_per_sm, rows_unroll):
    """bench/kernels.py's shape (Qwen3.5-9B prefill, 16384 x 16 x 256, gate strided in [q | gate]): the
    vector kernel with each knob setting gives the scalar kernel's bits."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    rows, heads, head_dim = 16384, 16, 256
    q_gate = (torch.randn(rows, heads, 2 * head_dim, device="cuda", generator=gen) * 3).bfloat16()
    q_gate[0, 0, head_dim : head_dim + 4] = torch.tensor([-150.0, 150.0, 0.0, -0.0], device="cuda")
    x = (torch.randn(rows, heads, head_dim, device="cuda", generator=gen) * 2).bfloat16()
    gate = q_gate[..., head_dim:].view(torch.int16)
    outs = []
    for vectorize in (True, False):
        y = x.clone()
        gate_mul = SigmoidMulInplace(
            build_codec("bfloat16"), vectorize=vectorize, vector_threads=vector_threads,
            blocks_per_sm=blocks_per_sm, rows_unroll=rows_unroll,
        )
        assert gate_mul.uses_vector(y.view(torch.int16), gate) == vectorize
        gate_mul(y.view(torch.int16), gate)
        outs.append(y)
    torch.cuda.synchronize()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_shape_errors():
    codec = build_codec("float32")
    with pytest.raises(ValueError, match="gate"):
        SigmoidMulInplace(codec, SIM_THREADS)(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 5), np.float32))


@pytest.mark.ptx
def test_compiles_for_sm90():
    """The scalar kernel, the vector kernel at each rows_unroll (buffers in registers), and the launcher's
    vector kernel with the launch bounds it carries (threads, blocks per SM) in its PTX."""
    compile_for_sm90(
        """
        from executor.kernels.rows.output_gate import (
            GATE_BLOCKS_PER_SM, GATE_THREADS, MAX_GATE_ROWS_UNROLL, SigmoidMulInplace,
            build_sigmoid_mul_inplace_kernel, build_sigmoid_mul_inplace_vector_kernel,
        )
        for name in DTYPES:
            codec = build_codec(name)
            ptx(build_sigmoid_mul_inplace_kernel(codec), arr(name, 3), arr(name, 3))
            for rows_unroll in range(1, MAX_GATE_ROWS_UNROLL + 1):
                vector_ptx(build_sigmoid_mul_inplace_vector_kernel(codec, rows_unroll), arr(name, 3), arr(name, 3))
            dispatcher = SigmoidMulInplace(codec).vector_kernel.dispatcher
            bounds = dispatcher.targetoptions["launch_bounds"]
            assert bounds == (GATE_THREADS, GATE_BLOCKS_PER_SM), bounds
            argtypes = (arr(name, 3), arr(name, 3))
            text = cuda.compile_ptx(dispatcher.py_func, argtypes, cc=(9, 0), launch_bounds=bounds)[0]
            assert f".maxntid {GATE_THREADS}, 1, 1" in text and f".minnctapersm {GATE_BLOCKS_PER_SM}" in text
            assert "ld.global.v4" in text and ".local" not in text
        """
    )
