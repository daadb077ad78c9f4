"""Client buffers the daemon maps once and moves bytes through.

A CPU client makes a memfd (``memfd_create`` with sealing allowed), seals it against
shrinking, and hands the descriptor to the daemon over its session socket
(SCM_RIGHTS). The daemon never opens a path in a client's name, so it can only ever
touch memory the client gave it; and a sealed file cannot be truncated under the
daemon's mapping, so no client can make the daemon fault (SIGBUS) on its memory. A
descriptor without ``F_SEAL_SHRINK``, not a memfd, or smaller than the size it is
registered with is refused with a ``buffer`` error.

Buffers belong to the session that registered them: a request names a buffer by id
and the id is looked up in the sending session's registry only. When the session
ends (the client closed its session socket, or died), its buffers are unmapped.

A GPU client registers a CUDA allocation instead, by its IPC handle
(kvstored/cuda_ipc.py): the daemon opens the handle once and copies blocks into the
device memory. Both kinds are a :class:`MappedBuffer` to the store, which hands every
byte move to the buffer: :meth:`MappedBuffer.write_blocks` (a get's DRAM hits),
:meth:`MappedBuffer.write_verified` (its SSD reads) and :meth:`MappedBuffer.read_blocks`
(a put's source). Both count against the same limits.

A third kind, a *pool* (:class:`PoolBuffer`), is shared memory the client made without
sealing (a serving engine's CPU KV pool: a memfd or a file in /dev/shm), so that gets
land in it and puts leave from it with no copy on the client's side. The daemon maps it
under a SIGBUS guard (kvstored/sigbus.py): a client that shrinks its file makes that
request and every later one on the pool fail with ``buffer``, never the daemon fault.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import resource
import stat
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvdrive.protocol.files import TMPFS_MAGIC, fs_type
from kvstored.checksum import verify_scatter
from kvstored.copy import gather_scatter
from kvstored.limits import RESERVED_FDS, BufferLimits
from kvstored.protocol import ErrorCode, ProtocolError
from kvstored.sigbus import SLOTS, guard

if TYPE_CHECKING:
    from kvstored.cuda_ipc import CudaIpc
    from kvstored.protocol import RegisterCudaIpc

log = logging.getLogger(__name__)


class MappedBuffer:
    """A registered buffer of ``size`` bytes, and how blocks move in and out of it.

    This one is a sealed memfd mapped into the daemon (``array``); offsets are from
    its start. Callers check spans against ``size`` first; the copies check again and
    copy nothing if any block falls outside.
    """

    kind = "memfd"

    def __init__(self, buf_id: int, size: int, array: np.ndarray, owner: Any) -> None:
        self.buf_id = buf_id
        self.size = size
        self.array = array
        self.owner = owner

    def check_span(self, offset: int, nbytes: int, what: str) -> None:
        """Refuse a request whose ``nbytes`` from ``offset`` do not fit in this buffer."""
        if offset + nbytes > self.size:
            raise ProtocolError(
                ErrorCode.BUFFER,
                f"{what} buffer {self.buf_id} is too small: needs {offset + nbytes} bytes (offset {offset} + {nbytes}), "
                f"has {self.size}",
            )

    def write_blocks(self, src: np.ndarray, src_offs: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
        """``buffer[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` (``src`` host memory)."""
        gather_scatter(src, src_offs, self.array, dst_offs, nbytes)

    def write_verified(self, src: np.ndarray, src_offs: np.ndarray, dst_offs: np.ndarray, nbytes: int,
                       tags: np.ndarray, expect: np.ndarray) -> np.ndarray:
        """:meth:`write_blocks` of the blocks whose CRC-32C (xor ``tags``) is ``expect``;
        returns the per-block ``ok`` mask (a damaged block's destination is left as it was)."""
        return verify_scatter(src, src_offs, self.array, dst_offs, nbytes, tags, expect)

    def read_blocks(self, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
        """``dst[dst_offs[i]:+nbytes] = buffer[src_offs[i]:+nbytes]`` (``dst`` host memory)."""
        gather_scatter(self.array, src_offs, dst, dst_offs, nbytes)

    def check_intact(self) -> None:
        """Raise a ``buffer`` error where the bytes last moved through this buffer may not be
        the client's (see PoolBuffer); a sealed or device buffer always holds them."""

    def close(self) -> None:
        """Unmap (once no reader can still copy through it: see ReclaimGate)."""
        self.array = np.zeros(0, dtype=np.uint8)
        try:
            self.owner.close()
        except BufferError:
            log.debug("buffer %d still referenced; unmapped at exit", self.buf_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(buf_id={self.buf_id}, size={self.size})"


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
                if self.refs == 0:
                    return
                if _libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(min(step, size - start)),
                                 MADV_POPULATE_WRITE) != 0:
                    log.debug("pool mapping %s not populated ahead (%s)", self.key, os.strerror(ctypes.get_errno()))
                    return

    def close(self) -> None:
        """One pool less; the last unmaps it (once no view of it is left) and frees its row."""
        with _pool_maps_lock:
            self.refs -= 1
            if self.refs:
                return
            if _pool_maps.get(self.key) is self:
                del _pool_maps[self.key]
        self.array = np.zeros(0, dtype=np.uint8)
        with self._populating:
            self.m.close()  # BufferError where a view is left: MappedBuffer.close logs it, the row stays
        guard().remove(self.row)


# Linux's MADV_POPULATE_WRITE (5.14; Python's mmap module has no name for it).
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_pool_maps: dict[tuple[int, int, int], _PoolMap] = {}
_pool_maps_lock = threading.Lock()


class BufferRegistry:
    """One session's buffers. ``register``/``unregister`` run on the session thread,
    ``lookup`` on any thread."""

    def __init__(self, limits: BufferLimits, budget: "MappedBudget", uid: int) -> None:
        self._lock = threading.Lock()
        self.uid = uid
        self._next = 1
        self._buffers: dict[int, MappedBuffer] = {}
        self.limits = limits
        self._budget = budget

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(mb.size for mb in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def _reserve(self, size: int) -> None:
        """Take ``size`` bytes of this session's and the daemon's limits (or refuse)."""
        with self._lock:
            if len(self._buffers) >= self.limits.max_buffers:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"this session already has {len(self._buffers)} buffers (limit {self.limits.max_buffers}); unregister some",
                )
            held = sum(mb.size for mb in self._buffers.values())
            if held + size > self.limits.max_bytes:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"this session's buffers would map {held + size} bytes, limit {self.limits.max_bytes} per session",
                )
            self._budget.take(self.uid, size)

    def _add(self, size: int, make: Callable[[], MappedBuffer]) -> MappedBuffer:
        """Reserve ``size``, then ``make()`` the buffer; what it raises gives the reservation back."""
        self._reserve(size)
        try:
            mb = make()
        except BaseException:
            self._budget.give_back(self.uid, size)
            raise
        with self._lock:
            mb.buf_id = self._next
            self._next += 1
            self._buffers[mb.buf_id] = mb
        log.debug("registered %r", mb)
        return mb

    def register_fd(self, fd: int, size: int) -> MappedBuffer:
        """Map ``size`` bytes of the client's sealed memfd ``fd`` (the caller closes ``fd``)."""
        def make() -> MappedBuffer:
            array, m = _map_sealed(fd, size)
            return MappedBuffer(0, size, array, m)

        return self._add(size, make)

    def register_pool(self, fd: int, size: int) -> MappedBuffer:
        """Map ``size`` bytes of the client's shared-memory file ``fd`` as a pool, under the
        SIGBUS guard (the caller closes ``fd``; the mapping holds a duplicate of it, which
        counts against the descriptors pools may hold)."""
        def make() -> MappedBuffer:
            self._budget.take_descriptor(self.uid)
            try:
                return _map_pool(fd, size)
            except BaseException:
                self._budget.give_back_descriptor(self.uid)
                raise

        return self._add(size, make)

    def register_cuda(self, spec: "RegisterCudaIpc", cuda: "CudaIpc") -> MappedBuffer:
        """Open the CUDA IPC handle of ``spec`` (refused, after the limits, where ``cuda`` is unavailable)."""
        return self._add(spec.size, lambda: cuda.open(spec))

    def lookup(self, buf_id: int) -> MappedBuffer:
        mb = self._buffers.get(buf_id)
        if mb is None:
            raise ProtocolError(ErrorCode.BUFFER, f"buffer {buf_id} is not registered by this session")
        return mb

    def unregister(self, buf_id: int) -> MappedBuffer:
        with self._lock:
            mb = self._buffers.pop(buf_id, None)
        if mb is None:
            raise ProtocolError(ErrorCode.BUFFER, f"buffer {buf_id} is not registered by this session")
        return mb

    def take_all(self) -> list[MappedBuffer]:
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
        return buffers

    def close_mapping(self, mb: MappedBuffer) -> None:
        """Unmap ``mb`` (once no reader can still copy through it: see ReclaimGate)."""
        try:
            mb.close()
        finally:
            self._budget.give_back(self.uid, mb.size)
            if isinstance(mb, PoolBuffer):
                self._budget.give_back_descriptor(self.uid)


class MappedBudget:
    """Bytes of client memory all sessions together may map (the daemon's address space),
    and one user's share of it: a quarter, so no user can lock the others out.

    Also the pools mapped: each holds a descriptor open and a row of the SIGBUS guard's
    table. At most ``max_fds`` (by default a quarter of the daemon's descriptor limit past
    RESERVED_FDS, since running out of descriptors aborts libzmq and connections take at
    most half, see ConnectionLimits.fit; and at most the guard's SLOTS rows), a quarter of
    them per user, so no user can take every row."""

    def __init__(self, max_bytes: int, max_fds: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_per_uid = max_bytes // 4
        self._lock = threading.Lock()
        self.used = 0
        self._by_uid: dict[int, int] = {}
        self._max_fds = max_fds
        self.fds = 0
        self._fds_by_uid: dict[int, int] = {}

    @property
    def max_fds(self) -> int:
        if self._max_fds is not None:
            return self._max_fds
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # raised at start (admission.py): read when used
        by_fds = max(4, (soft - RESERVED_FDS) // 4) if soft != resource.RLIM_INFINITY else 1 << 20
        return min(by_fds, SLOTS)  # each pool also takes a row of the SIGBUS guard's table

    def take_descriptor(self, uid: int) -> None:
        limit = self.max_fds
        with self._lock:
            mine = self._fds_by_uid.get(uid, 0)
            if mine >= max(1, limit // 4) or self.fds >= limit:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"pools hold {self.fds} descriptors open, {mine} of them uid {uid}'s; the daemon's limit is "
                    f"{limit}, a quarter of it per user (from its RLIMIT_NOFILE): unregister some pools",
                )
            self.fds += 1
            self._fds_by_uid[uid] = mine + 1

    def give_back_descriptor(self, uid: int) -> None:
        with self._lock:
            self.fds -= 1
            left = self._fds_by_uid[uid] - 1
            if left:
                self._fds_by_uid[uid] = left
            else:
                del self._fds_by_uid[uid]

    def take(self, uid: int, nbytes: int) -> None:
        with self._lock:
            mine = self._by_uid.get(uid, 0)
            if mine + nbytes > self.max_per_uid:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"uid {uid}'s sessions map {mine} bytes of buffers; {nbytes} more would pass a user's share of "
                    f"{self.max_per_uid} (a quarter of --max-mapped)",
                )
            if self.used + nbytes > self.max_bytes:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"the daemon maps {self.used} bytes of client buffers; {nbytes} more would pass its limit of "
                    f"{self.max_bytes} (--max-mapped)",
                )
            self.used += nbytes
            self._by_uid[uid] = mine + nbytes

    def give_back(self, uid: int, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            left = self._by_uid[uid] - nbytes
            assert self.used >= 0 and left >= 0
            if left:
                self._by_uid[uid] = left
            else:
                del self._by_uid[uid]


def _map_sealed(fd: int, size: int) -> tuple[np.ndarray, mmap.mmap]:
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ProtocolError(ErrorCode.BUFFER, f"the descriptor is not a sealable memfd ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(ErrorCode.BUFFER, "the descriptor is not a memfd")
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ProtocolError(
            ErrorCode.BUFFER,
            "the memfd is not sealed against shrinking (F_SEAL_SHRINK); the daemon maps only sealed buffers",
        )
    if st.st_size < size:
        raise ProtocolError(ErrorCode.BUFFER, f"the memfd is {st.st_size} bytes, registered as {size}")
    try:
        # Populated now: a get's or put's first copy through the buffer would otherwise take
        # a page fault every 4 KiB (~8 ms for 64 MiB, measured, on the first load of a channel).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.BUFFER, f"cannot map the buffer: {exc}") from None
    return np.frombuffer(m, dtype=np.uint8), m


def _map_pool(fd: int, size: int) -> PoolBuffer:
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
