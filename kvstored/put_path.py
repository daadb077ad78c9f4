"""The put path: check, stage, write and place a put's blocks, then commit and publish groups.

A put is two-phase: :meth:`PutPath.prepare` checks the request (the index's page window
and byte budget included, see index.py), stages the blocks in packing order, writes them
to the data file and grows the index arrays the put will land in; :meth:`PutPath.commit`
makes a group of prepared puts durable (one fdatasync, one LMDB commit) and only then
publishes them to the index (assignments into those arrays) and offers them to the DRAM
tier (a cache: a block it does not take is read from the SSD). Everything that can fail
for one put fails in its prepare, so it is refused alone; only the shared commit fails a
whole group, and then none of it is durable. A put that fails in either phase leaves no
blocks behind: its extents are unreferenced space that the allocator takes back.
Everything here runs on the single writer thread, but for the copies and checksums below.

Engine blocks that lie in the client's buffer as the data file can take them (host
memory; for O_DIRECT, 4 KiB-aligned) are written straight from it; meanwhile a thread of
their own copies them into DRAM slots reserved for them and checksums them
(:meth:`PutPath.write_blocks`). On a loaded 2-core host a 64 MiB put spent 4 to 10 ms
in its staging copy, as long in its checksums and 5 to 25 ms in its copy into the DRAM
tier after the commit, beside 25 to 50 ms of writes; now only the writes stand between
it and its commit. A block's checksum is that of its DRAM copy (of the client's bytes
where the tier took no copy), so a client that changes its bytes before the reply
(which it must not) leaves a block whose SSD copy fails its checksum: a get reports it
damaged, never other bytes.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
from collections import Counter
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvdrive.layout import ALIGN, SpaceError, align_up, packing_order
from kvstored.buffers import MappedBuffer
from kvstored.catalog import Catalog, ExtentRecord
from kvstored.checksum import block_crcs, verify_scatter
from kvstored.config import DaemonConfig, SyncPolicy, format_size
from kvstored.copy import address_tags, gather_scatter
from kvstored.footprint import check_put_bytes
from kvstored.gate import ReclaimGate
from kvstored.index import BlockIndex, Growth, IndexFullError, PageSpanError, SeqEntry
from kvstored.protocol import ErrorCode, ProtocolError, Put
from kvstored.residency import Residency
from kvstored.sessions import Session
from kvstored.space import Space
from kvstored.ssd import NO_SPACE, SsdTier
from kvstored.staging import StagingPool

log = logging.getLogger(__name__)

STAGING_KEEP_BYTES = 128 << 20  # put staging mappings kept for reuse between puts (staging.py)


@dataclass
class PreparedPut:
    entry: SeqEntry
    records: list[ExtentRecord]
    extents: list[tuple[int, int]]
    staging: np.ndarray
    staging_map: mmap.mmap | None  # None: written straight from the client's buffer
    stage_offs: np.ndarray  # where each block sits in the staging copy, or in the client's buffer
    layers: np.ndarray
    heads: np.ndarray
    pages: np.ndarray
    importance: np.ndarray
    crc: np.ndarray
    ssd_off: np.ndarray  # where each block lies in the data file
    page_ids: np.ndarray  # the put's distinct pages
    pool: StagingPool | None = None  # where the staging mapping goes back to
    # Engine blocks (blocks.py): records written in the commit's transaction, what to do
    # once the put is published or aborted, and the reply's fields.
    on_commit: Callable[[Any], None] | None = None
    on_publish: Callable[[], None] | None = None
    on_abort: Callable[[], None] | None = None
    reply: dict | None = None
    dram_slots: np.ndarray | None = None  # DRAM copies of the first blocks, made beside the write, to map
    # The (uid, layer) keys under which the put's pages are listed as being written (PutPath._inflight).
    inflight: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        """The bytes this put writes (what a write group counts against its size)."""
        return sum(n for _, n in self.extents)

    def release(self) -> None:
        self.staging = np.zeros(0, dtype=np.uint8)
        if self.staging_map is None:
            return
        if self.pool is not None:
            self.pool.give(self.staging_map)
        else:
            self.staging_map.close()


@dataclass
class Written:
    """Blocks written to the data file by :meth:`PutPath.write_blocks`."""

    block_bytes: int
    offsets: list[int]  # each block's extent
    crc: np.ndarray  # each block's CRC-32C (without its address tag)
    staging_map: mmap.mmap | None  # the staging copy's mapping; None: none was made
    staging: np.ndarray
    src_offs: np.ndarray  # where each block sits in the staging copy, or in the client's buffer
    dram_slots: np.ndarray | None  # written from the client's buffer: the DRAM copies of the first blocks


@dataclass
class _Staged:
    """A put's blocks in slot order: [layer, head, slot] arrays and the staging copy."""

    staging_map: mmap.mmap
    staging: np.ndarray
    stage_offs: np.ndarray  # where each block sits in the staging copy
    slot_pages: np.ndarray
    crc: np.ndarray
    importance: np.ndarray
    cluster: np.ndarray
    ext_bytes: int


