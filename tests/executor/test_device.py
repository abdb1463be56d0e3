"""Opening a device: GPUs older than the kernels' instructions are refused with the numbers."""

from __future__ import annotations

import pytest

from executor.device import DeviceError, check_compute_capability


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (12, 0)])
def test_sm80_and_later_are_accepted(capability):
    check_compute_capability("some GPU", capability)


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_older_gpus_are_refused_naming_both_capabilities(capability):
    with pytest.raises(DeviceError) as error:
        check_compute_capability("Tesla T4", capability)
    message = str(error.value)
    assert "Tesla T4" in message and f"{capability[0]}.{capability[1]}" in message and "8.0" in message


def test_decode_rows_share_the_step_stream_where_there_is_one():
    """The simulator and the meta device have one stream: a prefill step's decode rows launch on the step's
    stream whatever routing.DECODE_ROWS_SIDE_STREAM says, and a side stream is refused there by name."""
    import torch

    from executor.device import Device
    from executor.models.decode_rows_stream import SideStream, StepStream, decode_rows_stream

    for kind in ("sim", "meta"):
        device = Device(kind, torch.device("cpu" if kind == "sim" else "meta"))
        lanes = decode_rows_stream(device, side=True)
        assert isinstance(lanes, StepStream)
        step_stream = object()
        assert lanes.fork(step_stream) is step_stream
        lanes.join()
        with pytest.raises(ValueError, match=f"not '{kind}'"):
            SideStream(device)
