"""Which blocks the DRAM tier keeps: admission, ranking and eviction, never a scan.

A block enters the tier when a put commits (``replace``: it may displace residents) and
when a get reads it from the SSD (only into free slots). Residents are ranked by
importance, then by last use (the tick of the put or get that last touched them); a
candidate that finds no free slot displaces the lowest-ranked resident of its own user
if it ranks higher itself, or one of a user over its fair share while its own user is
under its share (dram_shares.py).

The ranking lives in one min-heap per (owner, block size) of *runs*: a run is a group of
blocks of one sequence, each with the importance and last use (the tick of the put or get
that last touched it) it had when recorded, in rank order and keyed by its first block's
``(importance, tick)``. A put or get pushes one run per sequence, whatever the importances
of its blocks (a decode step's get names hundreds of pages of as many importances; a run
per importance cost it ~10 ms of Python), so the cost of keeping the order is O(log runs)
per put or get, whatever the number of stored sequences or resident blocks. A block
touched again is pushed again with its new tick; its older record goes stale. Staleness is
checked when a run is popped: a block counts only if it is still resident and its
importance and last use are still the run's (ticks are never reused, so a block
re-admitted later cannot match an old run). When the records a heap holds pass twice its
resident blocks (plus a slack), the heap is compacted: the runs pushed longest ago, up to
COMPACT_SLICE records (a block's older records are those its later touches made stale),
each sequence's records among them checked in one vectorised pass, the stale ones dropped
and the live ones merged into runs of COMPACT_RUN blocks. So memory stays proportional to
the resident blocks, every push pays O(1) amortised for compaction, and runs do not
fragment: gets of random blocks leave a few live blocks in most old runs, and runs kept
whole for them had grown to 20K at 400K resident blocks, checked one by one in Python
(0.5-0.9 s a compaction, with the index lock held). Compacting the whole heap at once
still held the lock 66 ms at 400K resident blocks and 133 ms at 800K; a slice at a time,
2.5 ms or so at either, in about 55% of the total time (the oldest runs are found in push
order, not by a pass over them all; the heap list sheds the entries of runs taken out
when they outnumber the rest: 2.5 ms at 800K, every few dozen times).
Slices of 65,536 records took twice as long each, as many times fewer, for the same
total: the gets' p99.9 through kvstored was 7.4-7.7 ms with them, 4.4-4.5 ms now.
A block may then keep a live record in a run left out as well: eviction marks a block
it takes non-resident at once, so its other records are stale by the time they are
popped.

Eviction pops runs from the bottom of the owner's heap and takes their blocks in rank
order, those that rank at or below every other run's first block, while the candidates
(by descending importance) still outrank them; the rest of a run goes back under its new
first block. So the order is exact, the splitting is paid only by what eviction reaches,
and it pairs at most one resident with each candidate, as a full sort of the residents
would.
A put of new blocks written straight from a client's buffer (put_path.py) takes its
slots before its write (:meth:`Residency.reserve`), copies the blocks in beside the
write (:meth:`Residency.fill`) and maps them once its commit is done
(:meth:`Residency.publish_reserved`): the copy then costs the put no time of its own.
Slots reserved are nobody's to read until then, and go back if the put fails
(:meth:`Residency.release_reserved`).
All methods but :meth:`admit` and those four (which take it where they need it) expect the
index lock held.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from typing import Callable, NamedTuple

import numpy as np

from kvstored.buffers import MappedBuffer
from kvstored.checksum import block_crcs
from kvstored.copy import address_tags, gather_scatter
from kvstored.dram import DramTier
from kvstored.dram_shares import DramShares
from kvstored.index import BlockIndex, SeqEntry

COMPACT_SLACK = 4096  # records a heap may hold beyond twice its resident blocks before compaction
COMPACT_RUN = 128  # blocks a run of a compacted heap holds (an eviction checks a run whole, as a put's or get's)
COMPACT_SLICE = 1 << 15  # records one compaction takes at most: the oldest runs' (a bounded stall)
_RUN_FIELDS = ("importance", "ticks", "layers", "heads", "pages")


class _Run(NamedTuple):
    """Blocks ``(layers[i], heads[i], pages[i])`` of sequence ``uid`` that had importance
    ``importance[i]`` and last use ``ticks[i]`` when recorded, in rank order: by importance,
    then by last use.

    A heap keeps each as a plain tuple, and its entries hold numbers only: tuples of ints,
    floats and arrays, which the cyclic garbage collector stops tracking once it has seen
    them (it tracks a named tuple for good). As dataclass instances held by the entries,
    runs and entries were most of what a full collection walked at 800K resident blocks
    (46K of 113K objects in a test of the residency alone), a 14-18 ms pause of whichever
    thread allocated, a get's as often as not."""

    uid: int
    importance: np.ndarray  # float32, one per block
    ticks: np.ndarray  # int64
    layers: np.ndarray
    heads: np.ndarray
    pages: np.ndarray

    @classmethod
    def ranked(cls, uid: int, importance, ticks, layers, heads, pages) -> _Run:
        """A run of these blocks, put in rank order."""
        order = np.lexsort((ticks, importance))
        return cls(uid, importance[order], ticks[order], layers[order], heads[order], pages[order])

    @property
    def rank(self) -> tuple[float, int]:
        """The run's rank in its heap: its first block's (importance, last use), the lowest."""
        return float(self.importance[0]), int(self.ticks[0])

    def live(self, index: BlockIndex) -> tuple[SeqEntry | None, np.ndarray]:
        """The run's entry and, per block, whether it is resident with the run's rank still."""
        entry = index.get(self.uid)
        return entry, _live(entry, self.layers, self.heads, self.pages, self.importance, self.ticks)

    def keep(self, which: np.ndarray | slice) -> _Run:
        """The blocks ``which`` selects (a mask, or a slice: views), in the same order."""
        return _Run(self.uid, self.importance[which], self.ticks[which], self.layers[which], self.heads[which],
                    self.pages[which])

    def at_or_below(self, rank: tuple[float, int] | None) -> int:
        """How many of the first blocks rank at or below ``rank`` (all of them for None)."""
        if rank is None:
            return len(self.pages)
        imp, tick = rank
        return int(np.count_nonzero((self.importance < imp) | ((self.importance == imp) & (self.ticks <= tick))))


