"""Catalogs of an older format, rewritten in this one at the first writable open.

Each migration runs inside the write transaction that opens the catalog and then writes
its new format record, so a crash leaves the old catalog whole and the next start
migrates it again. A record it cannot read refuses the migration, and so the start,
naming the record; the catalog is then left as it was.

- format 2: no record checksums, no owners in the sequences' keys, counts in two bare
  records;
- format 3: block records keyed by the engine's key (see
  :mod:`kvstored.block_catalog` for why they are now keyed by extent id).
"""

from __future__ import annotations

import itertools
import logging

import lmdb

from kvdrive.layout.format import FORMAT_VERSION
from kvdrive.layout.geometry import Geometry
from kvstored.block_catalog import BLOCK_KEY, BlockRecord, sealed_rows
from kvstored.catalog import (
    CRC, PROGRESS_ROWS, Catalog, CatalogDamagedError, ExtentRecord, SeqRecord, _unpack_map, crc_of, intact_records,
    show_key,
)
from kvstored.notify import Progress

log = logging.getLogger(__name__)

MIGRATION_DB = b"blocks-format4"  # where block records are rewritten before they replace the old


def migrate(cat: Catalog, txn: lmdb.Transaction, version: int, owner: int) -> None:
    """Rewrite catalog ``cat`` of format ``version`` (2 or 3) in this format inside ``txn``;
    a format-2 catalog's sequences become ``owner`` 's."""
    problems: list[str] = []
    if version == 2:
        _format2(cat, txn, owner, problems)
    else:
        cat._read_counts(txn)  # rewritten as they are read: the migration changes no count
    rewritten = 0 if problems else _block_records(cat, txn, problems)
    if problems:
        raise CatalogDamagedError(cat.path, [f"cannot migrate it to format {FORMAT_VERSION}: {p}" for p in problems])
    txn.put(b"format", str(FORMAT_VERSION).encode(), db=cat.meta)
    cat._put_counts(txn)
    log.info("catalog %s: format %d migrated to %d (%d block records rewritten)", cat.path, version, FORMAT_VERSION,
             rewritten)


def _format2(cat: Catalog, txn: lmdb.Transaction, owner: int, problems: list[str]) -> None:
    """Checksums on every record, owners in the name keys, one counts record; nothing
    rewritten where a record cannot be read (``problems`` names it)."""
    seq_rows = list(txn.cursor(db=cat.seqs))
    ext_rows = list(txn.cursor(db=cat.extents))
    names = {k for k, _ in seq_rows if k.startswith(b"n:")}
    records = []
    for key, value in seq_rows:
        if key.startswith(b"u:"):
            if value not in names:
                problems.append(f"format-2 uid record {key[2:].hex()} names {value!r}, which does not exist")
            continue
        try:
            ns, name = key[2:].decode().split("\0", 1)
            v = _unpack_map(value, ("uid", "geometry", "created"))
            records.append(SeqRecord(v["uid"], ns, name, Geometry.from_dict(v["geometry"]), float(v["created"]), owner))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            problems.append(f"format-2 record {key!r}: {exc}")
    for key, value in ext_rows:
        try:
            ExtentRecord.decode(key, value)
        except (ValueError, TypeError) as exc:
            problems.append(f"format-2 {show_key(key)}: {exc}")
    if problems:
        return
    txn.drop(cat.seqs, delete=False)
    cat.num_seqs = cat.num_extents = 0
    for rec in records:
        cat.add_sequence(txn, rec)
    crcs = crc_of([k + v for k, v in ext_rows])
    for (key, value), crc in zip(ext_rows, crcs):
        txn.put(key, value + CRC.pack(crc), db=cat.extents)
    cat.num_extents = len(ext_rows)
    cat.next_uid = int(txn.pop(b"next_uid", db=cat.meta) or b"1")
    cat.next_extent = int(txn.pop(b"next_extent", db=cat.meta) or b"1")


def _block_records(cat: Catalog, txn: lmdb.Transaction, problems: list[str]) -> int:
    """Rewrite format-3 block records keyed by extent id; how many there were. The new
    records go to a database of their own first (a format-3 key, a uid and an engine key
    of 8 bytes, can equal a new one), then replace the old in key order: a few thousand
    rows are held in memory at a time, however many blocks the store holds."""
    total = txn.stat(cat.blocks)["entries"]
    if not total:
        return 0
    log.info("catalog %s: rewriting %d block records in format %d, in one transaction", cat.path, total,
             FORMAT_VERSION)
    # Told of the first pass only: putting the new records in place takes a tenth of its time.
    progress = Progress(f"catalog {cat.path}: migrating block records", "rewrote", total, log)
    temp = cat.env.open_db(MIGRATION_DB, txn=txn)
    cursor, count = iter(txn.cursor(db=cat.blocks)), 0
    while chunk := list(itertools.islice(cursor, PROGRESS_ROWS)):
        recs = intact_records(chunk, BlockRecord.decode_format3, lambda k: f"format-3 block record {k[:40]!r}", problems)
        for key, value in sealed_rows([r.encode() for r in recs]):
            if not txn.put(key, value, db=temp, overwrite=False):
                problems.append(f"two format-3 block records name extent {BLOCK_KEY.unpack(key)[1]} first")
        count += len(chunk)
        progress.add(len(chunk))
    if not problems:
        txn.drop(cat.blocks, delete=False)
        for key, value in txn.cursor(db=temp):
            txn.put(key, value, db=cat.blocks, append=True)
    txn.drop(temp, delete=True)
    return count
