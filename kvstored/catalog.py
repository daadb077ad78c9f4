"""Durable metadata in LMDB: sequences, extents (block -> location), the format version.

The environment and its named databases open once, before any thread starts; the
single writer thread owns every write transaction. Free space is not stored: it
is the complement of the extents, derived at open, so it can never disagree with
the extent map after a crash.

Records (format 4). Every value but ``format`` ends in a CRC-32C (4 bytes,
little-endian) of the record's key and the rest of its value:
- ``meta``: ``format`` -> FORMAT_VERSION in ASCII (left bare so that any kvstored can
  read it and refuse a store it does not know); ``counts`` -> {seqs, extents,
  next_uid, next_extent}, rewritten by every write transaction.
- ``seqs``: ``n:<owner u64 BE><ns>\\0<name>`` -> {uid, geometry, created};
  ``u:<uid u64 BE>`` -> the name key. A sequence's uid is drawn at random below
  :data:`UID_LIMIT` (:meth:`Catalog.new_uid`), so no user learns from its uids how many
  sequences others made or when; ``next_uid`` in ``counts`` is one past the highest
  handed out (stores made before held consecutive uids from 1, and keep them).
- ``extents``: ``>QIIQ (uid, layer, head, extent_id)`` -> {off, pages, crc, cluster, importance}
  where ``pages`` lists the extent's pages in slot order (int32 bytes) and ``crc``
  each slot's checksum (uint32 bytes, address-tagged).
- ``blocks`` (engine blocks, block_catalog.py): ``>QQ (namespace uid, first extent id)``
  -> {slot, ext, key}; the namespace is a sequence record of the reserved name
  :data:`BLOCKS_NAME`, whose pages are the slots. ``counts`` holds ``blocks`` too (a
  counts record without it, from a kvstored before engine blocks, is not checked there).

:meth:`Catalog.read` checks every record, the counts and the cross references in one
read transaction; :meth:`Catalog.load` raises :class:`CatalogDamagedError` on any
problem. A format-2 catalog (no record checksums, no owners) or format-3 one (block
records keyed by engine key) is migrated in place at the first writable open, in one
write transaction.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import lmdb
import msgpack
import numpy as np

from kvdrive.layout.format import DATA_FILE, FORMAT_VERSION, META_DIR
from kvdrive.layout.geometry import Geometry
from kvstored.checksum import block_crcs
from kvstored.config import format_size
from kvstored.files import CatalogFileError, StoreBusyError, StoreOpenError, lock_exclusive, read_lmdb_meta, reserve

log = logging.getLogger(__name__)

EXTENT_KEY = struct.Struct(">QIIQ")
UID_KEY = struct.Struct(">Q")
CRC = struct.Struct("<I")
# Sequence uids are drawn below this: the protocol's uid fields take values up to 2**62.
UID_LIMIT = 1 << 62
PROGRESS_ROWS = 4096  # records a catalog check reads between two looks at its progress
MIGRATES = (2, 3)  # the formats this kvstored rewrites in place; older ones are refused
READS_AS_IS = (3,)  # older formats a read-only open (kvstore-inspect) reads without migrating them
MAX_SHOWN = 5  # problems named in a CatalogDamagedError's message
# The sequence name of a block namespace: a space, which no client's sequence name holds.
BLOCKS_NAME = " blocks"
# Disk space kept allocated in data.mdb past LMDB's last page, so that a delete commits on
# a full filesystem: a delete copies each page it changes, at most the pages in use.
RESERVE_MIN_BYTES = 4 << 20
RESERVE_SHARE = 4  # and at least a quarter of the pages in use

__all__ = ["Catalog", "CatalogDamagedError", "CatalogMissingError", "FormatError", "StoreBusyError", "StoreOpenError"]


class FormatError(StoreOpenError):
    """The store on disk was written by an incompatible version."""


class CatalogMissingError(StoreOpenError):
    """The data file holds blocks but the catalog that says where they are is missing or empty."""


class CatalogDamagedError(StoreOpenError):
    """The catalog's records or LMDB file fail their checks; ``problems`` names each."""

    def __init__(self, meta_dir: Path, problems: list[str]) -> None:
        self.problems = problems
        more = f" (and {len(problems) - MAX_SHOWN} more)" if len(problems) > MAX_SHOWN else ""
        super().__init__(
            f"the catalog in {meta_dir} is damaged: {'; '.join(problems[:MAX_SHOWN])}{more}. "
            f"Restore {meta_dir.name}/ from a backup, or move {meta_dir.parent} away to start an empty store"
        )


