"""The get path: look blocks up, copy DRAM hits, read misses from the SSD checked, admit them.

Runs on any thread (the server's get workers, and its main thread for small gets served
inline). Every sequence of a get is checked under the index lock before any byte is
copied, and every copy runs inside the reclaim gate, so a delete or an eviction never
frees a location a get may still read (gate.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from typing import NamedTuple

import numpy as np

from kvdrive.layout import ALIGN, ReadPlan, plan_reads
from kvstored.buffers import MappedBuffer
from kvstored.config import DaemonConfig
from kvstored.copy import address_tags
from kvstored.gate import ReclaimGate
from kvstored.index import BlockIndex, SeqEntry
from kvstored.io_engine import AlignedScratch, IOEngine
from kvstored.protocol import MAX_SEQS_PER_GET, ErrorCode, Get, ProtocolError
from kvstored.residency import Residency
from kvstored.sequences import owned_entry
from kvstored.sessions import Session
from kvstored.ssd import SsdTier

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 16 << 20  # SSD reads of a get checked at once; the scratch buffer per get worker


class DamagedBlockError(ProtocolError):
    """Bytes read back that do not match their checksum; the client sees it as ChecksumError."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CHECKSUM, message)


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


class GetPath:
    def __init__(self, cfg: DaemonConfig, index: BlockIndex, ssd: SsdTier, engine: IOEngine, residency: Residency,
                 gate: ReclaimGate, counters: Counter, clock: itertools.count) -> None:
        self.cfg, self.index, self.ssd, self.engine = cfg, index, ssd, engine
        self.residency, self.gate, self.counters, self.clock = residency, gate, counters, clock
        self._scratch = AlignedScratch()  # per get worker: where its SSD reads land

    @staticmethod
    def seq_groups(req: Get) -> list[tuple[int, np.ndarray | slice]]:
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

    def _parts(self, req: Get, owner: int, blocks: bool) -> list[tuple[SeqEntry, np.ndarray | slice]]:
        """:meth:`seq_groups` with each sequence's entry. Every sequence must exist, be the
        caller's, and all must share a block size; every block must be in range."""
        parts = [(owned_entry(self.index, uid, owner, blocks), at) for uid, at in self.seq_groups(req)]
        sizes = {e.geometry.block_bytes for e, _ in parts}
        if len(sizes) > 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"the sequences of one get must share a block size, got {sorted(sizes)}")
        blocks = req.blocks
        for entry, at in parts:
            g = entry.geometry
            for name, col, limit in (("layer", 0, g.num_layers), ("head", 1, g.num_kv_heads)):
                bad = np.flatnonzero(blocks[at, col] >= limit)
                if len(bad):
                    i = int(np.arange(len(blocks))[at][bad[0]])
                    raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"block {i}: {name} {int(blocks[i, col])} >= {limit}")
        return parts

    def get(self, req: Get, session: Session, blocks: bool = False) -> dict:
        """Serve ``req``; with ``blocks``, a get of a block namespace's slots (blocks.py)."""
        t0 = time.perf_counter()
        parts = self._parts(req, session.uid, blocks)
        bb = parts[0][0].geometry.block_bytes
        blocks = req.blocks.astype(np.int64)
        mb = session.buffers.lookup(req.buf)
        n = len(blocks)
        dst = req.dst if req.dst is not None else np.arange(n, dtype=np.int64) * bb
        mb.check_span(req.offset, int(dst.max()) + bb, "destination")
        dst = dst + req.offset
        with self.gate.reading():
            # An unregister before this point has unmapped the buffer; after it, it waits for us.
            session.buffers.lookup(req.buf)
            found = self._look_up(parts, blocks, dst)
            misses = []
            for f in found:
                hit = f.dram_off >= 0
                mb.write_blocks(self.residency.dram.arena, f.dram_off[hit], f.dst[hit], bb)
                misses.append(np.flatnonzero(~hit))
            n_ssd = sum(len(m) for m in misses)
            reads = bytes_read = 0
            if n_ssd:
                # Every sequence's SSD blocks in one read plan: their reads are in flight together.
                part = np.concatenate([np.full(len(m), j) for j, m in enumerate(misses)])
                pick = lambda name: np.concatenate([getattr(f, name)[m] for f, m in zip(found, misses)])  # noqa: E731
                plan = self._read_ssd([f.entry for f in found], part, pick("lay"), pick("hed"), pick("pag"),
                                      pick("ssd_off"), pick("crc"), mb, pick("dst"))
                reads, bytes_read = plan.num_reads, plan.bytes_read
                for f, miss in zip(found, misses):
                    if len(miss):
                        self.residency.admit(f.entry, f.lay[miss], f.hed[miss], f.pag[miss], None, mb, f.dst[miss],
                                             replace=False, expect_crc=f.crc[miss])
        c = self.counters
        c["gets"] += 1
        c["blocks_dram"] += n - n_ssd
        c["blocks_ssd"] += n_ssd
        c["ssd_reads"] += reads
        c["ssd_bytes_read"] += bytes_read
        return {"n": n, "dram": n - n_ssd, "ssd": n_ssd, "reads": reads, "bytes_read": bytes_read,
                "ms": (time.perf_counter() - t0) * 1e3}

    def _look_up(self, parts, blocks: np.ndarray, dst: np.ndarray) -> list[_Looked]:
        """Every sequence's blocks checked, under the index lock, before any is copied; each
        block's last use set to a new tick and the DRAM residents' rank recorded."""
        found = []
        with self.index.lock:
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
                        f"{len(missing)} of {len(blocks)} blocks are not stored, first (layer {lay[i]}, head {hed[i]}, "
                        f"page {pag[i]}) of {entry.ns}/{entry.name}",
                    )
                found.append(_Looked(entry, lay, hed, pag, col, ssd_off, entry.crc[lay, hed, col],
                                     entry.dram_off[lay, hed, col], dst[at]))
            self.used([(f.entry, f.lay, f.hed, f.pag, f.col) for f in found])
        return found

    def used(self, groups, resident: bool = False) -> None:
        """Blocks just read, as (entry, layers, heads, pages, columns) groups: their last use
        set to one new tick, and the DRAM residents' rank recorded (index lock held).
        ``resident``: the caller found every one in DRAM (a DRAM-only get), so their rank
        needs no residency check and, as a rule, no sort (:meth:`Residency.touched_resident`)."""
        tick = next(self.clock)
        for entry, lay, hed, pag, col in groups:
            entry.last_use[lay, hed, col] = tick
            if len(lay):
                self.index.used(entry, tick)
            if resident:
                self.residency.touched_resident(entry, lay, hed, pag, col, tick)
            else:
                self.residency.touched(entry, lay, hed, pag, col)

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
                groups = self.seq_groups(req)
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
            looked.append((entry, blocks[:, 0], blocks[:, 1], blocks[:, 2]))
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
            self._damaged(entries, part, lay, hed, pag, ssd_off, np.concatenate(bad))
        return plan

    def _damaged(self, entries, part, lay, hed, pag, ssd_off, wrong: np.ndarray) -> None:
        self.counters["checksum_errors"] += len(wrong)
        i = int(wrong.min())
        entry = entries[int(part[i])]
        log.error(
            "checksum mismatch: %s/%s layer %d head %d page %d at offset %d (%d bad blocks in this get)",
            entry.ns, entry.name, lay[i], hed[i], pag[i], ssd_off[i], len(wrong))
        raise DamagedBlockError(
            f"checksum mismatch in {len(wrong)} block(s), first (layer {lay[i]}, head {hed[i]}, page {pag[i]}) "
            f"of {entry.ns}/{entry.name} at data file offset {int(ssd_off[i])}; the SSD copy is damaged"
        )
