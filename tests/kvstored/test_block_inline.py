"""A small block get all in DRAM, served on the main thread: one lookup under the index
lock, then the copy; anything else is left, untouched, to the get path."""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive_client.shm import SharedBuffer
from kvstored.blocks import Blocks
from kvstored.buffers import MappedBuffer
from kvstored.config import DaemonConfig
from kvstored.protocol import BlockDelete, BlockGet, BlockPut
from kvstored.sessions import SessionLimits, SessionTable
from kvstored.store import Store

BB = 64 << 10
N = 8
INLINE = 8 << 20


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(8, "little")


def opened(tmp_path, dram_bytes: int = 64 << 20):
    store = Store(DaemonConfig(ssd_dir=tmp_path / "ssd", dram_bytes=dram_bytes, ssd_max_bytes=1 << 30))
    session = SessionTable(SessionLimits(), 1 << 40, store.gate.retire).open(1, 1000, 1000)
    src, dst = SharedBuffer(N * BB), SharedBuffer(N * BB)
    src_id = session.buffers.register_fd(src.fd, src.size).buf_id
    dst_id = session.buffers.register_fd(dst.fd, dst.size).buf_id
    src.array[:] = np.random.default_rng(0).integers(0, 256, N * BB, dtype=np.uint8)
    return store, session, src, dst, src_id, dst_id


@pytest.fixture
def rig(tmp_path):
    store, session, src, dst, src_id, dst_id = opened(tmp_path)
    yield store, session, src, dst, src_id, dst_id
    store.close()
    src.close()
    dst.close()


def put(store, session, buf: int, ids) -> None:
    p = store.blocks.prepare_put(BlockPut("eng", BB, tuple(key(i) for i in ids), buf, 0), session)
    assert not store.commit_puts([p])


def request(dst_id: int) -> BlockGet:
    return BlockGet("eng", tuple(key(i) for i in range(N)), dst_id, 0)


def lru(store, session) -> list[bytes]:
    return [k for k, _ in store.blocks.tables[(session.uid, "eng")].held.items()]


def test_a_get_all_in_dram_is_served_with_one_lookup(rig, monkeypatch):
    store, session, src, dst, src_id, dst_id = rig
    put(store, session, src_id, range(N))
    put(store, session, src_id, [N])  # another key, so that the get's touch shows in the order
    picks = []
    pick = Blocks._pick
    monkeypatch.setattr(Blocks, "_pick", staticmethod(lambda *a: picks.append(1) or pick(*a)))
    gets_before = store.counters["gets"]
    r = store.blocks.get_in_dram(request(dst_id), session, INLINE)
    assert r == {"found": [True] * N, "damaged": []} and len(picks) == 1
    assert (dst.array == src.array).all()
    assert lru(store, session)[-N:] == [key(i) for i in range(N)]
    assert store.counters["block_gets"] == 1 and store.counters["blocks_dram"] == N
    assert store.counters["gets"] == gets_before + 1


def test_keys_not_stored_are_misses_and_the_rest_are_copied(rig):
    store, session, src, dst, src_id, dst_id = rig
    stored = [0, 2, 3, 5, 6, 7]
    put(store, session, src_id, stored)  # key stored[j] holds source block j
    r = store.blocks.get_in_dram(request(dst_id), session, INLINE)
    assert r["found"] == [True, False, True, True, False, True, True, True]
    got, want = dst.array.reshape(N, BB), src.array.reshape(N, BB)
    assert all((got[i] == want[j]).all() for j, i in enumerate(stored)) and not got[[1, 4]].any()


def test_a_key_deleted_during_the_copy_is_a_miss(rig, monkeypatch):
    store, session, src, dst, src_id, dst_id = rig
    put(store, session, src_id, range(N))
    write = MappedBuffer.write_blocks

    def delete_then_write(self, *a):
        store.blocks.delete(BlockDelete("eng", (key(2),), False), session.uid)  # its DRAM copy waits for this get
        write(self, *a)

    monkeypatch.setattr(MappedBuffer, "write_blocks", delete_then_write)
    r = store.blocks.get_in_dram(request(dst_id), session, INLINE)
    assert r["found"] == [True, True, False] + [True] * (N - 3)
    got, want = dst.array.reshape(N, BB), src.array.reshape(N, BB)
    assert (got[2] == want[2]).all()  # copied from a slot not yet freed: its bytes, though reported missing


