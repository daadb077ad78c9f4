"""What one tenant learns of the others: its own figures only, and uids that count nothing.

Root and the daemon's own uid are told the daemon-wide figures (docs/stats.md). A
sequence's uid is random (kvstored/catalog.py), so the uids a user is given do not
tell it how many sequences others made between two of its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive_client import Geometry, StoreClient
from tenants import as_other_user, needs_root, shared_dir

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
# Figures that count every user's activity: told to root and the daemon's uid only.
DAEMON_WIDE = ("counters", "ssd_file_bytes", "dram_blocks", "cuda_ipc_handles", "blocks", "block_namespaces")


def blocks_of(pages: int) -> np.ndarray:
    return np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in range(pages)])


def test_sequence_uids_are_random_and_kept_across_a_restart(daemon_factory):
    d = daemon_factory(dram="0").start()  # gets read the SSD, where each block's tag holds its uid
    c = d.client()
    seqs = [c.create("ids", f"s{i}", GEOM) for i in range(8)]
    uids = [s.uid for s in seqs]
    assert len(set(uids)) == len(uids) and all(0 < u < 1 << 62 for u in uids)
    assert max(uids) >= 1 << 40, f"uids {uids} are small: they count the sequences made"
    assert sorted(uids) != list(range(min(uids), min(uids) + len(uids)))
    data = np.random.default_rng(0).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, 3, GEOM.block_bytes), np.uint8)
    c.put(seqs[0], range(GEOM.num_layers), range(3), data)
    assert d.stop() == 0

    d.start()
    c = d.client()
    assert sorted(s["uid"] for s in c.list("ids")) == sorted(uids)
    out = c.get(c.open("ids", "s0"), blocks_of(3))
    np.testing.assert_array_equal(out, data.reshape(-1, GEOM.block_bytes))
    more = [c.create("ids", f"t{i}", GEOM).uid for i in range(8)]
    assert not set(more) & set(uids)
    assert d.stop() == 0


@pytest.fixture
def shared_root():
    yield from shared_dir()


def own_view(address: str) -> dict:
    c = StoreClient(address, timeout=10)
    try:
        c.create("mine", "one", GEOM)
        return {"hello": c.hello(), "stats": c.stats()}
    finally:
        c.close()


@needs_root
def test_another_user_is_told_its_own_figures_only(shared_root, daemon_at):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666"]).start()
    owner = d.client()
    for i in range(3):
        seq = owner.create("busy", f"s{i}", GEOM)
        owner.put(seq, range(GEOM.num_layers), range(2),
                  np.ones((GEOM.num_layers, GEOM.num_kv_heads, 2, GEOM.block_bytes), np.uint8))
    daemon_wide = owner.stats()
    assert daemon_wide["scope"] == "daemon" and daemon_wide["counters"]["puts"] == 3
    assert daemon_wide["ssd_used_bytes"] > 0 and daemon_wide["dram_used_bytes"] > 0

    seen = as_other_user(lambda: own_view(d.address))
    stats, hello = seen["stats"], seen["hello"]
    assert stats["scope"] == "user"
    assert not set(DAEMON_WIDE) & set(stats), f"another user was told {set(DAEMON_WIDE) & set(stats)}"
    assert stats["sequences"] == 1 and stats["sessions"] == 1
    assert stats["ssd_used_bytes"] == stats["dram_used_bytes"] == stats["mapped_bytes"] == 0
    assert 0 < stats["index_bytes"] <= stats["index_max_bytes"]
    # What it needs to size its work: the daemon's capacities and limits.
    for key in ("dram_bytes", "ssd_max_bytes", "sync", "format"):
        assert stats[key] == daemon_wide[key], key
    assert not set(DAEMON_WIDE) & set(hello) and "sequences" not in hello and "sessions" not in hello
    assert d.stop() == 0
