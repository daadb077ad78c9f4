"""What one session and its buffers may hold: plain frozen records, no I/O.

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


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 1024
    max_sessions_per_uid: int = 64
    buffers: BufferLimits = field(default_factory=BufferLimits)

    def to_dict(self) -> dict:
        return {
            "max_sessions": self.max_sessions, "max_sessions_per_uid": self.max_sessions_per_uid,
            "max_buffers": self.buffers.max_buffers, "max_buffer_bytes": self.buffers.max_bytes,
        }
