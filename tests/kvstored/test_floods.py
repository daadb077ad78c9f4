"""Connection floods against a real kvstored: the daemon lives through them, caps them well
below its descriptor limit, keeps room for other users, never waits on a peer that does not
read, and honours a session token from its own uid only.

Tests that act as a second OS user fork a child that drops to ``nobody``; they need root
and are skipped (saying so) otherwise.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import msgpack
import pytest
import zmq

from kvdrive_client import Geometry, StoreClient
from kvdrive_client.errors import BusyError, StoreUnavailableError
from kvstored.protocol import PROTOCOL_VERSION
from tenants import as_other_user, needs_root, settled, shared_dir

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", page_size=4)
FLOOD = 1100  # more connections than a shell's default descriptor limit (1024)



@contextlib.contextmanager
def daemon_fd_limit(soft: int, hard: int):
    """Daemons started inside get this RLIMIT_NOFILE (set in the child before exec)."""
    real = subprocess.Popen

    def popen(*args, **kwargs):
        kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return real(*args, **kwargs)

    subprocess.Popen = popen
    try:
        yield
    finally:
        subprocess.Popen = real


@pytest.fixture
def fds_for_a_flood():
    """This process's own descriptor limit raised to hold a flood's connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3 * FLOOD + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"a flood needs {need} descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def session_path(d) -> str:
    return d.address[len("ipc://"):] + ".session"


def wait_for(what: str, ready: Callable[[], bool], d, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert d.alive(), f"kvstored died (exit {d.proc.returncode}) waiting for {what}:\n{d.log()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{d.log()[-2000:]}"
        time.sleep(0.02)


def connect_many(path: str, count: int, deadline_s: float = 10.0) -> list[socket.socket]:
    """``count`` session-socket connections that never send a byte (fewer if the deadline
    passes first). While the listen backlog is full a connect fails at once; it is tried
    again once the daemon has had a moment to accept."""
    out: list[socket.socket] = []
    deadline = time.monotonic() + deadline_s
    while len(out) < count and time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            time.sleep(0.001)
            continue
        out.append(s)
    return out


def any_closed_by_daemon(socks: list[socket.socket]) -> bool:
    poll = select.poll()
    for s in socks:
        poll.register(s, select.POLLIN | select.POLLHUP)
    return bool(poll.poll(0))


def use_the_store(address: str, name: str, timeout: float = 10.0) -> int:
    c = StoreClient(address, timeout=timeout)
    try:
        return c.create("floods", name, GEOM).uid
    finally:
        c.close()


# ---------------------------------------------------------------- descriptors and floods


def test_the_daemon_raises_its_descriptor_limit_to_the_hard_limit(daemon_factory):
    with daemon_fd_limit(256, 4096):
        d = daemon_factory().start()
    limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
    line = next(l for l in limits.splitlines() if l.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line
    assert "raised from 256 to 4096" in d.log()
    d.stop()


def test_a_zeromq_connection_flood_is_refused_and_the_daemon_lives(daemon_factory, fds_for_a_flood):
    with daemon_fd_limit(1024, 1024):
        d = daemon_factory().start()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, FLOOD + 64)
    socks = []
    try:
        for _ in range(FLOOD):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.address)
            socks.append(s)
        wait_for("refusal of the excess connections", lambda: "refusing ZeroMQ connections" in d.log(), d)
        assert d.alive()
    finally:
        for s in socks:
            s.close()
        ctx.term()
    assert use_the_store(d.address, "after-zmq-flood") > 0
    assert d.stop() == 0


def test_a_session_socket_flood_leaves_the_session_thread_serving(daemon_factory, fds_for_a_flood):
    with daemon_fd_limit(1024, 1024):
        d = daemon_factory().start()
    flood = connect_many(session_path(d), FLOOD)
    try:
        wait_for("refusal of the excess session connections", lambda: any_closed_by_daemon(flood), d)
        assert d.alive()
    finally:
        for s in flood:
            s.close()
    # The daemon sees the flood's connections close as it gets to them: until then a new
    # session may still be refused as one too many (a reset, which a client takes as "down",
    # or, once the daemon has read its hello, a `busy` reply naming the limit).
    uid = []

    def serves() -> bool:
        try:
            uid.append(use_the_store(d.address, "after-session-flood", timeout=5))
        except (StoreUnavailableError, BusyError):
            return False
        return True

    wait_for("a session served once the flood's connections closed", serves, d)
    assert uid[0] > 0
    assert d.stop() == 0


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


