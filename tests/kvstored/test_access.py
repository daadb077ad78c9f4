"""Access control against a real kvstored: what another OS user may touch, on the ipc and the
TCP socket, and the socket directories neither the daemon nor a client will trust.

The other user is a forked child that drops to ``nobody``'s uid before it connects, so the
kernel reports that uid to the daemon; these tests need root to do so and are skipped
(saying so) otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import msgpack
import numpy as np
import pytest
import zmq

from kvdrive_client import Geometry, NotFoundError, StoreClient
from kvdrive_client.errors import BufferError_, RequestError, SessionLostError, UnsafeStoreError
from kvstored.protocol import PROTOCOL_VERSION
from tenants import as_other_user, needs_root, other_user, shared_dir

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=8)
BB = GEOM.block_bytes





@pytest.fixture
def shared_root():
    yield from shared_dir()


def refusal(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (NotFoundError, BufferError_, RequestError, SessionLostError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "allowed"


def attack(address: str, victim_uid: int, victim_name: tuple[str, str]) -> Callable[[], dict]:
    def run() -> dict:
        c = StoreClient(address, timeout=10)
        out: dict = {"uid": os.geteuid(), "list": [s["seq"] for s in c.list()]}
        out["open"] = refusal(lambda: c.open(*victim_name))
        out["delete"] = refusal(lambda: c.delete(*victim_name))
        # uids are sequential: try every small one, as a guess would
        mine = c.create(*victim_name, GEOM)  # the same names, in this user's own space
        fake = type(mine)(victim_uid, *victim_name, GEOM, 0, 0)
        out["get_by_uid"] = refusal(lambda: c.get(fake, [(0, 0, 0)]))
        out["put_by_uid"] = refusal(lambda: c.put(fake, [0], [7], np.zeros((1, GEOM.num_kv_heads, 1, BB), np.uint8)))
        out["guesses"] = sorted({refusal(lambda u=u: c.get(type(mine)(u, "x", "y", GEOM, 0, 0), [(0, 0, 0)])).split(":")[0]
                                 for u in range(1, 20) if u != mine.uid})
        # Ids are per session: the ones this session did not register (the victim holds
        # buffers 1 and 2 in its own) reach nothing.
        own = c.register(1 << 16)
        out["own_buf"] = own.buf_id
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        replies = {}
        for req_id, buf in ((1, own.buf_id + 1), (2, own.buf_id + 2)):
            header = {"v": PROTOCOL_VERSION, "op": "put", "id": req_id, "session": c.session().token, "seq": mine.uid,
                      "layers": [0], "pages": [0], "buf": buf, "offset": 0}
            sock.send(msgpack.packb(header))
            assert sock.poll(10_000)
            replies[req_id] = msgpack.unpackb(sock.recv(), raw=False)
        # a register by path, which a root daemon would once have opened with its own rights
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "id": 3, "session": c.session().token,
                                 "kind": "shm", "name": "victim-file", "size": 4096}))
        assert sock.poll(10_000)
        replies[3] = msgpack.unpackb(sock.recv(), raw=False)
        sock.close()
        ctx.term()
        out["raw"] = {str(k): [v["ok"], v.get("code"), v.get("error")] for k, v in replies.items()}
        out["mine_uid"] = mine.uid
        c.close()
        return out

    return run


def check_attack(out: dict, victim_uid: int) -> None:
    assert out["uid"] == other_user().pw_uid
    assert out["list"] == [], "another user's sequences were listed"
    assert out["open"].startswith("NotFoundError") and out["delete"].startswith("NotFoundError"), out
    assert out["get_by_uid"].startswith("NotFoundError") and f"uid {victim_uid}" in out["get_by_uid"], out
    assert out["put_by_uid"].startswith("NotFoundError"), out
    assert out["guesses"] == ["NotFoundError"], out["guesses"]
    for k in ("1", "2"):
        ok, code, error = out["raw"][k]
        assert not ok and code == "buffer" and "not registered by this session" in error, out["raw"]
    assert out["raw"]["3"][:2] == [False, "unsupported"], out["raw"]


@needs_root
def test_another_user_cannot_see_read_write_or_delete_a_tenants_data(shared_root, daemon_at):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    try:
        owner = d.client()
        seq = owner.create("tenant", "prompt-42", GEOM)
        data = np.random.default_rng(0).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, 4, BB), dtype=np.uint8)
        owner.put(seq, range(GEOM.num_layers), range(4), data)
        victim_buf = owner.register(1 << 16)
        victim_buf.array[:] = 0x77
        out = as_other_user(attack(d.address, seq.uid, ("tenant", "prompt-42")))
        check_attack(out, seq.uid)
        # The owner's data, names and buffer are as they were; the other user's same-named
        # sequence is its own.
        blocks = [(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in range(4)]
        np.testing.assert_array_equal(owner.get(seq, blocks), data.reshape(-1, BB))
        assert [s["uid"] for s in owner.list()] == [seq.uid]
        assert owner.open("tenant", "prompt-42").uid == seq.uid != out["mine_uid"]
        assert (victim_buf.array == 0x77).all()
    finally:
        d.stop()


@needs_root
def test_the_tcp_socket_serves_nothing_without_a_session(shared_root, daemon_at):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    d = daemon_at(shared_root, extra=["--socket-mode", "0666", "--session-socket", str(shared_root / "kvstored.session")])
    d.address = address  # the daemon listens where its address says
    d.start()
    try:
        owner = d.client()
        seq = owner.create("tenant", "over-tcp", GEOM)
        owner.put(seq, range(GEOM.num_layers), [0], np.ones((GEOM.num_layers, GEOM.num_kv_heads, 1, BB), np.uint8))

        def tokenless() -> dict:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            codes = []
            for req_id, op in enumerate(("list", "stats", "open", "delete")):
                sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": req_id, "ns": "tenant", "seq": "over-tcp"}))
                assert sock.poll(10_000)
                codes.append(msgpack.unpackb(sock.recv(), raw=False).get("code"))
            sock.close()
            ctx.term()
            return {"codes": codes, **attack(address, seq.uid, ("tenant", "over-tcp"))()}

        out = as_other_user(tokenless)
        assert out.pop("codes") == ["session"] * 4
        check_attack(out, seq.uid)
        assert owner.open("tenant", "over-tcp").num_blocks == GEOM.num_layers * GEOM.num_kv_heads
    finally:
        d.stop()


@needs_root
@pytest.mark.parametrize("how", ["owned by another user", "writable by others"])
def test_the_daemon_refuses_a_socket_directory_it_cannot_trust(shared_root, how):
    sock_dir = shared_root / "run"
    sock_dir.mkdir()
    if how == "owned by another user":
        os.chown(sock_dir, other_user().pw_uid, other_user().pw_gid)
        words = f"belongs to uid {other_user().pw_uid}"
    else:
        sock_dir.chmod(0o777)
        words = "writable by group or others"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstored", "--ssd", str(shared_root / "ssd"), "--dram", "16M", "--listen",
         f"ipc://{sock_dir / 'kvstored.sock'}"], capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "cannot start" in proc.stderr and words in proc.stderr, proc.stderr
    assert not (sock_dir / "kvstored.sock").exists()


def fake_daemon(sock_dir: Path) -> Callable[[], dict]:
    """What a hostile user runs: a socket that answers like a daemon and hands out tokens."""

    def run() -> dict:
        sock_dir.mkdir(mode=0o755)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(sock_dir / "kvstored.sock.session"))
        listener.listen(1)
        listener.settimeout(0.5)
        pid = os.fork()
        if pid:
            return {"server": pid}
        try:  # serve one connection for a while, answering 'open' with a token
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(5)
                msg = conn.recv(4096)
                if msg:
                    conn.send(msgpack.packb({"v": 1, "ok": True, "token": b"\0" * 16, "instance": "fake", "uid": 0}))
                conn.close()
        finally:
            os._exit(0)

    return run


def refused_by_client(sock_dir: Path, words: str) -> None:
    client = StoreClient(f"ipc://{sock_dir / 'kvstored.sock'}", timeout=5)
    try:
        with pytest.raises(UnsafeStoreError, match=words):
            client.session()
    finally:
        client.close()


@needs_root
def test_a_client_refuses_a_socket_directory_another_user_made(shared_root):
    """Another user made the directory first (as with /tmp/kvdrive-UID) and serves a fake daemon in it."""
    hijacked = Path(tempfile.mktemp(prefix="kvdrive-hijack-", dir="/tmp"))
    server = as_other_user(fake_daemon(hijacked))["server"]
    try:
        refused_by_client(hijacked, "another user may have made it")
    finally:
        os.kill(server, 9)
        shutil.rmtree(hijacked, ignore_errors=True)


@needs_root
def test_a_client_refuses_a_socket_directory_others_can_write(shared_root):
    sock_dir = shared_root / "open"
    sock_dir.mkdir()
    sock_dir.chmod(0o777)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(sock_dir / "kvstored.sock.session"))
    listener.listen(1)
    try:
        refused_by_client(sock_dir, "writable by group or others")
    finally:
        listener.close()
