"""A BlockStore call keeps two requests in flight, each from a staging slot of its own, and
never reuses a slot the daemon may still be reading or writing."""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive_client import StoreUnavailableError
from kvdrive_client.integrations import blocks as blocks_mod
from kvdrive_client.integrations.blocks import BlockStore

BB = 64 << 10  # blocks of 64 KiB
SLOT_BLOCKS = 4  # a 512 KiB staging region: two slots of four blocks


def sources(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BB, dtype=np.uint8) for _ in range(n)]


def small_store(daemon) -> BlockStore:
    store = BlockStore(BB, engine="test", model="m", address=daemon.address, staging_bytes=2 * SLOT_BLOCKS * BB)
    assert (store.depth, store.sub_blocks) == (2, SLOT_BLOCKS)
    return store


class InFlight:
    """Counts the requests a store or load has sent and not yet waited for."""

    def __init__(self, monkeypatch) -> None:
        self.now = self.most = 0
        for cls in (blocks_mod.PendingPut, blocks_mod.PendingGet):
            monkeypatch.setattr(cls, "wait", self._wrap(cls.wait))
        client = blocks_mod.StoreClient
        for name in ("block_put_async", "block_get_async"):
            monkeypatch.setattr(client, name, self._count(getattr(client, name)))

    def _count(self, send):
        def sent(*args, **kwargs):
            self.now += 1
            self.most = max(self.most, self.now)
            return send(*args, **kwargs)
        return sent

    def _wrap(self, wait):
        def waited(pending, *args, **kwargs):
            self.now -= 1
            return wait(pending, *args, **kwargs)
        return waited


def test_a_store_and_a_load_of_many_slots_round_trip_with_two_requests_in_flight(daemon, monkeypatch):
    store = small_store(daemon)
    flight = InFlight(monkeypatch)
    keys = [f"k{i}" for i in range(23)]  # six requests, the last of three blocks
    blocks = sources(len(keys), seed=1)
    assert store.store(keys, blocks) == [True] * len(keys)
    assert flight.most == 2 and flight.now == 0
    flight.most = 0
    targets = [np.zeros(BB, np.uint8) for _ in keys]
    order = [*range(1, len(keys)), 0]  # loaded in another order than stored
    assert store.load([keys[i] for i in order], [targets[i] for i in order]) == [True] * len(keys)
    assert flight.most == 2 and flight.now == 0
    for want, got in zip(blocks, targets):
        np.testing.assert_array_equal(got, want)
    c = store.stats()
    assert c["blocks_stored"] == c["blocks_loaded"] == len(keys)
    store.close()


def test_a_load_that_fits_one_slot_is_split_in_two_gets_once_it_is_large(daemon, monkeypatch):
    """A load of at least twice LOAD_SPLIT_BYTES goes as two gets in flight, so that the copy
    out of the first overlaps the daemon's fill of the second; a smaller one as one get."""
    monkeypatch.setattr(blocks_mod, "LOAD_SPLIT_BYTES", 2 * BB)
    store = BlockStore(BB, engine="test", model="m", address=daemon.address, staging_bytes=2 * 16 * BB)
    keys = [f"k{i}" for i in range(7)]
    blocks = sources(len(keys), seed=3)
    assert store.store(keys, blocks) == [True] * len(keys)
    gets = []
    send = blocks_mod.StoreClient.block_get_async
    monkeypatch.setattr(blocks_mod.StoreClient, "block_get_async",
                        lambda client, ns, ks, *a, **kw: gets.append(len(ks)) or send(client, ns, ks, *a, **kw))
    flight = InFlight(monkeypatch)
    for n, want in ((3, [3]), (4, [2, 2]), (7, [4, 3])):
        gets.clear()
        targets = [np.zeros(BB, np.uint8) for _ in range(n)]
        assert store.load(keys[:n], targets) == [True] * n
        assert gets == want
        for block, got in zip(blocks, targets):
            np.testing.assert_array_equal(got, block)
    assert flight.most == 2 and flight.now == 0
    store.close()


