"""Who may hold a ZeroMQ connection to the daemon, and as whom it speaks.

Every connection costs the daemon a descriptor, and libzmq aborts the whole process
when an ipc accept() fails with EMFILE (its listener asserts on that errno). So the
daemon raises its own soft ``RLIMIT_NOFILE`` to the hard limit at start
(:func:`raise_fd_limit`) and caps its connections well below it
(:meth:`~kvstored.limits.ConnectionLimits.fit`).

libzmq has no option that caps a listener's connections; what it offers, and what is
used here:

- a socket monitor reports ``EVENT_ACCEPTED`` and ``EVENT_DISCONNECTED``, each with the
  connection's descriptor: the set of descriptors accepted and not yet disconnected is
  the number of connections held, whatever ended them (a close, a failed handshake, a
  timeout);
- ZAP (RFC 27) lets a handler refuse a connection during its handshake, also for the
  NULL mechanism once the ROUTER has a ZAP domain. The handler refuses every connection
  past ``max_connections``, or past ``max_connections_per_uid`` of its uid; libzmq then
  closes it, freeing its descriptor at once instead of holding it as long as the peer
  does;
- a burst is accepted faster than handshakes reach ZAP (a test of 1,100 connections at
  once had 980 accepted before the first refusal), so a connection whose
  ``EVENT_ACCEPTED`` finds a cap full is also shut down at once (``shutdown(2)``, which
  makes libzmq close it; :meth:`RouterAdmission._brake`). 4,000 connections at once
  against a limit of 1,024 descriptors then held at most about 500. The uid an ipc
  connection counts against is read from its descriptor (``SO_PEERCRED``) when it is
  accepted, so one user's burst fills that user's share only, and a connection shut
  down here stops counting at once (its descriptor is libzmq's to close);
- ``ZMQ_HANDSHAKE_IVL`` bounds how long a connection that never sends its greeting (and
  so never reaches ZAP) holds a descriptor.

Closing a descriptor libzmq owns from another thread would race with its reuse; a
shutdown is made only after checking the number is still a socket of this listener, and
ZAP stays libzmq's own way to say no (the refused peer is told why). Neither makes a
descriptor limit safe on its own: a burst larger than the descriptors left can still
abort libzmq, which is why the limit is raised first.

ZAP also gives the peer's credentials of an ipc connection: libzmq reads SO_PEERCRED
and passes an address ending in ``:UID:GID:PID``. The handler returns the uid as the
connection's ZAP user id, which libzmq attaches to every message from it (the
``User-Id`` property), so a session token is honoured only from its session's uid
(:func:`peer_uid`). A TCP connection has no credentials: its user id is empty and the
token alone decides.

Threading: one thread (``kvstored-admission``) owns the ZAP socket and the monitor;
nothing else touches them.
"""

from __future__ import annotations

