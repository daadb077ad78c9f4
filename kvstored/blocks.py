"""Engine blocks: named, write-once blocks of one size per namespace, by the engine's key.

A serving engine hands its KV tier opaque blocks of one size, named by a prefix hash.
Each (owner, namespace) of them is one sequence of the reserved name
:data:`~kvstored.catalog.BLOCKS_NAME` (made by the namespace's first put), whose geometry
is the block's parts as layers (``block_geometry``) and whose pages are *slots*: a
block is one slot, each of its parts an extent of one page, so one block can be
deleted alone. Beside the index, a :class:`BlockTable` per namespace keeps key -> slot
(least recently used first, for quotas), by slot the key and its parts' extent ids (in
arrays: no object per block), and the free slots.

In the client's buffer a block is contiguous, at ``offset + i * block_bytes`` or at an
offset of its own, or in ``regions`` equal regions with an offset each (an engine page
whose K and V lie apart): then the namespace's parts must each lie whole in one region,
and a namespace made by such a put is split so (``block_geometry(block_bytes, regions)``).

Life cycle, on the writer thread but for lookups and gets:

- ``block_put`` (:meth:`Blocks.prepare_put`): the keys the namespace lacks (not stored,
  not being written by the group, each once) get slots, are staged, checksummed
  (address-tagged by namespace uid, part and slot) and written as one put of the put
  path, so they share its group commit: one fdatasync, then one LMDB transaction holding
  their extents and their block records (block_catalog.py). Keys already present are
  skipped, so puts are write-once and idempotent and two racing writers both succeed.
  A put that writes nothing is answered after its group's commit too.
- ``block_get`` (:meth:`Blocks.get`, any thread): keys to slots under the index lock,
  then the get path's DRAM hits and checked SSD reads; a block deleted (or its slot
  given to another key) meanwhile is reported missing, never as other bytes, and a
  damaged one is named in ``damaged``. A small get all in DRAM is served on the main
  thread (:meth:`Blocks.get_in_dram`): one lookup under the index lock, then the copy.
- ``block_delete``: given keys (their records and extents in one transaction, their
  bytes and DRAM copies freed once no get reads them), or the whole namespace.
- ``--quota``: a namespace past its quota loses its least recently used blocks, never
  one its own group just wrote.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvdrive.layout.geometry import Geometry
from kvdrive.protocol.blocks import block_geometry
from kvstored.block_catalog import BlockRecord, add_blocks, block_rows, delete_blocks, part_rows
from kvstored.block_keys import BlockKeys
from kvstored.buffers import MappedBuffer
from kvstored.catalog import BLOCKS_NAME, Catalog, Contents
from kvstored.config import DaemonConfig, format_size
from kvstored.copy import address_tags
from kvstored.footprint import check_put_bytes
from kvstored.gate import ReclaimGate
from kvstored.get_path import DamagedBlockError, GetPath
from kvstored.index import BlockIndex, Growth, IndexFullError, IndexLimitError, SeqEntry
from kvstored.protocol import (
    BlockDelete, BlockGet, BlockLookup, BlockPut, Create, ErrorCode, Get, ProtocolError,
)
from kvstored.put_path import PreparedPut, PutPath
from kvstored.residency import Residency
from kvstored.sequences import Sequences
from kvstored.sessions import Session
from kvstored.space import Space

log = logging.getLogger(__name__)

GET_TRIES = 3  # a get whose blocks are deleted under it looks them up again, this many times in all


class BlockExtents:
    """A block namespace's extents, as the (offset, bytes) pairs a sequence's extent list
    holds, read from its index: each part of each block is one extent of one page there,
    so nothing more is kept per block (a store of 64 KiB blocks holds tens of millions)."""

    def __init__(self, entry: SeqEntry) -> None:
        self.entry = entry

    def append(self, ext: tuple[int, int]) -> None:
        assert ext[1] == self.entry.geometry.block_bytes, "a block's part is one extent of one page"

    def extend(self, exts) -> None:
        for ext in exts:
            self.append(ext)

    def pop(self, off: int) -> tuple[int, int]:
        return off, self.entry.geometry.block_bytes

    def __iter__(self):
        nbytes, offs = self.entry.geometry.block_bytes, self.entry.ssd_off
        return iter([(off, nbytes) for off in offs[offs >= 0].tolist()])

    def __len__(self) -> int:
        return int(np.count_nonzero(self.entry.ssd_off >= 0))


class BlockTable:
    """One namespace's blocks: key -> slot, least recently used first; by slot, the block's
    key, its parts' extent ids and a generation, bumped whenever the slot is filled or
    emptied (so that a get can tell its block from a later one in the same slot); the free
    slots. Arrays by slot, not an object per block: a store of 64 KiB blocks holds tens of
    millions. Changed under the index lock."""

    def __init__(self, entry: SeqEntry, block_bytes: int) -> None:
        self.entry, self.block_bytes = entry, block_bytes
        self.parts = entry.geometry.num_layers
        self.held = BlockKeys()  # key -> slot, least recently used first
        self.extent_ids = np.zeros((0, self.parts), np.int64)
        self.gen = np.zeros(0, np.uint32)
        self.pending: dict[bytes, int] = {}  # keys of prepared puts not yet committed
        self._free: list[int] = []
        self._next = 0

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots, lowest first, so the index window stays dense."""
        out = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        out += range(self._next, self._next + n - len(out))
        self._next = max(self._next, out[-1] + 1) if out else self._next
        return np.asarray(out, dtype=np.int64)

    def give(self, slots) -> None:
        for s in slots:
            heapq.heappush(self._free, int(s))

    def prepare(self, slots: np.ndarray) -> None:
        """Ahead of :meth:`fill` of ``slots``, on the writer thread without the index lock: the
        arrays by slot grown and the key table made room in, where fill would do it
        (:meth:`BlockKeys.prepare`; only the writer changes these, gets read them whole)."""
        if len(slots):
            self._grow(int(slots.max()) + 1)
            self.held.prepare(len(self.gen), len(slots))

    def _grow(self, top: int) -> None:
        if top > len(self.gen):
            grow = max(top, 2 * len(self.gen), 64) - len(self.gen)
            self.extent_ids = np.concatenate([self.extent_ids, np.zeros((grow, self.parts), np.int64)])
            self.gen = np.concatenate([self.gen, np.zeros(grow, np.uint32)])

    def fill(self, keys: list[bytes] | np.ndarray, slots: np.ndarray, extent_ids: np.ndarray) -> None:
        """Block ``keys[i]`` is in slot ``slots[i]``, its parts in extents ``extent_ids[i]``."""
        if len(slots):
            self._grow(int(slots.max()) + 1)
            self.held.grow(len(self.gen))
        self.held.add(keys, slots)
        self.extent_ids[slots] = extent_ids
        self.gen[slots] += 1

    def empty(self, slots: np.ndarray) -> None:
        """Forget the blocks in ``slots``; the caller gives the slots back once nothing reads them."""
        self.held.remove(slots)
        self.extent_ids[slots] = 0
        self.gen[slots] += 1

    def loaded(self, keys: list[bytes] | np.ndarray, slots: np.ndarray, ids: np.ndarray) -> None:
        """Fill from the catalog at start-up (block ``keys[i]`` in slot ``slots[i]``, its
        parts in extents ``ids[i]``), the oldest written first. Reads are not durable, so
        the LRU order starts as the order blocks were written in (extent ids grow with every
        put; the catalog's key order, sorted here where it is not, so that nothing rests on how
        the catalog was read). Any other order would have the quota evict recent blocks as
        soon as old ones, and free space all over the data file, so that new puts are
        written in small pieces."""
        first = ids[:, 0]
        if (first[1:] < first[:-1]).any():  # not as the catalog holds them
            order = np.argsort(first, kind="stable")
            keys = keys[order] if isinstance(keys, np.ndarray) else [keys[i] for i in order.tolist()]
            slots, ids = slots[order], ids[order]
        self.fill(keys, slots, ids)
        self._next = int(slots.max()) + 1 if len(slots) else 0
        free = np.ones(self._next, bool)
        free[slots] = False
        self._free = np.flatnonzero(free).tolist()  # sorted: a heap


