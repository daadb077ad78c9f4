"""``kvstored --metrics``: a real daemon under a small load, its /metrics scraped and checked."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdrive_client import Geometry, NotFoundError, connect
from kvstored.protocol import ErrorCode

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)  # 4 KiB blocks
PAGES = 200  # 4 x 2 x 200 blocks = 6.25 MiB: more than the 4 MiB DRAM tier holds
PUT_PAGES = 50


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    """The one sample ``sample`` (default: the family's own name, or name_total) with ``labels``."""
    family = families[name]
    wanted = {sample} if sample else {name, f"{name}_total"}
    found = [s.value for s in family.samples if s.name in wanted and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {family.samples}"
    return found[0]


def test_metrics_report_a_put_get_load(daemon_factory):
    port = free_port()
    d = daemon_factory(dram="4M", extra=["--metrics", f"127.0.0.1:{port}"]).start()
    rng = np.random.default_rng(7)
    bb = GEOM.block_bytes
    store = connect(d.address)
    try:
        seq = store.create("t", "metrics", GEOM)
        data = rng.integers(0, 256, size=(4, 2, PAGES, bb), dtype=np.uint8)
        puts = 0
        for first in range(0, PAGES, PUT_PAGES):
            store.put(seq, range(4), range(first, first + PUT_PAGES), data[:, :, first:first + PUT_PAGES])
            puts += 1
        blocks = np.array([(l, h, p) for l in range(4) for h in range(2) for p in range(PAGES)])
        gets = 0
        for chunk in np.array_split(blocks, 4):
            np.testing.assert_array_equal(store.get(seq, chunk), data[chunk[:, 0], chunk[:, 1], chunk[:, 2]])
            gets += 1
        with pytest.raises(NotFoundError):
            store.get(seq, [(0, 0, PAGES)])  # never put: one not_found reply
        buf = store.register(1 << 20)
        stats = store.stats()
        m = scrape(port)
    finally:
        store.close()
    counters = stats["counters"]
    n_blocks = 4 * 2 * PAGES

    # Tiers: every block on the SSD, as many in DRAM as 4 MiB holds.
    assert value(m, "kvstored_tier_blocks", tier="ssd") == n_blocks
    assert value(m, "kvstored_tier_bytes", tier="ssd") >= n_blocks * bb
    dram_blocks = value(m, "kvstored_tier_blocks", tier="dram")
    assert 0 < dram_blocks <= (4 << 20) // bb
    assert value(m, "kvstored_tier_bytes", tier="dram") == dram_blocks * bb == stats["dram_used_bytes"]
    assert value(m, "kvstored_tier_capacity_bytes", tier="dram") == 4 << 20

    # Puts and gets: counts, bytes, and one histogram observation per request answered ok.
    assert value(m, "kvstored_puts") == puts == counters["puts"]
    assert value(m, "kvstored_put_bytes") == n_blocks * bb
    assert value(m, "kvstored_gets") == gets == counters["gets"]
    for op, n in (("get", gets), ("put", puts)):
        name = f"kvstored_{op}_latency_seconds"
        assert value(m, name, f"{name}_count") == n
        assert value(m, name, f"{name}_bucket", le="+Inf") == n
        assert 0 < value(m, name, f"{name}_sum") < 60 * n

    # DRAM hits and misses: every block got once, from DRAM or from the SSD.
    hits, from_ssd = value(m, "kvstored_dram_hits"), value(m, "kvstored_ssd_blocks_read")
    assert hits > 0 and from_ssd > 0 and hits + from_ssd == n_blocks
    assert value(m, "kvstored_dram_evictions") == counters["dram_evicted"] > 0
    reads = value(m, "kvstored_ssd_reads")
    assert 0 < reads <= from_ssd  # coalesced: never more reads than blocks
    assert value(m, "kvstored_ssd_read_bytes") >= from_ssd * bb

    # Errors: every code reported, the one refused get under its own.
    assert {s.labels["code"] for s in m["kvstored_errors"].samples} == {c.value for c in ErrorCode}
    assert value(m, "kvstored_errors", code="not_found") == 1
    assert sum(s.value for s in m["kvstored_errors"].samples) == 1

    # The client's session and its buffers (the one registered here, and get's staging buffer).
    assert value(m, "kvstored_sessions") >= 1
    assert value(m, "kvstored_buffers") >= 2
    assert value(m, "kvstored_buffer_bytes") >= buf.size

    assert d.stop() == 0
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # the endpoint went with the daemon


def test_the_ssd_block_gauge_follows_puts_deletes_evictions_and_a_restart(daemon_factory):
    """``kvstored_tier_blocks{tier="ssd"}`` is kept as blocks come and go (no pass over every
    sequence at each scrape): sequences and engine blocks put, some engine blocks deleted one
    by one and some evicted by a quota, a sequence deleted, then the store read back at a
    restart; each time it is the count the store itself reports."""
    port, bb = free_port(), 64 << 10
    d = daemon_factory(extra=["--metrics", f"127.0.0.1:{port}", "--quota", "eng=1M"]).start()
    c = d.client()

    def ssd_blocks() -> float:
        return value(scrape(port), "kvstored_tier_blocks", tier="ssd")

    def engine_put(ids) -> None:
        buf = c._staging_buffer(len(ids) * bb)
        buf.array[: len(ids) * bb] = 7
        c.block_put_async("eng", bb, [b"k%d" % i for i in ids], buf).wait()

    seqs = [c.create("t", f"s{i}", GEOM) for i in range(3)]
    for i, seq in enumerate(seqs):  # 4 x 2 x (i + 1) blocks each
        c.put(seq, range(4), range(i + 1), np.full((4, 2, i + 1, GEOM.block_bytes), i, np.uint8))
    seq_blocks = 8 * (1 + 2 + 3)
    engine_put(range(12))
    engine_put(range(12, 20))  # 20 x 64 KiB past the 1M quota: the 4 least recent are evicted
    assert ssd_blocks() == seq_blocks + 16 == seq_blocks + c.stats()["blocks"]
    assert c.block_delete("eng", [b"k18", b"k19", b"k99"])["deleted"] == 2
    c.delete("t", "s1")
    expected = seq_blocks - 16 + 16 - 2
    assert ssd_blocks() == expected
    assert d.stop() == 0
    d.start()
    assert ssd_blocks() == expected == sum(s["num_blocks"] for s in d.client().list("t")) + d.client().stats()["blocks"]
