"""Start-up reads the block namespaces' catalog rows as columns, not a record each.

A store of 64 KiB engine blocks holds tens of millions of blocks, each two catalog rows
or more (its block record and one extent record per part). Decoded one by one (msgpack,
a record object, four small arrays, dict and set entries) they took about 14 us a block
at every start. Here the rows of every block namespace are checked in bulk:

- their checksums in one compiled pass per row length;
- their values by a compiled reader of exactly the form the writer makes
  (:func:`~kvstored.block_catalog.part_rows`, :func:`~kvstored.block_catalog.block_rows`);
- every cross-reference the record check follows, as array comparisons: each block's
  parts exist, hold its slot and belong to no other block; slots are unique in their
  namespace; every extent lies in its namespace's geometry and in the data file.

Anything else (a row of another form, a checksum that fails, any disagreement) and the
columns are dropped: the record-by-record check (:mod:`kvstored.catalog_check`) runs as
before and names each problem in words. So this changes how long a sound catalog takes
to open, never what kvstore-inspect tells of a damaged one. A start, which refuses any
damage, names the first damaged row alone where the record check names it by itself,
in the same words, rather than read every record of millions (:class:`Unsound`).
Overlaps are left to that module, over the spans given here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import itemgetter

import numba
import numpy as np

from kvdrive.protocol import jit_cache
from kvstored import catalog
from kvstored.block_catalog import (
    BLOCK_EXT, BLOCK_HEAD, BLOCK_KEY, BLOCK_KEY_BIN, PART_CRC, PART_HEAD, PART_PAGES, PART_TAIL,
)
from kvstored.catalog import BLOCKS_NAME, CRC, EXTENT_KEY, UID_KEY, ExtentRecord, SeqRecord
from kvstored.checksum import block_crcs

jit_cache.use("kvstored")  # before the definitions below: they cache where it says

_NONE = np.int64(-1)


def _bytes(s: bytes) -> np.ndarray:
    return np.frombuffer(s, np.uint8).copy()


# The constant parts of a block part's extent value and of a block record's value, as the writer lays them out.
_PART_HEAD, _PART_PAGES, _PART_CRC, _PART_TAIL = map(_bytes, (PART_HEAD, PART_PAGES, PART_CRC, PART_TAIL))
_BLOCK_HEAD, _BLOCK_EXT, _BLOCK_KEY = map(_bytes, (BLOCK_HEAD, BLOCK_EXT, BLOCK_KEY_BIN))


@numba.njit(nogil=True, cache=True)
def _expect(buf, i, end, tpl):  # pragma: no cover - compiled
    """The index past ``tpl`` if ``buf[i:]`` starts with it, else -1."""
    if i < 0 or i + len(tpl) > end:
        return _NONE
    for k in range(len(tpl)):
        if buf[i + k] != tpl[k]:
            return _NONE
    return np.int64(i + len(tpl))


@numba.njit(nogil=True, cache=True)
def _uint(buf, i, end):  # pragma: no cover - compiled
    """A msgpack unsigned int below 2**63 at ``buf[i]``: (value, the index past it), or (0, -1)."""
    if i < 0 or i >= end:
        return np.int64(0), _NONE
    b = buf[i]
    if b < 0x80:
        return np.int64(b), np.int64(i + 1)
    width = 1 if b == 0xCC else 2 if b == 0xCD else 4 if b == 0xCE else 8 if b == 0xCF else 0
    if width == 0 or i + 1 + width > end:
        return np.int64(0), _NONE
    v = np.uint64(0)
    for k in range(width):
        v = (v << np.uint64(8)) | np.uint64(buf[i + 1 + k])
    if v >= np.uint64(1) << np.uint64(63):
        return np.int64(0), _NONE
    return np.int64(v), np.int64(i + 1 + width)


@numba.njit(nogil=True, cache=True)
def _le4(buf, i):  # pragma: no cover - compiled
    return np.int64(buf[i]) | (np.int64(buf[i + 1]) << 8) | (np.int64(buf[i + 2]) << 16) | (np.int64(buf[i + 3]) << 24)


@numba.njit(nogil=True, cache=True)
def _parse_parts(buf, starts, ends, head, pages, crc, tail, off_out, page_out, crc_out):  # pragma: no cover
    """Each value ``buf[starts[r]:ends[r]]`` read as a one-page extent with no cluster and
    no importance; whether it is exactly that form, with a page that is not negative."""
    ok = np.zeros(len(starts), np.bool_)
    for r in range(len(starts)):
        end = ends[r]
        i = _expect(buf, starts[r], end, head)
        off, i = _uint(buf, i, end)
        i = _expect(buf, i, end, pages)
        if i < 0 or i + 4 > end:
            continue
        page = _le4(buf, i)
        i = _expect(buf, i + 4, end, crc)
        if i < 0 or i + 4 > end:
            continue
        crc_out[r] = _le4(buf, i)
        if _expect(buf, i + 4, end, tail) != end or page >= 1 << 31:
            continue
        off_out[r], page_out[r], ok[r] = off, page, True
    return ok


@numba.njit(nogil=True, cache=True)
def _parse_blocks(buf, starts, ends, parts, head, ext, key, slot_out, ext_out, key_out):  # pragma: no cover
    """Each value read as a block record of ``parts[r]`` extent ids (the engine key: from
    ``key_out[r]`` to the value's end); whether it is exactly that form."""
    ok = np.zeros(len(starts), np.bool_)
    for r in range(len(starts)):
        end = ends[r]
        slot, i = _uint(buf, _expect(buf, starts[r], end, head), end)
        i = _expect(buf, i, end, ext)
        if i < 0 or i >= end:
            continue
        b = buf[i]
        i += 1
        if 0x90 <= b <= 0x9F:
            n = np.int64(b) - 0x90
        elif b == 0xDC and i + 2 <= end:  # an array of 16 or more
            n = (np.int64(buf[i]) << 8) | np.int64(buf[i + 1])
            i += 2
        else:
            continue
        if n != parts[r] or n > ext_out.shape[1]:
            continue
        for p in range(n):
            v, i = _uint(buf, i, end)
            ext_out[r, p] = v
        i = _expect(buf, i, end, key)
        if i < 0 or i >= end or buf[i] == 0 or i + 1 + buf[i] != end:
            continue
        if slot >= 1 << 31 or (n and ext_out[r, :n].min() <= 0):
            continue
        slot_out[r], key_out[r], ok[r] = slot, i + 1, True
    return ok


@numba.njit(nogil=True, cache=True)
def _gather(buf, starts, lens, out):  # pragma: no cover - compiled
    """``buf[starts[i]:starts[i] + lens[i]]``, one after another, into ``out``."""
    k = 0
    for i in range(len(starts)):
        for j in range(lens[i]):
            out[k + j] = buf[starts[i] + j]
        k += lens[i]


def part_record(uid: int, layer: int, ext_id: int, offset: int, slot: int, crc: int) -> ExtentRecord:
    """Part ``layer`` of a block as the extent record the catalog holds for it: one page
    (its slot), no cluster, no importance (for messages, and for tools that show records)."""
    return ExtentRecord(uid, layer, 0, int(ext_id), int(offset), np.array([slot], "<i4"), np.array([crc], "<u4"),
                        np.zeros(1, "<i4"), np.zeros(1, "<f4"))


@dataclass
class BlockColumns:
    """One block namespace's catalog, checked: block ``keys[i]`` is in slot ``slots[i]``,
    its part ``p`` in extent ``ext_ids[i, p]``, at ``offsets[i, p]`` in the data file, with
    checksum ``crcs[i, p]``. ``keys``: rows of one byte array where the keys are all of one
    length (as an engine's hashes are), else ``bytes`` objects."""

    keys: list[bytes] | np.ndarray
    slots: np.ndarray
    ext_ids: np.ndarray
    offsets: np.ndarray
    crcs: np.ndarray


@dataclass
class BlockLoad:
    """What :func:`read` made of the rows: the block namespaces by uid, the extent rows of
    other sequences (left to the record check), and every block part's data span."""

    columns: dict[int, BlockColumns]
    other_rows: list[tuple[bytes, bytes]]
    starts: np.ndarray
    ends: np.ndarray
    max_extent_id: int

    def records(self) -> list[ExtentRecord]:
        """The block parts as extent records (for a damaged catalog's messages only)."""
        return [part_record(uid, p, c.ext_ids[i, p], c.offsets[i, p], c.slots[i], c.crcs[i, p])
                for uid, c in self.columns.items()
                for i, p in itertools.product(range(len(c.slots)), range(c.ext_ids.shape[1]))]


class _Rows:
    """Catalog rows joined in one buffer, key then value, row after row."""

    def __init__(self, rows: list[tuple[bytes, bytes]]) -> None:
        n = len(rows)
        self.raw = b"".join(itertools.chain.from_iterable(rows))
        self.buf = np.frombuffer(self.raw, np.uint8)
        self.klen = np.fromiter(map(len, map(itemgetter(0), rows)), np.int64, n)
        vlen = np.fromiter(map(len, map(itemgetter(1), rows)), np.int64, n)
        self.start = np.zeros(n, np.int64)
        np.cumsum((self.klen + vlen)[:-1], out=self.start[1:])
        self.vend = self.start + self.klen + vlen - CRC.size  # the value's end, without its checksum

    def be(self, at: np.ndarray, width: int) -> np.ndarray:
        """The big-endian unsigned int of ``width`` (1, 2, 4 or 8) bytes at each of ``at``:
        the bytes of each gathered in a row and read as one number."""
        return self.buf[at[:, None] + np.arange(width)].view(f">u{width}").reshape(-1).astype(np.uint64)

    def sealed(self, at: np.ndarray) -> bool:
        """Whether rows ``at`` all hold their checksum (what :func:`~kvstored.catalog.unseal_many` checks)."""
        start, vend = self.start[at], self.vend[at]
        if (vend < start + self.klen[at]).any():
            return False
        stored = self.buf[vend[:, None] + np.arange(CRC.size)].copy().view("<u4").ravel()
        body = vend - start
        for n in np.unique(body).tolist():
            which = np.flatnonzero(body == n)
            if (block_crcs(self.buf, start[which], n) != stored[which]).any():
                return False
        return True


class _Namespaces:
    """The block namespaces' geometry as arrays, by the namespace's place in ``uids``."""

    def __init__(self, ns: dict[int, SeqRecord]) -> None:
        self.uids = np.array(sorted(ns), np.uint64)
        g = [ns[u].geometry for u in self.uids.tolist()]
        self.parts = np.array([x.num_layers for x in g], np.int64)
        self.heads = np.array([x.num_kv_heads for x in g], np.int64)
        self.bb = np.array([x.block_bytes for x in g], np.int64)

    def find(self, raw: np.ndarray) -> np.ndarray:
        """Each uid's place, or -1 for a uid of no block namespace."""
        at = np.minimum(np.searchsorted(self.uids, raw), len(self.uids) - 1)
        return np.where(self.uids[at] == raw, at, -1)


def _chunks(cursor):
    """The cursor's rows, :data:`~kvstored.catalog.PROGRESS_ROWS` at a time (a look at the progress each)."""
    it, rows = iter(cursor), catalog.PROGRESS_ROWS
    while chunk := list(itertools.islice(it, rows)):
        yield chunk


@dataclass
class Unsound:
    """The rows of the first chunk the columns could not take (``db``: ``extents`` or
    ``blocks``; for extents, only the block namespaces' rows), or none where the rows were
    each sound but disagree (``db`` ``join``): what :func:`read` met instead of columns."""

    db: str
    rows: list[tuple[bytes, bytes]]


def read(cat, txn, by_uid: dict[int, SeqRecord], data_bytes: int | None, progress=None) -> BlockLoad | Unsound | None:
    """The block namespaces' rows as columns, if every one is sound; :class:`Unsound` if
    any is not; None if there are no block namespaces. Either way but the first, the record
    check reads every row. Rows are read a few thousand at a time: what is kept of them is
    columns and engine keys."""
    ns = {uid: s for uid, s in by_uid.items() if s.name == BLOCKS_NAME}
    if not ns or cat.blocks is None:
        return None
    spaces = _Namespaces(ns)
    other: list[tuple[bytes, bytes]] = []
    parts = []
    for chunk in _chunks(txn.cursor(db=cat.extents)):
        rows = _Rows(chunk)
        uid = np.zeros(len(chunk), np.uint64)
        has = np.flatnonzero(rows.klen >= UID_KEY.size)
        uid[has] = rows.be(rows.start[has], UID_KEY.size)
        mine = np.isin(uid, spaces.uids)
        other.extend(itertools.compress(chunk, (~mine).tolist()))
        got = _read_parts(rows, np.flatnonzero(mine), spaces, data_bytes)
        if got is None:
            return Unsound("extents", list(itertools.compress(chunk, mine.tolist())))
        parts.append(got)
        if progress is not None:
            progress.add(int(np.count_nonzero(mine)))
    e = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else _read_parts(_Rows([]), [], spaces, None)
    blocks = []
    for chunk in _chunks(txn.cursor(db=cat.blocks)):
        got = _read_block_rows(chunk, spaces)
        if got is None:
            return Unsound("blocks", chunk)
        blocks.append(got)
        if progress is not None:
            progress.add(len(chunk))
    columns = _join(blocks, e, spaces)
    if columns is None:
        return Unsound("join", [])
    return BlockLoad(columns, other, e["off"], e["off"] + spaces.bb[e["u"]], int(e["id"].max()) if len(e["id"]) else 0)


def _read_parts(rows: _Rows, at: np.ndarray, spaces: _Namespaces, data_bytes: int | None) -> dict | None:
    """Rows ``at`` (extents of block namespaces) as columns, if each is sound and in its place."""
    at = np.asarray(at, np.int64)
    if len(at) and ((rows.klen[at] != EXTENT_KEY.size).any() or not rows.sealed(at)):
        return None
    n, start = len(at), rows.start[at]
    off, page, crc = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    ok = _parse_parts(rows.buf, start + EXTENT_KEY.size, rows.vend[at], _PART_HEAD, _PART_PAGES, _PART_CRC,
                      _PART_TAIL, off, page, crc)
    u = spaces.find(rows.be(start, 8))
    layer, head = rows.be(start + 8, 4).astype(np.int64), rows.be(start + 12, 4).astype(np.int64)
    if not ok.all() or (layer >= spaces.parts[u]).any() or (head >= spaces.heads[u]).any():
        return None
    if data_bytes is not None and (off + spaces.bb[u] > data_bytes).any():
        return None
    return {"u": u, "layer": layer, "off": off, "page": page, "crc": crc.astype(np.uint32),
            "id": rows.be(start + 16, 8).astype(np.int64)}


def _read_block_rows(chunk: list[tuple[bytes, bytes]], spaces: _Namespaces) -> dict | None:
    """Block records as columns (namespace, slot, extent ids, key), if each is sound."""
    rows = _Rows(chunk)
    n = len(chunk)
    if (rows.klen != BLOCK_KEY.size).any() or not rows.sealed(np.arange(n)):
        return None
    u = spaces.find(rows.be(rows.start, UID_KEY.size))
    if (u < 0).any():
        return None
    slot, ids, key_at = np.zeros(n, np.int64), np.zeros((n, int(spaces.parts.max())), np.int64), np.zeros(n, np.int64)
    if not _parse_blocks(rows.buf, rows.start + rows.klen, rows.vend, spaces.parts[u], _BLOCK_HEAD, _BLOCK_EXT,
                         _BLOCK_KEY, slot, ids, key_at).all():
        return None
    if (ids[:, 0] != rows.be(rows.start + UID_KEY.size, 8).astype(np.int64)).any():
        return None  # keyed by another extent than its first part's
    klen = rows.vend - key_at
    flat = np.empty(int(klen.sum()), np.uint8)
    _gather(rows.buf, key_at, klen, flat)
    return {"u": u, "slot": slot, "ids": ids, "kflat": flat, "klen": klen}


def _join(blocks: list[dict], e: dict, spaces: _Namespaces) -> dict[int, BlockColumns] | None:
    """Each namespace's blocks with their parts' extents, if every part is found where its
    block says, and every extent is a part of exactly one block."""
    u = np.concatenate([b["u"] for b in blocks]) if blocks else np.zeros(0, np.int64)
    slot = np.concatenate([b["slot"] for b in blocks]) if blocks else np.zeros(0, np.int64)
    ids = np.concatenate([b["ids"] for b in blocks]) if blocks else np.zeros((0, 1), np.int64)
    flat = np.concatenate([b["kflat"] for b in blocks]) if blocks else np.zeros(0, np.uint8)
    klen = np.concatenate([b["klen"] for b in blocks]) if blocks else np.zeros(0, np.int64)
    koff = np.zeros(len(klen) + 1, np.int64)
    np.cumsum(klen, out=koff[1:])
    order = np.argsort(e["id"], kind="stable")
    sorted_ids = e["id"][order]
    if (sorted_ids[1:] == sorted_ids[:-1]).any():
        return None  # ids repeat across namespaces: the record check tells them apart
    columns, claimed = {}, np.zeros(len(sorted_ids), bool)
    found = 0
    for x in np.flatnonzero(np.bincount(u)).tolist():
        r = np.flatnonzero(u == x)
        want = ids[r, :spaces.parts[x]]
        if not len(sorted_ids) or _repeats(slot[r]):
            return None
        pos = np.minimum(np.searchsorted(sorted_ids, want), len(sorted_ids) - 1)
        j = order[pos]
        if ((sorted_ids[pos] != want) | (e["u"][j] != x) | (e["layer"][j] != np.arange(spaces.parts[x]))
                | (e["page"][j] != slot[r, None])).any():
            return None
        claimed[pos] = True  # each part found is one extent (the ids are unique): its place marked
        found += want.size
        columns[int(spaces.uids[x])] = BlockColumns(_keys_of(flat, koff, r), slot[r], want, e["off"][j], e["crc"][j])
    if found != len(sorted_ids) or not claimed.all():
        return None  # an extent of no block, or of two
    return columns


def _keys_of(flat: np.ndarray, off: np.ndarray, r: np.ndarray) -> list[bytes] | np.ndarray:
    """The engine keys of rows ``r`` (row ``i``'s: ``flat[off[i]:off[i + 1]]``): rows of a
    byte array, a view of ``flat``, where they are of one length and lie together (a
    namespace's blocks, as the catalog holds them), else ``bytes`` objects."""
    lo, hi = int(off[r[0]]), int(off[r[-1] + 1])
    lens = off[r + 1] - off[r]
    if r[-1] - r[0] == len(r) - 1 and lens[0] > 0 and (lens == lens[0]).all():
        return flat[lo:hi].reshape(len(r), int(lens[0]))
    raw = flat[lo:hi].tobytes()
    return [raw[a - lo:b - lo] for a, b in zip(off[r].tolist(), off[r + 1].tolist())]


def _repeats(v: np.ndarray) -> bool:
    """Whether a value of ``v`` (not negative) is there twice: counted where the values are
    dense (a namespace's slots, as a rule), else by a sort."""
    if len(v) < 2:
        return False
    if int(v.max()) < 2 * len(v) + 4096:
        return bool(np.bincount(v).max() > 1)
    s = np.sort(v)
    return bool((s[1:] == s[:-1]).any())
