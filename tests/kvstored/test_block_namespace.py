"""Engine blocks through a real kvstored: named, write-once, batched, durable, one at a time deletable."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvdrive.layout.format import DATA_FILE, META_DIR
from kvdrive_client import NotFoundError, StoreClient
from kvstored.block_catalog import BlockRecord
from kvstored.catalog import Catalog
from tenants import as_other_user, needs_root, settled, shared_dir

BB = 64 << 10  # one part


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(8, "little")


def block(i: int, bb: int = BB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, bb, dtype=np.uint8)


def put(c: StoreClient, ns: str, ids, bb: int = BB) -> dict:
    ids = list(ids)
    buf = c._staging_buffer(len(ids) * bb)
    for j, i in enumerate(ids):
        buf.array[j * bb: (j + 1) * bb] = block(i, bb)
    return c.block_put_async(ns, bb, [key(i) for i in ids], buf).wait()


def get(c: StoreClient, ns: str, ids, bb: int = BB) -> tuple[list[bool], np.ndarray, dict]:
    ids = list(ids)
    buf = c._staging_buffer(len(ids) * bb)
    buf.array[: len(ids) * bb] = 0
    r = c.block_get_async(ns, [key(i) for i in ids], buf).wait()
    return r["found"], buf.array[: len(ids) * bb].reshape(len(ids), bb).copy(), r


def check(c: StoreClient, ns: str, ids, present, bb: int = BB) -> None:
    found, data, _ = get(c, ns, ids, bb)
    assert found == [i in present for i in ids]
    for j, i in enumerate(ids):
        if i in present:
            assert (data[j] == block(i, bb)).all(), f"block {i} came back with other bytes"


def test_blocks_round_trip_write_once_and_come_from_dram(daemon):
    c = daemon.client()
    assert c.hello()["block_ops"]
    assert c.block_lookup("eng", [key(0)]) == [False]
    r = put(c, "eng", range(8))
    assert (r["stored"], r["present"]) == (8, 0)
    r = put(c, "eng", [3, 8, 8, 9])  # 3 is stored; 8 given twice is stored once
    assert (r["stored"], r["present"]) == (2, 2)
    assert c.block_lookup("eng", [key(i) for i in (0, 7, 8, 9, 10)]) == [True, True, True, True, False]
    check(c, "eng", [9, 10, 0, 5, 5], present=set(range(10)))
    stats = c.stats()
    assert stats["blocks"] == 10 and stats["block_namespaces"] == 1
    assert stats["counters"]["blocks_dram"] == 4 and stats["counters"].get("blocks_ssd", 0) == 0  # from the put
    # A namespace is not a sequence: list shows none, and a put of another size is refused.
    assert c.list("eng") == []
    with pytest.raises(Exception, match="holds blocks of 65536 bytes"):
        put(c, "eng", [11], bb=2 * BB)
    assert daemon.stop() == 0
    shown = subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", str(daemon.ssd), "--json"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["engine_blocks"] == {"namespaces": 1, "blocks": 10}


def test_racing_writers_both_succeed_and_store_once(daemon):
    a, b = daemon.client(), daemon.client()
    bufs = []
    for c in (a, b):
        buf = c._staging_buffer(16 * BB)
        for j in range(16):
            buf.array[j * BB: (j + 1) * BB] = block(j)
        bufs.append(buf)
    pending = [c.block_put_async("race", BB, [key(j) for j in range(16)], buf) for c, buf in zip((a, b), bufs)]
    replies = [p.wait() for p in pending]
    assert sum(r["stored"] for r in replies) == 16 and all(r["stored"] + r["present"] == 16 for r in replies)
    assert a.stats()["blocks"] == 16
    check(b, "race", range(16), present=set(range(16)))
    assert daemon.stop() == 0


def test_blocks_survive_a_restart_and_one_deleted_block_frees_its_space(daemon_factory):
    d = daemon_factory(dram="0").start()  # every get reads the SSD
    c = d.client()
    put(c, "eng", range(12))
    used = c.stats()["ssd_used_bytes"]
    r = c.block_delete("eng", [key(2), key(5), key(99)])
    assert (r["deleted"], r["freed_bytes"]) == (2, 2 * BB)
    assert c.block_delete("eng", [key(2)])["deleted"] == 0
    freed = used - settled(lambda: c.stats()["ssd_used_bytes"], d, step=0.2)
    assert freed == 2 * BB
    put(c, "eng", [20, 21])  # they take the freed slots
    assert d.stop() == 0
    d.start()
    c = d.client()
    present = set(range(12)) - {2, 5} | {20, 21}
    check(c, "eng", list(range(12)) + [20, 21], present)
    assert c.stats()["blocks"] == len(present)
    r = c.block_delete("eng")
    assert (r["deleted"], r["freed_bytes"]) == (len(present), len(present) * BB)
    assert c.block_lookup("eng", [key(0)]) == [False]
    with pytest.raises(NotFoundError):
        c.block_delete("eng")
    assert d.stop() == 0
    cat = Catalog(d.ssd / META_DIR, 1 << 30, durable=True, readonly=True)
    try:
        contents = cat.load()
        assert not contents.blocks and not contents.extents and not contents.sequences
    finally:
        cat.close()


@pytest.mark.parametrize("dram", ["64M", "0"])
def test_a_small_block_get_from_dram_is_served_without_a_worker(daemon_factory, dram):
    """A block get of at most a few MiB whose blocks all sit in DRAM is copied on the thread
    that read it (two thread hand-offs fewer); a larger one, or one that reads the SSD, runs
    on a get worker; one that finds nothing is answered at once. Byte-exact, misses included."""
    d = daemon_factory(dram=dram).start()
    c = d.client()
    put(c, "inl", range(8))

    def inline_after(ids) -> int:
        before = c.stats()["counters"].get("gets_inline", 0)
        check(c, "inl", ids, present=set(range(8)))
        return c.stats()["counters"].get("gets_inline", 0) - before

    assert inline_after([5, 1, 99, 5]) == (dram != "0")
    assert inline_after([99]) == 1  # nothing found: answered here, with nothing to copy or read
    assert inline_after([*range(8)] * 17) == 0  # 136 blocks of 64 KiB: 8.5 MiB, past the inline bound
    assert d.stop() == 0


def test_large_blocks_are_stored_in_parts(daemon_factory):
    d = daemon_factory(dram="0").start()  # parts read back from the SSD
    c = d.client()
    bb = 80 << 20  # Llama-3-70B's 256-token block: two parts of 40 MiB
    put(c, "big", [1], bb)
    check(c, "big", [3, 1], {1}, bb)
    assert d.stop() == 0


def test_a_namespace_over_its_quota_loses_its_least_recently_used_blocks(daemon_factory):
    d = daemon_factory(extra=["--quota", "eng/*=1M"]).start()  # 16 blocks of 64 KiB
    c = d.client()
    put(c, "eng/q", range(12))
    get(c, "eng/q", [0, 1])  # used again: the least recently used are now 2, 3, ...
    put(c, "eng/q", range(12, 20))  # 20 blocks: 4 must go, none of this put's
    present = {i for i, f in zip(range(20), c.block_lookup("eng/q", [key(i) for i in range(20)])) if f}
    assert present == set(range(20)) - {2, 3, 4, 5}
    assert c.stats()["counters"]["blocks_quota_evicted"] == 4
    check(c, "eng/q", range(20), present)
    assert d.stop() == 0


def damage_block(d, k: bytes) -> None:
    """Overwrite 8 bytes of the stored block of key ``k`` on stopped daemon ``d``'s SSD."""
    cat = Catalog(d.ssd / META_DIR, 1 << 30, durable=True, readonly=True)
    try:
        contents = cat.read()  # records (load gives a sound catalog's blocks as columns)
        assert not contents.problems
        rec = next(b for b in contents.blocks if b.key == k)
        assert isinstance(rec, BlockRecord)
        off = next(e.offset for e in contents.extents if e.extent_id == rec.extent_ids[0])
    finally:
        cat.close()
    with open(d.ssd / DATA_FILE, "r+b") as f:
        f.seek(off + 100)
        f.write(b"\xff" * 8)


