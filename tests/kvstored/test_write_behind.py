"""``--sync write-behind`` writes the data file through the page cache and reads it with
O_DIRECT: a block read back before its pages were written back is the block put, the
flush then drops the file's cached pages, and ``--sync durable`` still writes O_DIRECT.
(Crashes of a write-behind daemon: test_durability.py.)"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np

from kvdrive.layout.format import DATA_FILE
from test_durability import BB, GEOM, page_blocks, page_data, wait_for

PAGES = 48  # 48 pages x 8 blocks of 8 KiB: 3 MiB, past the 1 MiB DRAM tier: most gets read the SSD


def cached_fraction(path) -> float:
    """The share of ``path`` 's pages the page cache holds (mincore over a read-only mapping)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        vec = ctypes.create_string_buffer(pages)
        view = np.frombuffer(m, np.uint8)  # read-only: only its address is used
        try:
            if libc.mincore(view.ctypes.data, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del view
    return sum(b & 1 for b in vec.raw) / pages


def test_write_behind_reads_back_unflushed_blocks_and_drops_the_cache_at_the_flush(daemon_factory):
    d = daemon_factory(dram="1M", extra=["--sync", "write-behind"]).start()
    client = d.client()
    hello = client.hello()
    assert hello["sync"] == "write-behind" and hello["direct_writes"] is False
    seq = client.create("wb", "s", GEOM)
    for page in range(PAGES):
        client.put(seq, range(GEOM.num_layers), [page], page_data(5, page, 1))
    # Read at once: the pages the SSD copy lies in are dirty, or being written back.
    got = client.get(seq, page_blocks(range(PAGES)))
    want = np.concatenate([page_data(5, p, 1).reshape(-1, BB) for p in range(PAGES)])
    np.testing.assert_array_equal(got, want)
    stats = client.stats()
    assert stats["counters"].get("blocks_ssd", 0) > 0, stats["counters"]  # some did come from the SSD
    data = d.ssd / DATA_FILE
    if hello["direct_io"]:  # the flush drops the written pages from the page cache (reads bypass it)
        wait_for(lambda: cached_fraction(data) < 0.1, 10, "the flush to drop the data file's cached pages")
    d.stop()
    d.start()
    client = d.client()
    np.testing.assert_array_equal(client.get(client.open("wb", "s"), page_blocks(range(PAGES))), want)


def test_durable_writes_bypass_the_page_cache(daemon_factory):
    d = daemon_factory(extra=["--sync", "durable"]).start()
    client = d.client()
    hello = client.hello()
    assert hello["direct_writes"] is hello["direct_io"]
    seq = client.create("d", "s", GEOM)
    for page in range(8):
        client.put(seq, range(GEOM.num_layers), [page], page_data(6, page, 1))
    if hello["direct_io"]:
        time.sleep(0.1)
        assert cached_fraction(d.ssd / DATA_FILE) < 0.1


def test_a_small_write_behind_backlog_holds_puts_to_it_and_loses_none(daemon_factory):
    """``--write-behind-backlog 1M`` against 3 MiB of puts: the writes past it wait for the
    disk, and every block reads back, before and after a restart."""
    d = daemon_factory(dram="1M", extra=["--sync", "write-behind", "--write-behind-backlog", "1M"]).start()
    client = d.client()
    hello = client.hello()
    assert hello["write_behind_backlog"] == (1 << 20 if not hello["direct_writes"] and hello["direct_io"] else 0)
    seq = client.create("wb", "small", GEOM)
    for page in range(PAGES):
        client.put(seq, range(GEOM.num_layers), [page], page_data(7, page, 1))
    want = np.concatenate([page_data(7, p, 1).reshape(-1, BB) for p in range(PAGES)])
    np.testing.assert_array_equal(client.get(seq, page_blocks(range(PAGES))), want)
    d.stop()
    d.start()
    client = d.client()
    np.testing.assert_array_equal(client.get(client.open("wb", "small"), page_blocks(range(PAGES))), want)


def test_durable_writes_have_no_backlog(daemon):
    assert daemon.client().hello()["write_behind_backlog"] == 0
