"""An engine's KV blocks in kvstored, by the engine's own key.

Serving engines hand their external KV tier whole blocks: opaque byte strings of one
size (every layer's K and V of a run of tokens, in the engine's layout), named by a
prefix hash that already says everything about the tokens before them. A
:class:`BlockStore` keeps each one as a one-page sequence of kvstored, named by the
key, in a namespace per engine, model, tenant and block size:

- puts are write-once and idempotent: a key stored already (by this process, another
  one, or before a restart) is not written again, and two writers racing on one key
  both succeed;
- the key -> block catalog is kvstored's own (LMDB), so it survives restarts, and
  blocks of a key shared by many requests are stored once;
- a lookup of many keys is one ``lookup`` request; a load of many blocks one ``get``
  (``seqs``: blocks of many sequences in one request).

Nothing here raises into the engine: a daemon that is down, a full store, a damaged
block or a refused request turns into a miss (or a store not done), one log line and a
counter (:attr:`BlockStore.counters`). After kvstored is found unavailable, calls are
misses at once, without I/O, for ``retry_s`` seconds; then the next call tries again.

Bytes move through one registered shared buffer: the engine's memory is copied into it
(stores) and out of it (loads), one memcpy each way, counted in ``staging_s``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence as Seq
from typing import Any

Buffer = Any  # anything with the buffer protocol (memoryview, numpy, bytearray)

import numpy as np

from kvdrive.layout.geometry import MAX_HEAD_DIM, MAX_PAGE_SIZE, Geometry
from kvdrive.protocol import MAX_SEQS_PER_GET, Op
from kvdrive_client.errors import ChecksumError, ExistsError, KVDriveError, StoreUnavailableError
from kvdrive_client.locate import DEFAULT, Default
from kvdrive_client.shm import SharedBuffer
from kvdrive_client.store import Sequence, StoreClient, connect

log = logging.getLogger(__name__)

_NAME_OK = re.compile(r"^[\x21-\x7e]{1,200}$")
DEFAULT_STAGING_BYTES = 64 << 20


def block_geometry(block_bytes: int) -> Geometry:
    """A one-layer, one-head geometry whose block is ``block_bytes`` (float16 K and V of
    ``page_size`` x ``head_dim``); ValueError for a size no such geometry has."""
    if not isinstance(block_bytes, int) or block_bytes <= 0 or block_bytes % 4:
        raise ValueError(f"an engine block must be a positive multiple of 4 bytes, got {block_bytes!r}")
    elems = block_bytes // 4  # page_size x head_dim
    for head_dim in range(min(MAX_HEAD_DIM, elems), 0, -1):
        if elems % head_dim == 0:
            page_size = elems // head_dim
            if page_size > MAX_PAGE_SIZE:
                break
            return Geometry(num_layers=1, num_kv_heads=1, head_dim=head_dim, dtype="float16", page_size=page_size)
    raise ValueError(
        f"an engine block of {block_bytes} bytes does not fit one kvstored block "
        f"(at most {4 * MAX_PAGE_SIZE * MAX_HEAD_DIM} bytes, as 4 x page_size x head_dim)"
    )


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


def key_name(key: bytes | str | int) -> str:
    """A sequence name for an engine key: a bytes key as hex, a printable string as it is,
    anything longer or stranger by its SHA-256."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        return raw.hex() if len(raw) <= 100 else "h" + hashlib.sha256(raw).hexdigest()
    s = str(key)
    return s if _NAME_OK.match(s) else "h" + hashlib.sha256(s.encode()).hexdigest()


def _parts(block: Any, block_bytes: int, what: str) -> list[np.ndarray]:
    """A block as uint8 arrays over its memory: one buffer, or a list or tuple of buffers
    (the parts of a block that lies in several places, such as its K and V), in order."""
    parts = [np.frombuffer(b, dtype=np.uint8) for b in (block if isinstance(block, (list, tuple)) else [block])]
    total = sum(p.nbytes for p in parts)
    if total != block_bytes:
        raise ValueError(f"a {what} of {total} bytes; this store's blocks are {block_bytes}")
    return parts


