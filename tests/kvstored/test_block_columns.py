"""Start-up reads block namespaces as columns (kvstored/block_columns.py): the same blocks
as the record check on a sound catalog, and on a damaged one the record check's own words."""

from __future__ import annotations

import os
import shutil
import struct

import msgpack
import numpy as np
import pytest

from kvdrive.layout.format import DATA_FILE, META_DIR
from kvdrive.layout.geometry import Geometry
from kvstored import catalog_check
from kvstored.block_keys import as_bytes
from kvstored.catalog import BLOCKS_NAME, Catalog, CatalogDamagedError, seal, unseal
from test_catalog_damage import rewrite

BB = 64 << 10
NAMESPACES = {"one": 1, "two": 2, "many": 16}  # regions, and so parts, of each namespace's blocks
GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)


def key(i: int, ns: str = "one") -> bytes:
    """Keys of one length (start-up keeps them as rows of a byte array), but in namespace
    "two": keys of several lengths (kept as bytes objects)."""
    return b"v%d" % i if ns == "two" else b"k" + i.to_bytes(8, "little")


def block(ns: str, i: int) -> np.ndarray:
    return np.random.default_rng([len(ns), i]).integers(0, 256, BB, dtype=np.uint8)


def put(c, ns: str, ids, regions: int) -> None:
    ids = list(ids)
    buf = c._staging_buffer(len(ids) * BB)
    for j, i in enumerate(ids):
        buf.array[j * BB: (j + 1) * BB] = block(ns, i)
    offsets = [j * BB + r * (BB // regions) for j in range(len(ids)) for r in range(regions)]
    assert c.block_put_async(ns, BB, [key(i, ns) for i in ids], buf, offsets=offsets, regions=regions).wait()["stored"]


def got(c, ns: str, ids) -> list:
    buf = c._staging_buffer(len(ids) * BB)
    found = c.block_get_async(ns, [key(i, ns) for i in ids], buf).wait()["found"]
    return [found[j] and bool((buf.array[j * BB: (j + 1) * BB] == block(ns, i)).all()) for j, i in enumerate(ids)]


KEPT = [i for i in range(40) if i % 7 != 3]  # the others are deleted: their slots are free


@pytest.fixture(scope="module")
def sound(module_daemon):
    """A stopped store of three block namespaces (1, 2 and 16 parts), with blocks deleted,
    and a sequence; a restart serves every kept block with its own bytes."""
    d = module_daemon
    c = d.client()
    for ns, regions in NAMESPACES.items():
        put(c, ns, range(40), regions)
        c.block_delete(ns, [key(i, ns) for i in range(40) if i not in KEPT])
    seq = c.create("t", "a", GEOM)
    c.put(seq, range(GEOM.num_layers), range(3), np.ones((GEOM.num_layers, 1, 3, GEOM.block_bytes), np.uint8))
    assert d.stop() == 0
    d.start()
    c = d.client()
    for ns in NAMESPACES:
        assert got(c, ns, range(40)) == [i in KEPT for i in range(40)]
    assert d.stop() == 0
    return d.ssd


def read(ssd, columns: bool):
    cat = Catalog(ssd / META_DIR, 1 << 30, durable=True, readonly=True)
    try:
        return cat.read(os.path.getsize(ssd / DATA_FILE), columns)
    finally:
        cat.close()


def ext_tuple(e) -> tuple:
    return e.uid, e.layer, e.head, e.extent_id, e.offset, e.pages.tolist(), e.crc.tolist(), e.cluster.tolist()


def test_a_sound_catalogs_columns_hold_what_its_records_do(sound):
    fast, slow = read(sound, True), read(sound, False)
    assert not fast.problems and not slow.problems and not fast.blocks
    uids = {s.uid: s.ns for s in slow.sequences if s.name == BLOCKS_NAME}
    assert set(fast.block_columns) == set(uids) and len(uids) == len(NAMESPACES)
    assert [ext_tuple(e) for e in fast.extents] == [ext_tuple(e) for e in slow.extents if e.uid not in uids]
    assert len(fast.extents) == GEOM.num_layers  # the sequence's, one per layer
    by_id = {e.extent_id: e for e in slow.extents}
    for uid, cols in fast.block_columns.items():
        recs = [r for r in slow.blocks if r.uid == uid]
        assert as_bytes(cols.keys) == [r.key for r in recs] and len(recs) == len(KEPT)
        assert isinstance(cols.keys, np.ndarray) == (uids[uid] != "two")  # rows where of one length
        assert cols.slots.tolist() == [r.slot for r in recs]
        assert cols.ext_ids.tolist() == [list(r.extent_ids) for r in recs]
        assert cols.ext_ids.shape[1] == NAMESPACES[uids[uid]]
        assert cols.offsets.tolist() == [[by_id[e].offset for e in r.extent_ids] for r in recs]
        assert cols.crcs.tolist() == [[int(by_id[e].crc[0]) for e in r.extent_ids] for r in recs]


def _uids(ssd) -> dict[str, int]:
    return {s.ns: s.uid for s in read(ssd, False).sequences if s.name == BLOCKS_NAME}


def _resealed(change):
    def rewrite(k: bytes, v: bytes):
        new = change(k, msgpack.unpackb(unseal(k, v)))
        return None if new is None else (new[0], seal(new[0], msgpack.packb(new[1], use_bin_type=True)))
    return rewrite


def _field(name: str, value):
    return _resealed(lambda k, v: (k, {**v, name: value(v) if callable(value) else value}))


def _block_of(ns: str):
    return lambda k, uids: k[:8] == struct.pack(">Q", uids[ns])


def _part_of(ns: str, layer: int = 0):
    return lambda k, uids: struct.unpack(">QIIQ", k)[:2] == (uids[ns], layer)


def _flip(k: bytes, v: bytes):
    return k, v[:6] + bytes([v[6] ^ 0x40]) + v[7:]


DAMAGE = {
    "a block record's byte": ("blocks", _block_of("two"), _flip, "checksum mismatch"),
    "a block in another's slot": ("blocks", _block_of("one"), _field("slot", 1), "slot"),
    "a block naming an extent not there": ("blocks", _block_of("two"), _field("ext", lambda v: [v["ext"][0], 10**9]),
                                           "missing"),
    "a block of a part too few": ("blocks", _block_of("two"), _field("ext", lambda v: v["ext"][:1]),
                                  "1 extents for 2 parts"),
    "a block keyed by another extent": ("blocks", _block_of("two"),
                                        _resealed(lambda k, v: (k[:8] + struct.pack(">Q", v["ext"][0] + 7), v)),
                                        "but its first part is extent"),
    "a block of an empty key": ("blocks", _block_of("one"), _field("key", b""), "engine key b''"),
    "a block record lost": ("blocks", _block_of("many"), lambda k, v: None, "belongs to no block"),
    "a block of no namespace": ("blocks", _block_of("one"),
                                _resealed(lambda k, v: (struct.pack(">Q", 12345) + k[8:], v)),
                                "belongs to no known block namespace"),
    "a part's byte": ("extents", _part_of("many", 9), _flip, "checksum mismatch"),
    "a part on another's bytes": ("extents", _part_of("two", 1), _field("off", 0), "overlaps"),
    "a part past the data file": ("extents", _part_of("one"), _field("off", 1 << 40), "past the end of the"),
    "a part holding another slot": ("extents", _part_of("two"), _field("pages", struct.pack("<i", 777)),
                                    "hold another slot"),
    "a part lost": ("extents", _part_of("many", 15), lambda k, v: None, "the counts record says"),
    "a part of a layer past the block's": ("extents", _part_of("one"),
                                           _resealed(lambda k, v: (k[:8] + struct.pack(">I", 3) + k[12:], v)),
                                           "lies outside"),
    "a part with a negative page": ("extents", _part_of("one"), _field("pages", struct.pack("<i", -1)), "page -1"),
}


def damaged(sound, tmp_path, db: str, pick, change):
    """A copy of the sound store with one record of ``db`` changed (see :func:`rewrite`)."""
    ssd = tmp_path / "ssd"
    shutil.copytree(sound, ssd)
    uids = _uids(ssd)
    rewrite(ssd, db.encode(), lambda k: pick(k, uids), change)
    return ssd


@pytest.mark.damages_store
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_block_namespace_is_told_in_the_record_checks_words(sound, tmp_path, damage):
    db, pick, change, why = DAMAGE[damage]
    ssd = damaged(sound, tmp_path, db, pick, change)
    fast, slow = read(ssd, True), read(ssd, False)
    assert any(why in p for p in slow.problems), slow.problems
    assert fast.problems == slow.problems


# Damage a start names from the damaged row alone, without the record check of every row.
NAMED_ALONE = {"a block record's byte", "a block keyed by another extent", "a block of an empty key", "a part's byte",
               "a part past the data file", "a part of a layer past the block's", "a part with a negative page"}


@pytest.mark.damages_store
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_start_names_damage_in_the_record_checks_words_reading_no_more_than_it_must(sound, tmp_path, damage,
                                                                                        monkeypatch):
    db, pick, change, why = DAMAGE[damage]
    ssd = damaged(sound, tmp_path, db, pick, change)
    slow = read(ssd, False)
    if damage in NAMED_ALONE:  # the record check of every block must not run
        def every_record(*args, **kwargs):
            raise AssertionError("the record check read every block")
        monkeypatch.setattr(catalog_check, "check_blocks", every_record)
    cat = Catalog(ssd / META_DIR, 1 << 30, durable=True, readonly=True)
    try:
        with pytest.raises(CatalogDamagedError) as told:
            cat.load(os.path.getsize(ssd / DATA_FILE))
    finally:
        cat.close()
    named = told.value.problems
    assert named and set(named) <= set(slow.problems) and any(why in p for p in named), (named, slow.problems)
    if damage in NAMED_ALONE:
        assert len(named) == 1


@pytest.mark.damages_store
def test_a_sound_row_of_another_form_is_read_as_a_record(sound, tmp_path):
    """A part with a cluster is not what the writer makes, but the record check takes it:
    so does start-up, record by record."""
    ssd = damaged(sound, tmp_path, "extents", _part_of("one"), _field("cluster", struct.pack("<i", 5)))
    fast, slow = read(ssd, True), read(ssd, False)
    assert not fast.problems and not slow.problems and not fast.block_columns
    assert len(fast.blocks) == len(slow.blocks) == len(NAMESPACES) * len(KEPT)


@pytest.mark.damages_store
def test_the_daemon_refuses_a_damaged_block_namespace_in_words(sound, tmp_path, daemon_at):
    ssd = damaged(sound, tmp_path, *DAMAGE["a block in another's slot"][:3])
    d = daemon_at(tmp_path)
    assert d.ssd == ssd
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start()
    assert "is damaged:" in d.log() and "slot" in d.log() and "Traceback" not in d.log()


@pytest.mark.parametrize("values, repeats", [
    ([], False), ([5], False), ([3, 0, 2, 1], False), ([3, 0, 2, 3], True),  # dense: counted
    ([1 << 30, 7, 1 << 29], False), ([1 << 30, 7, 1 << 30], True),  # sparse: sorted
])
def test_a_slot_held_twice_is_found_dense_or_sparse(values, repeats):
    from kvstored.block_columns import _repeats

    assert _repeats(np.array(values, np.int64)) is repeats


@pytest.mark.damages_store
def test_two_blocks_in_one_slot_with_parts_that_agree_are_refused(sound, tmp_path):
    """A block record moved into another block's slot, its part moved with it: every row is
    sound and the rows agree but for the slot held twice, which the columns must find too."""
    ssd = tmp_path / "ssd"
    shutil.copytree(sound, ssd)
    uid = _uids(ssd)["one"]
    recs = {r.key: r for r in read(ssd, False).blocks if r.uid == uid}
    moved, kept = recs[key(0)], recs[key(1)]
    rewrite(ssd, b"blocks", lambda k: k == struct.pack(">QQ", uid, moved.extent_ids[0]), _field("slot", kept.slot))
    rewrite(ssd, b"extents", lambda k: k == struct.pack(">QIIQ", uid, 0, 0, moved.extent_ids[0]),
            _field("pages", struct.pack("<i", kept.slot)))
    fast, slow = read(ssd, True), read(ssd, False)
    assert any("its slot is another block's too" in p for p in slow.problems), slow.problems
    assert fast.problems == slow.problems and not fast.block_columns
