"""The in-memory block index: where every block of every sequence lives.

LMDB holds the durable copy (see catalog.py); this index is rebuilt from it at
start-up and answers a sparse get's lookups with a few vectorised numpy gathers.
Per sequence it keeps dense ``[layers, heads, window]`` arrays over a window of
pages ``[first_page, first_page + capacity)``, grown by doubling as decode
appends pages.

Memory, and the limits that keep it proportional to what is stored:

- A new sequence holds no arrays at all; the first put allocates its window, which
  starts at that put's lowest page (a sequence that stores pages 400.. after a shared
  prefix pays nothing for pages 0..399).
- The page span: the window may cover at most
  ``PAGE_SPAN_FACTOR * (pages stored + the put's pages) + PAGE_SPAN_SLACK`` pages, so a
  put far past the stored pages (page 2^24 - 1 after page 0) is refused
  (:class:`PageSpanError`) instead of asking for gigabytes. Dense use, in order
  from any first page, never comes near it.
- The byte budget: all windows together, at :data:`SLOT_BYTES` per
  (layer, head, page) slot plus :data:`ENTRY_BYTES` per sequence, stay within
  ``max_bytes`` (``--index-max``); past it a put or create is refused
  (:class:`IndexFullError`).
- The owner's share: the windows of one owner (uid) stay within ``max_bytes_per_owner``
  (``--index-max-per-uid``, less than ``--index-max``), so one user cannot take the
  index from the others; past it that user's put or create is refused
  (:class:`IndexFullError`), and other users' are not.

Life cycle of a growth, on the writer thread: :meth:`BlockIndex.plan_growth` checks
every limit and says what the window becomes (nothing changes); :meth:`BlockIndex.grow`
allocates the new arrays (the one step that can fail, with MemoryError) and swaps them
in under the lock. Both run in ``Store.prepare_put``, before anything is committed, so
publishing a committed put is assignments into arrays that already exist.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np

from kvdrive.layout.geometry import Geometry
from kvdrive.layout.sorted_list import SortedList
from kvstored.catalog import BLOCKS_NAME
from kvstored.config import format_size
from kvstored.protocol import MAX_IMPORTANCE

ABSENT = -1
# Bytes per (layer, head, page) slot: ssd_off int64, crc uint32, dram_off int64,
# importance float32, last_use int64.
SLOT_BYTES = 8 + 4 + 8 + 4 + 8
# Bytes per page of the window beside its slots: its count of stored blocks, int32.
PAGE_BYTES = 4
# What a sequence costs before it stores a block (its entry, names, dict slots).
ENTRY_BYTES = 1024
# What a block namespace's key table (block_keys.py, blocks.py) costs per page of its
# window, beside its slots: a key (a bytes object), its hash, its place in the LRU order,
# a bucket of the key map, its parts' extent ids, a generation (about 100 to 130 bytes
# measured with 16-byte keys, more with longer ones; a window holds up to twice its blocks).
BLOCK_TABLE_BYTES = 256
PAGE_SPAN_FACTOR = 2
PAGE_SPAN_SLACK = 1024


class IndexLimitError(Exception):
    """A put or create the index refuses: it would grow past a documented limit."""


class PageSpanError(IndexLimitError):
    """The put's pages lie too far from the pages the sequence stores."""


class IndexFullError(IndexLimitError):
    """The put or create would take the index past its byte budget."""


