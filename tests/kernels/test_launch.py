"""executor.kernels.primitives.launch: torch tensors as kernel arguments.

The fast GPU path picks a compiled overload by its own key and packs arguments itself,
so the tests hold it to Numba's answers: the layout it assigns a strided tensor against
Numba's own contiguity rule (its ``dummyarray`` module, loaded from the installed
numba-cuda), and on the GPU its results against Numba's launch of the same kernel.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.kernels.primitives.launch import Kernel, _launch_key, _tensor_layout
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()


def _numba_dummyarray():
    """numba-cuda's ``cudadrv/dummyarray.py`` (pure Python; the simulator replaces the package's copy)."""
    root = Path(importlib.util.find_spec("numba_cuda").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("numba_dummyarray", root / "numba/cuda/cudadrv/dummyarray.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numba_layout(tensor: torch.Tensor, dummyarray) -> str:
    """The layout Numba types ``cuda.as_cuda_array(tensor)`` with: torch gives no strides for a
    contiguous tensor (Numba then takes C strides), byte strides otherwise."""
    if tensor.is_contiguous():
        return "C"
    itemsize = tensor.element_size()
    desc = dummyarray.Array.from_desc(0, tuple(tensor.shape), tuple(s * itemsize for s in tensor.stride()),
                                      itemsize)
    return "C" if desc.flags["C_CONTIGUOUS"] else "F" if desc.flags["F_CONTIGUOUS"] else "A"


def _views() -> list[torch.Tensor]:
    base = torch.zeros(4, 6, 8)
    return [
        base, base[1], base[:, 2], base[..., :4], base[:, :, 1:], base.transpose(0, 2), base.permute(2, 1, 0),
        base.permute(1, 0, 2), base[:, :1].transpose(0, 1), base[:1, :, :1], base[::2], base[:, ::3, :],
        torch.zeros(5, 1, 7).expand(5, 3, 7), torch.zeros(1, 7).expand(2, 7), torch.zeros(0, 3)[:, :2],
        torch.zeros(6, 1).t(), torch.zeros(3, 5).t()[:, 1:], torch.zeros(8)[::2], torch.zeros(2, 3, 4).mT,
        torch.zeros(5, 4, 3).permute(2, 1, 0)[:, :, :1],
    ]


def test_key_layout_is_numbas_for_every_view():
    dummyarray = _numba_dummyarray()
    for view in _views():
        assert _tensor_layout(view) == _numba_layout(view, dummyarray), (tuple(view.shape), view.stride())


def test_key_types_scalars_and_leaves_other_arguments_to_numba():
    assert _launch_key((np.int32(1), np.float32(2.0), 3, True)) == (np.int32, np.float32, int, bool)
    assert _launch_key((np.zeros(3),)) is None  # a numpy array: Numba's own path
    assert _launch_key((torch.zeros(3), np.int32(1))) is None  # host memory: Numba's path, which refuses it


@cuda.jit
def _scale_rows(src, dst, factor, shift):
    i, j = cuda.grid(2)
    if i < dst.shape[0] and j < dst.shape[1]:
        dst[i, j] = src[i, j] * factor + shift


@pytest.mark.skipif(not simulator_enabled(), reason="host tensors: the simulator's path (the GPU's is the next test)")
def test_simulator_launch_writes_through_strided_tensor_views():
    src = torch.arange(24, dtype=torch.float32).view(4, 6)
    out = torch.full((6, 8), -1.0)
    Kernel(_scale_rows)[(2, 2), (4, 4)](src.t(), out[:, 2:6], np.float32(2.0), np.float32(1.0))
    assert torch.equal(out[:, 2:6], src.t() * 2 + 1)
    assert (out[:, :2] == -1).all() and (out[:, 6:] == -1).all()


@pytest.mark.gpu
def test_gpu_fast_launch_matches_numbas_for_every_layout():
    """Each view launched twice through ``Kernel`` (the first launch learns the key and compiles,
    both pack and launch themselves) and once through Numba's own launch: the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    kernel, stream = Kernel(_scale_rows), cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        base = torch.randn(64, 96, device="cuda", generator=generator).to(dtype)
        for src in (base, base.t(), base[3:40, 5:70], base[::2, ::3], base.t()[1:, :17]):
            rows, cols = src.shape
            got = [torch.zeros(cols + 5, rows + 3, device="cuda", dtype=dtype).t()[:rows, :cols] for _ in range(2)]
            expected = torch.zeros(rows, cols, device="cuda", dtype=dtype)
            grid = (-(-rows // 16), -(-cols // 16))
            for out in got:
                kernel[grid, (16, 16), stream](src, out, np.float32(1.5), np.float32(-0.25))
            _scale_rows[grid, (16, 16), stream](cuda.as_cuda_array(src), cuda.as_cuda_array(expected),
                                                np.float32(1.5), np.float32(-0.25))
            torch.cuda.synchronize()
            key = _launch_key((src, got[0], np.float32(0), np.float32(0)))
            assert key[0] == (dtype, 2, _tensor_layout(src)) and kernel._launches[key] is not None
            for out in got:
                assert torch.equal(out, expected), (dtype, tuple(src.shape), src.stride())


@pytest.mark.gpu
def test_gpu_launch_memo_follows_each_view_object():
    """The per-tensor memo (launch.py ``_TensorMemo``) packs each view object once: views made afresh
    for every launch (new objects at other offsets and shapes, the memo's oldest entries dropped on
    the way) each reach the kernel with their own address and shape, and a remembered view launches
    again to the same result."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from executor.kernels.primitives.launch import TENSOR_MEMO_ENTRIES

    kernel, stream = Kernel(_scale_rows), cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    src = torch.randn(64, 96, device="cuda")
    out = torch.zeros(64, 96, device="cuda")
    kept = src[1:9, 2:10], out[1:9, 2:10]
    kernel[(1, 1), (16, 16), stream](*kept, np.float32(2.0), np.float32(0.0))
    for index in range(TENSOR_MEMO_ENTRIES + 40):
        rows, start = 1 + index % 7, index % 50
        kernel[(1, 1), (16, 16), stream](src[start : start + rows, :16], out[start : start + rows, 16:32],
                                         np.float32(2.0), np.float32(float(index)))
        expected = src[start : start + rows, :16] * 2.0 + float(index)  # exact doubling: FMA or not, one rounding
        assert torch.equal(out[start : start + rows, 16:32], expected), index
    kernel[(1, 1), (16, 16), stream](*kept, np.float32(2.0), np.float32(1.0))
    assert torch.equal(kept[1], kept[0] * 2.0 + 1.0)
    assert len(kernel._tensors.entries) <= TENSOR_MEMO_ENTRIES