def _live(entry: SeqEntry | None, layers, heads, pages, importance, ticks) -> np.ndarray:
    """Per record (a block of ``entry`` with the importance and last use it was recorded
    with), whether the block is still resident with that rank."""
    if entry is None:
        return np.zeros(len(pages), dtype=bool)
    cols = entry.columns(pages)
    ok = (cols >= 0) & (cols < entry.capacity)
    whole = ok.all()  # as a rule: then no copies of the records (a compaction checks ~2x the resident blocks)
    if not whole:
        layers, heads, cols, importance, ticks = layers[ok], heads[ok], cols[ok], importance[ok], ticks[ok]
    # Flat indices: three-array indexing of the 3-D arrays cost several times as much.
    at = np.ravel_multi_index((layers, heads, cols), entry.dram_off.shape)
    live = ((entry.dram_off.reshape(-1)[at] >= 0) & (entry.last_use.reshape(-1)[at] == ticks)
            & (entry.importance.reshape(-1)[at] == importance))
    if whole:
        return live
    ok[ok] = live
    return ok


class _Heap:
    """The runs of one (owner, block size), lowest ``(importance, last use)`` on top.

    ``live`` holds the runs in the heap by the sequence number they were pushed with, in
    push order, so a compaction takes the oldest without a pass over them all
    (:meth:`take_oldest`); the entries of runs it took stay in the heap list until popped
    (skipped) or purged, when they outnumber the live ones. Entries hold no runs (see
    :class:`_Run`): purging 29K of them, half stale, took 14-19 ms with the index lock
    held while they did (freeing the runs), 2.5 ms since."""

    def __init__(self) -> None:
        self.items: list[tuple[float, int, int]] = []  # (importance, tick, seq) of each run pushed
        self.live: OrderedDict[int, tuple] = OrderedDict()  # seq -> the run, as a plain tuple (see _Run)
        self.records = 0  # blocks across the live runs, stale ones included
        self.resident = 0  # blocks of this owner and size in the tier

    def push(self, run: _Run, seq: int) -> None:
        heapq.heappush(self.items, (*run.rank, seq))
        self.live[seq] = tuple(run)
        self.records += len(run.pages)

    def pop(self) -> tuple[tuple[float, int], _Run] | None:
        """The lowest run and the rank it was pushed with (at most its lowest rank now);
        None when no run is left."""
        while self.items:
            imp, tick, seq = heapq.heappop(self.items)
            held = self.live.pop(seq, None)
            if held is not None:
                run = _Run._make(held)
                self.records -= len(run.pages)
                return (imp, tick), run
        return None

    def top(self) -> tuple[float, int] | None:
        """The rank of the lowest run left, None when none is."""
        while self.items and self.items[0][2] not in self.live:
            heapq.heappop(self.items)
        return self.items[0][:2] if self.items else None

    def take_oldest(self, records: int) -> list[_Run]:
        """The runs pushed longest ago, out of the heap, until they hold ``records`` blocks
        (the run that reaches it included) or none is left."""
        out, n = [], 0
        while self.live and n < records:
            out.append(run := _Run._make(self.live.popitem(last=False)[1]))
            n += len(run.pages)
        self.records -= n
        if len(self.items) > 2 * len(self.live) + COMPACT_SLACK:
            self.items = [item for item in self.items if item[2] in self.live]
            heapq.heapify(self.items)
        return out


