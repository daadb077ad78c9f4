"""I/O engines: how the SSD tier's reads reach the disk.

One interface, :class:`IOEngine`, two implementations side by side:

- :class:`PosixEngine`: ``preadv`` on a thread pool, O_DIRECT where the file
  system allows it, every read of a get landing in one aligned buffer of the caller's.
- :class:`KvikioEngine`: kvikio's parallel ``pread`` (GPUDirect Storage, or its
  POSIX compatibility mode), chosen only where a CUDA driver is present, because
  every kvikio read fails without ``libcuda.so.1``.

:func:`choose_engine` probes and logs which one it picked and why.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)


class IOEngine(ABC):
    name: str

    @abstractmethod
    def read_into(self, fd: int, starts: np.ndarray, ends: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray) -> None:
        """Read every ``[starts[i], ends[i])`` into ``dst[dst_offs[i]:]``, the reads in flight at once.

        ``dst`` is a uint8 array whose every ``dst_offs[i]`` is aligned for O_DIRECT
        (:class:`AlignedScratch` gives such arrays). Raises the first I/O error (OSError)
        after all reads ended.
        """

    def close(self) -> None:
        pass


class AlignedScratch(threading.local):
    """A page-aligned uint8 buffer per thread, grown on demand (at least 4 MiB)."""

    buf: np.ndarray | None = None

    def get(self, size: int) -> np.ndarray:
        if self.buf is None or len(self.buf) < size:
            cap = max(size, 4 << 20)
            self.buf = np.frombuffer(mmap.mmap(-1, cap), dtype=np.uint8)
        return self.buf


class PosixEngine(IOEngine):
    name = "posix-preadv"

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstored-io")

    def _read(self, fd: int, start: int, view: np.ndarray) -> int:
        return os.preadv(fd, [view], start)

    def _read_slice(self, fd: int, starts: np.ndarray, ends: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray,
                    idx: range) -> None:
        # Only the read itself per I/O: checking what was read is one call per get, after.
        for i in idx:
            start, size, at = int(starts[i]), int(ends[i] - starts[i]), int(dst_offs[i])
            got = self._read(fd, start, dst[at : at + size])
            if got != size:
                raise OSError(f"short read at offset {start}: {got} of {size} bytes")

    def read_into(self, fd: int, starts: np.ndarray, ends: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray) -> None:
        n = len(starts)
        if n <= 1:
            self._read_slice(fd, starts, ends, dst, dst_offs, range(n))
            return
        k = min(self.threads, n)
        futures = [self._pool.submit(self._read_slice, fd, starts, ends, dst, dst_offs, range(t, n, k))
                   for t in range(1, k)]
        errors = []
        try:
            self._read_slice(fd, starts, ends, dst, dst_offs, range(0, n, k))  # the caller's thread takes a share
        except OSError as exc:
            errors.append(exc)
        errors += [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class KvikioEngine(PosixEngine):
    """kvikio reads into the same host buffers (GPU destinations use CUDA IPC)."""

    name = "kvikio"

    def __init__(self, threads: int, path: str) -> None:
        super().__init__(threads)
        import kvikio  # noqa: PLC0415 - optional dependency, probed first

        self._kvikio = kvikio
        self._file = kvikio.CuFile(path, "r")
        self.compat = bool(kvikio.defaults.is_compat_mode_preferred()) if hasattr(kvikio.defaults, "is_compat_mode_preferred") else None

    def _read(self, fd: int, start: int, view: np.ndarray) -> int:
        return self._file.pread(view, len(view), start).get()

    def close(self) -> None:
        super().close()
        self._file.close()


def probe_kvikio() -> tuple[bool, str]:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no CUDA driver (libcuda.so.1 not found)"
    try:
        import kvikio  # noqa: F401, PLC0415
    except ImportError as exc:
        return False, f"kvikio not importable ({exc}); install the 'gpu' extra"
    return True, "CUDA driver and kvikio present"


def choose_engine(kind: str, threads: int, data_path: str) -> IOEngine:
    if kind in ("auto", "kvikio"):
        ok, why = probe_kvikio()
        if ok:
            engine = KvikioEngine(threads, data_path)
            log.info("I/O engine: kvikio (%s; compat mode preferred: %s)", why, engine.compat)
            return engine
        if kind == "kvikio":
            raise RuntimeError(f"--engine kvikio asked for, but {why}")
        log.info("I/O engine: POSIX preadv on %d threads (kvikio not used: %s)", threads, why)
    else:
        log.info("I/O engine: POSIX preadv on %d threads (--engine posix)", threads)
    return PosixEngine(threads)
