"""Durable metadata in LMDB: sequences, extents (block -> location), the format version.

The environment and its named databases open once, before any thread starts; the
single writer thread owns every write transaction. Free space is not stored: it
is the complement of the extents, derived at open, so it can never disagree with
the extent map after a crash.

Records:
- ``meta``: ``format`` -> FORMAT_VERSION, ``next_uid``, ``next_extent``.
- ``seqs``: ``n:<ns>\\0<name>`` -> {uid, geometry, created}; ``u:<uid>`` -> name key.
- ``extents``: ``>QIIQ (uid, layer, head, extent_id)`` -> {off, pages, crc, cluster, importance}
  where ``pages`` lists the extent's pages in slot order (int32 bytes) and ``crc``
  each slot's checksum (uint32 bytes, address-tagged).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import lmdb
import msgpack
import numpy as np

from kvdrive.layout.format import FORMAT_VERSION
from kvdrive.layout.geometry import Geometry

EXTENT_KEY = struct.Struct(">QIIQ")
UID_KEY = struct.Struct(">Q")


class FormatError(RuntimeError):
    """The store on disk was written by an incompatible version."""


@dataclass(frozen=True)
class SeqRecord:
    uid: int
    ns: str
    name: str
    geometry: Geometry
    created: float


@dataclass(frozen=True)
class ExtentRecord:
    uid: int
    layer: int
    head: int
    extent_id: int
    offset: int
    pages: np.ndarray
    crc: np.ndarray
    cluster: np.ndarray
    importance: np.ndarray

    def encode(self) -> tuple[bytes, bytes]:
        key = EXTENT_KEY.pack(self.uid, self.layer, self.head, self.extent_id)
        value = msgpack.packb(
            {
                "off": self.offset,
                "pages": self.pages.astype("<i4").tobytes(),
                "crc": self.crc.astype("<u4").tobytes(),
                "cluster": self.cluster.astype("<i4").tobytes(),
                "imp": self.importance.astype("<f4").tobytes(),
            },
            use_bin_type=True,
        )
        return key, value

    @classmethod
    def decode(cls, key: bytes, value: bytes) -> "ExtentRecord":
        uid, layer, head, extent_id = EXTENT_KEY.unpack(key)
        v = msgpack.unpackb(value, raw=False)
        return cls(
            uid, layer, head, extent_id, v["off"],
            np.frombuffer(v["pages"], "<i4"), np.frombuffer(v["crc"], "<u4"),
            np.frombuffer(v["cluster"], "<i4"), np.frombuffer(v["imp"], "<f4"),
        )


def _name_key(ns: str, name: str) -> bytes:
    return b"n:" + ns.encode() + b"\0" + name.encode()


class Catalog:
    def __init__(self, path: Path, map_size: int, durable: bool, readonly: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.env = lmdb.open(
            str(path), map_size=map_size, max_dbs=4, subdir=True,
            # Readers take a slot in the lock file too: a reader without one is invisible to a
            # live writer, which may then recycle the pages under its snapshot.
            sync=durable, metasync=durable, readonly=readonly, lock=True,
        )
        self.meta = self.env.open_db(b"meta", create=not readonly)
        self.seqs = self.env.open_db(b"seqs", create=not readonly)
        self.extents = self.env.open_db(b"extents", create=not readonly)
        with self.env.begin(write=not readonly) as txn:
            found = txn.get(b"format", db=self.meta)
            if found is None:
                if readonly:
                    raise FormatError(f"{path} holds no KVDrive catalog")
                txn.put(b"format", str(FORMAT_VERSION).encode(), db=self.meta)
            elif int(found) != FORMAT_VERSION:
                raise FormatError(f"store format {int(found)} at {path}; this kvstored reads format {FORMAT_VERSION}")
            self.next_uid = int(txn.get(b"next_uid", b"1", db=self.meta))
            self.next_extent = int(txn.get(b"next_extent", b"1", db=self.meta))

    def sequences(self) -> list[SeqRecord]:
        out = []
        with self.env.begin() as txn:
            for key, value in txn.cursor(db=self.seqs):
                if not key.startswith(b"n:"):
                    continue
                ns, name = key[2:].decode().split("\0", 1)
                v = msgpack.unpackb(value, raw=False)
                out.append(SeqRecord(v["uid"], ns, name, Geometry.from_dict(v["geometry"]), v["created"]))
        return out

    def iter_extents(self) -> Iterator[ExtentRecord]:
        with self.env.begin() as txn:
            for key, value in txn.cursor(db=self.extents):
                yield ExtentRecord.decode(key, value)

    # ------------------------------------------------------------ writer only

    def begin(self) -> lmdb.Transaction:
        return self.env.begin(write=True)

    def add_sequence(self, txn: lmdb.Transaction, rec: SeqRecord) -> None:
        value = msgpack.packb({"uid": rec.uid, "geometry": rec.geometry.to_dict(), "created": rec.created})
        txn.put(_name_key(rec.ns, rec.name), value, db=self.seqs)
        txn.put(b"u:" + UID_KEY.pack(rec.uid), _name_key(rec.ns, rec.name), db=self.seqs)
        txn.put(b"next_uid", str(self.next_uid).encode(), db=self.meta)

    def delete_sequence(self, txn: lmdb.Transaction, rec: SeqRecord) -> None:
        txn.delete(_name_key(rec.ns, rec.name), db=self.seqs)
        txn.delete(b"u:" + UID_KEY.pack(rec.uid), db=self.seqs)
        cursor = txn.cursor(db=self.extents)
        prefix = UID_KEY.pack(rec.uid)
        if cursor.set_range(prefix):
            while cursor.key().startswith(prefix):
                if not cursor.delete():
                    break

    def add_extent(self, txn: lmdb.Transaction, rec: ExtentRecord) -> None:
        key, value = rec.encode()
        txn.put(key, value, db=self.extents)
        txn.put(b"next_extent", str(self.next_extent).encode(), db=self.meta)

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.close()
