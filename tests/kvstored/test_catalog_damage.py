"""A damaged or missing catalog, and a second daemon: refused in words, never served as an empty store."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from kvdrive.layout.format import DATA_FILE, FORMAT_VERSION, META_DIR
from kvdrive_client import Geometry

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes
PAGES = 6
MAIN_ROOT_AT = 16 + 24 + 48 + 40  # MDB_meta's dbs[MAIN].md_root, past the page header


def page_data(seed: int, pages: int = PAGES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, pages, BB), dtype=np.uint8)


def blocks(pages: int = PAGES) -> np.ndarray:
    return np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in range(pages)])


def filled_and_stopped(daemon_factory):
    d = daemon_factory().start()
    c = d.client()
    for seed, name in enumerate(("a", "b")):
        c.put(c.create("t", name, GEOM), range(GEOM.num_layers), range(PAGES), page_data(seed))
    assert d.stop() == 0
    return d


def refused(d) -> str:
    """Start ``d``, which must refuse with exit status 1; returns what this start logged."""
    before = len(d.log())
    try:
        d.start()
    except RuntimeError as exc:
        assert "kvstored exited with 1" in str(exc), str(exc)
    else:
        d.stop()
        pytest.fail("kvstored started over a damaged store:\n" + d.log()[before:])
    text = d.log()[before:]
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if "cannot start:" in line]
    assert len(lines) == 1, text
    return lines[0]


def inspect(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def rewrite(ssd: Path, db: bytes, pick, change) -> None:
    """Replace the first record of ``db`` that ``pick(key)`` chooses by ``change(key, value)``
    -> (key, value) or None (dropped), below the catalog's own encoding."""
    env = lmdb.open(str(ssd / META_DIR), max_dbs=4)
    try:
        with env.begin(write=True) as txn:
            handle = env.open_db(db, txn=txn, create=False)
            key, value = next((k, v) for k, v in txn.cursor(db=handle) if pick(k))
            txn.delete(key, db=handle)
            new = change(key, value)
            if new is not None:
                txn.put(*new, db=handle)
    finally:
        env.close()


def flip_last(b: bytes) -> bytes:
    return b[:-1] + bytes([b[-1] ^ 0x01])


# ---------------------------------------------------------------- the LMDB file


def test_meta_pages_read_as_lmdb_reports_them(tmp_path):
    from kvstored.files import read_lmdb_meta

    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=1 << 30)
    db = env.open_db(b"x")
    for batch in range(3):
        with env.begin(write=True) as txn:
            for i in range(2000):
                txn.put(struct.pack(">QQ", batch, i), os.urandom(64), db=db)
    info, stat = env.info(), env.stat()
    env.close()
    meta = read_lmdb_meta(tmp_path / "data.mdb")
    assert (meta.page_size, meta.last_pg, meta.txnid) == (stat["psize"], info["last_pgno"], info["last_txnid"])
    raw = (tmp_path / "data.mdb").read_bytes()
    assert struct.unpack_from("<QHH", raw, meta.main_root * meta.page_size)[0] == meta.main_root
    assert read_lmdb_meta(tmp_path / "absent.mdb") is None


