"""--quota: a namespace past its size loses its least recently used sequences, nothing else."""

import numpy as np
import pytest

from kvdrive_client import Geometry, NotFoundError

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=1024, dtype="float16", page_size=64)  # 256 KiB blocks
BB = GEOM.block_bytes


def put_one(c, ns, name, value):
    s = c.create(ns, name, GEOM)
    c.put(s, [0], [0], np.full(BB, value, np.uint8))
    return s


def names(c, ns):
    return [s["seq"] for s in c.list(ns)]


def test_a_namespace_over_its_quota_loses_its_least_recently_used_sequences(daemon_factory):
    d = daemon_factory(extra=["--quota", "eng/*=1M"]).start()  # 4 blocks of 256 KiB per namespace
    c = d.client()
    for i in range(4):
        put_one(c, "eng/a", f"s{i}", i)
    put_one(c, "other", "big", 9)  # no quota there
    for i in range(4):
        put_one(c, "eng/b", f"s{i}", 10 + i)
    assert names(c, "eng/a") == ["s0", "s1", "s2", "s3"]

    s0 = c.open("eng/a", "s0")
    assert c.get(s0, [(0, 0, 0)])[0, 0] == 0  # s0 is now the most recently used of eng/a
    put_one(c, "eng/a", "s4", 4)
    assert names(c, "eng/a") == ["s0", "s2", "s3", "s4"]  # s1 went: the least recently used
    with pytest.raises(NotFoundError):
        c.open("eng/a", "s1")
    assert names(c, "eng/b") == ["s0", "s1", "s2", "s3"]  # each namespace apart
    assert names(c, "other") == ["big"]
    counters = c.stats()["counters"]
    assert counters["quota_evicted"] == 1 and counters["quota_evicted_bytes"] == BB

    # What is left reads back as stored, and the accounting survives a restart.
    d.stop()
    d.start()
    c = d.client()
    for name, value in (("s0", 0), ("s2", 2), ("s3", 3), ("s4", 4)):
        assert (c.get(c.open("eng/a", name), [(0, 0, 0)]) == value).all()
    put_one(c, "eng/a", "s5", 5)
    assert len(names(c, "eng/a")) == 4


def test_a_put_past_the_quota_by_itself_is_kept(daemon_factory):
    d = daemon_factory(extra=["--quota", "eng=1M"]).start()
    c = d.client()
    put_one(c, "eng", "small", 1)
    s = c.create("eng", "huge", GEOM)
    c.put(s, [0], range(6), np.zeros(6 * BB, np.uint8))  # 1.5 MiB in one put
    assert names(c, "eng") == ["huge"]  # the older sequence made room; the put itself is never undone


def test_quotas_from_a_config_file_and_the_command_line_replaces_them(daemon_factory, tmp_path):
    conf = tmp_path / "kvstored.toml"
    conf.write_text('quota = ["eng/*=1M", "never=1M"]\n')
    d = daemon_factory(extra=["--config", str(conf)]).start()
    c = d.client()
    for i in range(6):
        put_one(c, "eng/x", f"s{i}", i)
    assert len(names(c, "eng/x")) == 4
    d.stop()

    d2 = daemon_factory(extra=["--config", str(conf), "--quota", "other/*=1M"]).start()
    c2 = d2.client()
    for i in range(6):
        put_one(c2, "eng/x", f"s{i}", i)
    assert len(names(c2, "eng/x")) == 6  # the file's quota is replaced by the command line's
