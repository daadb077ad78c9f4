"""The in-memory block index: where every block of every sequence lives.

LMDB holds the durable copy (see catalog.py); this index is rebuilt from it at
start-up and answers a sparse get's lookups with a few vectorised numpy gathers.
Per sequence it keeps ``[layers, heads, pages]`` arrays, grown by doubling along
the page axis as decode appends pages.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from kvdrive.layout.geometry import Geometry

ABSENT = -1


@dataclass
class SeqEntry:
    uid: int
    ns: str
    name: str
    geometry: Geometry
    created: float
    owner: int = 0
    ssd_off: np.ndarray = field(init=False)
    crc: np.ndarray = field(init=False)
    dram_off: np.ndarray = field(init=False)
    importance: np.ndarray = field(init=False)
    last_use: np.ndarray = field(init=False)
    num_blocks: int = 0
    # (offset, bytes) of every extent on SSD, so a delete can free them.
    extents: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._alloc(16)

    def _alloc(self, cap: int) -> None:
        shape = (self.geometry.num_layers, self.geometry.num_kv_heads, cap)
        self.ssd_off = np.full(shape, ABSENT, dtype=np.int64)
        self.crc = np.zeros(shape, dtype=np.uint32)
        self.dram_off = np.full(shape, ABSENT, dtype=np.int64)
        self.importance = np.zeros(shape, dtype=np.float32)
        self.last_use = np.zeros(shape, dtype=np.int64)

    @property
    def capacity(self) -> int:
        return self.ssd_off.shape[2]

    def ensure_pages(self, num_pages: int) -> None:
        """Grow the page axis (called by the single writer before it publishes)."""
        cap = self.capacity
        if num_pages <= cap:
            return
        while cap < num_pages:
            cap *= 2
        old = (self.ssd_off, self.crc, self.dram_off, self.importance, self.last_use)
        n = old[0].shape[2]
        self._alloc(cap)
        for new, prev in zip((self.ssd_off, self.crc, self.dram_off, self.importance, self.last_use), old):
            new[:, :, :n] = prev

    def stored_pages(self) -> np.ndarray:
        """Number of stored pages per (layer, head)."""
        return (self.ssd_off >= 0).sum(axis=2)

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.geometry.block_bytes


class BlockIndex:
    """Sequences by uid and by (namespace, name); guarded by one lock for structure."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_uid: dict[int, SeqEntry] = {}
        self._by_name: dict[tuple[str, str], int] = {}

    def add(self, entry: SeqEntry) -> None:
        with self.lock:
            self._by_uid[entry.uid] = entry
            self._by_name[(entry.ns, entry.name)] = entry.uid

    def remove(self, uid: int) -> SeqEntry | None:
        with self.lock:
            entry = self._by_uid.pop(uid, None)
            if entry is not None:
                self._by_name.pop((entry.ns, entry.name), None)
            return entry

    def get(self, uid: int) -> SeqEntry | None:
        return self._by_uid.get(uid)

    def find(self, ns: str, name: str) -> SeqEntry | None:
        uid = self._by_name.get((ns, name))
        return None if uid is None else self._by_uid.get(uid)

    def all(self) -> list[SeqEntry]:
        with self.lock:
            return list(self._by_uid.values())