@dataclass(frozen=True)
class SeqRecord:
    uid: int
    ns: str
    name: str
    geometry: Geometry
    created: float
    owner: int  # the OS user (uid) the sequence belongs to

    @property
    def key(self) -> bytes:
        return name_key(self.owner, self.ns, self.name)


# Not frozen (no record changes once made): its init took 1.1 us against 0.2; start-up decodes millions.
@dataclass(slots=True)
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
        """Key and payload (the value without its checksum)."""
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
    def decode(cls, key: bytes, payload: bytes) -> "ExtentRecord":
        """From a key and payload; ValueError names what does not fit."""
        if len(key) != EXTENT_KEY.size:
            raise ValueError(f"key of {len(key)} bytes, not {EXTENT_KEY.size}")
        uid, layer, head, extent_id = EXTENT_KEY.unpack(key)
        v = _unpack_map(payload, _EXTENT_FIELDS)
        pages, crc = np.frombuffer(v["pages"], _I4), np.frombuffer(v["crc"], _U4)
        cluster, imp = np.frombuffer(v["cluster"], _I4), np.frombuffer(v["imp"], _F4)
        off, n = v["off"], len(pages)
        if not isinstance(off, int) or off < 0:
            raise ValueError(f"offset {off!r}")
        if not n or len(crc) != n or len(cluster) != n or len(imp) != n:
            raise ValueError(f"pages, crc, cluster and importance hold {[n, len(crc), len(cluster), len(imp)]} values")
        if (pages[0] if n == 1 else pages.min()) < 0:  # most are one page: no reduction
            raise ValueError(f"page {int(pages.min())}")
        return cls(uid, layer, head, extent_id, off, pages, crc, cluster, imp)

    def describe(self) -> str:
        return f"extent {self.extent_id} (uid {self.uid}, layer {self.layer}, head {self.head})"


_EXTENT_FIELDS, _I4, _U4, _F4 = ("off", "pages", "crc", "cluster", "imp"), *map(np.dtype, ("<i4", "<u4", "<f4"))


@dataclass
class Contents:
    """What :meth:`Catalog.read` found: the intact records and every problem, in words."""

    sequences: list[SeqRecord]
    extents: list[ExtentRecord]
    problems: list[str]
    blocks: list = field(default_factory=list)  # block_catalog.BlockRecord, by namespace uid and key
    block_columns: dict = field(default_factory=dict)  # uid -> block_columns.BlockColumns (Catalog.load)


def name_key(owner: int, ns: str, name: str) -> bytes:
    return b"n:" + UID_KEY.pack(owner) + ns.encode() + b"\0" + name.encode()


def uid_key(uid: int) -> bytes:
    return b"u:" + UID_KEY.pack(uid)


def seal(key: bytes, payload: bytes) -> bytes:
    return payload + CRC.pack(crc_of([key + payload])[0])


def unseal(key: bytes, value: bytes) -> bytes | None:
    """The payload of a sealed value, or None if its checksum does not match."""
    return unseal_many([(key, value)])[0]


def crc_of(items: list[bytes]) -> list[int]:
    """CRC-32C of each item; items of one length share one compiled pass."""
    out = [0] * len(items)
    by_len: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_len.setdefault(len(item), []).append(i)
    for n, idx in by_len.items():
        if n == 0:
            continue  # the CRC of nothing is 0
        buf = np.frombuffer(b"".join(items[i] for i in idx), dtype=np.uint8)
        for i, c in zip(idx, block_crcs(buf, np.arange(len(idx), dtype=np.int64) * n, n).tolist()):
            out[i] = c
    return out


