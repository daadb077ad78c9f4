"""Importance hints between users of one kvstored: a hint ranks its user's own blocks only.

The largest float32 as every block's importance must not push another user's blocks out of
the DRAM tier: a user at or below its fair share of the tier (the tier split equally among
the users with blocks in it) keeps them, and one that arrives later reaches its share
whatever the others' hints. NaN and infinity are refused; other values are kept within
0..MAX_IMPORTANCE.

The second user is a forked child that has become ``nobody`` (see tenants.py); the
daemon tests need root to drop to it and are skipped, saying so, otherwise.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvdrive_client import Geometry, RequestError, StoreClient
from kvstored import protocol
from kvstored.protocol import PROTOCOL_VERSION, SESSION_TOKEN_BYTES, ErrorCode, ProtocolError, parse_request
from tenants import as_other_user, needs_root, shared_dir, verify_clean

# 4 KiB blocks: an 8 MiB DRAM tier holds 2048 of them.
GEOM = Geometry(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes
DRAM = "8M"
LARGEST_FLOAT32 = float(np.finfo(np.float32).max)
VICTIM_PAGES = 16  # 4 x 4 x 16 = 256 blocks, 1 MiB: far below half the tier
FLOOD_PAGES = 128  # 2048 blocks a put: the whole tier


@pytest.fixture
def shared_root():
    yield from shared_dir()


def blocks(num_pages: int, first: int = 0) -> list[tuple[int, int, int]]:
    return [(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads)
            for p in range(first, first + num_pages)]


def put_pages(c: StoreClient, seq, first: int, num_pages: int, importance: float, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, num_pages, BB), np.uint8)
    shape = (GEOM.num_layers, GEOM.num_kv_heads, num_pages)
    c.put(seq, range(GEOM.num_layers), range(first, first + num_pages), data, importance=np.full(shape, importance))
    return data


def flood_dram(address: str, puts: int) -> dict:
    """Put ``puts`` tiers' worth of blocks, every one at the largest float32 importance."""
    c = StoreClient(address, timeout=60)
    seq = c.create("flood", "hot", GEOM)
    for i in range(puts):
        put_pages(c, seq, i * FLOOD_PAGES, FLOOD_PAGES, LARGEST_FLOAT32, seed=100 + i)
    refused = {}
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        try:
            put_pages(c, seq, puts * FLOOD_PAGES, 1, value, seed=7)
            refused[name] = "allowed"
        except RequestError as exc:
            refused[name] = str(exc)
    out = {"refused": refused, "dram_blocks": c.list("flood")[0]["dram_blocks"]}
    c.close()
    return out


def dram_blocks(c: StoreClient, ns: str) -> int:
    return c.list(ns)[0]["dram_blocks"]


def get_summary(c: StoreClient, seq, num_pages: int) -> dict:
    buf = c.register(num_pages * GEOM.num_layers * GEOM.num_kv_heads * BB)
    return c.get_into(seq, blocks(num_pages), buf)


@needs_root
def test_the_largest_importance_does_not_evict_another_users_blocks(shared_root, daemon_at):
    d = daemon_at(shared_root, dram=DRAM, extra=["--socket-mode", "0666"]).start()
    owner = d.client()
    seq = owner.create("tenant", "prompt", GEOM)
    data = put_pages(owner, seq, 0, VICTIM_PAGES, 1.0, seed=1)
    n = VICTIM_PAGES * GEOM.num_layers * GEOM.num_kv_heads
    assert dram_blocks(owner, "tenant") == n
    out = as_other_user(lambda: flood_dram(d.address, puts=4))
    got = get_summary(owner, seq, VICTIM_PAGES)
    assert (got["dram"], got["ssd"]) == (n, 0), f"the other user's importance hints evicted this user's blocks: {got}"
    np.testing.assert_array_equal(owner.get(seq, blocks(VICTIM_PAGES)), data.reshape(-1, BB))
    # The flood kept the rest of the tier, displacing its own blocks; NaN and infinity were refused.
    assert out["dram_blocks"] == 2048 - n, out
    for name in ("nan", "inf"):
        assert out["refused"][name].startswith("[bad_field] 'importance' holds NaN or infinity"), out
    assert d.stop() == 0
    verify_clean(d.ssd)


@needs_root
def test_a_user_arriving_later_reaches_its_share_whatever_the_others_hints(shared_root, daemon_at):
    d = daemon_at(shared_root, dram=DRAM, extra=["--socket-mode", "0666"]).start()
    out = as_other_user(lambda: flood_dram(d.address, puts=2))
    assert out["dram_blocks"] == 2048, out  # alone, a user may take the whole tier
    owner = d.client()
    seq = owner.create("tenant", "prompt", GEOM)
    put_pages(owner, seq, 0, VICTIM_PAGES, 0.0, seed=2)
    n = VICTIM_PAGES * GEOM.num_layers * GEOM.num_kv_heads
    assert dram_blocks(owner, "tenant") == n, "a user below its fair share got no DRAM against the largest hints"
    got = get_summary(owner, seq, VICTIM_PAGES)
    assert (got["dram"], got["ssd"]) == (n, 0), got
    assert d.stop() == 0
    verify_clean(d.ssd)


def put_frames(importance: np.ndarray) -> list[bytes]:
    header = {"v": PROTOCOL_VERSION, "op": "put", "id": 1, "session": b"\0" * SESSION_TOKEN_BYTES, "seq": 1,
              "layers": [0], "pages": list(range(len(importance))), "buf": 1, "offset": 0, "frames": ["importance"]}
    return [msgpack.packb(header), importance.astype(np.float32).tobytes()]


def test_importance_is_kept_within_its_range():
    top = protocol.MAX_IMPORTANCE
    put = parse_request(put_frames(np.array([LARGEST_FLOAT32, -5.0, 0.5, top], np.float32)), 1 << 20, 1 << 22).request
    np.testing.assert_array_equal(put.importance, [top, 0.0, 0.5, top])
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ProtocolError, match="'importance' holds NaN or infinity") as info:
            parse_request(put_frames(np.array([1.0, bad], np.float32)), 1 << 20, 1 << 22)
        assert info.value.code is ErrorCode.BAD_FIELD
