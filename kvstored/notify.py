"""systemd's readiness protocol (``sd_notify``), spoken without libsystemd.

Under a unit of ``Type=notify`` systemd sets ``NOTIFY_SOCKET``; kvstored sends ``READY=1``
once it serves (store open, sockets bound), ``STATUS=`` lines while it checks the catalog
and pre-faults the DRAM tier (:class:`Progress`), ``EXTEND_TIMEOUT_USEC=`` so that a large
store or ``--dram`` does not run past the unit's start timeout, and ``STOPPING=1`` when it
stops. Without ``NOTIFY_SOCKET`` (a shell, a test, an embedded daemon) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROGRESS_S = 2.0  # how often a start-up step's progress is logged (and told to systemd)


class Progress:
    """A long start-up step, ``total`` units of work: every :data:`PROGRESS_S` seconds
    ``"{what}: {done_verb} {done} of {total}{unit} in T s, about L s left"`` is logged (to
    ``logger``) and sent to systemd with more start-up time asked for (twice the time
    left, plus 30 s), so that the unit's start timeout never ends a start that is getting
    on. ``show`` writes an amount of work."""

    def __init__(self, what: str, done_verb: str, total: int, logger: logging.Logger = log,
                 show: Callable[[int], str] = "{:,}".format, unit: str = "") -> None:
        self.what, self.verb, self.total, self.log, self.show, self.unit = what, done_verb, total, logger, show, unit
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def add(self, n: int) -> None:
        """``n`` more units done."""
        self.done += n
        now = time.monotonic()
        if now - self.last < PROGRESS_S or self.done >= self.total:
            return
        self.last = now
        left = (now - self.t0) / max(self.done, 1) * (self.total - self.done)
        status = (f"{self.what}: {self.verb} {self.show(self.done)} of {self.show(self.total)}{self.unit} in "
                  f"{now - self.t0:.0f} s, about {left:.0f} s left")
        self.log.info("%s", status)
        notify(f"STATUS={status}", f"EXTEND_TIMEOUT_USEC={int((left * 2 + 30) * 1e6)}")


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
