"""systemd's readiness protocol (``sd_notify``), spoken without libsystemd.

Under a unit of ``Type=notify`` systemd sets ``NOTIFY_SOCKET``; kvstored sends ``READY=1``
once it serves (store open, sockets bound), ``STATUS=`` lines while it pre-faults the DRAM
tier, ``EXTEND_TIMEOUT_USEC=`` so that a large ``--dram`` does not run past the unit's
start timeout, and ``STOPPING=1`` when it stops. Without ``NOTIFY_SOCKET`` (a shell, a
test, an embedded daemon) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send ``fields`` (``KEY=value``) to systemd; whether a socket took them."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(fields).encode(), path)
    except OSError as exc:
        log.warning("cannot tell systemd %s (NOTIFY_SOCKET %s): %s", fields[0], os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True
