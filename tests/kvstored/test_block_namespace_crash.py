"""kill -9 during block puts: every acknowledged block is there after a restart, and every
block there is whole (its own bytes, never a checksum miss): a block is stored whole or not at all."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvdrive_client import StoreClient, StoreUnavailableError
from test_block_namespace import BB, block, get, key

BATCH = 8


class BlockPutter(threading.Thread):
    """Puts batches of fresh blocks, one request at a time, recording which were acknowledged."""

    def __init__(self, address: str, first: int) -> None:
        super().__init__(daemon=True)
        self.client = StoreClient(address, timeout=2.0)  # its own: the fixture closes its clients at kill time
        self.next, self.acked, self.error = first, [], None

    def run(self) -> None:
        try:
            buf = self.client._staging_buffer(BATCH * BB)
            while True:
                ids = list(range(self.next, self.next + BATCH))
                for j, i in enumerate(ids):
                    buf.array[j * BB: (j + 1) * BB] = block(i)
                try:
                    self.client.block_put_async("crash", BB, [key(i) for i in ids], buf).wait()
                except StoreUnavailableError:
                    return  # the daemon died under this put: in doubt
                self.acked += ids
                self.next += BATCH
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.mark.parametrize("sync", ["durable", "write-behind"])
def test_kill9_during_block_puts_leaves_whole_blocks_or_none(daemon_factory, sync):
    d = daemon_factory(dram="16M", extra=["--sync", sync]).start()
    acked: list[int] = []
    first = 0
    rng = np.random.default_rng(7)
    for _ in range(2):
        putter = BlockPutter(d.address, first)
        putter.start()
        deadline = time.monotonic() + 30
        while len(putter.acked) < 3 * BATCH and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(float(rng.uniform(0, 0.05)))  # die somewhere in a put
        d.kill9()
        putter.join(10)
        assert putter.error is None, putter.error
        assert len(putter.acked) >= 3 * BATCH, "the putter stalled before the kill"
        if sync == "durable":
            acked += putter.acked
        first = putter.next + BATCH
        d.start()
    c = d.client()
    tried = list(range(first))
    found, data, r = get(c, "crash", tried)
    assert r["damaged"] == []
    missing = [i for i in acked if not found[i]]
    assert not missing, f"acknowledged durable blocks lost: {missing[:8]}"
    for i in np.flatnonzero(found):
        assert (data[i] == block(int(i))).all(), f"block {i} is there with other bytes"
    assert c.block_lookup("crash", [key(i) for i in tried]) == found
    assert d.stop() == 0
