"""The DRAM tier: a pre-faulted arena of block slots, one slot class per block size.

The arena is exactly ``--dram`` bytes, mapped and faulted in at start-up, so the
tier can never hold more than it was given and the first get does not pay for
page faults. Space is handed to a block size in chunks; within a class, slots sit
on a free stack. Which blocks stay is the store's decision (importance, then
least recently used, within each user's fair share: dram_shares.py); this class
only owns the bytes and the free slots.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
import time

import numpy as np

from kvdrive.layout.allocator import ExtentAllocator, SpaceError
from kvstored.config import format_size
from kvstored.files import StoreOpenError
from kvstored.notify import Progress
from kvstored.tier import Tier

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
PREFAULT_STEP_BYTES = 256 << 20  # pre-faulted between two looks at the clock


class DramAllocationError(StoreOpenError):
    """The DRAM tier could not be mapped: ``--dram`` asks for more than the kernel gives."""


class DramTier(Tier):
    name = "dram"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lock = threading.Lock()
        if capacity:
            try:
                self._map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise
                raise DramAllocationError(
                    f"--dram {format_size(capacity)}: the kernel refused to map that much memory (ENOMEM); "
                    "choose a smaller --dram"
                ) from None
            # Gets touch scattered blocks all over the arena: 2 MiB pages spare most of
            # the TLB misses that 4 KiB pages would cost. Asked for before the first
            # touch, so the faults below already allocate huge pages where the kernel has them.
            self.huge_pages = _advise_huge_pages(self._map)
            self.arena = np.frombuffer(self._map, dtype=np.uint8)
            _prefault(self.arena)  # every page now, not on the first get
        else:
            self.huge_pages = False
            self._map = None
            self.arena = np.zeros(0, dtype=np.uint8)
        self._chunks = ExtentAllocator(capacity, align=4096)
        self._free: dict[int, list[int]] = {}
        self._resident: dict[int, int] = {}

    def usage(self) -> tuple[int, int]:
        """(bytes, blocks) held now, read under the lock (for a reader on another thread)."""
        with self.lock:
            return sum(bb * n for bb, n in self._resident.items()), sum(self._resident.values())

    @property
    def used_bytes(self) -> int:
        return sum(bb * n for bb, n in self._resident.items())

    @property
    def num_blocks(self) -> int:
        return sum(self._resident.values())

    def allocate(self, block_bytes: int, count: int) -> np.ndarray:
        """Up to ``count`` free slots for blocks of ``block_bytes`` (maybe fewer)."""
        with self.lock:
            free = self._free.setdefault(block_bytes, [])
            while len(free) < count and self._grow(block_bytes, free):
                pass
            take = min(count, len(free))
            out = np.asarray(free[len(free) - take :], dtype=np.int64)
            del free[len(free) - take :]
            self._resident[block_bytes] = self._resident.get(block_bytes, 0) + take
            return out

    def has_room(self, block_bytes: int) -> bool:
        """Whether :meth:`allocate` would give at least one slot of ``block_bytes`` now."""
        with self.lock:
            return bool(self._free.get(block_bytes)) or self._chunks.can_allocate(self._chunk_bytes(block_bytes))

    def release(self, block_bytes: int, offsets: np.ndarray) -> None:
        if not len(offsets):
            return  # a sequence that never had DRAM slots (or a tier of size 0)
        with self.lock:
            self._free.setdefault(block_bytes, []).extend(offsets.tolist())
            self._resident[block_bytes] -= len(offsets)
            assert self._resident[block_bytes] >= 0

    def _chunk_bytes(self, block_bytes: int) -> int:
        return max(block_bytes, min(CHUNK_BYTES, self._chunks.capacity) // block_bytes * block_bytes)

    def _grow(self, block_bytes: int, free: list[int]) -> bool:
        chunk = self._chunk_bytes(block_bytes)
        try:
            start = self._chunks.allocate(chunk)
        except (SpaceError, ValueError):
            return False
        free.extend(range(start + chunk - block_bytes, start - 1, -block_bytes))
        return True

    def close(self) -> None:
        self.arena = np.zeros(0, dtype=np.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A view still exists (a test holding a reference); the OS frees it at exit.
                log.debug("DRAM arena still referenced at close")
            self._map = None


def _prefault(arena: np.ndarray) -> None:
    """Touch every 4 KiB page of ``arena``; log progress with the time left, and ask
    systemd for more start-up time as it goes (:class:`~kvstored.notify.Progress`):
    a 96 GiB tier takes minutes on some hosts."""
    total, t0 = len(arena), time.monotonic()
    progress = Progress("DRAM tier", "pre-faulted", total, log, format_size)
    log.info("DRAM tier: pre-faulting %s", format_size(total))
    for start in range(0, total, PREFAULT_STEP_BYTES):
        arena[start : start + PREFAULT_STEP_BYTES : 4096] = 0
        progress.add(min(total, start + PREFAULT_STEP_BYTES) - start)
    log.info("DRAM tier: pre-faulted %s in %.1f s", format_size(total), time.monotonic() - t0)


def _advise_huge_pages(region: mmap.mmap) -> bool:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        log.info("DRAM tier: this platform has no MADV_HUGEPAGE; using 4 KiB pages")
        return False
    try:
        region.madvise(advice)
    except OSError as exc:
        log.info("DRAM tier: huge pages refused (%s); using 4 KiB pages", exc)
        return False
    return True
