"""Requests served in turn by user and session, not by connection or arrival (kvstored/turns.py)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time

import numpy as np
import pytest

from kvdrive_client import Geometry, StoreClient
from kvstored.turns import FairQueue, Turns
from tenants import needs_root, other_user, shared_dir
from test_sessions import Raw

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=8)
# 8 layers x 8 heads x 8 KiB blocks: 512 KiB a page, 4 MiB a put of 8 pages.
BIG = Geometry(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
BIG_PAGES = 8
BIG_PUT = BIG.num_layers * BIG.num_kv_heads * BIG_PAGES * BIG.block_bytes


def test_turns_go_user_by_user_then_session_by_session():
    turns = Turns()
    for i in range(4):
        turns.push("flood", "a", f"a{i}")
        turns.push("flood", "b", f"b{i}")
    turns.push("victim", "v", "v0")
    order = [turns.pop() for _ in range(len(turns))]
    assert order == ["a0", "v0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    with pytest.raises(IndexError):
        turns.pop()


def test_the_fair_queue_waits_and_times_out():
    q = FairQueue()
    threading.Timer(0.05, q.put, args=("u", "s", "late")).start()
    assert q.get(timeout=10) == "late"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)


@pytest.fixture
def shared_root():
    yield from shared_dir()


@contextlib.contextmanager
def _stopped(daemon):
    """SIGSTOP the daemon until the block ends: what is sent meanwhile waits in its socket,
    so what it serves first is its choice, not the order of arrival."""
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


@pytest.mark.alone
def test_a_small_put_waits_behind_a_few_mib_of_another_sessions_puts(daemon_factory):
    """One session keeps 48 puts of 4 MiB queued; another session's small put, sent once the
    first of them is acknowledged, is acknowledged after a group of a few MiB, not after the
    whole backlog (first come, first served, it would be one of the last)."""
    d = daemon_factory(dram="16M").start()
    flood, victim = d.client(), d.client()
    big = flood.create("t", "big", BIG)
    small = victim.create("t", "small", GEOM)
    page = np.random.default_rng(0).integers(0, 255, GEOM.num_layers * GEOM.num_kv_heads * GEOM.block_bytes,
                                             dtype=np.uint8)
    victim.put(small, range(GEOM.num_layers), [0], page)  # its staging buffer exists before the race
    buf = flood.register(BIG_PUT)
    buf.array[:] = 7
    num = 48
    pending = [flood.put_async(big, range(BIG.num_layers), range(i * BIG_PAGES, (i + 1) * BIG_PAGES), buf, 0)
               for i in range(num)]
    pending[0].wait()
    t0 = time.monotonic()
    victim.put(small, range(GEOM.num_layers), [1], page)
    put_s = time.monotonic() - t0
    for p in pending[1:]:  # the first was waited for above
        assert p.wait()["blocks"] == BIG.num_layers * BIG.num_kv_heads * BIG_PAGES
    rest_s = time.monotonic() - t0
    assert put_s < rest_s / 3, f"the small put took {put_s:.2f} s of the {rest_s:.2f} s the backlog took"
    np.testing.assert_array_equal(victim.get(small, [(0, 0, 1)])[0], page[: GEOM.block_bytes])


@needs_root
def test_a_user_on_many_connections_gets_one_turn_a_round(shared_root, daemon_at):
    """Eight connections of one user flooding lists, one connection of another user asking for
    stats: served a connection at a time, the other user would wait behind eight lists per
    request; served a user at a time, behind one."""
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    flood_client = d.client()
    for i in range(32):  # lists that cost something
        flood_client.create("t", f"seq-{i}", GEOM)
    token = flood_client.session().token
    nobody = other_user()
    os.setegid(nobody.pw_gid)
    os.seteuid(nobody.pw_uid)
    try:  # the kernel names the connecting process's uid: these two connections are nobody's
        victim_client = StoreClient(d.address, timeout=30)
        victim_token = victim_client.session().token
        victim = Raw(d.address)
        victim.send(0, "stats", victim_token)
        assert victim.recv()["ok"]
    finally:
        os.seteuid(0)
        os.setegid(0)
    floods = [Raw(d.address) for _ in range(8)]
    for raw in floods:
        raw.send(0, "stats", token)
        assert raw.recv()["ok"]
    per_flood, asks = 100, 40
    try:
        with _stopped(d):
            for raw in floods:
                for i in range(per_flood):
                    raw.send(i, "list", token, ns="t")
            for i in range(asks):
                victim.send(i, "stats", victim_token)
            time.sleep(0.3)  # the requests leave this process
        for _ in range(asks):
            assert victim.recv(60_000)["ok"]
        served_before = 0
        for raw in floods:  # the flood's replies that had come by the victim's last one
            while raw.sock.poll(0):
                raw.sock.recv()
                served_before += 1
    finally:
        for raw in [*floods, victim]:
            raw.close()
        victim_client.close()
    # A user at a time: about one list per stats request; a connection at a time: about eight.
    assert served_before < 3 * asks, f"{served_before} lists were served before the other user's {asks} requests"
