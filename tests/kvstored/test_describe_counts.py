"""What ``open``, ``list`` and ``lookup`` report of a sequence (complete pages, stored pages
and blocks, DRAM-resident blocks) comes from counts the daemon keeps as blocks come and go,
not from a pass over the window: checked here against a model of the puts, against the
DRAM tier's own count, and across a restart, with random puts, gets and deletes over a DRAM
tier too small to hold everything."""

from __future__ import annotations

import numpy as np

from kvdrive_client import Geometry
from tenants import settled

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)  # 4 KiB blocks
BB = GEOM.block_bytes
PAGES = 48


def complete_prefix(stored: np.ndarray) -> int:
    """Pages 0..n-1 every block of which is stored (``stored``: [layers, heads, pages] bool)."""
    full = stored.all(axis=(0, 1))
    return int(np.argmin(full)) if not full.all() else len(full)


def check(client, daemon, names: list[str], stored: dict[str, np.ndarray]) -> None:
    """Each sequence's figures against the model, and their DRAM blocks against the tier's."""
    listed = {s["seq"]: s for s in client.list("t")}
    assert set(listed) == set(names)
    for name in names:
        want = stored[name]
        seq = client.open("t", name)
        assert seq.complete_pages == listed[name]["complete_pages"] == complete_prefix(want), name
        assert seq.num_blocks == listed[name]["num_blocks"] == int(want.sum()), name
    looked = client.lookup("t", names)
    assert looked["pages"] == [complete_prefix(stored[n]) for n in names]
    # The DRAM tier gives back an evicted block's slot once no get still reads it: compared
    # once both figures have settled.
    resident = settled(lambda: (sum(s["dram_blocks"] for s in client.list("t")), client.stats()["dram_blocks"]),
                       daemon, step=0.05)
    assert resident[0] == resident[1]


def test_reported_counts_follow_puts_gets_deletes_evictions_and_a_restart(daemon_factory):
    d = daemon_factory(dram="256K").start()  # 64 blocks: most puts evict
    client = d.client()
    rng = np.random.default_rng(3)
    names = ["a", "b", "c"]
    seqs = {n: client.create("t", n, GEOM) for n in names}
    stored = {n: np.zeros((4, 2, PAGES), bool) for n in names}
    for step in range(60):
        name = names[rng.integers(len(names))]
        layers = np.flatnonzero(rng.random(4) < 0.6) if step % 3 else np.arange(4)
        # Mostly at the edge of the complete prefix (as a prompt is stored), some anywhere.
        edge = min(complete_prefix(stored[name]), PAGES - 4)
        start = int(rng.integers(PAGES - 4)) if step % 5 == 4 else edge
        if step % 5 != 4 and step % 3:  # the layers the edge page lacks, or some of them
            missing = np.flatnonzero(~stored[name][:, :, start].any(axis=1))
            layers = missing if step % 2 or len(missing) < 2 else missing[: len(missing) // 2]
        if not len(layers):
            layers = np.array([int(rng.integers(4))])
        pages = np.arange(start, start + int(rng.integers(1, 5)))
        fresh = ~stored[name][layers][:, :, pages].any(axis=(0, 1))  # blocks are write-once: whole pages new
        pages = pages[fresh]
        if len(pages):
            data = rng.integers(0, 256, (len(layers), 2, len(pages), BB), dtype=np.uint8)
            client.put(seqs[name], layers, pages, data)
            stored[name][np.ix_(layers, np.arange(2), pages)] = True
        held = np.argwhere(stored[names[step % 3]])
        if len(held):  # reads take blocks back into DRAM, evicting others
            client.get(seqs[names[step % 3]], held[rng.permutation(len(held))[:24]])
        if step % 8 == 7:
            check(client, d, names, stored)
    assert all(0 < complete_prefix(stored[n]) < int(stored[n].any(axis=(0, 1)).sum()) for n in names)
    client.delete("t", "b")
    names.remove("b")
    check(client, d, names, stored)
    assert client.stats()["dram_blocks"] > 0
    assert d.stop() == 0
    d.start()
    client = d.client()
    check(client, d, names, stored)
    assert client.stats()["dram_blocks"] == 0
