"""The store: sequences, their blocks, and the two tiers that hold them.

Threading contract (the server keeps it):
- :meth:`create`, :meth:`create_many`, :meth:`delete`, :meth:`prepare_put` and
  :meth:`commit_puts` run on the single writer thread, which owns LMDB writes and the SSD allocator.
- :meth:`get`, :meth:`open`, :meth:`list`, :meth:`stats` run on any thread.

A put is two-phase: ``prepare_put`` checks the request (the index's page window and
byte budget included, see index.py), allocates extents, writes the blocks to the data
file and grows the index arrays the put will land in; ``commit_puts`` makes a group of
prepared puts durable (one fdatasync, one LMDB commit) and only then publishes them to
the index (assignments into those arrays) and the DRAM tier (a cache: a block it does
not take is read from the SSD). Everything that can fail for one put fails in its
prepare, so it is refused alone; only the shared commit fails a whole group, and then
none of it is durable. A put that fails in either phase leaves no blocks behind: its
extents are unreferenced space that the allocator takes back.

Every sequence belongs to the uid that created it: lookups by name take the caller's
uid, and a request naming another owner's sequence by uid is told it does not exist
(the same words as for a uid never used), so uids say nothing about other tenants.
Buffers are looked up in the calling session's registry only.
"""

from __future__ import annotations

import fcntl
import fnmatch
import itertools
import logging
import mmap
import os
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import lmdb
import numpy as np

from kvdrive.layout import ALIGN, ReadPlan, SpaceError, align_up, packing_order, plan_reads
from kvdrive.layout.format import DATA_FILE, FORMAT_VERSION, META_DIR
from kvstored.buffers import MappedBuffer
from kvstored.catalog import RESERVE_MIN_BYTES, Catalog, CatalogDamagedError, ExtentRecord, SeqRecord
from kvstored.config import DaemonConfig, SyncPolicy, format_size
from kvstored.checksum import block_crcs
from kvstored.copy import address_tags, gather_scatter
from kvstored.dram import DramTier
from kvstored.dram_shares import DramShares
from kvstored.files import StoreBusyError, StoreOpenError, lock_exclusive, punch_hole
from kvstored.footprint import check_put_bytes
from kvstored.gate import ReclaimGate
from kvstored.index import BlockIndex, Growth, IndexFullError, PageSpanError, SeqEntry
from kvstored.io_engine import AlignedScratch, choose_engine
from kvstored.ssd import NO_SPACE, SsdTier
from kvstored.staging import StagingPool
from kvstored.protocol import (MAX_IMPORTANCE, MAX_SEQS_PER_GET, Create, Delete, ErrorCode, Get, ListSeqs, Lookup,
                               OpenSeq, ProtocolError, Put)
from kvstored.quota import pick_victims
from kvstored.sessions import Session

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 16 << 20  # SSD reads of a get checked at once; the scratch buffer per get worker
STAGING_KEEP_BYTES = 128 << 20  # put staging mappings kept for reuse between puts (staging.py)


class DamagedBlockError(ProtocolError):
    """Bytes read back that do not match their checksum; the client sees it as ChecksumError."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CHECKSUM, message)


@dataclass
class PreparedPut:
    entry: SeqEntry
    records: list[ExtentRecord]
    extents: list[tuple[int, int]]
    staging: np.ndarray
    staging_map: mmap.mmap
    stage_offs: np.ndarray
    layers: np.ndarray
    heads: np.ndarray
    pages: np.ndarray
    importance: np.ndarray
    crc: np.ndarray
    ssd_off: np.ndarray  # where each block lies in the data file
    page_ids: np.ndarray  # the put's distinct pages
    counts: Counter = field(default_factory=Counter)
    pool: StagingPool | None = None  # where the staging mapping goes back to

    def release(self) -> None:
        self.staging = np.zeros(0, dtype=np.uint8)
        if self.pool is not None:
            self.pool.give(self.staging_map)
        else:
            self.staging_map.close()


class _Looked(NamedTuple):
    """One sequence's blocks of a get, as looked up under the index lock."""

    entry: SeqEntry
    lay: np.ndarray
    hed: np.ndarray
    pag: np.ndarray
    col: np.ndarray  # the page's column in the entry's arrays
    ssd_off: np.ndarray
    crc: np.ndarray
    dram_off: np.ndarray
    dst: np.ndarray  # where each lands in the client's buffer


