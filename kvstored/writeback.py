"""Writeback of the data file's page-cache writes, started as they are made.

Under ``--sync write-behind`` the data file is written through the page cache and flushed
about once a second (docs/durability.md). Left to itself the kernel starts writing dirty
pages back only past its background threshold (a tenth of memory by default), so each
flush would find a second's puts still in memory and hold the writer while the disk
took them all: stores at 1 GB/s would wait about half a second each second. A thread
here asks the kernel to start writing each run as soon as it is written; it alone waits
when the disk's queue is full, so a burst still goes into memory at memory speed, and a
flush waits only for what the disk has not caught up with.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvstored.files import start_writeback

log = logging.getLogger(__name__)


class Writeback:
    """Starts the writeback of the ranges :meth:`written` names, in order, on one thread
    (started on first use)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._ranges: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failed = False

    def written(self, offset: int, nbytes: int) -> None:
        """``nbytes`` at ``offset`` were just written (any thread)."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvstored-writeback", daemon=True)
                    self._thread.start()
        self._ranges.put((offset, nbytes))

    def _run(self) -> None:
        while (item := self._ranges.get()) is not None:
            try:
                start_writeback(self.fd, *item)
            except OSError as exc:  # the flush's fdatasync still writes the range (and reports a disk error)
                if not self._failed:
                    log.warning("could not start the data file's writeback early (%s); it is written at each "
                                "flush instead", exc)
                    self._failed = True

    def close(self) -> None:
        """Stop the thread (before the descriptor closes)."""
        if self._thread is not None:
            self._ranges.put(None)
            self._thread.join()
            self._thread = None
