"""Selection and attention kernels.

Every kernel has a plain torch reference (``kvdrive.kernels.reference``), which runs
on any device; the CPU has faster compiled versions (numba, ``kvdrive.kernels.cpu``),
tested against it. No kernel here has run on a GPU yet: on a CUDA device the client
uses the torch references.
"""