@pytest.mark.parametrize("why", ["too large", "not in dram", "buffer unknown", "no namespace"])
def test_a_get_not_served_here_copies_and_records_nothing(tmp_path, why):
    store, session, src, dst, src_id, dst_id = opened(tmp_path, dram_bytes=(N // 2) * BB if why == "not in dram"
                                                      else 64 << 20)
    try:
        if why != "no namespace":
            put(store, session, src_id, range(N))
            order = lru(store, session)
        counters = dict(store.counters)
        req = request(dst_id) if why != "buffer unknown" else BlockGet("eng", request(dst_id).keys, 999, 0)
        limit = BB * (N - 1) if why == "too large" else INLINE
        assert store.blocks.get_in_dram(req, session, limit) is None
        assert not dst.array.any() and dict(store.counters) == counters
        if why != "no namespace":
            assert lru(store, session) == order
        if why == "not in dram":  # the get path serves it, from both tiers
            r = store.blocks.get(request(dst_id), session)
            assert r["found"] == [True] * N and (dst.array == src.array).all()
    finally:
        store.close()
        src.close()
        dst.close()


def test_a_table_kept_in_arrays_grows_reloads_and_reuses_freed_slots_lowest_first(tmp_path):
    """A block table keeps its blocks in arrays by slot: filled past their first capacity,
    emptied by deletes, and rebuilt from the catalog at a restart with the same keys, slots
    and extents, its LRU order as the blocks were written, the freed slots handed out
    again lowest first."""
    cfg = DaemonConfig(ssd_dir=tmp_path / "ssd", dram_bytes=64 << 20, ssd_max_bytes=1 << 30)
    bb, n = 4096, 300
    src = SharedBuffer(n * bb)
    src.array[:] = np.random.default_rng(1).integers(0, 256, n * bb, dtype=np.uint8)

    def opened():
        store = Store(cfg)
        session = SessionTable(SessionLimits(), 1 << 40, store.gate.retire).open(1, 1000, 1000)
        return store, session, session.buffers.register_fd(src.fd, src.size).buf_id

    store, session, buf = opened()
    keys = tuple(key(i) for i in range(n))
    assert not store.commit_puts([store.blocks.prepare_put(BlockPut("eng", bb, keys, buf, 0), session)])
    store.blocks.delete(BlockDelete("eng", (key(3), key(70), key(4)), False), session.uid)
    before = store.blocks.tables[(session.uid, "eng")]
    kept = {k: (s, before.extent_ids[s].tolist()) for k, s in before.held.items()}
    store.close()

    store, session, buf = opened()
    table = store.blocks.tables[(session.uid, "eng")]
    assert {k: (s, table.extent_ids[s].tolist()) for k, s in table.held.items()} == kept
    # Least recently used first, as written (the keys' own order differs: little-endian numbers).
    assert [k for k, _ in table.held.items()] == [k for k in keys if k in kept] != sorted(kept)
    assert all(table.held.key(s) == k for k, s in table.held.items()) and len(kept) == n - 3
    assert (table.held.find(list(kept)) == [s for s, _ in kept.values()]).all()
    offs = table.entry.ssd_off[0, 0, table.entry.columns(np.array(sorted(s for s, _ in kept.values())))]
    assert sorted(o for o, _ in table.entry.extents) == sorted(offs.tolist()) and len(table.entry.extents) == n - 3
    assert table.take(4).tolist() == [3, 4, 70, n]
    dst = SharedBuffer(n * bb)
    dst_id = session.buffers.register_fd(dst.fd, dst.size).buf_id
    r = store.blocks.get(BlockGet("eng", keys, dst_id, 0), session)
    assert r["found"] == [i not in (3, 4, 70) for i in range(n)]
    got, want = dst.array.reshape(n, bb), src.array.reshape(n, bb)
    assert all((got[i] == want[i]).all() for i in range(n) if i not in (3, 4, 70))
    store.close()
    src.close()
    dst.close()