class Store:
    """Opening refuses, with a :class:`StoreOpenError` that says what to do, a store that
    another kvstored serves or whose catalog is missing or damaged; whatever fails, a
    store that did not open holds nothing open."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self._ssd_dir = str(cfg.ssd_dir.resolve())
        self._short = False  # the disk cannot hold the catalog's reserve: creates and puts are refused
        self._staging = StagingPool(STAGING_KEEP_BYTES)
        try:
            self._open(cfg)
        except BaseException as exc:
            self.close()
            if isinstance(exc, lmdb.Error):
                raise CatalogDamagedError(cfg.ssd_dir / META_DIR, [f"reading it failed: {exc}"]) from None
            if isinstance(exc, OSError) and not isinstance(exc, StoreOpenError):
                raise StoreOpenError(f"cannot open the store in {cfg.ssd_dir}: {exc.strerror or exc}"
                                     + (f" ({exc.filename})" if exc.filename else "")) from None
            raise

    def _open(self, cfg: DaemonConfig) -> None:
        cfg.ssd_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = _lock_directory(cfg.ssd_dir)
        t0 = time.monotonic()
        data = cfg.ssd_dir / DATA_FILE
        self.catalog = Catalog(cfg.ssd_dir / META_DIR, cfg.lmdb_map_bytes, durable=cfg.sync == SyncPolicy.DURABLE,
                               data_bytes=data.stat().st_size if data.exists() else 0, migrate_owner=os.geteuid())
        self.ssd = _open_ssd(cfg)
        # Held on the open file, which an unlink of kvstored.lock leaves in force.
        lock_exclusive(self.ssd.fd, self.ssd.path, cfg.ssd_dir)
        self.engine = choose_engine(cfg.engine, cfg.io_threads, str(self.ssd.path), self.ssd.direct)
        self._scratch = AlignedScratch()  # per get worker: where its SSD reads land
        self.dram = DramTier(cfg.dram_bytes)
        self.shares = DramShares(cfg.dram_bytes)  # guarded by the index lock
        self.index = BlockIndex(cfg.index_max_bytes, cfg.index_max_per_uid_bytes)
        self.gate = ReclaimGate()
        self.counters: Counter[str] = Counter()
        # Bytes stored per (owner, namespace), for --quota.
        self._ns_bytes: Counter[tuple[int, str]] = Counter()
        self._tick = itertools.count(1)
        self._inflight: dict[tuple[int, int], list[np.ndarray]] = {}
        self._load()
        self._keep_reserve()
        log.info(
            "store at %s: format %d, %d sequences, %s on SSD (cap %s), DRAM tier %s pre-faulted, opened in %.2f s",
            cfg.ssd_dir, FORMAT_VERSION, len(self.index.all()), format_size(self.ssd.used_bytes),
            format_size(cfg.ssd_max_bytes), format_size(cfg.dram_bytes), time.monotonic() - t0,
        )

    # ------------------------------------------------------------ start-up

    def _load(self) -> None:
        contents = self.catalog.load(os.fstat(self.ssd.fd).st_size)
        for rec in contents.sequences:
            self.index.add(SeqEntry(rec.uid, rec.ns, rec.name, rec.geometry, rec.created, rec.owner))
        by_uid: dict[int, list[ExtentRecord]] = {}
        for ext in contents.extents:
            assert self.index.get(ext.uid) is not None, "Catalog.load checks that every extent's sequence exists"
            by_uid.setdefault(ext.uid, []).append(ext)
        used = []
        for uid, exts in by_uid.items():
            entry = self.index.get(uid)
            bb = entry.geometry.block_bytes
            # One window for everything stored: what LMDB holds is loaded whatever the limits.
            ends = np.array([(int(e.pages.min()), int(e.pages.max())) for e in exts])
            self.index.grow(entry, self.index.plan_growth(entry, np.array([ends[:, 0].min(), ends[:, 1].max()]), enforce=False))
            for ext in exts:
                cols = entry.columns(ext.pages.astype(np.int64))
                slots = np.arange(len(ext.pages), dtype=np.int64)
                entry.ssd_off[ext.layer, ext.head, cols] = ext.offset + slots * bb
                entry.crc[ext.layer, ext.head, cols] = ext.crc
                # Stores written before hints were bounded may hold larger ones.
                entry.importance[ext.layer, ext.head, cols] = np.clip(ext.importance, 0.0, MAX_IMPORTANCE)
                entry.has_page[cols] = True
                entry.extents.append((ext.offset, len(ext.pages) * bb))
                entry.num_blocks += len(ext.pages)
                used.append((ext.offset, len(ext.pages) * bb))
            entry.num_pages = int(np.count_nonzero(entry.has_page))
            self._ns_bytes[(entry.owner, entry.ns)] += entry.bytes
        self.ssd.load(used)
        if self.index.num_bytes > self.index.max_bytes:
            log.warning("the block index holds %s, past --index-max %s: puts that grow it are refused until sequences "
                        "are deleted", format_size(self.index.num_bytes), format_size(self.index.max_bytes))

    # ------------------------------------------------------------ disk space

    def _keep_reserve(self) -> None:
        """Top up the catalog's reserve; on a disk that cannot hold it, hand free data-file
        space back to the filesystem and try once more."""
        was_short = self._short
        self._short = not self.catalog.ensure_reserve()
        if self._short and not was_short:
            freed = self._punch([*self.ssd.allocator.holes,
                                 (self.ssd.allocator.end, max(0, os.fstat(self.ssd.fd).st_size - self.ssd.allocator.end))])
            self._short = not self.catalog.ensure_reserve()
            if self._short:
                log.warning("disk full under %s: creates and puts are refused until deletes free space "
                            "(%s of free data-file space handed back to the filesystem)", self.cfg.ssd_dir, format_size(freed))
        if was_short and not self._short:
            log.info("disk space for the catalog's reserve is back: creates and puts are accepted again")

    def _check_room(self, what: str) -> None:
        self._keep_reserve()
        if self._short:
            self.counters["refused_disk_full"] += 1
            raise ProtocolError(
                ErrorCode.FULL,
                f"{what} refused: the disk under {self.cfg.ssd_dir} is full, and the space kept for deletes "
                "cannot grow; delete sequences to make room",
            )

    def _punch(self, ranges: list[tuple[int, int]]) -> int:
        done = 0
        for off, nbytes in ranges:
            if nbytes > 0 and punch_hole(self.ssd.fd, off, nbytes):
                done += nbytes
        return done

    def _release_extents(self, extents: list[tuple[int, int]]) -> None:
        # Runs once no reader can still read them; on a full disk their blocks go back to
        # the filesystem, so the reserve can grow again.
        if self._short:
            self._punch([(o, align_up(n)) for o, n in extents])
        for o, n in extents:
            self.ssd.queue_free(o, n)

    @contextmanager
    def _catalog_write(self, what: str) -> Iterator[lmdb.Transaction]:
        """A catalog write transaction whose LMDB errors become typed replies."""
        try:
            with self.catalog.begin() as txn:
                yield txn
        except lmdb.MapFullError:
            raise ProtocolError(ErrorCode.FULL, f"{what}: the catalog filled its {format_size(self.cfg.lmdb_map_bytes)} "
                                "LMDB map; delete sequences to make room") from None
        except (lmdb.CorruptedError, lmdb.PanicError, lmdb.PageNotFoundError) as exc:
            log.error("%s: the catalog cannot be written: %s", what, exc)
            raise ProtocolError(ErrorCode.IO, f"{what}: the catalog cannot be written ({exc}); restart kvstored, "
                                "which checks the catalog at open") from None
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.DiskError) or self._disk_nearly_full():
                self._short = True
                raise ProtocolError(ErrorCode.FULL, f"{what}: no disk space left for the catalog under "
                                    f"{self.cfg.ssd_dir} ({exc}); delete sequences to make room") from None
            raise ProtocolError(ErrorCode.IO, f"{what}: writing the catalog failed ({exc})") from None

    def _disk_nearly_full(self) -> bool:
        st = os.statvfs(self.cfg.ssd_dir / META_DIR)
        return st.f_bavail * st.f_frsize < RESERVE_MIN_BYTES

    # ------------------------------------------------------------ catalog ops

    def hello(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "engine": self.engine.name,
            "direct_io": self.ssd.direct,
            "dram_bytes": self.dram.capacity,
            "ssd_max_bytes": self.ssd.allocator.capacity,
            "sync": self.cfg.sync,
            "pid": os.getpid(),
            "ssd_dir": self._ssd_dir,
            "get_seqs": True,  # a get may name each block's sequence (the 'seqs' array)
        }

    def create(self, req: Create, owner: int) -> dict:
        """Create ``req``'s sequence, owned by OS user ``owner``."""
        result = self.create_many([(req, owner)])[0]
        if isinstance(result, ProtocolError):
            raise result
        return result

    def create_many(self, reqs: list[tuple[Create, int]]) -> list[dict | ProtocolError]:
        """Create sequences (request, owner) in one catalog commit: per request, its sequence's
        description or the error that refused it. A request refused on its own (a name taken
        with another geometry, a full index) refuses only itself; a failed commit refuses
        every request that would have created a sequence, and none of them exists. A name
        given twice in the group is created once (the second is a request for an existing
        sequence)."""
        results: list[dict | ProtocolError | SeqEntry] = []
        pending: dict[tuple[int, str, str], SeqEntry] = {}
        records: list[SeqRecord] = []
        for req, owner in reqs:
            try:
                results.append(self._prepare_create(req, owner, pending, records))
            except ProtocolError as exc:
                results.append(exc)
        if records:
            try:
                with self._catalog_write("create") as txn:
                    for rec in records:
                        self.catalog.add_sequence(txn, rec)
            except ProtocolError as exc:
                made = {id(e) for e in pending.values()}
                results = [exc if isinstance(r, SeqEntry) and id(r) in made else r for r in results]
                return [self._describe(r) if isinstance(r, SeqEntry) else r for r in results]
            self.counters["create_commits"] += 1
            self.counters["creates"] += len(pending)
            for entry in pending.values():
                self.index.add(entry)
                log.info("created %s/%s (uid %d, %d B blocks)", entry.ns, entry.name, entry.uid,
                         entry.geometry.block_bytes)
        return [self._describe(r) if isinstance(r, SeqEntry) else r for r in results]

    def _prepare_create(self, req: Create, owner: int, pending: dict, records: list) -> SeqEntry:
        """The entry ``req`` names: an existing one (``exist_ok``, same geometry), or a new one
        added to ``pending`` with its catalog record in ``records``, to be committed."""
        key = (owner, req.ns, req.seq)
        found = pending.get(key) or self.index.find(owner, req.ns, req.seq)
        if found is not None:
            if req.exist_ok and found.geometry == req.geometry:
                return found
            raise ProtocolError(
                ErrorCode.EXISTS,
                f"sequence {req.ns}/{req.seq} exists" + ("" if found.geometry == req.geometry else " with another geometry"),
            )
        try:
            self.index.check_add(owner)
        except IndexFullError as exc:
            raise ProtocolError(ErrorCode.FULL, str(exc)) from None
        self._check_room("create")
        uid = self.catalog.next_uid
        rec = SeqRecord(uid, req.ns, req.seq, req.geometry, time.time(), owner)
        # The entry holds no arrays until its first put; made before the commit, so nothing
        # that can fail is left once the sequence is durable.
        entry = SeqEntry(uid, req.ns, req.seq, req.geometry, rec.created, owner)
        self.catalog.next_uid += 1
        pending[key] = entry
        records.append(rec)
        return entry

    def open(self, req: OpenSeq, owner: int) -> dict:
        entry = self.index.find(owner, req.ns, req.seq)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence {req.ns}/{req.seq}")
        return self._describe(entry)

    def list(self, req: ListSeqs, owner: int) -> dict:
        """The caller's sequences (of namespace ``req.ns`` if given) with uid > ``req.after``,
        in uid order, at most ``req.limit``; ``more`` says whether others follow."""
        mine = sorted(
            (e for e in self.index.all() if e.owner == owner and e.uid > req.after and (req.ns is None or e.ns == req.ns)),
            key=lambda e: e.uid,
        )
        return {"sequences": [self._describe(e) for e in mine[: req.limit]], "more": len(mine) > req.limit}

    def lookup(self, req: Lookup, owner: int) -> dict:
        """For each name: the sequence's uid and complete pages, or 0 and -1 where the caller
        has no such sequence; ``prefix`` counts the leading names with at least ``min_pages``."""
        uids, pages = [], []
        with self.index.lock:
            for name in req.names:
                entry = self.index.find(owner, req.ns, name)
                uids.append(0 if entry is None else entry.uid)
                pages.append(-1 if entry is None else entry.complete_pages)
        prefix = next((i for i, n in enumerate(pages) if n < req.min_pages), len(pages))
        self.counters["lookups"] += 1
        return {"uids": uids, "pages": pages, "prefix": prefix}

    def _describe(self, entry: SeqEntry) -> dict:
        with self.index.lock:
            prefix = entry.complete_pages
            dram_blocks = int((entry.dram_off >= 0).sum())
        return {
            "ns": entry.ns, "seq": entry.name, "uid": entry.uid, "geometry": entry.geometry.to_dict(),
            "num_blocks": entry.num_blocks, "bytes": entry.bytes, "dram_blocks": dram_blocks,
            "complete_pages": prefix, "created": entry.created,
        }

    def delete(self, req: Delete, owner: int) -> dict:
        entry = self.index.find(owner, req.ns, req.seq)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence {req.ns}/{req.seq}")
        self._delete_entries([entry], "delete")
        log.info("deleted %s/%s (%s)", entry.ns, entry.name, format_size(entry.bytes))
        return {"freed_bytes": entry.bytes}

    def _delete_entries(self, entries: list[SeqEntry], what: str) -> None:
        """Delete sequences in one catalog commit; their DRAM slots and extents are freed once
        no get still reads them."""
        # Never refused for want of space: the catalog's reserve is kept for this.
        with self._catalog_write(what) as txn:
            for entry in entries:
                self.catalog.delete_sequence(
                    txn, SeqRecord(entry.uid, entry.ns, entry.name, entry.geometry, entry.created, entry.owner))
        for entry in entries:
            self.index.remove(entry.uid)
            key = (entry.owner, entry.ns)
            self._ns_bytes[key] -= entry.bytes
            if self._ns_bytes[key] <= 0:  # an emptied namespace leaves nothing behind
                del self._ns_bytes[key]
            bb = entry.geometry.block_bytes
            with self.index.lock:
                slots = entry.dram_off[entry.dram_off >= 0].copy()
                entry.dram_off[:] = -1
                self.shares.drop(entry.owner, len(slots) * bb)
            extents = list(entry.extents)
            self.gate.retire(lambda bb=bb, slots=slots: self.dram.release(bb, slots))
            self.gate.retire(lambda extents=extents: self._release_extents(extents))
        self.ssd.unpark()  # the filesystem may back them now
        self._keep_reserve()

    def quota_of(self, ns: str) -> int | None:
        """The --quota that applies to namespace ``ns`` (the first pattern it matches), if any."""
        return next((limit for pattern, limit in self.cfg.quotas if fnmatch.fnmatchcase(ns, pattern)), None)

    def enforce_quotas(self, prepared: list[PreparedPut]) -> None:
        """After a commit: in each namespace these puts took past its --quota, delete the least
        recently used sequences (by their last put or get) until it is within it. The
        sequences these puts wrote are kept, so a put is never undone by its own quota, and
        so is every sequence not yet put into (see quota.py)."""
        if not self.cfg.quotas:
            return
        keep = {p.entry.uid for p in prepared}
        for owner, ns in {(p.entry.owner, p.entry.ns) for p in prepared}:
            limit = self.quota_of(ns)
            if limit is None or self._ns_bytes[(owner, ns)] <= limit:
                continue
            candidates = [e for e in self.index.all() if e.owner == owner and e.ns == ns and e.uid not in keep]
            with self.index.lock:
                victims = pick_victims(candidates, self._ns_bytes[(owner, ns)] - limit)
            if not victims:
                continue
            freed = sum(e.bytes for e in victims)
            self._delete_entries(victims, "quota")
            self.counters["quota_evicted"] += len(victims)
            self.counters["quota_evicted_bytes"] += freed
            log.info("namespace %s is over its quota %s: deleted its %d least recently used sequences (%s)", ns,
                     format_size(limit), len(victims), format_size(freed))

    # ------------------------------------------------------------ put

    def prepare_put(self, req: Put, session: Session) -> PreparedPut:
        entry = self._entry(req.uid, session.uid)
        g = entry.geometry
        bb = g.block_bytes
        layers, pages = req.layers, req.pages
        if layers.max() >= g.num_layers:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"layer {int(layers.max())} >= num_layers {g.num_layers}")
        num_l, num_h, num_p = len(layers), g.num_kv_heads, len(pages)
        total = num_l * num_h * num_p
        if total > self.cfg.max_blocks_per_request:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"put of {num_l} layers x {num_h} heads x {num_p} pages = {total} blocks, limit {self.cfg.max_blocks_per_request}",
            )
        check_put_bytes(num_l * num_h, num_p, bb)
        for name, arr in (("cluster", req.cluster), ("order", req.order), ("importance", req.importance)):
            if arr is not None and len(arr) != total:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'{name}' has {len(arr)} values for {total} blocks")
        mb = session.buffers.lookup(req.buf)
        _check_span(mb, req.offset, total * bb, "source")
        self._check_new_pages(entry, layers, pages)
        growth = self._plan_growth(entry, pages)
        self._check_room("put")

        cluster = (req.cluster if req.cluster is not None else np.zeros(total, np.int32)).reshape(num_l, num_h, num_p)
        order = req.order.reshape(num_l, num_h, num_p) if req.order is not None else None
        importance = (req.importance if req.importance is not None else np.zeros(total, np.float32)).reshape(num_l, num_h, num_p)

        ext_bytes = align_up(num_p * bb)
        staging_map, staging = self._staging.take(num_l * num_h * ext_bytes)
        slot_pages = np.empty((num_l, num_h, num_p), dtype=np.int64)
        src_offs = np.empty((num_l, num_h, num_p), dtype=np.int64)
        records = []
        for li in range(num_l):
            for h in range(num_h):
                perm = packing_order(pages, cluster[li, h], None if order is None else order[li, h])
                slot_pages[li, h] = pages[perm]
                src_offs[li, h] = req.offset + ((li * num_h + h) * num_p + perm) * bb
        stage_offs = (np.arange(num_l * num_h, dtype=np.int64)[:, None] * ext_bytes + np.arange(num_p) * bb).reshape(num_l, num_h, num_p)
        with self.gate.reading():
            # Inside the gate an unregister of the source waits for this copy to end before
            # it unmaps the buffer; one that came first fails the put here.
            session.buffers.lookup(req.buf)
            mb.read_blocks(src_offs.ravel(), staging, stage_offs.ravel(), bb)
        lay = np.broadcast_to(layers[:, None, None], slot_pages.shape)
        hed = np.broadcast_to(np.arange(num_h)[None, :, None], slot_pages.shape)
        crc = (block_crcs(staging, stage_offs.ravel(), bb) ^ address_tags(entry.uid, lay.ravel(), hed.ravel(), slot_pages.ravel())).reshape(slot_pages.shape)
        # Importance and cluster follow the pages into slot order.
        perm_idx = (src_offs - req.offset) // bb - (np.arange(num_l * num_h).reshape(num_l, num_h, 1) * num_p)
        slot_imp = np.take_along_axis(importance, perm_idx, axis=2)
        slot_cluster = np.take_along_axis(cluster, perm_idx, axis=2)
        # Space is taken only once nothing but the write can fail, so no path leaks it.
        offsets = self._place(staging, num_l * num_h, ext_bytes)
        try:
            # The index grows now, so that publishing after the commit cannot fail.
            self.index.grow(entry, growth)
        except MemoryError:
            for off in offsets:
                self.ssd.allocator.free(off, ext_bytes)
            raise ProtocolError(
                ErrorCode.FULL,
                f"no memory for the block index of {entry.ns}/{entry.name} ({growth.capacity} pages); lower --index-max "
                f"to what this host can hold, or delete sequences",
            ) from None
        slot = np.arange(num_p, dtype=np.int64) * bb
        ssd_off = (np.asarray(offsets, dtype=np.int64)[:, None] + slot).ravel()
        k = 0
        for li in range(num_l):
            for h in range(num_h):
                self.catalog.next_extent += 1
                records.append(ExtentRecord(
                    entry.uid, int(layers[li]), h, self.catalog.next_extent, offsets[k],
                    slot_pages[li, h].astype(np.int32), crc[li, h], slot_cluster[li, h], slot_imp[li, h],
                ))
                k += 1
        for li in range(num_l):
            self._inflight.setdefault((entry.uid, int(layers[li])), []).append(pages)
        return PreparedPut(
            entry, records, [(o, num_p * bb) for o in offsets], staging, staging_map, stage_offs.ravel(),
            lay.ravel().copy(), hed.ravel().copy(), slot_pages.ravel(), slot_imp.ravel(), crc.ravel(), ssd_off, pages,
            pool=self._staging,
        )

    def _plan_growth(self, entry: SeqEntry, pages: np.ndarray) -> Growth:
        try:
            return self.index.plan_growth(entry, pages)
        except PageSpanError as exc:
            self.counters["puts_refused_span"] += 1
            raise ProtocolError(ErrorCode.TOO_LARGE, str(exc)) from None
        except IndexFullError as exc:
            self.counters["puts_refused_index"] += 1
            raise ProtocolError(ErrorCode.FULL, str(exc)) from None

    def _place(self, staging: np.ndarray, count: int, ext_bytes: int) -> list[int]:
        """Write a put's extents to the data file (see SsdTier.place); refusals as replies."""
        try:
            return self.ssd.place(staging, count, ext_bytes)
        except SpaceError as exc:
            self.counters["puts_refused_full"] += 1
            raise ProtocolError(
                ErrorCode.FULL,
                f"SSD tier full: this put needs {format_size(count * ext_bytes)} ({exc}); "
                f"delete sequences or raise --ssd-max",
            ) from None
        except OSError as exc:
            # The staging map is left to the garbage collector: views of it (the traceback's
            # frames hold some) keep it exported, and closing it now would raise BufferError.
            code = ErrorCode.FULL if exc.errno in NO_SPACE else ErrorCode.IO
            raise ProtocolError(code, f"writing blocks failed: {exc}") from None

    def _check_new_pages(self, entry: SeqEntry, layers: np.ndarray, pages: np.ndarray) -> None:
        inside = pages[entry.inside(pages)]
        if len(inside):
            # Columns first: indexing the layers first would copy every page of them.
            stored = entry.ssd_off[:, :, entry.columns(inside)][layers] >= 0
            if stored.any():
                li, h, pi = np.argwhere(stored)[0]
                raise ProtocolError(
                    ErrorCode.EXISTS,
                    f"block (layer {int(layers[li])}, head {int(h)}, page {int(inside[pi])}) is already stored; blocks are write-once",
                )
        for li in layers.tolist():
            for pending in self._inflight.get((entry.uid, li), ()):
                both = np.intersect1d(pending, pages)
                if len(both):
                    raise ProtocolError(ErrorCode.EXISTS, f"page {int(both[0])} of layer {li} is being written by another put")

    def abort_puts(self, prepared: list[PreparedPut]) -> None:
        for p in prepared:
            for off, nbytes in p.extents:
                self.ssd.allocator.free(off, nbytes)
            p.release()
        self._inflight.clear()

    def commit_puts(self, prepared: list[PreparedPut]) -> dict[int, ProtocolError]:
        """Make prepared puts durable (one fdatasync, one LMDB commit), then visible.

        A failure of the shared commit raises: ProtocolError(IO) for an I/O error, and
        then no put of the group is durable. After the commit, publishing a put is
        assignments into index arrays its prepare grew; should one fail all the same
        (a bug), only that put is refused: the returned map holds its position.
        """
        if not prepared:
            return {}
        try:
            if self.cfg.sync == SyncPolicy.DURABLE:
                self.ssd.sync()
            with self._catalog_write("put") as txn:
                self.catalog.add_extents(txn, [rec for p in prepared for rec in p.records])
        except OSError as exc:
            self.abort_puts(prepared)
            self.counters["commits_failed"] += 1
            raise ProtocolError(ErrorCode.IO, f"commit failed: {exc.__class__.__name__}: {exc}") from None
        except ProtocolError:
            self.abort_puts(prepared)
            self.counters["commits_failed"] += 1
            raise
        except BaseException:
            self.abort_puts(prepared)
            raise
        self._inflight.clear()
        self.counters["put_commits"] += 1
        self._keep_reserve()
        tick = next(self._tick)
        refused: dict[int, ProtocolError] = {}
        for i, p in enumerate(prepared):
            try:
                self._publish(p, tick)
            except Exception as exc:
                log.exception("publishing a committed put to %s/%s failed", p.entry.ns, p.entry.name)
                self.counters["publish_failed"] += 1
                refused[i] = ProtocolError(
                    ErrorCode.INTERNAL,
                    f"the put is durable but not visible until kvstored restarts: {exc.__class__.__name__}: {exc}",
                )
            else:
                try:
                    self._admit(p.entry, p.layers, p.heads, p.pages, p.importance, p.staging, p.stage_offs, replace=True)
                except Exception:  # DRAM is a cache: a block it does not take is read from the SSD
                    log.exception("admitting a put of %s/%s to DRAM failed", p.entry.ns, p.entry.name)
                    self.counters["dram_admit_failed"] += 1
            p.release()
        return refused

    def _publish(self, p: PreparedPut, tick: int) -> None:
        entry = p.entry
        with self.index.lock:
            cols = entry.columns(p.pages)
            entry.ssd_off[p.layers, p.heads, cols] = p.ssd_off
            entry.crc[p.layers, p.heads, cols] = p.crc
            entry.importance[p.layers, p.heads, cols] = p.importance
            entry.last_use[p.layers, p.heads, cols] = tick
            self.index.mark_pages(entry, entry.columns(p.page_ids))
            entry.extents.extend(p.extents)
            entry.num_blocks += len(p.pages)
        bb = entry.geometry.block_bytes
        self.counters["puts"] += 1
        self.counters["blocks_put"] += len(p.pages)
        self.counters["bytes_put"] += len(p.pages) * bb
        self._ns_bytes[(entry.owner, entry.ns)] += len(p.pages) * bb

    def sync(self) -> None:
        self.ssd.sync()
        self.catalog.sync()

    # ------------------------------------------------------------ DRAM residency

    def _admit(self, entry, layers, heads, pages, importance, src, src_offs, replace: bool,
               expect_crc: np.ndarray | None = None) -> None:
        """Copy blocks into DRAM: into free slots, and with ``replace`` over residents that matter less.

        Residents are ranked by importance, then by last use; a candidate displaces the
        lowest-ranked resident of its own user only if it ranks higher itself, or one of a
        user over its fair share while its own user is under its share (dram_shares.py).
        With ``expect_crc`` (the source is client memory) only copies that verify against
        it are kept. Without ``importance`` the index's is used. ``src`` is host memory or a client's buffer,
        which copies the blocks out itself (from device memory, for a CUDA IPC buffer).
        """
        bb = entry.geometry.block_bytes
        if not self.dram.capacity or (not replace and not self.dram.has_room(bb)):
            return  # a full tier takes blocks read from the SSD only into free slots
        with self.index.lock:
            if self.index.get(entry.uid) is not entry:
                return
            cols = entry.columns(pages)  # under the lock: a put may move the window
            if importance is None:
                importance = entry.importance[layers, heads, cols]
            absent = entry.dram_off[layers, heads, cols] < 0
            lin = np.ravel_multi_index((layers, heads, cols), entry.dram_off.shape)
            _, first = np.unique(lin, return_index=True)
            keep = np.zeros(len(lin), dtype=bool)
            keep[first] = True
            sel = np.flatnonzero(absent & keep)
            if not len(sel):
                return
            sel = sel[np.argsort(-importance[sel], kind="stable")]
            slots = self.dram.allocate(bb, len(sel))
            if len(slots) < len(sel) and replace:
                if self._displace(entry.owner, bb, importance[sel[len(slots):]], next(self._tick)):
                    slots = np.concatenate([slots, self.dram.allocate(bb, len(sel) - len(slots))])
            sel = sel[: len(slots)]
            if isinstance(src, MappedBuffer):
                src.read_blocks(src_offs[sel], self.dram.arena, slots, bb)
            else:
                gather_scatter(src, src_offs[sel], self.dram.arena, slots, bb)
            if expect_crc is not None:
                # A client's buffer may hold one block twice (overlapping destinations) or
                # change under the copy; checking the DRAM copy keeps it from poisoning the tier.
                tags = address_tags(entry.uid, layers[sel], heads[sel], pages[sel])
                good = (block_crcs(self.dram.arena, slots, bb) ^ tags) == expect_crc[sel]
                if not good.all():
                    self.dram.release(bb, slots[~good])
                    self.counters["dram_admit_refused"] += int((~good).sum())
                    sel, slots = sel[good], slots[good]
            entry.dram_off[layers[sel], heads[sel], cols[sel]] = slots
            self.shares.add(entry.owner, len(sel) * bb)
            self.counters["dram_admitted"] += len(sel)

    def _displace(self, owner: int, bb: int, cand_importance: np.ndarray, now: int) -> int:
        """Evict residents for candidates of ``owner`` (by descending importance) that found no
        free slot, within the owners' fair shares (see dram_shares.py); index lock held."""
        plan = self.shares.plan(owner, bb, len(cand_importance))
        evicted = sum(self._evict_for(bb, np.full(n, np.inf, np.float32), now, other) for other, n in plan.from_others)
        return evicted + self._evict_for(bb, cand_importance[len(cand_importance) - plan.own:], now, owner)

    def _evict_for(self, bb: int, cand_importance: np.ndarray, now: int, owner: int) -> int:
        """Evict residents of ``owner`` of block size ``bb`` that rank below the candidates (index lock held).

        At most one resident per candidate goes, so only the ``len(cand_importance)``
        lowest-ranked residents are ranked: a linear partition by importance picks them
        (with every resident tied at the cut), and only those are sorted. A full sort of a
        tier of a few hundred thousand blocks took about 0.1 s, under the index lock.
        """
        m = len(cand_importance)
        if not m:
            return 0
        seq_uids, flats, imps, uses = [], [], [], []
        for entry in self.index._by_uid.values():
            if entry.geometry.block_bytes != bb or entry.owner != owner:
                continue
            flat = np.flatnonzero(entry.dram_off.reshape(-1) >= 0)
            seq_uids.append(np.full(len(flat), entry.uid, dtype=np.int64))
            flats.append(flat)
            imps.append(entry.importance.reshape(-1)[flat]), uses.append(entry.last_use.reshape(-1)[flat])
        if not seq_uids:
            return 0
        imp, use = np.concatenate(imps), np.concatenate(uses)
        low = np.flatnonzero(imp <= np.partition(imp, m - 1)[m - 1]) if len(imp) > m else np.arange(len(imp))
        rank = low[np.lexsort((use[low], imp[low]))]  # ascending (importance, last use); ties keep resident order
        m = min(len(rank), m)
        vi, vu = imp[rank[:m]], use[rank[:m]]
        ci = cand_importance[:m]
        beats = (ci > vi) | ((ci == vi) & (now > vu))
        count = int(np.argmin(beats)) if not beats.all() else m
        if not count:
            return 0
        victims = rank[:count]
        seq_uid, flat = np.concatenate(seq_uids)[victims], np.concatenate(flats)[victims]
        freed = []
        for uid in np.unique(seq_uid).tolist():
            entry = self.index._by_uid[uid]
            where = np.unravel_index(flat[seq_uid == uid], entry.dram_off.shape)
            freed.append(entry.dram_off[where].copy())
            entry.dram_off[where] = -1
        slots = np.concatenate(freed)
        self.gate.retire(lambda: self.dram.release(bb, slots))
        self.shares.drop(owner, count * bb)
        self.counters["dram_evicted"] += count
        return count

    # ------------------------------------------------------------ get

    @staticmethod
    def _seq_groups(req: Get) -> list[tuple[int, np.ndarray | slice]]:
        """A get's sequence uids, ascending, and which of its blocks each holds (every block
        of ``uid`` without ``seqs``): one sort, O(N log N). More than
        :data:`MAX_SEQS_PER_GET` sequences are refused before any is looked up."""
        if req.seqs is None:
            return [(req.uid, slice(None))]
        order = np.argsort(req.seqs, kind="stable")
        ranked = req.seqs[order]
        starts = np.flatnonzero(np.concatenate(([True], ranked[1:] != ranked[:-1])))
        if len(starts) > MAX_SEQS_PER_GET:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"'seqs' names {len(starts)} sequences, limit {MAX_SEQS_PER_GET} per get: split the get",
            )
        return list(zip(ranked[starts].tolist(), np.split(order, starts[1:])))

    def _get_parts(self, req: Get, owner: int) -> list[tuple[SeqEntry, np.ndarray | slice]]:
        """:meth:`_seq_groups` with each sequence's entry. Every sequence must exist and
        all must share a block size."""
        parts = [(self._entry(uid, owner), at) for uid, at in self._seq_groups(req)]
        sizes = {e.geometry.block_bytes for e, _ in parts}
        if len(sizes) > 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"the sequences of one get must share a block size, got {sorted(sizes)}")
        return parts

    def get(self, req: Get, session: Session) -> dict:
        t0 = time.perf_counter()
        parts = self._get_parts(req, session.uid)
        bb = parts[0][0].geometry.block_bytes
        blocks = req.blocks.astype(np.int64)
        for entry, at in parts:
            g = entry.geometry
            for name, col, limit in (("layer", 0, g.num_layers), ("head", 1, g.num_kv_heads)):
                bad = np.flatnonzero(blocks[at, col] >= limit)
                if len(bad):
                    i = int(np.arange(len(blocks))[at][bad[0]])
                    raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"block {i}: {name} {int(blocks[i, col])} >= {limit}")
        mb = session.buffers.lookup(req.buf)
        n = len(blocks)
        dst = req.dst if req.dst is not None else np.arange(n, dtype=np.int64) * bb
        _check_span(mb, req.offset, int(dst.max()) + bb, "destination")
        dst = dst + req.offset
        n_hit = n_ssd = reads = bytes_read = 0
        with self.gate.reading():
            # An unregister before this point has unmapped the buffer; after it, it waits for us.
            session.buffers.lookup(req.buf)
            found = []
            with self.index.lock:  # every sequence's blocks checked before any is copied
                for entry, at in parts:
                    lay, hed, pag = blocks[at, 0], blocks[at, 1], blocks[at, 2]
                    col = entry.columns(pag)
                    inside = (col >= 0) & (col < entry.capacity)
                    ssd_off = np.full(len(lay), -1, dtype=np.int64)
                    ssd_off[inside] = entry.ssd_off[lay[inside], hed[inside], col[inside]]
                    missing = np.flatnonzero(ssd_off < 0)
                    if len(missing):
                        i = int(missing[0])
                        raise ProtocolError(
                            ErrorCode.NOT_FOUND,
                            f"{len(missing)} of {n} blocks are not stored, first (layer {lay[i]}, head {hed[i]}, "
                            f"page {pag[i]}) of {entry.ns}/{entry.name}",
                        )
                    found.append(_Looked(entry, lay, hed, pag, col, ssd_off, entry.crc[lay, hed, col],
                                         entry.dram_off[lay, hed, col], dst[at]))
                tick = next(self._tick)
                for f in found:
                    f.entry.last_use[f.lay, f.hed, f.col] = tick
            misses = []
            for f in found:
                hit = f.dram_off >= 0
                mb.write_blocks(self.dram.arena, f.dram_off[hit], f.dst[hit], bb)
                misses.append(np.flatnonzero(~hit))
                n_hit += len(f.lay) - len(misses[-1])
            # Every sequence's SSD blocks in one read plan: their reads are in flight together.
            part = np.concatenate([np.full(len(m), j) for j, m in enumerate(misses)])
            pick = lambda name: np.concatenate([getattr(f, name)[m] for f, m in zip(found, misses)])  # noqa: E731
            plan = self._read_ssd([f.entry for f in found], part, pick("lay"), pick("hed"), pick("pag"), pick("ssd_off"),
                                  pick("crc"), mb, pick("dst"))
            reads, bytes_read = plan.num_reads, plan.bytes_read
            for f, miss in zip(found, misses):
                if len(miss):
                    self._admit(f.entry, f.lay[miss], f.hed[miss], f.pag[miss], None, mb, f.dst[miss],
                                replace=False, expect_crc=f.crc[miss])
                n_ssd += len(miss)
        self.counters["gets"] += 1
        self.counters["blocks_dram"] += n_hit
        self.counters["blocks_ssd"] += n_ssd
        self.counters["ssd_reads"] += reads
        self.counters["ssd_bytes_read"] += bytes_read
        return {
            "n": n, "dram": n_hit, "ssd": n_ssd, "reads": reads,
            "bytes_read": bytes_read, "ms": (time.perf_counter() - t0) * 1e3,
        }

    def in_dram(self, req: Get, session: Session, max_bytes: int) -> bool:
        """Whether ``req`` asks for at most ``max_bytes`` and every block sits in DRAM now
        (False for a request :meth:`get` would refuse). An eviction after this answer only
        sends the get to the SSD for those blocks."""
        if not len(req.blocks):
            return False
        # The sequences of a get share a block size (or it is refused): the first one's
        # sizes the get before its sequences are grouped, so a large get costs this thread nothing.
        first = self.index.get(req.uid if req.seqs is None else int(req.seqs[0]))
        if first is None or len(req.blocks) * first.geometry.block_bytes > max_bytes:
            return False
        if req.seqs is not None and len(req.seqs) > 1 and not (req.seqs == req.seqs[0]).all():
            try:
                groups = self._seq_groups(req)
            except ProtocolError:
                return False
        else:
            groups = [(first.uid, slice(None))]
        looked = []
        for uid, at in groups:
            entry = self.index.get(uid)
            if entry is None or entry.owner != session.uid or entry.geometry.block_bytes != first.geometry.block_bytes:
                return False
            blocks = req.blocks[at]
            lay, hed, pag = (blocks[:, i] for i in range(3))
            looked.append((entry, lay, hed, pag))
        with self.index.lock:
            for entry, lay, hed, pag in looked:
                g, col = entry.geometry, entry.columns(pag)
                if lay.max() >= g.num_layers or hed.max() >= g.num_kv_heads or col.min() < 0 or col.max() >= entry.capacity:
                    return False
                if not (entry.dram_off[lay, hed, col] >= 0).all():
                    return False
            return True

    def _read_ssd(self, entries, part, lay, hed, pag, ssd_off, crc, dst_buf: MappedBuffer, dst) -> ReadPlan:
        """Read blocks from the SSD into ``dst_buf`` at ``dst``, each checked against its CRC.

        Block i is of sequence ``entries[part[i]]`` (all of one block size). The reads of
        a chunk (up to :data:`READ_CHUNK_BYTES`, or one read if larger) land in this
        thread's aligned scratch buffer; then one call checks and scatters every block of
        the chunk, so an I/O costs the engine's read and no Python work of its own.
        """
        bb = entries[0].geometry.block_bytes
        plan = plan_reads(ssd_off, bb, self.cfg.max_gap_bytes, self.cfg.max_io_bytes, ALIGN)
        if not len(ssd_off):
            return plan
        sizes = plan.ends - plan.starts
        by_run = np.argsort(plan.run_of, kind="stable")
        bounds = np.searchsorted(plan.run_of[by_run], np.arange(plan.num_reads + 1))
        tags = np.empty(len(lay), np.uint32)
        for j, entry in enumerate(entries):
            at = part == j
            tags[at] = address_tags(entry.uid, lay[at], hed[at], pag[at])
        bad: list[np.ndarray] = []
        reach = np.cumsum(sizes)  # bytes read up to the end of each run
        r0 = 0
        while r0 < plan.num_reads:
            # Runs [r0, r1): as many as fit in a chunk, at least one.
            done = int(reach[r0 - 1]) if r0 else 0
            r1 = max(r0 + 1, int(np.searchsorted(reach, done + READ_CHUNK_BYTES, side="right")))
            base = reach[r0:r1] - sizes[r0:r1] - done  # where each run lands in the scratch buffer
            scratch = self._scratch.get(int(reach[r1 - 1]) - done)
            try:
                self.engine.read_into(self.ssd.fd, plan.starts[r0:r1], plan.ends[r0:r1], scratch, base)
            except OSError as exc:
                self.counters["io_errors"] += 1
                raise ProtocolError(ErrorCode.IO, f"SSD read failed: {exc}") from None
            idx = by_run[bounds[r0] : bounds[r1]]
            src = base[plan.run_of[idx] - r0] + plan.offset_in_run[idx]
            ok = dst_buf.write_verified(scratch, src, dst[idx], bb, tags[idx], crc[idx])
            if not ok.all():
                bad.append(idx[~ok])
            r0 = r1
        if bad:
            wrong = np.concatenate(bad)
            self.counters["checksum_errors"] += len(wrong)
            i = int(wrong.min())
            entry = entries[int(part[i])]
            log.error("checksum mismatch: %s/%s layer %d head %d page %d at offset %d (%d bad blocks in this get)",
                      entry.ns, entry.name, lay[i], hed[i], pag[i], ssd_off[i], len(wrong))
            raise DamagedBlockError(
                f"checksum mismatch in {len(wrong)} block(s), first (layer {lay[i]}, head {hed[i]}, page {pag[i]}) "
                f"of {entry.ns}/{entry.name} at data file offset {int(ssd_off[i])}; the SSD copy is damaged"
            )
        return plan

    # ------------------------------------------------------------ buffers, stats, close

    def _entry(self, uid: int, owner: int) -> SeqEntry:
        entry = self.index.get(uid)
        if entry is None or entry.owner != owner:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence with uid {uid} (create or open it first)")
        return entry

    def stats(self, session: Session) -> dict:
        """Daemon-wide figures (tiers, counters) and the caller's own sequence count."""
        return {
            **self.hello(),
            "sequences": sum(1 for e in self.index.all() if e.owner == session.uid),
            "dram_used_bytes": self.dram.used_bytes,
            "dram_blocks": self.dram.num_blocks,
            "ssd_used_bytes": self.ssd.used_bytes,
            "ssd_file_bytes": self.ssd.allocator.end,
            "index_bytes": self.index.num_bytes,
            "index_max_bytes": self.index.max_bytes,
            "counters": dict(self.counters),
        }

    def close(self) -> None:
        """Close what is open (all of it once the store opened; what there is after a failed open)."""
        for name in ("engine", "catalog", "ssd", "dram", "_staging"):
            part = self.__dict__.pop(name, None)
            if part is not None:
                part.close()
        fd = self.__dict__.pop("_lock_fd", None)
        if fd is not None:
            os.close(fd)


def _check_span(mb: MappedBuffer, offset: int, nbytes: int, what: str) -> None:
    if offset + nbytes > mb.size:
        raise ProtocolError(
            ErrorCode.BUFFER,
            f"{what} buffer {mb.buf_id} is too small: needs {offset + nbytes} bytes (offset {offset} + {nbytes}), has {mb.size}",
        )


def _lock_directory(path: Path) -> int:
    """Lock ``kvstored.lock``, which names the serving daemon's pid. Being unlinkable, it
    is not the only lock: the data file and data.mdb are flocked too."""
    fd = os.open(path / "kvstored.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StoreBusyError(f"another kvstored (pid {other or 'unknown'}) serves {path}; stop it or choose "
                             "another --ssd") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _open_ssd(cfg: DaemonConfig) -> SsdTier:
    return SsdTier(cfg.ssd_dir / DATA_FILE, cfg.ssd_max_bytes, cfg.direct_io)
