"""The SSD tier: one data file of 4 KiB-aligned extents, written once, read sparsely.

Free space in the data file is of two kinds the allocator does not tell apart: ranges
still backed by filesystem blocks, and holes punched out of it on a full disk (see
docs/durability.md, Full disk). Writing into a hole needs new filesystem blocks, so on a
full disk it fails with ENOSPC where a backed range would not. :meth:`SsdTier.place`
therefore sets a range that fails so aside (parked: taken from the free list and punched
again, so a partial write keeps no blocks) and tries the next one, until the extents are
written or no free range is left. Parked ranges go back to the free list when a delete
frees space (:meth:`SsdTier.unpark`); they are never referenced by the catalog, so a
restart finds them free as well.

Reads are O_DIRECT wherever the filesystem takes it. Writes are too under ``--sync
durable``; under ``--sync write-behind`` they go through the page cache (a second
descriptor of the same file, without O_DIRECT), so that a put is acknowledged once the
kernel holds its bytes, not once the disk has them: 2 MiB engine blocks stored at 3.3
GB/s against 2.3 GB/s O_DIRECT on the same disk. Their writeback is started as they are
written, and paced (:mod:`kvstored.writeback`). A read of a range whose pages are still dirty has
the kernel write them first, so it returns the bytes written. Each flush drops the
file's clean cached pages: every read bypasses them, and the DRAM tier holds the copies
worth keeping.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from kvdrive.layout import align_up
from kvdrive.layout.allocator import ExtentAllocator, SpaceError
from kvstored.config import format_size
from kvstored.files import punch_hole
from kvstored.tier import Tier
from kvstored.writeback import Writeback

log = logging.getLogger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """The filesystem could not back any free range of the data file for a put."""


MAX_GATHER = 1024  # extents per write at most: each is at most one of the write's iovecs (IOV_MAX)
# A put whose extents lie in at least PARALLEL_MIN_RUNS places of the data file (free space
# left by deletes and quota evictions) writes them from WRITE_THREADS threads at once: one
# O_DIRECT write at a time, 128 scattered 64 KiB writes took 14 ms here, 6.9 ms from 8
# threads (5.3 ms as one sequential write), and a put of 128 such blocks through a quota
# that keeps evicting took twice as long as one into free space at the file's end.
WRITE_THREADS = 8
PARALLEL_MIN_RUNS = 4
# A write through the page cache holds the file's inode lock while it copies (ext4), and an
# O_DIRECT read of the file takes that lock too: written in pieces of this size at most, a
# read waits for one piece's copy (about 1.3 ms at 3 GB/s), not a whole run's (a 64 MiB
# job's: about 20 ms). A bound from the locking, not a measured gain: at 3 GB/s offered,
# the loads' p99 moved within the run-to-run noise either way.
CACHED_WRITE_BYTES = 4 << 20


def _runs(source: np.ndarray, src: list[int], i: int, j: int, ext_bytes: int) -> list[np.ndarray]:
    """Extents ``i`` to ``j`` of ``source`` (extent k at ``src[k]``), as the fewest runs: those
    back to back in the source are one."""
    runs, start = [], i
    for k in range(i + 1, j + 1):
        if k == j or src[k] != src[k - 1] + ext_bytes:
            data = source[src[start]: src[start] + (k - start) * ext_bytes]
            if len(data) != (k - start) * ext_bytes:
                raise ValueError(f"extents {start} to {k} lie past the end of their {len(source)} B source")
            runs.append(data)
            start = k
    return runs


def _capped(views: list[memoryview], most: int) -> list[memoryview]:
    """The first ``most`` bytes of ``views`` (all of them where they hold fewer)."""
    out, left = [], most
    for v in views:
        if len(v) >= left:
            out.append(v[:left])
            return out
        out.append(v)
        left -= len(v)
    return out


def _file_runs(offsets: list[int], i: int, j: int, ext_bytes: int) -> list[tuple[int, int]]:
    """Extents ``i`` to ``j`` as runs back to back in the file, of MAX_GATHER at most."""
    runs, start = [], i
    for k in range(i + 1, j + 1):
        if k == j or k - start == MAX_GATHER or offsets[k] != offsets[k - 1] + ext_bytes:
            runs.append((start, k))
            start = k
    return runs


class SsdTier(Tier):
    """Owns the data file and its free space.

    The allocator belongs to the single writer thread; frees that readers might
    still race with arrive through :meth:`queue_free` and are applied by the
    writer before its next allocation.
    """

    name = "ssd"

    def __init__(self, path: Path, capacity: int, direct: bool, cached_writes: bool = False,
                 backlog_bytes: int | None = None) -> None:
        self.path = path
        self.direct = False
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("%s does not support O_DIRECT; using buffered I/O (reads may hit the page cache)", path.parent)
                self.fd = os.open(path, flags, 0o600)
        else:
            self.fd = os.open(path, flags, 0o600)
        # Where writes go: the O_DIRECT descriptor, or the same file through the page cache.
        self.wfd = os.open(path, flags, 0o600) if self.direct and cached_writes else self.fd
        self._writeback = Writeback(path, backlog_bytes) if self.wfd != self.fd else None
        self.allocator = ExtentAllocator(capacity)
        self._ready_frees: list[tuple[int, int]] = []
        self._frees_lock = threading.Lock()
        self._parked: list[tuple[int, int]] = []  # free ranges the filesystem could not back
        self._parked_bytes = 0
        self._writers: ThreadPoolExecutor | None = None  # started by the first scattered put

    @property
    def direct_writes(self) -> bool:
        """Whether writes bypass the page cache (O_DIRECT)."""
        return self.direct and self.wfd == self.fd

    @property
    def writeback_backlog(self) -> int:
        """Bytes of page-cache writes that may wait for the disk before a write waits (0: O_DIRECT writes)."""
        return 0 if self._writeback is None else self._writeback.backlog_bytes

    @property
    def capacity(self) -> int:  # type: ignore[override]
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of extents in use: parked ranges are free space, and so are extents a delete
        freed that the writer has not yet put back on the free list."""
        with self._frees_lock:
            pending = sum(align_up(n) for _, n in self._ready_frees)
        return self.allocator.used_bytes - self._parked_bytes - pending

    def load(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """The ranges in use, found in the catalog: the rest of the file is free."""
        self.allocator = ExtentAllocator.from_spans(self.allocator.capacity, starts, lengths)
        size = os.fstat(self.fd).st_size
        if size < self.allocator.end:
            raise RuntimeError(f"{self.path} is {size} bytes but extents reach {self.allocator.end}: data file truncated")

    def queue_free(self, start: int, nbytes: int) -> None:
        with self._frees_lock:
            self._ready_frees.append((start, nbytes))

    def apply_frees(self) -> None:
        with self._frees_lock:
            frees, self._ready_frees = self._ready_frees, []
        for start, nbytes in frees:
            self.allocator.free(start, nbytes)

    def unpark(self) -> None:
        """Give parked ranges back to the free list (a delete may have made room for them)."""
        parked, self._parked = self._parked, []
        self._parked_bytes = 0
        for start, nbytes in parked:
            self.allocator.free(start, nbytes)

    def place(self, source: np.ndarray, count: int, ext_bytes: int, src_offs: np.ndarray | None = None) -> list[int]:
        """Allocate ``count`` extents of ``ext_bytes`` and write extent i from
        ``source[src_offs[i]:]`` (by default ``source[i * ext_bytes:]``: a staging copy);
        their offsets. With the data file opened O_DIRECT the source offsets, and the
        source's address, are multiples of the I/O alignment. A run that fails with
        ENOSPC is parked and written elsewhere; one past the data file's end (new space,
        which no other range can replace) is not. Raises SpaceError when the tier is full,
        :class:`DiskFullError` when every free range was tried, OSError for other write
        errors; nothing stays allocated when it raises."""
        self.apply_frees()
        tail = self.allocator.end  # offsets from here on grow the file
        src = [i * ext_bytes for i in range(count)] if src_offs is None else [int(o) for o in src_offs]
        offsets: list[int] = []
        try:
            while len(offsets) < count:
                offsets.append(self.allocator.allocate(ext_bytes))
            todo = [(0, count)]
            while todo:
                runs = [run for i, j in todo for run in _file_runs(offsets, i, j, ext_bytes)]
                todo = []
                for (i, j), exc in self._write_runs(source, src, offsets, runs, ext_bytes):
                    if exc.errno not in NO_SPACE or offsets[i] >= tail:
                        raise exc
                    self._park(offsets, i, j, ext_bytes)  # the same number of extents, elsewhere
                    todo.append((i, j))
        except BaseException:
            for off in offsets:
                self.allocator.free(off, ext_bytes)
            raise
        return offsets

    def _write_runs(self, source: np.ndarray, src: list[int], offsets: list[int], runs: list[tuple[int, int]],
                    ext_bytes: int) -> list[tuple[tuple[int, int], OSError]]:
        """Write extents ``i`` to ``j`` of each run (back to back in the file) from ``source``,
        each run one write gathered from wherever its extents lie in the source (an engine
        page's K and V, apart in its pool), on WRITE_THREADS threads where there are at least
        PARALLEL_MIN_RUNS runs; the runs whose write failed, with its error, in order."""
        jobs = [(offsets[i], _runs(source, src, i, j, ext_bytes), (i, j)) for i, j in runs]
        if len(jobs) < PARALLEL_MIN_RUNS:
            return self._write_each(jobs)
        if self._writers is None:
            self._writers = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kvstored-ssd-write")
        parts = [self._writers.submit(self._write_each, jobs[k::WRITE_THREADS])
                 for k in range(min(WRITE_THREADS, len(jobs)))]
        wait(parts)  # every write has ended before an error frees the extents for others
        return sorted((failed for part in parts for failed in part.result()), key=lambda f: f[0])

    def _write_each(self, jobs: list) -> list[tuple[tuple[int, int], OSError]]:
        failed = []
        for offset, data, run in jobs:
            try:
                self.write(offset, data)
            except OSError as exc:
                failed.append((run, exc))
        return failed

    def _park(self, offsets: list[int], i: int, j: int, ext_bytes: int) -> None:
        """Set extents ``offsets[i:j]`` aside and allocate others in their place."""
        failed = offsets[i:j]
        del offsets[i:j]
        for off in failed:
            self._parked.append((off, ext_bytes))
            self._parked_bytes += ext_bytes
            punch_hole(self.fd, off, ext_bytes)
        log.debug("%d bytes at %d of %s could not be backed by the filesystem; trying other free space",
                  len(failed) * ext_bytes, failed[0], self.path)
        replaced = []
        try:
            for _ in failed:
                replaced.append(self.allocator.allocate(ext_bytes))
        except SpaceError:
            for off in replaced:
                self.allocator.free(off, ext_bytes)
            raise DiskFullError(errno.ENOSPC, f"no free range of {self.path} could be written "
                                f"({format_size(self._parked_bytes)} of punched free space tried)") from None
        offsets[i:i] = replaced

    def write(self, offset: int, data: np.ndarray | list[np.ndarray]) -> None:
        """Write ``data`` (bytes, or a list of runs written one after another, in one
        ``pwritev``) at ``offset`` of the data file."""
        views = [memoryview(d) for d in (data if isinstance(data, list) else [data])]
        done = 0
        while views:
            batch = views if self._writeback is None else _capped(views, CACHED_WRITE_BYTES)
            n = os.pwritev(self.wfd, batch, offset + done) if len(batch) > 1 else os.pwrite(self.wfd, batch[0],
                                                                                           offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes at {offset + done}")
            done += n
            k = 0
            while k < len(views) and n >= len(views[k]):
                n -= len(views[k])
                k += 1
            views = views[k:]
            if n:
                views[0] = views[0][n:]
        if self._writeback is not None:
            self._writeback.written(offset, done)

    def sync(self) -> None:
        """The data file's writes on the disk; through the page cache, its clean pages then
        dropped (no read uses them)."""
        if self._writeback is not None:
            self._writeback.drain()
        os.fdatasync(self.wfd)
        if self.wfd != self.fd:
            os.posix_fadvise(self.wfd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._writers is not None:
            self._writers.shutdown(wait=True)
        if self._writeback is not None:
            self._writeback.close()
            os.close(self.wfd)
        os.close(self.fd)
