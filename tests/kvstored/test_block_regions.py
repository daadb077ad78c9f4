"""Engine blocks that lie in regions (an SGLang page's K and V, apart in its host pool),
moved in place through a real kvstored: a put and a get with an offset per region,
the namespace's parts kept whole in regions, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive.protocol import ErrorCode
from kvdrive.protocol.blocks import block_geometry
from test_pool_buffer import POOL, all_refused, key, memfd_pool, started_pool

BB = 64 << 10
HALF = BB // 2
# K and V of 4 blocks at scattered places, not 4 KiB-aligned; the get puts them elsewhere.
PUT_AT = [[7, 2 << 20], [HALF + 7, (2 << 20) + HALF], [5 * BB + 1, 9 * BB + 3], [3 * BB, 30 * BB + 11]]
GET_AT = [[40 * BB + 5, 20 * BB], [50 * BB, 11], [41 * BB + 5, 60 * BB - 1], [12 * BB + 9, 22 * BB]]


def blk(i: int) -> np.ndarray:
    return np.random.default_rng(500 + i).integers(0, 256, BB, dtype=np.uint8)


def put_regions(engine: np.ndarray, at, ids) -> None:
    for (k, v), i in zip(at, ids):
        engine[k: k + HALF], engine[v: v + HALF] = blk(i)[:HALF], blk(i)[HALF:]


def test_the_geometry_keeps_each_part_in_one_region():
    assert block_geometry(BB).num_layers == 1
    for regions, parts in [(2, 2), (4, 4), (64, 64)]:
        assert block_geometry(BB, regions).num_layers == parts
    assert block_geometry(80 << 20, 2).num_layers == 2  # 40 MiB parts: one per region
    assert block_geometry(256 << 20, 2).num_layers == 4  # 64 MiB parts: two per region
    with pytest.raises(ValueError, match="3 equal regions"):
        block_geometry(BB, 3)
    with pytest.raises(ValueError, match="regions must be"):
        block_geometry(BB, 0)


@pytest.mark.parametrize("dram", ["64M", "0"])
def test_blocks_in_regions_round_trip_byte_exact(daemon_factory, dram):
    d, c, _, engine, pool = started_pool(daemon_factory, dram)
    put_regions(engine, PUT_AT, range(4))
    ks = [key(i) for i in range(4)]
    r = c.block_put_async("eng", BB, ks, pool, offsets=np.ravel(PUT_AT), regions=2).wait()
    assert (r["stored"], r["present"]) == (4, 0)
    engine[:] = 0xEE
    r = c.block_get_async("eng", ks[::-1], pool, offsets=np.ravel(GET_AT), regions=2).wait()
    assert r["found"] == [True] * 4 and r["damaged"] == []
    expect = np.full(POOL, 0xEE, np.uint8)
    put_regions(expect, GET_AT, [3, 2, 1, 0])
    np.testing.assert_array_equal(engine, expect)  # each region in place, no other byte touched
    # The same blocks whole, one offset per key, and contiguous in a staging buffer.
    buf = c.register(4 * BB)
    assert c.block_get_async("eng", ks, buf).wait()["found"] == [True] * 4
    for i in range(4):
        assert (buf.array[i * BB: (i + 1) * BB] == blk(i)).all()
    engine[:] = 0
    assert c.block_get_async("eng", ks[:2], pool, offsets=[BB, 3 * BB]).wait()["found"] == [True, True]
    assert (engine[BB: 2 * BB] == blk(0)).all() and (engine[3 * BB: 4 * BB] == blk(1)).all()
    assert d.stop() == 0


def test_a_namespace_of_finer_parts_takes_coarser_regions(daemon):
    c = daemon.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    q = BB // 4
    quarters = [[i * BB + 100 + j * 7 * BB for j in range(4)] for i in range(3)]  # 4 regions each, scattered
    for i, at in enumerate(quarters):
        for j, off in enumerate(at):
            engine[off: off + q] = blk(i)[j * q: (j + 1) * q]
    ks = [key(i) for i in range(3)]
    assert c.block_put_async("eng4", BB, ks, pool, offsets=np.ravel(quarters), regions=4).wait()["stored"] == 3
    halves = [[40 * BB + i * 3 * BB, 41 * BB + i * 3 * BB + 9] for i in range(3)]
    assert c.block_get_async("eng4", ks, pool, offsets=np.ravel(halves), regions=2).wait()["found"] == [True] * 3
    for i, (k, v) in enumerate(halves):
        assert (engine[k: k + HALF] == blk(i)[:HALF]).all() and (engine[v: v + HALF] == blk(i)[HALF:]).all()


def test_region_fields_are_checked(daemon):
    c = daemon.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    ks = [key(0), key(1)]
    engine[:2 * BB] = np.concatenate([blk(0), blk(1)])
    c.block_put_async("whole", BB, ks, pool, offsets=[0, BB]).wait()  # a namespace of one part per block
    c.block_put_async("split", BB, ks, pool, offsets=[0, HALF, BB, BB + HALF], regions=2).wait()
    cases = [
        # a namespace whose parts straddle the regions
        (lambda: c.block_get_async("whole", ks, pool, offsets=[0, HALF, BB, BB + HALF], regions=2),
         ErrorCode.UNSUPPORTED),
        (lambda: c.block_put_async("whole", BB, [key(5)], pool, offsets=[0, HALF], regions=2), ErrorCode.UNSUPPORTED),
        # not one offset per region
        (lambda: c.block_get_async("split", ks, pool, offsets=[0, BB], regions=2), ErrorCode.BAD_FIELD),
        (lambda: c.block_put_async("split", BB, ks, pool, offsets=[0, 1, 2], regions=2), ErrorCode.BAD_FIELD),
        # regions a new namespace's blocks do not split into, or out of range
        (lambda: c.block_put_async("odd", BB, ks, pool, regions=3), ErrorCode.BAD_FIELD),
        (lambda: c.block_put_async("odd", BB, ks, pool, regions=0), ErrorCode.OUT_OF_RANGE),
        (lambda: c.block_get_async("split", ks, pool, offsets=[0] * 4096, regions=2048), ErrorCode.OUT_OF_RANGE),
        # two regions of a get sharing bytes, or one past the pool's end
        (lambda: c.block_get_async("split", ks, pool, offsets=[0, HALF, BB, BB + HALF - 1], regions=2),
         ErrorCode.BAD_FIELD),
        (lambda: c.block_get_async("split", ks, pool, offsets=[0, HALF, BB, POOL - HALF + 1], regions=2),
         ErrorCode.BUFFER),
    ]
    all_refused(cases, engine)
    assert c.block_lookup("odd", ks) == [False, False]  # no namespace was made by a refused put
    # Whole blocks still move in and out of either namespace, and the split one in halves.
    assert c.block_get_async("split", ks, pool, offsets=[3 * BB, 5 * BB]).wait()["found"] == [True, True]
    assert c.block_get_async("whole", ks, pool, offsets=[6 * BB, 7 * BB]).wait()["found"] == [True, True]
    for at, i in [(3 * BB, 0), (5 * BB, 1), (6 * BB, 0), (7 * BB, 1)]:
        assert (engine[at: at + BB] == blk(i)).all()
