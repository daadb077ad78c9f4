"""Engine blocks' catalog records: (slot, extents, engine key), and their part of the catalog check.

A block namespace is a sequence record of the reserved name :data:`~kvstored.catalog.BLOCKS_NAME`
(its geometry: the block's parts as layers, one head, one page per block). Each block
is one record of the ``blocks`` database, keyed by the namespace's uid and the id of
the block's first extent, holding the block's slot (its page in the namespace), the ids
of its extents (one per part, each of one page) and the engine's key. The record is
written in the transaction that writes those extents and deleted in the one that
deletes them, so a block is in the catalog whole or not at all.

Extent ids only grow, so a put's block records go to the end of the B-tree: a few pages
rewritten per commit however full the store. Keyed by the engine's key (a hash: format
3, which :mod:`kvstored.migrate` rewrites) each of a put's records rewrote a page of its own,
and the commit grew slower as the store filled.
"""

from __future__ import annotations

import struct

import lmdb
import msgpack
import numpy as np

from kvstored.catalog import (
    BLOCKS_NAME, CRC, EXTENT_KEY, UID_KEY, Catalog, ExtentRecord, SeqRecord, _unpack_map, crc_of, intact_records,
)

BLOCK_KEY = struct.Struct(">QQ")  # a block record's key: namespace uid, first extent id


class BlockRecord:
    """Block ``key`` of the namespace with uid ``uid``: in slot ``slot``, part ``l`` in extent ``extent_ids[l]``."""

    __slots__ = ("uid", "key", "slot", "extent_ids")

    def __init__(self, uid: int, key: bytes, slot: int, extent_ids: tuple[int, ...]) -> None:
        self.uid, self.key, self.slot, self.extent_ids = uid, key, slot, extent_ids

    @property
    def db_key(self) -> bytes:
        return BLOCK_KEY.pack(self.uid, self.extent_ids[0])

    def encode(self) -> tuple[bytes, bytes]:
        return self.db_key, msgpack.packb({"slot": self.slot, "ext": list(self.extent_ids), "key": self.key})

    @classmethod
    def decode(cls, key: bytes, payload: bytes) -> "BlockRecord":
        if len(key) != BLOCK_KEY.size:
            raise ValueError(f"a key of {len(key)} bytes, not {BLOCK_KEY.size}")
        uid, first = BLOCK_KEY.unpack(key)
        v = _unpack_map(payload, ("slot", "ext", "key"))
        slot, ext = _slot_and_extents(v)
        if not isinstance(v["key"], bytes) or not v["key"]:
            raise ValueError(f"engine key {v['key']!r}")
        if ext[0] != first:
            raise ValueError(f"keyed by extent {first}, but its first part is extent {ext[0]}")
        return cls(uid, v["key"], slot, ext)

    @classmethod
    def decode_format3(cls, key: bytes, payload: bytes) -> "BlockRecord":
        """A record as format 3 held it: keyed by namespace uid and engine key, value {slot, ext}."""
        if len(key) <= UID_KEY.size:
            raise ValueError(f"key of {len(key)} bytes holds no engine key")
        slot, ext = _slot_and_extents(_unpack_map(payload, ("slot", "ext")))
        return cls(UID_KEY.unpack(key[:UID_KEY.size])[0], key[UID_KEY.size:], slot, ext)

    def describe(self) -> str:
        return f"block {self.key.hex()[:32]} (namespace uid {self.uid}, slot {self.slot})"


def _slot_and_extents(v: dict) -> tuple[int, tuple[int, ...]]:
    slot, ext = v["slot"], v["ext"]
    if not isinstance(slot, int) or slot < 0:
        raise ValueError(f"slot {slot!r}")
    if not isinstance(ext, list) or not ext or not all(isinstance(e, int) and e > 0 for e in ext):
        raise ValueError(f"extent ids {ext!r}")
    return slot, tuple(ext)


_PAGE, _SUM = struct.Struct("<i"), struct.Struct("<I")
_ZERO = bytes(4)  # a part's cluster (int32) and importance (float32): none


