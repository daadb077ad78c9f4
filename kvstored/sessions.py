"""Client sessions: who a request comes from, and what it may touch.

A client opens a session on the daemon's *session socket*, a Unix SOCK_SEQPACKET
socket beside the ZeroMQ one. The kernel tells the daemon the client's pid, uid and
gid (SO_PEERCRED); nothing the client says about itself is believed. The daemon
answers with a random 16-byte token that the client puts in every ZeroMQ request,
and with its instance id (random per daemon start), so a client can tell a
restarted daemon from the one it knew.

On the session socket a client also registers its buffers: it sends a memfd as a
file descriptor (SCM_RIGHTS), or a CUDA allocation's IPC handle, and gets a buffer id
valid in this session only (kvstored/buffers.py, kvstored/cuda_ipc.py). When the
client closes the socket or dies, the kernel closes it too: the session ends, its
token stops working and its buffers are unmapped (CUDA IPC handles closed). So
a dead client's resources never outlive it, and a request queued by a client that
gave up (a ghost request replayed after a reconnect) names a token that no longer
exists and is refused.

A session token is honoured from its session's uid only, where the transport says who
sends a request (the ipc socket: kvstored/admission.py); over TCP the token alone counts.

Connections are capped in all and per uid (one user never holds every slot), one that
has not opened a session within ``--session-open-timeout`` is closed, and no peer can
make the thread wait: replies it does not read queue up to a bound, then it is
disconnected (kvstored/session_server.py, kvstored/session_conns.py).

Access model: a session acts for its uid. Sequences belong to the uid that created
them (every lookup by name or uid is scoped to it), and buffers to the session
that registered them. What a session is told of the daemon's activity is its own
(``stats``), unless its uid is root's or the daemon's (:attr:`Session.sees_daemon`,
docs/stats.md). See docs/protocol.md.

Threading: one thread (``kvstored-sessions``, kvstored/session_server.py) owns the
listening socket and every session connection. ``SessionTable`` lookups run on any
thread under its lock.

Messages on the session socket: one msgpack map per packet (at most
:data:`kvstored.session_server.MAX_PACKET` bytes), request then reply, in order:

- ``{"v": 1, "op": "open"}`` -> ``{"ok": true, "token", "instance", "uid", "limits"}``
- ``{"v": 1, "op": "register", "kind": "memfd", "size": N}`` with one descriptor ->
  ``{"ok": true, "buf", "size", "kind"}`` (``kind`` may be left out, or be ``"shm"``)
- ``{"v": 1, "op": "register", "kind": "cuda_ipc", "handle": <64 bytes>, "device",
  "offset", "size"}`` without a descriptor -> ``{"ok": true, "buf", "size", "kind"}``
  (kvstored/cuda_ipc.py; ``cuda_unavailable`` where the daemon has no usable CUDA device)
- ``{"v": 1, "op": "unregister", "buf": ID}`` -> ``{"ok": true}``

Errors are ``{"ok": false, "code", "error"}`` with the codes of kvstored.protocol.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvstored.buffers import BufferRegistry, MappedBudget, MappedBuffer
from kvstored.cuda_ipc import CudaIpc, unavailable
from kvstored.limits import SessionLimits
from kvstored.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)


@dataclass
class Session:
    token: bytes
    pid: int
    uid: int
    gid: int
    buffers: BufferRegistry
    opened: float = field(default_factory=time.time)

    def __repr__(self) -> str:
        return f"Session(pid={self.pid}, uid={self.uid})"

    @property
    def sees_daemon(self) -> bool:
        """Whether this session is told daemon-wide figures (root, or the daemon's own uid),
        rather than its user's own."""
        return self.uid in (0, os.geteuid())


class SessionTable:
    """Sessions by token. ``retire`` unmaps a buffer once no reader can still use it."""

    def __init__(self, limits: SessionLimits, max_mapped_bytes: int, retire: Callable[[Callable[[], None]], None],
                 cuda: CudaIpc | None = None) -> None:
        self.limits = limits
        # CUDA IPC registrations: the start-up probe's outcome (kvstored/cuda_ipc.py).
        self.cuda = cuda if cuda is not None else unavailable("CUDA IPC was not probed")
        self.instance = secrets.token_hex(8)
        self.budget = MappedBudget(max_mapped_bytes)
        self._retire = retire
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Session] = {}

    def open(self, pid: int, uid: int, gid: int) -> Session:
        with self._lock:
            if len(self._by_token) >= self.limits.max_sessions:
                raise ProtocolError(ErrorCode.BUSY, f"{len(self._by_token)} sessions are open (limit {self.limits.max_sessions})")
            mine = sum(1 for s in self._by_token.values() if s.uid == uid)
            if mine >= self.limits.max_sessions_per_uid:
                raise ProtocolError(
                    ErrorCode.BUSY, f"uid {uid} has {mine} sessions open (limit {self.limits.max_sessions_per_uid} per user)",
                )
            session = Session(secrets.token_bytes(16), pid, uid, gid, BufferRegistry(self.limits.buffers, self.budget, uid))
            self._by_token[session.token] = session
        log.info("session opened: pid %d uid %d", pid, uid)
        return session

    def find(self, token: bytes | None, uid: int | None = None) -> Session:
        """The session of ``token``; with ``uid`` (the peer's, where the transport tells it),
        only if that session is that uid's: a token copied to another user opens nothing."""
        session = self._by_token.get(token) if token is not None else None
        if session is not None and uid is not None and uid != session.uid:
            log.debug("a session token of uid %d was presented by uid %d; refused", session.uid, uid)
            session = None
        if session is None:
            raise ProtocolError(
                ErrorCode.SESSION,
                f"no open session with this token on kvstored instance {self.instance} (the session ended, or the "
                f"daemon restarted): open a new session and register the buffers again",
            )
        return session

    def is_open(self, token: bytes) -> bool:
        return token in self._by_token

    def close(self, session: Session) -> None:
        with self._lock:
            if self._by_token.pop(session.token, None) is None:
                return
        buffers = session.buffers.take_all()
        for mb in buffers:
            self.retire_buffer(session, mb)
        log.info("session closed: pid %d uid %d, %d buffers unmapped", session.pid, session.uid, len(buffers))

    def retire_buffer(self, session: Session, mb: MappedBuffer) -> None:
        self._retire(lambda: session.buffers.close_mapping(mb))

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._by_token.values())
        for s in sessions:
            self.close(s)

    def __len__(self) -> int:
        return len(self._by_token)

    def of_uid(self, uid: int) -> list[Session]:
        """The sessions of ``uid`` open now."""
        with self._lock:
            return [s for s in self._by_token.values() if s.uid == uid]

    def buffer_count(self) -> int:
        """Buffers registered now, all sessions (their bytes: ``budget.used``)."""
        with self._lock:
            sessions = list(self._by_token.values())
        return sum(len(s.buffers) for s in sessions)
