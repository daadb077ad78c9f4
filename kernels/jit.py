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

Compiled kernels are kept once per machine and version of their sources:
:func:`configure_cache` points numba's on-disk cache at ``<KVDrive's cache>/numba/<digest>``
(:func:`cache_root`, :func:`source_digest`), not at the ``__pycache__`` beside the sources,
unless ``NUMBA_CACHE_DIR`` says otherwise. numba checks only the file that defines a cached
function, not the files of the functions it calls, whose code it holds compiled in: after
a ``git pull`` that changed only a callee's file, a caller loaded from its cache ran the old
callee. A directory per digest of every numba source compiles afresh whenever any changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

log = logging.getLogger(__name__)

VECTOR_ENV = "KVDRIVE_JIT_VECTOR"
CACHE_ENV = "NUMBA_CACHE_DIR"
# The packages whose modules numba compiles with cache=True: the client's kernels, and the
# daemon's and the protocol's (the embedded kvstored inherits the cache directory).
NUMBA_PACKAGES = ("kvdrive.kernels", "kvstored", "kvdrive.protocol")
KEPT_VERSIONS = 4  # cache directories of other source digests kept, the most recently used


def cache_root() -> Path:
    """Where KVDrive keeps per-machine files it derived (compiled kernels, de-quantised models):
    ``$KVDRIVE_CACHE``, else ``$XDG_CACHE_HOME/kvdrive``, else ``~/.cache/kvdrive``.

    Defined here, the lowest layer that needs it: the kernels' cache must be set before
    numba loads, which is before anything of ``kvdrive_client`` can be imported.
    """
    if os.environ.get("KVDRIVE_CACHE"):
        return Path(os.environ["KVDRIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvdrive"


def source_digest() -> str:
    """16 hex digits of SHA-256 over the Python sources of :data:`NUMBA_PACKAGES` (paths and bytes)."""
    h = hashlib.sha256()
    for name in NUMBA_PACKAGES:
        spec = find_spec(name)
        for root in spec.submodule_search_locations or () if spec else ():
            for path in sorted(Path(root).rglob("*.py")):
                h.update(f"{name}/{path.relative_to(root)}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    """``cache_root() / "numba" / source_digest()``, marked as used now; directories of other
    digests past the :data:`KEPT_VERSIONS` most recently used are removed, and the ones numba
    made there itself before the cache was kept per digest."""
    base = cache_root() / "numba"
    target = base / source_digest()
    try:
        target.mkdir(parents=True, exist_ok=True)
        os.utime(target)
        dirs = [p for p in base.iterdir() if p.is_dir() and p != target]
        others = sorted((p for p in dirs if re.fullmatch(r"[0-9a-f]{16}", p.name)), key=lambda p: p.stat().st_mtime,
                        reverse=True)
        unkeyed = [p for p in dirs if re.fullmatch(r"\w+_[0-9a-f]{40}", p.name)]  # numba's own, before the digests
        for old in others[KEPT_VERSIONS:] + unkeyed:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # an unwritable cache: numba says so and compiles in memory
        log.debug("numba cache directory %s: %s", target, e)
    return target


def configure_cache() -> Path:
    """Point numba's on-disk cache at :func:`_cache_dir`; returns the directory in use.

    Call before the kernels are defined. Before numba is imported this sets
    ``NUMBA_CACHE_DIR``, which numba reads at import and which the processes started
    from here (the embedded kvstored, whose kernels are numba's too) inherit. A
    ``NUMBA_CACHE_DIR`` the user set is left as it is.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    target = _cache_dir()
    if "numba" not in sys.modules:
        os.environ[CACHE_ENV] = str(target)
        return target
    import numba  # noqa: PLC0415

    if numba.config.CACHE_DIR:  # a .numba_config.yaml of the user's
        return Path(numba.config.CACHE_DIR)
    # Setting the variable now would make numba re-read its whole environment at the next
    # compile, undoing configure()'s vector width; numba's own setting is read when a
    # kernel is defined, so the kernels still cache in the target.
    numba.config.CACHE_DIR = str(target)
    log.warning("numba was imported before KVDrive's kernels: they cache in %s, but processes started from here "
                "(the embedded kvstored) cache beside their sources (import kvdrive_client before numba, or set %s)",
                target, CACHE_ENV)
    return target


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
