"""Sequences as named objects: create, open, list, lookup, delete, and namespace quotas.

Runs on the writer thread (create, delete, quotas) or any thread (open, list, lookup).
Every sequence belongs to the uid that created it: lookups by name take the caller's uid,
and a request naming another owner's sequence by uid is told it does not exist (the same
words as for a uid never used).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections import Counter
from typing import Callable

from kvstored.catalog import BLOCKS_NAME, Catalog, SeqRecord
from kvstored.config import DaemonConfig, format_size
from kvstored.index import BlockIndex, IndexFullError, SeqEntry
from kvstored.protocol import Create, Delete, ErrorCode, ListSeqs, Lookup, OpenSeq, ProtocolError
from kvstored.quota import pick_victims
from kvstored.residency import Residency
from kvstored.space import Space

log = logging.getLogger(__name__)


def owned_entry(index: BlockIndex, uid: int, owner: int, blocks: bool = False) -> SeqEntry:
    """The sequence ``uid`` if ``owner`` owns it; otherwise the reply a uid never used gets.
    A block namespace (blocks.py) is not a sequence to its clients: only ``blocks`` finds one."""
    entry = index.get(uid)
    if entry is None or entry.owner != owner or (entry.name == BLOCKS_NAME) != blocks:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence with uid {uid} (create or open it first)")
    return entry


def _never_open(token: bytes) -> bool:
    return False


class Sequences:
    def __init__(self, cfg: DaemonConfig, index: BlockIndex, catalog: Catalog, space: Space, residency: Residency,
                 retire: Callable, counters: Counter) -> None:
        self.cfg = cfg
        self.index = index
        self.catalog = catalog
        self.space = space
        self.residency = residency
        self._retire = retire
        self.counters = counters
        # Bytes stored per (owner, namespace), for --quota.
        self.ns_bytes: Counter[tuple[int, str]] = Counter()
        # Whether a session token is of an open session (the server's session table says).
        self.session_open: Callable[[bytes], bool] = _never_open

    def describe(self, entry: SeqEntry) -> dict:
        """A sequence as ``create``, ``open`` and ``list`` answer it. ``writing``: whether the
        session that created it, or last put into it, is still open (false after a restart,
        until a put): where its pages are incomplete, a session may still store them, or none
        ever will."""
        with self.index.lock:
            prefix, dram_blocks = entry.complete_pages, entry.dram_blocks
        return {
            "ns": entry.ns, "seq": entry.name, "uid": entry.uid, "geometry": entry.geometry.to_dict(),
            "num_blocks": entry.num_blocks, "bytes": entry.bytes, "dram_blocks": dram_blocks,
            "complete_pages": prefix, "created": entry.created,
            "writing": entry.writer is not None and self.session_open(entry.writer),
        }

    def create_many(self, reqs: list[tuple[Create, int]], writers: list[bytes | None] | None = None
                    ) -> list[dict | ProtocolError]:
        """Create sequences (request, owner) in one catalog commit: per request, its sequence's
        description or the error that refused it. A request refused on its own (a name taken
        with another geometry, a full index) refuses only itself; a failed commit refuses
        every request that would have created a sequence, and none of them exists. A name
        given twice in the group is created once (the second is a request for an existing
        sequence). ``writers``: each request's session token, which a sequence it creates
        keeps as its writer."""
        results: list[dict | ProtocolError | SeqEntry] = []
        pending: dict[tuple[int, str, str], SeqEntry] = {}
        records: list[SeqRecord] = []
        for i, (req, owner) in enumerate(reqs):
            writer = None if writers is None else writers[i]
            try:
                results.append(self._prepare_create(req, owner, pending, records, writer))
            except ProtocolError as exc:
                results.append(exc)
        if records:
            try:
                with self.space.catalog_write("create") as txn:
                    for rec in records:
                        self.catalog.add_sequence(txn, rec)
            except ProtocolError as exc:
                made = {id(e) for e in pending.values()}
                results = [exc if isinstance(r, SeqEntry) and id(r) in made else r for r in results]
                return [self.describe(r) if isinstance(r, SeqEntry) else r for r in results]
            self.counters["create_commits"] += 1
            self.counters["creates"] += len(pending)
            for entry in pending.values():
                self.index.add(entry)
                log.info("created %s/%s (uid %d, %d B blocks)", entry.ns, entry.name, entry.uid,
                         entry.geometry.block_bytes)
        return [self.describe(r) if isinstance(r, SeqEntry) else r for r in results]

    def _prepare_create(self, req: Create, owner: int, pending: dict, records: list, writer: bytes | None) -> SeqEntry:
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
        self.space.check_room("create")
        uid = self.catalog.new_uid()
        rec = SeqRecord(uid, req.ns, req.seq, req.geometry, time.time(), owner)
        # The entry holds no arrays until its first put; made before the commit, so nothing
        # that can fail is left once the sequence is durable.
        entry = SeqEntry(uid, req.ns, req.seq, req.geometry, rec.created, owner)
        entry.writer = writer
        pending[key] = entry
        records.append(rec)
        return entry

    def open(self, req: OpenSeq, owner: int) -> dict:
        entry = self.index.find(owner, req.ns, req.seq)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence {req.ns}/{req.seq}")
        return self.describe(entry)

    def list(self, req: ListSeqs, owner: int) -> dict:
        """The caller's sequences (of namespace ``req.ns`` if given) with uid > ``req.after``,
        in uid order, at most ``req.limit``; ``more`` says whether others follow."""
        mine = self.index.listed(owner, req.ns, req.after, req.limit + 1, lambda e: e.name != BLOCKS_NAME)
        return {"sequences": [self.describe(e) for e in mine[: req.limit]], "more": len(mine) > req.limit}

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

    def delete(self, req: Delete, owner: int) -> dict:
        entry = self.index.find(owner, req.ns, req.seq)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence {req.ns}/{req.seq}")
        if req.uid and entry.uid != req.uid:  # the one the caller saw was deleted, and the name taken again
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no sequence {req.ns}/{req.seq} with uid {req.uid} "
                                                     f"(the name is another's now, uid {entry.uid})")
        self.delete_entries([entry], "delete")
        log.info("deleted %s/%s (%s)", entry.ns, entry.name, format_size(entry.bytes))
        return {"freed_bytes": entry.bytes}

    def delete_entries(self, entries: list[SeqEntry], what: str) -> None:
        """Delete sequences in one catalog commit; their DRAM slots and extents are freed once
        no get still reads them."""
        # Never refused for want of space: the catalog's reserve is kept for this.
        with self.space.catalog_write(what) as txn:
            for entry in entries:
                self.catalog.delete_sequence(
                    txn, SeqRecord(entry.uid, entry.ns, entry.name, entry.geometry, entry.created, entry.owner))
        dram = self.residency.dram
        for entry in entries:
            self.index.remove(entry.uid)
            key = (entry.owner, entry.ns)
            self.ns_bytes[key] -= entry.bytes
            if self.ns_bytes[key] <= 0:  # an emptied namespace leaves nothing behind
                del self.ns_bytes[key]
            bb = entry.geometry.block_bytes
            with self.index.lock:
                slots = self.residency.forget(entry)
            extents = list(entry.extents)
            self._retire(lambda bb=bb, slots=slots: dram.release(bb, slots))
            self._retire(lambda extents=extents: self.space.release_extents(extents))
        self.space.ssd.unpark()  # the filesystem may back them now
        self.space.keep_reserve()

    def quota_of(self, ns: str) -> int | None:
        """The --quota that applies to namespace ``ns`` (the first pattern it matches), if any."""
        return next((limit for pattern, limit in self.cfg.quotas if fnmatch.fnmatchcase(ns, pattern)), None)

    def enforce_quotas(self, written: list[SeqEntry]) -> None:
        """After a commit: in each namespace these puts took past its --quota, delete the least
        recently used sequences (by their last put or get) until it is within it. The
        sequences these puts wrote are kept, so a put is never undone by its own quota, and
        so is every sequence not yet put into (see quota.py)."""
        if not self.cfg.quotas:
            return
        keep = {e.uid for e in written}
        for owner, ns in {(e.owner, e.ns) for e in written}:
            limit = self.quota_of(ns)
            if limit is None or self.ns_bytes[(owner, ns)] <= limit:
                continue
            # A block namespace loses single blocks instead (blocks.py).
            with self.index.lock:
                victims = pick_victims(self.index.least_recent(owner, ns), self.ns_bytes[(owner, ns)] - limit, keep)
            if not victims:
                continue
            freed = sum(e.bytes for e in victims)
            self.delete_entries(victims, "quota")
            self.counters["quota_evicted"] += len(victims)
            self.counters["quota_evicted_bytes"] += freed
            log.info("namespace %s is over its quota %s: deleted its %d least recently used sequences (%s)", ns,
                     format_size(limit), len(victims), format_size(freed))
