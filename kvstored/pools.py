"""Pools: an engine's unsealed shared memory, mapped by the daemon under the SIGBUS guard
(kvstored/sigbus.py; docs/protocol.md, "Pool buffers").

:func:`map_pool` checks a registered descriptor (a memfd or a file in /dev/shm, open
read-write, as large as registered) and gives a :class:`PoolBuffer`. Pools on one file
at one size share one :class:`_PoolMap`; its pages are faulted in ahead by a thread.
Every copy through a pool checks the guard's count when it ends (:meth:`PoolBuffer.check_intact`).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import stat
import threading
from typing import Any

import numpy as np

from kvdrive.protocol.files import TMPFS_MAGIC, fs_type
from kvstored.buffers import MappedBuffer
from kvstored.protocol import ErrorCode, ProtocolError
from kvstored.sigbus import SLOTS, guard

log = logging.getLogger(__name__)


class PoolBuffer(MappedBuffer):
    """``size`` bytes of a client's unsealed shared-memory file, mapped under the SIGBUS
    guard (row ``row`` of :func:`kvstored.sigbus.guard`'s table). ``owner`` is the
    :class:`_PoolMap` it shares with every other pool on the same file and size.

    Every copy through it is checked after it ends: where any access faulted (the client
    shrank the file below ``size``) the bytes moved are not the client's, so the request
    fails, and so does every later one (the guard has put anonymous pages in place of the
    file's, so the mapping no longer shows the client's memory).
    """

    kind = "pool"

    def __init__(self, buf_id: int, size: int, array: np.ndarray, owner: Any, row: int) -> None:
        super().__init__(buf_id, size, array, owner)
        self.row = row
        self.key = owner.key  # the file and the size: what a user's registrations of it share
        self.broken = False

    def check_intact(self) -> None:
        if self.row < 0 or guard().faulted(self.row):
            if not self.broken:
                self.broken = True
                log.warning("pool buffer %d (%d bytes): its client shrank the file under the daemon's mapping; its "
                            "requests fail from now on", self.buf_id, self.size)
            raise ProtocolError(ErrorCode.BUFFER, f"pool buffer {self.buf_id}: the client shrank its file below the "
                                                  f"{self.size} bytes it registered while the daemon used it; this and "
                                                  f"every later request on it fail (register the pool again)")

    def write_blocks(self, src: np.ndarray, src_offs: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
        self.check_intact()
        super().write_blocks(src, src_offs, dst_offs, nbytes)
        self.check_intact()

    def write_verified(self, src: np.ndarray, src_offs: np.ndarray, dst_offs: np.ndarray, nbytes: int,
                       tags: np.ndarray, expect: np.ndarray) -> np.ndarray:
        self.check_intact()
        ok = super().write_verified(src, src_offs, dst_offs, nbytes, tags, expect)
        self.check_intact()
        return ok

    def read_blocks(self, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
        self.check_intact()
        super().read_blocks(src_offs, dst, dst_offs, nbytes)
        self.check_intact()

    def close(self) -> None:
        """Let go of the mapping (unmapped, and no longer guarded, with its last pool)."""
        super().close()
        self.row = -1


class _PoolMap:
    """One mapping of a shared-memory file (``key``: its device, inode and mapped size), for
    every pool registered on it: an engine registers its CPU tier once per connection, and
    one mapping of a 100 GiB tier takes 200 MiB of page tables. Its pages are faulted in by
    a thread of its own (``MADV_POPULATE_WRITE``), so that neither the register nor the
    first copies pay a fault per 4 KiB page. A mapping that met a fault (its file shrank)
    is never given to a new registration."""

    def __init__(self, key: tuple[int, int, int], m: mmap.mmap, row: int) -> None:
        self.key, self.m, self.row, self.refs = key, m, row, 0
        self.array = np.frombuffer(m, dtype=np.uint8)
        self._populating = threading.Lock()

    def populate(self) -> None:
        """Fault the mapping's pages in, 256 MiB at a time, by ctypes (which lets go of the GIL
        for the call, where mmap.madvise holds it), until done or the last pool goes."""
        step, base, size = 256 << 20, self.array.ctypes.data, len(self.array)
        for start in range(0, size, step):
            with self._populating:  # the unmap waits for this call to end
                # A faulted mapping is anonymous memory now (sigbus.py): populating it would
                # take the daemon's own memory for a file its client shrank.
                if self.refs == 0 or guard().faulted(self.row):
                    return
                if _libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(min(step, size - start)),
                                 MADV_POPULATE_WRITE) != 0:
                    log.debug("pool mapping %s not populated ahead (%s)", self.key, os.strerror(ctypes.get_errno()))
                    return

    def close(self) -> None:
        """One pool less; the last frees its row, then unmaps it (once no view of it is left).

        The row goes first: with no pool left and the populating thread held off, nothing
        reads or writes the mapping, so it needs no guard; and a row must never outlive its
        mapping, whose addresses another mapping may take (a fault there would then be
        counted on this row, not on that mapping's own, or put anonymous memory over this
        row's range). A view left alive somewhere (an exception's traceback, say) makes the
        close raise BufferError (MappedBuffer.close logs it): the mapping then goes with that
        view, unguarded and unused."""
        with _pool_maps_lock:
            self.refs -= 1
            if self.refs:
                return
            if _pool_maps.get(self.key) is self:
                del _pool_maps[self.key]
        self.array = np.zeros(0, dtype=np.uint8)
        with self._populating:
            guard().remove(self.row)
            self.m.close()


# Linux's MADV_POPULATE_WRITE (5.14; Python's mmap module has no name for it).
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_pool_maps: dict[tuple[int, int, int], _PoolMap] = {}
_pool_maps_lock = threading.Lock()


def pool_key(fd: int, size: int) -> tuple[int, int, int]:
    """What pools on one file at one size share (their mapping, and a user's count of them):
    the file's device and inode, and the size."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise ProtocolError(ErrorCode.BUFFER, f"cannot inspect the pool descriptor: {exc.strerror}") from None
    return st.st_dev, st.st_ino, size


def map_pool(fd: int, size: int) -> PoolBuffer:
    """``size`` bytes of ``fd`` mapped under the SIGBUS guard once it is a shared-memory file
    of at least that size, open for reading and writing (else a ``buffer`` refusal)."""
    try:
        st, flags = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
        fs = fs_type(fd) if stat.S_ISREG(st.st_mode) else None
    except OSError as exc:
        raise ProtocolError(ErrorCode.BUFFER, f"cannot inspect the pool descriptor: {exc.strerror}") from None
    if fs is None:
        raise ProtocolError(ErrorCode.BUFFER, "a pool must be a memfd or a file in /dev/shm (tmpfs); this descriptor "
                                              f"is not a regular file ({_file_kind(st.st_mode)})")
    if fs != TMPFS_MAGIC:
        raise ProtocolError(ErrorCode.BUFFER, f"a pool must be a memfd or a file in /dev/shm (tmpfs); this file is on "
                                              f"a file system of type {fs:#x}, not shared memory")
    if flags & os.O_ACCMODE != os.O_RDWR or flags & os.O_APPEND:
        raise ProtocolError(ErrorCode.BUFFER, "a pool descriptor must be open for reading and writing, without O_APPEND")
    if st.st_size < size:
        raise ProtocolError(ErrorCode.BUFFER, f"the pool file is {st.st_size} bytes, registered as {size}")
    key = (st.st_dev, st.st_ino, size)
    with _pool_maps_lock:
        pm = _pool_maps.get(key)
        fresh = pm is None or guard().faulted(pm.row)
        if fresh:
            pm = _pool_maps[key] = _new_pool_map(fd, key)
        pm.refs += 1
    if fresh:
        threading.Thread(target=pm.populate, name="kvstored-pool-populate", daemon=True).start()
    return PoolBuffer(0, size, pm.array, pm, pm.row)


def _new_pool_map(fd: int, key: tuple[int, int, int]) -> _PoolMap:
    size = key[2]
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.BUFFER, f"cannot map the pool: {exc}") from None
    row = guard().add(np.frombuffer(m, dtype=np.uint8).ctypes.data, size)
    if row is None:
        m.close()
        raise ProtocolError(ErrorCode.BUFFER, f"the daemon guards {SLOTS} pools already; unregister some")
    return _PoolMap(key, m, row)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"
