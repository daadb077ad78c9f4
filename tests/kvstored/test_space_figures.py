"""What stats and the metrics say of the SSD tier right after a delete, before any write."""

import numpy as np

from kvdrive_client import Geometry
from test_metrics import free_port, scrape, value

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)


def test_a_delete_frees_its_ssd_bytes_in_stats_and_metrics_at_once(daemon_factory):
    port = free_port()
    d = daemon_factory(extra=["--metrics", f"127.0.0.1:{port}"]).start()
    c = d.client()
    s = c.create("ns", "a", GEOM)
    c.put(s, [0, 1], np.arange(4), np.zeros((2, 2, 4, GEOM.block_bytes), np.uint8))
    assert c.stats()["ssd_used_bytes"] > 0 and value(scrape(port), "kvstored_tier_bytes", tier="ssd") > 0
    c.delete("ns", "a")
    stats = c.stats()
    assert stats["sequences"] == 0 and stats["ssd_used_bytes"] == 0, stats["ssd_used_bytes"]
    assert value(scrape(port), "kvstored_tier_bytes", tier="ssd") == 0