class PutPath:
    def __init__(self, cfg: DaemonConfig, index: BlockIndex, catalog: Catalog, ssd: SsdTier, space: Space,
                 residency: Residency, gate: ReclaimGate, counters: Counter, ns_bytes: Counter,
                 clock: itertools.count) -> None:
        self.cfg, self.index, self.catalog, self.ssd, self.space = cfg, index, catalog, ssd, space
        self.residency, self.gate, self.counters, self.ns_bytes, self.clock = residency, gate, counters, ns_bytes, clock
        self.staging = StagingPool(STAGING_KEEP_BYTES)
        self._inflight: dict[tuple[int, int], list[np.ndarray]] = {}
        # Checksums of blocks written straight from a client's buffer, beside their writes.
        self._crc_thread = futures.ThreadPoolExecutor(1, thread_name_prefix="kvstored-put-crc")
        warm_kernels()

    def close(self) -> None:
        self._crc_thread.shutdown()
        self.staging.close()

    # ------------------------------------------------------------ prepare

    def prepare(self, req: Put, session: Session, entry: SeqEntry) -> PreparedPut:
        mb = self._check(req, session, entry)
        growth = self.plan_growth(entry, req.pages)
        self.space.check_room("put")
        st = self._stage(req, mb, session, entry)
        num_l, num_h, num_p = st.slot_pages.shape
        # Space is taken only once nothing but the write can fail, so no path leaks it.
        offsets = self.place(st.staging, num_l * num_h, st.ext_bytes)
        try:
            # The index grows now, so that publishing after the commit cannot fail.
            self.index.grow(entry, growth)
        except MemoryError:
            for off in offsets:
                self.ssd.allocator.free(off, st.ext_bytes)
            raise ProtocolError(
                ErrorCode.FULL,
                f"no memory for the block index of {entry.ns}/{entry.name} ({growth.capacity} pages); lower --index-max "
                f"to what this host can hold, or delete sequences",
            ) from None
        bb = entry.geometry.block_bytes
        ssd_off = (np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(num_p, dtype=np.int64) * bb).ravel()
        records = []
        for k, (li, h) in enumerate(itertools.product(range(num_l), range(num_h))):
            self.catalog.next_extent += 1
            records.append(ExtentRecord(
                entry.uid, int(req.layers[li]), h, self.catalog.next_extent, offsets[k],
                st.slot_pages[li, h].astype(np.int32), st.crc[li, h], st.cluster[li, h], st.importance[li, h],
            ))
        inflight = tuple((entry.uid, int(li)) for li in req.layers)
        for key in inflight:
            self._inflight.setdefault(key, []).append(req.pages)
        lay = np.broadcast_to(req.layers[:, None, None], st.slot_pages.shape)
        hed = np.broadcast_to(np.arange(num_h)[None, :, None], st.slot_pages.shape)
        return PreparedPut(
            entry, records, [(o, num_p * bb) for o in offsets], st.staging, st.staging_map, st.stage_offs.ravel(),
            lay.ravel().copy(), hed.ravel().copy(), st.slot_pages.ravel(), st.importance.ravel(), st.crc.ravel(),
            ssd_off, req.pages, pool=self.staging, inflight=inflight,
        )

    def _check(self, req: Put, session: Session, entry: SeqEntry) -> MappedBuffer:
        """Refuse a put that names blocks out of range, asks too much, or overwrites; its source buffer."""
        g = entry.geometry
        if req.layers.max() >= g.num_layers:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"layer {int(req.layers.max())} >= num_layers {g.num_layers}")
        num_l, num_h, num_p = len(req.layers), g.num_kv_heads, len(req.pages)
        total = num_l * num_h * num_p
        if total > self.cfg.max_blocks_per_request:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"put of {num_l} layers x {num_h} heads x {num_p} pages = {total} blocks, limit {self.cfg.max_blocks_per_request}",
            )
        check_put_bytes(num_l * num_h, num_p, g.block_bytes)
        for name, arr in (("cluster", req.cluster), ("order", req.order), ("importance", req.importance)):
            if arr is not None and len(arr) != total:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'{name}' has {len(arr)} values for {total} blocks")
        mb = session.buffers.lookup(req.buf)
        mb.check_span(req.offset, total * g.block_bytes, "source")
        self._check_new_pages(entry, req.layers, req.pages)
        return mb

    def _stage(self, req: Put, mb: MappedBuffer, session: Session, entry: SeqEntry) -> _Staged:
        """Copy the put's blocks from the client's buffer into staging, each (layer, head)'s
        pages in packing order as one extent; their CRCs, importance and cluster in that order."""
        bb, num_h = entry.geometry.block_bytes, entry.geometry.num_kv_heads
        layers, pages = req.layers, req.pages
        num_l, num_p = len(layers), len(pages)
        total = num_l * num_h * num_p
        cluster = (req.cluster if req.cluster is not None else np.zeros(total, np.int32)).reshape(num_l, num_h, num_p)
        order = req.order.reshape(num_l, num_h, num_p) if req.order is not None else None
        importance = (req.importance if req.importance is not None else np.zeros(total, np.float32)).reshape(num_l, num_h, num_p)
        ext_bytes = align_up(num_p * bb)
        staging_map, staging = self.staging.take(num_l * num_h * ext_bytes)
        perm_idx = np.empty((num_l, num_h, num_p), dtype=np.int64)
        for li, h in itertools.product(range(num_l), range(num_h)):
            perm_idx[li, h] = packing_order(pages, cluster[li, h], None if order is None else order[li, h])
        slot_pages = pages[perm_idx]
        src_offs = req.offset + ((np.arange(num_l * num_h).reshape(num_l, num_h, 1) * num_p) + perm_idx) * bb
        stage_offs = (np.arange(num_l * num_h, dtype=np.int64)[:, None] * ext_bytes + np.arange(num_p) * bb).reshape(num_l, num_h, num_p)
        with self.gate.reading():
            # Inside the gate an unregister of the source waits for this copy to end before
            # it unmaps the buffer; one that came first fails the put here.
            session.buffers.lookup(req.buf)
            mb.read_blocks(src_offs.ravel(), staging, stage_offs.ravel(), bb)
        lay = np.broadcast_to(layers[:, None, None], slot_pages.shape)
        hed = np.broadcast_to(np.arange(num_h)[None, :, None], slot_pages.shape)
        tags = address_tags(entry.uid, lay.ravel(), hed.ravel(), slot_pages.ravel())
        crc = (block_crcs(staging, stage_offs.ravel(), bb) ^ tags).reshape(slot_pages.shape)
        # Importance and cluster follow the pages into slot order.
        return _Staged(staging_map, staging, stage_offs, slot_pages, crc, np.take_along_axis(importance, perm_idx, axis=2),
                       np.take_along_axis(cluster, perm_idx, axis=2), ext_bytes)

    def plan_growth(self, entry: SeqEntry, pages: np.ndarray) -> Growth:
        try:
            return self.index.plan_growth(entry, pages)
        except PageSpanError as exc:
            self.counters["puts_refused_span"] += 1
            raise ProtocolError(ErrorCode.TOO_LARGE, str(exc)) from None
        except IndexFullError as exc:
            self.counters["puts_refused_index"] += 1
            raise ProtocolError(ErrorCode.FULL, str(exc)) from None

    def write_blocks(self, mb: MappedBuffer, session: Session, buf: int, src_offs: np.ndarray, nbytes: int,
                     owner: int) -> Written:
        """Write the blocks of ``nbytes`` at ``src_offs`` of ``owner``'s buffer ``mb`` to extents
        of their own; where they lie and their checksums. Straight from ``mb`` where the
        data file can take them as they lie (see the module), else through a staging
        copy. An unregister of ``mb`` waits, inside the gate, for the copies and writes;
        one that came first fails the put here."""
        if self._writable_from(mb, src_offs, nbytes):
            return self._write_direct(mb, session, buf, src_offs, nbytes, owner)
        count, ext_bytes = len(src_offs), align_up(nbytes)
        # On a failure the staging map is left to the garbage collector (see place).
        stage_offs = np.arange(count, dtype=np.int64) * ext_bytes
        staging_map, staging = self.staging.take(count * ext_bytes)
        with self.gate.reading():
            session.buffers.lookup(buf)
            mb.read_blocks(src_offs, staging, stage_offs, nbytes)
        crc = block_crcs(staging, stage_offs, nbytes)
        return Written(nbytes, self.place(staging, count, ext_bytes), crc, staging_map, staging, stage_offs, None)

    def _write_direct(self, mb: MappedBuffer, session: Session, buf: int, src_offs: np.ndarray, nbytes: int,
                      owner: int) -> Written:
        count = len(src_offs)
        slots = self.residency.reserve(owner, nbytes, count)  # before the gate (see reserve)
        try:
            with self.gate.reading():
                session.buffers.lookup(buf)
                sums = self._crc_thread.submit(self._copy_and_sum, mb.array, src_offs, nbytes, slots)
                try:
                    offsets = self.place(mb.array, count, nbytes, src_offs)
                except ProtocolError:
                    futures.wait([sums])
                    mb.check_intact()  # EFAULT from a pool its client shrank is the client's doing
                    raise
                finally:
                    futures.wait([sums])  # it reads the client's buffer: not past the gate
                try:
                    mb.check_intact()  # a pool its client shrank meanwhile: not its bytes
                except ProtocolError:
                    self.unwrite(Written(nbytes, offsets, np.zeros(0, np.uint32), None, np.zeros(0, np.uint8),
                                         src_offs, None))
                    raise
        except BaseException:
            self.residency.release_reserved(nbytes, slots)
            raise
        wrote = Written(nbytes, offsets, np.zeros(0, np.uint32), None, np.zeros(0, np.uint8), src_offs, slots)
        if sums.exception() is not None:
            self.unwrite(wrote)
        wrote.crc = sums.result()
        return wrote

    def _copy_and_sum(self, src: np.ndarray, src_offs: np.ndarray, nbytes: int, slots: np.ndarray) -> np.ndarray:
        """The blocks' CRC-32Cs: the first ``len(slots)`` copied into those DRAM slots and
        summed there, the others summed in ``src``."""
        k = len(slots)
        crc = np.empty(len(src_offs), np.uint32)
        crc[:k] = self.residency.fill(src, src_offs, slots, nbytes)
        crc[k:] = block_crcs(src, src_offs[k:], nbytes)
        return crc

    def unwrite(self, wrote: Written) -> None:
        """Give back the extents and DRAM slots of blocks written for a put that fails after."""
        for off in wrote.offsets:
            self.ssd.allocator.free(off, align_up(wrote.block_bytes))
        if wrote.dram_slots is not None:
            self.residency.release_reserved(wrote.block_bytes, wrote.dram_slots)

    def _writable_from(self, mb: MappedBuffer, src_offs: np.ndarray, nbytes: int) -> bool:
        """Whether blocks of ``nbytes`` at ``src_offs`` of ``mb`` can be written to the data file
        as they lie: host memory (a CUDA IPC buffer has no host view), whole 4 KiB units
        at 4 KiB-aligned addresses (what O_DIRECT takes)."""
        if nbytes % ALIGN or not mb.array.nbytes or not len(src_offs):
            return False
        return not ((mb.array.ctypes.data + src_offs) % ALIGN).any()

    def place(self, source: np.ndarray, count: int, ext_bytes: int, src_offs: np.ndarray | None = None) -> list[int]:
        """Write a put's extents to the data file (see SsdTier.place); refusals as replies."""
        try:
            return self.ssd.place(source, count, ext_bytes, src_offs)
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
            if exc.errno == errno.EFAULT:  # the kernel could not read the source: a client's pool it shrank
                raise ProtocolError(ErrorCode.BUFFER, f"writing blocks failed: the client's memory could not be "
                                                      f"read ({exc.strerror}); a pool shrunk under its put?") from None
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

    # ------------------------------------------------------------ commit

    def abort(self, prepared: list[PreparedPut]) -> None:
        for p in prepared:
            for off, nbytes in p.extents:
                self.ssd.allocator.free(off, nbytes)
            self._drop_reserved(p)
            if p.on_abort is not None:
                p.on_abort()
            self._forget_inflight(p)
            p.release()

    def commit(self, prepared: list[PreparedPut]) -> dict[int, ProtocolError]:
        """Make prepared puts durable, then visible (:meth:`make_durable`, then :meth:`publish`,
        on this thread); a failure of the shared commit aborts them all and raises."""
        try:
            self.make_durable(prepared)
        except BaseException as exc:
            self.abort(prepared)
            if isinstance(exc, ProtocolError):
                self.counters["commits_failed"] += 1
            raise
        return self.publish(prepared)

    def make_durable(self, prepared: list[PreparedPut]) -> None:
        """One fdatasync of the data file (with ``--sync durable``), then one LMDB commit of the
        group's extent and block records; ProtocolError(IO) for an I/O error, and then no
        put of the group is durable (the caller aborts them). It touches only the data
        file's descriptor and the catalog, so it may run on the commit thread while the
        writer prepares the next group (kvstored/commits.py)."""
        if not prepared:
            return
        try:
            if self.cfg.sync == SyncPolicy.DURABLE:
                self.ssd.sync()
            with self.space.catalog_write("put") as txn:
                self.catalog.add_extents(txn, [rec for p in prepared for rec in p.records])
                for p in prepared:
                    if p.on_commit is not None:
                        p.on_commit(txn)
        except OSError as exc:
            raise ProtocolError(ErrorCode.IO, f"commit failed: {exc.__class__.__name__}: {exc}") from None

    def publish(self, prepared: list[PreparedPut]) -> dict[int, ProtocolError]:
        """Make a durable group visible: its puts into the index, their blocks offered to the
        DRAM tier. Publishing is assignments into index arrays each prepare grew; should one
        fail all the same (a bug), only that put is refused: the returned map holds its
        position."""
        self.counters["put_commits"] += 1
        self.space.keep_reserve()
        tick = next(self.clock)
        refused: dict[int, ProtocolError] = {}
        for i, p in enumerate(prepared):
            self._forget_inflight(p)
            try:
                self._publish(p, tick)
            except Exception as exc:
                log.exception("publishing a committed put to %s/%s failed", p.entry.ns, p.entry.name)
                self.counters["publish_failed"] += 1
                refused[i] = ProtocolError(
                    ErrorCode.INTERNAL,
                    f"the put is durable but not visible until kvstored restarts: {exc.__class__.__name__}: {exc}",
                )
                self._drop_reserved(p)
            else:
                if p.on_publish is not None:
                    p.on_publish()
                try:
                    self._admit(p)
                except Exception:  # DRAM is a cache: a block it does not take is read from the SSD
                    log.exception("admitting a put of %s/%s to DRAM failed", p.entry.ns, p.entry.name)
                    self.counters["dram_admit_failed"] += 1
            p.release()
        return refused

    def _forget_inflight(self, p: PreparedPut) -> None:
        """The put's pages are no longer being written (published or aborted)."""
        for key in p.inflight:
            left = [a for a in self._inflight.get(key, ()) if a is not p.page_ids]
            if left:
                self._inflight[key] = left
            else:
                self._inflight.pop(key, None)
        p.inflight = ()

    def _admit(self, p: PreparedPut) -> None:
        """Offer a published put's blocks to the DRAM tier: map the copies made beside its
        write, or copy them from its staging copy."""
        if p.dram_slots is not None:
            self.residency.publish_reserved(p.entry, p.layers, p.heads, p.pages, p.dram_slots, p.crc)
        else:
            self.residency.admit(p.entry, p.layers, p.heads, p.pages, p.importance, p.staging, p.stage_offs,
                                 replace=True)

    def _drop_reserved(self, p: PreparedPut) -> None:
        """Give back the DRAM slots of a put that will not be published (no reader saw them)."""
        if p.dram_slots is not None:
            self.residency.release_reserved(p.entry.geometry.block_bytes, p.dram_slots)
            p.dram_slots = None

    def _publish(self, p: PreparedPut, tick: int) -> None:
        entry = p.entry
        with self.index.lock:
            cols = entry.columns(p.pages)
            entry.ssd_off[p.layers, p.heads, cols] = p.ssd_off
            entry.crc[p.layers, p.heads, cols] = p.crc
            entry.importance[p.layers, p.heads, cols] = p.importance
            entry.last_use[p.layers, p.heads, cols] = tick
            if len(cols):
                self.index.used(entry, tick)
            self.index.mark_blocks(entry, cols)
            entry.extents.extend(p.extents)
        bb = entry.geometry.block_bytes
        self.counters["puts"] += 1
        self.counters["blocks_put"] += len(p.pages)
        self.counters["bytes_put"] += len(p.pages) * bb
        self.ns_bytes[(entry.owner, entry.ns)] += len(p.pages) * bb



def warm_kernels() -> None:
    """Load the compiled copy and checksum kernels of puts and gets now, at start: the first
    call of each in a process loads it from numba's cache (0.3 to 0.6 s measured on a
    loaded 2-core host), which the first put or get would otherwise wait for."""
    buf, offs = np.zeros(2 * ALIGN, np.uint8), np.zeros(1, np.int64)
    crc = block_crcs(buf, offs, ALIGN)
    gather_scatter(buf, offs, buf, offs + ALIGN, ALIGN)
    verify_scatter(buf, offs, buf, offs + ALIGN, ALIGN, np.zeros(1, np.uint32), crc)