def test_a_slot_whose_put_has_an_unknown_fate_is_never_copied_into_again(daemon, monkeypatch):
    """The first put's reply is lost (as on a timeout) while the second is in flight: the
    call fails those blocks and gives the region up, so the next call copies into a new
    one, and every block stored holds its own bytes."""
    store = small_store(daemon)
    keys, blocks = [f"a{i}" for i in range(8)], sources(8, seed=2)
    real_wait, calls = blocks_mod.PendingPut.wait, []

    def lost_once(pending, *args, **kwargs):
        calls.append(pending)
        reply = real_wait(pending, *args, **kwargs)  # it ran; the client cannot know
        if len(calls) == 1:
            raise StoreUnavailableError("no reply within the timeout")
        return reply

    first = store.stores._channels[0]
    monkeypatch.setattr(blocks_mod.PendingPut, "wait", lost_once)
    assert store.store(keys, blocks) == [False] * 8
    assert store.stats()["store_failed"] == 8
    assert first._region is None and first._client is None  # given up, not reused
    monkeypatch.setattr(blocks_mod.PendingPut, "wait", real_wait)
    store._down_until = 0.0  # the outage hold-off is not what this test is about
    more, more_blocks = [f"b{i}" for i in range(8)], sources(8, seed=3)
    assert store.store(more, more_blocks) == [True] * 8
    targets = [np.zeros(BB, np.uint8) for _ in range(16)]
    got = store.load(keys + more, targets)
    for i, (ok, want, t) in enumerate(zip(got, blocks + more_blocks, targets)):
        if ok:  # the lost put may have stored its blocks: then with their own bytes
            np.testing.assert_array_equal(t, want, err_msg=f"block {i}")
    assert all(got[8:])
    store.close()


@pytest.mark.parametrize("staging_blocks, depth", [(1, 1), (3, 2), (4, 2)])
def test_a_region_of_fewer_than_two_blocks_per_slot_still_holds_whole_blocks(staging_blocks, depth):
    store = BlockStore(BB, engine="test", model="m", address="ipc:///nonexistent", staging_bytes=staging_blocks * BB)
    assert store.depth == depth and store.sub_blocks * depth <= staging_blocks and store.sub_blocks >= 1
    store.close()


def test_open_early_connects_and_registers_every_channel_before_the_first_call(daemon, monkeypatch):
    store = small_store(daemon)
    assert store.wait_open(0)  # nothing started: nothing to wait for
    store.open_early()
    assert store.wait_open(10)
    lanes = (store.loads, store.stores)
    assert all(ch.opened for lane in lanes for ch in lane._channels)
    assert [lane.busy() for lane in lanes] == [0, 0]  # every channel handed back
    registered = []
    monkeypatch.setattr(blocks_mod.StoreClient, "register",
                        lambda self, *a, **k: registered.append(a) or pytest.fail("registered again"))
    keys, blocks = [f"e{i}" for i in range(6)], sources(6, seed=4)
    assert store.store(keys, blocks) == [True] * 6
    targets = [np.zeros(BB, np.uint8) for _ in keys]
    assert store.load(keys, targets) == [True] * 6
    for want, got in zip(blocks, targets):
        np.testing.assert_array_equal(got, want)
    assert registered == []
    assert store.loads.open(1.0) == store.stores.open(1.0) == 0  # nothing left to open
    store.close()


def test_open_early_without_a_daemon_only_logs_and_calls_are_misses(tmp_path, caplog):
    store = BlockStore(BB, engine="test", model="m", address=f"ipc://{tmp_path}/none.sock", timeout=0.5,
                       staging_bytes=2 * SLOT_BLOCKS * BB)
    with caplog.at_level("INFO", logger="kvdrive_client.integrations.blocks"):
        store.open_early()
        assert store.wait_open(10)
    assert "not opened early" in caplog.text
    assert not any(ch.opened for ch in store.loads._channels)
    assert store.load(["k"], [np.zeros(BB, np.uint8)]) == [False]
    store.close()


def test_an_engine_that_exits_while_channels_still_open_early_prints_no_traceback(daemon, tmp_path):
    """The opening thread is a daemon thread: at the interpreter's exit the clients'
    finalisers close the sockets it is still waiting on, which must end it quietly (the
    daemon here is stopped, so its wait would last seconds more)."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import sys, time, traceback\n"
        "from kvdrive_client.integrations.blocks import BlockStore\n"
        f"store = BlockStore({BB}, engine='test', model='m', address={daemon.address!r}, timeout=5.0,\n"
        f"                   staging_bytes={2 * SLOT_BLOCKS * BB})\n"
        "store.open_early()\n"
        "deadline = time.monotonic() + 10\n"
        "while not any(f.name == 'ping' for f in traceback.extract_stack(\n"
        "        sys._current_frames().get(store._opener.ident, sys._getframe()))):\n"
        "    assert time.monotonic() < deadline, 'the opening thread never waited on the daemon'\n"
        "    time.sleep(0.01)\n"
        "print('exiting', flush=True)\n"
    )
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert run.returncode == 0 and "exiting" in run.stdout, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
