"""The DRAM tier's residency policy (kvstored/residency.py): the rank a full sort would give,
its records bounded by the resident blocks, and no scan of the stored sequences per eviction."""

from collections import Counter

import numpy as np
import pytest

from kvdrive.layout.geometry import Geometry
from kvstored import residency as residency_mod
from kvstored.dram import DramTier
from kvstored.index import BlockIndex, SeqEntry
from kvstored.residency import Residency

GEOM = Geometry(2, 2, 32, "float16", 16)
BB = GEOM.block_bytes
PAGES = 8


class Rig:
    """One owner's sequences over a DRAM tier of ``slots`` blocks, driven as puts and gets drive it."""

    def __init__(self, slots: int, seqs: int, pages: int = PAGES, resident_path: bool = False) -> None:
        self.resident_path = resident_path  # gets of resident blocks only record as a DRAM-only get does
        self.dram = DramTier(slots * BB)
        self.index = BlockIndex(1 << 34)
        self.counters = Counter()
        self.res = Residency(self.dram, self.index, lambda fn: fn(), self.counters)
        self.tick = 0
        self.src = np.random.default_rng(0).integers(0, 256, 64 * BB, dtype=np.uint8)
        self.entries = []
        for uid in range(1, seqs + 1):
            e = SeqEntry(uid, "ns", f"s{uid}", GEOM, 0.0, owner=1000)
            self.index.add(e)
            self.index.grow(e, self.index.plan_growth(e, np.array([0, pages - 1])))
            self.entries.append(e)

    def put(self, e: SeqEntry, lay, hed, pag, imp) -> None:
        """A committed put's publish (importance, last use) and its admission, replacing."""
        self.tick += 1
        e.importance[lay, hed, pag] = imp
        e.last_use[lay, hed, pag] = self.tick
        e.ssd_off[lay, hed, pag] = 0
        offs = (np.arange(len(lay)) % 64) * BB
        self.res.admit(e, lay, hed, pag, imp.astype(np.float32), self.src, offs, replace=True)

    def get(self, e: SeqEntry, lay, hed, pag) -> None:
        """A get's touch, then the admission of its misses into free slots only."""
        self.tick += 1
        miss = e.dram_off[lay, hed, pag] < 0
        with self.index.lock:
            e.last_use[lay, hed, pag] = self.tick
            if self.resident_path and not miss.any():
                self.res.touched_resident(e, lay, hed, pag, pag, self.tick)  # the window starts at page 0
            else:
                self.res.touched(e, lay, hed, pag)
        offs = (np.arange(int(miss.sum())) % 64) * BB
        self.res.admit(e, lay[miss], hed[miss], pag[miss], None, self.src, offs, replace=False)

    def residents(self) -> list[tuple[float, int]]:
        """(importance, last use) of every resident block, sorted."""
        keys = []
        for e in self.entries:
            at = np.nonzero(e.dram_off >= 0)
            keys += list(zip(e.importance[at].tolist(), e.last_use[at].tolist()))
        return sorted(keys)


def expected_after_put(before: list[tuple[float, int]], cand: np.ndarray, slots: int) -> tuple[list, int]:
    """What a full sort of the residents keeps when ``cand`` (importances, new blocks) arrive:
    free slots first, then candidate k (descending) displaces the k-th lowest resident while
    it ranks at least as high (a tie goes to the newer block)."""
    cand = sorted(cand.tolist(), reverse=True)
    free = slots - len(before)
    kept, placed, left = list(before), cand[:free], cand[free:]
    ranked = sorted(before)
    count = 0
    while count < min(len(left), len(ranked)) and left[count] >= ranked[count][0]:
        count += 1
    for victim in ranked[:count]:
        kept.remove(victim)
    return kept, len(placed) + count


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("levels", ["few", "every block its own"])
@pytest.mark.parametrize("compact", ["rarely", "often, into runs of 3", "often, the oldest 8 records at a time"])
@pytest.mark.parametrize("gets", ["touched", "touched_resident"])
def test_the_heap_keeps_what_a_full_sort_of_the_residents_would(seed, levels, compact, gets, monkeypatch):
    # One run per put or get holds blocks of many importances (a decode step's get, the
    # second case); eviction splits it lazily and must still rank as a full sort. Compacted,
    # a sequence's blocks of many puts and gets share runs, which interleave with others;
    # compacted a slice at a time, a block may keep a live record in a run left out too.
    if compact != "rarely":
        monkeypatch.setattr(residency_mod, "COMPACT_SLACK", 4)
        monkeypatch.setattr(residency_mod, "COMPACT_RUN", 3)
    if compact.endswith("at a time"):
        monkeypatch.setattr(residency_mod, "COMPACT_SLICE", 8)
    rng = np.random.default_rng(seed)
    slots = 24
    rig = Rig(slots, seqs=6, resident_path=gets == "touched_resident")
    unput = {e.uid: [(l, h, p) for l in range(2) for h in range(2) for p in range(PAGES)] for e in rig.entries}
    for _ in range(300):
        e = rig.entries[rng.integers(len(rig.entries))]
        todo = unput[e.uid]
        if todo and rng.random() < 0.5:
            n = min(len(todo), int(rng.integers(1, 7)))
            picked = [todo.pop(int(rng.integers(len(todo)))) for _ in range(n)]
            lay, hed, pag = (np.array(x) for x in zip(*picked))
            imp = rng.choice([0.0, 1.0, 2.0, 5.0], size=n) if levels == "few" else rng.random(n).astype(np.float32)
            before = rig.residents()
            want, _ = expected_after_put(before, imp, slots)
            rig.put(e, lay, hed, pag, imp)
            new = [(float(i), rig.tick) for i in imp]
            got = rig.residents()
            # The kept old residents are those a full sort keeps; the rest of the tier is new blocks.
            assert [k for k in got if k[1] != rig.tick] == sorted(want), "an eviction broke the rank"
            assert len(got) == min(slots, len(want) + len(new))
        else:
            stored = np.argwhere(e.ssd_off >= 0)
            if not len(stored):
                continue
            pick = stored[rng.integers(len(stored), size=int(rng.integers(1, 6)))]
            rig.get(e, pick[:, 0], pick[:, 1], pick[:, 2])
        assert rig.dram.num_blocks == len(rig.residents()) <= slots
    assert rig.counters["dram_evicted"] > 0
    assert (rig.counters["dram_rank_compactions"] > 0) == (compact != "rarely")


