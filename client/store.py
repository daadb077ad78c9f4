"""The low-level client of kvstored: sequences, puts, sparse gets.

- ``connect()`` talks to the default daemon: ``$KVDRIVE_ADDRESS``, else the one a plain
  ``kvstored --ssd DIR --dram SIZE`` started (``ipc://RUNTIME/kvstored.sock``), else the
  systemd unit's (``ipc:///run/kvdrive/kvstored.sock``); see :mod:`kvdrive_client.locate`.
- ``connect("ipc://PATH")`` (or ``tcp://127.0.0.1:PORT``) talks to that daemon.
- ``connect(None)`` starts a private daemon in a temporary directory and stops it,
  directory and all, on :meth:`StoreClient.close` (or when this process dies).

One client may have many gets in flight (``get_async``); it is safe to share between threads.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvdrive.layout.geometry import Geometry
from kvdrive_client.embedded import EmbeddedDaemon
from kvdrive_client.channel import SessionChannel, trusted_daemon_uids
from kvdrive_client.errors import BufferError_, RequestError, SessionLostError, StoreUnavailableError, error_from_reply
from kvdrive_client.locate import DEFAULT, Default, check_socket, resolve
from kvdrive_client.shm import CudaIpcBuffer, PoolBuffer, SharedBuffer
from kvdrive.protocol import MAX_BLOCK_KEYS, MAX_LOOKUP, BadReplyError, Op, decode_reply, request_frames

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sequence:
    """A stored sequence, as :meth:`StoreClient.create` or :meth:`StoreClient.open` returns it.

    ``uid`` names it in puts and gets; ``ns``/``name`` are what it was created as;
    ``num_blocks`` the blocks stored so far and ``complete_pages`` the pages stored for
    every (layer, KV head), both as of the reply. ``writing``: whether the session that
    created it, or put into it last, is still open on the daemon (False after a restart
    until a put; None where the daemon does not say): an incomplete sequence nobody is
    writing stays so.
    """

    uid: int
    ns: str
    name: str
    geometry: Geometry
    num_blocks: int
    complete_pages: int
    writing: bool | None = None

    @classmethod
    def from_reply(cls, r: dict) -> "Sequence":
        return cls(r["uid"], r["ns"], r["seq"], Geometry.from_dict(r["geometry"]), r["num_blocks"], r["complete_pages"],
                   r.get("writing"))


class PendingGet:
    """A sparse get in flight (:meth:`StoreClient.get_async`)."""

    def __init__(self, client: "StoreClient", req_id: int) -> None:
        self._client = client
        self.req_id = req_id

    def wait(self, timeout: float | None = None) -> dict:
        """Wait until the blocks are in the buffer; the daemon's summary of the get: ``n`` blocks,
        of which ``dram`` came from the DRAM tier and ``ssd`` from the SSD in ``reads`` reads of
        ``bytes_read`` bytes, in ``ms`` milliseconds of the daemon's time. Raises the store's error
        (:class:`~kvdrive_client.errors.NotFoundError` for a block never put, ...) if it failed."""
        return self._client._wait(self.req_id, timeout)

    def settle(self) -> dict:
        """:meth:`wait` until the daemon answers or ends the session, past every timeout (each
        one passed is logged): for a request that moves memory the caller hands back to
        its owner once this returns (a pool's rows), which no late copy may touch."""
        return self._client._wait(self.req_id, patient=True)


class PendingPut(PendingGet):
    """A put in flight; :meth:`wait` returns the daemon's reply (``blocks``: how many it stored)."""


ZERO_COPY_MIN_BYTES = 256 << 10
# A waiting thread holds the socket's lock while it polls, this long at most: another
# thread's request on the same client waits at most this long to be sent (50 ms before).
POLL_MS = 5
# Ops that change nothing: retried once, on a new session, when the daemon no longer knew the old one.
_SAFE_TO_RETRY = frozenset({Op.HELLO, Op.OPEN, Op.LIST, Op.LOOKUP, Op.STATS, Op.BLOCK_LOOKUP})


class StoreClient:
    """A connection to kvstored and one session on it; :func:`connect` makes one.

    Sequences (:meth:`create`, :meth:`open`, :meth:`list`, :meth:`delete`) hold blocks:
    a block is the K and V of one page of one (layer, KV head), addressed
    ``(layer, head, page)``, ``geometry.block_bytes`` bytes (K then V, each
    ``[page_size, head_dim]`` of the geometry's dtype). Blocks are written once
    (:meth:`put`) and read in any sparse set (:meth:`get`, :meth:`get_async` into a
    buffer from :meth:`register`). ``timeout`` (seconds) bounds every request.

    The session is opened on first use (see kvdrive_client.channel). When the daemon
    ends it (a restart, a crash), the client notices at once: a request waiting for
    its reply fails within a poll interval instead of waiting out ``timeout``, and the
    next call opens a new session and registers the client's buffers again, with new
    ids (``SharedBuffer.buf_id``), so no request ever names a buffer of the old session.
    Every request carries a deadline of ``timeout`` from its sending: the daemon does
    not start it later, so a request the client gave up on never runs behind its back.
    """

    def __init__(self, address: str, timeout: float = 120.0, daemon: EmbeddedDaemon | None = None,
                 daemon_uid: int | None = None) -> None:
        self.address = address
        # Over TCP, the uids the daemon behind the session socket may run as (client/channel.py).
        self._trusted_uids = None if address.startswith("ipc://") else trusted_daemon_uids(daemon_uid)
        self.timeout = timeout
        self._daemon = daemon
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        # Runs once: at close(), at exit, or when a client nobody closed is collected (before
        # the context's own finaliser could wait forever for a socket the collector has not
        # closed yet). An embedded daemon goes with it, and its temp directory.
        self._release = weakref.finalize(self, _release, self._ctx, self._sock, daemon)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._session_lock = threading.RLock()
        self._replies: dict[int, dict] = {}
        self._staging: SharedBuffer | None = None
        self._buffers: list[SharedBuffer | PoolBuffer | CudaIpcBuffer] = []
        self._channel: SessionChannel | None = None
        # Requests in flight, by id: the session (channel) each was sent in.
        self._sent_in: dict[int, SessionChannel | None] = {}
        self.server_info: dict = {}
        self.instance: str | None = None
        self.restarts_seen = 0

    # ------------------------------------------------------------ session

    def _session_path(self) -> Path:
        if self.address.startswith("ipc://"):
            return Path(self.address[len("ipc://"):] + ".session")
        return Path(self.hello()["session_socket"])

    def session(self) -> SessionChannel:
        """The open session, opened (again) here if there is none or the daemon ended it."""
        with self._session_lock:
            ch = self._channel
            if ch is not None and not ch.dead():
                return ch
            if ch is not None:
                ch.close()
                self._channel = None
            ch = SessionChannel(self._session_path(), min(self.timeout, 30.0), self._trusted_uids)
            if self.instance is not None and ch.instance != self.instance:
                self.restarts_seen += 1
                log.warning("kvstored at %s restarted (instance %s -> %s); registering %d buffers again",
                            self.address, self.instance, ch.instance, len(self._buffers))
            self.server_info = {}
            for buf in self._buffers:
                buf.buf_id = None
            try:
                for buf in list(self._buffers):
                    try:
                        buf.buf_id = ch.register(buf)
                    except BufferError_ as exc:  # refused by this daemon (its limits, say): the others still work
                        self._buffers.remove(buf)
                        log.warning("kvstored at %s refused to register %r again (%s); requests naming it fail "
                                    "until it is registered anew", self.address, buf, exc)
            except BaseException:
                ch.close()
                raise
            self._channel, self.instance = ch, ch.instance
        self.server_info = self.call(Op.HELLO)
        return ch

    # ------------------------------------------------------------ transport

    def _submit(self, op: Op, fields: dict | None = None, arrays: dict | None = None,
                timeout: float | None = None) -> int:
        ch = None if op is Op.HELLO else self.session()
        if fields is not None and hasattr(fields.get("buf"), "buf_id"):
            # A buffer's id is read once the session is open: a restarted daemon's new session
            # registers the client's buffers again, with ids of its own, which the old ids may
            # name other buffers of. (A raw id, from a caller speaking the protocol, goes as it is.)
            buf = fields["buf"]
            if buf.buf_id is None:
                raise BufferError_(f"[buffer] {type(buf).__name__} of {buf.size} bytes is not registered with kvstored "
                                   f"(unregistered, or refused when the session opened again)")
            fields = {**fields, "buf": buf.buf_id}
        req_id = next(self._ids)
        deadline = time.time() + (self.timeout if timeout is None else timeout)
        frames = request_frames(op, req_id, fields or {}, arrays, None if ch is None else ch.token, deadline)
        nbytes = sum(memoryview(f).nbytes for f in frames)
        limit = self.server_info.get("max_message_bytes") if self.server_info else None
        if limit is not None and nbytes > limit:
            raise RequestError(f"[too_large] this {op.value} is {nbytes} bytes; kvstored takes messages of at most {limit}")
        # Zero-copy sends pay for tracking every frame; they only win for large frames
        # (measured: ~0.3 ms per small frame with copy=False).
        with self._lock:
            self._sent_in[req_id] = ch
            self._sock.send_multipart(frames, copy=nbytes <= ZERO_COPY_MIN_BYTES)
        return req_id

    def _wait(self, req_id: int, timeout: float | None = None, patient: bool = False) -> dict:
        wait_s = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        ch = self._sent_in.get(req_id)
        try:
            while True:
                with self._lock:
                    reply = self._replies.pop(req_id, None)
                    if reply is None and self._sock.poll(POLL_MS, zmq.POLLIN):
                        try:
                            got = decode_reply(self._sock.recv())
                        except BadReplyError as exc:
                            raise RequestError(f"kvstored at {self.address}: {exc}") from None
                        if got.get("id") is None:
                            # The daemon could not read a request's id; it can only be reported here.
                            raise error_from_reply(got)
                        if got.get("id") == req_id:
                            reply = got
                        elif got.get("id") in self._sent_in:
                            self._replies[got.get("id")] = got
                if reply is not None:
                    if not reply.get("ok"):
                        raise error_from_reply(reply)
                    return reply
                if ch is not None and ch.dead():
                    raise StoreUnavailableError(
                        f"kvstored at {self.address} ended this client's session while request {req_id} was in flight "
                        f"(it stopped or restarted); whether the request ran is unknown"
                    )
                if self._daemon is not None:
                    self._daemon.check_alive()
                if time.monotonic() > deadline:
                    if not patient:
                        raise StoreUnavailableError(f"kvstored at {self.address} sent no reply within {self.timeout:.0f} s")
                    log.warning("kvstored at %s has not answered request %d in %.0f s more; waiting on: it moves memory "
                                "that is given back only once it ends", self.address, req_id, wait_s)
                    deadline = time.monotonic() + wait_s
        finally:
            with self._lock:
                self._sent_in.pop(req_id, None)

    def call(self, op: Op, fields: dict | None = None, arrays: dict | None = None, timeout: float | None = None) -> dict:
        """Send one request and wait for its reply (the methods below are made of this)."""
        try:
            return self._wait(self._submit(op, fields, arrays, timeout), timeout)
        except SessionLostError:
            if op not in _SAFE_TO_RETRY:
                raise
            # It did not run; the retry opens a new session first.
            return self._wait(self._submit(op, fields, arrays, timeout), timeout)

    def ping(self, timeout: float = 1.0) -> bool:
        """Whether the daemon answers a hello within ``timeout`` seconds."""
        try:
            self.server_info = self.call(Op.HELLO, timeout=timeout)
            return True
        except StoreUnavailableError:
            return False

    # ------------------------------------------------------------ sequences

    def create(self, ns: str, seq: str, geometry: Geometry, exist_ok: bool = False) -> Sequence:
        """A new, empty sequence ``ns/seq`` of this user with ``geometry``.

        One that exists raises :class:`~kvdrive_client.errors.ExistsError`, unless
        ``exist_ok`` and its geometry is the same: then it is returned as it is.
        """
        r = self.call(Op.CREATE, {"ns": ns, "seq": seq, "geometry": geometry.to_dict(), "exist_ok": exist_ok})
        return Sequence.from_reply(r)

    def open(self, ns: str, seq: str) -> Sequence:
        """This user's sequence ``ns/seq`` (also one stored before a daemon restart);
        :class:`~kvdrive_client.errors.NotFoundError` if there is none."""
        return Sequence.from_reply(self.call(Op.OPEN, {"ns": ns, "seq": seq}))

    def list(self, ns: str | None = None) -> list[dict]:
        """This user's sequences (of namespace ``ns``), in uid order (uids are random: sort by ``created`` for creation order), every page of the reply."""
        out: list[dict] = []
        after = 0
        while True:
            r = self.call(Op.LIST, {**({"ns": ns} if ns else {}), "after": after})
            out.extend(r["sequences"])
            if not r.get("more") or not r["sequences"]:
                return out
            after = r["sequences"][-1]["uid"]

    def lookup(self, ns: str, names, min_pages: int = 1, timeout: float | None = None) -> dict:
        """Which of this user's sequences ``ns/names[i]`` exist, in one request per
        :data:`~kvdrive.protocol.MAX_LOOKUP` names: ``{"uids": [...], "pages": [...],
        "prefix": n}``, uid 0 and pages -1 where a name has no sequence, ``prefix`` the
        leading names whose sequences hold at least ``min_pages`` complete pages."""
        names = list(names)
        uids: list[int] = []
        pages: list[int] = []
        for i in range(0, len(names), MAX_LOOKUP):
            r = self.call(Op.LOOKUP, {"ns": ns, "seqs": names[i: i + MAX_LOOKUP], "min_pages": min_pages}, timeout=timeout)
            uids += r["uids"]
            pages += r["pages"]
        prefix = next((i for i, n in enumerate(pages) if n < min_pages), len(pages))
        return {"uids": uids, "pages": pages, "prefix": prefix}

    def delete(self, ns: str, seq: str, uid: int | None = None) -> dict:
        """Delete ``ns/seq`` and free its blocks; :class:`~kvdrive_client.errors.NotFoundError` if there is none,
        or, given ``uid``, if ``ns/seq`` is no longer that sequence (deleted, and its name taken again)."""
        return self.call(Op.DELETE, {"ns": ns, "seq": seq} if uid is None else {"ns": ns, "seq": seq, "uid": uid})

    def hello(self) -> dict:
        """The daemon's hello (format, engine, what it supports), asked once and kept."""
        if not self.server_info:
            self.server_info = self.call(Op.HELLO)
        return self.server_info

    def stats(self) -> dict:
        """The daemon's figures: its tiers, its counters since start, this user's sequence count
        (every key, with its unit, in docs/stats.md)."""
        return self.call(Op.STATS)

    # ------------------------------------------------------------ buffers

    def register(self, size: int) -> SharedBuffer:
        """A new shared buffer of ``size`` bytes, registered with the daemon (a memfd)."""
        return self._register(SharedBuffer(size))

    def _register(self, buf):
        try:
            with self._session_lock:
                buf.buf_id = self.session().register(buf)
                self._buffers.append(buf)
        except BaseException:
            buf.close()
            raise
        return buf

    def register_pool(self, fd_or_buffer: int | PoolBuffer, size: int | None = None,
                      array: np.ndarray | None = None) -> PoolBuffer:
        """Register memory the caller already shares (an engine's CPU KV pool: a memfd or a
        file in /dev/shm, open read-write, unsealed) for block gets to land in and block
        puts to read from, without a copy through a buffer of the client's own.

        ``fd_or_buffer`` is a descriptor of it (duplicated here; ``size`` bytes of it are
        registered; ``array``, the caller's mapping of it, if it has one) or a
        :class:`PoolBuffer`. The daemon maps it under a guard: a file shrunk under it makes
        this pool's requests fail (register it again), never the daemon; it is registered
        again with a restarted daemon, like every buffer.
        """
        if isinstance(fd_or_buffer, PoolBuffer):
            return self._register(fd_or_buffer)
        if size is None:
            raise ValueError("register_pool(fd, size): a descriptor needs the size to register")
        return self._register(PoolBuffer.from_fd(fd_or_buffer, size, array))

    def register_cuda(self, target) -> CudaIpcBuffer:
        """Register a CUDA tensor's memory (contiguous; or a :class:`CudaIpcBuffer` made
        from a raw IPC handle) for gets to land in and puts to read from, by CUDA IPC.

        The daemon opens the allocation's IPC handle once; the tensor is held until
        :meth:`unregister`. A daemon without a usable CUDA device refuses with
        :class:`~kvdrive_client.errors.CudaUnavailableError` (its hello says
        ``cuda_ipc: false``). On a GPU this path has run once, exact, untimed (see docs/protocol.md).
        """
        return self._register(target if isinstance(target, CudaIpcBuffer) else CudaIpcBuffer.from_tensor(target))

    def unregister(self, buf: SharedBuffer | CudaIpcBuffer) -> None:
        """Tell the daemon to forget ``buf`` (it unmaps it) and free it here."""
        with self._session_lock:
            if buf in self._buffers:
                self._buffers.remove(buf)
            ch = self._channel
            if buf.buf_id is not None and ch is not None and not ch.dead():
                ch.unregister(buf.buf_id)
        buf.close()

    def _staging_buffer(self, nbytes: int) -> SharedBuffer:
        if self._staging is None or self._staging.size < nbytes:
            if self._staging is not None:
                self.unregister(self._staging)
            self._staging = self.register(max(nbytes, 1 << 20))
        return self._staging

    # ------------------------------------------------------------ data

    def put_async(self, seq: Sequence, layers, pages, buffer: SharedBuffer | CudaIpcBuffer, offset: int = 0,
                  cluster=None, order=None, importance=None) -> PendingPut:
        """Start storing blocks laid out ``[layers, heads, pages, block_bytes]`` in ``buffer`` at
        ``offset``; those bytes must stay as they are until the returned put's ``wait()``
        returns (the daemon reads them while it stores them). A put's errors are raised by
        ``wait()``."""
        arrays = {}
        for name, arr, dtype in (("cluster", cluster, np.int32), ("order", order, np.int32), ("importance", importance, np.float32)):
            if arr is not None:
                arrays[name] = np.ascontiguousarray(np.asarray(arr, dtype=dtype).ravel())
        fields = {"seq": seq.uid, "layers": _int_list(layers), "pages": _int_list(pages), "buf": buffer, "offset": offset}
        return PendingPut(self, self._submit(Op.PUT, fields, arrays))

    def put_from(self, seq: Sequence, layers, pages, buffer: SharedBuffer | CudaIpcBuffer, offset: int = 0,
                 cluster=None, order=None, importance=None) -> int:
        """Store blocks already laid out ``[layers, heads, pages, block_bytes]`` in ``buffer`` at ``offset``
        (no copy on this side); the other arguments as :meth:`put`'s. Returns the blocks stored."""
        return self.put_async(seq, layers, pages, buffer, offset, cluster, order, importance).wait()["blocks"]

    def put(self, seq: Sequence, layers, pages, data, cluster=None, order=None, importance=None) -> int:
        """Store the blocks of ``layers`` x every KV head x ``pages``; returns how many.

        ``data`` (numpy or torch, any dtype) holds ``len(layers) * num_kv_heads *
        len(pages) * block_bytes`` bytes in that order: for example an array
        ``[layers, heads, pages, 2, page_size, head_dim]`` of the geometry's dtype, K
        before V in each block. Blocks are written once: a page already stored for one
        of these (layer, head) is refused. Optional, one value per block
        (``[layers, heads, pages]``): ``cluster`` (int) and ``order`` (int) say which
        blocks the SSD layout packs side by side and in what order; ``importance``
        (float) which ones the DRAM tier keeps first. Acknowledged once durable (see
        docs/durability.md).
        """
        raw = _as_bytes(data)
        g = seq.geometry
        expect = len(_int_list(layers)) * g.num_kv_heads * len(_int_list(pages)) * g.block_bytes
        if raw.nbytes != expect:
            raise ValueError(f"data holds {raw.nbytes} bytes; layers x heads x pages x block_bytes = {expect}")
        staging = self._staging_buffer(raw.nbytes)
        staging.array[: raw.nbytes] = raw
        return self.put_from(seq, layers, pages, staging, 0, cluster, order, importance)

    def get_async(self, seq: Sequence, blocks, buffer: SharedBuffer | CudaIpcBuffer, offset: int = 0, dst=None,
                  seqs=None) -> PendingGet:
        """Start a sparse get of ``blocks`` ((layer, head, page) rows) into ``buffer``.

        Block i lands at ``offset + dst[i]`` (default ``offset + i * block_bytes``).
        ``seqs`` (uids, one per block) gathers blocks of several sequences of one block
        size in one request (daemons whose hello says ``get_seqs``); ``seq`` is then
        only the default. Returns at once; :meth:`PendingGet.wait` waits for the blocks.
        """
        blocks = np.ascontiguousarray(np.asarray(blocks, dtype=np.int32).reshape(-1, 3))
        arrays = {"blocks": blocks}
        if dst is not None:
            arrays["dst"] = np.ascontiguousarray(np.asarray(dst, dtype=np.int64))
        if seqs is not None:
            arrays["seqs"] = np.ascontiguousarray(np.asarray(seqs, dtype=np.int64))
        return PendingGet(self, self._submit(Op.GET, {"seq": seq.uid, "buf": buffer, "offset": offset}, arrays))

    def get_into(self, seq: Sequence, blocks, buffer: SharedBuffer | CudaIpcBuffer, offset: int = 0, dst=None) -> dict:
        """:meth:`get_async` and wait: the daemon's summary of the get."""
        return self.get_async(seq, blocks, buffer, offset, dst).wait()

    def get(self, seq: Sequence, blocks) -> np.ndarray:
        """The blocks named by ``(layer, head, page)`` rows, copied out: ``[N, block_bytes]`` uint8
        (``.view(dtype).reshape(N, 2, page_size, head_dim)`` gives K and V)."""
        blocks = np.asarray(blocks, dtype=np.int32).reshape(-1, 3)
        bb = seq.geometry.block_bytes
        staging = self._staging_buffer(len(blocks) * bb)
        self.get_into(seq, blocks, staging)
        return staging.array[: len(blocks) * bb].reshape(len(blocks), bb).copy()

    # ------------------------------------------------------------ engine blocks (docs/protocol.md, block_*)

    def block_lookup(self, ns: str, keys, timeout: float | None = None) -> list[bool]:
        """Whether this user's block namespace ``ns`` holds each of ``keys`` (bytes), in one
        request per :data:`~kvdrive.protocol.MAX_BLOCK_KEYS` keys."""
        keys = _key_list(keys)
        found: list[bool] = []
        for i in range(0, len(keys), MAX_BLOCK_KEYS):
            found += self.call(Op.BLOCK_LOOKUP, {"ns": ns, "keys": keys[i: i + MAX_BLOCK_KEYS]}, timeout=timeout)["found"]
        return found

    def block_put_async(self, ns: str, block_bytes: int, keys, buffer: SharedBuffer | PoolBuffer, offset: int = 0,
                        offsets=None, regions: int = 1) -> PendingPut:
        """Start storing block i of ``keys`` from ``buffer`` at ``offset + i * block_bytes`` (at
        ``offset + offsets[i]`` where ``offsets`` is given; at most MAX_BLOCK_KEYS keys);
        write-once: keys stored already are skipped. ``wait()`` gives ``stored`` (blocks
        written) and ``present`` (skipped), once they are durable. A block in ``regions``
        equal regions has an offset per region: ``offsets[i * regions + r]``."""
        fields = {"ns": ns, "block_bytes": block_bytes, "keys": _key_list(keys), "buf": buffer,
                  "offset": offset}
        return PendingPut(self, self._submit(Op.BLOCK_PUT, fields, _place(fields, offsets, regions)))

    def block_get_async(self, ns: str, keys, buffer: SharedBuffer | PoolBuffer, offset: int = 0,
                        offsets=None, regions: int = 1) -> PendingGet:
        """Start copying the block of each of ``keys`` that ``ns`` holds to ``offset + i *
        block_bytes`` of ``buffer`` (``offset + offsets[i]`` where ``offsets`` is given, or
        ``offsets[i * regions + r]`` for region r of blocks in ``regions`` equal regions: no
        two may overlap); ``wait()`` gives ``found`` per key and ``damaged``, the positions
        whose stored copy failed its checksum (not found, their bytes not to be used)."""
        fields = {"ns": ns, "keys": _key_list(keys), "buf": buffer, "offset": offset}
        return PendingGet(self, self._submit(Op.BLOCK_GET, fields, _place(fields, offsets, regions)))

    def block_delete(self, ns: str, keys=None) -> dict:
        """Delete ``keys`` from block namespace ``ns`` (every block of it without ``keys``):
        ``{"deleted": n, "freed_bytes": ...}``; NotFoundError if the namespace has none."""
        if keys is None:
            return self.call(Op.BLOCK_DELETE, {"ns": ns, "all": True})
        return self.call(Op.BLOCK_DELETE, {"ns": ns, "keys": _key_list(keys)})

    # ------------------------------------------------------------ life cycle

    def close(self) -> None:
        """End the session (the daemon unmaps its buffers as the socket closes) and free the buffers."""
        with self._session_lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()
            self._staging = None
        self._release()
        self._daemon = None

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(address: str | None | Default = DEFAULT, *, dram: str = "256M", ssd_max: str = "8G",
            timeout: float = 120.0, daemon_args: list[str] | None = None, daemon_uid: int | None = None) -> StoreClient:
    """A client of kvstored.

    - ``connect()``: the default daemon, the first of ``$KVDRIVE_ADDRESS``; the user's
      runtime-directory socket ``ipc://RUNTIME/kvstored.sock`` (``$RUNTIME_DIRECTORY``,
      else ``$XDG_RUNTIME_DIR``, else ``/tmp/kvdrive-UID``), where ``kvstored --ssd DIR
      --dram SIZE`` listens when started without ``--listen``; and, when that socket
      does not exist, ``ipc:///run/kvdrive/kvstored.sock`` (the systemd unit's).
    - ``connect("ipc://PATH")`` or ``connect("tcp://127.0.0.1:PORT")``: that daemon.
    - ``connect(None)``: a private daemon, started here in a temporary directory with a
      ``dram`` DRAM tier and at most ``ssd_max`` on its SSD tier (``daemon_args``: more
      ``kvstored`` flags); :meth:`StoreClient.close` stops it and removes the directory,
      and so does the daemon itself if this process dies first.

    Over TCP the daemon's session socket must be served by root, this user or the
    service user ``kvdrive`` (a local user could have bound the port first and would
    otherwise be handed this client's buffers); ``daemon_uid`` trusts one more uid.
    ``timeout`` (seconds) bounds every request. An ipc:// path with no daemon behind it
    (no socket file, or a stale one) raises :class:`StoreUnavailableError` at once, saying
    how to start one; a daemon that does not answer within ``min(timeout, 10)`` seconds
    raises it too.
    """
    if address is None:
        return _connect_embedded(dram, ssd_max, timeout, daemon_args)
    address, by_default = resolve(address)
    check_socket(address, by_default)
    client = StoreClient(address, timeout, daemon_uid=daemon_uid)
    wait = min(timeout, 10.0)
    if not client.ping(timeout=wait):
        client.close()
        raise StoreUnavailableError(f"no kvstored answers at {address} within {wait:g} s")
    return client


def _connect_embedded(dram: str, ssd_max: str, timeout: float, daemon_args: list[str] | None) -> StoreClient:
    daemon = EmbeddedDaemon(dram=dram, ssd_max=ssd_max, extra_args=daemon_args)
    client = StoreClient(daemon.address, timeout, daemon)
    try:
        daemon.wait_ready(lambda: client.ping(timeout=0.5))
    except BaseException:
        client.close()
        raise
    return client


def _place(fields: dict, offsets, regions: int) -> dict | None:
    """A block request's ``regions`` field, where not the default, and its ``offsets`` as an
    array frame (int64), where given: the request's arrays."""
    if regions != 1:
        fields["regions"] = int(regions)
    if offsets is None:
        return None
    a = np.asarray(offsets).ravel()
    if a.dtype != np.int64:
        a = a.astype(np.int64)  # as int() would: floats truncated, a str of digits read
    return {"offsets": a}


def _key_list(keys) -> list[bytes]:
    """``keys`` as a list of bytes (a list of bytes as it is, copied: one C pass, not a call a key)."""
    keys = list(keys)
    return keys if set(map(type, keys)) <= {bytes} else [bytes(k) for k in keys]


def _int_list(x) -> list[int]:
    if isinstance(x, range):
        return list(x)
    a = np.asarray(x).ravel()
    if a.dtype.kind not in "iu":
        a = a.astype(np.int64)  # as int() would: floats truncated, a str of digits read
    return a.tolist()


def _as_bytes(data) -> np.ndarray:
    if hasattr(data, "detach"):  # a torch tensor: view its bytes without a dtype round trip
        t = data.detach().contiguous().cpu()
        return t.view(-1).view(__import__("torch").uint8).numpy()
    arr = np.ascontiguousarray(data)
    return arr.view(np.uint8).ravel()


def _release(ctx: zmq.Context, sock: zmq.Socket, daemon: EmbeddedDaemon | None) -> None:
    """Close the socket and end its context without waiting for anything unsent; stop an embedded daemon."""
    sock.close(linger=0)
    ctx.term()
    if daemon is not None:
        daemon.stop()
