"""Where numba keeps KVDrive's compiled functions: a directory per package and version of its sources.

numba checks only the file that defines a cached function, not the files of the
functions it calls, whose code it holds compiled in: after a ``git pull`` that changed
only a callee's file, a caller loaded from its cache would run the old callee. So each
package that compiles with ``cache=True`` keeps its functions in
``<KVDrive's cache>/numba/<name>-<digest>``, the digest taken over its own sources and
those of the packages it calls compiled functions of (:data:`CALLS`). A change to the
daemon's sources recompiles the daemon's functions alone, not the client's kernels, and
the reverse. The :data:`KEPT_VERSIONS` directories of each package used last before the
current one are kept.

Every module that defines cached functions calls :func:`use` with its package after its
imports and before its first definition: numba reads where to cache a function when it is
defined, and the modules a module imports point it elsewhere for their own. A
``NUMBA_CACHE_DIR`` (or numba configuration) the user set is left as it is: everything
caches there. Light on purpose (no numba, no torch until :func:`use`): the client and
kvstored both import it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from importlib.util import find_spec
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "NUMBA_CACHE_DIR"
# Each package whose modules numba compiles with cache=True, and the packages whose compiled
# functions its own call (their code is compiled into its functions).
CALLS = {
    "kvdrive.kernels": ("kvdrive.kernels",),
    "kvdrive.protocol": ("kvdrive.protocol",),
    "kvstored": ("kvstored", "kvdrive.protocol"),
}
KEPT_VERSIONS = 4  # cache directories of other source digests kept per package, the most recently used

_dirs: dict[str, Path] = {}  # package -> its directory, once looked up in this process


def cache_root() -> Path:
    """Where KVDrive keeps per-machine files it derived (compiled kernels, de-quantised models):
    ``$KVDRIVE_CACHE``, else ``$XDG_CACHE_HOME/kvdrive``, else ``~/.cache/kvdrive``."""
    if os.environ.get("KVDRIVE_CACHE"):
        return Path(os.environ["KVDRIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvdrive"


def source_digest(package: str) -> str:
    """16 hex digits of SHA-256 over the Python sources (paths and bytes) of ``package`` and
    the packages it calls into (:data:`CALLS`)."""
    h = hashlib.sha256()
    for name in CALLS[package]:
        spec = find_spec(name)
        for root in spec.submodule_search_locations or () if spec else ():
            for path in sorted(Path(root).rglob("*.py")):
                h.update(f"{name}/{path.relative_to(root)}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir(package: str) -> Path:
    """``cache_root() / "numba" / "<name>-<digest>"`` for ``package``, marked as used now.
    Its directories of other digests past the :data:`KEPT_VERSIONS` most recently used are
    removed, as are those an older KVDrive kept for every package at once (``<digest>``) and
    the ones numba made there itself before the cache was kept per digest."""
    name = package.rsplit(".", 1)[-1]
    base = cache_root() / "numba"
    target = base / f"{name}-{source_digest(package)}"
    try:
        target.mkdir(parents=True, exist_ok=True)
        os.utime(target)
        dirs = [p for p in base.iterdir() if p.is_dir() and p != target]
        mine = sorted((p for p in dirs if re.fullmatch(rf"{name}-[0-9a-f]{{16}}", p.name)),
                      key=lambda p: p.stat().st_mtime, reverse=True)
        unkeyed = [p for p in dirs if re.fullmatch(r"[0-9a-f]{16}|\w+_[0-9a-f]{40}", p.name)]
        for old in mine[KEPT_VERSIONS:] + unkeyed:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # an unwritable cache: numba tries its other places, or compiles in memory
        log.debug("numba cache directory %s: %s", target, e)
    return target


def use(package: str) -> Path | None:
    """Point numba's cache at ``package`` 's directory (:func:`cache_dir`) for the functions
    defined next; returns it, or None where the user chose where numba caches."""
    import numba  # noqa: PLC0415 - the caller is about to define numba functions anyway

    ours = {str(p) for p in _dirs.values()}
    if os.environ.get(CACHE_ENV) or (numba.config.CACHE_DIR and numba.config.CACHE_DIR not in ours):
        return None
    target = _dirs.get(package)
    if target is None:
        try:
            target = _dirs[package] = cache_dir(package)
        except RuntimeError as e:  # Path.home() for a user with no home: numba's own places
            log.debug("no KVDrive cache directory for numba (%s)", e)
            return None
    numba.config.CACHE_DIR = str(target)
    return target
