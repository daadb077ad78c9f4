"""The block index shared by users of one kvstored: each user's sequences take at most its
share (--index-max-per-uid), so another user's ordinary put still fits; and an --index-max
the host could never back is refused at start.

The flooding user is a forked child that has become ``nobody`` (see tenants.py); these
tests need root to drop to it and are skipped, saying so, otherwise.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvdrive_client import Geometry, StoreClient, StoreFullError
from kvstored.config import DaemonConfig
from kvstored.preflight import meminfo
from tenants import as_other_user, needs_root, other_user, shared_dir, verify_clean

MiB = 1 << 20
INDEX_MAX = 64 * MiB
# 4-byte blocks on 16 x 16 (layer, head) pairs: a put of two pages 1025 apart sends 2 KiB and
# opens a window of 1026 pages, 8 MiB of index (32 bytes a slot), within the SSD footprint limit.
TINY = Geometry(num_layers=16, num_kv_heads=16, head_dim=1, dtype="float16", page_size=1)
PLAIN = Geometry(num_layers=32, num_kv_heads=8, head_dim=8, dtype="float16", page_size=16)
SPANS = (1025, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 0)


@pytest.fixture
def shared_root():
    yield from shared_dir()


def flood_index(address: str) -> dict:
    """Open ever smaller windows in new sequences until the daemon refuses: the index as full
    as this user can make it."""
    c = StoreClient(address, timeout=30)
    refusals: list[str] = []
    made = 0
    for span in SPANS:
        pages = [0, span] if span else [0]
        data = np.zeros((TINY.num_layers, TINY.num_kv_heads, len(pages), TINY.block_bytes), np.uint8)
        while True:
            try:
                seq = c.create("flood", f"s{made}", TINY)
                made += 1
                c.put(seq, range(TINY.num_layers), pages, data)
            except StoreFullError as exc:
                refusals.append(str(exc))
                break
    out = {"refusals": refusals, "made": made, "index_bytes": c.stats()["index_bytes"]}
    c.close()
    return out


@needs_root
def test_one_user_cannot_fill_the_index_for_another(shared_root, daemon_at):
    d = daemon_at(shared_root, extra=["--socket-mode", "0666", "--index-max", "64M"]).start()
    owner = d.client()
    seq = owner.create("tenant", "prompt", PLAIN)
    out = as_other_user(lambda: flood_index(d.address))
    # The other user's ordinary put still fits, and reads back.
    data = np.random.default_rng(1).integers(0, 256, (PLAIN.num_layers, PLAIN.num_kv_heads, 16, PLAIN.block_bytes),
                                             dtype=np.uint8)
    assert owner.put(seq, range(PLAIN.num_layers), range(16), data) == PLAIN.num_layers * PLAIN.num_kv_heads * 16
    got = owner.get(seq, [(31, h, p) for h in range(PLAIN.num_kv_heads) for p in range(16)])
    np.testing.assert_array_equal(got, data[31].reshape(-1, PLAIN.block_bytes))
    # The flooding user was stopped at its share, told which limit and what to do.
    share = INDEX_MAX * 7 // 8
    assert out["refusals"] and out["made"] >= 6, out
    assert all(f"block index full for uid {other_user().pw_uid}" in r and "--index-max-per-uid" in r
               for r in out["refusals"]), out["refusals"]
    assert share - 64 * 1024 < out["index_bytes"] <= share + 2048, out  # its share, and the owner's one entry
    stats = owner.stats()
    assert stats["index_bytes"] <= stats["index_max_bytes"] == INDEX_MAX
    assert d.stop() == 0
    verify_clean(d.ssd)


def test_an_index_max_the_host_cannot_back_is_refused_at_start(tmp_path):
    total, _ = meminfo()
    if not total:
        pytest.skip("/proc/meminfo cannot be read: nothing to check --index-max against")
    too_much = f"{(total >> 30) + 1}G"
    cmd = [sys.executable, "-m", "kvstored", "--ssd", str(tmp_path / "ssd"), "--dram", "64M", "--index-max", too_much,
           "--listen", f"ipc://{tmp_path / 'k.sock'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"kvstored started with --index-max {too_much} on a host of {total >> 30} GiB:\n{out}")
    lines = out.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, out
    assert "--index-max" in lines[0] and "choose a smaller --index-max" in lines[0], lines[0]


def test_a_share_per_uid_must_leave_room_for_others(tmp_path):
    with pytest.raises(ValueError, match="--index-max-per-uid must be less than --index-max"):
        DaemonConfig(tmp_path, 0, index_max_bytes=64 * MiB, index_max_per_uid_bytes=64 * MiB)
    assert DaemonConfig(tmp_path, 0, index_max_bytes=64 * MiB).index_max_per_uid_bytes == 56 * MiB
