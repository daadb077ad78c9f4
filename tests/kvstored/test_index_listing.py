"""A listing pages through an owner's sequences (of one namespace, or all of them) in uid
order from a search of sorted uids, not a pass over every sequence for each page, and the
blocks and bytes stored are counted as they come and go: checked here against such
passes, with sequences of several owners and namespaces added and removed in between."""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive.layout import sorted_list
from kvdrive.layout.geometry import Geometry
from kvstored.index import BlockIndex, SeqEntry

GEOM = Geometry(1, 1, 8, "float16", 16)


def brute(entries: dict[int, SeqEntry], owner: int, ns: str | None, after: int, n: int, keep) -> list[SeqEntry]:
    mine = sorted((e for e in entries.values() if e.owner == owner and (ns is None or e.ns == ns) and e.uid > after
                   and keep(e)), key=lambda e: e.uid)
    return mine[:n]


@pytest.mark.parametrize("load", [2, 512], ids=["sublists of 2", "sublists of 512"])
@pytest.mark.parametrize("seed", range(3))
def test_a_page_is_the_next_uids_of_the_owner_and_namespace(seed, load, monkeypatch):
    monkeypatch.setattr(sorted_list, "LOAD", load)
    rng = np.random.default_rng(seed)
    index = BlockIndex(1 << 40)
    entries: dict[int, SeqEntry] = {}
    keep = lambda e: not e.name.startswith("hidden")  # noqa: E731 - as a block namespace's entry is
    for step in range(600):
        if entries and rng.random() < 0.3:
            uid = int(rng.choice(list(entries)))
            assert index.remove(uid) is entries.pop(uid)
        else:
            uid = int(rng.integers(1, 1 << 62))
            owner, ns = int(rng.integers(0, 3)), f"ns{int(rng.integers(0, 3))}"
            name = f"hidden{uid}" if rng.random() < 0.1 else f"s{uid}"
            entry = entries[uid] = SeqEntry(uid, ns, name, GEOM, 0.0, owner=owner)
            entry.num_blocks = int(rng.integers(0, 3))  # held before it is added, as at start-up
            index.add(entry)
        if entries:  # blocks stored and deleted: the counts the metrics and stats read
            index.add_blocks(entries[int(rng.choice(list(entries)))], int(rng.integers(0, 5)))
            entry = entries[int(rng.choice(list(entries)))]
            index.add_blocks(entry, -int(rng.integers(0, entry.num_blocks + 1)))
        if step % 20:
            continue
        assert index.stored_blocks == sum(e.num_blocks for e in entries.values())
        for owner in range(4):  # owner 3 has none
            mine = {e.uid for e in entries.values() if e.owner == owner}
            assert {e.uid for e in index.listed(owner, None, 0, len(entries) + 1, lambda e: True)} == mine
            assert index.count(owner) == len(mine)
            assert index.stored_bytes(owner) == sum(e.bytes for e in entries.values() if e.owner == owner)
            for ns in (None, "ns0", "ns1", "ns2", "ns9"):
                n = int(rng.integers(1, 6))
                after = 0
                while True:  # page through all of them, as a client does
                    page = index.listed(owner, ns, after, n, keep)
                    assert page == brute(entries, owner, ns, after, n, keep)
                    if len(page) < n:
                        break
                    after = page[-1].uid
                mid = int(rng.integers(0, 1 << 62))
                assert index.listed(owner, ns, mid, n, keep) == brute(entries, owner, ns, mid, n, keep)
    for uid in list(entries):
        index.remove(uid)
    assert not index._uids and index.listed(0, None, 0, 5, keep) == []
    assert index.stored_blocks == 0 and not index._owner_stored


def test_a_namespaces_least_recently_used_come_first_and_a_quota_takes_them_in_that_order():
    """The index keeps each namespace's used sequences in the order of their last use (and
    those holding blocks at start-up first, by uid), so a quota picks its victims by reading
    from the front: the least recently used that hold blocks and are not being written."""
    from kvstored.quota import pick_victims

    index = BlockIndex(1 << 40)
    loaded = [SeqEntry(uid, "q", f"s{uid}", GEOM, 0.0, owner=1) for uid in (50, 10, 30, 40)]
    for e in loaded:
        index.add(e)
    loaded[0].num_blocks = loaded[1].num_blocks = loaded[2].num_blocks = 2  # uid 40 holds none
    index.add(SeqEntry(70, "other", "x", GEOM, 0.0, owner=1))
    index.rank_loaded()
    assert [e.uid for e in index.least_recent(1, "q")] == [10, 30, 50]
    new = SeqEntry(20, "q", "s20", GEOM, 0.0, owner=1)
    index.add(new)
    assert [e.uid for e in index.least_recent(1, "q")] == [10, 30, 50], "a sequence counts from its first use"
    new.num_blocks = 2
    for uid, tick in ((20, 5), (10, 6), (40, 7), (20, 8)):
        index.used(index.get(uid), tick)
    assert [e.uid for e in index.least_recent(1, "q")] == [30, 50, 10, 40, 20]
    assert index.get(20).last_tick == 8 and index.get(30).last_tick == 0
    index.used(index.get(10), 3)  # a use that ended after a later one: its last tick stays
    assert index.get(10).last_tick == 6 and [e.uid for e in index.least_recent(1, "q")][-1] == 10
    bb = loaded[0].bytes
    assert bb > 0
    assert [e.uid for e in pick_victims(index.least_recent(1, "q"), 2 * bb, keep=set())] == [30, 50]
    assert [e.uid for e in pick_victims(index.least_recent(1, "q"), 2 * bb + 1, keep={50})] == [30, 20, 10]
    assert [e.uid for e in pick_victims(index.least_recent(1, "q"), 1 << 40, keep=set())] == [30, 50, 20, 10]
    index.remove(30)
    index.remove(50)
    assert [e.uid for e in index.least_recent(1, "q")] == [40, 20, 10]
    for uid in (40, 20, 10, 70):
        index.remove(uid)
    assert not index._lru and list(index.least_recent(1, "q")) == []


def test_entries_added_at_once_list_as_those_added_one_by_one():
    """Start-up adds every stored sequence in one call (the sorted uids built whole); later
    adds go into those lists."""
    rng = np.random.default_rng(5)
    entries = {}
    for i in range(300):
        uid = int(rng.integers(1, 1 << 62))
        entries[uid] = SeqEntry(uid, f"ns{i % 4}", f"s{uid}", GEOM, 0.0, owner=i % 2)
    at_once, one_by_one = BlockIndex(1 << 40), BlockIndex(1 << 40)
    first = list(entries.values())[:200]
    at_once.add_many(first)
    for e in first:
        one_by_one.add(e)
    for e in list(entries.values())[200:]:
        at_once.add(e)
        one_by_one.add(e)
    keep = lambda e: True  # noqa: E731
    for owner in (0, 1):
        assert at_once.count(owner) == one_by_one.count(owner) == sum(e.owner == owner for e in entries.values())
        for ns in (None, "ns0", "ns1", "ns2", "ns3"):
            want = brute(entries, owner, ns, 0, 1000, keep)
            assert at_once.listed(owner, ns, 0, 1000, keep) == one_by_one.listed(owner, ns, 0, 1000, keep) == want
