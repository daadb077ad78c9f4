"""The store: a thin coordinator over the parts that each do one job.

- tiers (tier.py): the media, DRAM (dram.py) as the cache tier and the SSD data file
  (ssd.py) as the durable tier, opened through one registry;
- the block index (index.py): where every block of every sequence lives, rebuilt from the
  catalog (catalog.py, LMDB) at start-up;
- residency (residency.py): which blocks the DRAM tier keeps, by a heap, never a scan;
- space (space.py): the catalog's disk reserve and catalog writes;
- sequences (sequences.py): create, open, list, lookup, delete and quotas;
- engine blocks (blocks.py): named, write-once blocks of one size per namespace, each
  namespace a sequence whose pages are slots, stored through the put and get paths;
- the put path (put_path.py) and the get path (get_path.py), which take the parts they
  need and never the store.

Threading contract (the server keeps it):
- :meth:`create`, :meth:`create_many`, :meth:`delete`, :meth:`prepare_put`,
  :meth:`commit_puts`, :meth:`publish_puts` and the writes of ``blocks`` (``prepare_put``,
  ``delete``) run on the single writer thread, which owns the SSD allocator.
- :meth:`make_durable` runs on the commit thread, one group at a time, while the writer
  prepares the next (kvstored/commits.py); catalog writes take the catalog's lock.
- :meth:`get`, :meth:`open`, :meth:`list`, :meth:`stats`, ``blocks.lookup`` and
  ``blocks.get`` run on any thread.

Every sequence belongs to the uid that created it: lookups by name take the caller's
uid, and a request naming another owner's sequence by uid is told it does not exist
(the same words as for a uid never used), so uids say nothing about other tenants.
Buffers are looked up in the calling session's registry only.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import logging
import os
import time
from collections import Counter
from pathlib import Path

import lmdb
import numpy as np

from kvdrive.layout.format import DATA_FILE, FORMAT_VERSION, META_DIR
from kvstored.blocks import Blocks
from kvstored.catalog import Catalog, CatalogDamagedError, ExtentRecord
from kvstored.config import DaemonConfig, SyncPolicy, format_size
from kvstored.dram import DramTier
from kvstored.files import StoreBusyError, StoreOpenError, lock_exclusive
from kvstored.gate import ReclaimGate
from kvstored.get_path import READ_CHUNK_BYTES, DamagedBlockError, GetPath  # noqa: F401 (re-exported)
from kvstored.index import BlockIndex, SeqEntry
from kvstored.io_engine import choose_engine
from kvstored.protocol import Create, Delete, Get, ListSeqs, Lookup, OpenSeq, ProtocolError, Put
from kvstored.put_path import PreparedPut, PutPath
from kvstored.residency import Residency
from kvstored.sequences import Sequences, owned_entry
from kvstored.sessions import Session
from kvstored.space import Space
from kvstored.ssd import SsdTier
from kvstored.tier import open_tier

log = logging.getLogger(__name__)

__all__ = ["Store", "PreparedPut", "DamagedBlockError", "READ_CHUNK_BYTES"]


class Store:
    """Opening refuses, with a :class:`StoreOpenError` that says what to do, a store that
    another kvstored serves or whose catalog is missing or damaged; whatever fails, a
    store that did not open holds nothing open."""

    dram: DramTier
    ssd: SsdTier

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self._ssd_dir = str(cfg.ssd_dir.resolve())
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
        self.ssd = open_tier("durable", cfg)
        # Held on the open file, which an unlink of kvstored.lock leaves in force.
        lock_exclusive(self.ssd.fd, self.ssd.path, cfg.ssd_dir)
        self.engine = choose_engine(cfg.engine, cfg.io_threads, str(self.ssd.path), self.ssd.direct)
        self.dram = open_tier("cache", cfg)
        self.index = BlockIndex(cfg.index_max_bytes, cfg.index_max_per_uid_bytes)
        self.gate = ReclaimGate()
        self.counters: Counter[str] = Counter()
        clock = itertools.count(1)  # ticks of puts and gets: the last use of a block
        self.residency = Residency(self.dram, self.index, self.gate.retire, self.counters)
        self.space = Space(cfg, self.catalog, self.ssd, self.counters)
        self.sequences = Sequences(cfg, self.index, self.catalog, self.space, self.residency, self.gate.retire,
                                   self.counters)
        self.puts = PutPath(cfg, self.index, self.catalog, self.ssd, self.space, self.residency, self.gate,
                            self.counters, self.sequences.ns_bytes, clock)
        self.gets = GetPath(cfg, self.index, self.ssd, self.engine, self.residency, self.gate, self.counters, clock)
        self.blocks = Blocks(cfg, self.index, self.catalog, self.sequences, self.puts, self.gets, self.residency,
                             self.space, self.gate, self.counters)
        self._load()
        self.index.rank_loaded()
        _give_back_free_memory()  # what the catalog's decode left free: most of it, for a store of small blocks
        self.space.keep_reserve()
        log.info(
            "store at %s: format %d, %d sequences, %s on SSD (cap %s), DRAM tier %s pre-faulted, opened in %.2f s",
            cfg.ssd_dir, FORMAT_VERSION, len(self.index.all()), format_size(self.ssd.used_bytes),
            format_size(cfg.ssd_max_bytes), format_size(cfg.dram_bytes), time.monotonic() - t0,
        )

    def _load(self) -> None:
        contents = self.catalog.load(os.fstat(self.ssd.fd).st_size)
        self.index.add_many([SeqEntry(rec.uid, rec.ns, rec.name, rec.geometry, rec.created, rec.owner)
                             for rec in contents.sequences])
        by_uid: dict[int, list[ExtentRecord]] = {}
        for ext in contents.extents:
            assert self.index.get(ext.uid) is not None, "Catalog.load checks that every extent's sequence exists"
            by_uid.setdefault(ext.uid, []).append(ext)
        starts, lengths = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for uid, exts in by_uid.items():
            entry = self.index.get(uid)
            offsets, nbytes = self.index.load_extents(entry, exts)
            starts.append(offsets)
            lengths.append(nbytes)
            self.sequences.ns_bytes[(entry.owner, entry.ns)] += entry.bytes
        for uid, cols in contents.block_columns.items():
            entry = self.index.get(uid)
            self.index.load_parts(entry, cols)
            self.sequences.ns_bytes[(entry.owner, entry.ns)] += entry.bytes
            starts.append(cols.offsets.ravel())
            lengths.append(np.full(cols.offsets.size, entry.geometry.block_bytes, np.int64))
        self.ssd.load(np.concatenate(starts), np.concatenate(lengths))
        self.blocks.load(contents)
        if self.index.num_bytes > self.index.max_bytes:
            log.warning("the block index holds %s, past --index-max %s: puts that grow it are refused until sequences "
                        "are deleted", format_size(self.index.num_bytes), format_size(self.index.max_bytes))

    # ------------------------------------------------------------ requests, each to the part that serves it

    def hello(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "engine": self.engine.name,
            "direct_io": self.ssd.direct,
            "direct_writes": self.ssd.direct_writes,
            "write_behind_backlog": self.ssd.writeback_backlog,
            "dram_bytes": self.dram.capacity,
            "ssd_max_bytes": self.ssd.allocator.capacity,
            "sync": self.cfg.sync,
            "pid": os.getpid(),
            "ssd_dir": self._ssd_dir,
            "get_seqs": True,  # a get may name each block's sequence (the 'seqs' array)
            "block_ops": True,  # the block_* ops: engine blocks by key (blocks.py)
        }

    def create(self, req: Create, owner: int) -> dict:
        """Create ``req``'s sequence, owned by OS user ``owner``."""
        result = self.sequences.create_many([(req, owner)])[0]
        if isinstance(result, ProtocolError):
            raise result
        return result

    def create_many(self, reqs: list[tuple[Create, int]], writers: list[bytes | None] | None = None
                    ) -> list[dict | ProtocolError]:
        return self.sequences.create_many(reqs, writers)

    def open(self, req: OpenSeq, owner: int) -> dict:
        return self.sequences.open(req, owner)

    def list(self, req: ListSeqs, owner: int) -> dict:
        return self.sequences.list(req, owner)

    def lookup(self, req: Lookup, owner: int) -> dict:
        return self.sequences.lookup(req, owner)

    def delete(self, req: Delete, owner: int) -> dict:
        return self.sequences.delete(req, owner)

    def enforce_quotas(self, prepared: list[PreparedPut]) -> None:
        self.sequences.enforce_quotas([p.entry for p in prepared])
        self.blocks.enforce_quotas(prepared)

    def prepare_put(self, req: Put, session: Session) -> PreparedPut:
        entry = owned_entry(self.index, req.uid, session.uid)
        if entry.writer is None or not self.sequences.session_open(entry.writer):
            entry.writer = session.token  # a writer that reconnected after a restart says so with its next put
        return self.puts.prepare(req, session, entry)

    def abort_puts(self, prepared: list[PreparedPut]) -> None:
        self.puts.abort(prepared)

    def commit_puts(self, prepared: list[PreparedPut]) -> dict[int, ProtocolError]:
        return self.puts.commit(prepared)

    def make_durable(self, prepared: list[PreparedPut]) -> None:
        self.puts.make_durable(prepared)

    def publish_puts(self, prepared: list[PreparedPut]) -> dict[int, ProtocolError]:
        return self.puts.publish(prepared)

    def sync(self) -> None:
        self.ssd.sync()
        self.catalog.sync()

    def get(self, req: Get, session: Session) -> dict:
        return self.gets.get(req, session)

    def in_dram(self, req: Get, session: Session, max_bytes: int) -> bool:
        return self.gets.in_dram(req, session, max_bytes)

    def stats(self, session: Session) -> dict:
        """Daemon-wide figures (tiers, counters) and the caller's own sequence count; to a
        caller that does not see the daemon (docs/stats.md), its own figures and its limits."""
        if not session.sees_daemon:
            return {
                **self.hello(),
                "scope": "user",
                "sequences": self.index.count(session.uid),
                "dram_used_bytes": self.residency.shares.held(session.uid),
                "ssd_used_bytes": self.index.stored_bytes(session.uid),
                "index_bytes": self.index.owner_bytes(session.uid),
                "index_max_bytes": self.index.max_bytes_per_owner,
            }
        return {
            **self.hello(),
            "scope": "daemon",
            "sequences": self.index.count(session.uid),
            "dram_used_bytes": self.dram.used_bytes,
            "dram_blocks": self.dram.num_blocks,
            "ssd_used_bytes": self.ssd.used_bytes,
            "ssd_file_bytes": self.ssd.allocator.end,
            "index_bytes": self.index.num_bytes,
            "index_max_bytes": self.index.max_bytes,
            "block_namespaces": len(self.blocks.tables),
            "blocks": self.blocks.num_blocks(),
            "counters": dict(self.counters),
        }

    def close(self) -> None:
        """Close what is open (all of it once the store opened; what there is after a failed open)."""
        puts = self.__dict__.pop("puts", None)
        if puts is not None:
            puts.close()
        for name in ("engine", "catalog", "ssd", "dram"):
            part = self.__dict__.pop(name, None)
            if part is not None:
                part.close()
        fd = self.__dict__.pop("_lock_fd", None)
        if fd is not None:
            os.close(fd)


def _give_back_free_memory() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; elsewhere, nothing)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
