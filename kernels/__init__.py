"""Selection, placement and attention kernels, chosen once per device.

Every kernel has a plain torch reference (``kvdrive.kernels.reference``), which runs
on any device; the CPU has faster compiled versions (numba, ``kvdrive.kernels.cpu``),
tested against it. :func:`for_device` picks the set a session uses; it is the one
place that decides by device. No kernel here has run on a GPU yet: on a CUDA device
the client uses the torch references.
"""

from __future__ import annotations

import torch

from kvdrive.kernels.backends import CpuKernels, Kernels, ReferenceKernels

KERNEL_CHOICES = ("auto", "cpu", "reference")

__all__ = ["KERNEL_CHOICES", "CpuKernels", "Kernels", "ReferenceKernels", "for_device"]


def for_device(device: torch.device | str, choice: str = "auto") -> Kernels:
    """The kernels for ``device``: ``auto`` takes the compiled CPU kernels on the CPU and the
    torch references elsewhere; ``cpu`` or ``reference`` forces one (``cpu`` only on the CPU)."""
    device = torch.device(device)
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    on_cpu = device.type == "cpu"
    if choice == "cpu" and not on_cpu:
        raise ValueError(f"kernels='cpu' runs on CPU tensors; the model is on {device} (use 'auto' or 'reference')")
    if choice == "cpu" or (choice == "auto" and on_cpu):
        return CpuKernels(device)
    return ReferenceKernels(device, one_thread=on_cpu, widen_half=on_cpu)