def _main_root(move):
    def hurt(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        psize = struct.unpack_from("<I", raw, 16 + 24)[0]
        for meta in range(2):
            at = meta * psize + MAIN_ROOT_AT
            struct.pack_into("<Q", raw, at, move(struct.unpack_from("<Q", raw, at)[0]))
        path.write_bytes(bytes(raw))

    return hurt


def _lmdb_used_bytes(path: Path) -> int:
    """(last page + 1) x page size of the current meta page (the file may be longer: a reserve)."""
    raw = path.read_bytes()
    psize = struct.unpack_from("<I", raw, 16 + 24)[0]
    last_pg, _ = max((struct.unpack_from("<QQ", raw, m * psize + 136) for m in range(2)), key=lambda lt: lt[1])
    return (last_pg + 1) * psize


DAMAGE = {
    "emptied": (lambda p: p.write_bytes(b""), "is empty"),
    "cut in half": (lambda p: os.truncate(p, _lmdb_used_bytes(p) // 2), "cut short"),
    # Another intact page: LMDB would read it as the main database and find no catalog there.
    "root elsewhere": (_main_root(lambda root: root - 1 if root > 2 else root + 1), "has no format record"),
    "root past the end": (_main_root(lambda root: root + 1000), "the root of LMDB's main database"),
    "meta/ removed": (lambda p: shutil.rmtree(p.parent), "is missing"),
}


@pytest.mark.damages_store
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_catalog_file_is_refused_never_served_empty(daemon_factory, damage):
    d = filled_and_stopped(daemon_factory)
    data_before = (d.ssd / DATA_FILE).read_bytes()
    hurt, why = DAMAGE[damage]
    hurt(d.ssd / META_DIR / "data.mdb")
    line = refused(d)
    assert why in line and "from a backup" in line and "away" in line, line
    assert (d.ssd / DATA_FILE).read_bytes() == data_before  # nothing written over the blocks
    # kvstore-inspect refuses it too, in words (not SIGBUS); with --verify it is a finding.
    plain = inspect(d.ssd)
    assert plain.returncode == 2 and why in plain.stderr and plain.stderr.count("\n") == 1, plain
    checked = inspect(d.ssd, "--verify")
    assert checked.returncode == 1 and why in checked.stdout, checked


# ---------------------------------------------------------------- records


RECORD_DAMAGE = {
    # A flipped byte in a sequence's name key: the sequence would vanish (or be renamed).
    "name key": (b"seqs", lambda k: k.startswith(b"n:") and k.endswith(b"\0a"), lambda k, v: (flip_last(k), v),
                 "checksum mismatch"),
    # A flipped uid in a uid record: nothing read it before.
    "uid record": (b"seqs", lambda k: k.startswith(b"u:"), lambda k, v: (flip_last(k), v), "checksum mismatch"),
    "extent value": (b"extents", lambda k: True, lambda k, v: (k, v[:40] + bytes([v[40] ^ 0x10]) + v[41:]),
                     "checksum mismatch"),
    # A lost extent record: its blocks would be silently gone.
    "extent dropped": (b"extents", lambda k: True, lambda k, v: None, "the counts record says"),
}


@pytest.mark.damages_store
@pytest.mark.parametrize("damage", RECORD_DAMAGE)
def test_a_damaged_record_is_refused_naming_it(daemon_factory, damage):
    d = filled_and_stopped(daemon_factory)
    db, pick, change, why = RECORD_DAMAGE[damage]
    rewrite(d.ssd, db, pick, change)
    line = refused(d)
    assert "is damaged:" in line and why in line, line
    checked = inspect(d.ssd, "--verify")
    assert checked.returncode == 1, checked
    assert any(why in ln for ln in checked.stdout.splitlines() if ln.startswith("catalog damaged: ")), checked.stdout


def _resealed(change):
    """Rewrite a format-3 record's payload and seal it again, so only the cross checks can tell."""
    from kvstored.catalog import seal, unseal

    def rewrite_payload(key: bytes, value: bytes) -> tuple[bytes, bytes]:
        new_key, payload = change(key, unseal(key, value))
        return new_key, seal(new_key, payload)

    return rewrite_payload


def _extent_field(name: str, value):
    def change(key: bytes, payload: bytes) -> tuple[bytes, bytes]:
        v = msgpack.unpackb(payload)
        v[name] = value
        return key, msgpack.packb(v, use_bin_type=True)

    return change


def _without_cluster(key: bytes, payload: bytes) -> tuple[bytes, bytes]:
    v = msgpack.unpackb(payload)
    del v["cluster"]
    return key, msgpack.packb(v, use_bin_type=True)


CROSS_DAMAGE = {
    "overlapping extents": (b"extents", _extent_field("off", 4096), "overlaps"),
    "extent past the data file": (b"extents", _extent_field("off", 1 << 30), "past the end of the"),
    "record lacks a field": (b"extents", _without_cluster, "lacks 'cluster'"),
    "uid record names another sequence": (
        b"seqs", lambda k, p: (k, p[:-1] + b"b") if k.startswith(b"u:") and p.endswith(b"\0a") else (k, p), "instead"),
}


@pytest.mark.damages_store
@pytest.mark.parametrize("damage", CROSS_DAMAGE)
def test_records_that_disagree_are_refused_in_words(daemon_factory, damage):
    d = filled_and_stopped(daemon_factory)
    db, change, why = CROSS_DAMAGE[damage]
    pick = (lambda k: k.startswith(b"u:")) if db == b"seqs" else (lambda k: struct.unpack(">QIIQ", k)[1:3] == (0, 1))
    if damage == "uid record names another sequence":
        env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4)
        with env.begin() as txn:  # the uid record of t/a
            target = next(k for k, v in txn.cursor(db=env.open_db(b"seqs", txn=txn)) if k.startswith(b"u:") and b"\0a" in v)
        env.close()
        pick = lambda k: k == target  # noqa: E731
    rewrite(d.ssd, db, pick, _resealed(change))
    line = refused(d)
    assert why in line, line
    checked = inspect(d.ssd, "--verify")
    assert checked.returncode == 1 and why in checked.stdout, checked


@pytest.mark.damages_store
def test_an_unknown_format_is_refused_in_one_sentence(daemon_factory):
    d = filled_and_stopped(daemon_factory)
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"99", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    assert "store format 99" in refused(d)


# ---------------------------------------------------------------- format 2


def write_format2_store(ssd: Path, data: np.ndarray) -> None:
    """A store as the format-2 kvstored wrote it: plain msgpack records, no owners, no counts."""
    from kvstored.checksum import block_crcs
    from kvstored.copy import address_tags

    uid, ext_bytes = 1, -(-PAGES * BB // 4096) * 4096
    (ssd / META_DIR).mkdir(parents=True)
    blob = np.zeros(GEOM.num_layers * GEOM.num_kv_heads * ext_bytes, np.uint8)
    env = lmdb.open(str(ssd / META_DIR), max_dbs=4)
    with env.begin(write=True) as txn:
        meta, seqs, extents = (env.open_db(n, txn=txn) for n in (b"meta", b"seqs", b"extents"))
        name_key = b"n:t\0old"
        txn.put(name_key, msgpack.packb({"uid": uid, "geometry": GEOM.to_dict(), "created": 1.5}), db=seqs)
        txn.put(b"u:" + struct.pack(">Q", uid), name_key, db=seqs)
        ext_id = 1
        for layer in range(GEOM.num_layers):
            for head in range(GEOM.num_kv_heads):
                off = (layer * GEOM.num_kv_heads + head) * ext_bytes
                blob[off : off + PAGES * BB] = data[layer, head].ravel()
                pages = np.arange(PAGES)
                crc = block_crcs(blob, off + pages * BB, BB) ^ address_tags(uid, np.full(PAGES, layer), np.full(PAGES, head), pages)
                ext_id += 1
                txn.put(struct.pack(">QIIQ", uid, layer, head, ext_id), msgpack.packb({
                    "off": off, "pages": pages.astype("<i4").tobytes(), "crc": crc.astype("<u4").tobytes(),
                    "cluster": np.zeros(PAGES, "<i4").tobytes(), "imp": np.zeros(PAGES, "<f4").tobytes(),
                }, use_bin_type=True), db=extents)
        for key, value in ((b"format", b"2"), (b"next_uid", b"2"), (b"next_extent", str(ext_id).encode())):
            txn.put(key, value, db=meta)
    env.close()
    (ssd / DATA_FILE).write_bytes(blob.tobytes())


def test_a_format2_catalog_is_migrated_in_place_at_open(daemon_factory):
    d = daemon_factory()
    data = page_data(7)
    write_format2_store(d.ssd, data)
    told = inspect(d.ssd)
    assert told.returncode == 2 and "store format 2" in told.stderr and "once" in told.stderr, told
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4, readonly=True)
    before = env.info()["last_txnid"]
    env.close()

    d.start()
    c = d.client()
    assert c.hello()["format"] == FORMAT_VERSION
    seq = c.open("t", "old")
    assert seq.num_blocks == GEOM.num_layers * GEOM.num_kv_heads * PAGES
    np.testing.assert_array_equal(c.get(seq, blocks()), data.reshape(-1, BB))
    c.put(seq, range(GEOM.num_layers), [PAGES], page_data(8, 1))  # and it takes new puts
    assert d.stop() == 0

    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4, readonly=True)
    meta = env.open_db(b"meta", create=False)
    with env.begin() as txn:
        assert txn.get(b"format", db=meta) == str(FORMAT_VERSION).encode()
    assert env.info()["last_txnid"] == before + 2  # the migration, then the put: one transaction each
    env.close()
    doc = json.loads(inspect(d.ssd, "--json", "--verify").stdout)
    (row,) = doc["sequences"]
    assert (row["id"], row["owner"], row["created"]) == ("old", os.geteuid(), 1.5)
    assert doc["verify"]["bad"] == [] and doc["verify"]["catalog_problems"] == []


@pytest.mark.damages_store
def test_a_format2_record_it_cannot_read_refuses_the_start_and_changes_nothing(daemon_factory):
    d = daemon_factory()
    write_format2_store(d.ssd, page_data(7))
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"n:t\0old", b"\xc1", db=env.open_db(b"seqs", txn=txn, create=False))  # 0xc1: never msgpack
    env.close()
    before = (d.ssd / META_DIR / "data.mdb").read_bytes()
    line = refused(d)
    assert f"cannot migrate it to format {FORMAT_VERSION}: format-2 record b'n:t\\x00old'" in line, line
    assert (d.ssd / META_DIR / "data.mdb").read_bytes() == before