@pytest.mark.damages_store
def test_a_damaged_block_is_a_checksum_miss_not_other_bytes(daemon_factory):
    d = daemon_factory(dram="0").start()
    c = d.client()
    put(c, "eng", range(4))
    assert d.stop() == 0
    damage_block(d, key(2))
    d.start()
    c = d.client()
    found, data, r = get(c, "eng", range(4))
    assert found == [True, True, False, True] and r["damaged"] == [2]
    assert c.stats()["counters"]["checksum_errors"] >= 1
    assert d.stop() == 0


@pytest.fixture
def shared_root():
    yield from shared_dir()


def _other_users_view(address: str) -> dict:
    c = StoreClient(address, timeout=30)
    try:
        seen = c.block_lookup("eng", [key(0), key(1)])
        try:
            get(c, "eng", [0])
            got = "read"
        except NotFoundError:
            got = "not_found"
        put(c, "eng", [0])  # its own namespace of that name
        return {"seen": seen, "got": got, "own": c.block_lookup("eng", [key(0)])}
    finally:
        c.close()


@needs_root
def test_a_tenant_never_sees_another_users_blocks(shared_root, daemon_at):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    owner = d.client()
    put(owner, "eng", [0, 1])
    other = as_other_user(lambda: _other_users_view(d.address))
    assert other == {"seen": [False, False], "got": "not_found", "own": [True]}
    assert owner.stats()["blocks"] == 3 and owner.stats()["block_namespaces"] == 2
    check(owner, "eng", [0, 1], {0, 1})
    assert d.stop() == 0


