"""Write groups committed on the commit thread while the writer writes the next: a failed
commit fails its own group only and leaves nothing behind; deletes and creates see every
put sent before them; groups are published in the order they were written."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvdrive_client import StoreClient
from kvdrive_client.errors import KVDriveError
from kvstored.config import DaemonConfig
from kvstored.protocol import ErrorCode, ProtocolError
from kvstored.server import Server

BB = 1 << 20
N = 16  # a put of 16 MiB closes its group (GROUP_BYTES): the next put is written in a group of its own


@pytest.fixture
def served(tmp_path, request):
    """A kvstored Server on a thread of this process, so its store can be reached into
    (``--sync`` from the test's ``sync`` mark, durable without one)."""
    mark = request.node.get_closest_marker("sync")
    cfg = DaemonConfig(ssd_dir=tmp_path / "ssd", dram_bytes=256 << 20, ssd_max_bytes=1 << 30,
                       address=f"ipc://{tmp_path / 'kvstored.sock'}", sync=mark.args[0] if mark else "durable")
    server = Server(cfg)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = StoreClient(cfg.address, timeout=20.0)
    yield server, client
    client.close()
    server.request_stop()
    thread.join(30)
    assert not thread.is_alive()


def blocks(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (N, BB), dtype=np.uint8)


def put(client: StoreClient, buf, ns: str, tag: str, data: np.ndarray):
    buf.array[: data.nbytes] = data.reshape(-1)
    return client.block_put_async(ns, BB, [f"{tag}{i}".encode() for i in range(N)], buf)


def load(client: StoreClient, buf, ns: str, tag: str) -> tuple[list[bool], np.ndarray]:
    found = client.block_get_async(ns, [f"{tag}{i}".encode() for i in range(N)], buf).wait()["found"]
    return found, buf.array[: N * BB].reshape(N, BB).copy()


def test_a_failed_commit_fails_its_group_only_and_the_next_group_commits(served):
    server, client = served
    real, calls, prepared, first_ended = server.store.make_durable, [], [], []
    real_prepare = server.store.blocks.prepare_put

    def fails_first(writes):
        calls.append(len(writes))
        if len(calls) == 1:
            time.sleep(0.2)  # long enough for the next put to be written meanwhile
            first_ended.append(time.monotonic())
            raise ProtocolError(ErrorCode.IO, "commit failed: OSError: [Errno 5] Input/output error")
        return real(writes)

    def prepare(req, session):
        prepared.append(time.monotonic())
        if len(prepared) == 1:
            time.sleep(0.1)  # the second put is queued by the time the first's group closes
        return real_prepare(req, session)

    server.writer.commits._make_durable = fails_first
    server.store.blocks.prepare_put = prepare
    a, b, out = client.register(N * BB), client.register(N * BB), client.register(N * BB)
    b.array[:] = blocks(2).reshape(-1)
    first = put(client, a, "eng", "a", blocks(1))
    second = client.block_put_async("eng", BB, [f"b{i}".encode() for i in range(N)], b)
    with pytest.raises(KVDriveError, match="Input/output error"):
        first.wait()
    assert second.wait()["stored"] == N
    assert len(calls) == 2 and prepared[1] < first_ended[0]  # the second was written while the first committed
    assert client.block_lookup("eng", [f"a{i}".encode() for i in range(N)]) == [False] * N
    found, got = load(client, out, "eng", "b")
    assert found == [True] * N
    np.testing.assert_array_equal(got, blocks(2))
    assert client.stats()["counters"]["commits_failed"] == 1
    # Nothing of the failed group is left pending: the same keys store again.
    server.writer.commits._make_durable = real
    assert put(client, a, "eng", "a", blocks(3)).wait()["stored"] == N
    found, got = load(client, out, "eng", "a")
    assert found == [True] * N
    np.testing.assert_array_equal(got, blocks(3))


def test_a_delete_sees_the_put_in_commit_before_it(served):
    server, client = served
    real = server.store.make_durable

    def slow(writes):
        time.sleep(0.2)
        return real(writes)

    server.writer.commits._make_durable = slow
    a = client.register(N * BB)
    stored = put(client, a, "eng", "d", blocks(4))
    assert client.block_delete("eng", [f"d{i}".encode() for i in range(N)])["deleted"] == N
    assert stored.wait()["stored"] == N
    assert client.block_lookup("eng", [f"d{i}".encode() for i in range(N)]) == [False] * N


def test_groups_are_published_in_the_order_they_were_written(served):
    server, client = served
    order: list[int] = []
    real_publish = server.store.publish_puts

    def publish(writes):
        order.extend(int(p.page_ids[0]) for p in writes)
        return real_publish(writes)

    server.store.publish_puts = publish
    bufs = [client.register(N * BB) for _ in range(6)]
    sent = [put(client, buf, "eng", f"g{j}-", blocks(10 + j)) for j, buf in enumerate(bufs)]
    assert [s.wait()["stored"] for s in sent] == [N] * 6
    assert len(order) == 6 and order == sorted(order)
    out = client.register(N * BB)
    for j in range(6):
        found, got = load(client, out, "eng", f"g{j}-")
        assert found == [True] * N
        np.testing.assert_array_equal(got, blocks(10 + j))


@pytest.mark.sync("write-behind")
def test_write_behind_is_not_flushed_after_every_group_the_commit_thread_commits(served):
    """Eight puts of 16 MiB sent at once: each closes its group with the next one waiting, so
    the commit thread commits them; write-behind still flushes at most once a second, not
    at each commit's wake-up."""
    server, client = served
    real_sync, syncs = server.store.sync, []
    server.store.sync = lambda: (syncs.append(time.monotonic()), real_sync())
    bufs = [client.register(N * BB) for _ in range(8)]
    t0 = time.monotonic()
    sent = [put(client, buf, "eng", f"w{j}-", blocks(20 + j)) for j, buf in enumerate(bufs)]
    assert [s.wait()["stored"] for s in sent] == [N] * 8
    took = time.monotonic() - t0
    during = [t for t in syncs if t <= t0 + took]
    assert len(during) <= 1 + int(took), (len(during), took)


@pytest.mark.sync("write-behind")
def test_a_failed_write_behind_flush_is_counted_and_the_writer_goes_on(served, caplog):
    server, client = served
    real, flushes = server.store.ssd.sync, []

    def fails_first():
        flushes.append(time.monotonic())
        if len(flushes) == 1:
            raise OSError(5, "Input/output error")
        real()

    server.store.ssd.sync = fails_first
    a, out = client.register(N * BB), client.register(N * BB)
    with caplog.at_level("ERROR", logger="kvstored.writer"):
        assert put(client, a, "eng", "a", blocks(4)).wait()["stored"] == N
        deadline = time.monotonic() + 10
        while not flushes and time.monotonic() < deadline:  # flushed within about a second
            time.sleep(0.05)
    assert flushes and "write-behind flush failed" in caplog.text
    assert client.stats()["counters"]["flushes_failed"] == 1
    # The writer is still there: the next put is stored, flushed and read back.
    assert put(client, a, "eng", "b", blocks(5)).wait()["stored"] == N
    found, got = load(client, out, "eng", "b")
    assert found == [True] * N
    np.testing.assert_array_equal(got, blocks(5))
    deadline = time.monotonic() + 10
    while len(flushes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(flushes) == 2 and client.stats()["counters"]["flushes_failed"] == 1
