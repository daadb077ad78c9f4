"""Over TCP, whoever binds the port first answers: the SDK opens a session only with a daemon
of a uid it trusts (client/channel.py), so a local user squatting the port never gets a buffer."""

from __future__ import annotations

import json
import os
import select
import socket
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from kvdrive_client import StoreClient
from kvdrive_client.errors import UnsafeStoreError
from kvdrive.protocol import PROTOCOL_VERSION, ok_reply
from tenants import needs_root, other_user, shared_dir

SERVE_S = 30.0


@pytest.fixture
def shared_root():
    yield from shared_dir()


def _serve_as_squatter(session_path: Path, port_w: int, stop_r: int, report_w: int) -> None:
    """A fake kvstored: hello names ``session_path``; the session socket opens sessions and
    accepts registers, counting them (runs in the forked child, as the other user)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(session_path))
    listener.listen(8)
    os.write(port_w, f"{port}\n".encode())
    seen = {"opened": 0, "registered": 0, "fds": 0}
    conns: list[socket.socket] = []
    deadline = time.monotonic() + SERVE_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stop_r, listener, router.fileno(), *conns], [], [], 0.05)
        if stop_r in ready:
            break
        while router.poll(0):
            ident, body = router.recv_multipart()
            req = msgpack.unpackb(body, raw=False)
            router.send_multipart([ident, *ok_reply(req["id"], instance="squat", session_socket=str(session_path),
                                                    max_message_bytes=1 << 20, cuda_ipc=False)])
        if listener in ready:
            conns.append(listener.accept()[0])
        for conn in [c for c in conns if c in ready]:
            data, anc, _, _ = conn.recvmsg(4096, socket.CMSG_SPACE(16))
            if not data:
                conns.remove(conn)
                continue
            msg = msgpack.unpackb(data, raw=False)
            if msg["op"] == "open":
                seen["opened"] += 1
                reply = {"v": PROTOCOL_VERSION, "ok": True, "token": b"t" * 16, "instance": "squat", "uid": os.getuid()}
            else:
                seen["registered"] += 1
                seen["fds"] += len(anc)
                reply = {"v": PROTOCOL_VERSION, "ok": True, "buf": seen["registered"], "size": msg.get("size"),
                         "kind": "memfd"}
            conn.send(msgpack.packb(reply, use_bin_type=True))
    os.write(report_w, json.dumps(seen).encode() + b"\n")


class Squatter:
    """The fake daemon in a child process that has become ``nobody``."""

    def __init__(self, root: Path) -> None:
        self.user = other_user()
        home = root / "squat"  # the other user's own directory, as in their home
        home.mkdir(mode=0o755)
        os.chown(home, self.user.pw_uid, self.user.pw_gid)
        port_r, port_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._report_r, report_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.setgroups([])
                os.setgid(self.user.pw_gid)
                os.setuid(self.user.pw_uid)
                _serve_as_squatter(home / "kvstored.session", port_w, self._stop_r, report_w)
            finally:
                os._exit(0)
        os.close(port_w)
        os.close(report_w)
        assert select.select([port_r], [], [], 20)[0], "the squatter did not start"
        self.address = f"tcp://127.0.0.1:{int(os.read(port_r, 64))}"
        os.close(port_r)

    def finish(self) -> dict:
        """Stop it; what it was sent."""
        os.write(self._stop_w, b"x")
        assert select.select([self._report_r], [], [], SERVE_S + 10)[0], "the squatter did not report"
        seen = json.loads(os.read(self._report_r, 4096))
        os.waitpid(self.pid, 0)
        return seen


@needs_root
def test_a_client_never_hands_a_buffer_to_a_daemon_of_another_user_over_tcp(shared_root):
    squatter = Squatter(shared_root)
    client = StoreClient(squatter.address, timeout=10)
    try:
        assert client.ping(timeout=5)  # anyone may answer a hello
        with pytest.raises(UnsafeStoreError, match=f"runs as uid {squatter.user.pw_uid}"):
            client.register(4096)
    finally:
        client.close()
        seen = squatter.finish()
    assert seen == {"opened": 0, "registered": 0, "fds": 0}, seen


@needs_root
def test_a_daemon_uid_the_caller_names_is_trusted(shared_root):
    squatter = Squatter(shared_root)
    client = StoreClient(squatter.address, timeout=10, daemon_uid=squatter.user.pw_uid)
    try:
        assert client.register(4096).buf_id == 1
    finally:
        client.close()
        seen = squatter.finish()
    assert seen["opened"] == 1 and seen["registered"] == 1 and seen["fds"] == 1, seen
