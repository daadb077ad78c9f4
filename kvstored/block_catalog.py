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
from kvstored.checksum import block_crcs

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

# The constant parts of the rows' values (msgpack maps), as :func:`part_rows` and
# :func:`block_rows` lay them out between their integers; :mod:`kvstored.block_columns`
# reads them back in this form. A part: off, pages (int32), crc (uint32), cluster and imp
# (none). A block: slot, ext (an array header follows), key (bin 8: its length follows).
PART_HEAD, PART_PAGES, PART_CRC = b"\x85\xa3off", b"\xa5pages\xc4\x04", b"\xa3crc\xc4\x04"
PART_TAIL = b"\xa7cluster\xc4\x04" + _ZERO + b"\xa3imp\xc4\x04" + _ZERO
BLOCK_HEAD, BLOCK_EXT, BLOCK_KEY_BIN = b"\x83\xa4slot", b"\xa3ext", b"\xa3key\xc4"


def sealed_rows(encoded: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Keys and payloads as keys and stored values (each payload with its record's checksum)."""
    return [(key, payload + CRC.pack(crc)) for (key, payload), crc in zip(encoded, crc_of([k + p for k, p in encoded]))]


def part_rows(uid: int, parts: int, first_id: int, offsets: list[int], slots: np.ndarray,
              crc: np.ndarray) -> list[tuple[bytes, bytes]]:
    """The catalog rows (key, stored value) of new blocks' parts: part ``p`` of the ``i``-th
    block is extent ``first_id + i * parts + p``, one page (its slot ``slots[i]``) at
    ``offsets[i * parts + p]`` with checksum ``crc[i * parts + p]``. Byte for byte the
    rows :class:`~kvstored.catalog.ExtentRecord` would make, written without one: a put of
    128 SGLang pages makes 256 of them. Where every offset takes msgpack's integer of one
    width (as a rule) the rows are laid out as columns of one array (:func:`_columns`), else
    made one at a time. The put's writer thread makes them after its write, before the
    commit: a 128-page put's part and block rows took 0.28 ms here as columns, 0.62 ms
    one at a time."""
    n = len(offsets)
    off = np.asarray(offsets)
    width = _uint_width(off) if off.dtype.kind in "iu" else None
    if width is None or not len(slots) or slots.min() < -(1 << 31) or slots.max() >= 1 << 31:
        return _part_rows_each(uid, parts, first_id, offsets, slots, crc)
    keys = _columns(n, [(EXTENT_KEY_DTYPE, (uid, np.arange(n) % parts, 0, first_id + np.arange(n)))])
    pay = _columns(n, [PART_HEAD, *width(off), PART_PAGES, ("<i4", np.repeat(slots, parts)), PART_CRC, ("<u4", crc),
                       PART_TAIL])
    return _sealed_columns(keys, pay)


def _part_rows_each(uid: int, parts: int, first_id: int, offsets: list[int], slots: np.ndarray,
                    crc: np.ndarray) -> list[tuple[bytes, bytes]]:
    pack = msgpack.Packer(use_bin_type=True).pack
    keys = [EXTENT_KEY.pack(uid, k % parts, 0, first_id + k) for k in range(len(offsets))]
    payloads = [pack({"off": off, "pages": _PAGE.pack(slot), "crc": _SUM.pack(c), "cluster": _ZERO, "imp": _ZERO})
                for off, slot, c in zip(offsets, np.repeat(slots, parts).tolist(), crc.tolist())]
    return sealed_rows(list(zip(keys, payloads)))


def block_rows(uid: int, keys: list[bytes], slots: np.ndarray, extent_ids: np.ndarray) -> list[tuple[bytes, bytes]]:
    """The catalog rows (key, stored value) of blocks ``keys`` of namespace ``uid``: block
    ``keys[i]`` in slot ``slots[i]``, its parts in extents ``extent_ids[i]``. As columns
    (:func:`part_rows`) where the slots take one msgpack width, the extent ids one, and the
    keys are of one length (at most 255 bytes); else :meth:`BlockRecord.encode` each."""
    n, parts = extent_ids.shape
    slot_w, ext_w, klen = _uint_width(slots), _uint_width(extent_ids), len(keys[0]) if keys else 0
    if slot_w is None or ext_w is None or not 0 < klen < 256 or parts >= 1 << 16 or set(map(len, keys)) != {klen}:
        return sealed_rows([BlockRecord(uid, key, slot, tuple(ids)).encode()
                            for key, slot, ids in zip(keys, slots.tolist(), extent_ids.tolist())])
    head = bytes([0x90 | parts]) if parts < 16 else b"\xdc" + struct.pack(">H", parts)
    ext = [c for p in range(parts) for c in ext_w(extent_ids[:, p])]
    db_keys = _columns(n, [(BLOCK_KEY_DTYPE, (uid, extent_ids[:, 0]))])
    pay = _columns(n, [BLOCK_HEAD, *slot_w(slots), BLOCK_EXT + head, *ext, BLOCK_KEY_BIN + bytes([klen]),
                       ("V%d" % klen, np.frombuffer(b"".join(keys), "V%d" % klen))])
    return _sealed_columns(db_keys, pay)


EXTENT_KEY_DTYPE = np.dtype([("uid", ">u8"), ("layer", ">u4"), ("head", ">u4"), ("ext", ">u8")])  # EXTENT_KEY
BLOCK_KEY_DTYPE = np.dtype([("uid", ">u8"), ("first", ">u8")])  # BLOCK_KEY
# msgpack's unsigned integers: below each bound, the type byte (none: a positive fixint) and the big-endian width.
_UINTS = ((1 << 7, None, ">u1"), (1 << 8, b"\xcc", ">u1"), (1 << 16, b"\xcd", ">u2"), (1 << 32, b"\xce", ">u4"),
          (1 << 64, b"\xcf", ">u8"))


def _uint_width(values: np.ndarray):
    """A maker of the msgpack columns of ``values`` (non-negative integers) where they all take
    one width; None where they do not (or there are none)."""
    if not values.size:
        return None
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or _uint_class(lo) != _uint_class(hi):
        return None
    _, tag, fmt = _UINTS[_uint_class(hi)]
    return lambda v: ([tag] if tag else []) + [(fmt, v)]


def _uint_class(v: int) -> int:
    return next(i for i, (bound, _, _) in enumerate(_UINTS) if v < bound)


def _columns(n: int, cols: list) -> np.ndarray:
    """``n`` rows of fixed-size columns, as an ``[n, width]`` uint8 array: each column a
    constant (bytes) or (dtype, values) (a structured dtype takes a tuple of field values)."""
    fields, values = [], []
    for i, col in enumerate(cols):
        if isinstance(col, bytes):
            fields.append((f"c{i}", f"V{len(col)}"))
            values.append(np.frombuffer(col, f"V{len(col)}")[0])
        else:
            fields.append((f"c{i}", col[0]))
            values.append(col[1])
    out = np.empty(n, np.dtype(fields))
    for (name, _), v in zip(fields, values):
        if isinstance(v, tuple):
            for field, part in zip(out.dtype[name].names, v):
                out[name][field] = part
        else:
            out[name] = v
    return out.view(np.uint8).reshape(n, -1)


def _sealed_columns(keys: np.ndarray, payloads: np.ndarray) -> list[tuple[bytes, bytes]]:
    """Rows of :func:`_columns` keys and payloads as (key, payload + the checksum of both)."""
    n, kw = keys.shape
    row = kw + payloads.shape[1]
    crc = block_crcs(np.concatenate([keys, payloads], axis=1).reshape(-1), np.arange(n, dtype=np.int64) * row, row)
    stored = np.concatenate([payloads, crc.astype("<u4").view(np.uint8).reshape(n, 4)], axis=1).tobytes()
    key_bytes, vw = keys.tobytes(), payloads.shape[1] + 4
    return [(key_bytes[i * kw: (i + 1) * kw], stored[i * vw: (i + 1) * vw]) for i in range(n)]


def add_blocks(cat: Catalog, txn: lmdb.Transaction, parts: list[tuple[bytes, bytes]],
               blocks: list[tuple[bytes, bytes]]) -> None:
    """Write new blocks' rows (:func:`part_rows`, :func:`block_rows`) in one transaction, so
    that a block is in the catalog whole or not at all."""
    txn.cursor(db=cat.extents).putmulti(parts)  # as a put each, in one call (256 rows: 0.07 ms, not 0.17)
    txn.cursor(db=cat.blocks).putmulti(blocks)
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