class Growth(NamedTuple):
    """What a sequence's window becomes for one put (see :meth:`BlockIndex.plan_growth`)."""

    first_page: int
    capacity: int
    lo: int  # the pages reserved: [lo, hi)
    hi: int


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
    # How many blocks of page first_page + i are stored (of layers x heads), and how many
    # pages hold any: what ``open``, ``list`` and ``lookup`` report reads these, not the window.
    page_blocks: np.ndarray = field(init=False)
    num_pages: int = 0
    num_blocks: int = 0
    # Blocks with a DRAM copy (residency.py keeps it, index lock held).
    dram_blocks: int = 0
    # Page number of column 0 of the arrays.
    first_page: int = 0
    # Pages [lo_page, hi_page) are reserved: stored, or being written by a prepared put.
    lo_page: int = 0
    hi_page: int = 0
    # (offset, bytes) of every extent on SSD, so a delete can free them.
    extents: list = field(default_factory=list)
    # The token of the session that created it, while this daemon runs (not in the catalog).
    writer: bytes | None = None
    # The tick of its most recent put or get (0: none since start): the largest of last_use,
    # kept as one number, so that a quota ranks a namespace's sequences without a pass over
    # each one's window (index lock held to write it).
    last_tick: int = 0

    def __post_init__(self) -> None:
        self._install(_arrays(self.geometry, 0))
        self.page_extra = BLOCK_TABLE_BYTES if self.name == BLOCKS_NAME else 0

    def _install(self, arrays: tuple[np.ndarray, ...]) -> None:
        self.ssd_off, self.crc, self.dram_off, self.importance, self.last_use, self.page_blocks = arrays

    @property
    def capacity(self) -> int:
        return self.ssd_off.shape[2]

    @property
    def nbytes(self) -> int:
        """What this entry counts against the index budget."""
        return index_bytes(self.geometry, self.capacity, self.page_extra)

    def columns(self, pages: np.ndarray) -> np.ndarray:
        """Array columns of ``pages`` (each must lie in the window)."""
        return pages - self.first_page

    def inside(self, pages: np.ndarray) -> np.ndarray:
        """Which of ``pages`` lie in the window."""
        return (pages >= self.first_page) & (pages < self.first_page + self.capacity)

    @property
    def complete_pages(self) -> int:
        """Pages 0..n-1 all of whose blocks are stored (index lock held): a pass over the
        window's pages, not its blocks (at 80 layers x 8 heads x 8,192 pages the blocks' pass
        held the index lock for 6.4 ms an ``open``)."""
        if self.first_page or not self.capacity:
            return 0
        complete = self.page_blocks == self.geometry.num_layers * self.geometry.num_kv_heads
        return int(np.argmin(complete)) if not complete.all() else len(complete)

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.geometry.block_bytes


def index_bytes(geometry: Geometry, capacity: int, page_extra: int = 0) -> int:
    """What a sequence with a window of ``capacity`` pages counts against the budget
    (``page_extra``: what else it keeps per page, a block namespace's key table)."""
    return ENTRY_BYTES + capacity * (geometry.num_layers * geometry.num_kv_heads * SLOT_BYTES + PAGE_BYTES + page_extra)


def _arrays(g: Geometry, cap: int) -> tuple[np.ndarray, ...]:
    shape = (g.num_layers, g.num_kv_heads, cap)
    return (
        np.full(shape, ABSENT, dtype=np.int64), np.zeros(shape, dtype=np.uint32), np.full(shape, ABSENT, dtype=np.int64),
        np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.int64), np.zeros(cap, dtype=np.int32),
    )


