"""kvstored's front end: one ZeroMQ ROUTER socket, the session socket, a writer thread, a get pool.

The main thread owns the ROUTER socket. It reads what clients sent into one queue per
connection and serves them in turn by user: each round, one request of each user (the
uid the ipc socket names; over TCP, where no uid is known, each connection is a user
of its own), from that user's connections one after another. So a user who floods the
daemon, on however many connections, delays only itself: another user waits at most
one request of each busy user. A request is parsed (a bad one gets an error reply at
once), its session token checked (kvstored/sessions.py) and its deadline; cheap ops
are answered here, catalog changes and puts are queued for the single writer thread
(kvstored/writer.py), which takes them in turn by user and session and commits them
in groups; gets and block gets go to a worker pool (one of a few MiB
whose blocks are all in DRAM is served here: ``gets_inline`` counts them). Each connection has at most ``MAX_IN_FLIGHT`` requests
handed to the writer or the pool at once, and at most ``MAX_QUEUED`` waiting; past
that it gets ``busy`` replies. Workers and the writer send finished replies back over
an inproc PUSH/PULL pair, so only the main thread ever touches the ROUTER socket.

Replies never wait on a peer (kvstored/replies.py): a connection whose peer is behind in
reading them is not served until it catches up, and replies past a small bound are
dropped and counted. A list reply holds at most ``LIST_PAGE`` sequences (the client asks
again for the rest), so what one connection that never reads can pin is under 4 MiB,
and what one uid can pin is that times its connections (``--max-connections-per-uid``;
docs/protocol.md, Connections).

On SIGTERM the daemon starts no more requests: it answers ``unavailable`` to every
request it had read but not started and to every one waiting in its socket (until the
socket has been quiet for ``REFUSE_QUIET_MS``), finishes the ones it started, answers
those that arrived meanwhile the same way, and flushes every reply before it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import zmq

from kvstored import cuda_ipc, sigbus
from kvstored.admission import RouterAdmission, peer_uid, raise_fd_limit
from kvstored.config import DaemonConfig, check_private_dir
from kvstored.protocol import (
    BlockDelete, BlockGet, BlockLookup, BlockPut, Create, Delete, Envelope, ErrorCode, Get, Hello, ListSeqs, Lookup, OpenSeq, ProtocolError, Put, Stats,
    ErrorTally, check_deadline, error_reply, ok_reply, parse_request,
)
from kvstored.preflight import daemon_answers
from kvstored.replies import Replies
from kvstored.session_server import SessionServer
from kvstored.sessions import Session, SessionTable
from kvstored.store import Store
from kvstored.turns import FairQueue
from kvstored.writer import Writer

if TYPE_CHECKING:
    from kvstored.metrics import Metrics

log = logging.getLogger(__name__)

_DONE = "inproc://kvstored-done"
_STOP = object()
# Gets of at most this many bytes, all in DRAM, are served on the main thread.
INLINE_GET_BYTES = 8 << 20
# Per connection: requests handed to the writer or the get pool and not yet answered,
# and requests read but not yet served.
MAX_IN_FLIGHT = 64
MAX_QUEUED = 1024
# Sequences in one list reply at most (a reply is then at most about 13 KiB, as large as a
# lookup's); ``more`` says whether others follow. It bounds what unread replies pin.
LIST_PAGE = 16
# Messages read from the socket before the queues are served again.
READ_BATCH = 256
# How long replies may take to leave at shutdown.
SHUTDOWN_LINGER_MS = 5000
# At shutdown, requests still arriving are refused until the socket is quiet this long,
# for at most REFUSE_MAX_S (a client that sends on regardless cannot hold the daemon up).
REFUSE_QUIET_MS = 50
REFUSE_MAX_S = 2.0


class Server:
    def __init__(self, cfg: DaemonConfig, metrics: "Metrics | None" = None) -> None:
        self.cfg = cfg
        # Error replies by code; with --metrics, also get and put latencies (kvstored/metrics.py).
        self.errors = ErrorTally()
        self.metrics = metrics
        self._observe_get = metrics.get_latency.observe if metrics is not None else _ignore
        self._observe_put = metrics.put_latency.observe if metrics is not None else _ignore
        self.address = cfg.bind_address
        self.store = Store(cfg)
        self.cuda_ipc = cuda_ipc.probe()  # once: whether CUDA IPC buffers can be served, logged with why
        self.sessions = SessionTable(cfg.session_limits, cfg.max_mapped_bytes, self.store.gate.retire, self.cuda_ipc)
        self.store.sequences.session_open = self.sessions.is_open
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._writes = FairQueue()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(cfg.get_workers, thread_name_prefix="kvstored-get")
        self._push_lock = threading.Lock()
        self._push_sockets: list[zmq.Socket] = []
        self.writer = Writer(cfg, self.store, self._writes, self._send, self._error, self._run, self._observe_put)
        self._queues: dict[bytes, deque] = {}
        self._users: dict[bytes, int] = {}  # the uid of each connection with requests waiting (ipc)
        self._in_flight: Counter[bytes] = Counter()
        self._session_server: SessionServer | None = None
        if metrics is not None:
            metrics.watch(self)

    # ------------------------------------------------------------ life cycle

    def bind(self) -> None:
        session_path = self.cfg.session_socket_path
        check_private_dir(session_path.parent, create=True)
        if self.address.startswith("ipc://"):
            path = Path(self.address[len("ipc://"):])
            check_private_dir(path.parent, create=True)
            _refuse_live_socket(path)
        # Connection caps that fit the descriptor limit; admission is set up before the bind.
        limits = self.cfg.session_limits.connections.fit(raise_fd_limit())
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, 2 * self.cfg.max_message_bytes)
        self.replies = Replies(self.router, self.store.counters)
        self.admission = RouterAdmission(self.ctx, self.router, limits, ipc=self.address.startswith("ipc://"))
        self.router.bind(self.address)
        if self.address.startswith("ipc://"):
            os.chmod(self.address[len("ipc://"):], self.cfg.socket_mode)
        self.done = self.ctx.socket(zmq.PULL)
        self.done.bind(_DONE)
        self._identity = {"instance": self.sessions.instance, "session_socket": str(session_path),
                          "max_message_bytes": self.cfg.max_message_bytes,
                          # register may name a CUDA allocation by its IPC handle (kvstored/cuda_ipc.py)
                          "cuda_ipc": self.cuda_ipc.available}
        self._session_server = SessionServer(session_path, self.sessions, self.cfg.socket_mode, self.errors, limits)
        self._session_server.start()
        log.info("kvstored %d serving %s, sessions on %s (instance %s)", os.getpid(), self.address,
                 session_path, self.sessions.instance)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        if self._session_server is None:
            self.bind()
        self.writer.start()
        sigbus.install_soon()  # before an engine registers its pool, not on that request
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.done, zmq.POLLIN)
        while not self._stop.is_set():
            if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                log.warning("parent process %d is gone; shutting down", self.cfg.parent_pid)
                break
            servable = any(self._servable(i) for i in self._queues)
            ready = dict(poller.poll(0 if servable else self._idle_ms()))
            self.replies.flush()
            if self.done in ready:
                self._drain_replies()
            if self.router in ready:
                self._read_requests()
            self._serve_round()
        self._shutdown()

    def _shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.close()  # before the store closes under a scrape
        refused = self._refuse_not_started()
        log.info("shutting down: finishing started work, refused %d requests not started", refused)
        self._pool.shutdown(wait=True)
        self.writer.stop()
        self._drain_replies()
        # The worker threads have ended; their reply sockets close here.
        for sock in self._push_sockets:
            sock.close()
        self._drain_replies()
        late = self._refuse_not_started()  # sent while the started work finished
        if late:
            log.info("refused %d requests that arrived while shutting down", late)
        if self._session_server is not None:
            self._session_server.stop()
        # Replies already queued still leave: a client told nothing would wait out its timeout.
        dropped = self.replies.drain(SHUTDOWN_LINGER_MS / 1000)
        if dropped:
            log.info("dropped %d replies for clients that did not read them", dropped)
        self.router.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        self.router.close()
        self.done.close()
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
        self.store.close()
        self.ctx.term()
        log.info("kvstored stopped cleanly")

    def _refuse_not_started(self) -> int:
        """Answer ``unavailable`` to every request queued here or waiting in the socket; how many."""
        refused = 0
        for ident, q in self._queues.items():
            while q:
                self._refuse(ident, q.popleft())
                refused += 1
        self._queues.clear()
        self._users.clear()
        deadline = time.monotonic() + REFUSE_MAX_S
        while time.monotonic() < deadline and self.router.poll(REFUSE_QUIET_MS, zmq.POLLIN):
            for _ in range(READ_BATCH):
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._refuse(frames[0].bytes, frames[1:])
                refused += 1
        return refused

    def _refuse(self, ident: bytes, body: list) -> None:
        reply = self._error(_peek_id(body), ErrorCode.UNAVAILABLE, "kvstored is shutting down; the request did not run")
        self.replies.send([ident, *reply])

    # ------------------------------------------------------------ main thread

    def _read_requests(self) -> None:
        for _ in range(READ_BATCH):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, body = frames[0].bytes, frames[1:]
            q = self._queues.get(ident)
            if q is None:
                q = self._queues[ident] = deque()
                uid = peer_uid(body)
                if uid is not None:
                    self._users[ident] = uid
            if len(q) >= MAX_QUEUED:
                self.store.counters["requests_busy"] += 1
                self.replies.send([ident, *self._error(
                    _peek_id(body), ErrorCode.BUSY,
                    f"this connection has {len(q)} requests waiting (limit {MAX_QUEUED}); wait for replies",
                )])
                continue
            q.append(body)

    def _serve_round(self) -> None:
        """One request of each user that has one waiting on a connection with room in flight.

        A served connection that still has requests goes to the back of the queues, so the
        user's other connections come first next round."""
        idents = list(self._queues)
        served: set = set()
        for ident in idents:
            q = self._queues[ident]
            user = self._users.get(ident, ident)
            if user in served or not self._servable(ident):
                continue
            served.add(user)
            self._handle(ident, q.popleft())
            del self._queues[ident]
            if q:
                self._queues[ident] = q
            else:
                self._users.pop(ident, None)
            if len(idents) > 1:
                self._drain_replies()  # others' finished work leaves between requests, not after a round

    def _idle_ms(self) -> int:
        """How long the main loop may wait for a request or a finished reply: until the
        replies waiting for slow readers are due to be offered again (kvstored/replies.py)."""
        flush_in = self.replies.wait_s()
        return 200 if flush_in is None else max(1, int(flush_in * 1000))

    def _servable(self, ident: bytes) -> bool:
        """Whether a request of ``ident`` may start: room in flight, and its replies taken."""
        return self._in_flight[ident] < MAX_IN_FLIGHT and not self.replies.stalled(ident)

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self.done.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident = frames[0]
            self._in_flight[ident] -= 1
            if self._in_flight[ident] <= 0:
                del self._in_flight[ident]
            self.replies.send(frames)

    def _handle(self, ident: bytes, body: list) -> None:
        req_id = None
        t0 = time.perf_counter()
        try:
            env = parse_request(body, self.cfg.max_message_bytes, self.cfg.max_blocks_per_request)
            req_id, req = env.req_id, env.request
            if isinstance(req, Hello):
                self.replies.send([ident, *ok_reply(req_id, **self._hello())])
                return
            session = self.sessions.find(env.session, peer_uid(body))
            check_deadline(env)
            if isinstance(req, (Get, BlockGet)):
                # A DRAM-only get is a copy of a few MiB at most: served here, it saves
                # two thread hand-offs (to a worker, and its reply back), about half of
                # a small get's round trip on a busy host.
                served = self._get_inline(req, session)
                if served is not None:
                    reply = ok_reply(req_id, **served)
                    self.store.counters["gets_inline"] += 1
                    self._observe_get(time.perf_counter() - t0)  # before the reply: a scrape after it sees this get
                    self.replies.send([ident, *reply])
                else:
                    serve = (partial(self.store.blocks.get, req, session) if isinstance(req, BlockGet)
                             else partial(self.store.get, req, session))
                    self._in_flight[ident] += 1
                    self._pool.submit(self._run, ident, env, serve, self._observe_get, t0)
            elif isinstance(req, (Put, Create, Delete, BlockPut, BlockDelete)):
                self._in_flight[ident] += 1
                self._writes.put(session.uid, session.token, (ident, env, session, t0))
            else:
                self.replies.send([ident, *ok_reply(req_id, **self._inline(req, session))])
        except ProtocolError as exc:
            req_id = getattr(exc, "req_id", req_id)
            self.store.counters["bad_requests"] += 1
            log.debug("refused request %s: %s", req_id, exc)
            self.replies.send([ident, *self._error(req_id, exc.code, str(exc))])
        except Exception as exc:  # keep serving everyone else; the client gets the reason
            log.exception("internal error on request %s", req_id)
            self.replies.send([ident, *self._error(req_id, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")])

    def _get_inline(self, req: Get | BlockGet, session: Session) -> dict | None:
        """The reply of ``req`` served on this thread, where it is small and all in DRAM; None otherwise."""
        if isinstance(req, BlockGet):
            return self.store.blocks.get_in_dram(req, session, INLINE_GET_BYTES)
        return self.store.get(req, session) if self.store.in_dram(req, session, INLINE_GET_BYTES) else None

    def _error(self, req_id: int | None, code: ErrorCode, message: str) -> list:
        """An error reply's frames, counted by code (any thread)."""
        self.errors.add(code)
        return error_reply(req_id, code, message)

    def _hello(self) -> dict:
        return {**self.store.hello(), **self._identity}

    def _inline(self, req: object, session: Session) -> dict:
        if isinstance(req, Stats):
            return {**self.store.stats(session), "instance": self.sessions.instance, **self._session_figures(session)}
        if isinstance(req, OpenSeq):
            return self.store.open(req, session.uid)
        if isinstance(req, ListSeqs):
            return self.store.list(replace(req, limit=min(req.limit, LIST_PAGE)), session.uid)
        if isinstance(req, Lookup):
            return self.store.lookup(req, session.uid)
        if isinstance(req, BlockLookup):
            return self.store.blocks.lookup(req, session.uid)
        raise AssertionError(f"no inline handler for {type(req).__name__}")

    def _session_figures(self, session: Session) -> dict:
        """Sessions and mapped buffers: the daemon's, or only the caller's user's (docs/stats.md)."""
        if not session.sees_daemon:
            mine = self.sessions.of_uid(session.uid)
            return {"sessions": len(mine), "mapped_bytes": sum(s.buffers.mapped_bytes for s in mine),
                    "cuda_ipc": self.cuda_ipc.available}
        return {"sessions": len(self.sessions), "mapped_bytes": self.sessions.budget.used,
                "cuda_ipc": self.cuda_ipc.available, "cuda_ipc_handles": self.cuda_ipc.open_handles}

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

    def _run(self, ident: bytes, env: Envelope, fn: Callable[[], dict],
             observe: Callable[[float], None] | None = None, t0: float = 0.0) -> None:
        req_id = env.req_id
        try:
            check_deadline(env)
            reply = ok_reply(req_id, **fn())
            if observe is not None:
                observe(time.perf_counter() - t0)
            self._send([ident, *reply])
        except ProtocolError as exc:
            self._send([ident, *self._error(req_id, exc.code, str(exc))])
        except Exception as exc:
            log.exception("internal error on request %s", req_id)
            self._send([ident, *self._error(req_id, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")])


def _peek_id(body: list) -> int | None:
    """The id of a request not worth parsing in full (it is refused as a whole)."""
    try:
        return parse_request(body, 1 << 62, 1 << 62).req_id
    except ProtocolError as exc:
        return getattr(exc, "req_id", None)
    except Exception:  # noqa: BLE001 - garbage frames have no readable id
        return None


def _refuse_live_socket(path: Path) -> None:
    """The preflight check again (another daemon may have started since), then a stale socket file goes."""
    if path.exists():
        if daemon_answers(f"ipc://{path}"):
            raise RuntimeError(f"another kvstored is serving ipc://{path}; stop it or choose another --listen")
        log.info("removing stale socket %s", path)
        path.unlink()


def _ignore(_: float) -> None:
    pass


def install_signal_handlers(server: Server) -> None:
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
