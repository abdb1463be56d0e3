"""L2Prefetch: a cache hint that reads a byte range and changes nothing; bad views are refused up front."""

from __future__ import annotations

import pytest
import torch

from executor.device import open_device
from executor.kernels.l2_prefetch import L2Prefetch
from tests.kernels.compile_check import compile_for_sm90


@pytest.mark.parametrize("num_bytes", [16, 4096 + 48, 3 * 4096])
def test_prefetch_walks_the_range_and_leaves_it_unchanged(num_bytes):
    """Chunks of 1 KiB (several per thread and a short last one at 4144 bytes); the bytes and
    their neighbours are the same afterwards."""
    device = open_device("auto")
    generator = torch.Generator().manual_seed(0)
    backing = torch.randint(0, 256, (num_bytes + 64,), dtype=torch.uint8, generator=generator)
    data_host = backing.to(device.torch_device)
    data = data_host[32 : 32 + num_bytes]
    L2Prefetch(chunk_bytes=1024)(data, stream=device.current_stream())
    device.synchronize()
    assert torch.equal(data_host.cpu(), backing)


def test_views_the_instruction_cannot_take_are_refused_with_their_numbers():
    open_device("auto")
    data = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"o_proj: address .* and size 4088 bytes must be multiples of 16"):
        L2Prefetch.check(data[8:], "o_proj")
    with pytest.raises(ValueError, match=r"contiguous uint8"):
        L2Prefetch.check(data.view(torch.int32), "o_proj")
    L2Prefetch.check(data[16:], "o_proj")  # aligned and whole: accepted


def test_compiles_to_the_bulk_prefetch_for_sm90():
    compile_for_sm90(
        """
        from executor.kernels.l2_prefetch import build_prefetch_kernel
        text = ptx(build_prefetch_kernel(), types.Array(types.uint8, 1, "C"), types.int32)
        assert "cp.async.bulk.prefetch.L2.global" in text, "the prefetch instruction is missing"
        """
    )
