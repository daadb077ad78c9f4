"""A small block get all in DRAM: the check's lookup is handed to the get, and used only
while no key of the namespace was stored or deleted in between."""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive_client.shm import SharedBuffer
from kvstored.blocks import Blocks
from kvstored.config import DaemonConfig
from kvstored.protocol import BlockDelete, BlockGet, BlockPut
from kvstored.sessions import SessionLimits, SessionTable
from kvstored.store import Store

BB = 64 << 10
N = 8
INLINE = 8 << 20


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(8, "little")


@pytest.fixture
def rig(tmp_path):
    store = Store(DaemonConfig(ssd_dir=tmp_path / "ssd", dram_bytes=64 << 20, ssd_max_bytes=1 << 30))
    session = SessionTable(SessionLimits(), 1 << 40, store.gate.retire).open(1, 1000, 1000)
    src, dst = SharedBuffer(N * BB), SharedBuffer(N * BB)
    src_id = session.buffers.register_fd(src.fd, src.size).buf_id
    dst_id = session.buffers.register_fd(dst.fd, dst.size).buf_id
    src.array[:] = np.random.default_rng(0).integers(0, 256, N * BB, dtype=np.uint8)
    yield store, session, src, dst, src_id, dst_id
    store.close()
    src.close()
    dst.close()


def put(store, session, buf: int, ids) -> None:
    p = store.blocks.prepare_put(BlockPut("eng", BB, tuple(key(i) for i in ids), buf, 0), session)
    assert not store.commit_puts([p])


def request(dst_id: int) -> BlockGet:
    return BlockGet("eng", tuple(key(i) for i in range(N)), dst_id, 0)


def test_the_get_starts_from_the_checks_lookup(rig, monkeypatch):
    store, session, src, dst, src_id, dst_id = rig
    put(store, session, src_id, range(N))
    put(store, session, src_id, [N])  # another key, so that the get's touch shows in the order
    picked = store.blocks.in_dram(request(dst_id), session, INLINE)
    assert picked is not None
    monkeypatch.setattr(Blocks, "_pick", lambda *a: pytest.fail("looked the keys up again"))
    r = store.blocks.get(request(dst_id), session, picked)
    assert r == {"found": [True] * N, "damaged": []}
    assert (dst.array == src.array).all()
    assert [k for k, _ in store.blocks.tables[(session.uid, "eng")].held.items()][-N:] == [key(i) for i in range(N)]
    assert store.counters["block_gets"] == 1 and store.counters["blocks_dram"] == N


def test_a_key_deleted_after_the_check_is_a_miss(rig):
    store, session, src, dst, src_id, dst_id = rig
    put(store, session, src_id, range(N))
    picked = store.blocks.in_dram(request(dst_id), session, INLINE)
    store.blocks.delete(BlockDelete("eng", (key(2),), False), session.uid)
    r = store.blocks.get(request(dst_id), session, picked)
    assert r["found"] == [True, True, False] + [True] * (N - 3)


def test_a_key_stored_after_the_check_is_found(rig):
    store, session, src, dst, src_id, dst_id = rig
    put(store, session, src_id, range(N - 1))
    picked = store.blocks.in_dram(request(dst_id), session, INLINE)
    assert picked.picks.pos.tolist() == list(range(N - 1))
    put(store, session, src_id, range(N))
    r = store.blocks.get(request(dst_id), session, picked)
    assert r["found"] == [True] * N and (dst.array == src.array).all()


def test_a_key_stored_again_in_its_old_slot_is_found_with_its_new_bytes(rig):
    store, session, src, dst, src_id, dst_id = rig
    put(store, session, src_id, range(N))
    picked = store.blocks.in_dram(request(dst_id), session, INLINE)
    store.blocks.delete(BlockDelete("eng", (key(2),), False), session.uid)
    src.array[2 * BB: 3 * BB] ^= 0xFF
    put(store, session, src_id, [*range(N)])  # key 2 again, in the slot it left
    r = store.blocks.get(request(dst_id), session, picked)
    assert r["found"] == [True] * N and (dst.array == src.array).all()


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
