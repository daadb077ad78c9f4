"""The catalog's consistency check: every record decoded, every cross-reference followed.

Run at every open (``Catalog.read``/``Catalog.load``) and by ``kvstore-inspect``: what it
finds is a list of problems in words, one per damaged or disagreeing record, so that a
damaged catalog is refused in sentences that name what is wrong.
"""

from __future__ import annotations

from operator import itemgetter

import lmdb
import numpy as np

from kvdrive.layout.format import FORMAT_VERSION
from kvstored import block_columns
from kvstored.block_catalog import BlockRecord, check_blocks, show_block_key
from kvstored.block_columns import BlockLoad, Unsound
from kvstored.catalog import UID_KEY, Catalog, Contents, ExtentRecord, SeqRecord, decode_seq, intact_records, show_key, unseal_many
from kvstored.notify import Progress


def check(cat: Catalog, txn: lmdb.Transaction, data_bytes: int | None, columns: bool = False,
          first_damage: bool = False) -> Contents:
    """Everything the catalog holds, decoded, with every problem found: damaged records,
    uid records that disagree, extents of no sequence or past the data file, overlaps,
    and counts that do not match. With ``columns``, block namespaces come as
    :class:`~kvstored.block_columns.BlockColumns` in ``block_columns`` where every one of
    their rows is sound (the checks are the same; a damaged catalog is read record by record).
    With ``first_damage`` too (a start, which refuses any damage), a row the columns could
    not take that the record check names by itself is named alone, and nothing else is
    read: record by record, every row of a store of millions of blocks would cost about
    2 KB and 20 us a block."""
    problems: list[str] = []
    # A store of small blocks holds millions of records: minutes, under a unit's start timeout.
    num_ext_records = txn.stat(cat.extents)["entries"]
    num_block_records = txn.stat(cat.blocks)["entries"] if cat.blocks is not None else 0
    progress = Progress("catalog", "checked", num_ext_records + num_block_records, unit=" records")
    by_key, by_uid = _check_sequences(cat, txn, problems)
    current = cat.format == FORMAT_VERSION  # else an older one, read as it is (Catalog's READS_AS_IS)
    fast = block_columns.read(cat, txn, by_uid, data_bytes, progress) if columns and current else None
    if isinstance(fast, Unsound):
        named = _named(fast, by_uid, data_bytes) if first_damage else []
        if named:  # with what the sequences' check found before
            return Contents([], [], problems + named, [], {})
        fast = None
    if fast is None:
        progress.done = 0  # the rows read again, one by one
        ext_rows = list(txn.cursor(db=cat.extents))
        blk_rows = list(txn.cursor(db=cat.blocks)) if cat.blocks is not None else []
    else:
        ext_rows, blk_rows = fast.other_rows, []
    extents = _check_extents(ext_rows, by_uid, data_bytes, problems, progress)
    problems.extend(_overlaps(extents, by_uid, fast))
    decode = BlockRecord.decode if current else BlockRecord.decode_format3
    blocks = check_blocks(blk_rows, by_uid, extents, problems, progress, decode) if cat.blocks is not None else []
    top = max([e.extent_id for e in extents] + [fast.max_extent_id if fast else 0])
    _check_counts(cat, txn, len(by_key), num_ext_records, by_uid, top, problems)
    counts = cat.counts(txn)
    if isinstance(counts, dict) and counts.get("blocks", num_block_records) != num_block_records:
        problems.append(f"the counts record says {counts['blocks']} blocks, the catalog holds {num_block_records}")
    return Contents(sorted(by_key.values(), key=lambda s: (s.ns, s.name, s.owner)), extents, problems, blocks,
                    fast.columns if fast else {})


def _named(unsound: Unsound, by_uid: dict[int, SeqRecord], data_bytes: int | None) -> list[str]:
    """The problems the record check names in the rows of ``unsound`` by themselves, in its words."""
    problems: list[str] = []
    if unsound.db == "extents":
        _check_extents(unsound.rows, by_uid, data_bytes, problems)
    elif unsound.db == "blocks":
        list(intact_records(unsound.rows, BlockRecord.decode, show_block_key, problems))
    return problems


