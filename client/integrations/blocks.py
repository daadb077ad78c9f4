"""An engine's KV blocks in kvstored, by the engine's own key.

Serving engines hand their external KV tier whole blocks: opaque byte strings of one
size (every layer's K and V of a run of tokens, in the engine's layout), named by a
prefix hash that already says everything about the tokens before them. A
:class:`BlockStore` keeps them in a block namespace of kvstored (docs/protocol.md,
``block_*``), by the engine's key (:func:`key_bytes`), one namespace per engine, model,
tenant and block size:

- puts are write-once and idempotent: a key stored already (by this process, another
  one, or before a restart) is not written again, and two writers racing on one key
  both succeed;
- the key -> block catalog is kvstored's own (LMDB), so it survives restarts, and
  blocks of a key shared by many requests are stored once;
- a lookup of many keys is one ``block_lookup`` request, a store of many blocks one
  ``block_put`` (one durable commit), a load one ``block_get``.

Nothing here raises into the engine: a daemon that is down, a full store, a damaged
block or a refused request turns into a miss (or a store not done), one log line and a
counter (:attr:`BlockStore.counters`). After kvstored is found unavailable, calls are
misses at once, without I/O, for ``retry_s`` seconds; then the next call tries again.

Where the engine's rows are a shared-memory file (vLLM's CPU tier), :meth:`BlockStore.share`
registers it with kvstored and rows move with no copy of this process's: kvstored's get
writes them in place, its put reads them there (:mod:`~kvdrive_client.integrations.pool`).
Elsewhere bytes move through shared buffers registered with kvstored: the engine's memory is
copied into one (stores) and out of one (loads), one memcpy each way (out with
non-temporal stores for large blocks: :data:`STREAM_OUT_BYTES`), counted in ``staging_us``. Loads and stores go through lanes of their own
(:mod:`~kvdrive_client.integrations.lanes`): each has its connections and staging
regions, ``load_channels`` / ``store_channels`` calls of each kind run at once, and a
load never waits for a store. Lookups have a connection of their own too. Within a
call, a channel's region is ``PIPELINE_DEPTH`` slots, each a request's: a store copies
the next slot while the daemon writes the one before, a load copies one slot out while
the daemon fills the next (a load of ``PIPELINE_DEPTH`` x ``LOAD_SPLIT_BYTES`` or
more takes at least that many gets, so that even one that fits a slot overlaps the two).
A slot whose request's fate is unknown (a timeout, a daemon
gone) is never reused: the channel gives its region up (:meth:`Channel.discard`).

kvstored keeps a block as ``parts`` pieces (one up to 64 MiB, equal ones past that: a
1 GiB block is 16 of 64 MiB, see kvdrive.protocol.blocks), written by one put, so a block
is stored whole or not at all.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence as Seq
from typing import Any

Buffer = Any  # anything with the buffer protocol (memoryview, numpy, bytearray)

import numpy as np
import zmq

from kvdrive.protocol import MAX_BLOCK_KEYS, ErrorCode, Op
from kvdrive.protocol.blocks import MAX_BLOCK_BYTES, MAX_PART_BYTES, block_geometry  # noqa: F401 (re-exported)
from kvdrive_client.errors import ChecksumError, KVDriveError, NotFoundError, StoreUnavailableError
from kvdrive_client.integrations.lanes import Channel, Lane
from kvdrive_client.integrations.pool import InPlace, SharedFile
from kvdrive_client.integrations.rows import Rows, Spans, _copy_out, _movers, _parts, key_bytes, keys_bytes  # noqa: F401 (re-exported)
from kvdrive_client.locate import DEFAULT, Default
from kvdrive_client.store import PendingGet, PendingPut, StoreClient, connect

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
DELETE_WINDOW = 32  # deletes in flight at once
PIPELINE_DEPTH = 2  # requests in flight per load or store call
LOAD_SLOT_BYTES = 16 << 20  # the most one block_get of a load moves (one block, if larger)
# A loaded block's parts of at least this size are copied out of staging with non-temporal
# stores (kvdrive.protocol.copy): the engine's memory they land in is read next by its
# copy to the device, not by this thread, and a plain copy first reads every line it
# overwrites. 2 MiB blocks, DRAM tier, one load call at a time, side by side: 4.06 ->
# 4.80 GB/s (medians of 4); 64 KiB blocks gained 5%, within the numpy copy's per-call cost.
STREAM_OUT_BYTES = 256 << 10
# A load of at least twice this is split into at least PIPELINE_DEPTH gets, so that the
# copy out of one overlaps the daemon's fill of the next even when it fits one slot.
LOAD_SPLIT_BYTES = 2 << 20


def _check_spans(blocks: Any, block_bytes: int) -> None:
    if isinstance(blocks, Spans) and blocks.regions * blocks.span != block_bytes:
        raise ValueError(f"blocks of {blocks.regions} spans of {blocks.span} bytes; this store's are {block_bytes}")


def _part(value: object) -> str:
    """One namespace part: printable, no '/', at most 64 characters (a longer one keeps its
    first 51 and a hash of the whole, so two long names never meet)."""
    s = re.sub(r"[^\x21-\x7e]", "_", str(value)).replace("/", "_") or "_"
    return s if len(s) <= 64 else f"{s[:51]}~{hashlib.sha256(s.encode()).hexdigest()[:12]}"


def namespace(engine: str, model: str, tenant: str, block_bytes: int, rank: str | None = None) -> str:
    """The kvstored namespace of one engine's blocks: engine, model, tenant, block size
    (and the rank, where each rank holds a different share of a block)."""
    parts = [_part(engine), _part(model), _part(tenant), f"b{block_bytes}"]
    if rank is not None:
        parts.append(_part(rank))
    return "/".join(parts)


class BlockStore(InPlace):
    """Blocks of ``block_bytes`` bytes, by engine key, in kvstored (see the module).

    ``address``: the daemon (default: the one ``connect()`` finds); ``timeout``: per data
    request; ``lookup_timeout``: per lookup (engines ask on their scheduling path);
    ``retry_s``: how long an unavailable daemon is answered with misses before the next
    try; ``staging_bytes``: each staging region (``PIPELINE_DEPTH`` slots, each moving at
    most its share of it, or one block, per request); ``load_channels`` / ``store_channels``: how many loads / stores
    run at once, each with a connection and a staging region of its own (made on first
    use). One store at a time is the default: stores are bound by the disk's durable
    write, and the CPU and memory bandwidth a second would take are the loads'.
    ``client``: one client every channel uses instead of connections of their own (the
    caller closes it). ``regions``: blocks lie in that many equal regions each (an engine
    page's K and V, given as :class:`~kvdrive_client.integrations.rows.Spans`), which a
    namespace this store makes keeps whole in its parts, so that kvstored can move them in
    place where :meth:`share` shares their memory.
    """

    def __init__(self, block_bytes: int, *, engine: str, model: str, tenant: str = "default",
                 rank: str | None = None, address: str | Default = DEFAULT, timeout: float = 10.0,
                 lookup_timeout: float = 1.0, retry_s: float = 1.0, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 load_channels: int = 2, store_channels: int = 1, client: StoreClient | None = None,
                 regions: int = 1) -> None:
        self.geometry = block_geometry(block_bytes, regions)
        self.block_bytes, self.regions = block_bytes, regions
        self.parts = self.geometry.num_layers
        self.ns = namespace(engine, model, tenant, block_bytes, rank)
        self.address = address
        self.timeout, self.lookup_timeout, self.retry_s = timeout, lookup_timeout, retry_s
        # A channel's region holds ``depth`` slots of ``sub_blocks`` blocks, one per request in flight.
        per_region = max(1, staging_bytes // block_bytes)
        self.depth = max(1, min(PIPELINE_DEPTH, per_region))
        self.sub_blocks = min(per_region // self.depth, MAX_BLOCK_KEYS)
        self.slot_bytes = self.sub_blocks * block_bytes
        # Loads use smaller slots (within the same ones): the daemon fills the next while this
        # copies one out, so the smaller the slot, the less of the two copies runs alone.
        self.load_blocks = max(1, min(self.sub_blocks, LOAD_SLOT_BYTES // block_bytes))
        region = self.depth * self.slot_bytes
        self.loads = Lane("load", load_channels, region, self._connect, client)
        self.stores = Lane("store", store_channels, region, self._connect, client)
        self.counters: Counter[str] = Counter()
        self._tally_lock = threading.Lock()
        self._lookups = client  # a connection of its own: a lookup never waits for a load or a store
        self._lookups_lock = threading.Lock()
        self._own_lookups = client is None
        self._down_until = 0.0
        self._closed = False
        self._opener: threading.Thread | None = None
        self._shared: SharedFile | None = None  # the engine's rows, where share() found their file (None if refused)
        self._shared_file: SharedFile | None = None  # the same, kept to close

    # ------------------------------------------------------------ connection

    def _connect(self) -> StoreClient:
        return connect(self.address, timeout=self.timeout)

    def open_early(self) -> None:
        """Open every load and store channel now, on a thread of its own, so that the first
        calls pay no connect or region registration (~40-50 ms per 64 MiB region, measured),
        nor the compile of the loads' copy out (:data:`STREAM_OUT_BYTES`). A daemon not
        reachable now is only logged: the first call opens what is left."""
        self._opener = threading.Thread(target=self._open_lanes, name="kvdrive-open-channels", daemon=True)
        self._opener.start()

    def wait_open(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until it ends) for :meth:`open_early`'s opening,
        for a caller whose first call must pay no set-up (an engine's warm-up, a benchmark);
        whether it has ended. True where it never started."""
        opener = self._opener
        if opener is None:
            return True
        opener.join(timeout)
        return not opener.is_alive()

    def _open_lanes(self) -> None:
        try:
            for lane in (self.loads, self.stores):
                if not self._closed:
                    lane.open(self.timeout, self._shared)
        except (KVDriveError, OSError, zmq.ZMQError) as exc:
            # ZMQError: its sockets closed under it, by close() or by the clients' finalisers
            # as the interpreter exits (this is a daemon thread).
            log.info("kvstored channels of %s not opened early (%s); the first call opens them", self.ns, exc)
        except Exception:  # a store closed under it: close() gave up waiting and closed its sockets
            if not self._closed:
                raise
            log.debug("kvstored channels of %s: the store closed while they opened", self.ns, exc_info=True)
        if (movers := _movers()) is not None:  # compiled, or read from numba's cache, now
            movers.copy_out(np.zeros(64, np.uint8), np.zeros(64, np.uint8), 0)
            movers.scatter_out(np.zeros(64, np.uint8), [0], np.zeros(64, np.uint8), [0], 64)
        if self._closed:  # closed while this opened: free what it opened
            self.loads.close(self.timeout)
            self.stores.close(self.timeout)

    def _lookup_client(self) -> StoreClient:
        with self._lookups_lock:
            if self._lookups is None:
                self._lookups = self._connect()
            return self._lookups

    def _tally(self, **counts: int) -> None:
        with self._tally_lock:
            self.counters.update(counts)

    def available(self) -> bool:
        """False while a recent failure to reach kvstored holds calls off (``retry_s``)."""
        return not self._closed and time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: BaseException, blocks: int) -> None:
        if isinstance(exc, StoreUnavailableError) or isinstance(exc, OSError):
            with self._tally_lock:  # loads, stores and lookups fail at once: one outage
                first = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + self.retry_s
                self.counters.update({f"{op}_failed": blocks, "unavailable": int(first)})
            # The session and its buffers are gone with the daemon; each client opens a new
            # session on its next call, and registers its staging region again there.
            if first:
                log.warning("kvstored is unavailable (%s); %s of %d block(s) of %s treated as not done; calls are "
                            "misses for %.1f s, then tried again", exc, op, blocks, self.ns, self.retry_s)
        else:
            self._tally(**{f"{op}_failed": blocks})
            log.warning("kvstored %s of %d block(s) of %s failed (%s: %s); treated as not done", op, blocks, self.ns,
                        type(exc).__name__, exc)

    def _guard(self, op: str, n: int) -> bool:
        if n == 0:
            return False
        if not self.available():
            self._tally(**{f"{op}_skipped": n})
            return False
        return True

    # ------------------------------------------------------------ the engine's calls

    def lookup(self, keys: Iterable) -> list[bool]:
        """Whether each key's block is stored; misses where kvstored cannot say."""
        ks = keys_bytes(keys)
        if not self._guard("lookup", len(ks)):
            return [False] * len(ks)
        try:
            found = self._lookup_client().block_lookup(self.ns, ks, timeout=self.lookup_timeout)
        except (KVDriveError, OSError) as exc:
            self._failed("lookup", exc, len(ks))
            return [False] * len(ks)
        self._tally(lookups=1, keys_found=sum(found), keys_missing=len(found) - sum(found))
        return found

    def prefix(self, keys: Iterable) -> int:
        """How many leading keys have their block stored (0 where kvstored cannot say)."""
        found = self.lookup(keys)
        return next((i for i, f in enumerate(found) if not f), len(found))

    def store(self, keys: Seq, sources: Seq[Buffer]) -> list[bool]:
        """Store ``sources[i]`` (``block_bytes`` bytes each, or a list of buffers that together
        are) as ``keys[i]``; True for each key whose block is stored when this returns (by
        this call or before it)."""
        if len(keys) != len(sources):
            raise ValueError(f"{len(keys)} keys for {len(sources)} blocks")
        _check_spans(sources, self.block_bytes)
        if (offs := self._in_place(sources)) is not None:
            return self._pooled("store", keys, offs, sources)
        ks = keys_bytes(keys)
        done = [False] * len(ks)
        if not self._guard("store", len(ks)):
            return done
        t0 = time.perf_counter()
        try:
            with self.stores.channel(self.timeout) as ch:
                # Blocks stored already are not copied into staging (the daemon would skip them too).
                found = ch.client.block_lookup(self.ns, ks, timeout=self.lookup_timeout)
                todo: dict[bytes, int] = {}
                for i, (k, f) in enumerate(zip(ks, found)):
                    if f:
                        done[i] = True
                    elif k not in todo:
                        todo[k] = i
                self._tally(stored_before=sum(done))
                self._store_all(ch, ks, sources, list(todo.values()), done)
                for i, k in enumerate(ks):  # a key given twice in one call
                    done[i] = done[i] or done[todo.get(k, i)]
        except (KVDriveError, OSError, ValueError) as exc:  # ValueError: a block of another size
            self._failed("store", exc, len(ks) - sum(done))
        self._tally(store_s_us=int((time.perf_counter() - t0) * 1e6))
        return done

    def _store_all(self, ch: Channel, ks: list[bytes], sources: Seq[Buffer], order: list[int],
                   done: list[bool]) -> None:
        """Store blocks ``order`` in ``block_put`` s of ``sub_blocks``, up to ``depth`` in flight,
        each from a slot of the staging region of its own: the copy of one overlaps the
        daemon's write of the one before. Each is stored whole, durable when answered."""
        inflight: deque = deque()
        try:
            for n, start in enumerate(range(0, len(order), self.sub_blocks)):
                if len(inflight) == self.depth:  # the slot this one takes is the oldest's
                    self._stored(inflight.popleft(), done)
                batch = order[start: start + self.sub_blocks]
                inflight.append((self._store_batch(ch, ks, sources, batch, (n % self.depth) * self.slot_bytes), batch))
            while inflight:
                self._stored(inflight.popleft(), done)
        except BaseException:
            if inflight:  # the daemon may still read their slots: the region is not used again
                ch.discard()
            raise

    def _store_batch(self, ch: Channel, ks: list[bytes], sources: Seq[Buffer], batch: list[int], at: int) -> PendingPut:
        """Copy ``batch`` into the staging region from ``at`` and start its ``block_put``."""
        bb, staging = self.block_bytes, ch.region
        t0 = time.perf_counter()
        if isinstance(sources, Spans):  # one compiled gather
            sources.copy_to(staging.array, at, batch)
        else:
            for j, i in enumerate(batch):
                to = at + j * bb
                for part in _parts(sources[i], bb, "block"):
                    staging.array[to: to + part.nbytes] = part
                    to += part.nbytes
        self._tally(staging_us=int((time.perf_counter() - t0) * 1e6))
        return ch.client.block_put_async(self.ns, bb, [ks[i] for i in batch], staging, offset=at, regions=self.regions)

    def _stored(self, sent: tuple[PendingPut, list[int]], done: list[bool], in_place: bool = False) -> None:
        """The end of a put of keys ``batch``; ``in_place``: one from shared rows, waited for to
        its end (:mod:`.pool`)."""
        pending, batch = sent
        try:
            r = pending.settle() if in_place else pending.wait()
        except StoreUnavailableError:
            raise
        except KVDriveError as exc:  # these blocks only (a full store, say)
            if in_place and getattr(exc, "code", None) is ErrorCode.UNSUPPORTED:
                raise  # not in these regions: the whole call moves through staging (InPlace._pooled)
            self._failed("store", exc, len(batch))
            return
        self._tally(blocks_stored=r["stored"], bytes_stored=r["stored"] * self.block_bytes, stored_before=r["present"],
                    blocks_in_place=r["stored"] if in_place else 0)
        for i in batch:
            done[i] = True

    def load(self, keys: Seq, targets: Seq[Buffer]) -> list[bool]:
        """Copy each key's block into ``targets[i]`` (writable, ``block_bytes`` bytes, or a list
        of buffers that together are); True for each one loaded. A block that is not stored,
        or fails its checksum, is False."""
        if len(keys) != len(targets):
            raise ValueError(f"{len(keys)} keys for {len(targets)} targets")
        _check_spans(targets, self.block_bytes)
        if (offs := self._in_place(targets)) is not None:
            return self._pooled("load", keys, offs, targets)
        ks = keys_bytes(keys)
        got = [False] * len(ks)
        if not self._guard("load", len(ks)):
            return got
        t0 = time.perf_counter()
        try:
            with self.loads.channel(self.timeout) as ch:
                self._load_all(ch, ks, targets, got)
        except NotFoundError:  # nothing stored in this namespace yet
            self._tally(load_missing=len(ks) - sum(got))
        except (KVDriveError, OSError, ValueError) as exc:  # ValueError: a target of another size
            self._failed("load", exc, len(ks) - sum(got))
        self._tally(load_s_us=int((time.perf_counter() - t0) * 1e6))
        return got

    def load_rows(self, keys: Seq, array: np.ndarray, rows: Iterable[int]) -> list[bool]:
        """:meth:`load` of each key's block into row ``rows[i]`` of ``array`` (writable,
        contiguous uint8, a block a row: an engine's CPU tier), each get's blocks copied out
        by one compiled call, or written in place by kvstored where :meth:`share` shared
        ``array``. ValueError for an array or rows that cannot take the blocks."""
        if self._shared is not None and self._shared.covers(array):
            return self._rows_in_place("load", keys, array, rows)
        return self.load(keys, Rows(array, rows, self.block_bytes))

    def _load_all(self, ch: Channel, ks: list[bytes], targets: Seq[Buffer], got: list[bool]) -> None:
        """Load in ``block_get`` s of ``load_blocks``, up to ``depth`` in flight, each into a slot
        of the staging region of its own: the daemon fills one while this copies another out."""
        inflight: deque = deque()
        step = self._load_step(len(ks))
        try:
            for n, start in enumerate(range(0, len(ks), step)):
                if len(inflight) == self.depth:
                    self._loaded(ch, inflight.popleft(), targets, got)
                batch = list(range(start, min(start + step, len(ks))))
                at = (n % self.depth) * self.slot_bytes
                inflight.append((ch.client.block_get_async(self.ns, [ks[i] for i in batch], ch.region, offset=at),
                                 batch, at))
            while inflight:
                self._loaded(ch, inflight.popleft(), targets, got)
        except BaseException:
            if inflight:  # the daemon may still write their slots: the region is not used again
                ch.discard()
            raise

    def _load_step(self, n: int) -> int:
        """The blocks of one get in a load of ``n``: ``load_blocks``, or fewer so that a load
        of ``depth`` x ``LOAD_SPLIT_BYTES`` or more takes at least ``depth`` gets."""
        if n * self.block_bytes < self.depth * LOAD_SPLIT_BYTES:
            return self.load_blocks
        return max(1, min(self.load_blocks, -(-n // self.depth)))

    def _loaded(self, ch: Channel, sent: tuple[PendingGet, list[int], int], targets: Seq[Buffer],
                got: list[bool]) -> None:
        pending, batch, at = sent
        bb, staging = self.block_bytes, ch.region
        r = pending.wait()
        if r["damaged"]:
            self._failed("load", ChecksumError(f"{len(r['damaged'])} block(s) failed their checksum"),
                         len(r["damaged"]))
        ok = [j for j, f in enumerate(r["found"]) if f]
        self._tally(load_missing=len(batch) - len(ok) - len(r["damaged"]))
        t0 = time.perf_counter()
        if isinstance(targets, (Rows, Spans)):
            targets.copy_in(staging.array, at, ok, batch)
        else:
            self._copy_parts(staging.array, at, ok, batch, targets)
        for j in ok:
            got[batch[j]] = True
        self._tally(staging_us=int((time.perf_counter() - t0) * 1e6), blocks_loaded=len(ok), bytes_loaded=len(ok) * bb)

    def _copy_parts(self, staging: np.ndarray, at: int, js: list[int], batch: list[int], targets: Seq[Buffer]) -> None:
        """Blocks ``js`` of the slot at ``at`` into ``targets[batch[j]]``, part by part: parts of
        :data:`STREAM_OUT_BYTES` or more with streaming stores, smaller ones by numpy."""
        bb = self.block_bytes
        copy_out = _copy_out() if bb >= STREAM_OUT_BYTES else None
        for j in js:
            frm = at + j * bb
            for part in _parts(targets[batch[j]], bb, "target"):
                if copy_out is not None and part.nbytes >= STREAM_OUT_BYTES:
                    copy_out(part, staging, frm)
                else:
                    part[:] = staging[frm: frm + part.nbytes]
                frm += part.nbytes

    def delete_all(self) -> int:
        """Delete every block of this store's namespace that this user stored (any process,
        any run); how many. Blocks being loaded meanwhile may miss; none loads wrong bytes.
        Blocks an earlier KVDrive kept as one sequence each in this namespace go too."""
        if not self.available():
            return 0
        deleted = 0
        try:
            with self.stores.channel(self.timeout) as ch:
                try:
                    deleted += ch.client.block_delete(self.ns)["deleted"]
                except NotFoundError:  # no block stored in this namespace
                    pass
                deleted += self._delete_sequences(ch.client)
        except (KVDriveError, OSError) as exc:
            self._failed("delete", exc, 0)
        self._tally(blocks_deleted=deleted)
        return deleted

    def _delete_sequences(self, client: StoreClient) -> int:
        """Delete the namespace's sequences (blocks as an earlier KVDrive stored them), pipelined."""
        names = [s["seq"] for s in client.list(self.ns)]
        deleted = 0
        for start in range(0, len(names), DELETE_WINDOW):
            sent = [client._submit(Op.DELETE, {"ns": self.ns, "seq": n}) for n in names[start: start + DELETE_WINDOW]]
            for req in sent:
                try:
                    client._wait(req)
                    deleted += 1
                except NotFoundError:  # deleted by another since the list
                    pass
        return deleted

    def stats(self) -> dict:
        """The counters: lookups, keys_found/keys_missing, blocks_stored, stored_before,
        blocks_loaded, load_missing, bytes_stored/bytes_loaded, blocks_deleted, *_failed
        and *_skipped (blocks), unavailable (outages seen), staging_us, store_s_us, load_s_us,
        blocks_in_place (blocks kvstored moved straight from or into shared rows: share())."""
        with self._tally_lock:
            return dict(self.counters)

    def close(self) -> None:
        """Free the staging regions and the connections this store opened (waiting up to
        ``timeout`` for calls in flight)."""
        self._closed = True
        if self._opener is not None:  # it frees what it opens after this, if it is not done
            self._opener.join(min(self.timeout, 1.0))
        self.loads.close(self.timeout)
        self.stores.close(self.timeout)
        if self._shared_file is not None:
            self._shared_file.close()
            self._shared = self._shared_file = None
        with self._lookups_lock:
            if self._lookups is not None and self._own_lookups:
                self._lookups.close()
            self._lookups = None if self._own_lookups else self._lookups