class BlockIndex:
    """Sequences by uid and by (owner uid, namespace, name); guarded by one lock for structure.

    ``num_bytes`` (what every entry counts, see :data:`SLOT_BYTES`) and each owner's
    part of it change on the writer thread only: :meth:`add`, :meth:`remove` and :meth:`grow`.
    """

    def __init__(self, max_bytes: int, max_bytes_per_owner: int | None = None) -> None:
        self.lock = threading.Lock()
        self.max_bytes = max_bytes
        self.max_bytes_per_owner = max_bytes if max_bytes_per_owner is None else max_bytes_per_owner
        self.num_bytes = 0
        # Blocks held by every entry in the index, and the bytes of each owner's: what the
        # metrics and a user's ``stats`` report, read without a pass over the entries
        # (:meth:`add_blocks` keeps them).
        self.stored_blocks = 0
        self._owner_stored: Counter[int] = Counter()
        self._owner_bytes: Counter[int] = Counter()
        self._by_uid: dict[int, SeqEntry] = {}
        self._by_name: dict[tuple[int, str, str], int] = {}
        # The uids of each owner's entries, (owner,), and of each of its namespaces, (owner, ns), in order.
        self._uids: dict[tuple, SortedList] = {}
        # Each (owner, namespace)'s entries put into or read since start-up (or holding blocks
        # then), least recently used first: a --quota's victims in order (kvstored/quota.py).
        self._lru: dict[tuple[int, str], OrderedDict[int, SeqEntry]] = {}

    def owner_bytes(self, owner: int) -> int:
        """What the sequences of ``owner`` count against the index budget."""
        return self._owner_bytes.get(owner, 0)

    def check_add(self, owner: int) -> None:
        """Raise :class:`IndexFullError` where a new sequence of ``owner`` would pass a limit."""
        if self.num_bytes + ENTRY_BYTES > self.max_bytes:
            raise IndexFullError(f"block index full: {format_size(self.num_bytes)} of --index-max "
                                 f"{format_size(self.max_bytes)}; delete sequences or raise --index-max")
        if self.owner_bytes(owner) + ENTRY_BYTES > self.max_bytes_per_owner:
            raise IndexFullError(self._owner_full(owner, "a new sequence", ENTRY_BYTES))

    def _owner_full(self, owner: int, what: str, need: int) -> str:
        return (f"block index full for uid {owner}: {what} would add {format_size(need)}, and this user's sequences "
                f"hold {format_size(self.owner_bytes(owner))} of --index-max-per-uid "
                f"{format_size(self.max_bytes_per_owner)} (one user's share of --index-max "
                f"{format_size(self.max_bytes)}, so that others keep room): delete sequences of this user, put "
                f"pages near the stored ones, or raise --index-max-per-uid")

    def add(self, entry: SeqEntry) -> None:
        self.add_many([entry])

    def add_many(self, entries: list[SeqEntry]) -> None:
        """Add ``entries``; a sorted list of uids new to them is built whole (start-up adds
        every stored sequence at once: one by one, the sorted lists took 0.4 s a 100K)."""
        new: dict[tuple, list[int]] = {}
        with self.lock:
            for entry in entries:
                self._by_uid[entry.uid] = entry
                self._by_name[(entry.owner, entry.ns, entry.name)] = entry.uid
                for key in ((entry.owner,), (entry.owner, entry.ns)):
                    new.setdefault(key, []).append(entry.uid)
                self._count(entry.owner, entry.nbytes)
                self._stored(entry, entry.num_blocks)
            for key, uids in new.items():
                held = self._uids.get(key)
                if held is None:
                    self._uids[key] = SortedList(uids)
                else:
                    for uid in uids:
                        held.add(uid)

    def remove(self, uid: int) -> SeqEntry | None:
        with self.lock:
            entry = self._by_uid.pop(uid, None)
            if entry is not None:
                self._by_name.pop((entry.owner, entry.ns, entry.name), None)
                for key in ((entry.owner,), (entry.owner, entry.ns)):
                    uids = self._uids[key]
                    uids.remove(uid)
                    if not len(uids):
                        del self._uids[key]
                lru = self._lru.get((entry.owner, entry.ns))
                if lru is not None and lru.pop(uid, None) is not None and not lru:
                    del self._lru[(entry.owner, entry.ns)]
                self._count(entry.owner, -entry.nbytes)
                self._stored(entry, -entry.num_blocks)
            return entry

    def add_blocks(self, entry: SeqEntry, n: int) -> None:
        """``n`` more blocks held by ``entry`` (fewer for n < 0), counted in :attr:`stored_blocks`
        where the entry is in the index (index lock held, or start-up)."""
        entry.num_blocks += n
        if self._by_uid.get(entry.uid) is entry:
            self._stored(entry, n)

    def _stored(self, entry: SeqEntry, n: int) -> None:
        self.stored_blocks += n
        self._owner_stored[entry.owner] += n * entry.geometry.block_bytes
        if not self._owner_stored[entry.owner]:
            del self._owner_stored[entry.owner]

    def stored_bytes(self, owner: int) -> int:
        """The bytes of the blocks ``owner``'s entries hold."""
        return self._owner_stored.get(owner, 0)

    def _count(self, owner: int, delta: int) -> None:
        self.num_bytes += delta
        self._owner_bytes[owner] += delta
        if not self._owner_bytes[owner]:
            del self._owner_bytes[owner]  # an owner with no sequences leaves nothing behind

    def get(self, uid: int) -> SeqEntry | None:
        return self._by_uid.get(uid)

    def find(self, owner: int, ns: str, name: str) -> SeqEntry | None:
        uid = self._by_name.get((owner, ns, name))
        return None if uid is None else self._by_uid.get(uid)

    def all(self) -> list[SeqEntry]:
        with self.lock:
            return list(self._by_uid.values())

    def used(self, entry: SeqEntry, tick: int) -> None:
        """``entry`` was put into or read at ``tick``: its ``last_tick``, and its place as the most
        recently used of its namespace (index lock held)."""
        entry.last_tick = max(entry.last_tick, tick)
        lru = self._lru.get(key := (entry.owner, entry.ns))
        if lru is None:
            lru = self._lru[key] = OrderedDict()
        lru[entry.uid] = entry
        lru.move_to_end(entry.uid)

    def rank_loaded(self) -> None:
        """At start-up, once every entry is loaded: those holding blocks, none used since, as the
        least recently used of their namespaces, by uid."""
        with self.lock:
            for uid in sorted(uid for uid, e in self._by_uid.items() if e.num_blocks):
                entry = self._by_uid[uid]
                self._lru.setdefault((entry.owner, entry.ns), OrderedDict())[uid] = entry

    def least_recent(self, owner: int, ns: str) -> Iterator[SeqEntry]:
        """``owner`` 's entries of namespace ``ns`` put into or read since start-up (or holding
        blocks then), least recently used first (index lock held while it is read)."""
        return iter(self._lru.get((owner, ns), {}).values())

    def count(self, owner: int) -> int:
        """How many entries ``owner`` has."""
        return len(self._uids.get((owner,), ()))

    def listed(self, owner: int, ns: str | None, after: int, n: int, keep: Callable[[SeqEntry], bool]) -> list[SeqEntry]:
        """The first ``n`` entries of ``owner`` (of namespace ``ns``, if given) with uid > ``after``
        that ``keep`` takes, by uid: a search and ``n`` steps, where a pass over every entry
        for each page of a listing made listing S sequences O(S^2) (20K sequences: 1250
        pages of 16 at 1.5-3 ms each, on the thread that serves every request)."""
        out: list[SeqEntry] = []
        with self.lock:
            uids = self._uids.get((owner,) if ns is None else (owner, ns))
            for uid in uids.irange(after + 1) if uids is not None else ():
                if keep(entry := self._by_uid[uid]):
                    out.append(entry)
                    if len(out) == n:
                        break
        return out

    # ------------------------------------------------------------ growth (writer thread)

    def plan_growth(self, entry: SeqEntry, pages: np.ndarray, enforce: bool = True) -> Growth:
        """The window ``entry`` needs to also hold ``pages``; changes nothing.

        With ``enforce`` (every put; not the start-up load of what LMDB holds) a window
        past the page span, the byte budget or the owner's share raises :class:`IndexLimitError`.
        """
        pmin, pmax = int(pages.min()), int(pages.max()) + 1
        lo, hi = (min(entry.lo_page, pmin), max(entry.hi_page, pmax)) if entry.hi_page > entry.lo_page else (pmin, pmax)
        span_limit = PAGE_SPAN_FACTOR * (entry.num_pages + len(pages)) + PAGE_SPAN_SLACK
        if enforce and hi - lo > span_limit:
            raise PageSpanError(
                f"pages {lo}..{hi - 1} of {entry.ns}/{entry.name} span {hi - lo} pages for {entry.num_pages} stored "
                f"and {len(pages)} put; the index holds a window of at most {PAGE_SPAN_FACTOR} x (stored + put) + "
                f"{PAGE_SPAN_SLACK} pages per sequence: put pages near the stored ones (in order, as decode appends "
                f"them), or use another sequence for a far range"
            )
        cap, first = entry.capacity, entry.first_page
        if cap and first <= lo and hi <= first + cap:
            return Growth(first, cap, lo, hi)
        if not cap:
            first, need, roomy = lo, hi - lo, hi - lo
        else:
            first = min(first, lo)
            need = max(hi, entry.first_page + cap) - first
            roomy = max(need, 2 * cap)  # doubling keeps appends amortised O(1)
        new_cap = roomy if not enforce or self._fits(entry, roomy) else need
        if enforce and not self._fits(entry, need):
            self._refuse(entry, need)
        return Growth(first, new_cap, lo, hi)

    def _fits(self, entry: SeqEntry, capacity: int) -> bool:
        """Whether ``entry`` with a window of ``capacity`` pages stays within both budgets."""
        grown = index_bytes(entry.geometry, capacity, entry.page_extra) - entry.nbytes
        return (self.num_bytes + grown <= self.max_bytes
                and self.owner_bytes(entry.owner) + grown <= self.max_bytes_per_owner)

    def _refuse(self, entry: SeqEntry, need: int) -> None:
        cost = index_bytes(entry.geometry, need, entry.page_extra)
        what = f"a window of {need} pages for {entry.ns}/{entry.name}"
        others = self.num_bytes - entry.nbytes
        if others + cost > self.max_bytes:
            raise IndexFullError(
                f"block index full: {what} needs {format_size(cost)}, and {format_size(others)} of --index-max "
                f"{format_size(self.max_bytes)} are held by other sequences: delete sequences or raise --index-max"
            )
        raise IndexFullError(self._owner_full(entry.owner, what, cost - entry.nbytes))

    def grow(self, entry: SeqEntry, growth: Growth) -> None:
        """Give ``entry`` the window of ``growth`` (on the writer thread, or at start-up):
        allocate (may raise MemoryError, leaving the entry as it was) and copy, then copy
        again what gets change and swap, under the lock (cannot fail)."""
        if growth.capacity == entry.capacity and growth.first_page == entry.first_page:
            entry.lo_page, entry.hi_page = growth.lo, growth.hi
            return
        arrays = _arrays(entry.geometry, growth.capacity)
        shift = entry.first_page - growth.first_page
        # Everything is copied before the lock, into the new pages (their first touch); under
        # it only what gets change as well (DRAM offsets, last use) is copied again: the rest
        # only puts, deletes and start-up change, on the writer thread, which is the one
        # growing the window. At a million blocks the lock, which gets wait on, was held
        # twice as long with every copy made under it.
        old = (entry.ssd_off, entry.crc, entry.dram_off, entry.importance, entry.last_use)
        for new, prev in zip(arrays, old):
            new[:, :, shift : shift + prev.shape[2]] = prev
        arrays[5][shift : shift + entry.capacity] = entry.page_blocks
        with self.lock:
            for new, prev in zip((arrays[2], arrays[4]), (entry.dram_off, entry.last_use)):
                new[:, :, shift : shift + prev.shape[2]] = prev
            before = entry.nbytes
            entry._install(arrays)
            entry.first_page = growth.first_page
            entry.lo_page, entry.hi_page = growth.lo, growth.hi
            self._count(entry.owner, entry.nbytes - before)

    def clear_blocks(self, entry: SeqEntry, layers: np.ndarray, heads: np.ndarray, columns: np.ndarray) -> None:
        """Forget blocks deleted one by one (engine blocks: a page each, every block of its
        pages), their pages no longer stored (index lock held; their DRAM copies are
        residency's to forget first)."""
        stored = entry.ssd_off[layers, heads, columns] >= 0
        entry.ssd_off[layers, heads, columns] = ABSENT
        entry.crc[layers, heads, columns] = 0
        entry.importance[layers, heads, columns] = 0
        self._count_blocks(entry, columns[stored], -1)

    def mark_blocks(self, entry: SeqEntry, columns: np.ndarray) -> None:
        """Count blocks just stored, in pages ``columns`` (one per block, index lock held)."""
        self._count_blocks(entry, columns, 1)

    def _count_blocks(self, entry: SeqEntry, columns: np.ndarray, sign: int) -> None:
        """Add ``sign`` to the stored blocks of each of ``columns`` (one per block), the pages
        holding any and the entry's blocks."""
        if not len(columns):
            return
        lo = int(columns.min())
        span = entry.page_blocks[lo: int(columns.max()) + 1]
        before = int(np.count_nonzero(span))
        span += sign * np.bincount(columns - lo, minlength=len(span)).astype(np.int32)
        entry.num_pages += int(np.count_nonzero(span)) - before
        self.add_blocks(entry, sign * len(columns))

    def load_extents(self, entry: SeqEntry, exts: list) -> tuple[np.ndarray, np.ndarray]:
        """Fill ``entry``'s arrays from its catalog extents (:class:`~kvstored.catalog.ExtentRecord`);
        the offsets and bytes they use."""
        counts = np.fromiter((len(e.pages) for e in exts), np.int64, len(exts))
        offsets = np.fromiter((e.offset for e in exts), np.int64, len(exts))
        self._load(entry, np.concatenate([e.pages for e in exts]).astype(np.int64), counts, offsets,
                   np.repeat(np.fromiter((e.layer for e in exts), np.int64, len(exts)), counts),
                   np.repeat(np.fromiter((e.head for e in exts), np.int64, len(exts)), counts),
                   np.concatenate([e.crc for e in exts]), np.concatenate([e.importance for e in exts]))
        nbytes = counts * entry.geometry.block_bytes
        entry.extents.extend(zip(offsets.tolist(), nbytes.tolist()))
        return offsets, nbytes

    def load_parts(self, entry: SeqEntry, cols) -> None:
        """Fill a block namespace's arrays from its blocks' columns
        (:class:`~kvstored.block_columns.BlockColumns`): part ``p`` of a block is layer ``p``
        of its slot, one page at its offset."""
        n, parts = cols.ext_ids.shape
        self._load(entry, np.repeat(cols.slots, parts), np.ones(n * parts, np.int64), cols.offsets.ravel(),
                   np.tile(np.arange(parts, dtype=np.int64), n), np.zeros(n * parts, np.int64), cols.crcs.ravel(),
                   np.zeros(n * parts, np.float32))

    def _load(self, entry: SeqEntry, pages: np.ndarray, counts: np.ndarray, offsets: np.ndarray, layers: np.ndarray,
              heads: np.ndarray, crc: np.ndarray, importance: np.ndarray) -> None:
        """Fill ``entry``'s arrays: extent ``i`` holds ``counts[i]`` of ``pages`` from ``offsets[i]``;
        ``layers``, ``heads``, ``crc`` and ``importance`` by page. All at once (a block
        namespace has one extent per block and part: millions, at start-up)."""
        if not len(pages):
            return
        bb = entry.geometry.block_bytes
        # One window for everything stored: what LMDB holds is loaded whatever the limits.
        self.grow(entry, self.plan_growth(entry, np.array([pages.min(), pages.max()]), enforce=False))
        within = np.arange(len(pages), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)  # i-th page of its extent
        cols = entry.columns(pages)
        entry.ssd_off[layers, heads, cols] = np.repeat(offsets, counts) + within * bb
        entry.crc[layers, heads, cols] = crc
        # Stores written before hints were bounded may hold larger ones.
        entry.importance[layers, heads, cols] = np.clip(importance, 0.0, MAX_IMPORTANCE)
        self._count_blocks(entry, cols, 1)
