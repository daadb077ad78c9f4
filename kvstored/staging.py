"""Staging buffers for puts, kept for reuse.

A put of a sequence's blocks (and of engine blocks the data file cannot take as they
lie in the client's buffer: see put_path.py) copies them out of the client's buffer into
an anonymous staging mapping (checksummed and written to the data file from there, then
copied into the DRAM tier after the commit). A fresh mapping costs a page fault per 4 KiB on its first touch,
which made that copy run at about 1 GB/s, a third of a 2 MiB put's time in the daemon;
a mapping used before copies at memcpy speed. The pool keeps released mappings, in
power-of-two size classes from 1 MiB, up to ``max_bytes`` in all.

Single-threaded: only the writer thread takes and gives (see store.py's contract).
"""

from __future__ import annotations

import mmap
from collections import defaultdict

import numpy as np

MIN_CLASS = 1 << 20


def size_class(nbytes: int) -> int:
    """The mapping size that serves ``nbytes``: the next power of two, at least 1 MiB."""
    return max(MIN_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())


class StagingPool:
    """Anonymous mappings by size class; ``max_bytes`` bounds what it keeps between puts."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self._free: dict[int, list[mmap.mmap]] = defaultdict(list)
        self.reused = 0
        self.mapped = 0

    def take(self, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
        """A mapping of at least ``nbytes`` and a uint8 view of its first ``nbytes``."""
        size = size_class(nbytes)
        free = self._free[size]
        if free:
            m = free.pop()
            self.kept_bytes -= size
            self.reused += 1
        else:
            m = mmap.mmap(-1, size)
            self.mapped += 1
        return m, np.frombuffer(m, dtype=np.uint8, count=nbytes)

    def give(self, m: mmap.mmap) -> None:
        """Return a mapping taken here once no view of it is left: kept while the pool has
        room, else unmapped (a view still held raises BufferError there)."""
        size = len(m)
        if size == size_class(size) and self.kept_bytes + size <= self.max_bytes:
            self._free[size].append(m)
            self.kept_bytes += size
        else:
            m.close()

    def close(self) -> None:
        for maps in self._free.values():
            for m in maps:
                m.close()
        self._free.clear()
        self.kept_bytes = 0