def test_hostile_block_requests_get_error_replies_and_the_daemon_carries_on(daemon):
    from kvdrive.protocol import MAX_BLOCK_KEY_BYTES, MAX_BLOCK_KEYS, Op
    from kvdrive_client.errors import KVDriveError

    c = daemon.client()
    put(c, "eng", [0])
    buf = c._staging_buffer(4 * BB)
    bad = [
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": ["text, not bytes"]}, "bad_field"),
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": [b""]}, "bad_field"),
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": [b"x" * (MAX_BLOCK_KEY_BYTES + 1)]}, "bad_field"),
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": [b"k"] * (MAX_BLOCK_KEYS + 1)}, "bad_field"),
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": {"a": 1}}, "bad_field"),
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": [b"a", "b", b"c"]}, "bad_field"),  # one key text
        (Op.BLOCK_LOOKUP, {"ns": "eng", "keys": [b"a", 7]}, "bad_field"),
        # offsets: one a bool, a float, a string, negative, past 2^44
        *((Op.BLOCK_GET, {"ns": "eng", "keys": [b"a", b"b"], "buf": buf.buf_id, "offset": 0, "offsets": offs}, code)
          for offs, code in [([0, True], "bad_field"), ([0, 1.0], "bad_field"), ([0, "8"], "bad_field"),
                             ([BB, -BB], "out_of_range"), ([0, 1 << 45], "out_of_range")]),
        (Op.BLOCK_PUT, {"ns": "eng", "block_bytes": 6, "keys": [b"a"], "buf": buf.buf_id, "offset": 0}, "bad_field"),
        (Op.BLOCK_PUT, {"ns": "eng", "block_bytes": 4 << 30, "keys": [b"a"], "buf": buf.buf_id, "offset": 0},
         "out_of_range"),
        (Op.BLOCK_PUT, {"ns": "eng", "block_bytes": 2 * BB, "keys": [b"a"], "buf": buf.buf_id, "offset": 0},
         "bad_field"),  # another size than the namespace's
        (Op.BLOCK_PUT, {"ns": "eng", "block_bytes": BB, "keys": [b"a", b"b"], "buf": buf.buf_id,
                        "offset": buf.size - BB}, "buffer"),  # past the buffer
        (Op.BLOCK_PUT, {"ns": "eng", "block_bytes": BB, "keys": [b"a"], "buf": 12345, "offset": 0}, "buffer"),
        (Op.BLOCK_GET, {"ns": "nowhere", "keys": [b"a"], "buf": buf.buf_id, "offset": 0}, "not_found"),
        (Op.BLOCK_GET, {"ns": "eng", "keys": [b"a"] * 5, "buf": buf.buf_id, "offset": buf.size - 4 * BB},
         "buffer"),
        (Op.BLOCK_DELETE, {"ns": "nowhere", "all": True}, "not_found"),
        (Op.BLOCK_DELETE, {"ns": "eng", "keys": [b"a"], "all": True}, "bad_field"),
        (Op.BLOCK_DELETE, {"ns": "eng"}, "bad_field"),
        (Op.BLOCK_PUT, {"ns": "bad name", "block_bytes": BB, "keys": [b"a"], "buf": buf.buf_id, "offset": 0},
         "bad_field"),
    ]
    for op, fields, code in bad:
        with pytest.raises(KVDriveError) as info:
            c.call(op, fields)
        assert f"[{code}]" in str(info.value), (op, fields, str(info.value))
    # offsets as an array frame (int64), as the client sends them: the same checks
    get = {"ns": "eng", "keys": [b"a", b"b"], "buf": buf.buf_id, "offset": 0}
    framed = [
        (get, {"offsets": np.array([0, BB, 2 * BB], np.int64)}, "bad_field"),  # 3 for 2 keys
        (get, {"offsets": np.array([BB, -BB], np.int64)}, "out_of_range"),
        (get, {"offsets": np.array([0, 1 << 45], np.int64)}, "out_of_range"),
        (get, {"offsets": np.array([0, BB // 2], np.int64)}, "bad_field"),  # destinations that overlap
        (get, {"offsets": np.zeros(3, np.int8)}, "bad_message"),  # 3 bytes: not whole int64s
        ({**get, "offsets": [0, BB]}, {"offsets": np.array([0, BB], np.int64)}, "bad_field"),  # given twice
        (get, {"dst": np.array([0, BB], np.int64)}, "bad_field"),  # a frame no block request takes
    ]
    for fields, arrays, code in framed:
        with pytest.raises(KVDriveError) as info:
            c.call(Op.BLOCK_GET, fields, arrays)
        assert f"[{code}]" in str(info.value), (fields, arrays, str(info.value))
    with pytest.raises(KVDriveError, match=r"\[bad_field\].*one integer per key \(2\), got 3 values"):
        c.call(Op.BLOCK_GET, get, {"offsets": np.array([0, BB, 2 * BB], np.int64)})
    with pytest.raises(KVDriveError, match=r"\[bad_field\]"):
        c.call(Op.BLOCK_LOOKUP, {"ns": "eng", "keys": [b"a"]}, {"offsets": np.array([0], np.int64)})
    # the header's list form still moves blocks, for a client that speaks it
    r = c.call(Op.BLOCK_GET, {**get, "keys": [key(7), key(0)], "offsets": [BB, 0]})
    assert r["found"] == [False, True] and (buf.array[:BB] == block(0)).all()
    check(c, "eng", [0, 1], {0})
    assert c.block_lookup("eng", [b"a"]) == [False]
    assert daemon.stop() == 0


def test_a_store_from_before_block_namespaces_opens_and_takes_blocks(daemon_factory):
    """A store whose catalog has no blocks database and a counts record without ``blocks``
    (as kvstored wrote them before engine blocks) opens as it is and takes blocks."""
    import lmdb
    import msgpack

    from kvdrive_client import Geometry
    from kvstored.catalog import seal, unseal

    geom = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)
    d = daemon_factory().start()
    c = d.client()
    seq = c.create("old", "s", geom)
    c.put(seq, [0], [0], np.full(geom.block_bytes, 7, np.uint8))
    assert d.stop() == 0
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"blocks", txn=txn), delete=True)
        meta = env.open_db(b"meta", txn=txn)
        counts = msgpack.unpackb(unseal(b"counts", txn.get(b"counts", db=meta)))
        del counts["blocks"]
        txn.put(b"counts", seal(b"counts", msgpack.packb(counts)), db=meta)
    env.close()
    d.start()
    c = d.client()
    assert (c.get(c.open("old", "s"), [(0, 0, 0)]) == 7).all()
    put(c, "eng", [1, 2])
    assert d.stop() == 0
    d.start()
    check(d.client(), "eng", [1, 2, 3], {1, 2})
    assert d.stop() == 0


@pytest.mark.parametrize("base", [0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 3, 1 << 32, 1 << 40])
def test_rows_laid_out_as_columns_are_the_rows_made_one_at_a_time(base):
    """part_rows and block_rows lay a put's rows out as columns where every integer takes one
    msgpack width, else encode them one by one: either way the same bytes, here on both sides of
    each width's bound (a put whose values straddle one takes the row-by-row path)."""
    from kvstored.block_catalog import BlockRecord, _part_rows_each, block_rows, part_rows, sealed_rows

    rng = np.random.default_rng(base % 1000)
    for parts, n in ((1, 3), (2, 4), (17, 2)):
        offsets = [base + 4096 * k for k in range(n * parts)]
        slots = np.arange(n, dtype=np.int64) + min(base, 1 << 30)
        crc = rng.integers(0, 2**32, n * parts, dtype=np.uint32)
        assert part_rows(5, parts, base + 1, offsets, slots, crc) == _part_rows_each(5, parts, base + 1, offsets,
                                                                                    slots, crc)
        ids = (base + 1 + np.arange(n * parts, dtype=np.int64)).reshape(n, parts)
        for width in (1, 33, 48):
            keys = [bytes(rng.integers(0, 256, width, dtype=np.uint8)) for _ in range(n)]
            one_by_one = sealed_rows([BlockRecord(5, k, s, tuple(i)).encode()
                                      for k, s, i in zip(keys, slots.tolist(), ids.tolist())])
            assert block_rows(5, keys, slots, ids) == one_by_one
    mixed = [b"a", b"bc"]  # keys of two lengths: row by row
    assert block_rows(5, mixed, np.array([1, 2]), np.array([[3], [4]])) == sealed_rows(
        [BlockRecord(5, k, s, (i,)).encode() for k, s, i in zip(mixed, (1, 2), (3, 4))])


def test_block_parts_are_written_as_the_extent_records_a_restart_reads():
    """A put's part rows are made without ExtentRecord objects; they must be those records'
    rows byte for byte, so that a restart and the catalog check read them as extents."""
    from kvstored.block_catalog import part_rows
    from kvstored.catalog import ExtentRecord, seal

    uid, parts, first = 7, 2, 41
    slots = np.array([3, 0, 9], np.int64)
    offsets = [(1 << 33) + k * 32768 for k in range(6)]
    crc = np.array([0, 1, 2**32 - 1, 12345, 2**31, 7], np.uint32)
    rows = part_rows(uid, parts, first, offsets, slots, crc)
    for k, (key_, value) in enumerate(rows):
        rec = ExtentRecord(uid, k % parts, 0, first + k, offsets[k], np.array([slots[k // parts]], np.int32),
                           crc[k: k + 1], np.zeros(1, np.int32), np.zeros(1, np.float32))
        want_key, payload = rec.encode()
        assert (key_, value) == (want_key, seal(want_key, payload))
        back = ExtentRecord.decode(key_, value[:-4])
        assert (back.layer, back.extent_id, back.offset, int(back.pages[0]), int(back.crc[0])) == \
               (k % parts, first + k, offsets[k], int(slots[k // parts]), int(crc[k]))
