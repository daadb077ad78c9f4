"""Shared-memory buffers a CPU client registers with kvstored."""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedBuffer:
    """A pre-faulted memfd mapped here and, once registered, in the daemon.

    The memfd has no name in any file system, so nothing is left behind if either
    process dies, and no other user can open it. It is sealed at its size before
    the daemon sees it: it can never shrink under the daemon's mapping. The
    descriptor stays open so the buffer can be registered again with a restarted
    daemon.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        self.size = size
        self.fd = os.memfd_create("kvdrive-buffer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self.fd, size, flags=flags)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[::4096] = 0  # fault every page in now, not on the first get
        self.buf_id: int | None = None

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        end = self.size if nbytes is None else offset + nbytes
        if offset < 0 or end > self.size:
            raise ValueError(f"view [{offset}, {end}) outside buffer of {self.size} bytes")
        return self.array[offset:end]

    def close(self) -> None:
        self.array = np.zeros(0, dtype=np.uint8)
        self.buf_id = None
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