def unseal_many(rows: list[tuple[bytes, bytes]]) -> list[bytes | None]:
    bodies = [k + v[:-CRC.size] for k, v in rows]
    crcs = crc_of(bodies)
    return [
        v[:-CRC.size] if len(v) >= CRC.size and CRC.unpack(v[-CRC.size:])[0] == c else None
        for (k, v), c in zip(rows, crcs)
    ]


def intact_records(rows: list[tuple[bytes, bytes]], decode, show, problems: list[str], progress=None):
    """``decode(key, payload)`` of each sealed row that unseals and decodes, in order; each
    row that does not adds a problem, named by ``show(key)``. ``progress``
    (:class:`~kvstored.notify.Progress`) is told of every :data:`PROGRESS_ROWS` rows."""
    for i, ((key, _), payload) in enumerate(zip(rows, unseal_many(rows))):
        if progress is not None and i % PROGRESS_ROWS == PROGRESS_ROWS - 1:
            progress.add(PROGRESS_ROWS)
        if payload is None:
            problems.append(f"{show(key)}: checksum mismatch")
            continue
        try:
            rec = decode(key, payload)
        except (ValueError, TypeError) as exc:
            problems.append(f"{show(key)}: {exc}")
            continue
        yield rec
    if progress is not None:
        progress.add(len(rows) % PROGRESS_ROWS)


def show_key(key: bytes) -> str:
    """A record key in words, for messages."""
    if key.startswith(b"n:") and len(key) >= 10:
        rest = key[10:].decode("utf-8", "backslashreplace").replace("\0", "/", 1)
        return f"sequence record {rest!r} of owner {UID_KEY.unpack(key[2:10])[0]}"
    if key.startswith(b"u:") and len(key) == 10:
        return f"uid record {UID_KEY.unpack(key[2:])[0]}"
    if len(key) == EXTENT_KEY.size:
        uid, layer, head, ext = EXTENT_KEY.unpack(key)
        return f"extent {ext} (uid {uid}, layer {layer}, head {head})"
    return f"record {key!r}"


def _unpack_map(payload: bytes, fields: tuple[str, ...]) -> dict:
    try:
        v = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"its value is not msgpack ({exc})") from None
    if not isinstance(v, dict):
        raise ValueError("its value is not a map")
    missing = [f for f in fields if f not in v]
    if missing:
        raise ValueError(f"its value lacks {', '.join(repr(m) for m in missing)}")
    return v


def decode_seq(key: bytes, payload: bytes) -> SeqRecord:
    if len(key) < 11 or b"\0" not in key[10:]:
        raise ValueError("its key is not owner + namespace + NUL + name")
    ns, name = key[10:].decode().split("\0", 1)
    v = _unpack_map(payload, ("uid", "geometry", "created"))
    if not isinstance(v["uid"], int) or v["uid"] <= 0:
        raise ValueError(f"uid {v['uid']!r}")
    return SeqRecord(v["uid"], ns, name, Geometry.from_dict(v["geometry"]), float(v["created"]), UID_KEY.unpack(key[2:10])[0])


