"""Free-space bookkeeping for one data file (or one DRAM arena): aligned ranges."""

from __future__ import annotations

import bisect
from typing import Iterable

import numpy as np

from kvdrive.layout.format import ALIGN, align_up


class SpaceError(Exception):
    """No free range is large enough and the capacity forbids growing."""


class ExtentAllocator:
    """Best-fit allocator of ``align``-aligned byte ranges below ``capacity``.

    The space is ``[0, end)`` with holes on a sorted free list; new space comes from
    the best-fitting hole (the smallest that fits, the lowest of those), else from
    ``end`` while ``end`` stays within ``capacity``. Freed ranges merge with their
    neighbours, and a hole that reaches ``end`` gives its space back to the tail.

    The holes are also kept ordered by (length, start), so a best fit is a binary search:
    a scan of every hole took 0.27 ms per allocation among 10,000 holes here when none
    fitted exactly (a put of 128 engine pages allocates 256 extents), as a store whose
    evictions left small holes met larger blocks.
    """

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.align = align
        self.capacity = capacity // align * align
        self.end = 0
        self._starts: list[int] = []
        self._lengths: list[int] = []
        self._fit: list[tuple[int, int]] = []  # (length, start) of every hole, sorted
        self._hole_bytes = 0

    @classmethod
    def from_used(cls, capacity: int, used: Iterable[tuple[int, int]], align: int = ALIGN) -> "ExtentAllocator":
        """Rebuild the free list as the complement of the ranges in use."""
        pairs = np.array(list(used), dtype=np.int64).reshape(-1, 2)
        return cls.from_spans(capacity, pairs[:, 0], pairs[:, 1], align)

    @classmethod
    def from_spans(cls, capacity: int, starts: np.ndarray, lengths: np.ndarray, align: int = ALIGN) -> "ExtentAllocator":
        """:meth:`from_used` of the ranges ``(starts[i], lengths[i])``, in arrays (a store of
        small blocks holds millions)."""
        alloc = cls(capacity, align)
        order = np.lexsort((lengths, starts))
        start = np.asarray(starts, np.int64)[order]
        end = start + align_up(np.asarray(lengths, np.int64)[order], align)
        pos = np.concatenate([np.zeros(1, np.int64), end[:-1]])  # where the range before ends
        overlap = np.flatnonzero(start < pos)
        if len(overlap):
            raise ValueError(f"ranges in use overlap at offset {int(start[overlap[0]])}")
        hole = start > pos
        alloc._starts, alloc._lengths = pos[hole].tolist(), (start - pos)[hole].tolist()
        alloc._fit = sorted(zip(alloc._lengths, alloc._starts))
        alloc._hole_bytes = sum(alloc._lengths)
        alloc.end = int(end[-1]) if len(end) else 0
        return alloc

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def used_bytes(self) -> int:
        return self.end - self._hole_bytes

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lengths))

    def can_allocate(self, nbytes: int) -> bool:
        size = align_up(nbytes, self.align)
        return bool(self._fit) and self._fit[-1][0] >= size or self.end + size <= self.capacity

    def allocate(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        size = align_up(nbytes, self.align)
        j = bisect.bisect_left(self._fit, (size, -1))
        if j < len(self._fit):
            length, start = self._fit.pop(j)
            i = bisect.bisect_left(self._starts, start)
            if length == size:
                del self._starts[i]
                del self._lengths[i]
            else:
                self._starts[i] += size
                self._lengths[i] -= size
                bisect.insort(self._fit, (length - size, start + size))
            self._hole_bytes -= size
            return start
        if self.end + size > self.capacity:
            raise SpaceError(
                f"need {size} bytes, largest hole {self._fit[-1][0] if self._fit else 0}, "
                f"{self.free_bytes} free of {self.capacity}"
            )
        start = self.end
        self.end += size
        return start

    def free(self, start: int, nbytes: int) -> None:
        size = align_up(nbytes, self.align)
        if start % self.align or start < 0 or start + size > self.end:
            raise ValueError(f"range [{start}, {start + size}) was never allocated (end {self.end})")
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + size:
            raise ValueError(f"double free of [{start}, {start + size})")
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start:
            raise ValueError(f"double free of [{start}, {start + size})")
        self._hole_bytes += size
        if i < len(self._starts) and start + size == self._starts[i]:  # the hole after it joins
            self._unfit(i)
            size += self._lengths.pop(i)
            self._starts.pop(i)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # it joins the hole before
            i -= 1
            self._unfit(i)
            start, size = self._starts.pop(i), size + self._lengths.pop(i)
        if start + size == self.end:
            self.end = start
            self._hole_bytes -= size
            return
        self._starts.insert(i, start)
        self._lengths.insert(i, size)
        bisect.insort(self._fit, (size, start))

    def _unfit(self, i: int) -> None:
        """Take hole ``i`` (by start) out of the best-fit order."""
        del self._fit[bisect.bisect_left(self._fit, (self._lengths[i], self._starts[i]))]