import logging
import resource
import socket
import struct
import threading
import time
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvstored.limits import ConnectionLimits

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvstored"
# How long a connection may take to finish its ZeroMQ handshake (local clients send it at once).
HANDSHAKE_MS = 3000
# Seconds between warnings about refused connections.
REFUSAL_LOG_S = 10.0
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# struct ucred, as getsockopt(SO_PEERCRED) returns it: pid, uid, gid.
PEERCRED = struct.Struct("3i")


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        log.info("descriptor limit (RLIMIT_NOFILE) is %d", soft)
        return soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the descriptor limit from %d to %d (%s); connections are capped to fit %d",
                    soft, target, exc, soft)
        return soft
    log.info("descriptor limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
    return target


def peer_uid(frames: list) -> int | None:
    """The uid libzmq attached to a message's connection (ipc), or None (TCP, or unknown)."""
    try:
        text = frames[0].get("User-Id")
    except (AttributeError, IndexError, zmq.ZMQError):
        return None
    return int(text) if text and text.isdigit() else None


class RouterAdmission:
    """Caps a ROUTER socket's connections, in all and per uid, and names each ipc
    connection's uid (see above).

    Construct it before the socket binds: libzmq asks the ZAP handler only if one is
    bound when a handshake starts, and without one it lets every connection in.
    """

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, limits: ConnectionLimits, ipc: bool) -> None:
        self.limits = limits
        self._ipc = ipc
        self.refused = 0
        self.peak = 0  # the most connections held at once
        self._next_warning = 0.0
        # Connections accepted and not yet disconnected: the uid of each that counts against
        # the caps (None over TCP), and those shut down past a cap, whose descriptors libzmq
        # has yet to close.
        self._live: dict[int, int | None] = {}
        self._num_by_uid: Counter[int] = Counter()
        self._braked: set[int] = set()
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self._monitor = router.get_monitor_socket(_EVENTS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstored-admission", daemon=True)
        self._thread.start()
        log.info("connections: at most %d on ZeroMQ (%d per uid), %d on the session socket (%d per uid), sessions "
                 "opened within %d s", limits.max_connections, limits.max_connections_per_uid,
                 limits.max_session_connections, limits.max_session_connections_per_uid, limits.session_open_timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        """Until stopped, or until the context terminates (the daemon's shutdown): then the
        sockets close here, as ``zmq.Context.term`` waits for them."""
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(200))
                    self._drain_monitor()  # before a decision: the count must include the asker
                    if self._zap in ready:
                        self._answer(self._zap.recv_multipart())
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        return
                    log.warning("connection admission: %s; carrying on", exc)
                except Exception:  # without this thread no handshake would ever finish again
                    log.exception("connection admission: internal error; carrying on")
        finally:
            self._zap.close()
            self._monitor.close()

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd, event["endpoint"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._forget(fd)

    def _accepted(self, fd: int, endpoint: bytes) -> None:
        self._forget(fd)  # a number libzmq closed and reused before its disconnect was read
        uid = self._peer_uid(fd, endpoint) if self._ipc else None
        self._live[fd] = uid
        if uid is not None:
            self._num_by_uid[uid] += 1
        self.peak = max(self.peak, len(self._live) + len(self._braked))
        why = self.refusal(uid)
        if why is not None:
            self._brake(fd, endpoint, why)

    def _forget(self, fd: int) -> None:
        self._braked.discard(fd)
        if fd in self._live:
            uid = self._live.pop(fd)
            if uid is not None:
                self._num_by_uid[uid] -= 1
                if self._num_by_uid[uid] <= 0:
                    del self._num_by_uid[uid]

    def refusal(self, uid: int | None) -> str | None:
        """Why the connections held (the asker's included) are past a cap, or None."""
        if len(self._live) > self.limits.max_connections:
            return f"{len(self._live)} held (limit {self.limits.max_connections}, --max-connections)"
        mine = self._num_by_uid[uid] if uid is not None else 0
        if mine > self.limits.max_connections_per_uid:
            return f"uid {uid} holds {mine} (limit {self.limits.max_connections_per_uid}, --max-connections-per-uid)"
        return None

    def _peer_uid(self, fd: int, endpoint: bytes) -> int | None:
        """The uid of the ipc peer on ``fd``, if ``fd`` is still a connection of this listener."""
        try:
            sock = socket.socket(fileno=fd)  # wraps the number, no new descriptor; detached below
        except OSError:
            return None  # closed since, and not a socket now
        try:
            if not _is_endpoint(sock, endpoint):
                return None
            _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            return uid
        except OSError:
            return None
        finally:
            sock.detach()

    def _brake(self, fd: int, endpoint: bytes, why: str) -> None:
        """Shut down a connection accepted past a cap, before its handshake.

        A burst of connections is accepted faster than their handshakes reach ZAP, and each
        holds a descriptor until refused; shutting one down here makes libzmq close it at
        once. The descriptor is libzmq's and may have been closed and its number reused
        since the event was sent: it is shut down only if it is still a socket of this
        listener. At worst that is a newer connection (one its peer's ZeroMQ reconnects);
        never a file, the session socket or anything else of the daemon's.
        """
        try:
            sock = socket.socket(fileno=fd)  # wraps the number, no new descriptor; detached below
        except OSError:
            return  # closed since, and not a socket now
        try:
            if _is_endpoint(sock, endpoint):
                sock.shutdown(socket.SHUT_RDWR)
                # Going: it no longer takes a place under the caps (its descriptor goes soon).
                self._forget(fd)
                self._braked.add(fd)
                self._note_refusal(why)
        except OSError as exc:
            log.debug("connection admission: cannot shut down descriptor %d: %s", fd, exc)
        finally:
            sock.detach()

    def _note_refusal(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now >= self._next_warning:  # a flood is told of every REFUSAL_LOG_S, not per connection
            self._next_warning = now + REFUSAL_LOG_S
            log.warning("refusing ZeroMQ connections: %s; at most %d held so far, %d refused so far",
                        why, self.peak, self.refused)

    def _answer(self, request: list[bytes]) -> None:
        """One ZAP request: version, request id, domain, address, identity, mechanism[, credentials]."""
        if len(request) < 6:  # not from libzmq; answered all the same, as a REP socket must
            log.warning("connection admission: a ZAP request of %d frames; refused", len(request))
            self._zap.send_multipart([b"1.0", request[1] if len(request) > 1 else b"", b"400", b"bad request", b"", b""])
            return
        version, request_id, address = request[0], request[1], request[3]
        user_id = _uid_of(address) if self._ipc else b""
        why = self.refusal(int(user_id) if user_id else None)
        if why is not None:
            self._note_refusal(why)
            self._zap.send_multipart([version, request_id, b"400", b"too many connections", b"", b""])
            return
        self._zap.send_multipart([version, request_id, b"200", b"OK", user_id, b""])


def _is_endpoint(sock: socket.socket, endpoint: bytes) -> bool:
    """Whether ``sock`` was accepted on ``endpoint`` (``ipc://PATH``, ``tcp://HOST:PORT``)."""
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        path = name.encode() if isinstance(name, str) else name
        return endpoint == b"ipc://" + path
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        return endpoint.startswith(b"tcp://") and endpoint.rsplit(b":", 1)[-1] == str(name[1]).encode()
    return False


def _uid_of(address: bytes) -> bytes:
    """The uid of an ipc peer's ZAP address (``[HOST]:UID:GID:PID``); empty for TCP."""
    parts = address.rsplit(b":", 3)
    if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit() and parts[3].isdigit():
        return parts[1]
    return b""