@pytest.mark.parametrize("slice_", [None, 8], ids=["whole heap", "the oldest 8 records at a time"])
def test_records_stay_within_twice_the_resident_blocks(slice_, monkeypatch):
    monkeypatch.setattr(residency_mod, "COMPACT_SLACK", 16)
    if slice_:
        monkeypatch.setattr(residency_mod, "COMPACT_SLICE", slice_)
    rig = Rig(slots=16, seqs=2)
    e = rig.entries[0]
    lay, hed, pag = (a.ravel() for a in np.meshgrid(range(2), range(2), range(4), indexing="ij"))
    rig.put(e, lay, hed, pag, np.zeros(len(lay)))
    for i in range(500):  # every get touches resident blocks again: each touch is a new record
        rig.get(e, lay[i % 16: i % 16 + 1], hed[i % 16: i % 16 + 1], pag[i % 16: i % 16 + 1])
        (resident, records), = rig.res.resident_records().values()
        assert resident == 16 and records <= 2 * resident + 16 + 1
    assert rig.counters["dram_rank_compactions"] > 0


def test_a_deleted_sequence_leaves_its_slots_and_its_records_go_stale():
    rig = Rig(slots=8, seqs=2)
    a, b = rig.entries
    lay, hed, pag = np.zeros(8, int), np.zeros(8, int), np.arange(8)
    rig.put(a, lay, hed, pag, np.zeros(8))  # a's records rank lowest
    with rig.index.lock:
        slots = rig.res.forget(a)
    rig.index.remove(a.uid)
    rig.dram.release(BB, slots)
    assert rig.res.shares.held(1000) == 0 and rig.dram.num_blocks == 0
    rig.put(b, lay, hed, pag, np.full(8, 0.5))  # takes the freed slots, evicts nothing
    assert rig.dram.num_blocks == 8 and rig.counters["dram_evicted"] == 0
    rig.put(b, np.ones(4, int), hed[:4], pag[:4], np.ones(4))  # the stale records of a are skipped
    assert rig.counters["dram_evicted"] == 4 and int((b.dram_off >= 0).sum()) == 8


def test_an_eviction_looks_at_the_victims_sequences_not_every_stored_one():
    """With the tier full and thousands of stored one-block sequences, the put that evicts one
    block looks up a handful of sequences (the popped runs'), not all of them."""
    rig = Rig(slots=16, seqs=3000, pages=1)
    one = np.zeros(1, int)
    for e in rig.entries:
        rig.put(e, one, one, one, np.zeros(1))
    assert rig.dram.num_blocks == 16 and rig.counters["dram_evicted"] == 3000 - 16
    looked = Counter()
    real_get = rig.index.get
    rig.index.get = lambda uid: looked.update([uid]) or real_get(uid)
    fresh = rig.entries[0]
    fresh.ssd_off[:] = -1
    with rig.index.lock:
        rig.res.forget(fresh)
    rig.put(fresh, np.ones(1, int), one, one, np.zeros(1))
    assert sum(looked.values()) <= 4, f"{sum(looked.values())} sequences looked up for one eviction"


