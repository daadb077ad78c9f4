"""What a put stages and writes is bounded in bytes: tiny blocks cannot turn a small put
into a large footprint (one 4 KiB-aligned extent per (layer, head))."""

import subprocess
import sys

import numpy as np
import pytest

from kvdrive_client import Geometry, RequestError
from kvstored.footprint import MAX_PUT_BYTES, PADDING_SLACK_BYTES, check_put_bytes
from kvstored.protocol import ProtocolError

TINY = Geometry(num_layers=256, num_kv_heads=256, head_dim=1, dtype="float16", page_size=1)  # 4-byte blocks


def test_a_put_of_tiny_blocks_past_the_padding_bound_is_refused_before_anything_is_written(daemon):
    c = daemon.client()
    s = c.create("t", "tiny", TINY)
    payload = np.arange(TINY.num_layers * TINY.num_kv_heads, dtype=np.uint32).view(np.uint8)  # a block each
    with pytest.raises(RequestError, match=r"\[too_large\].*256\.0 MiB on the SSD"):
        c.put(s, range(TINY.num_layers), [0], payload)  # 256 KiB sent, 256 MiB of extents
    stats = c.stats()
    assert stats["ssd_file_bytes"] == 0 and stats["ssd_used_bytes"] == 0

    # Puts of fewer (layer, head) extents stay inside the bound and are taken.
    c.put(s, range(16), [0], payload[: 16 * TINY.num_kv_heads * TINY.block_bytes])
    c.put(s, [255], range(1, 9), np.full((1, TINY.num_kv_heads, 8, TINY.block_bytes), 5, np.uint8))
    got = c.get(s, [(0, 0, 0), (15, 255, 0), (255, 7, 8)])
    assert got[0].tobytes() == payload[:4].tobytes() and (got[2] == 5).all()
    assert got[1].tobytes() == payload[(15 * 256 + 255) * 4 : (15 * 256 + 256) * 4].tobytes()
    daemon.stop()
    done = subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", str(daemon.ssd), "--verify"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_decode_step_of_small_blocks_is_taken(daemon):
    """One page of 256-byte blocks on every (layer, head): 16x its payload, inside the slack."""
    g = Geometry(num_layers=32, num_kv_heads=8, head_dim=64, dtype="float16", page_size=1)
    c = daemon.client()
    s = c.create("t", "decode", g)
    for page in range(3):
        c.put(s, range(g.num_layers), [page], np.full(g.num_layers * g.num_kv_heads * g.block_bytes, page, np.uint8))
    assert (c.get(s, [(31, 7, 2)]) == 2).all()


def test_the_bounds_in_bytes():
    check_put_bytes(32 * 8, 1, 256)  # a decode step: 16x its payload, 1 MiB
    check_put_bytes(1, 1, MAX_PUT_BYTES)  # one extent of the largest footprint
    with pytest.raises(ProtocolError, match="limit 4.0 GiB per put"):
        check_put_bytes(2, 1, MAX_PUT_BYTES // 2 + 1)
    with pytest.raises(ProtocolError, match="limit 16x its payload"):
        check_put_bytes(PADDING_SLACK_BYTES // 4096 + 1, 1, 4)
    check_put_bytes(PADDING_SLACK_BYTES // 4096, 1, 4)  # padded 1024x, but within the slack
