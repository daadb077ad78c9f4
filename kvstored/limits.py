"""What one session and its buffers may hold, and how many clients may connect: plain
frozen records, no I/O.

They live apart from kvstored/sessions.py and kvstored/buffers.py so that the
command line (kvstored/cli.py) can build a :class:`~kvstored.config.DaemonConfig`
without importing numpy or numba: ``kvstored --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BufferLimits:
    """What one session may register (see docs/protocol.md, Limits)."""

    max_buffers: int = 64
    max_bytes: int = 256 << 30


# Descriptors kept for everything but client connections: the store's files, LMDB, the
# memfds a register is mapping, libzmq's own, and the handshakes of connections being refused.
RESERVED_FDS = 64


@dataclass(frozen=True)
class ConnectionLimits:
    """How many clients may be connected at once (see docs/protocol.md, Connections).

    ``max_connections`` counts ZeroMQ connections, the ``session`` ones the session socket's.
    On either socket a uid may hold fewer connections than there are, so one user can
    never take every slot (a ZeroMQ share above half of ``max_connections`` is lowered to
    that half by :meth:`fit`); a connection that has not opened a session within
    ``session_open_timeout`` seconds is closed.
    """

    max_connections: int = 4096
    max_connections_per_uid: int = 128
    max_session_connections: int = 1088
    max_session_connections_per_uid: int = 128
    session_open_timeout: int = 10

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_uid", "max_session_connections",
                     "max_session_connections_per_uid", "session_open_timeout"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_session_connections_per_uid >= self.max_session_connections:
            raise ValueError(
                f"--max-session-connections-per-uid ({self.max_session_connections_per_uid}) must be less than "
                f"--max-session-connections ({self.max_session_connections}), so other users always have room")

    def fit(self, fd_limit: int) -> ConnectionLimits:
        """These limits lowered so that both kinds of connection together use at most half of
        the descriptors past :data:`RESERVED_FDS`: running out of descriptors aborts libzmq
        (its ipc accept() treats EMFILE as a bug), so the caps must bind long before it."""
        share = max(2, (fd_limit - RESERVED_FDS) // 4)
        zmq_cap = min(self.max_connections, share)
        session = min(self.max_session_connections, share)
        return ConnectionLimits(
            max_connections=zmq_cap,
            max_connections_per_uid=min(self.max_connections_per_uid, zmq_cap // 2 or 1),
            max_session_connections=session,
            max_session_connections_per_uid=min(self.max_session_connections_per_uid, session // 2 or 1),
            session_open_timeout=self.session_open_timeout,
        )


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 1024
    max_sessions_per_uid: int = 64
    buffers: BufferLimits = field(default_factory=BufferLimits)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def to_dict(self) -> dict:
        return {
            "max_sessions": self.max_sessions, "max_sessions_per_uid": self.max_sessions_per_uid,
            "max_buffers": self.buffers.max_buffers, "max_buffer_bytes": self.buffers.max_bytes,
        }
