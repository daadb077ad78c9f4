"""SIGTERM under load: every request the daemon received is answered, ``ok`` or ``unavailable``."""

from __future__ import annotations

import signal
import time
from collections import Counter

import numpy as np
import zmq

from kvdrive.protocol import Op, decode_reply, request_frames
from kvdrive_client import Geometry

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes
NUM_CONNECTIONS = 4
REQUESTS = 300  # per connection; gets of every block of the stored pages, and puts of new pages
STORED_PAGES = 32
BLOCKS = np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads)
                   for p in range(STORED_PAGES)], dtype=np.int32)


class Connection:
    """A client's session and buffer, and a DEALER socket of its own for a pipelined burst."""

    def __init__(self, daemon, index: int, ctx: zmq.Context) -> None:
        self.client = daemon.client(timeout=30)
        self.seq = self.client.create("burst", f"s{index}", GEOM)
        data = np.full((GEOM.num_layers, GEOM.num_kv_heads, STORED_PAGES, BB), index, np.uint8)
        self.client.put(self.seq, range(GEOM.num_layers), range(STORED_PAGES), data)
        self.buf = self.client.register(len(BLOCKS) * BB + GEOM.num_layers * GEOM.num_kv_heads * BB)
        self.token = self.client.session().token
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(daemon.address)
        self.replies: dict[int, str] = {}

    def send_burst(self) -> None:
        put_at = len(BLOCKS) * BB
        for req_id in range(1, REQUESTS + 1):
            if req_id % 3:
                op, fields, arrays = Op.GET, {"seq": self.seq.uid, "buf": self.buf.buf_id, "offset": 0}, {"blocks": BLOCKS}
            else:  # a page no put has stored yet
                page = STORED_PAGES + req_id // 3
                op, arrays = Op.PUT, None
                fields = {"seq": self.seq.uid, "layers": list(range(GEOM.num_layers)), "pages": [page],
                          "buf": self.buf.buf_id, "offset": put_at}
            self.sock.send_multipart(request_frames(op, req_id, fields, arrays, self.token, time.time() + 60))

    def receive(self, timeout_ms: int) -> bool:
        """Take one reply, if one comes within ``timeout_ms``."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return False
        reply = decode_reply(self.sock.recv())
        self.replies[reply["id"]] = "ok" if reply["ok"] else reply["code"]
        return True


def receive_until(connections: list[Connection], done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        for c in connections:
            while c.receive(10):
                pass


def test_sigterm_answers_every_request_it_received(daemon_factory):
    daemon = daemon_factory(dram="1M").start()  # gets read the SSD: slow enough that many wait
    ctx = zmq.Context()
    connections = [Connection(daemon, i, ctx) for i in range(NUM_CONNECTIONS)]
    try:
        for c in connections:  # each socket connected: a hello answered
            c.sock.send_multipart(request_frames(Op.HELLO, 0, {}))
        receive_until(connections, lambda: all(0 in c.replies for c in connections), timeout=10)
        assert all(c.replies.pop(0, None) == "ok" for c in connections), daemon.log()
        for c in connections:
            c.send_burst()
        # At once: many requests are still in the daemon's socket, not yet read, when it stops.
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(20) == 0, daemon.log()
        receive_until(connections, lambda: all(len(c.replies) == REQUESTS for c in connections), timeout=5)
        outcomes = Counter(code for c in connections for code in c.replies.values())
        missing = {i: REQUESTS - len(c.replies) for i, c in enumerate(connections) if len(c.replies) < REQUESTS}
        assert not missing, f"requests without a reply, by connection: {missing}; replies: {dict(outcomes)}"
        assert set(outcomes) <= {"ok", "unavailable"}, dict(outcomes)
        assert outcomes["unavailable"] > 0, dict(outcomes)  # the signal came while requests waited
    finally:
        for c in connections:
            c.sock.close()
            c.client.close()
        ctx.term()
