"""kvstored's ZeroMQ front end: one ROUTER socket, a writer thread, a get pool.

The main thread owns the socket. It parses every request (a bad one gets an error
reply at once), answers the cheap ops itself, queues catalog changes and puts for
the single writer thread, and hands gets to a worker pool; a get of a few MiB whose
blocks are all in DRAM it serves itself (``gets_inline`` counts them). Workers and the writer
send finished replies back over an inproc PUSH/PULL pair, so only the main thread
ever touches the ROUTER socket.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import zmq

from kvstored.config import DaemonConfig, SyncPolicy
from kvstored.protocol import (
    Create, Delete, ErrorCode, Get, Hello, ListSeqs, OpenSeq, ProtocolError, Put, Register, Stats, Unregister,
    error_reply, ok_reply, parse_request,
)
from kvstored.store import PreparedPut, Store

log = logging.getLogger(__name__)

_DONE = "inproc://kvstored-done"
_STOP = object()
# Puts gathered into one durable commit at most.
MAX_GROUP = 64
# Gets of at most this many bytes, all in DRAM, are served on the main thread.
INLINE_GET_BYTES = 8 << 20


class Server:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.address = cfg.bind_address
        self.store = Store(cfg)
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._writes: queue.Queue = queue.Queue()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(cfg.get_workers, thread_name_prefix="kvstored-get")
        self._push_lock = threading.Lock()
        self._push_sockets: list[zmq.Socket] = []
        self._writer = threading.Thread(target=self._writer_loop, name="kvstored-writer", daemon=True)

    # ------------------------------------------------------------ life cycle

    def bind(self) -> None:
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, 2 * self.cfg.max_message_bytes)
        if self.address.startswith("ipc://"):
            _prepare_ipc_path(Path(self.address[len("ipc://"):]), self.ctx)
        self.router.bind(self.address)
        if self.address.startswith("ipc://"):
            os.chmod(self.address[len("ipc://"):], stat.S_IRUSR | stat.S_IWUSR)
        self.done = self.ctx.socket(zmq.PULL)
        self.done.bind(_DONE)
        log.info("kvstored %d serving %s", os.getpid(), self.address)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        self.bind()
        self._writer.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.done, zmq.POLLIN)
        while not self._stop.is_set():
            if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                log.warning("parent process %d is gone; shutting down", self.cfg.parent_pid)
                break
            for sock, _ in poller.poll(200):
                if sock is self.router:
                    self._drain_requests()
                else:
                    self._drain_replies()
        self._shutdown()

    def _shutdown(self) -> None:
        log.info("shutting down: finishing queued work")
        self._pool.shutdown(wait=True)
        self._writes.put(_STOP)
        self._writer.join()
        self._drain_replies()
        # The worker threads have ended; their reply sockets close here.
        for sock in self._push_sockets:
            sock.close()
        self._drain_replies()
        self.router.close()
        self.done.close()
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
        self.store.close()
        self.ctx.term()
        log.info("kvstored stopped cleanly")

    # ------------------------------------------------------------ main thread

    def _drain_requests(self) -> None:
        for _ in range(256):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, body = frames[0].bytes, frames[1:]
            self._handle(ident, body)

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self.done.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.router.send_multipart(frames)

    def _handle(self, ident: bytes, body: list) -> None:
        req_id = None
        try:
            req_id, req = parse_request(body, self.cfg.max_message_bytes, self.cfg.max_blocks_per_request)
            if isinstance(req, Get):
                if self.store.in_dram(req, INLINE_GET_BYTES):
                    # A DRAM-only get is a copy of a few MiB at most: served here, it saves
                    # two thread hand-offs (to a worker, and its reply back), about half of
                    # a small get's round trip on a busy host.
                    self.router.send_multipart([ident, *ok_reply(req_id, **self.store.get(req))])
                    self.store.counters["gets_inline"] += 1
                else:
                    self._pool.submit(self._run, ident, req_id, lambda: self.store.get(req))
            elif isinstance(req, (Put, Create, Delete)):
                self._writes.put((ident, req_id, req))
            else:
                self.router.send_multipart([ident, *ok_reply(req_id, **self._inline(req))])
        except ProtocolError as exc:
            req_id = getattr(exc, "req_id", req_id)
            self.store.counters["bad_requests"] += 1
            log.debug("refused request %s: %s", req_id, exc)
            self.router.send_multipart([ident, *error_reply(req_id, exc.code, str(exc))])
        except Exception as exc:  # keep serving everyone else; the client gets the reason
            log.exception("internal error on request %s", req_id)
            self.router.send_multipart([ident, *error_reply(req_id, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")])

    def _inline(self, req: object) -> dict:
        if isinstance(req, Hello):
            return self.store.hello()
        if isinstance(req, Stats):
            return self.store.stats()
        if isinstance(req, OpenSeq):
            return self.store.open(req)
        if isinstance(req, ListSeqs):
            return {"sequences": self.store.list(req)}
        if isinstance(req, Register):
            mb = self.store.buffers.register(req)
            return {"buf": mb.buf_id, "size": mb.size}
        if isinstance(req, Unregister):
            self.store.unregister(req.buf)
            return {}
        raise AssertionError(f"no inline handler for {type(req).__name__}")

    # ------------------------------------------------------------ other threads

    def _send(self, frames: list) -> None:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(_DONE)
            with self._push_lock:
                self._push_sockets.append(sock)
        sock.send_multipart(frames)

    def _run(self, ident: bytes, req_id: int, fn: Callable[[], dict]) -> None:
        try:
            self._send([ident, *ok_reply(req_id, **fn())])
        except ProtocolError as exc:
            self._send([ident, *error_reply(req_id, exc.code, str(exc))])
        except Exception as exc:
            log.exception("internal error on request %s", req_id)
            self._send([ident, *error_reply(req_id, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")])

    def _writer_loop(self) -> None:
        dirty_since: float | None = None
        running = True
        while running:
            batch = []
            try:
                batch.append(self._writes.get(timeout=None if dirty_since is None else 1.0))
            except queue.Empty:
                pass
            while batch and len(batch) < MAX_GROUP:
                try:
                    batch.append(self._writes.get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                running = False
                batch = [b for b in batch if b is not _STOP]
            self._write_batch(batch)
            if self.cfg.sync == SyncPolicy.WRITE_BEHIND:
                if batch and dirty_since is None:
                    dirty_since = time.monotonic()
                if dirty_since is not None and (not running or not batch or time.monotonic() - dirty_since >= 1.0):
                    self.store.sync()
                    dirty_since = None

    def _write_batch(self, batch: list) -> None:
        prepared: list[tuple[bytes, int, PreparedPut]] = []
        for ident, req_id, req in batch:
            if isinstance(req, Put):
                try:
                    prepared.append((ident, req_id, self.store.prepare_put(req)))
                except ProtocolError as exc:
                    self._send([ident, *error_reply(req_id, exc.code, str(exc))])
                except Exception as exc:
                    log.exception("internal error preparing put %s", req_id)
                    self._send([ident, *error_reply(req_id, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")])
            else:
                # Catalog changes commit on their own, after the puts gathered so far.
                self._commit(prepared)
                prepared = []
                fn = self.store.create if isinstance(req, Create) else self.store.delete
                self._run(ident, req_id, lambda fn=fn, req=req: fn(req))
        self._commit(prepared)

    def _commit(self, prepared: list[tuple[bytes, int, PreparedPut]]) -> None:
        if not prepared:
            return
        try:
            self.store.commit_puts([p for _, _, p in prepared])
        except Exception as exc:
            log.exception("commit of %d puts failed", len(prepared))
            code = exc.code if isinstance(exc, ProtocolError) else ErrorCode.IO
            for ident, req_id, _ in prepared:
                self._send([ident, *error_reply(req_id, code, f"commit failed: {exc}")])
            return
        for ident, req_id, p in prepared:
            self._send([ident, *ok_reply(req_id, blocks=len(p.pages))])


def _prepare_ipc_path(path: Path, ctx: zmq.Context) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(f"ipc://{path}")
        probe.send(b"\x80")
        alive = probe.poll(300, zmq.POLLIN)
        probe.close()
        if alive:
            raise RuntimeError(f"another kvstored is serving ipc://{path}")
        log.info("removing stale socket %s", path)
        path.unlink()


def install_signal_handlers(server: Server) -> None:
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
