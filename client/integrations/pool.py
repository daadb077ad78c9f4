"""Zero-copy moves for an engine whose CPU tier is shared memory: kvstored reads and writes
the engine's own rows.

vLLM's CPU tier is a file in /dev/shm mapped by every process of the engine (its
``SharedOffloadRegion``); SGLang can keep its host pool in a memfd. When the rows a
:class:`~kvdrive_client.integrations.blocks.BlockStore` moves lie in such a mapping, the
file is registered with kvstored as a *pool* (docs/protocol.md, "Pool buffers"), and a
load is a ``block_get`` whose blocks land straight in their rows (the daemon's copy, no
staging region, no copy out), a store a ``block_put`` that reads them there.

:func:`find_shared_file` finds the file behind an array from ``/proc/self/maps``: a
descriptor this process holds on the same file (vLLM keeps its region's open), or the
file itself where it is still linked. Anonymous memory, private mappings and memory on a
disk file have none; those move through staging, as before, and the store logs why.

A pool request's fate must be known before its rows go back to the engine: a get or put
still running would write or read rows the engine has given to other blocks. So a pool
request is waited for until the daemon answers or its session ends
(:meth:`~kvdrive_client.store.PendingGet.settle`), never abandoned at a timeout; a
daemon that ended the session (it stopped or restarted) moves nothing more.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import zmq

from kvdrive.protocol import MAX_BLOCK_KEYS, ErrorCode
from kvdrive.protocol.files import TMPFS_MAGIC, fs_type
from kvdrive_client.errors import BufferError_, ChecksumError, KVDriveError, NotFoundError
from kvdrive_client.integrations.rows import Rows, Spans, keys_bytes
from kvdrive_client.shm import PoolBuffer

if TYPE_CHECKING:
    from kvdrive_client.integrations.lanes import Channel
    from kvdrive_client.store import StoreClient

log = logging.getLogger(__name__)

# An in-place load of at least twice this, with no other load running, is split into
# gets of half of it or more, which kvstored copies on two of its threads at once.
IN_PLACE_SPLIT_BYTES = 16 << 20


@dataclass
class SharedFile:
    """The file ``fd`` (this object's own descriptor, read-write) behind an array: the
    array's first byte is byte ``base`` of the file, and ``size`` is ``base`` plus the
    array's length, what a pool registration of it covers. The descriptor is only lent
    out through :meth:`registered` and :meth:`whole`, under a lock that :meth:`close`
    takes too: once closed, its number (which the process may reuse for another file)
    is never registered."""

    fd: int
    base: int
    size: int
    address: int  # the array's first byte in this process
    nbytes: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def registered(self, client: StoreClient) -> PoolBuffer:
        """The file registered as a pool on ``client`` 's session (OSError EBADF once closed)."""
        with self._lock:  # only the duplication: the registration has a descriptor of its own
            if self.fd < 0:
                raise OSError(errno.EBADF, "the engine's shared file was closed (its store closed)")
            pool = PoolBuffer.from_fd(self.fd, self.size)
        return client.register_pool(pool)

    def file_offsets(self, array: np.ndarray, rows: np.ndarray, row_bytes: int) -> np.ndarray:
        """The file offsets of rows ``rows`` of ``array`` (a view within this file's mapping)."""
        if not self.covers(array):
            raise ValueError("the array lies outside the shared file's mapping")
        return self.base + (array.ctypes.data - self.address) + rows.astype(np.int64) * row_bytes

    def covers(self, array: np.ndarray) -> bool:
        start = array.ctypes.data - self.address
        return 0 <= start and start + array.nbytes <= self.nbytes

    def whole(self) -> bool:
        """Whether the file still holds every byte a registration of it covers (an engine's
        memory past a shrunk file's end cannot be touched: it would fault)."""
        with self._lock:
            try:
                return self.fd >= 0 and os.fstat(self.fd).st_size >= self.size
            except OSError:
                return False

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def find_shared_file(array: np.ndarray) -> tuple[SharedFile | None, str]:
    """The shared-memory file mapped at ``array`` (contiguous), or None and why not."""
    if not array.flags.c_contiguous or array.nbytes == 0:
        return None, "the array is not contiguous"
    addr, end = array.ctypes.data, array.ctypes.data + array.nbytes
    try:
        with open("/proc/self/maps") as f:
            maps = [_parse(line) for line in f]
    except OSError as exc:
        return None, f"/proc/self/maps cannot be read ({exc.strerror})"
    first = next((m for m in maps if m[0] <= addr < m[1]), None)
    if first is None:
        return None, "the array's memory is not in /proc/self/maps"
    lo, hi, perms, pgoff, dev, inode, path = first
    if inode == 0:  # before the span check: the kernel splits anonymous memory too (huge-page advice)
        return None, "the array is anonymous memory, with no file to share"
    for m in maps:  # the same file's next part, mapped right after (a mapping the kernel split)
        if hi < end and m[0] == hi and (m[4], m[5]) == (dev, inode) and m[3] == pgoff + hi - lo:
            hi = m[1]
    if end > hi:
        return None, "the array spans mappings of more than one file"
    if perms[:2] != "rw" or perms[3] != "s":
        return None, f"the array's mapping is not shared and writable ({perms})"
    fd = _open_same(dev, inode, path)
    if fd is None:
        return None, (f"no descriptor of this process is open on {path or 'its file'}, and the file cannot be "
                      "opened by its path (unlinked)")
    try:
        kind = fs_type(fd)
    except OSError as exc:
        kind, why = None, exc.strerror
    if kind != TMPFS_MAGIC:
        os.close(fd)
        return None, f"{path} is not shared memory ({why if kind is None else f'file system type {kind:#x}'})"
    return SharedFile(fd, pgoff + addr - lo, pgoff + end - lo, addr, array.nbytes), ""


def _parse(line: str) -> tuple[int, int, str, int, str, int, str]:
    fields = line.split(maxsplit=5)
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    path = fields[5].strip() if len(fields) > 5 else ""
    return lo, hi, fields[1], int(fields[2], 16), fields[3], int(fields[4]), path


def _same(st: os.stat_result, dev: str, inode: int) -> bool:
    major, minor = (int(x, 16) for x in dev.split(":"))
    return st.st_ino == inode and (os.major(st.st_dev), os.minor(st.st_dev)) == (major, minor)


def _open_same(dev: str, inode: int, path: str) -> int | None:
    """A new read-write descriptor of the file ``dev``/``inode``: reopened through a descriptor
    this process holds on it, else by ``path``; None where neither works."""
    flags = os.O_RDWR | os.O_CLOEXEC
    for name in os.listdir("/proc/self/fd"):
        link = f"/proc/self/fd/{name}"
        try:
            if _same(os.stat(link), dev, inode):
                return os.open(link, flags)
        except OSError:
            continue  # closed meanwhile, or not reopenable (a socket): look on
    if path.startswith("/") and not path.endswith("(deleted)"):
        try:
            fd = os.open(path, flags)
        except OSError:
            return None
        if _same(os.fstat(fd), dev, inode):
            return fd
        os.close(fd)
    return None


class InPlace:
    """:class:`~kvdrive_client.integrations.blocks.BlockStore`'s moves of rows in place: its
    ``share``, ``store_rows``, the pool path of ``load_rows`` and of ``load`` / ``store``
    of blocks given as :class:`Spans`. It uses the store's namespace, lanes, pipeline sizes
    and counters (``ns``, ``block_bytes``, ``loads``, ``stores``, ``depth``,
    ``sub_blocks``, ``_load_step``, ``_guard``, ``_failed``, ``_tally``), and ``_shared``,
    the file :meth:`share` found."""

    def share(self, array: np.ndarray) -> bool:
        """Move blocks of :meth:`load_rows` / :meth:`store_rows` on rows of ``array`` (an
        engine's CPU tier), and of :meth:`load` / :meth:`store` given as :class:`Spans` of an
        array within it, with no copy of this process's, where ``array`` is a shared-memory
        file's mapping (:mod:`.pool`); whether it is. Elsewhere they go through staging.
        Once per store: its channels register the file on their first move."""
        if self._shared_file is not None:
            raise ValueError(f"{self.ns}: rows are shared already (share() once per store)")
        found, why = find_shared_file(array)
        if found is None:
            log.info("KVDrive %s: rows move through staging, one copy each way on this side: %s", self.ns, why)
            return False
        self._shared = self._shared_file = found
        log.info("KVDrive %s: %d bytes of rows shared with kvstored (byte %d of their file on): no copy on this "
                 "side", self.ns, array.nbytes, found.base)
        return True

    def store_rows(self, keys: Seq, array: np.ndarray, rows: Iterable[int]) -> list[bool]:
        """:meth:`store` of row ``rows[i]`` of ``array`` (contiguous uint8, a block a row) as
        ``keys[i]``; read in place by kvstored where :meth:`share` shared ``array``."""
        if self._shared is not None and self._shared.covers(array):
            return self._rows_in_place("store", keys, array, rows)
        return self.store(keys, Rows(array, rows, self.block_bytes))

    def _rows_in_place(self, op: str, keys: Seq, array: np.ndarray, rows: Iterable[int]) -> list[bool]:
        """:meth:`load_rows` or :meth:`store_rows` on the shared file."""
        at = Rows(array, rows, self.block_bytes).rows
        if len(at) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(at)} rows")
        shared, whole = self._shared, Rows(array, at, self.block_bytes)
        if shared is None:  # refused by kvstored since this call was routed here
            return (self.load if op == "load" else self.store)(keys, whole)
        return self._pooled(op, keys, shared.file_offsets(array, at, self.block_bytes)[:, None], whole)

    def _in_place(self, blocks: Seq) -> np.ndarray | None:
        """Where :meth:`share` shared a file and ``blocks`` are :class:`Spans` of an array
        within it, their file offsets (blocks x regions); else None."""
        shared = self._shared
        if shared is None or not isinstance(blocks, Spans) or not len(blocks) or not shared.covers(blocks.array):
            return None
        return shared.file_offsets(blocks.array, blocks.offsets, 1)  # offsets are in bytes: rows of 1

    def _pooled(self, op: str, keys: Seq, offs: np.ndarray, blocks: Seq) -> list[bool]:
        """A load or store on the shared file: ``block_get`` s or ``block_put`` s naming the
        file offset of each block's regions (``offs``: blocks x regions), up to ``depth`` in
        flight, each waited for to its end, whatever fails meanwhile (see :mod:`.pool`).
        ``blocks``: the same blocks as :meth:`load` / :meth:`store` take them, for a fallback
        to staging."""
        ks = keys_bytes(keys)
        if len(offs) != len(ks):
            raise ValueError(f"{len(ks)} keys for {len(offs)} blocks")
        shared, done = self._shared, [False] * len(ks)
        if shared is None:  # refused by kvstored since this call was routed here
            return (self.load if op == "load" else self.store)(keys, blocks)
        if not self._guard(op, len(ks)):
            return done
        # A key given twice is stored once, and loaded into each of its rows.
        first = {k: i for i, k in reversed(list(enumerate(ks)))} if op == "store" else {}
        order = sorted(first.values()) if op == "store" else range(len(ks))
        t0 = time.perf_counter()
        try:
            with (self.loads if op == "load" else self.stores).channel(self.timeout) as ch:
                pool = self._pool_on(ch, shared)
                if pool is not None:
                    self._pool_moves(op, ch, pool, ks, offs, order, done)
            if pool is None:
                return (self.load if op == "load" else self.store)(keys, blocks)
        except NotFoundError:  # a load from a namespace with nothing stored yet
            self._tally(load_missing=len(ks) - sum(done))
        except (KVDriveError, OSError, zmq.ZMQError) as exc:  # ZMQError: the store closed under this call
            code = getattr(exc, "code", None)
            if code in (ErrorCode.UNSUPPORTED, ErrorCode.BUFFER) and not self._closed:
                # UNSUPPORTED: a namespace made before its blocks moved in regions, whose parts
                # straddle them. BUFFER: kvstored no longer takes the engine's file (a restarted
                # daemon refused it, or it shrank under a copy). The call moves through staging,
                # and so does every later one; but not while the file is short (the engine's
                # rows past its end would fault here too): then this call fails.
                log.warning("KVDrive %s: kvstored moves no more blocks in place (%s); they move through staging "
                            "from now on", self.ns, exc)
                self._unshare()
                if code is ErrorCode.UNSUPPORTED or shared.whole():
                    return (self.load if op == "load" else self.store)(keys, blocks)
            self._failed(op, exc, len(order) - sum(done[i] for i in order))
        if first:  # a store: a key given twice is done where its first place was
            for i, k in enumerate(ks):
                done[i] = done[first.get(k, i)]
        self._tally(**{f"{op}_s_us": int((time.perf_counter() - t0) * 1e6)})
        return done

    def _pool_on(self, ch: Channel, shared: SharedFile) -> PoolBuffer | None:
        """``shared`` as ``ch`` 's session has it registered; None where kvstored refuses it (its
        mapping limits, say) or this process cannot map it (the file shrank below its size):
        rows go through staging from then on, logged once; a ``buffer`` error while the file is
        short (this call fails: its rows past the end cannot be touched). (Its descriptor
        stays open until the store closes: another call may be registering it.)"""
        try:
            return ch.pool(shared)
        except (BufferError_, OSError, ValueError) as exc:
            if self._shared is shared:
                log.warning("KVDrive %s: kvstored refuses the engine's shared rows (%s); they move through staging "
                            "from now on", self.ns, exc)
                self._unshare()
            if not shared.whole():
                raise BufferError_(f"[buffer] the engine's shared file is shorter than its rows ({exc})") from None
            return None

    def _unshare(self) -> None:
        """Rows move through staging from now on: no channel keeps the file registered (nor
        registers it again with a restarted daemon)."""
        self._shared = None
        self.loads.drop_pools()
        self.stores.drop_pools()

    def _in_place_step(self, n: int) -> int:
        """Blocks per get of an in-place load of ``n``. A load is one get (there is no copy out
        to overlap with the next): one of more than 8 MiB runs on one of kvstored's I/O
        threads, so two load calls at once copy on two cores. A large load alone is split
        into ``depth`` gets, which copy on as many. Side by side, DRAM tier: vLLM's tier (two
        loads at once), 2 MiB blocks 0.73-0.82x a memcpy as two gets per call, 0.96-1.14x
        as one; SGLang's (one call at a time, 128 pages), 2 MiB pages 8.4-9.1 GB/s as one
        get, 11.2-13.4 as two, while 64 KiB pages (8 MiB a call) fell from 3.1-3.5 to
        2.7-2.8: hence the size below which a load stays one get."""
        if n * self.block_bytes < self.depth * IN_PLACE_SPLIT_BYTES or self.loads.busy() > 1:
            return n
        return -(-n // self.depth)

    def _pool_moves(self, op: str, ch: Channel, pool: PoolBuffer, ks: list[bytes], offs: np.ndarray,
                    order: list[int] | range, done: list[bool]) -> None:
        client = ch.client
        # A request names at most MAX_BLOCK_KEYS offsets (its keys' regions): fewer keys a
        # request as blocks lie in more regions.
        most = max(1, MAX_BLOCK_KEYS // offs.shape[1])
        # Stores keep two puts in flight, so that one's commit overlaps the next one's write.
        step = self._in_place_step(len(order)) if op == "load" else self.sub_blocks
        step = min(step, most)
        inflight: deque = deque()
        every = len(order) == len(ks)  # order is then 0..n-1: a request's keys and offsets are slices
        try:
            for start in range(0, len(order), step):
                if len(inflight) == self.depth:
                    self._pool_done(op, inflight.popleft(), done)
                idx = order[start: start + step]
                batch = ks[start: start + step] if every else [ks[i] for i in idx]
                at, r = offs[start: start + step] if every else offs[idx], offs.shape[1]
                inflight.append((client.block_get_async(self.ns, batch, pool, offsets=at, regions=r) if op == "load"
                                 else client.block_put_async(self.ns, self.block_bytes, batch, pool, offsets=at,
                                                             regions=r), idx))
            while inflight:
                self._pool_done(op, inflight.popleft(), done)
        finally:
            for pending, _ in inflight:  # after a failure: no row goes back while kvstored may move it
                try:
                    pending.settle()
                except (KVDriveError, zmq.ZMQError):
                    pass

    def _pool_done(self, op: str, sent: tuple, done: list[bool]) -> None:
        if op == "store":
            self._stored(sent, done, in_place=True)
            return
        pending, idx = sent
        bb = self.block_bytes
        r = pending.settle()
        if r["damaged"]:
            self._failed("load", ChecksumError(f"{len(r['damaged'])} block(s) failed their checksum"), len(r["damaged"]))
        found = r["found"]
        # As a rule a load's keys are in order (a range) and each is found: marked without a
        # loop in Python over them.
        if isinstance(idx, range) and idx.step == 1 and len(found) == len(idx) and all(found):
            done[idx.start: idx.stop] = found
            n = len(idx)
        else:
            ok = [i for i, f in zip(idx, found) if f]
            for i in ok:
                done[i] = True
            n = len(ok)
        self._tally(load_missing=len(idx) - n - len(r["damaged"]), blocks_loaded=n, bytes_loaded=n * bb,
                    blocks_in_place=n)
