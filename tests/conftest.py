"""Test setup: kernels run in the Numba CUDA simulator unless a GPU is present.

NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported, so this
runs at collection, before any test module imports the executor.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


HAS_GPU = _cuda_available()
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    from executor.device import speed_up_simulator

    speed_up_simulator()
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if HAS_GPU else 0


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run through the device tool")
    skip_multi = pytest.mark.skip(reason=f"needs 2 or more GPUs of one host, this one has {gpus}")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        elif "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)
