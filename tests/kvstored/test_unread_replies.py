"""A client that sends requests and never reads the replies pins little of the daemon's
memory: libzmq holds at most 256 replies per connection and the daemon 256 KiB more
(kvstored/replies.py), a list reply holds at most 16 sequences (kvstored/server.py,
``LIST_PAGE``), the replies past that are dropped and counted, and other users are
served as before.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq

from kvdrive_client import Geometry, StoreClient
from kvstored.protocol import PROTOCOL_VERSION
from tenants import as_other_user, needs_root, settled, shared_dir

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", page_size=4)
NUM_SEQS = 200  # with names of 250 characters: a list reply of all of them was about 80 KiB
CONNECTIONS = 2
REQUESTS = 1000  # per connection, fewer than it may have waiting (1,024)
MORE_REQUESTS = 5000
# What the daemon may grow by while its peers do not read. Before the bound, each such
# connection pinned up to 1,000 replies (80 MiB of these).
MAX_GROWTH = 32 << 20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def request(op: str, req_id: int, token: bytes, **fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": req_id, "session": token, **fields})


def create_many(address: str, token: bytes, names: list[str]) -> None:
    """Create the sequences with requests sent together (they share catalog commits)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        for i, name in enumerate(names):
            sock.send(request("create", i + 1, token, ns="unread", seq=name, geometry=GEOM.to_dict()))
        for _ in names:
            assert sock.poll(30_000), "no reply to a create"
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["ok"], reply
    finally:
        sock.close()
        ctx.term()


def served_promptly(address: str) -> dict:
    t0 = time.monotonic()
    c = StoreClient(address, timeout=10)
    try:
        c.create("other", "seq", GEOM)
        listed = c.list()
    finally:
        c.close()
    return {"seconds": time.monotonic() - t0, "listed": len(listed)}


@pytest.fixture
def shared_root():
    yield from shared_dir()


@needs_root
def test_replies_a_client_never_reads_pin_a_bounded_amount(shared_root, daemon_at):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    owner = d.client()
    token = owner.session().token
    create_many(d.address, token, [f"{i:04d}-" + "x" * 245 for i in range(NUM_SEQS)])
    assert len(owner.list("unread")) == NUM_SEQS  # every page of it: the client asks again for more
    before = rss_bytes(d.proc.pid)

    ctx = zmq.Context()
    hostile = []
    try:
        for _ in range(CONNECTIONS):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)  # everything is sent; nothing is read
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(d.address)
            hostile.append(s)

        def figures() -> tuple:
            counters = owner.stats()["counters"]
            return rss_bytes(d.proc.pid) >> 20, counters.get("requests_busy", 0), counters.get("replies_dropped", 0)

        # No more lists than a connection may have waiting: none is refused, and the daemon
        # would serve them all in turn to a peer that read the replies.
        for s in hostile:
            for i in range(REQUESTS):
                s.send(request("list", i + 1, token, ns="unread"))
        other = as_other_user(lambda: served_promptly(d.address))
        assert other["listed"] == 1
        assert other["seconds"] < 5.0, f"another user waited {other['seconds']:.1f} s behind peers that never read"
        # Once the daemon has read every request and made every reply it will make.
        growth = (settled(figures, d)[0] << 20) - before
        print(f"daemon RSS growth {growth / (1 << 20):.1f} MiB for {CONNECTIONS} x {REQUESTS} unread lists")
        assert growth < MAX_GROWTH, f"the daemon grew by {growth >> 20} MiB for replies nobody read"

        # Past the requests a connection may have waiting, each gets a 'busy' reply: those
        # wait for the peer too, up to 256 KiB (about 1,700 of them), and the rest are dropped.
        for s in hostile:
            for i in range(MORE_REQUESTS):
                s.send(request("list", REQUESTS + i + 1, token, ns="unread"))
        final = settled(figures, d)
        assert (final[0] << 20) - before < MAX_GROWTH
        assert final[2] > 0, f"no reply was dropped: {final}"
    finally:
        for s in hostile:
            s.close()
        ctx.term()
    assert d.log().count("dropping replies to a ZeroMQ client") == 1
    assert d.alive()
    assert d.stop() == 0
