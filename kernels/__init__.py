"""Selection and attention kernels.

Every kernel has a plain torch reference here (``kvdrive.kernels.reference``);
faster versions (numba on the CPU, cupy on CUDA) are tested against it.
"""
