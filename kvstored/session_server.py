"""The session socket's server thread (``kvstored-sessions``): the protocol is described in
kvstored/sessions.py, the limits in docs/protocol.md (Connections).

It owns the listening socket and every connection; sessions it opens live in the
:class:`~kvstored.sessions.SessionTable`, which any thread may read.
"""

from __future__ import annotations

import array
import logging
import os
import selectors
import socket
import struct
import threading
import time
from pathlib import Path

import msgpack

from kvstored.limits import ConnectionLimits
from kvstored.protocol import (
    PROTOCOL_VERSION, ErrorCode, ErrorTally, ProtocolError, RegisterCudaIpc, RegisterPool, parse_register,
)
from kvstored.session_conns import Connection, ConnectionTable
from kvstored.sessions import Session, SessionTable

log = logging.getLogger(__name__)

MAX_PACKET = 4096
# Connections accepted per wake-up before the others' requests are served again.
ACCEPT_BATCH = 64
# The longest pause in accepting after accept() failed (out of descriptors, say).
MAX_ACCEPT_BACKOFF = 1.0
# Seconds between warnings about refused connections.
REFUSAL_LOG_S = 10.0
_UCRED = struct.Struct("3i")  # pid, uid, gid


class SessionServer:
    """The session socket: accepts connections, opens sessions, takes buffer descriptors.

    It never waits on one peer: every socket is non-blocking, a reply the peer's queue
    cannot take yet waits in the connection's bounded outbox (kvstored/session_conns.py),
    and a peer whose outbox is full is disconnected. Connections are capped in all and
    per uid, and one that has not opened a session in time is closed. An error of
    accept() (out of descriptors, say) pauses accepting for a moment, with a warning;
    nothing that happens on a connection ends the thread.
    """

    def __init__(self, path: Path, table: SessionTable, mode: int, errors: ErrorTally | None = None,
                 limits: ConnectionLimits | None = None) -> None:
        self.path = path
        self.table = table
        self.errors = errors if errors is not None else ErrorTally()
        self._conns = ConnectionTable(limits if limits is not None else table.limits.connections)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path.unlink(missing_ok=True)
        self._listener.bind(str(path))
        os.chmod(path, mode)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._accept_backoff = 0.0
        self._accept_resume: float | None = None
        self.accept_errors = 0
        self.refused = 0
        self._next_warning = 0.0
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvstored-sessions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        for conn in self._conns:
            self._drop(conn)
        self._sel.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.path.unlink(missing_ok=True)

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._step()
            except Exception:  # one connection's surprise must not end every client's sessions
                log.exception("session socket: internal error; carrying on")
                time.sleep(0.05)  # a fault that repeats must not spin the thread

    def _step(self) -> None:
        for key, mask in self._sel.select(self._select_timeout()):
            if key.data == "wake":
                continue
            if key.fileobj is self._listener:
                self._accept()
                continue
            conn = self._conns.get(key.fileobj)  # type: ignore[arg-type]
            if conn is not None and mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if conn is not None and mask & selectors.EVENT_READ and self._conns.get(conn.sock) is conn:
                self._serve(conn)
        now = time.monotonic()
        for conn in self._conns.expired(now):
            log.debug("session socket: pid %d uid %d opened no session in %d s (--session-open-timeout); closed",
                      conn.pid, conn.uid, self._conns.limits.session_open_timeout)
            self._drop(conn)
        if self._accept_resume is not None and now >= self._accept_resume:
            self._accept_resume = None
            self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _select_timeout(self) -> float:
        now = time.monotonic()
        wake = [t for t in (self._conns.next_deadline(), self._accept_resume) if t is not None]
        return max(0.0, min([1.0, *(t - now for t in wake)]))

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                self._pause_accepting(exc)
                return
            self._accept_backoff = 0.0
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError as exc:
            log.debug("session socket: a connection ended before it was admitted: %s", exc)
            sock.close()
            return
        reason = self._conns.refusal(uid)
        if reason is not None:
            self._note_refusal(pid, uid, reason)
            try:  # the reason, if the peer's queue takes it now; never waited for
                sock.send(msgpack.packb(_error(ErrorCode.BUSY, reason), use_bin_type=True))
            except OSError as exc:  # a refused peer that cannot take one packet learns from the close alone
                log.debug("session socket: the refusal was not sent: %s", exc)
            sock.close()
            return
        self._conns.add(Connection(sock, pid, uid, gid, time.monotonic() + self._conns.limits.session_open_timeout))
        self._sel.register(sock, selectors.EVENT_READ, "conn")

    def _note_refusal(self, pid: int, uid: int, reason: str) -> None:
        self.errors.add(ErrorCode.BUSY)
        self.refused += 1
        now = time.monotonic()
        if now >= self._next_warning:  # a flood is told of every REFUSAL_LOG_S, not per connection
            self._next_warning = now + REFUSAL_LOG_S
            log.warning("session socket: refused pid %d uid %d (%s); %d refused so far", pid, uid, reason, self.refused)

    def _pause_accepting(self, exc: OSError) -> None:
        """Stop accepting for a while (doubling up to a second): retrying at once would spin
        while descriptors are short; connections wait in the listen backlog meanwhile."""
        self.accept_errors += 1
        self._accept_backoff = min(MAX_ACCEPT_BACKOFF, max(0.05, 2 * self._accept_backoff))
        log.warning("session socket: accept failed (%s), %d times so far; accepting again in %.2f s",
                    exc, self.accept_errors, self._accept_backoff)
        self._sel.unregister(self._listener)
        self._accept_resume = time.monotonic() + self._accept_backoff

    def _drop(self, conn: Connection) -> None:
        if self._conns.remove(conn.sock) is None:
            return
        self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn.session is not None:
            self.table.close(conn.session)

    def _send(self, conn: Connection, packet: bytes) -> None:
        if not conn.outbox:
            try:
                conn.sock.send(packet)
                return
            except BlockingIOError:
                self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, "conn")
            except OSError as exc:
                log.info("session client pid %d unreachable (%s); closing its session", conn.pid, exc)
                self._drop(conn)
                return
        if conn.outbox_full():
            log.warning("session client pid %d uid %d left %d replies unread; closing its session",
                        conn.pid, conn.uid, len(conn.outbox))
            self._drop(conn)
            return
        conn.outbox.append(packet)

    def _flush(self, conn: Connection) -> None:
        while conn.outbox:
            try:
                conn.sock.send(conn.outbox[0])
            except BlockingIOError:
                return
            except OSError as exc:
                log.info("session client pid %d unreachable (%s); closing its session", conn.pid, exc)
                self._drop(conn)
                return
            conn.outbox.popleft()
        self._sel.modify(conn.sock, selectors.EVENT_READ, "conn")

    def _serve(self, conn: Connection) -> None:
        fds: list[int] = []
        try:
            msg, fds, flags = _recv_with_fds(conn.sock)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("session socket read failed: %s", exc)
            self._drop(conn)
            return
        try:
            if not msg:
                self._drop(conn)  # EOF: the client closed its session, or died
                return
            if flags & socket.MSG_CTRUNC or flags & socket.MSG_TRUNC:
                reply = _error(ErrorCode.TOO_LARGE, f"a session message is at most {MAX_PACKET} bytes with one descriptor")
            else:
                reply = self._handle(conn, msg, fds)
            if not reply["ok"]:
                self.errors.add(reply["code"])
            self._send(conn, msgpack.packb(reply, use_bin_type=True))
        finally:
            for fd in fds:
                os.close(fd)

    def _handle(self, conn: Connection, msg: bytes, fds: list[int]) -> dict:
        try:
            req = msgpack.unpackb(msg, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            return _error(ErrorCode.BAD_MESSAGE, f"session message is not msgpack: {exc.__class__.__name__}")
        if not isinstance(req, dict):
            return _error(ErrorCode.BAD_MESSAGE, "a session message must be a msgpack map")
        v = req.get("v")
        if not isinstance(v, int) or isinstance(v, bool) or v != PROTOCOL_VERSION:
            return _error(ErrorCode.BAD_VERSION, f"protocol version {v!r:.32} is not {PROTOCOL_VERSION}")
        op = req.get("op")
        session = conn.session
        try:
            if op == "open":
                if session is not None:
                    raise ProtocolError(ErrorCode.EXISTS, "this connection already has a session")
                session = conn.session = self.table.open(conn.pid, conn.uid, conn.gid)
                return {"v": PROTOCOL_VERSION, "ok": True, "token": session.token, "instance": self.table.instance,
                        "uid": conn.uid, "pid": os.getpid(), "limits": self.table.limits.to_dict()}
            if session is None:
                raise ProtocolError(ErrorCode.SESSION, "open a session first ({'op': 'open'})")
            if op == "register":
                return self._register(session, req, fds)
            if op == "unregister":
                buf = req.get("buf")
                if not isinstance(buf, int) or isinstance(buf, bool):
                    raise ProtocolError(ErrorCode.BAD_FIELD, "field 'buf' must be an integer")
                mb = session.buffers.unregister(buf)
                self.table.retire_buffer(session, mb)
                return {"v": PROTOCOL_VERSION, "ok": True}
            raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown session op {op!r:.64}")
        except ProtocolError as exc:
            return _error(exc.code, str(exc))
        except Exception as exc:  # keep serving everyone else; the client gets the reason
            log.exception("internal error on a session request")
            return _error(ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")

    def _register(self, session: Session, req: dict, fds: list[int]) -> dict:
        spec = parse_register(req, len(fds))
        if isinstance(spec, RegisterCudaIpc):
            mb = session.buffers.register_cuda(spec, self.table.cuda)
        elif isinstance(spec, RegisterPool):
            mb = session.buffers.register_pool(fds[0], spec.size)
        else:
            mb = session.buffers.register_fd(fds[0], spec.size)
        return {"v": PROTOCOL_VERSION, "ok": True, "buf": mb.buf_id, "size": mb.size, "kind": mb.kind}


def _error(code: ErrorCode, message: str) -> dict:
    return {"v": PROTOCOL_VERSION, "ok": False, "code": code.value, "error": message}


def _recv_with_fds(conn: socket.socket) -> tuple[bytes, list[int], int]:
    fds = array.array("i")
    msg, ancdata, flags, _ = conn.recvmsg(MAX_PACKET, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags
