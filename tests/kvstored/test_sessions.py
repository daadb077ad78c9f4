"""Sessions against a real kvstored: buffers belong to the session that registered them,
a restarted daemon is noticed, requests given up on never run later, a dead client's
resources are reclaimed, and a stopping or dead daemon is learned of in seconds."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from kvdrive_client import Geometry, StoreUnavailableError
from kvdrive_client.errors import BufferError_, ExpiredError, NotFoundError, SessionLostError
from kvdrive_client.shm import SharedBuffer
from kvstored.protocol import PROTOCOL_VERSION, Op

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=8)
BB = GEOM.block_bytes


def blocks_of(pages) -> np.ndarray:
    return np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in pages], np.int32)


def random_pages(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, count, BB), dtype=np.uint8)


class Raw:
    """A bare DEALER that speaks the protocol with a given session token."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a flood queues here instead of blocking the test
        self.sock.connect(address)

    def send(self, req_id: int, op: str, token: bytes, **fields) -> None:
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": req_id, "session": token, **fields}))

    def recv(self, timeout_ms: int = 20_000) -> dict:
        assert self.sock.poll(timeout_ms), "no reply from kvstored"
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def restart(d) -> None:
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(30)
    d.start()


def test_buffer_ids_of_a_restarted_daemon_never_reach_another_clients_memory(daemon):
    first = daemon.client()
    seq = first.create("t", "restart", GEOM)
    data = random_pages(1, 4)
    first.put(seq, range(GEOM.num_layers), range(4), data)
    buf = first.register(16 * BB)
    old_id, old_instance, old_token = buf.buf_id, first.instance, first.session().token
    restart(daemon)
    # A second client registers first after the restart: the daemon would hand it the id
    # the first client still holds, if ids were global.
    second = daemon.client()
    others = [second.register(16 * BB) for _ in range(old_id)]
    other = others[-1]
    for o in others:
        o.array[:] = 0xAB
    assert other.buf_id == old_id, "ids are per session: the second client now holds the first one's old id"
    # The first client notices the new daemon instance, opens a new session and registers
    # its buffer again before the get goes out; the get lands in its own memory.
    first.get_into(seq, blocks_of([2, 3]), buf)
    assert first.instance != old_instance and first.restarts_seen == 1
    np.testing.assert_array_equal(buf.array[: 8 * BB].reshape(8, BB), data[:, :, 2:4].reshape(-1, BB))
    assert all((o.array == 0xAB).all() for o in others), "the second client's buffer was written"
    # A request that still names the old session is refused, never served.
    raw = Raw(daemon.address)
    try:
        header = {"v": PROTOCOL_VERSION, "op": "get", "id": 1, "session": old_token, "seq": seq.uid, "buf": old_id,
                  "offset": 0, "frames": ["blocks"]}
        raw.sock.send_multipart([msgpack.packb(header), blocks_of([2]).tobytes()])
        r = raw.recv()
        assert r["ok"] is False and r["code"] == "session", r
    finally:
        raw.close()
    assert all((o.array == 0xAB).all() for o in others)


def test_a_session_sees_only_its_own_buffers(daemon):
    """Two clients of one user share its sequences, never each other's buffers."""
    a, b = daemon.client(), daemon.client()
    seq = a.create("t", "mine", GEOM)
    a.put(seq, range(GEOM.num_layers), [0], random_pages(2, 1))
    buf_a = a.register(8 * BB)
    buf_a.array[:] = 0x5A
    b.register(8 * BB)
    raw = Raw(daemon.address)
    try:
        for req_id, op in ((7, "get"), (8, "put")):
            header = {"v": PROTOCOL_VERSION, "op": op, "id": req_id, "session": b.session().token, "seq": seq.uid,
                      "buf": buf_a.buf_id, "offset": 0}
            if op == "get":
                raw.sock.send_multipart([msgpack.packb({**header, "frames": ["blocks"]}), blocks_of([0]).tobytes()])
            else:
                raw.sock.send(msgpack.packb({**header, "layers": [0, 1], "pages": [1]}))
            r = raw.recv()
            assert r["ok"] is False and r["code"] == "buffer", r
            assert f"buffer {buf_a.buf_id} is not registered by this session" in r["error"]
    finally:
        raw.close()
    assert (buf_a.array == 0x5A).all()
    assert b.open("t", "mine").num_blocks == a.open("t", "mine").num_blocks


def test_a_shrunk_or_unsealed_buffer_cannot_fault_the_daemon(daemon):
    client = daemon.client()
    seq = client.create("t", "sigbus", GEOM)
    client.put(seq, range(GEOM.num_layers), range(2), random_pages(3, 2))
    buf = client.register(1 << 20)
    # The memfd is sealed before the daemon sees it: shrinking it is refused by the kernel.
    with pytest.raises(PermissionError):
        os.ftruncate(buf.fd, 0)
    client.get_into(seq, blocks_of([0, 1]), buf)
    ch = client.session()
    # An unsealed memfd, a /dev/shm file and a pipe are all refused at registration.
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 1 << 20)
    shm_path = f"/dev/shm/kvdrive-test-{os.getpid()}"
    shm = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(shm, 1 << 20)
    r, w = os.pipe()
    try:
        for fd, words in ((unsealed, "not sealed against shrinking"), (shm, "not sealed"), (r, "not a memfd|not a sealable")):
            with pytest.raises(BufferError_, match=words):
                ch._call({"op": "register", "kind": "memfd", "size": 1 << 20}, [fd])
        # What the attack did: shrink the file under a registration, then move bytes through it.
        os.ftruncate(unsealed, 0)
        os.ftruncate(shm, 0)
    finally:
        for fd in (unsealed, shm, r, w):
            os.close(fd)
        os.unlink(shm_path)
    assert client.get(seq, blocks_of([1])).shape == (4, BB)
    assert daemon.alive()


def test_a_request_given_up_on_does_not_run_later(daemon):
    client = daemon.client(timeout=30)
    seq = client.create("t", "ghost", GEOM)
    data = random_pages(4, 2)
    client.put(seq, range(GEOM.num_layers), range(2), data)
    # The daemon stalls (stopped); the client's delete times out, as one to a dead daemon would.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailableError):
            client.call(Op.DELETE, {"ns": "t", "seq": "ghost"}, timeout=1.0)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # When the daemon runs again, it reads the delete and refuses it: its deadline passed.
    deadline = time.monotonic() + 20
    while client.stats()["counters"].get("bad_requests", 0) < 1:
        assert time.monotonic() < deadline, "the stalled delete was never read"
        time.sleep(0.05)
    assert client.open("t", "ghost").num_blocks == GEOM.num_layers * GEOM.num_kv_heads * 2
    np.testing.assert_array_equal(client.get(seq, blocks_of([1])), data[:, :, 1].reshape(-1, BB))


def test_a_request_queued_while_the_daemon_was_down_is_refused_by_the_new_one(daemon):
    client = daemon.client()
    seq = client.create("t", "ghost2", GEOM)
    client.put(seq, range(GEOM.num_layers), [0], random_pages(5, 1))
    token = client.session().token
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.wait(30)
    # Sent while nobody listens: ZeroMQ keeps it and delivers it once a daemon binds again.
    raw = Raw(daemon.address)
    try:
        raw.send(11, "delete", token, ns="t", seq="ghost2")
        daemon.start()
        r = raw.recv()
        assert r["id"] == 11 and r["ok"] is False and r["code"] == "session", r
    finally:
        raw.close()
    fresh = daemon.client()
    assert fresh.open("t", "ghost2").num_blocks == GEOM.num_layers * GEOM.num_kv_heads


def test_an_expired_request_is_refused_with_its_own_error(daemon):
    client = daemon.client()
    # Sent already past its deadline, and waited for as long as it takes: a wait of the same
    # -1 s polls once for 5 ms, which a loaded machine's daemon may not answer within.
    req_id = client._submit(Op.STATS, timeout=-1.0)
    with pytest.raises(ExpiredError, match="deadline passed"):
        client._wait(req_id, timeout=30.0)


def test_a_dead_clients_buffers_are_unmapped(daemon):
    watcher = daemon.client()
    base = watcher.stats()["mapped_bytes"]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the client that dies holding buffers
        try:
            os.close(read_fd)
            from kvdrive_client import StoreClient  # noqa: PLC0415

            c = StoreClient(daemon.address, timeout=10)
            for _ in range(4):
                c.register(4 << 20)
            os.write(write_fd, b"1")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        assert os.read(read_fd, 1) == b"1"
        assert watcher.stats()["mapped_bytes"] == base + (16 << 20)
        os.kill(pid, signal.SIGKILL)
    finally:
        os.waitpid(pid, 0)
        os.close(read_fd)
    deadline = time.monotonic() + 10
    while watcher.stats()["mapped_bytes"] != base:
        assert time.monotonic() < deadline, "a killed client's buffers stayed mapped"
        time.sleep(0.05)
    assert watcher.stats()["sessions"] == 1


def test_per_session_buffer_limits_leave_room_for_others(daemon_factory):
    d = daemon_factory(extra=["--max-client-buffers", "64M", "--max-mapped", "384M"]).start()
    greedy, modest = d.client(), d.client()
    held = [greedy.register(1 << 20) for _ in range(63)]
    with pytest.raises(BufferError_, match="limit 64 per session|already has 64 buffers"):
        for _ in range(2):
            held.append(greedy.register(1 << 20))
    assert len(held) == 64
    # Bytes: a registration past the per-session cap is refused before anything is mapped.
    big = os.memfd_create("big", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(big, 1 << 40)  # sparse: costs nothing until touched
        fcntl.fcntl(big, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(BufferError_, match="limit 67108864 per session"):
            modest.session()._call({"op": "register", "kind": "memfd", "size": 1 << 40}, [big])
        # and past one user's share of the daemon-wide cap (a quarter of 384 MiB): this
        # user's sessions hold 64 MiB, so 32 MiB more fit, and not a byte past that
        modest.session()._call({"op": "register", "kind": "memfd", "size": 32 << 20}, [big])
        with pytest.raises(BufferError_, match="a user's share of 100663296"):
            modest.session()._call({"op": "register", "kind": "memfd", "size": 1 << 20}, [big])
    finally:
        os.close(big)
    # Closing the greedy session gives its share back to everyone.
    greedy.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            modest.register(1 << 20)
            break
        except BufferError_:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_sigterm_answers_every_request_in_flight_and_clients_learn_at_once(daemon):
    client = daemon.client(timeout=120)
    seq = client.create("t", "term", GEOM)
    client.put(seq, range(GEOM.num_layers), range(8), random_pages(6, 8))
    buf = client.register(64 * BB)
    pending = [client.get_async(seq, blocks_of([i % 8]), buf, offset=(i % 16) * 4 * BB) for i in range(40)]
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    answered = failed = 0
    for p in pending:
        try:
            p.wait()
            answered += 1
        except StoreUnavailableError:
            failed += 1
    assert answered + failed == 40
    assert time.monotonic() - t0 < 15, "clients waited for their timeout"
    assert daemon.proc.wait(30) == 0


def test_a_dead_daemon_is_learned_of_in_seconds_and_close_does_not_wait(daemon):
    client = daemon.client(timeout=120)
    seq = client.create("t", "dead", GEOM)
    client.put(seq, range(GEOM.num_layers), [0], random_pages(7, 1))
    bufs = [client.register(1 << 20) for _ in range(4)]
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    pending = client.get_async(seq, blocks_of([0]), bufs[0])
    os.kill(daemon.proc.pid, signal.SIGKILL)
    daemon.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="ended this client's session"):
        pending.wait()
    assert time.monotonic() - t0 < 5
    with pytest.raises(StoreUnavailableError):
        client.stats()
    assert time.monotonic() - t0 < 10
    t1 = time.monotonic()
    client.close()
    assert time.monotonic() - t1 < 2


@pytest.mark.alone
def test_a_flood_of_lists_does_not_hold_up_another_clients_put(daemon_factory):
    # Write-behind: a durable put's reply waits for its fsync, and kvstored serves the flood
    # meanwhile, as it should; a slow fsync of a shared disk (once, 60 ms: 164 lists) would
    # count against the turn-taking this test measures.
    daemon = daemon_factory(extra=["--sync", "write-behind"]).start()
    writer = daemon.client()
    seq = writer.create("t", "fair", GEOM)
    for i in range(300):
        writer.create("t", f"filler-{i}", GEOM)
    # The writer's staging buffer exists before the race; the first put registers it.
    writer.put(seq, range(GEOM.num_layers), [0], random_pages(8, 1))
    flood = daemon.client()
    token = flood.session().token
    raw = Raw(daemon.address)
    num = 1024
    # Both clients' requests are waiting when kvstored wakes: the flood cannot have been served
    # before the put arrived, however fast this machine is.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    stopped = True
    put_done: list[float] = []
    put = threading.Thread(target=lambda: (writer.put(seq, range(GEOM.num_layers), [1], random_pages(9, 1)),
                                           put_done.append(time.monotonic())))
    try:
        for i in range(num):
            raw.send(i, "list", token, ns="t")
        put.start()
        time.sleep(0.3)  # the put's request leaves this process
        t0 = time.monotonic()
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        put.join(60)
        assert put_done, "the put did not finish"
        put_s = put_done[0] - t0
        # Count the flood's replies that had come by the time the put was acknowledged.
        got = 0
        while raw.sock.poll(0):
            raw.sock.recv()
            got += 1
        rest = 0
        while got + rest < num:
            r = raw.recv(60_000)
            assert r["ok"] or r["code"] == "busy", r
            rest += 1
        flood_s = time.monotonic() - t0
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        raw.close()
    # Served in turn, the put waits behind a few lists; served a connection at a time, behind at
    # least a read batch of them (256).
    assert got < num // 8, f"the put waited behind {got} of {num} lists"
    assert put_s < flood_s / 2, (put_s, flood_s)
    np.testing.assert_array_equal(writer.get(seq, blocks_of([1])), random_pages(9, 1).reshape(-1, BB))


def test_a_connection_past_its_queue_limit_gets_busy_replies(daemon):
    client = daemon.client()
    token = client.session().token
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    raw = Raw(daemon.address)
    try:
        for i in range(3000):
            raw.send(i, "stats", token)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    codes: dict[str, int] = {}
    try:
        for _ in range(3000):
            r = raw.recv(60_000)
            key = "ok" if r["ok"] else r["code"]
            codes[key] = codes.get(key, 0) + 1
    finally:
        raw.close()
    assert codes.get("ok", 0) >= 1024 and codes.get("busy", 0) >= 1, codes
    assert set(codes) <= {"ok", "busy"}, codes


def test_session_lost_error_is_raised_for_writes_and_the_next_call_works(daemon):
    client = daemon.client()
    client.create("t", "again", GEOM)
    restart(daemon)
    # The client's old session is gone: the next call opens a new one first.
    assert client.open("t", "again").num_blocks == 0
    assert client.restarts_seen == 1
    assert issubclass(SessionLostError, StoreUnavailableError)
    buf = client.register(4096)
    assert isinstance(buf, SharedBuffer) and buf.buf_id is not None


def test_a_sequence_says_whether_the_session_that_created_it_is_still_open(daemon):
    """``writing``: true while its creator's session is open, false once it closed or the
    daemon restarted, so that an incomplete sequence nobody will finish can be told from one
    being written; a delete naming a uid deletes only that sequence."""
    watcher = daemon.client()
    with daemon.client() as writer:
        made = writer.create("w", "prompt", GEOM)
        assert made.writing is True and writer.open("w", "prompt").writing is True
        assert watcher.open("w", "prompt").writing is True  # the same user: it sees the writer is still there
        other = watcher.create("w", "other", GEOM)
    deadline = time.monotonic() + 10
    while watcher.open("w", "prompt").writing:  # the writer's session ends with its connection
        assert time.monotonic() < deadline, "a closed session's sequence still says it is written"
        time.sleep(0.05)
    assert watcher.open("w", "other").writing is True
    assert {s["seq"]: s["writing"] for s in watcher.list("w")} == {"prompt": False, "other": True}
    watcher.close()
    restart(daemon)
    with daemon.client() as after:
        assert [after.open("w", n).writing for n in ("prompt", "other")] == [False, False]
        buf = after.register(GEOM.num_kv_heads * BB)
        after.put_from(after.open("w", "other"), [0], [0], buf)  # a writer back after the restart says so
        assert after.open("w", "other").writing is True and after.open("w", "prompt").writing is False
        # Deleted, and the name taken again: a delete of the uid seen before deletes nothing.
        after.delete("w", "prompt", uid=made.uid)
        again = after.create("w", "prompt", GEOM)
        with pytest.raises(NotFoundError, match=f"uid {made.uid}"):
            after.delete("w", "prompt", uid=made.uid)
        assert after.open("w", "prompt").uid == again.uid
        with pytest.raises(NotFoundError):
            after.delete("w", "nothing", uid=again.uid)
        after.delete("w", "other", uid=other.uid)
        assert [s["seq"] for s in after.list("w")] == ["prompt"]
