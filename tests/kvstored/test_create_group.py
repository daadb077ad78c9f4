"""Creates sent together are created in one catalog commit, each told its own result, and
every acknowledged one survives a kill -9 (an engine creates a sequence per block, many at
once: one fsync each made its stores a third of the disk's speed)."""

import os
import signal

import pytest

from kvdrive.protocol import Op
from kvdrive_client import ExistsError, Geometry, RequestError

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)
OTHER = Geometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)


def _create(c, name, geometry=GEOM, exist_ok=True):
    return c._submit(Op.CREATE, {"ns": "eng", "seq": name, "geometry": geometry.to_dict(), "exist_ok": exist_ok})


def test_creates_sent_together_share_a_commit_and_each_gets_its_own_answer(daemon):
    c = daemon.client()
    c.create("eng", "taken", OTHER)
    before = c.stats()["counters"]
    names = [f"blk-{i}" for i in range(30)]
    # Held still while the requests queue up, so the writer finds them all at once.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        fresh = [_create(c, n) for n in names]
        again = _create(c, "blk-3")  # the same name in the same group, exist_ok
        twice = _create(c, "blk-4", exist_ok=False)  # the same name, not exist_ok
        clash = _create(c, "taken")  # exists with another geometry
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    replies = [c._wait(r) for r in fresh]
    assert [r["seq"] for r in replies] == names
    assert len({r["uid"] for r in replies}) == len(names)
    assert c._wait(again)["uid"] == replies[3]["uid"]
    with pytest.raises(ExistsError):
        c._wait(twice)
    with pytest.raises(ExistsError, match="another geometry"):
        c._wait(clash)
    after = c.stats()["counters"]
    assert after["creates"] - before["creates"] == len(names)
    # Far fewer commits than sequences. How many creates each commit finds queued depends on how
    # fast the daemon's socket thread hands over what waited while it was stopped: 1 to 5
    # commits were seen for these 33 requests.
    assert after["create_commits"] - before["create_commits"] <= 8

    daemon.kill9()
    daemon.start()
    c = daemon.client()
    found = c.lookup("eng", names)
    assert found["uids"] == [r["uid"] for r in replies] and found["pages"] == [0] * len(names)


def test_a_bad_create_among_good_ones_is_refused_alone(daemon):
    c = daemon.client()
    c.lookup("eng", ["warm"])  # the session is open before the daemon is held still
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        good = [_create(c, f"ok-{i}") for i in range(5)]
        bad = c._submit(Op.CREATE, {"ns": "eng", "seq": "bad", "geometry": {**GEOM.to_dict(), "head_dim": 0},
                                    "exist_ok": True})
        good.append(_create(c, "ok-last"))
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    with pytest.raises(RequestError):
        c._wait(bad)
    assert [c._wait(r)["seq"] for r in good] == [f"ok-{i}" for i in range(5)] + ["ok-last"]
    assert c.lookup("eng", ["bad"])["pages"] == [-1]
