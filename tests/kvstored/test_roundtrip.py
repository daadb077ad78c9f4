import numpy as np
import pytest

from kvdrive_client import ExistsError, Geometry, NotFoundError

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)


def random_blocks(rng, layers, pages, geom=GEOM):
    return rng.integers(0, 256, size=(layers, geom.num_kv_heads, pages, geom.block_bytes), dtype=np.uint8)


def all_blocks(geom, pages):
    return np.array([(l, h, p) for l in range(geom.num_layers) for h in range(geom.num_kv_heads) for p in range(pages)])


def test_roundtrip_through_dram(daemon):
    rng = np.random.default_rng(0)
    c = daemon.client()
    seq = c.create("t", "dram", GEOM)
    data = random_blocks(rng, 4, 12)
    assert c.put(seq, range(4), range(12), data, cluster=rng.integers(0, 3, (4, 2, 12))) == 4 * 2 * 12
    blocks = all_blocks(GEOM, 12)
    rng.shuffle(blocks)
    out = c.get(seq, blocks)
    np.testing.assert_array_equal(out, data[blocks[:, 0], blocks[:, 1], blocks[:, 2]])
    counters = c.stats()["counters"]
    assert counters["blocks_dram"] == len(blocks) and counters.get("blocks_ssd", 0) == 0
    assert counters["gets_inline"] == counters["gets"] == 1  # all in DRAM: served without a worker


def test_roundtrip_through_ssd_when_dram_is_off(daemon_factory):
    d = daemon_factory(dram="0").start()
    rng = np.random.default_rng(1)
    c = d.client()
    seq = c.create("t", "ssd", GEOM)
    data = random_blocks(rng, 4, 40)
    c.put(seq, range(4), range(40), data, cluster=rng.integers(0, 5, (4, 2, 40)), order=rng.integers(0, 100, (4, 2, 40)))
    blocks = all_blocks(GEOM, 40)[rng.permutation(4 * 2 * 40)[:100]]
    out = c.get(seq, blocks)
    np.testing.assert_array_equal(out, data[blocks[:, 0], blocks[:, 1], blocks[:, 2]])
    counters = c.stats()["counters"]
    assert counters["blocks_ssd"] == 100 and counters["ssd_reads"] < 100
    assert counters.get("gets_inline", 0) == 0  # SSD reads run on the get workers


@pytest.mark.parametrize("dram", ["64M", "0"])
def test_one_get_gathers_blocks_of_several_sequences(daemon_factory, dram):
    d = daemon_factory(dram=dram).start()
    rng = np.random.default_rng(5)
    c = d.client()
    assert c.hello()["get_seqs"] is True
    seqs = [c.create("t", f"multi{i}", GEOM) for i in range(3)]
    data = [random_blocks(rng, 4, 10) for _ in seqs]
    for seq, x in zip(seqs, data):
        c.put(seq, range(4), range(10), x)
    n = 60
    which = rng.integers(0, 3, n)
    blocks = np.stack([rng.integers(0, 4, n), rng.integers(0, 2, n), rng.integers(0, 10, n)], axis=1)
    buf = c.register(n * GEOM.block_bytes)
    before = c.stats()["counters"]
    reply = c.get_async(seqs[0], blocks, buf, dst=np.arange(n)[::-1].astype(np.int64) * GEOM.block_bytes,
                        seqs=[seqs[i].uid for i in which]).wait()
    got = buf.array[: n * GEOM.block_bytes].reshape(n, GEOM.block_bytes)[::-1]
    expect = np.stack([data[w][l, h, p] for w, (l, h, p) in zip(which, blocks)])
    np.testing.assert_array_equal(got, expect)
    after = c.stats()["counters"]
    assert reply["n"] == n and reply["dram"] + reply["ssd"] == n
    assert after["gets"] - before.get("gets", 0) == 1
    assert (after.get("gets_inline", 0) - before.get("gets_inline", 0) == 1) == (dram != "0")
    other = c.create("t", "wide", Geometry(num_layers=4, num_kv_heads=2, head_dim=128, dtype="float16", page_size=16))
    c.put(other, [0], [0], np.zeros((1, 2, 1, other.geometry.block_bytes), np.uint8))
    with pytest.raises(Exception, match="share a block size"):
        c.get_async(seqs[0], [(0, 0, 0), (0, 0, 0)], buf, seqs=[seqs[0].uid, other.uid]).wait()
    with pytest.raises(NotFoundError, match="of t/multi2"):
        c.get_async(seqs[0], [(0, 0, 0), (0, 0, 10)], buf, seqs=[seqs[0].uid, seqs[2].uid]).wait()


def test_decode_appends_pages_and_blocks_are_write_once(daemon):
    rng = np.random.default_rng(2)
    c = daemon.client()
    seq = c.create("t", "grow", GEOM)
    first = random_blocks(rng, 4, 8)
    c.put(seq, range(4), range(8), first)
    for page in range(8, 40):
        c.put(seq, range(4), [page], random_blocks(rng, 4, 1))
    assert c.open("t", "grow").complete_pages == 40
    with pytest.raises(ExistsError, match="write-once"):
        c.put(seq, [0], [3], random_blocks(rng, 1, 1))
    np.testing.assert_array_equal(c.get(seq, [(2, 1, 5)])[0], first[2, 1, 5])


def test_data_survives_restart(daemon_factory):
    rng = np.random.default_rng(3)
    d = daemon_factory().start()
    c = d.client()
    seq = c.create("tenant", "prompt-1", GEOM)
    data = random_blocks(rng, 4, 20)
    c.put(seq, range(4), range(20), data)
    assert d.stop() == 0
    d.start()
    c = d.client()
    seq = c.open("tenant", "prompt-1")
    assert seq.geometry == GEOM and seq.complete_pages == 20
    blocks = all_blocks(GEOM, 20)
    np.testing.assert_array_equal(c.get(seq, blocks), data.reshape(-1, GEOM.block_bytes))


def test_delete_frees_space_for_reuse(daemon):
    rng = np.random.default_rng(4)
    c = daemon.client()
    for i in range(3):
        seq = c.create("t", f"s{i}", GEOM)
        c.put(seq, range(4), range(16), random_blocks(rng, 4, 16))
        c.delete("t", f"s{i}")
    stats = c.stats()
    # Three sequences were written one after another into the same reclaimed space.
    assert stats["ssd_file_bytes"] <= 4 * 2 * 16 * GEOM.block_bytes
    with pytest.raises(NotFoundError):
        c.open("t", "s0")
    assert c.list("t") == []
