"""Shared-memory buffers a CPU client registers with kvstored."""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

SHM_DIR = "/dev/shm"


class SharedBuffer:
    """A pre-faulted file in /dev/shm mapped here and, once registered, in the daemon.

    The file is unlinked as soon as the daemon has mapped it, so nothing is left in
    /dev/shm if either process dies.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        self.size = size
        self.name = f"kvdrive-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[::4096] = 0  # fault every page in now, not on the first get
        self.buf_id: int | None = None

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        end = self.size if nbytes is None else offset + nbytes
        if offset < 0 or end > self.size:
            raise ValueError(f"view [{offset}, {end}) outside buffer of {self.size} bytes")
        return self.array[offset:end]

    def close(self) -> None:
        self.unlink()
        self.array = np.zeros(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