def test_the_session_thread_survives_running_out_of_descriptors(tmp_path, caplog):
    """accept() failing with EMFILE is logged and retried; the connection is served after."""
    from kvstored.limits import SessionLimits
    from kvstored.server import SessionServer, SessionTable  # the classes the daemon uses

    server = SessionServer(tmp_path / "s.session", SessionTable(SessionLimits(), 1 << 30, lambda fn: fn()), 0o600)
    server.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_fd(), hard))  # no descriptor is free below it
    try:
        client.connect(str(tmp_path / "s.session"))
        deadline = time.monotonic() + 10
        while not any("accept failed" in r.getMessage() for r in caplog.records):
            assert any(t.name == "kvstored-sessions" for t in threading.enumerate()), "the session thread died"
            assert time.monotonic() < deadline, "accept() never failed"
            time.sleep(0.01)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    client.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "open"}))
    assert msgpack.unpackb(client.recv(4096), raw=False)["ok"]
    client.close()
    server.stop()


# ---------------------------------------------------------------- idle connections




@pytest.fixture
def shared_root():
    yield from shared_dir()


@needs_root
def test_idle_connections_of_one_user_leave_room_for_another(shared_root, daemon_at, fds_for_a_flood):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    flood = connect_many(session_path(d), FLOOD)
    assert len(flood) == FLOOD
    try:
        out = as_other_user(lambda: {"uid": use_the_store(d.address, "other-user", timeout=5)})
        assert out["uid"] > 0
        assert d.alive()
    finally:
        for s in flood:
            s.close()
    d.stop()


@needs_root
def test_one_users_zeromq_flood_leaves_room_for_another(shared_root, daemon_at, fds_for_a_flood):
    """With 1,024 descriptors the ZeroMQ cap is 240 connections, 120 per uid: 500 from one
    user are more than the whole cap, yet that user is served on 120 only, and another
    user still connects and is served."""
    with daemon_fd_limit(1024, 1024):
        d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 600)
    socks = []
    try:
        for _ in range(500):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.address)
            s.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello", "id": 1}))
            socks.append(s)
        served = settled(lambda: sum(1 for s in socks if s.poll(0)), d, timeout=20.0)
        out = as_other_user(lambda: {"uid": use_the_store(d.address, "other-user", timeout=5)})
        assert out["uid"] > 0
        assert served == 120, f"one uid was served on {served} ZeroMQ connections (--max-connections-per-uid 120)"
        assert d.alive()
    finally:
        for s in socks:
            s.close()
        ctx.term()
    assert d.stop() == 0


def test_a_connection_that_opens_no_session_is_closed(daemon_factory):
    d = daemon_factory(extra=["--session-open-timeout", "1"]).start()
    keeper = StoreClient(d.address, timeout=10)
    keeper.create("floods", "keeper", GEOM)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.connect(session_path(d))
    idle.settimeout(8)
    t0 = time.monotonic()
    assert idle.recv(4096) == b"", "the daemon sent something instead of closing"
    assert time.monotonic() - t0 < 5
    idle.close()
    keeper.create("floods", "keeper-2", GEOM)  # an open session is not idle: it stays
    keeper.close()
    d.stop()


# ---------------------------------------------------------------- peers that never read


def stall(path: str) -> socket.socket:
    """A session-socket peer that opens a session, then sends requests and never reads a reply."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.setblocking(False)
    bogus = msgpack.packb({"v": PROTOCOL_VERSION, "op": "no-such-op"})
    s.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "open"}))
    for _ in range(200):
        try:
            s.send(bogus)
        except BlockingIOError:
            break
    return s


@pytest.mark.alone
def test_a_client_that_never_reads_does_not_stall_the_others(daemon):
    stalled = [stall(session_path(daemon)) for _ in range(3)]
    try:
        t0 = time.monotonic()
        victim = daemon.client(timeout=30)
        victim.create("floods", "victim", GEOM)
        victim.register(1 << 16)
        took = time.monotonic() - t0
        assert took < 3.0, f"a session open and a register took {took:.1f} s behind peers that do not read"
    finally:
        for s in stalled:
            s.close()
    assert daemon.alive()


# ---------------------------------------------------------------- tokens and uids


def raw_list(address: str, token: bytes) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "list", "id": 1, "session": token}))
        assert sock.poll(10_000), "no reply from kvstored"
        reply = msgpack.unpackb(sock.recv(), raw=False)
        return {"ok": reply["ok"], "code": reply.get("code")}
    finally:
        sock.close()
        ctx.term()


@needs_root
def test_a_session_token_works_only_from_its_own_uid(shared_root, daemon_at):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    owner = d.client()
    owner.create("tenant", "secret", GEOM)
    token = owner.session().token
    assert raw_list(d.address, token)["ok"], "the token works from its own uid"
    out = as_other_user(lambda: {"reply": raw_list(d.address, token)})
    assert out["reply"] == {"ok": False, "code": "session"}, out
    d.stop()