def test_an_admission_whose_copy_fails_gives_its_slots_back():
    """A get's misses are admitted from the client's buffer after the get: where that copy
    fails (a client's pool that shrank under it), the slots it took go back."""
    from kvstored.buffers import MappedBuffer
    from kvstored.protocol import ErrorCode, ProtocolError

    class Shrunk(MappedBuffer):
        def read_blocks(self, src_offs, dst, dst_offs, nbytes):
            raise ProtocolError(ErrorCode.BUFFER, "the client shrank its file")

    rig = Rig(slots=8, seqs=1)
    e = rig.entries[0]
    lay, hed, pag = np.zeros(4, int), np.zeros(4, int), np.arange(4)
    src = Shrunk(1, 4 * BB, np.zeros(4 * BB, np.uint8), None)
    for _ in range(3):
        with pytest.raises(ProtocolError):
            rig.res.admit(e, lay, hed, pag, None, src, np.arange(4) * BB, replace=False)
    assert rig.dram.num_blocks == 0 and int((e.dram_off >= 0).sum()) == 0


def _pushed(heap, rng, seq: int, tick: int):
    n = int(rng.integers(1, 9))
    run = residency_mod._Run.ranked(1, rng.random(n).astype(np.float32), np.full(n, tick, np.int64),
                                    *(np.zeros(n, np.int64),) * 2, np.arange(n))
    heap.push(run, seq)
    return run


@pytest.mark.parametrize("slack", [4096, 0], ids=["stale entries kept", "stale entries purged"])
def test_a_compaction_takes_the_oldest_runs_up_to_its_slice_and_the_rest_pop_in_rank_order(slack, monkeypatch):
    monkeypatch.setattr(residency_mod, "COMPACT_SLACK", slack)
    rng = np.random.default_rng(7)
    heap = residency_mod._Heap()
    runs = {seq: _pushed(heap, rng, seq, seq) for seq in range(40)}
    records = heap.records
    taken = heap.take_oldest(130)  # most of them: the stale entries then outnumber the live ones
    seqs = [int(run.ticks[0]) for run in taken]  # a run's ticks are its seq here
    assert seqs == list(range(len(taken))), "not the oldest pushed, in order"
    sizes = [len(run.pages) for run in taken]
    assert sum(sizes) >= 130 > sum(sizes) - sizes[-1]
    assert heap.records == records - sum(sizes) == sum(len(residency_mod._Run._make(t).pages) for t in heap.live.values())
    assert (len(heap.items) == 40 - len(taken)) == (slack == 0)
    assert all(isinstance(x, (int, float)) for item in heap.items for x in item), "an entry holds more than numbers"
    runs = {s: r for s, r in runs.items() if s in heap.live}
    for seq in range(40, 50):
        runs[seq] = _pushed(heap, rng, seq, seq)
    popped = []
    while (got := heap.pop()) is not None:
        popped.append(got)
    assert [r for r, _ in popped] == sorted(r.rank for r in runs.values()), "not in rank order"
    assert heap.records == 0 and not heap.live and heap.top() is None


def test_runs_taken_popped_and_purged_in_turn_each_pop_once_in_rank_order(monkeypatch):
    """Compactions (each purging the heap list of what they took), pops and pushes in turn:
    every run left pops once, in rank order."""
    monkeypatch.setattr(residency_mod, "COMPACT_SLACK", 0)
    rng = np.random.default_rng(11)
    heap = residency_mod._Heap()
    runs = {seq: _pushed(heap, rng, seq, seq) for seq in range(200)}
    seq = 200
    for step in range(60):
        for run in heap.take_oldest(int(rng.integers(1, 20))):
            del runs[int(run.ticks[0])]  # a run's ticks are its seq here
        if step % 3 == 0 and (got := heap.pop()) is not None:
            del runs[int(got[1].ticks[0])]
        for _ in range(int(rng.integers(1, 6))):
            runs[seq] = _pushed(heap, rng, seq, seq)
            seq += 1
    assert set(heap.live) == set(runs)
    assert len(heap.items) <= 2 * len(heap.live) + 6  # purged at the last compaction, pushes and a pop since
    popped = []
    while (got := heap.pop()) is not None:
        popped.append(got[1])
    assert sorted(int(r.ticks[0]) for r in popped) == sorted(runs), "a run lost or popped twice"
    assert [r.rank for r in popped] == sorted(r.rank for r in runs.values())


@pytest.mark.parametrize("size", [40, 4000], ids=["by a scatter", "by a sort"])
def test_a_compaction_keeps_one_record_of_each_block(size):
    lin = np.random.default_rng(size).integers(0, 40, 60)
    one = residency_mod._one_each(lin, size)
    assert sorted(lin[one].tolist()) == sorted(set(lin.tolist()))
