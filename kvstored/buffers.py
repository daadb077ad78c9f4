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

A third kind, a *pool* (:class:`kvstored.pools.PoolBuffer`), is shared memory the client made without
sealing (a serving engine's CPU KV pool: a memfd or a file in /dev/shm), so that gets
land in it and puts leave from it with no copy on the client's side. The daemon maps it
under a SIGBUS guard (kvstored/sigbus.py): a client that shrinks its file makes that
request and every later one on the pool fail with ``buffer``, never the daemon fault.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import resource
import stat
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvstored.checksum import verify_scatter
from kvstored.copy import gather_scatter
from kvstored.limits import RESERVED_FDS, BufferLimits
from kvstored.protocol import ErrorCode, ProtocolError
from kvstored.sigbus import SLOTS

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

    def _reserve(self, size: int, shared: tuple | None = None) -> None:
        """Take ``size`` bytes of this session's and the daemon's limits (or refuse); ``shared``:
        a pool's file (:meth:`MappedBudget.take`)."""
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
            self._budget.take(self.uid, size, shared)

    def _add(self, size: int, make: Callable[[], MappedBuffer], shared: tuple | None = None) -> MappedBuffer:
        """Reserve ``size``, then ``make()`` the buffer; what it raises gives the reservation back."""
        self._reserve(size, shared)
        try:
            mb = make()
        except BaseException:
            self._budget.give_back(self.uid, size, shared)
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
        from kvstored.pools import map_pool, pool_key  # noqa: PLC0415 - they build on this module's MappedBuffer

        key = pool_key(fd, size)

        def make() -> MappedBuffer:
            self._budget.take_descriptor(self.uid, key)
            try:
                return map_pool(fd, size)
            except BaseException:
                self._budget.give_back_descriptor(self.uid, key)
                raise

        return self._add(size, make, key)

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
        key = getattr(mb, "key", None)  # a pool's file: counted once per user (MappedBudget.take)
        try:
            mb.close()
        finally:
            self._budget.give_back(self.uid, mb.size, key)
            if mb.kind == "pool":
                self._budget.give_back_descriptor(self.uid, key)


class MappedBudget:
    """Bytes of client memory all sessions together may map (the daemon's address space),
    and one user's share of it: a quarter, so no user can lock the others out.

    A pool's file registered at one size on several sessions of one user (an engine
    registers its host pool on each of its connections, and the daemon maps it once) counts
    once, against the bytes and as one descriptor held open and one row of the SIGBUS
    guard's table (``key``: the file and the size, :func:`kvstored.pools.pool_key`). At most ``max_fds`` (by default a quarter of the daemon's descriptor limit past
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
        self._held: dict[tuple, int] = {}  # (what, uid, key) -> registrations counted once

    @property
    def max_fds(self) -> int:
        if self._max_fds is not None:
            return self._max_fds
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # raised at start (admission.py): read when used
        by_fds = max(4, (soft - RESERVED_FDS) // 4) if soft != resource.RLIM_INFINITY else 1 << 20
        return min(by_fds, SLOTS)  # each pool also takes a row of the SIGBUS guard's table

    def _again(self, what: str, uid: int, key: tuple | None) -> bool:
        """Whether ``key`` (a pool's file) is counted for ``uid`` already: then this registration
        only adds to its count (lock held)."""
        if key is None:
            return False
        n = self._held.get((what, uid, key), 0)
        if n:
            self._held[(what, uid, key)] = n + 1
        return bool(n)

    def _counted(self, what: str, uid: int, key: tuple | None) -> None:
        if key is not None:
            self._held[(what, uid, key)] = 1

    def _last(self, what: str, uid: int, key: tuple | None) -> bool:
        """One registration of ``key`` less; whether it was the last (lock held)."""
        if key is None:
            return True
        n = self._held.pop((what, uid, key)) - 1
        if n:
            self._held[(what, uid, key)] = n
        return not n

    def take_descriptor(self, uid: int, key: tuple | None = None) -> None:
        limit = self.max_fds
        with self._lock:
            if self._again("fd", uid, key):
                return
            mine = self._fds_by_uid.get(uid, 0)
            if mine >= max(1, limit // 4) or self.fds >= limit:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"{self.fds} pools are registered, {mine} of them uid {uid}'s; the daemon's limit is {limit} "
                    f"(from its RLIMIT_NOFILE, at most the SIGBUS guard's {SLOTS} rows), a quarter of it per user: "
                    f"unregister some pools",
                )
            self.fds += 1
            self._fds_by_uid[uid] = mine + 1
            self._counted("fd", uid, key)

    def give_back_descriptor(self, uid: int, key: tuple | None = None) -> None:
        with self._lock:
            if not self._last("fd", uid, key):
                return
            self.fds -= 1
            left = self._fds_by_uid[uid] - 1
            if left:
                self._fds_by_uid[uid] = left
            else:
                del self._fds_by_uid[uid]

    def take(self, uid: int, nbytes: int, key: tuple | None = None) -> None:
        with self._lock:
            if self._again("bytes", uid, key):
                return
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
            self._counted("bytes", uid, key)

    def give_back(self, uid: int, nbytes: int, key: tuple | None = None) -> None:
        with self._lock:
            if not self._last("bytes", uid, key):
                return
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
