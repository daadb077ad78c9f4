"""The SSD tier: one data file of 4 KiB-aligned extents, written once, read sparsely."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import numpy as np

from kvdrive.layout.allocator import ExtentAllocator

log = logging.getLogger(__name__)


class SsdTier:
    """Owns the data file and its free space.

    The allocator belongs to the single writer thread; frees that readers might
    still race with arrive through :meth:`queue_free` and are applied by the
    writer before its next allocation.
    """

    def __init__(self, path: Path, capacity: int, direct: bool) -> None:
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
        self.allocator = ExtentAllocator(capacity)
        self._ready_frees: list[tuple[int, int]] = []
        self._frees_lock = threading.Lock()

    def load(self, used: list[tuple[int, int]]) -> None:
        self.allocator = ExtentAllocator.from_used(self.allocator.capacity, used)
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

    def write(self, offset: int, data: np.ndarray) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            n = os.pwrite(self.fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes at {offset + done}")
            done += n

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