def sealed_rows(encoded: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Keys and payloads as keys and stored values (each payload with its record's checksum)."""
    return [(key, payload + CRC.pack(crc)) for (key, payload), crc in zip(encoded, crc_of([k + p for k, p in encoded]))]


def part_rows(uid: int, parts: int, first_id: int, offsets: list[int], slots: np.ndarray,
              crc: np.ndarray) -> list[tuple[bytes, bytes]]:
    """The catalog rows (key, stored value) of new blocks' parts: part ``p`` of the ``i``-th
    block is extent ``first_id + i * parts + p``, one page (its slot ``slots[i]``) at
    ``offsets[i * parts + p]`` with checksum ``crc[i * parts + p]``. Byte for byte the
    rows :class:`~kvstored.catalog.ExtentRecord` would make, written without one: a put of
    128 SGLang pages makes 256 of them, and the records' arrays cost more than their writes."""
    pack = msgpack.Packer(use_bin_type=True).pack
    keys = [EXTENT_KEY.pack(uid, k % parts, 0, first_id + k) for k in range(len(offsets))]
    payloads = [pack({"off": off, "pages": _PAGE.pack(slot), "crc": _SUM.pack(c), "cluster": _ZERO, "imp": _ZERO})
                for off, slot, c in zip(offsets, np.repeat(slots, parts).tolist(), crc.tolist())]
    return sealed_rows(list(zip(keys, payloads)))


def block_rows(uid: int, keys: list[bytes], slots: np.ndarray, extent_ids: np.ndarray) -> list[tuple[bytes, bytes]]:
    """The catalog rows (key, stored value) of blocks ``keys`` of namespace ``uid``: block
    ``keys[i]`` in slot ``slots[i]``, its parts in extents ``extent_ids[i]``."""
    return sealed_rows([BlockRecord(uid, key, slot, tuple(ids)).encode()
                        for key, slot, ids in zip(keys, slots.tolist(), extent_ids.tolist())])


def add_blocks(cat: Catalog, txn: lmdb.Transaction, parts: list[tuple[bytes, bytes]],
               blocks: list[tuple[bytes, bytes]]) -> None:
    """Write new blocks' rows (:func:`part_rows`, :func:`block_rows`) in one transaction, so
    that a block is in the catalog whole or not at all."""
    for key, value in parts:
        txn.put(key, value, db=cat.extents)
    for key, value in blocks:
        txn.put(key, value, db=cat.blocks)
    cat.num_extents += len(parts)
    cat.num_blocks += len(blocks)


def delete_blocks(cat: Catalog, txn: lmdb.Transaction, uid: int, extent_ids: np.ndarray) -> None:
    """Delete the records of namespace ``uid``'s blocks whose parts are extents
    ``extent_ids[i]`` (by part), and of those extents."""
    for ids in extent_ids.tolist():
        if txn.delete(BLOCK_KEY.pack(uid, ids[0]), db=cat.blocks):
            cat.num_blocks -= 1
        for layer, ext_id in enumerate(ids):
            if txn.delete(EXTENT_KEY.pack(uid, layer, 0, ext_id), db=cat.extents):
                cat.num_extents -= 1


def show_block_key(key: bytes) -> str:
    return f"block record {key[:40]!r}"


def check_blocks(rows: list[tuple[bytes, bytes]], by_uid: dict[int, SeqRecord], extents: list[ExtentRecord],
                 problems: list[str], progress=None, decode=BlockRecord.decode) -> list[BlockRecord]:
    """The block records among ``rows`` that ``decode`` reads and that agree with their
    namespace and extents; every extent of a namespace must belong to exactly one block."""
    ext_of = {(e.uid, e.layer, e.extent_id): e for e in extents if by_uid[e.uid].name == BLOCKS_NAME}
    claimed: set[tuple[int, int, int]] = set()
    slots: set[tuple[int, int]] = set()
    out = []
    for rec in intact_records(rows, decode, show_block_key, problems, progress):
        ns = by_uid.get(rec.uid)
        if ns is None or ns.name != BLOCKS_NAME:
            problems.append(f"{rec.describe()} belongs to no known block namespace")
            continue
        if len(rec.extent_ids) != ns.geometry.num_layers or (rec.uid, rec.slot) in slots:
            problems.append(f"{rec.describe()}: {len(rec.extent_ids)} extents for {ns.geometry.num_layers} parts, "
                            f"or its slot is another block's too")
            continue
        parts = [ext_of.get((rec.uid, layer, e)) for layer, e in enumerate(rec.extent_ids)]
        if any(p is None or len(p.pages) != 1 or int(p.pages[0]) != rec.slot for p in parts):
            problems.append(f"{rec.describe()}: its extents are missing or hold another slot")
            continue
        slots.add((rec.uid, rec.slot))
        claimed.update((rec.uid, layer, e) for layer, e in enumerate(rec.extent_ids))
        out.append(rec)
    for key, ext in ext_of.items():
        if key not in claimed:
            problems.append(f"{ext.describe()} of block namespace {by_uid[ext.uid].ns} belongs to no block")
    return out
