"""Which kernel set a session uses: :func:`for_device`, the one place that decides by device."""

from __future__ import annotations

import os

import torch

from kvdrive.kernels.backends import CpuKernels, Kernels, ReferenceKernels

KERNEL_CHOICES = ("auto", "cpu", "reference", "triton")

__all__ = ["KERNEL_CHOICES", "compiles_on_cpu", "for_device"]


def compiles_on_cpu(device: torch.device | str, choice: str = "auto") -> bool:
    """Whether :func:`for_device` gives the compiled CPU kernels for ``(device, choice)``: the
    kernels :func:`warm_up` prepares."""
    return torch.device(device).type == "cpu" and choice in ("auto", "cpu")


def for_device(device: torch.device | str, choice: str = "auto") -> Kernels:
    """The kernels for ``device``: ``auto`` takes the compiled CPU kernels on the CPU and the
    torch references elsewhere; ``cpu`` or ``reference`` forces one (``cpu`` only on the CPU);
    ``triton`` the Triton kernels (CUDA, or the CPU under Triton's interpreter). On a CUDA
    device fetched pages reach it through pinned staging and a copy stream
    (:class:`kvdrive.kernels.transfer.CudaTransfer`)."""
    device = torch.device(device)
    kernels = _choose(device, choice)
    if device.type == "cuda":
        from kvdrive.kernels.transfer import CudaTransfer  # noqa: PLC0415

        kernels.transfer = CudaTransfer(device)
    return kernels


def _choose(device: torch.device, choice: str) -> Kernels:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    on_cpu = device.type == "cpu"
    if choice == "triton":
        return _triton(device)
    if choice == "cpu" and not on_cpu:
        raise ValueError(f"kernels='cpu' runs on CPU tensors; the model is on {device} (use 'auto' or 'reference')")
    if compiles_on_cpu(device, choice):
        return CpuKernels(device)
    return ReferenceKernels(device, one_thread=on_cpu, widen_half=on_cpu)


def _triton(device: torch.device) -> Kernels:
    """The Triton kernels (imported here: ``import kvdrive.kernels`` never needs triton): on a
    CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
    if device.type != "cuda" and not (device.type == "cpu" and interpreting):
        raise ValueError(f"kernels='triton' runs on CUDA devices (on the CPU only under Triton's interpreter, "
                         f"TRITON_INTERPRET=1); the model is on {device}")
    try:
        from kvdrive.kernels.triton_kernels import TritonKernels
    except ImportError as e:
        raise ValueError(f"kernels='triton' cannot load the Triton kernels: {e}") from e
    return TritonKernels(device)
