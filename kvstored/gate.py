"""Deferred reclamation: space freed while a reader may still use it waits for it."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator


class ReclaimGate:
    """Epoch-based reclamation for DRAM slots, SSD extents and mapped buffers.

    A reader enters at the current epoch, looks locations up, moves bytes and
    leaves. A writer that unpublishes a location calls :meth:`retire` with the
    callback that frees it; the callback runs once every reader that entered
    before the retirement has left, so a location is never reused under a reader
    that may still copy from it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._active: Counter[int] = Counter()
        self._pending: list[tuple[int, Callable[[], None]]] = []

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._lock:
            epoch = self._epoch
            self._active[epoch] += 1
        try:
            yield
        finally:
            with self._lock:
                self._active[epoch] -= 1
                if not self._active[epoch]:
                    del self._active[epoch]
                due = self._take_due()
            for fn in due:
                fn()

    def retire(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._epoch += 1
            self._pending.append((self._epoch, fn))
            due = self._take_due()
        for f in due:
            f()

    def _take_due(self) -> list[Callable[[], None]]:
        oldest = min(self._active, default=None)
        due = [fn for epoch, fn in self._pending if oldest is None or epoch <= oldest]
        if due:
            self._pending = [(e, fn) for e, fn in self._pending if not (oldest is None or e <= oldest)]
        return due
