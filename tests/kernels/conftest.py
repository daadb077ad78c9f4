"""The kernel backends under test: every set that runs on CPU tensors."""

from __future__ import annotations

import pytest

from kvdrive.kernels import for_device

from kernel_cases import BACKENDS


@pytest.fixture(params=BACKENDS)
def kernels(request):
    """Each backend's :class:`kvdrive.kernels.Kernels` for the CPU."""
    return for_device("cpu", request.param)
