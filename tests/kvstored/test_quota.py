"""--quota: a namespace past its size loses its least recently used sequences, nothing else."""

import subprocess
import sys

import numpy as np
import pytest

from kvdrive_client import Geometry, NotFoundError
from kvdrive_client.integrations.blocks import BlockStore

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=1024, dtype="float16", page_size=64)  # 256 KiB blocks
BB = GEOM.block_bytes


def put_one(c, ns, name, value):
    s = c.create(ns, name, GEOM)
    c.put(s, [0], [0], np.full(BB, value, np.uint8))
    return s


def names(c, ns):
    """The namespace's sequences, oldest first (a list is in uid order, and uids are random)."""
    return [s["seq"] for s in sorted(c.list(ns), key=lambda s: s["created"])]


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


def verify_clean(d) -> None:
    """The stopped store's catalog and every block check out."""
    d.stop()
    done = subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", str(d.ssd), "--verify"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_sequence_not_yet_put_into_is_never_a_victim(daemon_factory):
    d = daemon_factory(extra=["--quota", "eng=1M"]).start()
    owner, other = d.client(), d.client()
    for i in range(4):
        put_one(other, "eng", f"s{i}", i)
    fresh = owner.create("eng", "fresh", GEOM)  # the least recently used of all, but empty
    put_one(other, "eng", "s4", 4)  # past the quota: s0 goes, the empty sequence stays
    assert names(owner, "eng") == ["s1", "s2", "s3", "fresh", "s4"]
    owner.put(fresh, [0], [0], np.full(BB, 7, np.uint8))
    assert names(owner, "eng") == ["s2", "s3", "fresh", "s4"]
    assert (owner.get(fresh, [(0, 0, 0)]) == 7).all()
    assert owner.stats()["counters"]["quota_evicted"] == 2
    verify_clean(d)


def test_an_adapter_store_at_its_quota_stores_every_key_of_the_batch(daemon_factory):
    """An engine adapter stores a batch as one block put: none of its blocks may be taken
    for the batch's own room."""
    num_keys, block_bytes = 64, 64 << 10
    d = daemon_factory(extra=["--quota", f"vllm/*={2 * num_keys * block_bytes}"]).start()
    store = BlockStore(block_bytes, engine="vllm", model="m", address=d.address)
    try:
        batches = [[f"k{b}-{i}" for i in range(num_keys)] for b in range(3)]
        for b, keys in enumerate(batches):
            sources = [np.full(block_bytes, (b * num_keys + i) % 251, np.uint8) for i in range(num_keys)]
            assert store.store(keys, sources) == [True] * num_keys, f"batch {b}: {store.stats()}"
        assert store.lookup(batches[0]) == [False] * num_keys  # the oldest batch made the room
        assert store.lookup(batches[1] + batches[2]) == [True] * (2 * num_keys)
        targets = [np.zeros(block_bytes, np.uint8) for _ in range(num_keys)]
        assert store.load(batches[2], targets) == [True] * num_keys
        assert all((t == (2 * num_keys + i) % 251).all() for i, t in enumerate(targets))
    finally:
        store.close()
    verify_clean(d)


def test_a_namespace_lists_and_evicts_from_its_own_entries_only(daemon_factory):
    """Quotas and listings read a namespace's own entries (kept by namespace in the index, not
    found by a pass over every sequence): a listing pages through 40 sequences of one namespace
    beside others of the same user, and a quota past its limit evicts only its own."""
    d = daemon_factory(extra=["--quota", "eng/q=1M"]).start()  # 4 blocks of 256 KiB
    c = d.client()
    for i in range(40):
        c.create("eng/many", f"s{i:02d}", GEOM)
        if i % 8 == 0:
            c.create("eng/other", f"o{i:02d}", GEOM)
    listed = c.list("eng/many")
    assert sorted(s["seq"] for s in listed) == [f"s{i:02d}" for i in range(40)]
    assert [s["uid"] for s in listed] == sorted(s["uid"] for s in listed)  # uid order, across pages
    assert len(c.list()) == 45
    for i in range(5):
        put_one(c, "eng/q", f"q{i}", i)
    assert names(c, "eng/q") == ["q1", "q2", "q3", "q4"]
    c.delete("eng/many", "s07")
    assert len(c.list("eng/many")) == 39 and len(c.list("eng/other")) == 5