def _check_sequences(cat: Catalog, txn: lmdb.Transaction, problems: list[str]):
    """The sequence records by key and by uid; their problems appended to ``problems``."""
    by_key: dict[bytes, SeqRecord] = {}
    uid_refs: dict[int, bytes] = {}
    rows = list(txn.cursor(db=cat.seqs))
    for (key, value), payload in zip(rows, unseal_many(rows)):
        if payload is None:
            problems.append(f"{show_key(key)}: checksum mismatch")
        elif key.startswith(b"n:"):
            try:
                by_key[key] = decode_seq(key, payload)
            except (ValueError, TypeError, UnicodeDecodeError) as exc:
                problems.append(f"{show_key(key)}: {exc}")
        elif key.startswith(b"u:") and len(key) == 10:
            uid_refs[UID_KEY.unpack(key[2:])[0]] = payload
        else:
            problems.append(f"{show_key(key)}: not a sequence or uid record")
    by_uid: dict[int, SeqRecord] = {}
    for key, rec in by_key.items():
        where = f"sequence {rec.ns}/{rec.name} (uid {rec.uid})"
        if rec.uid in by_uid:
            problems.append(f"{where} shares its uid with {by_uid[rec.uid].ns}/{by_uid[rec.uid].name}")
        ref = uid_refs.get(rec.uid)
        if ref is None:
            problems.append(f"{where} has no uid record")
        elif ref != key:
            problems.append(f"{where}: uid record {rec.uid} names {show_key(ref)} instead")
        by_uid.setdefault(rec.uid, rec)
    for uid, ref in uid_refs.items():
        if ref not in by_key:
            problems.append(f"uid record {uid} names {show_key(ref)}, which does not exist")
    return by_key, by_uid


def _check_extents(rows: list[tuple[bytes, bytes]], by_uid: dict[int, SeqRecord], data_bytes: int | None,
                   problems: list[str], progress: Progress | None = None) -> list[ExtentRecord]:
    """The extent records among ``rows`` that decode and fit their sequence and the data file."""
    extents: list[ExtentRecord] = []
    for ext in intact_records(rows, ExtentRecord.decode, show_key, problems, progress):
        seq = by_uid.get(ext.uid)
        if seq is None:
            problems.append(f"{ext.describe()} belongs to no known sequence")
            continue
        g = seq.geometry
        if ext.layer >= g.num_layers or ext.head >= g.num_kv_heads:
            problems.append(f"{ext.describe()} lies outside {seq.ns}/{seq.name}'s {g.num_layers} layers x {g.num_kv_heads} heads")
            continue
        end = ext.offset + len(ext.pages) * g.block_bytes
        if data_bytes is not None and end > data_bytes:
            problems.append(f"{ext.describe()} ends at byte {end}, past the end of the {data_bytes}-byte data file")
        extents.append(ext)
    return extents


def _check_counts(cat: Catalog, txn: lmdb.Transaction, num_seqs: int, num_ext_records: int,
                  by_uid: dict[int, SeqRecord], top_extent: int, problems: list[str]) -> None:
    """The counts record against what the catalog holds (``top_extent``: its highest extent id)."""
    counts = cat.counts(txn)
    if isinstance(counts, str):
        problems.append(counts)
    else:
        if (counts["seqs"], counts["extents"]) != (num_seqs, num_ext_records):
            problems.append(f"the counts record says {counts['seqs']} sequences and {counts['extents']} extents, "
                            f"the catalog holds {num_seqs} and {num_ext_records}")
        if by_uid and max(by_uid) >= counts["next_uid"]:
            problems.append(f"the next uid to hand out ({counts['next_uid']}) is already taken")
        # next_extent is the last extent id handed out (the writer increments it first).
        if top_extent > counts["next_extent"]:
            problems.append(f"extent id {top_extent} is past the last one handed out ({counts['next_extent']})")


def _overlaps(extents: list[ExtentRecord], by_uid: dict[int, SeqRecord], fast: BlockLoad | None = None) -> list[str]:
    """Every extent that overlaps one before it in the data file, in words. The block parts
    of ``fast`` are checked as arrays first, and named only if something overlaps."""
    if fast is not None and len(fast.starts):
        starts = np.concatenate([fast.starts, np.fromiter((e.offset for e in extents), np.int64, len(extents))])
        ends = np.concatenate([fast.ends, np.fromiter((e.offset + len(e.pages) * by_uid[e.uid].geometry.block_bytes
                                                       for e in extents), np.int64, len(extents))])
        order = np.lexsort((ends, starts))
        if not (starts[order][1:] < np.maximum.accumulate(ends[order])[:-1]).any():
            return []
        extents = extents + fast.records()
    spans = sorted(((e.offset, e.offset + len(e.pages) * by_uid[e.uid].geometry.block_bytes, e) for e in extents),
                   key=itemgetter(0, 1))
    out = []
    reach, last = -1, None
    for start, end, ext in spans:
        if start < reach:
            out.append(f"{ext.describe()} at [{start}, {end}) overlaps {last.describe()}")
        if end > reach:
            reach, last = end, ext
    return out