@dataclass(frozen=True)
class Picks:
    """The keys of a get a table holds, looked up under the index lock: their positions in
    the request, their slots and the slots' generations then."""

    pos: np.ndarray
    slots: np.ndarray
    gens: np.ndarray

    def __len__(self) -> int:
        return len(self.pos)

    def one(self, j: int) -> "Picks":
        return Picks(self.pos[j:j + 1], self.slots[j:j + 1], self.gens[j:j + 1])


class Blocks:
    def __init__(self, cfg: DaemonConfig, index: BlockIndex, catalog: Catalog, sequences: Sequences, puts: PutPath,
                 gets: GetPath, residency: Residency, space: Space, gate: ReclaimGate, counters: Counter) -> None:
        self.cfg, self.index, self.catalog, self.sequences = cfg, index, catalog, sequences
        self.puts, self.gets, self.residency, self.space, self.gate = puts, gets, residency, space, gate
        self.counters = counters
        self.tables: dict[tuple[int, str], BlockTable] = {}
        BlockKeys.warm()

    def load(self, contents: Contents) -> None:
        """The tables of the block namespaces the catalog holds, as records or as columns."""
        by_uid: dict[int, list[BlockRecord]] = {}
        for rec in contents.blocks:
            by_uid.setdefault(rec.uid, []).append(rec)
        for seq in contents.sequences:
            if seq.name != BLOCKS_NAME:
                continue
            table = self._add_table(self.index.get(seq.uid))
            cols = contents.block_columns.get(seq.uid)
            if cols is not None:
                table.loaded(cols.keys, cols.slots, cols.ext_ids)
                continue
            recs = by_uid.pop(seq.uid, [])
            table.loaded([r.key for r in recs], np.array([r.slot for r in recs], np.int64),
                         np.array([r.extent_ids for r in recs], np.int64).reshape(len(recs), table.parts))

    def _add_table(self, entry: SeqEntry) -> BlockTable:
        g = entry.geometry
        entry.extents = BlockExtents(entry)
        table = self.tables[(entry.owner, entry.ns)] = BlockTable(entry, g.num_layers * g.block_bytes)
        return table

    def num_blocks(self) -> int:
        return sum(len(t.held) for t in self.tables.values())

    # ------------------------------------------------------------ any thread

    def lookup(self, req: BlockLookup, owner: int) -> dict:
        with self.index.lock:
            table = self.tables.get((owner, req.ns))
            found = [False] * len(req.keys) if table is None else (table.held.find(req.keys) >= 0).tolist()
        self.counters["block_lookups"] += 1
        return {"found": found}

    def get(self, req: BlockGet, session: Session) -> dict:
        """Copy the blocks found to ``offset + i * block_bytes`` (or to their ``offsets``, one per
        key or per region of each); ``found`` per key, ``damaged``
        the positions whose SSD copy failed its checksum (their bytes are not to be used)."""
        table = self.tables.get((session.uid, req.ns))
        if table is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no block namespace {req.ns}")
        at = part_spans(session.buffers.lookup(req.buf), req, table.block_bytes, table.parts, "destination")
        for _ in range(GET_TRIES):
            if self.tables.get((session.uid, req.ns)) is not table:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no block namespace {req.ns} (deleted during this get)")
            with self.index.lock:
                picks = self._pick(table, req)
                table.held.touch(picks.slots)
            try:
                damaged = self._read(table, req, session, picks, at)
            except ProtocolError as exc:
                if exc.code != ErrorCode.NOT_FOUND:
                    raise
                continue  # a block was deleted between the two lookups: look them up again
            return self._found(table, req, picks, damaged)
        raise ProtocolError(ErrorCode.BUSY, f"the blocks of {req.ns} were deleted under {GET_TRIES} tries of this get")

    def get_in_dram(self, req: BlockGet, session: Session, max_bytes: int) -> dict | None:
        """:meth:`get` of ``req`` where it names at most ``max_bytes`` of blocks and every one
        found sits in DRAM: one lookup under the index lock, then the copy, on this thread (a
        small get on the main thread: its lookup and bookkeeping cost about as much as the
        copy of a few blocks). None, having copied and recorded nothing, where it does not,
        or where :meth:`get` would refuse it."""
        table = self.tables.get((session.uid, req.ns))
        if table is None or len(req.keys) * table.block_bytes > max_bytes:
            return None
        entry, parts = table.entry, table.parts
        with self.gate.reading():
            try:  # within the gate: a buffer unregistered before it is gone, after it waits for this copy
                mb = session.buffers.lookup(req.buf)
                at = part_spans(mb, req, table.block_bytes, parts, "destination")
            except ProtocolError:
                return None
            with self.index.lock:
                picks = self._pick(table, req)
                lay, pag = np.tile(np.arange(parts, dtype=np.int32), len(picks)), np.repeat(picks.slots, parts)
                col = entry.columns(pag)
                src = entry.dram_off[lay, 0, col]
                if not (src >= 0).all():
                    return None
                self.gets.used([(entry, lay, np.zeros(len(lay), np.int32), pag, col)], resident=True)
                table.held.touch(picks.slots)
            mb.write_blocks(self.residency.dram.arena, src, at[picks.pos].reshape(-1) + req.offset,
                            entry.geometry.block_bytes)
        self.counters.update(gets=1, blocks_dram=len(src))
        return self._found(table, req, picks, set())

    def _found(self, table: BlockTable, req: BlockGet, picks: Picks, damaged: set[int]) -> dict:
        """A get's reply once its copies are done: a block deleted, or its slot given to
        another key, during the copy is a miss, as is a damaged one."""
        with self.index.lock:
            same = table.gen[picks.slots] == picks.gens
        if len(picks) == len(req.keys) and not damaged and same.all():  # as a rule: every key found whole
            found = [True] * len(req.keys)
        else:
            found = [False] * len(req.keys)
            for i, ok in zip(picks.pos.tolist(), same.tolist()):
                found[i] = ok and i not in damaged
        self.counters["block_gets"] += 1
        return {"found": found, "damaged": sorted(damaged)}

    @staticmethod
    def _pick(table: BlockTable, req: BlockGet) -> Picks:
        """The keys of ``req`` the table holds (index lock held)."""
        every = table.held.find(req.keys)
        pos = np.flatnonzero(every >= 0)
        slots = every[pos]
        return Picks(pos, slots, table.gen[slots])

    def _read(self, table: BlockTable, req: BlockGet, session: Session, picks: Picks, at: np.ndarray) -> set[int]:
        """Read ``picks`` into the client's buffer, part p of key i at ``offset + at[i, p]``;
        the positions of those that are damaged."""
        if not picks:
            return set()
        try:
            self.gets.get(self._get_of(table, req, picks, at), session, blocks=True)
            return set()
        except DamagedBlockError:
            pass
        damaged = set()  # one at a time, so that only the damaged ones are misses
        for j, i in enumerate(picks.pos.tolist()):
            try:
                self.gets.get(self._get_of(table, req, picks.one(j), at), session, blocks=True)
            except DamagedBlockError:
                damaged.add(i)
        return damaged

    @staticmethod
    def _get_of(table: BlockTable, req: BlockGet, picks: Picks, at: np.ndarray) -> Get:
        n, parts = len(picks), table.parts
        rows = np.zeros((n * parts, 3), np.int32)
        rows[:, 0] = np.tile(np.arange(parts, dtype=np.int32), n)
        rows[:, 2] = np.repeat(picks.slots, parts)
        return Get(table.entry.uid, req.buf, req.offset, rows, at[picks.pos].reshape(-1))

    # ------------------------------------------------------------ writer thread

    def _table_for_put(self, req: BlockPut, owner: int) -> BlockTable:
        table = self.tables.get((owner, req.ns))
        if table is not None:
            if table.block_bytes != req.block_bytes:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"block namespace {req.ns} holds blocks of {table.block_bytes} "
                                                         f"bytes, not {req.block_bytes}")
            return table
        geometry = self._geometry(req, owner)
        made = self.sequences.create_many([(Create(req.ns, BLOCKS_NAME, geometry, True), owner)])[0]
        if isinstance(made, ProtocolError):
            raise made
        log.info("block namespace %s of uid %d: blocks of %d bytes", req.ns, owner, req.block_bytes)
        return self._add_table(self.index.find(owner, req.ns, BLOCKS_NAME))

    def _geometry(self, req: BlockPut, owner: int) -> Geometry:
        """The geometry of ``req`` 's namespace: the one it has, or the one a put makes."""
        table = self.tables.get((owner, req.ns))
        if table is not None and table.block_bytes == req.block_bytes:
            return table.entry.geometry
        try:
            return block_geometry(req.block_bytes, req.regions)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None

    def prepare_put(self, req: BlockPut, session: Session) -> PreparedPut | None:
        """Stage and write the keys the namespace lacks, as one put of the put path (see the
        module); None when it lacks none."""
        mb = session.buffers.lookup(req.buf)  # before a new namespace is made for a put that fails
        parts = self._geometry(req, session.uid).num_layers
        at = part_spans(mb, req, req.block_bytes, parts, "source")
        table = self._table_for_put(req, session.uid)
        entry, parts = table.entry, table.parts
        with self.index.lock:
            new: dict[bytes, int] = {}
            held = table.held.find(req.keys).tolist()
            for i, key in enumerate(req.keys):
                if held[i] < 0 and key not in new and key not in table.pending:
                    new[key] = i
        reply = {"stored": len(new), "present": len(req.keys) - len(new)}
        if not new:
            return None
        count, part_bytes = len(new) * parts, entry.geometry.block_bytes
        if count > self.cfg.max_blocks_per_request:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"put of {count} parts, limit {self.cfg.max_blocks_per_request}")
        check_put_bytes(count, 1, part_bytes)
        slots, growth = self._room(table, len(new))
        try:
            return self._write(table, req, session, mb, list(new), at[list(new.values())].reshape(-1), slots, growth,
                               reply)
        except BaseException:
            table.give(slots)
            raise

    def _room(self, table: BlockTable, n: int) -> tuple[np.ndarray, Growth]:
        """Slots for ``n`` new blocks, and the window that holds them. Where the index
        budget cannot grow the window, a namespace under a --quota loses its least recently
        used blocks to make room in it (as its quota would), so that a quota past what
        --index-max holds does not stop its stores; elsewhere the put is refused (``full``)."""
        slots = table.take(n)
        try:
            return slots, self.index.plan_growth(table.entry, slots)
        except IndexFullError:
            room = self.sequences.quota_of(table.entry.ns) is not None and n <= len(table.held)
        except IndexLimitError:
            room = False
        if room:  # its n least recently used blocks' slots lie in the window, and free slots go lowest first
            table.give(slots)
            self._drop(table, self._least_recent(table, n), "quota")
            log.info("block namespace %s: the block index is full, so its %d least recently used blocks made room",
                     table.entry.ns, n)
            slots = table.take(n)
        try:
            return slots, self.puts.plan_growth(table.entry, slots)  # refused (and counted) as any put
        except BaseException:
            table.give(slots)
            raise

    def _least_recent(self, table: BlockTable, n: int, keep=frozenset()) -> np.ndarray:
        """The slots of ``table``'s ``n`` least recently used blocks, but for those in ``keep``."""
        with self.index.lock:
            return table.held.oldest(n, np.fromiter(keep, np.int64, len(keep)))

    def _write(self, table, req, session, mb, new, at, slots, growth, reply) -> PreparedPut:
        entry, parts, part_bytes = table.entry, table.parts, table.entry.geometry.block_bytes
        self.space.check_room("put")
        n = len(new)
        lay = np.tile(np.arange(parts, dtype=np.int64), n)
        hed = np.zeros(n * parts, np.int64)
        pag = np.repeat(slots, parts)
        src = at + req.offset
        wrote = self.puts.write_blocks(mb, session, req.buf, src, part_bytes, entry.owner)
        offsets = wrote.offsets
        crc = wrote.crc ^ address_tags(entry.uid, lay, hed, pag)
        try:
            self.index.grow(entry, growth)
        except MemoryError:
            self.puts.unwrite(wrote)
            raise ProtocolError(ErrorCode.FULL, f"no memory for the block index of {entry.ns}: lower --index-max to "
                                                f"what this host can hold, or delete blocks") from None
        first = self.catalog.next_extent + 1  # part p of new block j is extent first + j * parts + p
        self.catalog.next_extent += n * parts
        ids = np.arange(first, first + n * parts, dtype=np.int64).reshape(n, parts)
        table.pending.update(zip(new, slots.tolist()))
        rows = part_rows(entry.uid, parts, first, offsets, slots, crc), block_rows(entry.uid, new, slots, ids)
        self.counters["block_puts"] += 1
        return PreparedPut(
            entry, [], [(off, part_bytes) for off in offsets], wrote.staging, wrote.staging_map, wrote.src_offs,
            lay, hed, pag, np.zeros(n * parts, np.float32), crc, np.asarray(offsets, np.int64), slots,
            pool=self.puts.staging, on_commit=lambda txn: add_blocks(self.catalog, txn, *rows),
            on_publish=lambda: self._published(table, new, slots, ids), on_abort=lambda: self._aborted(table, new, slots),
            reply=reply, dram_slots=wrote.dram_slots,
        )

    def _published(self, table: BlockTable, keys: list[bytes], slots: np.ndarray, ids: np.ndarray) -> None:
        table.prepare(slots)  # a doubling's copies and rehash, before the lock gets wait on
        with self.index.lock:
            for key in keys:
                table.pending.pop(key, None)
            table.fill(keys, slots, ids)
        self.counters["blocks_stored"] += len(keys)

    def _aborted(self, table: BlockTable, keys: list[bytes], slots: np.ndarray) -> None:
        for key in keys:
            table.pending.pop(key, None)
        table.give(slots)

    def delete(self, req: BlockDelete, owner: int) -> dict:
        table = self.tables.get((owner, req.ns))
        if table is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no block namespace {req.ns}")
        if req.all:
            count, freed = len(table.held), table.entry.bytes
            self.sequences.delete_entries([table.entry], "delete")
            del self.tables[(owner, req.ns)]
            log.info("deleted block namespace %s of uid %d: %d blocks, %s", req.ns, owner, count, format_size(freed))
            return {"deleted": count, "freed_bytes": freed}
        with self.index.lock:
            slots = table.held.find(list(dict.fromkeys(req.keys)))
            slots = slots[slots >= 0]
        self._drop(table, slots, "delete")
        return {"deleted": len(slots), "freed_bytes": len(slots) * table.block_bytes}

    def _drop(self, table: BlockTable, slots: np.ndarray, what: str) -> None:
        """Delete blocks: their records in one transaction, then their index cells; their
        DRAM copies and extents are freed once no get still reads them."""
        if not len(slots):
            return
        entry, parts, n = table.entry, table.parts, len(slots)
        with self.index.lock:
            ids = table.extent_ids[slots]
        with self.space.catalog_write(what) as txn:  # never refused for want of space: the reserve
            delete_blocks(self.catalog, txn, entry.uid, ids)
        lay, hed, pag = np.tile(np.arange(parts), n), np.zeros(n * parts, np.int64), np.repeat(slots, parts)
        cols = entry.columns(pag)
        with self.index.lock:
            offs = entry.ssd_off[lay, hed, cols].tolist()
            dram_slots = self.residency.forget_blocks(entry, lay, hed, cols)
            self.index.clear_blocks(entry, lay, hed, cols)
            table.empty(slots)
        table.give(slots)
        extents = [entry.extents.pop(off) for off in offs]
        key = (entry.owner, entry.ns)
        self.sequences.ns_bytes[key] -= n * table.block_bytes
        dram, bb = self.residency.dram, entry.geometry.block_bytes
        self.gate.retire(lambda: dram.release(bb, dram_slots))
        self.gate.retire(lambda: self.space.release_extents(extents))
        self.space.ssd.unpark()
        self.space.keep_reserve()
        self.counters["blocks_deleted" if what == "delete" else "blocks_quota_evicted"] += n

    def enforce_quotas(self, prepared: list[PreparedPut]) -> None:
        """After a commit: each namespace these puts took past its --quota loses its least
        recently used blocks, never one the group wrote, until it is within it."""
        if not self.cfg.quotas:
            return
        written: dict[int, set[int]] = {}
        tables: list[BlockTable] = []  # the group's namespaces only: not a pass over every one
        for p in prepared:
            if p.entry.name == BLOCKS_NAME:
                table = self.tables.get((p.entry.owner, p.entry.ns))
                if table is not None and table.entry is p.entry and p.entry.uid not in written:
                    tables.append(table)
                written.setdefault(p.entry.uid, set()).update(p.page_ids.tolist())
        for table in tables:
            limit = self.sequences.quota_of(table.entry.ns)
            key = (table.entry.owner, table.entry.ns)
            if limit is None or self.sequences.ns_bytes[key] <= limit:
                continue
            over = self.sequences.ns_bytes[key] - limit
            victims = self._least_recent(table, -(-over // table.block_bytes), written[table.entry.uid])
            self._drop(table, victims, "quota")
            log.info("block namespace %s is over its quota %s: deleted its %d least recently used blocks",
                     table.entry.ns, format_size(limit), len(victims))


def part_spans(mb: MappedBuffer, req: BlockGet | BlockPut, block_bytes: int, parts: int, what: str) -> np.ndarray:
    """Where part p of block i of ``req`` lies from its ``offset`` in buffer ``mb`` (an array of
    blocks x parts): ``i * block_bytes + p * part_bytes``, or, with ``offsets``, that part's
    place in its region, from ``offsets[i * regions + r]``. Refused unless each lies in the
    buffer, the namespace's parts lie whole in the regions and, for a get's destinations,
    no two regions share a byte."""
    n, regions, offsets = len(req.keys), req.regions, req.offsets
    part_bytes = block_bytes // parts
    if offsets is None:
        mb.check_span(req.offset, n * block_bytes, what)
        return np.arange(n * parts, dtype=np.int64).reshape(n, parts) * part_bytes
    if parts % regions:
        raise ProtocolError(ErrorCode.UNSUPPORTED, f"namespace {req.ns} keeps a block as {parts} part(s) of {part_bytes} "
                                                 f"bytes, which do not lie whole in {regions} regions of "
                                                 f"{block_bytes // regions} bytes: move its blocks whole, or in regions "
                                                 f"that hold whole parts")
    span = block_bytes // regions
    if what == "destination" and len(offsets) > 1:
        ranked = np.sort(offsets)
        mb.check_span(req.offset, int(ranked[-1]) + span, what)
        clash = np.flatnonzero(np.diff(ranked) < span)
        if len(clash):
            a, b = int(ranked[clash[0]]), int(ranked[clash[0] + 1])
            raise ProtocolError(ErrorCode.BAD_FIELD, f"'offsets' {a} and {b} overlap: {span} bytes there share "
                                                     f"bytes; a get's destinations must not overlap")
    else:
        mb.check_span(req.offset, int(offsets.max()) + span, what)
    per = parts // regions
    if per == 1:  # a part a region
        return offsets.reshape(n, parts)
    return (np.repeat(offsets, per) + np.tile(np.arange(per, dtype=np.int64) * part_bytes, n * regions)).reshape(n, parts)
