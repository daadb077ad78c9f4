"""I/O engines: how the SSD tier's reads reach the disk.

One interface, :class:`IOEngine`, three implementations side by side:

- :class:`AioEngine`: Linux native AIO (``io_submit`` / ``io_getevents``) on the
  O_DIRECT data file: every read of a chunk goes to the disk in one system call and
  the calling thread waits for them in another, with no thread hand-offs.
- :class:`PosixEngine`: ``preadv`` on a thread pool, O_DIRECT where the file
  system allows it, every read of a get landing in one aligned buffer of the caller's.
- :class:`KvikioEngine`: kvikio's parallel ``pread`` (GPUDirect Storage, or its
  POSIX compatibility mode), chosen only where a CUDA driver is present, because
  every kvikio read fails without ``libcuda.so.1``.

:func:`choose_engine` probes and logs which one it picked and why.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import sys
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstored.config import ENGINES

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


# ---------------------------------------------------------------- Linux native AIO

# System call numbers of the AIO calls, per architecture (the kernel's unistd tables).
_AIO_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
# struct iocb and struct io_event of <linux/aio_abi.h>, as laid out on a little-endian 64-bit host.
_IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                  ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                  ("flags", "<u4"), ("resfd", "<u4")])
_IO_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
_IOCB_CMD_PREAD = 0
assert _IOCB.itemsize == 64 and _IO_EVENT.itemsize == 32


def _libc_syscall():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


class _AioContext:
    """One thread's AIO context with its request and event arrays (``depth`` reads in flight at most)."""

    def __init__(self, calls: dict, syscall, depth: int) -> None:
        self._calls, self._syscall, self.depth = calls, syscall, depth
        ctx = ctypes.c_ulong(0)
        if self._syscall(ctypes.c_long(calls["io_setup"]), ctypes.c_long(depth), ctypes.byref(ctx)) < 0:
            raise _errno_error("io_setup")
        self.ctx = ctx.value
        self.iocbs = np.zeros(depth, _IOCB)
        # io_submit takes an array of pointers to the requests.
        self.ptrs = np.uint64(self.iocbs.ctypes.data) + np.arange(depth, dtype=np.uint64) * np.uint64(_IOCB.itemsize)
        self.events = np.zeros(depth, _IO_EVENT)

    def _call(self, name: str, *args) -> int:
        return self._syscall(ctypes.c_long(self._calls[name]), ctypes.c_ulong(self.ctx), *args)

    def submit(self, first: int, n: int) -> int:
        """Submit requests ``[first, first + n)``; how many the kernel took (-errno on failure)."""
        r = self._call("io_submit", ctypes.c_long(n), ctypes.c_void_p(self.ptrs.ctypes.data + first * 8))
        return r if r >= 0 else -ctypes.get_errno()

    def reap(self, at: int, min_n: int, max_n: int) -> int:
        """Wait for ``min_n`` to ``max_n`` completions into ``events[at:]``; how many (-errno on failure)."""
        addr = self.events.ctypes.data + at * _IO_EVENT.itemsize
        r = self._call("io_getevents", ctypes.c_long(min_n), ctypes.c_long(max_n), ctypes.c_void_p(addr), None)
        return r if r >= 0 else -ctypes.get_errno()

    def destroy(self) -> None:
        if self.ctx:
            self._call("io_destroy")
            self.ctx = 0


def _errno_error(call: str, err: int | None = None) -> OSError:
    err = ctypes.get_errno() if err is None else err
    return OSError(err, f"{call}: {os.strerror(err)}")


def probe_aio() -> tuple[bool, str]:
    """Whether Linux native AIO works here (it can be missing, or blocked by a sandbox)."""
    calls = _AIO_SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or calls is None or sys.byteorder != "little":
        return False, f"Linux AIO is not supported on {sys.platform}/{platform.machine()}"
    try:
        _AioContext(calls, _libc_syscall(), 1).destroy()
    except OSError as exc:
        return False, f"Linux AIO unavailable ({exc})"
    return True, "Linux AIO available"