class Catalog:
    """The LMDB environment under ``meta/``.

    ``data_bytes`` is the size of the data file beside it: when it holds bytes, a
    missing, empty or format-less catalog is refused rather than started anew. A
    writable catalog holds an exclusive ``flock`` on ``data.mdb`` while open.
    """

    def __init__(self, path: Path, map_size: int, durable: bool, readonly: bool = False,
                 data_bytes: int = 0, migrate_owner: int | None = None) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self.env: lmdb.Environment | None = None
        self.num_seqs = self.num_extents = self.num_blocks = 0
        self.blocks = None  # the engine blocks' database; None in a read-only catalog written before them
        self._reserved = 0
        self.next_uid = self.next_extent = 1
        self.format = FORMAT_VERSION  # the store's: an older one only where opened read-only (READS_AS_IS)
        self._handed_out: set[int] = set()  # uids given to sequences not yet added
        # Held through every write transaction and reserve change: the writer thread and the
        # commit thread (kvstored/commits.py) both write, one at a time.
        self.write_lock = threading.RLock()
        data_mdb = path / "data.mdb"
        try:
            meta = read_lmdb_meta(data_mdb)
        except CatalogFileError as exc:
            raise CatalogDamagedError(path, [str(exc)]) from None
        except OSError as exc:
            raise StoreOpenError(f"cannot read {data_mdb}: {exc.strerror}") from None
        if meta is None and (readonly or data_bytes):
            self._refuse_missing(data_mdb, data_bytes, "is missing" if not data_mdb.exists() else "is empty")
        try:
            if not readonly:
                path.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._lock_fd = os.open(data_mdb, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
                lock_exclusive(self._lock_fd, data_mdb, path.parent)
            self.env = lmdb.open(
                str(path), map_size=map_size, max_dbs=5, subdir=True,
                # Readers take a slot in the lock file too: a reader without one is invisible to a
                # live writer, which may then recycle the pages under its snapshot.
                sync=durable, metasync=durable, readonly=readonly, lock=True,
            )
            self.page_size = self.env.stat()["psize"]
            self._open_databases(readonly, data_bytes, migrate_owner)
        except BaseException as exc:
            self.close()
            if isinstance(exc, lmdb.Error):
                raise CatalogDamagedError(path, [f"LMDB cannot open it: {exc}"]) from None
            raise

    def _refuse_missing(self, data_mdb: Path, data_bytes: int, what: str) -> None:
        if not data_bytes:
            raise FormatError(f"{self.path.parent} holds no KVDrive catalog ({data_mdb} {what})")
        data = self.path.parent / DATA_FILE
        raise CatalogMissingError(
            f"{data} holds {data_bytes} bytes of blocks but the catalog {data_mdb} {what}; "
            f"restore {META_DIR}/ from a backup, or move {data} away to start an empty store"
        )

    def _open_databases(self, readonly: bool, data_bytes: int, migrate_owner: int | None) -> None:
        if readonly:
            # Handles opened inside a read transaction close with it.
            try:
                self.meta, self.seqs, self.extents = (self.env.open_db(n, create=False) for n in (b"meta", b"seqs", b"extents"))
            except lmdb.NotFoundError:
                self._refuse_missing(self.path / "data.mdb", data_bytes, "has no format record")
            try:
                self.blocks = self.env.open_db(b"blocks", create=False)
            except lmdb.NotFoundError:
                self.blocks = None
        with self.env.begin(write=not readonly) as txn:
            try:
                if not readonly:
                    self.meta = self.env.open_db(b"meta", txn=txn, create=False)
                found = txn.get(b"format", db=self.meta)
            except lmdb.NotFoundError:
                found = None
            if found is None:
                if readonly or data_bytes or self.env.stat()["entries"]:
                    self._refuse_missing(self.path / "data.mdb", data_bytes or 0, "has no format record")
                self._create(txn)
                return
            try:
                version = int(found)
            except ValueError:
                raise CatalogDamagedError(self.path, [f"the format record holds {found!r}"]) from None
            if not readonly:
                try:
                    self.seqs = self.env.open_db(b"seqs", txn=txn, create=False)
                    self.extents = self.env.open_db(b"extents", txn=txn, create=False)
                except lmdb.NotFoundError:
                    raise CatalogDamagedError(self.path, ["the seqs or extents database is missing"]) from None
                # Made at the first writable open of a store from before engine blocks.
                self.blocks = self.env.open_db(b"blocks", txn=txn)
            if version in MIGRATES and not readonly:
                from kvstored.migrate import migrate  # noqa: PLC0415 - it builds on this module
                migrate(self, txn, version, os.geteuid() if migrate_owner is None else migrate_owner)
            elif version in MIGRATES and version not in READS_AS_IS:
                raise FormatError(
                    f"store format {version} at {self.path}: start kvstored (format {FORMAT_VERSION}) on it once "
                    "to migrate it in place"
                )
            elif version != FORMAT_VERSION and version not in READS_AS_IS:
                raise FormatError(
                    f"store format {version} at {self.path}; this kvstored reads format {FORMAT_VERSION} "
                    f"(and migrates formats {' and '.join(map(str, MIGRATES))})"
                )
            else:
                self.format = version
            self._read_counts(txn)

    def _create(self, txn: lmdb.Transaction) -> None:
        self.meta = self.env.open_db(b"meta", txn=txn)
        self.seqs = self.env.open_db(b"seqs", txn=txn)
        self.extents = self.env.open_db(b"extents", txn=txn)
        self.blocks = self.env.open_db(b"blocks", txn=txn)
        txn.put(b"format", str(FORMAT_VERSION).encode(), db=self.meta)
        self._put_counts(txn)

    def _read_counts(self, txn: lmdb.Transaction) -> None:
        v = self.counts(txn)
        if isinstance(v, str):
            raise CatalogDamagedError(self.path, [v])
        self.num_seqs, self.num_extents = v["seqs"], v["extents"]
        self.next_uid, self.next_extent = v["next_uid"], v["next_extent"]
        self.num_blocks = 0 if self.blocks is None else txn.stat(self.blocks)["entries"]

    def counts(self, txn: lmdb.Transaction) -> dict | str:
        """The counts record as of ``txn``, or what is wrong with it."""
        value = txn.get(b"counts", db=self.meta)
        if value is None:
            return "the counts record is missing"
        payload = unseal(b"counts", value)
        if payload is None:
            return "the counts record: checksum mismatch"
        try:
            v = _unpack_map(payload, ("seqs", "extents", "next_uid", "next_extent"))
        except ValueError as exc:
            return f"the counts record: {exc}"
        if not all(isinstance(v[k], int) and v[k] >= 0 for k in v):
            return f"the counts record holds {v}"
        return v

    def _put_counts(self, txn: lmdb.Transaction) -> None:
        payload = msgpack.packb({"seqs": self.num_seqs, "extents": self.num_extents, "blocks": self.num_blocks,
                                 "next_uid": self.next_uid, "next_extent": self.next_extent})
        txn.put(b"counts", seal(b"counts", payload), db=self.meta)

    # ------------------------------------------------------------ reading

    def read(self, data_bytes: int | None = None, columns: bool = False, first_damage: bool = False) -> Contents:
        """Every intact record, checked, in one read transaction; ``problems`` names the rest.
        ``data_bytes`` (the data file's size), when known, bounds every extent. With
        ``columns``, a sound catalog's block namespaces come as columns, not records (and
        with ``first_damage``, a damaged one's first damaged row may be named alone: see
        :func:`~kvstored.catalog_check.check`)."""
        with self.env.begin() as txn:
            from kvstored.catalog_check import check  # it reads this module's records

            return check(self, txn, data_bytes, columns, first_damage)

    def load(self, data_bytes: int | None = None) -> Contents:
        """:meth:`read` with columns, refusing a catalog with any problem (naming the first
        damaged row alone where it can: the start is refused either way)."""
        contents = self.read(data_bytes, columns=True, first_damage=True)
        if contents.problems:
            raise CatalogDamagedError(self.path, contents.problems)
        return contents

    def sequences(self) -> list[SeqRecord]:
        return self.read().sequences

    def iter_extents(self) -> Iterator[ExtentRecord]:
        yield from self.read().extents

    def extent_offset(self, txn: lmdb.Transaction, rec: ExtentRecord) -> int | None:
        """The offset an extent's record holds now (None if it is gone or damaged)."""
        key = EXTENT_KEY.pack(rec.uid, rec.layer, rec.head, rec.extent_id)
        value = txn.get(key, db=self.extents)
        payload = None if value is None else unseal(key, value)
        try:
            return None if payload is None else ExtentRecord.decode(key, payload).offset
        except ValueError:
            return None

    @property
    def used_bytes(self) -> int:
        """Bytes of data.mdb that LMDB's pages use (it never shrinks the file)."""
        return (self.env.info()["last_pgno"] + 1) * self.page_size

    # ------------------------------------------------------------ writer thread (its transactions and the commit thread's: under write_lock)

    def ensure_reserve(self) -> bool:
        """Keep disk space for deletes allocated in data.mdb ahead of LMDB's pages; False
        if the filesystem cannot give it (creates and puts are then refused).

        LMDB never truncates its file, so blocks allocated here stay allocated until
        LMDB writes pages into them.
        """
        if self._reserve_holds():  # most calls: no lock, so a put's prepare never waits for a commit here
            return True
        with self.write_lock:
            return self._ensure_reserve()

    def _reserve_holds(self) -> bool:
        used = self.used_bytes
        return self._reserved >= used + max(RESERVE_MIN_BYTES, used // RESERVE_SHARE)

    def _ensure_reserve(self) -> bool:
        used = self.used_bytes
        step = max(RESERVE_MIN_BYTES, used // RESERVE_SHARE)
        if self._reserved >= used + step:
            return True
        for size in (used + 2 * step, used + step):  # grow with slack, so not at every commit
            try:
                if reserve(self._lock_fd, size):
                    self._reserved = size
                    return True
            except OSError as exc:
                if exc.errno != errno.EFBIG:
                    raise
                # A file size limit, not a full disk: nothing to refuse puts for, no reserve to keep.
                log.warning("a file size limit keeps %s from holding a %s reserve for deletes", self.path, format_size(size))
                self._reserved = size
                return True
        return False

    @contextmanager
    def begin(self) -> Iterator[lmdb.Transaction]:
        """A write transaction that also rewrites the counts record; the counts roll back if it fails."""
        with self.write_lock:
            saved = (self.num_seqs, self.num_extents, self.num_blocks)
            try:
                with self.env.begin(write=True) as txn:
                    yield txn
                    self._put_counts(txn)
            except BaseException:
                self.num_seqs, self.num_extents, self.num_blocks = saved
                raise

    def new_uid(self) -> int:
        """A uid for a new sequence: random in [1, UID_LIMIT), neither held by the catalog
        nor handed out already for a sequence not yet added (writer thread)."""
        with self.env.begin(db=self.seqs) as txn:
            while True:
                uid = 1 + secrets.randbelow(UID_LIMIT - 1)
                if uid not in self._handed_out and txn.get(uid_key(uid)) is None:
                    break
        self._handed_out.add(uid)
        self.next_uid = max(self.next_uid, uid + 1)
        return uid

    def add_sequence(self, txn: lmdb.Transaction, rec: SeqRecord) -> None:
        self._handed_out.discard(rec.uid)
        value = msgpack.packb({"uid": rec.uid, "geometry": rec.geometry.to_dict(), "created": rec.created})
        key = rec.key
        txn.put(key, seal(key, value), db=self.seqs)
        txn.put(uid_key(rec.uid), seal(uid_key(rec.uid), key), db=self.seqs)
        self.num_seqs += 1

    def delete_sequence(self, txn: lmdb.Transaction, rec: SeqRecord) -> None:
        if txn.delete(rec.key, db=self.seqs):
            self.num_seqs -= 1
        txn.delete(uid_key(rec.uid), db=self.seqs)
        cursor = txn.cursor(db=self.extents)
        prefix = UID_KEY.pack(rec.uid)
        if cursor.set_range(prefix):
            while cursor.key().startswith(prefix):
                if not cursor.delete():
                    break
                self.num_extents -= 1
        if self.blocks is not None:  # a block namespace's keys go with it
            cursor = txn.cursor(db=self.blocks)
            if cursor.set_range(prefix):
                while cursor.key().startswith(prefix):
                    if not cursor.delete():
                        break
                    self.num_blocks -= 1

    def add_extents(self, txn: lmdb.Transaction, records: list[ExtentRecord]) -> None:
        encoded = [r.encode() for r in records]
        for (key, payload), crc in zip(encoded, crc_of([k + p for k, p in encoded])):
            txn.put(key, payload + CRC.pack(crc), db=self.extents)
        self.num_extents += len(records)

    def add_extent(self, txn: lmdb.Transaction, rec: ExtentRecord) -> None:
        self.add_extents(txn, [rec])

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