class BlockStore:
    """Blocks of ``block_bytes`` bytes, by engine key, in kvstored (see the module).

    ``address``: the daemon (default: the one ``connect()`` finds); ``timeout``: per data
    request; ``lookup_timeout``: per lookup (engines ask on their scheduling path);
    ``retry_s``: how long an unavailable daemon is answered with misses before the next
    try; ``staging_bytes``: the shared buffer blocks move through (a call moves at most
    this much per request).
    """

    def __init__(self, block_bytes: int, *, engine: str, model: str, tenant: str = "default",
                 rank: str | None = None, address: str | Default = DEFAULT, timeout: float = 10.0,
                 lookup_timeout: float = 1.0, retry_s: float = 1.0, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 client: StoreClient | None = None) -> None:
        self.geometry = block_geometry(block_bytes)
        self.block_bytes = block_bytes
        self.ns = namespace(engine, model, tenant, block_bytes, rank)
        self.address = address
        self.timeout, self.lookup_timeout, self.retry_s = timeout, lookup_timeout, retry_s
        self.batch_blocks = max(1, min(staging_bytes // block_bytes, MAX_SEQS_PER_GET))
        self.counters: Counter[str] = Counter()
        self._client = client
        self._own_client = client is None
        self._staging: SharedBuffer | None = None
        self._io = threading.Lock()  # one call at a time uses the staging buffer
        self._down_until = 0.0
        self._closed = False

    # ------------------------------------------------------------ connection

    def _conn(self) -> StoreClient:
        if self._client is None:
            self._client = connect(self.address, timeout=self.timeout)
        return self._client

    def _buffer(self) -> SharedBuffer:
        if self._staging is None:
            self._staging = self._conn().register(self.batch_blocks * self.block_bytes)
        return self._staging

    def available(self) -> bool:
        """False while a recent failure to reach kvstored holds calls off (``retry_s``)."""
        return not self._closed and time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: BaseException, blocks: int) -> None:
        self.counters[f"{op}_failed"] += blocks
        if isinstance(exc, StoreUnavailableError) or isinstance(exc, OSError):
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.retry_s
            # The session and its buffers are gone with the daemon; the client opens a new
            # session on its next call, and the staging buffer is registered again there.
            if first:
                self.counters["unavailable"] += 1
                log.warning("kvstored is unavailable (%s); %s of %d block(s) of %s treated as not done; calls are "
                            "misses for %.1f s, then tried again", exc, op, blocks, self.ns, self.retry_s)
        else:
            log.warning("kvstored %s of %d block(s) of %s failed (%s: %s); treated as not done", op, blocks, self.ns,
                        type(exc).__name__, exc)

    def _guard(self, op: str, n: int) -> bool:
        if n == 0:
            return False
        if not self.available():
            self.counters[f"{op}_skipped"] += n
            return False
        return True

    # ------------------------------------------------------------ the engine's calls

    def lookup(self, keys: Iterable) -> list[bool]:
        """Whether each key's block is stored; misses where kvstored cannot say."""
        names = [key_name(k) for k in keys]
        if not self._guard("lookup", len(names)):
            return [False] * len(names)
        try:
            pages = self._conn().lookup(self.ns, names, timeout=self.lookup_timeout)["pages"]
        except (KVDriveError, OSError) as exc:
            self._failed("lookup", exc, len(names))
            return [False] * len(names)
        found = [p >= 1 for p in pages]
        self.counters["lookups"] += 1
        self.counters["keys_found"] += sum(found)
        self.counters["keys_missing"] += len(found) - sum(found)
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
        names = [key_name(k) for k in keys]
        done = [False] * len(names)
        if not self._guard("store", len(names)):
            return done
        t0 = time.perf_counter()
        try:
            with self._io:
                c = self._conn()
                pages = c.lookup(self.ns, names, timeout=self.lookup_timeout)["pages"]
                todo: dict[str, int] = {}
                for i, (name, p) in enumerate(zip(names, pages)):
                    if p >= 1:
                        done[i] = True
                    elif name not in todo:
                        todo[name] = i
                self.counters["stored_before"] += sum(done)
                order = list(todo.values())
                for start in range(0, len(order), self.batch_blocks):
                    self._store_batch(c, names, sources, order[start: start + self.batch_blocks], done)
                for i, name in enumerate(names):  # a key given twice in one call
                    done[i] = done[i] or done[todo.get(name, i)]
        except (KVDriveError, OSError, ValueError) as exc:  # ValueError: a block of another size
            self._failed("store", exc, len(names) - sum(done))
        self.counters["store_s_us"] += int((time.perf_counter() - t0) * 1e6)
        return done

    def _store_batch(self, c: StoreClient, names: list[str], sources: Seq[Buffer], batch: list[int],
                     done: list[bool]) -> None:
        bb = self.block_bytes
        creates = [c._submit(Op.CREATE, {"ns": self.ns, "seq": names[i], "geometry": self.geometry.to_dict(),
                                         "exist_ok": True}) for i in batch]
        seqs = [Sequence.from_reply(c._wait(r)) for r in creates]
        staging = self._buffer()
        t0 = time.perf_counter()
        for j, i in enumerate(batch):
            at = j * bb
            for part in _parts(sources[i], bb, "block"):
                staging.array[at: at + part.nbytes] = part
                at += part.nbytes
        self.counters["staging_us"] += int((time.perf_counter() - t0) * 1e6)
        puts = [(i, c.put_async(seq, [0], [0], staging, j * bb)) for j, (i, seq) in enumerate(zip(batch, seqs))
                if seq.complete_pages < 1]
        for i, seq in zip(batch, seqs):
            if seq.complete_pages >= 1:  # stored by another writer since the lookup
                done[i] = True
        for i, pending in puts:
            try:
                pending.wait()
                self.counters["blocks_stored"] += 1
                self.counters["bytes_stored"] += bb
            except ExistsError:  # another writer stored it between our create and our put
                pass
            except StoreUnavailableError:
                raise
            except KVDriveError as exc:  # this block only (a full store, say)
                self._failed("store", exc, 1)
                continue
            done[i] = True

    def load(self, keys: Seq, targets: Seq[Buffer]) -> list[bool]:
        """Copy each key's block into ``targets[i]`` (writable, ``block_bytes`` bytes, or a list
        of buffers that together are); True for each one loaded. A block that is not stored,
        or fails its checksum, is False."""
        if len(keys) != len(targets):
            raise ValueError(f"{len(keys)} keys for {len(targets)} targets")
        names = [key_name(k) for k in keys]
        got = [False] * len(names)
        if not self._guard("load", len(names)):
            return got
        t0 = time.perf_counter()
        try:
            with self._io:
                c = self._conn()
                r = c.lookup(self.ns, names, timeout=self.lookup_timeout)
                present = [i for i, p in enumerate(r["pages"]) if p >= 1]
                self.counters["load_missing"] += len(names) - len(present)
                for start in range(0, len(present), self.batch_blocks):
                    batch = present[start: start + self.batch_blocks]
                    self._load_batch(c, [r["uids"][i] for i in batch], [targets[i] for i in batch], got, batch)
        except (KVDriveError, OSError, ValueError) as exc:  # ValueError: a target of another size
            self._failed("load", exc, len(names) - sum(got))
        self.counters["load_s_us"] += int((time.perf_counter() - t0) * 1e6)
        return got

    def _load_batch(self, c: StoreClient, uids: list[int], targets: list, got: list[bool], where: list[int]) -> None:
        bb = self.block_bytes
        staging = self._buffer()
        seq = Sequence(uids[0], self.ns, "", self.geometry, 1, 1)
        try:
            c.get_async(seq, np.zeros((len(uids), 3), np.int32), staging, 0, seqs=uids).wait()
            ok = list(range(len(uids)))
        except ChecksumError:
            # A damaged block fails the get: read them one by one, so only it is a miss.
            ok = []
            for j, uid in enumerate(uids):
                try:
                    c.get_async(Sequence(uid, self.ns, "", self.geometry, 1, 1), np.zeros((1, 3), np.int32),
                                staging, j * bb).wait()
                    ok.append(j)
                except ChecksumError as exc:
                    self._failed("load", exc, 1)
        t0 = time.perf_counter()
        for j in ok:
            at = j * bb
            for part in _parts(targets[j], bb, "target"):
                part[:] = staging.array[at: at + part.nbytes]
                at += part.nbytes
            got[where[j]] = True
        self.counters["staging_us"] += int((time.perf_counter() - t0) * 1e6)
        self.counters["blocks_loaded"] += len(ok)
        self.counters["bytes_loaded"] += len(ok) * bb

    def stats(self) -> dict:
        """The counters: lookups, keys_found/keys_missing, blocks_stored, stored_before,
        blocks_loaded, load_missing, bytes_stored/bytes_loaded, *_failed and *_skipped
        (blocks), unavailable (outages seen), staging_us, store_s_us, load_s_us."""
        return dict(self.counters)

    def close(self) -> None:
        """Free the staging buffer and, if this store opened it, the client."""
        self._closed = True
        with self._io:
            if self._client is not None and self._own_client:
                self._client.close()
            elif self._client is not None and self._staging is not None:
                try:
                    self._client.unregister(self._staging)
                except KVDriveError:
                    pass
            self._client = None
            self._staging = None
