"""A format-3 store (engine block records keyed by the engine's key) is migrated in place
by the first start: every block comes back with its bytes, nothing else changes, and a
record the migration cannot read refuses the start and leaves the store as it was.
kvstore-inspect reads it as it is before then."""

from __future__ import annotations

import json
import struct

import lmdb
import msgpack
import numpy as np
import pytest

from kvdrive.layout.format import FORMAT_VERSION, META_DIR
from kvstored.catalog import seal, unseal
from test_catalog_damage import inspect, refused

BB = 64 << 10
# Keys of 8 bytes, equal to extent ids as the new records' keys hold them: a format-3 key
# (namespace uid, engine key) is then byte for byte some block's format-4 key.
KEYS = {"eng": [struct.pack(">Q", i) for i in range(1, 25)], "two": [b"long key %d" % i for i in range(12)]}


def block(ns: str, i: int) -> np.ndarray:
    return np.random.default_rng([len(ns), i]).integers(0, 256, BB, dtype=np.uint8)


def put(c, ns: str, ids) -> None:
    ids = list(ids)
    buf = c._staging_buffer(len(ids) * BB)
    for j, i in enumerate(ids):
        buf.array[j * BB: (j + 1) * BB] = block(ns, i)
    r = c.block_put_async(ns, BB, [KEYS[ns][i] for i in ids], buf).wait()
    assert r["stored"] == len(ids), r


def check(c, ns: str, ids) -> None:
    ids = list(ids)
    buf = c._staging_buffer(len(ids) * BB)
    buf.array[: len(ids) * BB] = 0
    r = c.block_get_async(ns, [KEYS[ns][i] for i in ids], buf).wait()
    assert r["found"] == [True] * len(ids)
    for j, i in enumerate(ids):
        assert (buf.array[j * BB: (j + 1) * BB] == block(ns, i)).all(), f"{ns} block {i} came back with other bytes"


def as_format3(ssd) -> int:
    """Rewrite the stopped store's block records as format 3 wrote them: keyed by namespace
    uid and engine key, valued {slot, ext}; the format record says 3. The records rewritten."""
    env = lmdb.open(str(ssd / META_DIR), max_dbs=5)
    try:
        with env.begin(write=True) as txn:
            blocks, meta = env.open_db(b"blocks", txn=txn, create=False), env.open_db(b"meta", txn=txn, create=False)
            rows = list(txn.cursor(db=blocks))
            txn.drop(blocks, delete=False)
            for key, value in rows:
                v = msgpack.unpackb(unseal(key, value))
                old = key[:8] + v["key"]
                txn.put(old, seal(old, msgpack.packb({"slot": v["slot"], "ext": v["ext"]})), db=blocks)
            txn.put(b"format", b"3", db=meta)
        return len(rows)
    finally:
        env.close()


def catalog_state(ssd) -> tuple[bytes, list[bytes], list[tuple[bytes, bytes]]]:
    """The format record, the named databases, and the block records."""
    env = lmdb.open(str(ssd / META_DIR), max_dbs=5, readonly=True)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            fmt = txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False))
            rows = list(txn.cursor(db=env.open_db(b"blocks", txn=txn, create=False)))
        return fmt, names, rows
    finally:
        env.close()


@pytest.fixture
def format3_store(daemon_factory):
    """A stopped daemon whose store holds blocks in two namespaces, one deleted and one
    quota-free, in format 3."""
    d = daemon_factory().start()
    c = d.client()
    put(c, "eng", range(16))
    put(c, "two", range(12))
    put(c, "eng", range(16, 24))
    assert c.block_delete("eng", [KEYS["eng"][3], KEYS["eng"][17]])["deleted"] == 2
    assert d.stop() == 0
    assert as_format3(d.ssd) == 22 + 12
    return d


def test_a_format3_store_is_migrated_at_the_first_start(format3_store):
    d = format3_store
    before = catalog_state(d.ssd)
    shown = inspect(d.ssd, "--verify")  # read as it is, and left so: kvstore-inspect never writes
    assert shown.returncode == 0 and "(format 3)" in shown.stdout and "migrates its catalog" in shown.stdout, shown
    assert "34 blocks" in shown.stdout.replace(",", "")
    doc = json.loads(inspect(d.ssd, "--json").stdout)
    assert doc["store"]["format"] == 3 and doc["engine_blocks"] == {"namespaces": 2, "blocks": 34}
    assert catalog_state(d.ssd) == before

    d.start()
    assert f"rewriting 34 block records in format {FORMAT_VERSION}, in one transaction" in d.log()
    assert f"format 3 migrated to {FORMAT_VERSION} (34 block records rewritten)" in d.log()
    c = d.client()
    assert c.hello()["format"] == FORMAT_VERSION
    eng = [i for i in range(24) if i not in (3, 17)]
    check(c, "eng", eng)
    check(c, "two", range(12))
    assert c.block_lookup("eng", [KEYS["eng"][i] for i in (3, 17, 5)]) == [False, False, True]
    put(c, "eng", [3])  # and it takes new blocks, and deletes old ones
    assert c.block_delete("two", [KEYS["two"][0]])["deleted"] == 1
    assert d.stop() == 0

    fmt, names, rows = catalog_state(d.ssd)
    assert fmt == str(FORMAT_VERSION).encode() and b"blocks-format4" not in names
    assert len(rows) == 22 + 1 + 11 and all(len(k) == 16 for k, _ in rows)
    d.start()  # a migrated store reads as one written in this format
    c = d.client()
    check(c, "eng", [3, *eng])
    check(c, "two", range(1, 12))
    assert c.stats()["blocks"] == 34
    assert d.stop() == 0
    shown = inspect(d.ssd, "--verify")
    assert shown.returncode == 0 and "34 blocks" in shown.stdout.replace(",", ""), shown


@pytest.mark.damages_store
def test_a_format3_record_it_cannot_read_refuses_the_start_and_changes_nothing(format3_store):
    d = format3_store
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=5)
    with env.begin(write=True) as txn:
        blocks = env.open_db(b"blocks", txn=txn, create=False)
        key, value = next(iter(txn.cursor(db=blocks)))
        txn.put(key, value[:-1] + bytes([value[-1] ^ 1]), db=blocks)
    env.close()
    before = catalog_state(d.ssd)
    line = refused(d)
    assert f"cannot migrate it to format {FORMAT_VERSION}: format-3 block record" in line and "checksum" in line, line
    assert catalog_state(d.ssd) == before
