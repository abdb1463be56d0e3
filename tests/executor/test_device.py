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
