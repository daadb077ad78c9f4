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

Access model: a session acts for its uid. Sequences belong to the uid that created
them (every lookup by name or uid is scoped to it), and buffers to the session
that registered them. See docs/protocol.md.

Threading: one thread (``kvstored-sessions``) owns the listening socket and every
session connection. ``SessionTable`` lookups run on any thread under its lock.

Messages on the session socket: one msgpack map per packet (at most
:data:`MAX_PACKET` bytes), request then reply, in order:

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

import array
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgpack

from kvstored.buffers import BufferRegistry, MappedBudget, MappedBuffer
from kvstored.cuda_ipc import CudaIpc, unavailable
from kvstored.limits import SessionLimits
from kvstored.protocol import PROTOCOL_VERSION, ErrorCode, ErrorTally, ProtocolError, RegisterCudaIpc, parse_register

log = logging.getLogger(__name__)

MAX_PACKET = 4096
_UCRED = struct.Struct("3i")  # pid, uid, gid


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

    def find(self, token: bytes | None) -> Session:
        session = self._by_token.get(token) if token is not None else None
        if session is None:
            raise ProtocolError(
                ErrorCode.SESSION,
                f"no open session with this token on kvstored instance {self.instance} (the session ended, or the "
                f"daemon restarted): open a new session and register the buffers again",
            )
        return session

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

    def buffer_count(self) -> int:
        """Buffers registered now, all sessions (their bytes: ``budget.used``)."""
        with self._lock:
            sessions = list(self._by_token.values())
        return sum(len(s.buffers) for s in sessions)


class SessionServer:
    """The session socket: accepts connections, opens sessions, takes buffer descriptors."""

    def __init__(self, path: Path, table: SessionTable, mode: int, errors: ErrorTally | None = None) -> None:
        self.path = path
        self.table = table
        self.errors = errors if errors is not None else ErrorTally()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path.unlink(missing_ok=True)
        self._listener.bind(str(path))
        os.chmod(path, mode)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, Session | None] = {}
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
        for conn, session in list(self._conns.items()):
            if session is not None:
                self.table.close(session)
            conn.close()
        self._conns.clear()
        self._sel.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.path.unlink(missing_ok=True)

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(1.0):
                if key.data == "wake":
                    continue
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._serve(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        if len(self._conns) >= self.table.limits.max_sessions + 64:
            log.warning("session socket: %d connections open; refusing another", len(self._conns))
            conn.close()
            return
        conn.setblocking(True)
        conn.settimeout(5.0)  # a reply that cannot be sent in 5 s ends the session
        self._conns[conn] = None
        self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _drop(self, conn: socket.socket) -> None:
        session = self._conns.pop(conn, None)
        self._sel.unregister(conn)
        conn.close()
        if session is not None:
            self.table.close(session)

    def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            msg, fds, flags = _recv_with_fds(conn)
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
            try:
                conn.sendall(msgpack.packb(reply, use_bin_type=True))
            except OSError as exc:
                log.info("session client unreachable (%s); closing its session", exc)
                self._drop(conn)
        finally:
            for fd in fds:
                os.close(fd)

    def _handle(self, conn: socket.socket, msg: bytes, fds: list[int]) -> dict:
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
        session = self._conns.get(conn)
        try:
            if op == "open":
                if session is not None:
                    raise ProtocolError(ErrorCode.EXISTS, "this connection already has a session")
                pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                session = self.table.open(pid, uid, gid)
                self._conns[conn] = session
                return {"v": PROTOCOL_VERSION, "ok": True, "token": session.token, "instance": self.table.instance,
                        "uid": uid, "pid": os.getpid(), "limits": self.table.limits.to_dict()}
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