def test_new_sequences_belong_to_their_creator(daemon_factory):
    import pwd

    d = filled_and_stopped(daemon_factory)
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4, readonly=True)
    seqs = env.open_db(b"seqs", create=False)
    with env.begin() as txn:
        keys = [k for k, _ in txn.cursor(db=seqs) if k.startswith(b"n:")]
    env.close()
    assert sorted(keys) == [b"n:" + struct.pack(">Q", os.geteuid()) + b"t\0" + n for n in (b"a", b"b")]
    doc = json.loads(inspect(d.ssd, "--json").stdout)
    assert {(s["id"], s["owner"], s["user"]) for s in doc["sequences"]} == {
        (n, os.geteuid(), pwd.getpwuid(os.geteuid()).pw_name) for n in ("a", "b")
    }
    text = inspect(d.ssd).stdout
    assert f"{os.geteuid()} ({pwd.getpwuid(os.geteuid()).pw_name})" in text


# ---------------------------------------------------------------- two daemons


def test_a_second_daemon_is_refused_even_without_the_lock_file(daemon_factory):
    first = daemon_factory().start()
    c = first.client()
    seq = c.create("t", "a", GEOM)
    c.put(seq, range(GEOM.num_layers), range(PAGES), page_data(1))
    (first.ssd / "kvstored.lock").unlink()
    second = daemon_factory()
    second.ssd = first.ssd
    line = refused(second)
    assert f"another kvstored (pid {first.proc.pid})" in line, line
    # The first one serves on, its blocks untouched; kvstore-inspect still reads beside it.
    assert first.alive()
    c.put(seq, range(GEOM.num_layers), [PAGES], page_data(2, 1))
    np.testing.assert_array_equal(c.get(seq, blocks()), page_data(1).reshape(-1, BB))
    checked = inspect(first.ssd, "--verify")
    assert checked.returncode == 0 and "intact" in checked.stdout, checked
