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
    the best-fitting hole, else from ``end`` while ``end`` stays within
    ``capacity``. Freed ranges merge with their neighbours, and a hole that reaches
    ``end`` gives its space back to the tail.
    """

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.align = align
        self.capacity = capacity // align * align
        self.end = 0
        self._starts: list[int] = []
        self._lengths: list[int] = []

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
        alloc.end = int(end[-1]) if len(end) else 0
        return alloc

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def used_bytes(self) -> int:
        return self.end - sum(self._lengths)

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lengths))

    def can_allocate(self, nbytes: int) -> bool:
        size = align_up(nbytes, self.align)
        return any(length >= size for length in self._lengths) or self.end + size <= self.capacity

    def allocate(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        size = align_up(nbytes, self.align)
        best = -1
        for i, length in enumerate(self._lengths):
            if length >= size and (best < 0 or length < self._lengths[best]):
                best = i
                if length == size:
                    break
        if best >= 0:
            start = self._starts[best]
            if self._lengths[best] == size:
                del self._starts[best]
                del self._lengths[best]
            else:
                self._starts[best] += size
                self._lengths[best] -= size
            return start
        if self.end + size > self.capacity:
            raise SpaceError(
                f"need {size} bytes, largest hole {max(self._lengths, default=0)}, "
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
        self._starts.insert(i, start)
        self._lengths.insert(i, size)
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)
            i -= 1
        if self._starts[i] + self._lengths[i] == self.end:
            self.end = self._starts.pop(i)
            self._lengths.pop(i)
