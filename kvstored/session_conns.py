"""The session socket's connections: who holds how many, and which must open a session soon.

Pure bookkeeping (no I/O) for the session socket's server thread
(kvstored/session_server.py), which alone uses it:

- :meth:`ConnectionTable.refusal` says why a new connection from a uid is refused, or
  None: past ``max_session_connections`` in all, or past the uid's own share
  (``max_session_connections_per_uid``, always less than all, so one user can never
  take every slot from the others);
- a connection that has not opened a session by its deadline is returned by
  :meth:`ConnectionTable.expired`. Deadlines come in accept order (one timeout for
  all), so they are kept in a FIFO and checked from its front, never by a scan;
- each connection has an outbox of replies its peer has not taken yet, bounded by
  :data:`MAX_OUTBOX`: the server never waits on one peer.
"""

from __future__ import annotations

import socket
from collections import Counter, deque
from dataclasses import dataclass, field

from kvstored.limits import ConnectionLimits

# Replies queued for a peer that does not read them; past this it is disconnected.
MAX_OUTBOX = 16


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    deadline: float  # time.monotonic() by which a session must be open
    session: object | None = None  # kvstored.sessions.Session once opened
    outbox: deque[bytes] = field(default_factory=deque)

    def outbox_full(self) -> bool:
        return len(self.outbox) >= MAX_OUTBOX


class ConnectionTable:
    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._by_sock: dict[socket.socket, Connection] = {}
        self._num_by_uid: Counter[int] = Counter()
        self._deadlines: deque[Connection] = deque()

    def __len__(self) -> int:
        return len(self._by_sock)

    def __iter__(self):
        return iter(list(self._by_sock.values()))

    def get(self, sock: socket.socket) -> Connection | None:
        return self._by_sock.get(sock)

    def refusal(self, uid: int) -> str | None:
        """Why a new connection from ``uid`` may not be held now, or None."""
        if len(self._by_sock) >= self.limits.max_session_connections:
            return (f"{len(self._by_sock)} session-socket connections are open "
                    f"(limit {self.limits.max_session_connections}, --max-session-connections)")
        mine = self._num_by_uid[uid]
        if mine >= self.limits.max_session_connections_per_uid:
            return (f"uid {uid} holds {mine} session-socket connections "
                    f"(limit {self.limits.max_session_connections_per_uid}, --max-session-connections-per-uid)")
        return None

    def add(self, conn: Connection) -> None:
        self._by_sock[conn.sock] = conn
        self._num_by_uid[conn.uid] += 1
        self._deadlines.append(conn)

    def remove(self, sock: socket.socket) -> Connection | None:
        conn = self._by_sock.pop(sock, None)
        if conn is not None:
            self._num_by_uid[conn.uid] -= 1
            if self._num_by_uid[conn.uid] <= 0:
                del self._num_by_uid[conn.uid]
        return conn

    def expired(self, now: float) -> list[Connection]:
        """Connections still held, past their deadline, that have not opened a session."""
        out = []
        while self._deadlines and self._deadlines[0].deadline <= now:
            conn = self._deadlines.popleft()
            if conn.session is None and self._by_sock.get(conn.sock) is conn:
                out.append(conn)
        return out

    def next_deadline(self) -> float | None:
        return self._deadlines[0].deadline if self._deadlines else None
