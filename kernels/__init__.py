"""Selection, placement and attention kernels, chosen once per device.

Every kernel has a plain torch reference (``kvdrive.kernels.reference``), which runs
on any device; the CPU has faster compiled versions (numba, ``kvdrive.kernels.cpu``),
tested against it. :func:`for_device` picks the set a session uses; it is the one
place that decides by device. On a CUDA device the client uses the torch references
unless ``triton`` is chosen (Triton kernels, ``kvdrive.kernels.triton_kernels``, tested
under Triton's interpreter and run on one H200: README, "On a GPU").

The compiled CPU kernels are compiled once per machine and cached under KVDrive's
cache directory (:mod:`kvdrive.protocol.jit_cache`); :func:`warm_up` compiles or loads them
before a decode needs them (:mod:`kvdrive.kernels.warmup`).
"""

if __name__ == "kernels":  # imported from the repository root by its bare folder name: see tools/checkout.py
    from tools.checkout import step_aside

    step_aside(__name__)
else:
    from kvdrive.kernels.backends import CpuKernels, Kernels, ReferenceKernels
    from kvdrive.kernels.choice import KERNEL_CHOICES, compiles_on_cpu, for_device
    from kvdrive.kernels.warmup import KernelProgress, WarmUpReport, warm_up

    __all__ = ["KERNEL_CHOICES", "CpuKernels", "KernelProgress", "Kernels", "ReferenceKernels", "WarmUpReport",
               "compiles_on_cpu", "for_device", "warm_up"]