class Residency:
    """The DRAM tier's keeper: what to admit, and whom a block displaces."""

    def __init__(self, dram: DramTier, index: BlockIndex, retire: Callable[[Callable[[], None]], None],
                 counters: Counter) -> None:
        self.dram = dram
        self.index = index
        self.shares = DramShares(dram.capacity)
        self._retire = retire
        self._counters = counters
        self._heaps: dict[tuple[int, int], _Heap] = {}
        self._seq = itertools.count()  # breaks ties between runs of one (importance, tick)

    # ------------------------------------------------------------ recording

    def touched(self, entry: SeqEntry, lay: np.ndarray, hed: np.ndarray, pag: np.ndarray,
                cols: np.ndarray | None = None) -> None:
        """Record blocks of ``entry`` whose last use or importance just changed (``cols``: the
        pages' columns, where the caller has them); blocks not resident are skipped (index
        lock held)."""
        cols = entry.columns(pag) if cols is None else cols
        res = entry.dram_off[lay, hed, cols] >= 0
        if res.all():
            self._record(entry, lay, hed, pag, cols)
        elif res.any():
            self._record(entry, lay[res], hed[res], pag[res], cols[res])

    def touched_resident(self, entry: SeqEntry, lay: np.ndarray, hed: np.ndarray, pag: np.ndarray,
                         cols: np.ndarray, tick: int) -> None:
        """:meth:`touched` of blocks the caller found resident, their last use just set to
        ``tick``: in rank order as they are where they share one importance, as an engine's
        blocks do; else ranked as any run is. A DRAM get of 128 engine blocks records them
        with 5 numpy calls instead of 17, which cost about 30 us a get after its copy had
        pushed them out of the caches (index lock held)."""
        if not len(lay):
            return
        imp = entry.importance[lay, hed, cols]
        blocks = (entry.uid, imp, np.full(len(imp), tick, np.int64), lay.astype(np.int32, copy=False),
                  hed.astype(np.int32, copy=False), pag.astype(np.int64, copy=False))
        self._push(entry, _Run.ranked(*blocks) if len(imp) > 1 and imp.min() != imp.max() else _Run(*blocks))

    def _record(self, entry: SeqEntry, lay, hed, pag, cols) -> None:
        if not len(lay):
            return
        self._push(entry, _Run.ranked(entry.uid, entry.importance[lay, hed, cols].astype(np.float32),
                                      entry.last_use[lay, hed, cols].astype(np.int64), lay.astype(np.int32),
                                      hed.astype(np.int32), pag.astype(np.int64)))

    def _push(self, entry: SeqEntry, run: _Run) -> None:
        heap = self._heap(entry)
        heap.push(run, next(self._seq))
        if heap.records > 2 * heap.resident + COMPACT_SLACK:
            self._compact(heap)

    def _heap(self, entry: SeqEntry) -> _Heap:
        key = (entry.owner, entry.geometry.block_bytes)
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = _Heap()
        return heap

    def _compact(self, heap: _Heap) -> None:
        """Drop the stale records of ``heap``'s oldest runs (:meth:`_Heap.take_oldest`) and merge
        each sequence's live ones into runs of COMPACT_RUN blocks in rank order, in one
        vectorised pass per sequence (see the module's notes: runs kept whole while any
        block of theirs lived fragmented)."""
        by_uid: dict[int, list[_Run]] = {}
        for run in heap.take_oldest(COMPACT_SLICE):
            by_uid.setdefault(run.uid, []).append(run)
        for uid, runs in by_uid.items():
            entry = self.index.get(uid)
            imp, ticks, lay, hed, pag = (np.concatenate([getattr(r, f) for r in runs]) for f in _RUN_FIELDS)
            ok = _live(entry, lay, hed, pag, imp, ticks)
            if not ok.any():
                continue
            imp, ticks, lay, hed, pag = imp[ok], ticks[ok], lay[ok], hed[ok], pag[ok]
            order = _one_each(np.ravel_multi_index((lay, hed, entry.columns(pag)), entry.dram_off.shape),
                              entry.dram_off.size)
            order = order[np.lexsort((ticks[order], imp[order]))]
            merged = _Run(uid, imp[order], ticks[order], lay[order], hed[order], pag[order])
            for start in range(0, len(order), COMPACT_RUN):
                heap.push(merged.keep(slice(start, start + COMPACT_RUN)), next(self._seq))
        self._counters["dram_rank_compactions"] += 1

    # ------------------------------------------------------------ admission

    def admit(self, entry, layers, heads, pages, importance, src, src_offs, replace: bool,
              expect_crc: np.ndarray | None = None) -> None:
        """Copy blocks into DRAM: into free slots, and with ``replace`` over residents that matter less.

        With ``expect_crc`` (the source is client memory) only copies that verify against
        it are kept. Without ``importance`` the index's is used. ``src`` is host memory or a
        client's buffer, which copies the blocks out itself (from device memory, for a CUDA
        IPC buffer).
        """
        bb = entry.geometry.block_bytes
        if not self.dram.capacity or (not replace and not self.dram.has_room(bb)):
            return  # a full tier takes blocks read from the SSD only into free slots
        with self.index.lock:
            if self.index.get(entry.uid) is not entry:
                return
            cols = entry.columns(pages)  # under the lock: a put may move the window
            if importance is None:
                importance = entry.importance[layers, heads, cols]
            sel = _new_residents(entry, layers, heads, cols, importance)
            if not len(sel):
                return
            slots = self.dram.allocate(bb, len(sel))
            if len(slots) < len(sel) and replace:
                if self._displace(entry.owner, bb, importance[sel[len(slots):]]):
                    slots = np.concatenate([slots, self.dram.allocate(bb, len(sel) - len(slots))])
            sel = sel[: len(slots)]
        if not len(sel):
            return
        # The copy runs outside the index lock (a put's may be 64 MiB, and gets wait for
        # that lock): the slots are this call's alone until they are published below, and
        # go back if the copy fails (a client's pool that shrank under it, say).
        try:
            if isinstance(src, MappedBuffer):
                src.read_blocks(src_offs[sel], self.dram.arena, slots, bb)
            else:
                gather_scatter(src, src_offs[sel], self.dram.arena, slots, bb)
        except BaseException:
            self.dram.release(bb, slots)
            raise
        good = np.ones(len(sel), dtype=bool)
        if expect_crc is not None:
            # A client's buffer may hold one block twice (overlapping destinations) or
            # change under the copy; checking the DRAM copy keeps it from poisoning the tier.
            tags = address_tags(entry.uid, layers[sel], heads[sel], pages[sel])
            good = (block_crcs(self.dram.arena, slots, bb) ^ tags) == expect_crc[sel]
            self._counters["dram_admit_refused"] += int((~good).sum())
        self._publish(entry, layers, heads, pages, sel, slots, good, expect_crc)

    def reserve(self, owner: int, bb: int, count: int) -> np.ndarray:
        """Slots for up to ``count`` new blocks of ``bb`` bytes of ``owner``, of the lowest
        importance (a put's engine blocks): free ones, then residents they displace (as
        :meth:`admit` with ``replace``). Not inside the gate: displaced slots are freed
        once no reader holds it."""
        if not self.dram.capacity or not count:
            return np.zeros(0, np.int64)
        with self.index.lock:
            slots = self.dram.allocate(bb, count)
            if len(slots) < count and self._displace(owner, bb, np.zeros(count - len(slots), np.float32)):
                slots = np.concatenate([slots, self.dram.allocate(bb, count - len(slots))])
        return slots

    def fill(self, src: np.ndarray, src_offs: np.ndarray, slots: np.ndarray, bb: int) -> np.ndarray:
        """Copy the blocks at ``src_offs[:len(slots)]`` into reserved ``slots``; the CRC-32Cs of
        those copies (any thread: the slots are the caller's alone)."""
        gather_scatter(src, src_offs[: len(slots)], self.dram.arena, slots, bb)
        return block_crcs(self.dram.arena, slots, bb)

    def publish_reserved(self, entry, layers, heads, pages, slots, expect_crc) -> None:
        """Map the blocks filled into reserved ``slots`` (the first ``len(slots)`` of the
        arrays), now that their put is published with the checksums ``expect_crc``."""
        k = len(slots)
        if k:
            self._publish(entry, layers[:k], heads[:k], pages[:k], np.arange(k), slots, np.ones(k, bool),
                          expect_crc[:k])

    def release_reserved(self, bb: int, slots: np.ndarray) -> None:
        """Give back reserved slots of a put that failed (no reader saw them)."""
        self.dram.release(bb, slots)

    def _publish(self, entry, layers, heads, pages, sel, slots, good, expect_crc) -> None:
        """Map the admitted copies that are still wanted; free the others' slots (no reader saw them)."""
        bb = entry.geometry.block_bytes
        with self.index.lock:
            if self.index.get(entry.uid) is not entry:  # deleted during the copy
                self.dram.release(bb, slots)
                return
            cols = entry.columns(pages)
            lay, hed, col = layers[sel], heads[sel], cols[sel]
            # Meanwhile another admission may have taken a block, or (engine blocks reuse
            # slots) it may have been deleted and its page given to another block, whose
            # checksum differs: such a copy is of bytes the index no longer names.
            good &= entry.dram_off[lay, hed, col] < 0
            if expect_crc is not None:
                good &= (entry.ssd_off[lay, hed, col] >= 0) & (entry.crc[lay, hed, col] == expect_crc[sel])
            if not good.all():
                self.dram.release(bb, slots[~good])
                sel, slots = sel[good], slots[good]
            entry.dram_off[layers[sel], heads[sel], cols[sel]] = slots
            entry.dram_blocks += len(sel)
            self.shares.add(entry.owner, len(sel) * bb)
            self._heap(entry).resident += len(sel)
            self._record(entry, layers[sel], heads[sel], pages[sel], cols[sel])
            self._counters["dram_admitted"] += len(sel)

    def _displace(self, owner: int, bb: int, cand_importance: np.ndarray) -> int:
        """Evict residents for candidates of ``owner`` (by descending importance) that found no
        free slot, within the owners' fair shares (see dram_shares.py)."""
        plan = self.shares.plan(owner, bb, len(cand_importance))
        evicted = sum(self._evict(other, bb, np.full(n, np.inf, np.float32)) for other, n in plan.from_others)
        return evicted + self._evict(owner, bb, cand_importance[len(cand_importance) - plan.own:])

    # ------------------------------------------------------------ eviction

    def _evict(self, owner: int, bb: int, cand_importance: np.ndarray) -> int:
        """Evict residents of ``owner`` of block size ``bb`` that rank below the candidates:
        the k-th lowest-ranked goes if the k-th candidate outranks it. A candidate ties a
        resident of equal importance and wins it, being newer."""
        heap = self._heaps.get((owner, bb))
        want = len(cand_importance)
        freed: list[np.ndarray] = []
        count = 0
        while heap is not None and count < want and (got := heap.pop()) is not None:
            popped, run = got
            entry, ok = run.live(self.index)
            if not ok.any():
                continue
            if not ok.all():
                run = run.keep(ok)
            if run.rank > popped:  # its lowest blocks went stale: it ranks higher now
                heap.push(run, next(self._seq))
                continue
            run, cols = _once(run, entry)
            # Its blocks that rank at or below every other run go, lowest first, while the
            # candidate of each one's place (descending) outranks it; the rest go back.
            n = min(run.at_or_below(heap.top()), want - count)
            wins = cand_importance[count: count + n] >= run.importance[:n]
            take = n if wins.all() else int(np.argmin(wins))
            if take < len(run.pages):
                heap.push(run.keep(slice(take, None)), next(self._seq))
            where = (run.layers[:take], run.heads[:take], cols[:take])
            freed.append(entry.dram_off[where].copy())
            entry.dram_off[where] = -1
            entry.dram_blocks -= take
            count += take
            if take < n:  # a candidate lost: every later one ranks lower, every later block higher
                break
        if not count:
            return 0
        slots = np.concatenate(freed)
        self._retire(lambda: self.dram.release(bb, slots))
        self.shares.drop(owner, count * bb)
        heap.resident -= count
        self._counters["dram_evicted"] += count
        return count

    def forget(self, entry: SeqEntry) -> np.ndarray:
        """Unmap a deleted sequence's DRAM blocks; returns their slots, to free once no get
        reads them. Its heap records go stale and leave at the next pop or compaction."""
        slots = entry.dram_off[entry.dram_off >= 0].copy()
        entry.dram_off[:] = -1
        entry.dram_blocks = 0
        if len(slots):
            self.shares.drop(entry.owner, len(slots) * entry.geometry.block_bytes)
            self._heap(entry).resident -= len(slots)
        return slots

    def forget_blocks(self, entry: SeqEntry, lay: np.ndarray, hed: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """:meth:`forget` for some blocks of ``entry`` (distinct; index lock held)."""
        where = (lay, hed, cols)
        slots = entry.dram_off[where]
        slots = slots[slots >= 0].copy()
        entry.dram_off[where] = -1
        entry.dram_blocks -= len(slots)
        if len(slots):
            self.shares.drop(entry.owner, len(slots) * entry.geometry.block_bytes)
            self._heap(entry).resident -= len(slots)
        return slots

    def resident_records(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Per (owner, block size): (resident blocks, heap records); for tests and stats."""
        return {key: (h.resident, h.records) for key, h in self._heaps.items()}


def _one_each(lin: np.ndarray, size: int) -> np.ndarray:
    """Positions of one record of each block (flat indices ``lin`` into arrays of ``size``):
    a block recorded twice is live with one rank only, so either record will do. Where the
    records cover much of the arrays, by a scatter (a sort cost 80 ms at 800K records)."""
    if size > 4 * len(lin):
        return np.unique(lin, return_index=True)[1]
    at = np.arange(len(lin))
    first = np.empty(size, np.int64)
    first[lin] = at
    return np.flatnonzero(first[lin] == at)


def _once(run: _Run, entry: SeqEntry) -> tuple[_Run, np.ndarray]:
    """``run`` with a block recorded twice in it once (in rank order still), and the blocks' columns."""
    cols = entry.columns(run.pages)
    one = _one_each(np.ravel_multi_index((run.layers, run.heads, cols), entry.dram_off.shape), entry.dram_off.size)
    if len(one) == len(cols):
        return run, cols
    one.sort()
    return run.keep(one), cols[one]


def _new_residents(entry: SeqEntry, layers, heads, cols, importance) -> np.ndarray:
    """Positions of the blocks not yet in DRAM, each block once, by descending importance."""
    absent = entry.dram_off[layers, heads, cols] < 0
    lin = np.ravel_multi_index((layers, heads, cols), entry.dram_off.shape)
    _, first = np.unique(lin, return_index=True)
    keep = np.zeros(len(lin), dtype=bool)
    keep[first] = True
    sel = np.flatnonzero(absent & keep)
    return sel[np.argsort(-importance[sel], kind="stable")]
