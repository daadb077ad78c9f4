"""The check every kvstored test ends with (tests/kvstored/conftest.py) finds damage."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvdrive.layout.format import DATA_FILE
from kvdrive_client import Geometry
from store_check import verify_store

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)


def test_stores_are_checked_as_their_daemons_stop(daemon_process, daemon):
    assert daemon_process.after_exit is not None
    c = daemon.client()
    c.put(c.create("t", "s", GEOM), [0], range(4), np.ones((1, 1, 4, GEOM.block_bytes), np.uint8))
    assert daemon.stop() == 0
    assert daemon.checked


@pytest.mark.damages_store
def test_a_flipped_byte_fails_the_check(daemon_process, daemon):
    assert daemon_process.after_exit is None  # this test damages its store on purpose
    c = daemon.client()
    c.put(c.create("t", "s", GEOM), [0], range(4), np.ones((1, 1, 4, GEOM.block_bytes), np.uint8))
    assert daemon.stop() == 0
    verify_store(daemon.ssd)  # sound as the daemon left it
    fd = os.open(daemon.ssd / DATA_FILE, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, 100)[0] ^ 0x10]), 100)
    finally:
        os.close(fd)
    with pytest.raises(AssertionError, match="1 bad of 4 blocks"):
        verify_store(daemon.ssd)
