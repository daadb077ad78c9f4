"""Many clients at once, and many gets in flight from one client."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from kvdrive_client import Geometry, NotFoundError
from kvdrive_client.shm import SharedBuffer
from kvstored.protocol import PROTOCOL_VERSION

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes
NUM_CLIENTS = 8
DURATION_S = 12.0  # each worker puts and reads many times over in it, and the churn cycles
# Small enough that most of the data lives on the SSD only.
DRAM = "2M"


def page_data(seed: int, first: int, count: int) -> np.ndarray:
    out = np.empty((GEOM.num_layers, GEOM.num_kv_heads, count, BB), dtype=np.uint8)
    for i in range(count):
        rng = np.random.default_rng([seed, first + i])
        out[:, :, i] = rng.integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, BB), dtype=np.uint8)
    return out


def expected(seed: int, blocks: np.ndarray) -> np.ndarray:
    """Bytes of (layer, head, page) rows, regenerated page by page."""
    out = np.empty((len(blocks), BB), dtype=np.uint8)
    for page in np.unique(blocks[:, 2]).tolist():
        rows = np.flatnonzero(blocks[:, 2] == page)
        data = page_data(seed, page, 1)
        out[rows] = data[blocks[rows, 0], blocks[rows, 1], 0]
    return out


class Worker(threading.Thread):
    """One client: appends pages to its own sequence and reads random subsets back."""

    def __init__(self, daemon, index: int, deadline: float) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.client = daemon.client(timeout=60)
        self.seed = 100 + index
        self.seq = self.client.create("soak", f"c{index}", GEOM)
        self.buf = self.client.register(256 * BB)
        self.deadline = deadline
        self.rng = np.random.default_rng(self.seed)
        self.num_pages = 0
        self.num_puts = self.num_gets = self.blocks_read = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                if self.num_pages < 2 or self.rng.random() < 0.3:
                    self.put()
                else:
                    self.get()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def put(self) -> None:
        count = int(self.rng.integers(1, 4))
        pages = range(self.num_pages, self.num_pages + count)
        assert self.client.put(self.seq, range(GEOM.num_layers), pages, page_data(self.seed, pages[0], count)) == 8 * count
        self.num_pages += count
        self.num_puts += 1

    def get(self) -> None:
        n = int(self.rng.integers(1, 200))
        blocks = np.stack([
            self.rng.integers(0, GEOM.num_layers, n),
            self.rng.integers(0, GEOM.num_kv_heads, n),
            self.rng.integers(0, self.num_pages, n),
        ], axis=1)
        if self.rng.random() < 0.5:
            got = self.client.get(self.seq, blocks)
        else:  # scattered destinations
            dst = self.rng.permutation(256)[:n] * BB
            reply = self.client.get_into(self.seq, blocks, self.buf, dst=dst)
            assert reply["n"] == n == reply["dram"] + reply["ssd"]
            got = self.buf.array.reshape(256, BB)[dst // BB]
        np.testing.assert_array_equal(got, expected(self.seed, blocks), err_msg=f"{self.name}: wrong bytes")
        self.num_gets += 1
        self.blocks_read += n


class Churn(threading.Thread):
    """Creates, fills, reads and deletes scratch sequences, so freed space is reused under readers."""

    def __init__(self, daemon, deadline: float) -> None:
        super().__init__(name="churn", daemon=True)
        self.client = daemon.client(timeout=60)
        self.deadline = deadline
        self.cycles = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                name = f"scratch-{self.cycles}"
                seq = self.client.create("churn", name, GEOM)
                data = page_data(self.cycles, 0, 6)
                self.client.put(seq, range(GEOM.num_layers), range(6), data)
                blocks = np.array([(l, h, p) for l in range(4) for h in range(2) for p in range(6)])
                np.testing.assert_array_equal(self.client.get(seq, blocks), data[blocks[:, 0], blocks[:, 1], blocks[:, 2]])
                self.client.delete("churn", name)
                self.cycles += 1
        except BaseException as exc:
            self.error = exc


@pytest.mark.slow
def test_concurrent_clients_put_and_read_bit_exact(daemon_factory):
    d = daemon_factory(dram=DRAM).start()
    deadline = time.monotonic() + DURATION_S
    workers = [Worker(d, i, deadline) for i in range(NUM_CLIENTS)]
    churn = Churn(d, deadline)
    for t in (*workers, churn):
        t.start()
    for t in (*workers, churn):
        t.join(DURATION_S + 120)
        assert not t.is_alive(), f"{t.name} is stuck"
    errors = {t.name: t.error for t in (*workers, churn) if t.error is not None}
    assert not errors, errors
    assert d.alive()
    for w in workers:
        assert w.num_puts > 0 and w.num_gets > 0, (w.name, w.num_puts, w.num_gets)
    assert churn.cycles > 0

    check = d.client()
    for w in workers:
        seq = check.open("soak", w.seq.name)
        assert seq.complete_pages == w.num_pages and seq.num_blocks == 8 * w.num_pages
        blocks = np.array([(l, h, p) for p in range(w.num_pages) for l in range(4) for h in range(2)])
        for part in np.array_split(blocks, max(1, len(blocks) // 2048)):
            np.testing.assert_array_equal(check.get(seq, part), expected(w.seed, part))
    assert check.list("churn") == []
    stats = check.stats()
    counters = stats["counters"]
    assert counters["blocks_ssd"] > 0 and counters["blocks_dram"] > 0
    assert counters.get("checksum_errors", 0) == 0 and counters.get("io_errors", 0) == 0
    assert stats["dram_used_bytes"] <= stats["dram_bytes"]
    assert d.stop() == 0


def test_many_gets_in_flight_from_one_client(daemon_factory):
    d = daemon_factory(dram="0").start()  # every read goes to the SSD, so gets take uneven time
    client = d.client()
    seq = client.create("t", "async", GEOM)
    num_pages = 64
    client.put(seq, range(4), range(num_pages), page_data(5, 0, num_pages), cluster=np.arange(4 * 2 * num_pages) % 5)
    rng = np.random.default_rng(0)
    num_gets, slot = 48, 128
    buf = client.register((num_gets + 1) * slot * BB)
    wanted, pending = [], []
    for i in range(num_gets):
        n = int(rng.choice([1, 4, 128]))
        blocks = np.stack([rng.integers(0, 4, n), rng.integers(0, 2, n), rng.integers(0, num_pages, n)], axis=1)
        wanted.append(blocks)
        pending.append(client.get_async(seq, blocks, buf, offset=i * slot * BB))
    # A bad get in the middle of the flight fails alone.
    bad = client.get_async(seq, [(0, 0, num_pages + 5)], buf, offset=num_gets * slot * BB)
    order = rng.permutation(num_gets)
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def waiter(indices) -> None:
        try:
            for i in indices:
                results[int(i)] = pending[i].wait(timeout=60)
        except BaseException as exc:
            errors.append(exc)

    # Four threads wait on the one client, each for its own share, in shuffled order.
    threads = [threading.Thread(target=waiter, args=(order[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    with pytest.raises(NotFoundError, match=f"page {num_pages + 5}"):
        bad.wait(timeout=60)
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert not errors, errors
    assert sorted(results) == list(range(num_gets))
    for i, blocks in enumerate(wanted):
        assert results[i]["n"] == len(blocks) and results[i]["ssd"] == len(blocks)
        got = buf.array[i * slot * BB : (i * slot + len(blocks)) * BB].reshape(-1, BB)
        np.testing.assert_array_equal(got, expected(5, blocks), err_msg=f"get {i}")
    assert client._replies == {}, "replies were left unclaimed"


def test_unregister_racing_puts_and_gets(daemon_factory):
    """An unregister sent right behind a put or get from that buffer: the request either
    completes from the still-mapped buffer or fails with a 'buffer' error, and nothing leaks."""
    geom = Geometry(num_layers=64, num_kv_heads=8, head_dim=16, dtype="float16", page_size=4)  # many extents per put
    bb = geom.block_bytes
    d = daemon_factory(dram="1M").start()
    client = d.client()
    seq = client.create("t", "race", geom)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.address)
    rng = np.random.default_rng(3)
    req_ids = iter(range(1, 1 << 30))

    channel = client.session()

    def send(op: str, frames: list | None = None, **fields) -> int:
        req_id = next(req_ids)
        header = {"v": PROTOCOL_VERSION, "op": op, "id": req_id, "session": channel.token, **fields}
        if frames:
            header["frames"] = ["blocks"]
        sock.send_multipart([msgpack.packb(header), *(frames or [])])
        return req_id

    def replies(n: int) -> dict[int, dict]:
        out = {}
        while len(out) < n:
            assert sock.poll(30_000), "no reply from kvstored"
            r = msgpack.unpackb(sock.recv(), raw=False)
            out[r["id"]] = r
        return out

    stored: dict[int, np.ndarray] = {}
    first = rng.integers(0, 256, (geom.num_layers, geom.num_kv_heads, 2, bb), dtype=np.uint8)
    client.put(seq, range(geom.num_layers), [1000, 1001], first)
    stored.update({1000: first[:, :, 0], 1001: first[:, :, 1]})
    outcomes = {"put ok": 0, "put refused": 0, "get ok": 0, "get refused": 0}
    try:
        for trial in range(24):
            buf = SharedBuffer(geom.num_layers * geom.num_kv_heads * 2 * bb)
            buf_id = channel.register(buf)
            kind = "put" if trial % 2 == 0 else "get"
            if kind == "put":
                pages = [2 * trial, 2 * trial + 1]
                data = rng.integers(0, 256, (geom.num_layers, geom.num_kv_heads, 2, bb), dtype=np.uint8)
                buf.array[:] = data.ravel()
                op = send("put", seq=seq.uid, layers=list(range(geom.num_layers)), pages=pages, buf=buf_id, offset=0)
            else:
                page = int(rng.choice(list(stored)))
                blocks = np.array([(l, h, page) for l in range(geom.num_layers) for h in range(geom.num_kv_heads)], np.int32)
                op = send("get", [blocks.tobytes()], seq=seq.uid, buf=buf_id, offset=0)
            # Vary where the unregister lands: before the copy, during it, or after.
            time.sleep(rng.uniform(0, 0.01))
            channel.unregister(buf_id)  # on the session socket, racing the request on the other
            r = replies(1)[op]
            if r["ok"]:
                outcomes[f"{kind} ok"] += 1
                if kind == "put":
                    for i, p in enumerate(pages):
                        stored[p] = data[:, :, i]
                else:
                    np.testing.assert_array_equal(buf.array[: len(blocks) * bb].reshape(-1, bb), stored[page].reshape(-1, bb))
            else:
                assert r["code"] == "buffer" and f"buffer {buf_id} is not registered" in r["error"], r
                outcomes[f"{kind} refused"] += 1
            buf.close()
    finally:
        sock.close()
        ctx.term()
    assert d.alive()
    # Every put that succeeded reads back; refused ones left no blocks and no space behind.
    for page, data in stored.items():
        blocks = [(l, h, page) for l in range(geom.num_layers) for h in range(geom.num_kv_heads)]
        np.testing.assert_array_equal(client.get(seq, blocks), data.reshape(-1, bb))
    stats = client.stats()
    assert outcomes["put ok"] + outcomes["put refused"] == outcomes["get ok"] + outcomes["get refused"] == 12
    assert stats["ssd_used_bytes"] == len(stored) // 2 * geom.num_layers * geom.num_kv_heads * 4096
    assert client.open("t", "race").num_blocks == len(stored) * geom.num_layers * geom.num_kv_heads
