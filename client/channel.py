"""The client's end of kvstored's session socket (see kvstored/sessions.py).

Before it trusts a daemon with its data, the client checks who serves the socket:
the directory holding it must be writable by its owner only, the process behind it
(the kernel says which, SO_PEERCRED) must run as that owner or as root, and a
directory inside a directory anyone may write (``/tmp``) must belong to this user
or to root, since another user may have made it first and put a fake daemon there.

Over TCP the socket's path comes from whoever answers on the port, and any local user
may have bound it first, so there the process behind the session socket must also run
as a uid this user trusts (:func:`trusted_daemon_uids`): root, this user, the service
user ``kvdrive`` of the systemd unit, or one the caller names; otherwise the client
refuses before it sends anything on that socket, a buffer least of all.
"""

from __future__ import annotations

import os
import pwd
import select
import socket
import stat
import struct
import threading
from pathlib import Path

import msgpack

from kvdrive_client.errors import StoreUnavailableError, UnsafeStoreError, error_from_reply
from kvdrive_client.shm import CudaIpcBuffer, PoolBuffer, SharedBuffer
from kvdrive.protocol import PROTOCOL_VERSION

_UCRED = struct.Struct("3i")
_MAX_REPLY = 4096
# The user the systemd unit runs kvstored as (systemd/kvstored.service).
SERVICE_USER = "kvdrive"


def trusted_daemon_uids(named: int | None = None) -> frozenset[int]:
    """The uids a daemon found through a TCP address may run as: root, this user, the
    service user where it exists, and ``named``."""
    uids = {0, os.geteuid()}
    try:
        uids.add(pwd.getpwnam(SERVICE_USER).pw_uid)
    except KeyError:
        pass
    if named is not None:
        uids.add(named)
    return frozenset(uids)


def check_socket_dir(path: Path, daemon_uid: int) -> None:
    """Raise UnsafeStoreError unless ``path`` (a socket's directory) is safe to trust."""
    try:
        st = os.lstat(path)
        parent = os.stat(path.parent)
    except OSError as exc:
        raise StoreUnavailableError(f"cannot inspect socket directory {path}: {exc.strerror}") from None
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"socket directory {path} is not a directory (a symbolic link?); not connecting")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStoreError(
            f"socket directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"anyone there could replace the daemon's socket; not connecting"
        )
    if daemon_uid not in (st.st_uid, 0):
        raise UnsafeStoreError(
            f"the daemon on {path} runs as uid {daemon_uid}, but the directory belongs to uid {st.st_uid}; not connecting"
        )
    if parent.st_mode & stat.S_IWOTH and st.st_uid not in (me, 0):
        raise UnsafeStoreError(
            f"socket directory {path} belongs to uid {st.st_uid} inside the world-writable {path.parent}: another "
            f"user may have made it to serve a fake daemon; not connecting (remove it, or choose another directory)"
        )


class SessionChannel:
    """One session: its token, the daemon instance it was opened with, buffer registration."""

    def __init__(self, path: Path, timeout: float, trusted_uids: frozenset[int] | None = None) -> None:
        """``trusted_uids``: where the path came from the daemon's own answer (TCP), the uids
        the process behind it may run as; None where the caller named the path (ipc)."""
        self.path = path
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._timeout = timeout
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(path))
        except OSError as exc:
            self._sock.close()
            raise StoreUnavailableError(f"no kvstored session socket at {path}: {exc.strerror}") from None
        try:
            _pid, self.daemon_uid, _gid = _UCRED.unpack(
                self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if trusted_uids is not None and self.daemon_uid not in trusted_uids:
                raise UnsafeStoreError(
                    f"the daemon behind session socket {path} runs as {_user(self.daemon_uid)}, not as root, this "
                    f"user or the service user {SERVICE_USER!r}: over TCP anyone may answer first, so this client "
                    f"will not open a session there (connect(..., daemon_uid={self.daemon_uid}) trusts it)")
            check_socket_dir(path.parent, self.daemon_uid)
            reply = self._call({"op": "open"})
        except BaseException:
            self._sock.close()
            raise
        self.token: bytes = reply["token"]
        self.instance: str = reply["instance"]
        self.uid: int = reply["uid"]
        self.limits: dict = reply.get("limits", {})
        self.closed = False
        self._polls = threading.local()  # a poll object may not be used by two threads at once

    def fileno(self) -> int:
        return self._sock.fileno()

    def _call(self, msg: dict, fds: list[int] | None = None) -> dict:
        data = msgpack.packb({"v": PROTOCOL_VERSION, **msg}, use_bin_type=True)
        with self._lock:
            try:
                if fds:
                    self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
                else:
                    self._sock.send(data)
                raw = self._sock.recv(_MAX_REPLY)
            except OSError as exc:
                self.closed = True
                raise StoreUnavailableError(f"kvstored session socket {self.path} failed: {exc}") from None
        if not raw:
            self.closed = True
            raise StoreUnavailableError(f"kvstored closed the session on {self.path} (it stopped or restarted)")
        reply = msgpack.unpackb(raw, raw=False)
        if not reply.get("ok"):
            raise error_from_reply(reply)
        return reply

    def register(self, buf: SharedBuffer | PoolBuffer | CudaIpcBuffer) -> int:
        """Register ``buf`` in this session (a memfd or a pool goes as its descriptor, a CUDA
        allocation as its IPC handle); returns the buffer id."""
        msg, fds = buf.register_message()
        return self._call(msg, fds)["buf"]

    def unregister(self, buf_id: int) -> None:
        self._call({"op": "unregister", "buf": buf_id})

    def dead(self) -> bool:
        """Whether the daemon has ended this session (its end of the socket closed).

        Between requests nothing arrives on the socket but its end, so one poll that finds
        nothing readable answers (no lock, no exception on the hot path)."""
        if self.closed:
            return True
        poll = getattr(self._polls, "poll", None)
        if poll is None:
            poll = self._polls.poll = select.poll()
            poll.register(self._sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poll.poll(0):
            return False
        if not self._lock.acquire(blocking=False):
            return False  # a request is using the socket; it will see an end itself
        try:
            self._sock.setblocking(False)
            try:
                self.closed = not self._sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                pass
            except OSError:
                self.closed = True
            finally:
                self._sock.settimeout(self._timeout)
        finally:
            self._lock.release()
        return self.closed

    def close(self) -> None:
        self.closed = True
        self._sock.close()


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
