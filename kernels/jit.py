"""Code generation for the numba kernels: 512-bit vectors on AVX-512 hosts.

LLVM tunes recent Intel server cores to prefer 256-bit vectors, so its loop
vectorizer leaves half of every AVX-512 register unused. The kernels here are short
dense float32 loops (page scores, attention) over data that sits in cache, where
full-width vectors pay: on this project's AVX-512 hosts the low-rank selection took
about an eighth less time per decode step with them (attention about the same).
:func:`configure` turns the preference off for this process, before the first kernel
compiles (the kernels' on-disk cache keeps code for each setting apart).

``KVDRIVE_JIT_VECTOR=256`` keeps LLVM's own choice (for hosts whose clocks drop on
512-bit code); ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` set by the user are left
as they are.

Where the compiled kernels are kept is :mod:`kvdrive.protocol.jit_cache`'s: each module of
them calls ``jit_cache.use("kvdrive.kernels")`` before its definitions.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

VECTOR_ENV = "KVDRIVE_JIT_VECTOR"


def wide_vector_features() -> str | None:
    """The host's LLVM feature string with the 256-bit preference off; None without AVX-512."""
    from llvmlite import binding as llvm  # noqa: PLC0415

    try:
        features = llvm.get_host_cpu_features()
    except RuntimeError:  # llvmlite cannot read this host's features
        return None
    if not (features.get("avx512f") and features.get("avx512vl")):
        return None
    return features.flatten() + ",-prefer-256-bit"


def configure() -> str:
    """Let numba's vectorizer use 512-bit vectors where the host has them; returns what was done."""
    import numba  # noqa: PLC0415
    from numba.core.registry import cpu_target  # noqa: PLC0415

    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return "NUMBA_CPU_NAME / NUMBA_CPU_FEATURES as the user set them"
    choice = os.environ.get(VECTOR_ENV, "512")
    if choice not in ("256", "512"):
        log.warning("%s=%r is neither 256 nor 512: using 512", VECTOR_ENV, choice)
    if choice == "256":
        return f"LLVM's default vector width ({VECTOR_ENV}=256)"
    features = wide_vector_features()
    if features is None:
        return "LLVM's default vector width (no AVX-512 on this host)"
    if numba.config.CPU_FEATURES == features:
        return "512-bit vectors"
    if "_toplevel_target_context" in vars(cpu_target):  # something compiled with numba before the kernels loaded
        log.warning("numba's code generator was set up before KVDrive's kernels loaded: they keep LLVM's default "
                    "vector width (import kvdrive_client before other numba code for 512-bit vectors)")
        return "LLVM's default vector width (numba was set up before the kernels loaded)"
    numba.config.CPU_FEATURES = features
    return "512-bit vectors"
