"""Replies on the ROUTER socket, sent without ever waiting on a peer, and bounded per
connection however little the peer reads.

libzmq queues at most ``REPLY_HWM`` replies for one connection (its send high-water
mark, ``ZMQ_SNDHWM``; the default of 1,000, with list replies of up to 1,000 sequences,
let one connection that never read pin hundreds of MiB). A reply libzmq cannot take now waits in the connection's backlog here,
and :meth:`Replies.flush` offers the backlog again on every turn of the main loop; while
a connection has a backlog it is *stalled*: the server serves none of its requests
(kvstored/server.py), so it makes no new replies but those of requests already in flight
(at most ``MAX_IN_FLIGHT``) and the ``busy`` replies of requests past those it may have
waiting. A reply that would take a backlog past ``MAX_BACKLOG_BYTES`` is dropped and
counted (``replies_dropped``; the first is logged, then one warning per ``DROP_LOG_S``);
one for a peer that has gone is dropped and counted as ``replies_unrouted``.

A client that reads its replies, however many requests it sends at once, loses none:
a burst past ``REPLY_HWM`` (a thousand ``busy`` or ``unavailable`` replies of ~150 bytes
at most, or the replies of the requests it had in flight) waits here until libzmq has
passed the first ones on to the kernel and the client. One that never reads pins at most
``REPLY_HWM`` replies in libzmq (the largest, a list or lookup reply, is about 13 KiB:
server.py, ``LIST_PAGE``) and ``MAX_BACKLOG_BYTES`` here; docs/protocol.md, Connections,
gives the bound per uid.

Threading: only the thread that owns the ROUTER socket (the main thread) uses this.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import zmq

log = logging.getLogger(__name__)

# Replies libzmq holds for one connection (ZMQ_SNDHWM). Fewer cost a client that pipelines:
# libzmq's I/O thread lags a burst by a few hundred replies, and one past the mark waits
# here (measured: 1,000 pipelined lookups took 50 ms at 256 or 1,000, 250-600 ms at 16 or 64).
REPLY_HWM = 256
# Bytes of replies waiting here for one connection: room for a ``busy`` or ``unavailable``
# reply to each request it may have waiting (server.py, MAX_QUEUED) and those in flight.
MAX_BACKLOG_BYTES = 256 << 10
# Seconds between warnings about dropped replies.
DROP_LOG_S = 10.0
# How soon the backlogs are offered again while the daemon waits on nothing else: every
# millisecond while they drain, and for ``PATIENT_FLUSHES`` times after they last did (a
# reader that fell behind catches up in a few), then less and less often while no peer
# takes any (one that never reads costs the daemon a few attempts a second).
FLUSH_S = 0.001
PATIENT_FLUSHES = 50
MAX_FLUSH_S = 0.05


class Replies:
    """Sends replies (frames: the peer's identity, then the reply) on ``router``."""

    def __init__(self, router: zmq.Socket, counters: Counter) -> None:
        router.setsockopt(zmq.SNDHWM, REPLY_HWM)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply libzmq cannot queue is told, not lost
        self._router = router
        self._counters = counters
        self._backlogs: dict[bytes, deque[tuple[list, int]]] = {}  # (frames, bytes)
        self._backlog_bytes: Counter[bytes] = Counter()
        self._next_warning = 0.0
        self._wait = FLUSH_S
        self._idle_flushes = 0

    def stalled(self, ident: bytes) -> bool:
        """Whether replies to ``ident`` are waiting here (its peer is behind in reading them)."""
        return ident in self._backlogs

    def send(self, frames: list) -> None:
        ident = bytes(frames[0])
        backlog = self._backlogs.get(ident)
        if backlog is None:
            sent = self._try(frames)
            if sent:
                return
            if sent is not None:
                self._drop("replies_unrouted")
                return
            backlog = self._backlogs[ident] = deque()
        nbytes = sum(len(f) if isinstance(f, (bytes, zmq.Frame)) else memoryview(f).nbytes for f in frames)
        if self._backlog_bytes[ident] + nbytes > MAX_BACKLOG_BYTES and backlog:
            self._drop("replies_dropped")
            return
        backlog.append((frames, nbytes))
        self._backlog_bytes[ident] += nbytes

    def wait_s(self) -> float | None:
        """How long the daemon may wait before the next :meth:`flush`; None with no backlog."""
        return self._wait if self._backlogs else None

    def flush(self) -> None:
        """Offer each backlog to libzmq again, oldest reply first."""
        moved = False
        for ident in list(self._backlogs):
            backlog = self._backlogs[ident]
            while backlog:
                sent = self._try(backlog[0][0])
                if sent is None:
                    break
                moved = True
                self._backlog_bytes[ident] -= backlog.popleft()[1]
                if not sent:  # the peer has gone: so have the replies waiting for it
                    self._drop("replies_unrouted", 1 + len(backlog))
                    backlog.clear()
            if not backlog:
                del self._backlogs[ident]
                del self._backlog_bytes[ident]
        self._idle_flushes = 0 if moved else self._idle_flushes + 1
        self._wait = FLUSH_S if self._idle_flushes < PATIENT_FLUSHES else min(2 * self._wait, MAX_FLUSH_S)

    def drain(self, timeout: float) -> int:
        """At shutdown: flush until nothing waits or ``timeout`` seconds have passed, then
        drop what still waits (for peers that do not read); how many were dropped."""
        deadline = time.monotonic() + timeout
        self.flush()
        while self._backlogs and time.monotonic() < deadline:
            time.sleep(FLUSH_S)
            self.flush()
        num = sum(len(b) for b in self._backlogs.values())
        if num:
            self._drop("replies_dropped", num)
        self._backlogs.clear()
        self._backlog_bytes.clear()
        return num

    def _try(self, frames: list) -> bool | None:
        """True if sent, False if the peer has gone, None if libzmq has no room for it now."""
        for attempt in range(2):
            try:
                self._router.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.Again:
                # libzmq learns that its I/O thread has taken replies from a pipe only as it
                # processes its commands, which reading ZMQ_EVENTS makes it do: then once more.
                if attempt == 0:
                    self._router.getsockopt(zmq.EVENTS)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                return False
        return None

    def _drop(self, counter: str, num: int = 1) -> None:
        self._counters[counter] += num
        now = time.monotonic()
        if counter == "replies_dropped" and now >= self._next_warning:
            self._next_warning = now + DROP_LOG_S
            log.warning("dropping replies to a ZeroMQ client that does not read them (%d waiting for it in libzmq, "
                        "%d KiB here); %d dropped so far", REPLY_HWM, MAX_BACKLOG_BYTES >> 10, self._counters[counter])
