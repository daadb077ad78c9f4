"""Writeback of the data file's page-cache writes (``--sync write-behind``), paced.

Under write-behind the data file is written through the page cache and flushed about once
a second (docs/durability.md). Left to itself the kernel starts writing dirty pages back
only past its background threshold (a tenth of memory by default) and then queues as much
as the disk takes. Offered 3 GB/s of 2 MiB blocks, more than the disk writes, stores then
waited up to 0.5 s at a flush and loads from the SSD up to 0.27 s (with O_DIRECT writes,
0.07 s at most for either).

One thread here starts each run's writeback as soon as it is written and keeps at most
:data:`FLIGHT_BYTES` of it in the disk's queue, waiting for the oldest before starting
more, then drops its pages from the page cache (no read uses them). A write returns at
once until a backlog (:data:`BACKLOG_BYTES` unless kvstored's ``--write-behind-backlog``
says otherwise) is written and not yet on the disk, then waits for the thread: a burst
goes into memory at memory speed, a sustained stream is held to the disk's pace. A flush
first lets the thread take everything (:meth:`Writeback.drain`), so its fsync finds little
left to write. Offered 3 GB/s, stores ran at 2.85-3.0 GB/s
(O_DIRECT: 2.3-2.4), their p99 at 25-36 ms (O_DIRECT: 37-51), loads' p99 at 57-97 ms
(O_DIRECT: 57-71), the page cache 0.6 GB above its size before (3 GB while the flush
alone dropped the written pages, whose sweep made a store's p99 0.1 s); a 2 GiB burst of
2 MiB blocks was stored at 1.20-1.31x vLLM's own fs tier (with 256 MiB of backlog: 1.08x).
The thread has its own descriptor, so an error it meets is still reported to the flush's
``fdatasync``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading

from kvstored.config import DaemonConfig
from kvstored.files import WAIT_WRITTEN, start_writeback

log = logging.getLogger(__name__)

FLIGHT_BYTES = 64 << 20  # writeback started and not yet waited for: about 30 ms of a 2 GB/s disk
# Written and not yet known on the disk; past it, writes wait: kvstored's default --write-behind-backlog.
BACKLOG_BYTES = DaemonConfig.write_behind_backlog_bytes


class Writeback:
    """Paced writeback of the ranges :meth:`written` names, in order, on one thread
    (started on first use) with its own descriptor of ``path``; writes wait while more than
    ``backlog_bytes`` (default :data:`BACKLOG_BYTES`) are not yet known on the disk."""

    def __init__(self, path: os.PathLike, backlog_bytes: int | None = None) -> None:
        self.path = path
        self.backlog_bytes = BACKLOG_BYTES if backlog_bytes is None else backlog_bytes
        self._todo: queue.SimpleQueue = queue.SimpleQueue()  # (offset, nbytes), an Event (drain), None (stop)
        self._cond = threading.Condition()
        self._backlog = 0  # bytes written and not yet waited for on the disk
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._failed = False
        self._ended = False  # the thread is gone
        self._flight: collections.deque = collections.deque()  # ranges started, oldest first (the thread's)
        self._under_way = 0  # their bytes

    @property
    def backlog(self) -> int:
        return self._backlog

    def written(self, offset: int, nbytes: int) -> None:
        """``nbytes`` at ``offset`` were just written (any thread); waits while the backlog is
        past ``backlog_bytes``."""
        self._start()
        with self._cond:
            self._backlog += nbytes
        self._todo.put((offset, nbytes))
        with self._cond:
            while self._backlog > self.backlog_bytes and not self._ended:
                self._cond.wait()

    def drain(self) -> None:
        """Return once everything written before this call is on the disk (or failed)."""
        if self._thread is not None:
            done = threading.Event()
            self._todo.put(done)
            while not done.wait(0.5) and not self._ended:
                pass

    def close(self) -> None:
        """Finish the writeback under way, stop the thread, close its descriptor."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None
            os.close(self._fd)

    def _start(self) -> None:
        if self._thread is None:
            with self._cond:
                if self._thread is None:
                    self._fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                    self._thread = threading.Thread(target=self._run, name="kvstored-writeback", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            log.exception("the data file's writeback thread failed; each flush writes the data file from now on")
        finally:  # no write waits on a thread that is gone
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                self._settle(0)  # idle: everything started is waited for
                item = self._todo.get()
            if item is None:
                self._settle(0)
                return
            if isinstance(item, threading.Event):
                self._settle(0)
                item.set()
                continue
            self._call(*item, 0)
            self._flight.append(item)
            self._under_way += item[1]
            self._settle(FLIGHT_BYTES)

    def _settle(self, most: int) -> None:
        """Wait for the oldest ranges under way until at most ``most`` bytes are."""
        while self._flight and self._under_way > most:
            offset, nbytes = self._flight.popleft()
            self._call(offset, nbytes, WAIT_WRITTEN)
            self._drop(offset, nbytes)
            self._under_way -= nbytes
            with self._cond:
                self._backlog -= nbytes
                self._cond.notify_all()

    def _drop(self, offset: int, nbytes: int) -> None:
        """The range's pages, written back, leave the page cache (no read uses them): the cache
        holds about the backlog, not a second of writes until the flush sweeps it (3 GB at
        2.8 GB/s here)."""
        try:
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:  # only a hint
            pass

    def _call(self, offset: int, nbytes: int, wait: int) -> None:
        try:
            start_writeback(self._fd, offset, nbytes, wait)
        except OSError as exc:  # the flush's fdatasync writes the range again, and reports a disk error
            if not self._failed:
                log.warning("the data file's writeback (%s): left to each flush", exc)
                self._failed = True
