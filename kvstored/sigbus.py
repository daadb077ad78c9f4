"""A SIGBUS guard over client memory the daemon maps without a seal (pool buffers).

A client can shrink a shared-memory file the daemon has mapped; the daemon's next access
to a page past the new end raises SIGBUS, which kills a process by default. The guard
(the technique Wayland compositors use on clients' wl_shm pools) installs a handler that,
for a fault inside a guarded range, maps anonymous memory over the whole range (one
mapping, whatever the number of faults: a page at a time, a client that faults pages
far apart would split the daemon's mappings past the kernel's limit on them) and
counts the fault: the copy carries on over zeros, and the caller, which checks the count
after every copy (:meth:`SigbusGuard.faulted`), fails that request and every later one on
the buffer. A fault outside every guarded range puts back the disposition that was there
before (the default: the daemon dies, as it would without the guard; or faulthandler's)
and returns, so the fault repeats under it.

The handler is a numba ``cfunc``: machine code that touches no Python object, allocates
nothing and makes two system calls (``mmap``, ``sigaction``), so it is safe in a signal
handler and on any thread (SIGBUS is delivered to the thread that faulted). It reads the
ranges from a fixed table whose address is compiled into it (~0.2-1 s, and not cached), so
kvstored compiles and installs it on a thread of its own as it starts (:func:`install_soon`):
an engine's first pool registration after a restart does not wait for the compiler. Table
rows are written under a lock, and a row is cleared only once no copy can use its range
(the buffer's ReclaimGate).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import signal
import threading

import numpy as np

log = logging.getLogger(__name__)

SLOTS = 1024  # guarded ranges at once: pools the daemon maps, over every session
_START, _END, _FAULTS = range(3)
_SIGBUS = int(signal.SIGBUS)
_SA_SIGINFO, _SA_RESTART = 0x4, 0x10000000
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000
_SIGINFO_ADDR = 2  # si_addr, as the third 8-byte word of siginfo_t (x86-64 and aarch64 Linux)


class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` on 64-bit Linux."""

    _fields_ = [("handler", ctypes.c_size_t), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_size_t)]


class SigbusGuard:
    """The process's one guard (:func:`guard`): ranges in, fault counts out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.table = np.zeros((SLOTS, 3), np.int64)
        self._previous = _Sigaction()
        self._handler = None  # the compiled cfunc, kept alive with its code

    def install(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._handler = _compile(self.table.ctypes.data, ctypes.addressof(self._previous))
        act = _Sigaction(handler=self._handler.address, flags=_SA_SIGINFO | _SA_RESTART)
        if libc.sigaction(_SIGBUS, ctypes.byref(act), ctypes.byref(self._previous)) != 0:
            raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")
        log.info("SIGBUS guard installed over unsealed client pools (%d ranges at most)", SLOTS)

    def add(self, start: int, nbytes: int) -> int | None:
        """Guard ``[start, start + nbytes)``, one whole mapping of the caller's from its
        page-aligned start (a fault in it puts anonymous memory over all of it); its row, or
        None where every row is taken. The caller removes the row before it unmaps the range."""
        if start % mmap.PAGESIZE or nbytes <= 0:
            raise ValueError(f"a guarded range starts on a page and is not empty: {start:#x}, {nbytes} bytes")
        with self._lock:
            free = np.flatnonzero(self.table[:, _END] == 0)
            if not len(free):
                return None
            row = int(free[0])
            self.table[row, _FAULTS] = 0
            self.table[row, _START] = start
            self.table[row, _END] = start + nbytes
            return row

    def faulted(self, row: int) -> bool:
        """Whether an access in ``row``'s range faulted since it was added."""
        return bool(self.table[row, _FAULTS])

    def remove(self, row: int) -> None:
        with self._lock:
            self.table[row, _END] = 0
            self.table[row, _START] = 0


_guard: SigbusGuard | None = None
_guard_lock = threading.Lock()


def guard() -> SigbusGuard:
    """The process's guard, installed on first use."""
    global _guard
    with _guard_lock:
        if _guard is None:
            g = SigbusGuard()
            g.install()
            _guard = g
        return _guard


def install_soon() -> threading.Thread:
    """Compile and install the guard on a thread of its own; a failure is logged, and the
    first pool registration tries again (and fails that request with why)."""
    def run() -> None:
        try:
            guard()
        except Exception:
            log.warning("SIGBUS guard not installed at start-up; the first pool registration will try again",
                        exc_info=True)
    t = threading.Thread(target=run, name="kvstored-sigbus", daemon=True)
    t.start()
    return t


def _compile(table_addr: int, previous_addr: int):
    """The handler, with the table's and the saved disposition's addresses compiled in."""
    import numba
    from llvmlite import ir
    from numba import carray, types
    from numba.core.extending import intrinsic

    @intrinsic
    def as_pointer(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        return types.voidptr(types.int64), codegen

    libc = ctypes.CDLL(None)
    sys_mmap = libc.mmap
    sys_mmap.restype = ctypes.c_size_t
    sys_mmap.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    sys_sigaction = libc.sigaction
    sys_sigaction.restype = ctypes.c_int
    sys_sigaction.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
    page, prot = mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    slots, sigbus, failed = SLOTS, _SIGBUS, (1 << 64) - 1  # MAP_FAILED, as the size_t it returns

    @numba.cfunc(types.void(types.int32, types.voidptr, types.voidptr), nopython=True)
    def on_sigbus(sig, info, context):  # pragma: no cover - runs as a signal handler
        addr = carray(info, 4, dtype=np.int64)[_SIGINFO_ADDR]
        table = carray(as_pointer(table_addr), (slots, 3), dtype=np.int64)
        for i in range(slots):
            if table[i, 0] <= addr and addr < table[i, 1]:
                # The row's whole range (a mapping's, from its page-aligned start): one anonymous
                # mapping in place of the file's, so no later access to it faults again.
                start = table[i, 0]
                length = (table[i, 1] - start + page - 1) & ~(page - 1)
                if sys_mmap(start, length, prot, flags, -1, 0) == failed:
                    break  # nothing to put there: the fault repeats under the previous disposition
                table[i, 2] += 1
                return
        sys_sigaction(sigbus, previous_addr, 0)

    return on_sigbus