class AioEngine(IOEngine):
    """Every read of a call submitted at once with ``io_submit``; the caller reaps them.

    Asynchronous only on an O_DIRECT file (buffered AIO reads run inside ``io_submit``),
    so :func:`choose_engine` takes it only there. Each calling thread has its own
    context, so concurrent gets never reap each other's completions. A call with more
    than ``depth`` reads submits them in waves of ``depth``.
    """

    name = "linux-aio"

    def __init__(self, depth: int = 256) -> None:
        self._calls = _AIO_SYSCALLS[platform.machine()]
        self._syscall = _libc_syscall()
        self.depth = depth
        self._local = threading.local()
        self._contexts: list[_AioContext] = []
        self._lock = threading.Lock()
        self._closed = False

    def _context(self) -> _AioContext:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            with self._lock:
                if self._closed:
                    raise OSError(errno.EBADF, "the I/O engine is closed")
                ctx = self._local.ctx = _AioContext(self._calls, self._syscall, self.depth)
                self._contexts.append(ctx)
        return ctx

    def read_into(self, fd: int, starts: np.ndarray, ends: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray) -> None:
        n = len(starts)
        if not n:
            return
        ctx = self._context()
        base = np.uint64(dst.ctypes.data)
        for w0 in range(0, n, ctx.depth):
            self._wave(ctx, fd, starts[w0 : w0 + ctx.depth], ends[w0 : w0 + ctx.depth], base, dst_offs[w0 : w0 + ctx.depth])

    def _wave(self, ctx: _AioContext, fd: int, starts, ends, base, dst_offs) -> None:
        m = len(starts)
        sizes = np.asarray(ends, dtype=np.int64) - starts
        cb = ctx.iocbs[:m]
        cb["data"] = np.arange(m, dtype=np.uint64)
        cb["opcode"] = _IOCB_CMD_PREAD
        cb["fildes"] = fd
        cb["buf"] = base + np.asarray(dst_offs, dtype=np.uint64)
        cb["nbytes"] = sizes
        cb["offset"] = starts
        submitted = reaped = 0
        error: OSError | None = None
        # Every submitted read is reaped before returning, error or not: the kernel
        # writes into the caller's buffer until it completes.
        while True:
            if submitted < m and error is None:
                r = ctx.submit(submitted, m - submitted)
                if r > 0:
                    submitted += r
                    continue
                if r not in (0, -errno.EAGAIN, -errno.EINTR):
                    error = _errno_error("io_submit", -r)
                elif r != -errno.EINTR and reaped == submitted:  # refused with nothing in flight to wait for
                    error = _errno_error("io_submit", errno.EAGAIN)
            if reaped == submitted:
                if submitted == m or error is not None:
                    break
                continue  # interrupted before anything was in flight: submit again
            r = ctx.reap(reaped, 1, submitted - reaped)
            if r > 0:
                reaped += r
            elif r != -errno.EINTR:
                raise _errno_error("io_getevents", -r)  # only on arguments this code never passes
        if error is not None:
            raise error
        ev = ctx.events[:m]
        res = ev["res"]
        want = sizes[ev["data"].astype(np.int64)]
        bad = np.flatnonzero(res != want)
        if len(bad):
            i = int(ev["data"][bad[0]])
            got = int(res[bad[0]])
            if got < 0:
                raise OSError(-got, f"read at offset {int(starts[i])}: {os.strerror(-got)}")
            raise OSError(f"short read at offset {int(starts[i])}: {got} of {int(sizes[i])} bytes")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for ctx in self._contexts:
                ctx.destroy()
            self._contexts.clear()


def probe_kvikio() -> tuple[bool, str]:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no CUDA driver (libcuda.so.1 not found)"
    try:
        import kvikio  # noqa: PLC0415
    except ImportError as exc:
        return False, f"kvikio not importable ({exc}); install the 'gpu' extra"
    # A loadable libcufile is not GPUDirect Storage: without nvidia-fs cuFile reads through
    # POSIX in compatibility mode, which is no better than Linux AIO. Ask cuFile itself.
    try:
        if hasattr(kvikio, "cufile_driver"):
            gds = bool(kvikio.cufile_driver.properties.is_gds_available)
        else:
            gds = bool(kvikio.DriverProperties().is_gds_available)
    except Exception as exc:  # noqa: BLE001 - any failure of the driver query means no GDS
        return False, f"cuFile could not be asked whether GPUDirect Storage is active ({type(exc).__name__}: {exc})"
    if not gds:
        return False, "cuFile reports GPUDirect Storage not active (it would read in compatibility mode)"
    return True, "CUDA driver, kvikio and GPUDirect Storage active"


def choose_engine(kind: str, threads: int, data_path: str, direct: bool = True) -> IOEngine:
    """The engine ``kind`` names; ``auto``: kvikio where cuFile reports GPUDirect Storage active, else
    Linux AIO on an O_DIRECT file, else ``preadv`` on ``threads`` threads. Logs the choice."""
    if kind not in ENGINES:
        raise ValueError(f"unknown I/O engine {kind!r} (one of {', '.join(ENGINES)})")
    why_not = []
    if kind in ("auto", "kvikio"):
        ok, why = probe_kvikio()
        if ok:
            engine = KvikioEngine(threads, data_path)
            log.info("I/O engine: kvikio (%s; compat mode preferred: %s)", why, engine.compat)
            return engine
        if kind == "kvikio":
            raise RuntimeError(f"--engine kvikio asked for, but {why}")
        why_not.append(f"kvikio not used: {why}")
    if kind in ("auto", "aio"):
        ok, why = probe_aio()
        if ok and not direct:
            ok, why = False, "the data file is not open with O_DIRECT, and buffered AIO reads run one at a time"
        if ok:
            log.info("I/O engine: Linux AIO, every read of a get submitted at once (%s)", "; ".join(why_not + [why]))
            return AioEngine()
        if kind == "aio":
            raise RuntimeError(f"--engine aio asked for, but {why}")
        why_not.append(f"Linux AIO not used: {why}")
    log.info("I/O engine: POSIX preadv on %d threads (%s)", threads, "; ".join(why_not) or "--engine posix")
    return PosixEngine(threads)
