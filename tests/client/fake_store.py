"""An in-process stand-in for kvstored's client, for decode tests that need no daemon.

:class:`FakeStore` offers the part of :class:`kvdrive_client.store.StoreClient` that the
decode path uses (hello, create, open, list, delete, put, register, unregister,
get_async, stats), keeps every block as bytes in a dict, and answers the way the
real daemon does where the decode path can tell:

- ``open`` of an unknown sequence, a put or get naming an unknown uid, and a get of
  a block that was never put raise :class:`~kvdrive_client.errors.NotFoundError`;
- blocks are write-once: a second put of a block raises ``ExistsError``;
- a layer or head outside the geometry, a malformed request (repeated layers or
  pages, array lengths that do not match the blocks, non-finite importance) raise
  ``RequestError``; a get into a buffer that is not registered, or past its end,
  raises ``BufferError_``;
- like the real client, a get's errors come from ``wait()``, not ``get_async()``;
  and a get that fails copies nothing.

Each call is counted (:attr:`FakeStore.counts`) and logged (:attr:`FakeStore.put_log`,
:attr:`FakeStore.get_log`, with a shared event clock), so tests can assert what
was written and fetched, and in which order.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvdrive.layout.geometry import Geometry
from kvdrive.protocol import ErrorCode
from kvdrive_client.errors import BufferError_, ExistsError, NotFoundError, RequestError
from kvdrive_client.store import Sequence, _as_bytes, _int_list


class FakeBuffer:
    """A staging buffer: ``size`` bytes in ``array`` (numpy uint8)."""

    def __init__(self, size: int, buf_id: int) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        self.size = size
        self.buf_id = buf_id
        self.array = np.zeros(size, dtype=np.uint8)

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        end = self.size if nbytes is None else offset + nbytes
        return self.array[offset:end]


@dataclass
class PutRecord:
    """One put: which sequence, layers and pages, and when (on the store's event clock)."""

    event: int
    uid: int
    name: str
    layers: tuple[int, ...]
    pages: tuple[int, ...]
    thread: int


@dataclass
class GetRecord:
    """One get: its blocks ``[n, 3]`` (layer, head, page), the uid of each, and when."""

    event: int
    blocks: np.ndarray
    uids: np.ndarray
    thread: int


@dataclass
class _Seq:
    uid: int
    ns: str
    name: str
    geometry: Geometry


class FakePendingGet:
    """A get submitted to the fake: the copy is done (or deferred, see ``land``) and
    ``wait()`` returns the reply or raises the error the daemon would have sent."""

    def __init__(self, store: "FakeStore", run) -> None:
        self._store = store
        self._run = run
        self._reply: dict | None = None
        self._error: BaseException | None = None
        self._waited = False

    def _execute(self) -> None:
        try:
            self._reply = self._run()
        except (NotFoundError, RequestError, BufferError_) as exc:
            self._error = exc
        self._run = None

    def wait(self, timeout: float | None = None) -> dict:
        if self._waited:
            # The real client drops a reply once it is read: a second wait would never return.
            raise RuntimeError("this get was already waited for")
        self._waited = True
        self._store._unwaited.discard(self)
        if self._run is not None:
            self._execute()
        if self._error is not None:
            raise self._error
        return self._reply


class FakeStore:
    """StoreClient's decode-path methods over an in-memory dict of blocks.

    ``land``: when a get's blocks are copied into the buffer: ``"submit"`` (at
    ``get_async``, so a buffer reused before its data is read shows up) or
    ``"wait"`` (at ``wait()``, so data read before the wait shows up as stale).
    ``get_seqs``: what ``hello()`` says about gets across sequences.
    """

    def __init__(self, land: str = "submit", get_seqs: bool = True) -> None:
        if land not in ("submit", "wait"):
            raise ValueError(f"land must be 'submit' or 'wait', got {land!r}")
        self.land = land
        self.address = "fake://kvstored"
        self.server_info = {"format": 1, "engine": "fake", "get_seqs": get_seqs}
        self.counts: Counter = Counter()
        self.put_log: list[PutRecord] = []
        self.get_log: list[GetRecord] = []
        # (uid, layer, head, page) -> the block's bytes; and what the put said about it.
        self.blocks: dict[tuple[int, int, int, int], bytes] = {}
        self.importance: dict[tuple[int, int, int, int], float] = {}
        self.cluster: dict[tuple[int, int, int, int], int] = {}
        self._by_uid: dict[int, _Seq] = {}
        self._by_name: dict[tuple[str, str], int] = {}
        self._uids = itertools.count(1)
        self._buf_ids = itertools.count(1)
        self._buffers: dict[int, FakeBuffer] = {}
        self._clock = itertools.count(1)
        self._unwaited: set[FakePendingGet] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ what tests read

    def now(self) -> int:
        """The event clock's next value (puts and gets take values from it as they run)."""
        with self._lock:
            return next(self._clock)

    def sequence_blocks(self, seq: Sequence | int) -> dict[tuple[int, int, int], bytes]:
        """One sequence's stored blocks, by (layer, head, page)."""
        uid = seq if isinstance(seq, int) else seq.uid
        return {k[1:]: v for k, v in self.blocks.items() if k[0] == uid}

    def uid_of(self, ns: str, name: str) -> int:
        return self._by_name[(ns, name)]

    def names(self, ns: str | None = None) -> list[str]:
        return [s.name for s in self._by_uid.values() if ns is None or s.ns == ns]

    @property
    def unwaited(self) -> int:
        """Gets submitted and never waited for."""
        return len(self._unwaited)

    @property
    def registered(self) -> int:
        """Buffers registered and not yet unregistered."""
        return len(self._buffers)

    # ------------------------------------------------------------ sequences

    def hello(self) -> dict:
        self.counts["hello"] += 1
        return self.server_info

    def ping(self, timeout: float = 1.0) -> bool:
        return True

    def _describe(self, s: _Seq) -> Sequence:
        g = s.geometry
        per_page = Counter(page for (uid, _, _, page) in self.blocks if uid == s.uid)
        full = g.num_layers * g.num_kv_heads
        complete = 0
        while per_page.get(complete, 0) == full:
            complete += 1
        return Sequence(s.uid, s.ns, s.name, g, sum(per_page.values()), complete)

    def create(self, ns: str, seq: str, geometry: Geometry, exist_ok: bool = False) -> Sequence:
        with self._lock:
            self.counts["create"] += 1
            uid = self._by_name.get((ns, seq))
            if uid is not None:
                found = self._by_uid[uid]
                if exist_ok and found.geometry == geometry:
                    return self._describe(found)
                other = "" if found.geometry == geometry else " with another geometry"
                raise ExistsError(f"[exists] sequence {ns}/{seq} exists{other}")
            s = _Seq(next(self._uids), ns, seq, geometry)
            self._by_uid[s.uid] = s
            self._by_name[(ns, seq)] = s.uid
            return self._describe(s)

    def open(self, ns: str, seq: str) -> Sequence:
        with self._lock:
            self.counts["open"] += 1
            uid = self._by_name.get((ns, seq))
            if uid is None:
                raise NotFoundError(f"[not_found] no sequence {ns}/{seq}")
            return self._describe(self._by_uid[uid])

    def list(self, ns: str | None = None) -> list[dict]:
        with self._lock:
            out = []
            for s in sorted(self._by_uid.values(), key=lambda s: s.uid):
                if ns is None or s.ns == ns:
                    d = self._describe(s)
                    out.append({"ns": d.ns, "seq": d.name, "uid": d.uid, "geometry": d.geometry.to_dict(),
                                "num_blocks": d.num_blocks, "complete_pages": d.complete_pages})
            return out

    def delete(self, ns: str, seq: str, uid: int | None = None) -> dict:
        with self._lock:
            self.counts["delete"] += 1
            found = self._by_name.get((ns, seq))
            if found is None or uid not in (None, found):
                raise NotFoundError(f"[not_found] no sequence {ns}/{seq}" + ("" if uid is None else f" with uid {uid}"))
            uid = self._by_name.pop((ns, seq))
            s = self._by_uid.pop(uid)
            gone = [k for k in self.blocks if k[0] == uid]
            for k in gone:
                del self.blocks[k]
                self.importance.pop(k, None)
                self.cluster.pop(k, None)
            return {"freed_bytes": len(gone) * s.geometry.block_bytes}

    def stats(self) -> dict:
        return {"counters": {"gets": self.counts["get"], "puts": self.counts["put"],
                             "blocks_dram": self.counts["blocks_fetched"], "blocks_ssd": 0},
                "sequences": len(self._by_uid)}

    def _seq(self, uid: int) -> _Seq:
        s = self._by_uid.get(int(uid))
        if s is None:
            raise NotFoundError(f"[not_found] no sequence with uid {uid} (create or open it first)")
        return s

    # ------------------------------------------------------------ buffers

    def register(self, size: int) -> FakeBuffer:
        with self._lock:
            self.counts["register"] += 1
            buf = FakeBuffer(size, next(self._buf_ids))
            self._buffers[buf.buf_id] = buf
            return buf

    def unregister(self, buf: FakeBuffer) -> None:
        with self._lock:
            self.counts["unregister"] += 1
            self._buffers.pop(buf.buf_id, None)
            buf.buf_id = None
            buf.array = np.zeros(0, dtype=np.uint8)

    # ------------------------------------------------------------ data

    def put(self, seq: Sequence, layers, pages, data, cluster=None, order=None, importance=None) -> int:
        raw = _as_bytes(data)
        layers, pages = _int_list(layers), _int_list(pages)
        with self._lock:
            s = self._seq(seq.uid)
            g = s.geometry
            bb = g.block_bytes
            total = len(layers) * g.num_kv_heads * len(pages)
            # What the real client checks before sending.
            if raw.nbytes != total * bb:
                raise ValueError(f"data holds {raw.nbytes} bytes; layers x heads x pages x block_bytes = {total * bb}")
            # What the daemon refuses.
            for name, values in (("layers", layers), ("pages", pages)):
                if not values:
                    raise RequestError(f"[bad_field] field {name!r} must be a list of 1.. integers",
                                       ErrorCode.BAD_FIELD)
                if min(values) < 0:
                    raise RequestError(f"[out_of_range] field {name!r} has negative values", ErrorCode.OUT_OF_RANGE)
                if len(set(values)) != len(values):
                    raise RequestError(f"[bad_field] field {name!r} repeats a value", ErrorCode.BAD_FIELD)
            if max(layers) >= g.num_layers:
                raise RequestError(f"[out_of_range] layer {max(layers)} >= num_layers {g.num_layers}",
                                   ErrorCode.OUT_OF_RANGE)
            extra = {}
            for name, arr, dtype in (("cluster", cluster, np.int32), ("order", order, np.int32),
                                     ("importance", importance, np.float32)):
                if arr is None:
                    continue
                flat = np.asarray(arr, dtype=dtype).ravel()
                if len(flat) != total:
                    raise RequestError(f"[bad_message] '{name}' has {len(flat)} values for {total} blocks",
                                       ErrorCode.BAD_MESSAGE)
                extra[name] = flat
            if "importance" in extra and not np.isfinite(extra["importance"]).all():
                raise RequestError("[bad_field] 'importance' holds NaN or infinity", ErrorCode.BAD_FIELD)
            keys = [(s.uid, layer, head, page) for layer in layers for head in range(g.num_kv_heads) for page in pages]
            for k in keys:
                if k in self.blocks:
                    raise ExistsError(f"[exists] block (layer {k[1]}, head {k[2]}, page {k[3]}) is already stored; "
                                      "blocks are write-once")
            blocks = raw.reshape(total, bb)
            for i, k in enumerate(keys):
                self.blocks[k] = blocks[i].tobytes()
                if "importance" in extra:
                    self.importance[k] = float(extra["importance"][i])
                if "cluster" in extra:
                    self.cluster[k] = int(extra["cluster"][i])
            self.counts["put"] += 1
            self.counts["blocks_put"] += total
            self.put_log.append(PutRecord(next(self._clock), s.uid, s.name, tuple(layers), tuple(pages),
                                          threading.get_ident()))
            return total

    def put_async(self, seq: Sequence, layers, pages, buffer: FakeBuffer, offset: int = 0, cluster=None,
                  order=None, importance=None) -> FakePendingGet:
        """The put runs when it is waited for, reading the buffer then: the latest moment the daemon
        may read it, so a client that reuses the buffer before the reply stores the wrong bytes."""
        layers, pages = _int_list(layers), _int_list(pages)
        buf_id = buffer.buf_id

        def run() -> dict:
            buf = self._buffers.get(buf_id)
            if buf is None:
                raise BufferError_(f"[bad_buffer] buffer {buf_id} is not registered")
            g = self._seq(seq.uid).geometry
            n = len(layers) * g.num_kv_heads * len(pages) * g.block_bytes
            if offset < 0 or offset + n > buf.size:
                raise RequestError(f"[out_of_range] put of {n} bytes at offset {offset} overruns the buffer",
                                   ErrorCode.OUT_OF_RANGE)
            data = buf.array[offset : offset + n].copy()
            return {"blocks": self.put(seq, layers, pages, data, cluster, order, importance)}

        pending = FakePendingGet(self, run)
        with self._lock:
            self._unwaited.add(pending)
        return pending

    def get_async(self, seq: Sequence, blocks, buffer: FakeBuffer, offset: int = 0, dst=None,
                  seqs=None) -> FakePendingGet:
        blocks = np.array(np.asarray(blocks, dtype=np.int32).reshape(-1, 3), dtype=np.int64)
        uids = (np.full(len(blocks), seq.uid, dtype=np.int64) if seqs is None
                else np.array(np.asarray(seqs, dtype=np.int64).ravel()))
        dst = None if dst is None else np.array(np.asarray(dst, dtype=np.int64).ravel())
        buf_id = buffer.buf_id
        with self._lock:
            self.counts["get"] += 1
            self.get_log.append(GetRecord(next(self._clock), blocks.copy(), uids.copy(), threading.get_ident()))

        def run() -> dict:
            with self._lock:
                return self._get(blocks, uids, buf_id, offset, dst)

        pending = FakePendingGet(self, run)
        self._unwaited.add(pending)
        if self.land == "submit":
            pending._execute()
        return pending

    def _get(self, blocks: np.ndarray, uids: np.ndarray, buf_id, offset: int, dst) -> dict:
        n = len(blocks)
        if n == 0:
            raise RequestError("[bad_message] 'blocks' must hold N > 0 rows of (layer, head, page)",
                               ErrorCode.BAD_MESSAGE)
        if (blocks < 0).any():
            raise RequestError("[out_of_range] 'blocks' holds a negative layer, head or page", ErrorCode.OUT_OF_RANGE)
        if len(uids) != n:
            raise RequestError(f"[bad_message] 'seqs' has {len(uids)} uids for {n} blocks", ErrorCode.BAD_MESSAGE)
        if dst is not None and len(dst) != n:
            raise RequestError(f"[bad_message] 'dst' has {len(dst)} offsets for {n} blocks", ErrorCode.BAD_MESSAGE)
        parts = {int(u): self._seq(u) for u in np.unique(uids)}
        sizes = {s.geometry.block_bytes for s in parts.values()}
        if len(sizes) > 1:
            raise RequestError(f"[bad_field] the sequences of one get must share a block size, got {sorted(sizes)}",
                               ErrorCode.BAD_FIELD)
        bb = sizes.pop()
        for i, (layer, head, _) in enumerate(blocks.tolist()):
            g = parts[int(uids[i])].geometry
            if layer >= g.num_layers or head >= g.num_kv_heads:
                raise RequestError(f"[out_of_range] block {i}: layer {layer} / head {head} outside the geometry",
                                   ErrorCode.OUT_OF_RANGE)
        buf = self._buffers.get(buf_id)
        if buf is None:
            raise BufferError_(f"[buffer] buffer {buf_id} is not registered by this session")
        at = (np.arange(n, dtype=np.int64) * bb if dst is None else dst) + offset
        if int(at.max()) + bb > buf.size:
            raise BufferError_(f"[buffer] destination buffer {buf_id} is too small: needs {int(at.max()) + bb} bytes, "
                               f"has {buf.size}")
        keys = [(int(u), int(layer), int(head), int(page)) for u, (layer, head, page) in zip(uids, blocks)]
        missing = [k for k in keys if k not in self.blocks]
        if missing:
            u, layer, head, page = missing[0]
            s = parts[u]
            # The daemon checks every block before it copies any.
            raise NotFoundError(f"[not_found] {len(missing)} of {n} blocks are not stored, first (layer {layer}, "
                                f"head {head}, page {page}) of {s.ns}/{s.name}")
        for k, where in zip(keys, at.tolist()):
            buf.array[where : where + bb] = np.frombuffer(self.blocks[k], dtype=np.uint8)
        self.counts["blocks_fetched"] += n
        return {"n": n, "dram": n, "ssd": 0, "reads": 0, "bytes_read": 0, "ms": 0.0}

    def get_into(self, seq: Sequence, blocks, buffer: FakeBuffer, offset: int = 0, dst=None) -> dict:
        return self.get_async(seq, blocks, buffer, offset, dst).wait()

    def get(self, seq: Sequence, blocks) -> np.ndarray:
        """Blocks as a copy, ``[N, block_bytes]`` uint8 (counted like any get)."""
        blocks = np.asarray(blocks, dtype=np.int32).reshape(-1, 3)
        bb = seq.geometry.block_bytes
        buf = self.register(max(1, len(blocks) * bb))
        try:
            self.get_into(seq, blocks, buf)
            return buf.array[: len(blocks) * bb].reshape(len(blocks), bb).copy()
        finally:
            self.unregister(buf)

    # ------------------------------------------------------------ life cycle

    def close(self) -> None:
        self._buffers.clear()

    def __enter__(self) -> "FakeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
