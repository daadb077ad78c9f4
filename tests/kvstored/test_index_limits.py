"""The block index's memory limits and what a put or get past them is told, against a real kvstored.

Each daemon here runs under an RLIMIT_DATA of a few GiB, so that a daemon without these
limits fails a test with a MemoryError instead of taking the host's memory.
"""

from __future__ import annotations

import resource
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvdrive.layout.geometry import MAX_PAGES
from kvdrive_client import Geometry, StoreError, StoreFullError
from kvstored.protocol import MAX_SEQS_PER_GET, ErrorCode

LLAMA = Geometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
# Llama's 256 (layer, head) slots per page with 32-byte blocks: index-heavy, data-light.
THIN = Geometry(num_layers=32, num_kv_heads=8, head_dim=8, dtype="float16", page_size=1)
WIDEST = Geometry(num_layers=1024, num_kv_heads=1024, head_dim=1, dtype="float16", page_size=1)
SMALL = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
DATA_LIMIT = 3 << 30
MiB = 1 << 20


def started(daemon_factory, **kwargs):
    d = daemon_factory(**kwargs).start()
    resource.prlimit(d.proc.pid, resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))
    return d


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def blocks_of(geom: Geometry, layers, pages, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (len(layers), geom.num_kv_heads, len(pages), geom.block_bytes), dtype=np.uint8)


def every_block(geom: Geometry, layers, pages) -> np.ndarray:
    return np.array([(l, h, p) for l in layers for h in range(geom.num_kv_heads) for p in pages])


def test_a_put_far_past_the_stored_pages_fails_alone_and_the_store_reopens(daemon_factory):
    d = started(daemon_factory)
    c1, c2, c3 = d.client(), d.client(), d.client()
    far = c1.create("t", "far", LLAMA)
    c1.put(far, [0], [0], blocks_of(LLAMA, [0], [0], 1))
    near = c2.create("t", "near", LLAMA)
    good = blocks_of(LLAMA, [0], [0], 2)
    # A 16 MiB put, laid out beforehand, holds the writer while the two small puts queue
    # behind it: they are gathered into one write group (with it, or after it).
    holder = c3.create("t", "holder", SMALL)
    hold_pages = (16 * MiB) // (SMALL.num_layers * SMALL.num_kv_heads * SMALL.block_bytes)
    hold_src = c3.register(16 * MiB)
    hold_src.array[:] = 5
    before = memory_kib(d.proc.pid)
    with ThreadPoolExecutor(3) as pool:
        held = pool.submit(c3.put_from, holder, range(4), range(hold_pages), hold_src)
        bad = pool.submit(c1.put, far, [0], [MAX_PAGES - 1], blocks_of(LLAMA, [0], [0], 3))
        ok = pool.submit(c2.put, near, [0], [0], good)
        refused = bad.exception(30)
        assert ok.result(30) == LLAMA.num_kv_heads and held.result(30) == 4 * 2 * hold_pages
    assert isinstance(refused, StoreError) and refused.code is ErrorCode.TOO_LARGE, refused
    assert "span" in str(refused) and "in order" in str(refused), refused
    grown = memory_kib(d.proc.pid)["VmHWM"] - before["VmHWM"]
    assert grown < 128 * 1024, f"the daemon's peak RSS grew by {grown} KiB"
    np.testing.assert_array_equal(c2.get(near, every_block(LLAMA, [0], [0])), good.reshape(-1, LLAMA.block_bytes))

    assert d.stop() == 0
    d.start()
    c = d.client()
    near = c.open("t", "near")
    assert near.num_blocks == LLAMA.num_kv_heads
    np.testing.assert_array_equal(c.get(near, every_block(LLAMA, [0], [0])), good.reshape(-1, LLAMA.block_bytes))
    assert c.open("t", "far").num_blocks == LLAMA.num_kv_heads
    assert c.open("t", "holder").complete_pages == hold_pages


def test_a_lone_put_far_out_costs_its_own_pages_only(daemon_factory):
    d = started(daemon_factory)
    c = d.client()
    seq = c.create("t", "suffix", LLAMA)
    before = memory_kib(d.proc.pid)
    first = blocks_of(LLAMA, [0], [65536], 3)
    # A sequence may start anywhere (the rows of a shared prefix store only their suffix).
    assert c.put(seq, [0], [65536], first) == LLAMA.num_kv_heads
    later = blocks_of(LLAMA, range(32), [65537, 65538], 4)
    c.put(seq, range(32), [65537, 65538], later)
    grown = memory_kib(d.proc.pid)["VmHWM"] - before["VmHWM"]
    assert grown < 64 * 1024, f"the daemon's peak RSS grew by {grown} KiB for 3 pages"
    assert c.stats()["index_bytes"] < 1 * MiB
    with pytest.raises(Exception, match=r"too_large.*span"):
        c.put(seq, [0], [0], blocks_of(LLAMA, [0], [0], 5))
    assert memory_kib(d.proc.pid)["VmHWM"] - before["VmHWM"] < 64 * 1024

    assert d.stop() == 0
    d.start()
    c = d.client()
    seq = c.open("t", "suffix")
    assert seq.num_blocks == 8 + 2 * 256 and seq.complete_pages == 0
    np.testing.assert_array_equal(c.get(seq, [(0, 3, 65536)])[0], first[0, 3, 0])
    np.testing.assert_array_equal(c.get(seq, every_block(LLAMA, range(32), [65537, 65538])),
                                  later.reshape(-1, LLAMA.block_bytes))
    assert c.stats()["index_bytes"] < 1 * MiB


def test_create_allocates_no_index_memory_until_a_put(daemon_factory):
    d = started(daemon_factory)
    c = d.client()
    before = memory_kib(d.proc.pid)
    seqs = [c.create("t", f"wide{i}", WIDEST) for i in range(4)]
    grown = memory_kib(d.proc.pid)["VmHWM"] - before["VmHWM"]
    assert grown < 32 * 1024, f"four creates at 1024 layers x 1024 heads grew the peak RSS by {grown} KiB"
    # The first put allocates a window of one page: 1M slots of the index, 32 MiB.
    data = blocks_of(WIDEST, [5, 1023], [0], 6)
    assert c.put(seqs[0], [5, 1023], [0], data) == 2 * 1024
    assert c.stats()["index_bytes"] < 40 * MiB
    np.testing.assert_array_equal(c.get(seqs[0], [(1023, 1023, 0), (5, 9, 0)]), [data[1, 1023, 0], data[0, 9, 0]])
    assert c.open("t", "wide0").complete_pages == 0


def test_the_index_budget_refuses_with_full_and_frees_on_delete(daemon_factory):
    d = started(daemon_factory, extra=["--index-max", "2M"])
    c = d.client()
    # 100 pages of THIN: 100 x 256 slots x 32 bytes = 800 KiB of index each.
    a, b, third = (c.create("t", n, THIN) for n in ("a", "b", "c"))
    data = blocks_of(THIN, range(32), range(100), 7)
    c.put(a, range(32), range(100), data)
    c.put(b, range(32), range(100), data)
    with pytest.raises(StoreFullError, match=r"block index full.*--index-max"):
        c.put(third, range(32), range(100), data)
    # Appending one page still fits: the window grows by what it needs, not by doubling, at the edge.
    c.put(a, range(32), [100], blocks_of(THIN, range(32), [100], 8))
    stats = c.stats()
    assert stats["index_bytes"] <= stats["index_max_bytes"] == 2 * MiB
    c.delete("t", "b")
    c.put(third, range(32), range(100), data)
    np.testing.assert_array_equal(c.get(third, every_block(THIN, [31], [99])), data[31, :, 99])
    np.testing.assert_array_equal(c.get(a, every_block(THIN, [0], range(100))), data[0].reshape(-1, THIN.block_bytes))


@pytest.mark.alone
def test_a_get_naming_too_many_sequences_is_refused_at_once(daemon_factory):
    d = started(daemon_factory)
    c, other = d.client(), d.client()
    seq = c.create("t", "one", SMALL)
    c.put(seq, [0], [0], blocks_of(SMALL, [0], [0], 9))
    buf = c.register(1 * MiB)
    n = 50_000
    t0 = time.monotonic()
    pending = c.get_async(seq, np.zeros((n, 3), dtype=np.int32), buf, dst=np.zeros(n, dtype=np.int64),
                          seqs=np.arange(n, dtype=np.int64))
    assert other.stats()["pid"] == d.proc.pid
    stats_s = time.monotonic() - t0
    with pytest.raises(StoreError) as refused:
        pending.wait(30)
    refused_s = time.monotonic() - t0
    assert stats_s < 1.0, f"another client's stats waited {stats_s:.2f} s behind a get naming {n} sequences"
    assert refused.value.code is ErrorCode.TOO_LARGE, (refused.value, f"answered in {refused_s:.2f} s")
    assert f"names {n} sequences, limit {MAX_SEQS_PER_GET}" in str(refused.value)
    assert refused_s < 1.0, f"the refusal took {refused_s:.2f} s"


@pytest.mark.parametrize("dram", ["64M", "0"])
def test_a_get_gathers_blocks_of_many_sequences(daemon_factory, dram):
    d = started(daemon_factory, dram=dram, extra=["--sync", "write-behind"])
    c = d.client()
    num_seqs = 150
    seqs = [c.create("t", f"s{i}", SMALL) for i in range(num_seqs)]
    data = [blocks_of(SMALL, range(4), range(2), 100 + i) for i in range(num_seqs)]
    for seq, x in zip(seqs, data):
        c.put(seq, range(4), range(2), x)
    rng = np.random.default_rng(10)
    n = 4 * num_seqs
    which = np.concatenate([np.arange(num_seqs), rng.integers(0, num_seqs, n - num_seqs)])
    rng.shuffle(which)
    blocks = np.stack([rng.integers(0, 4, n), rng.integers(0, 2, n), rng.integers(0, 2, n)], axis=1)
    buf = c.register(n * SMALL.block_bytes)
    reply = c.get_async(seqs[0], blocks, buf, seqs=[seqs[w].uid for w in which]).wait()
    assert reply["n"] == n
    got = buf.array[: n * SMALL.block_bytes].reshape(n, SMALL.block_bytes)
    np.testing.assert_array_equal(got, np.stack([data[w][l, h, p] for w, (l, h, p) in zip(which, blocks)]))


def test_a_block_namespaces_key_table_counts_against_the_index_budget(daemon_factory):
    """A block costs its slot in the index and its key in the namespace's table (key, LRU
    place, extent ids): both count against --index-max, so a user storing small blocks
    is refused with full long before the table could take the host's memory."""
    d = started(daemon_factory, extra=["--index-max", "4M"])
    c = d.client()
    bb, batch = 4096, 512
    buf = c._staging_buffer(batch * bb)
    buf.array[: batch * bb] = np.random.default_rng(3).integers(0, 256, batch * bb, dtype=np.uint8)
    stored = 0
    with pytest.raises(StoreFullError, match=r"block index full"):
        while stored < 200_000:
            r = c.block_put_async("small", bb, [b"b%011d" % (stored + j) for j in range(batch)], buf).wait()
            stored += r["stored"]
    per_uid = c.stats()["index_max_bytes"] * 7 // 8  # the default --index-max-per-uid
    # Slots alone (36 bytes a block) would have let ~102,000 blocks in; with the table, 292 bytes.
    assert per_uid // 2 // 292 <= stored <= per_uid // 292, stored
    assert c.stats()["index_bytes"] <= c.stats()["index_max_bytes"]
    # Deleted blocks free their slots and table rows for new ones: the window need not grow.
    assert c.block_delete("small", [b"b%011d" % j for j in range(batch)])["deleted"] == batch
    assert c.block_put_async("small", bb, [b"n%011d" % j for j in range(batch)], buf).wait()["stored"] == batch


def test_a_block_namespace_under_a_quota_past_what_the_index_holds_makes_room_in_its_window(daemon_factory):
    """Where --index-max cannot grow a block namespace's window and a --quota applies to
    it, its least recently used blocks make room, as its quota would: its stores go on."""
    d = started(daemon_factory, extra=["--index-max", "4M", "--quota", "small=1G"])
    c = d.client()
    bb, batch = 4096, 512
    buf = c._staging_buffer(batch * bb)
    buf.array[: batch * bb] = np.random.default_rng(4).integers(0, 256, batch * bb, dtype=np.uint8)
    jobs = 60  # 30,720 blocks: well past the ~12,300 the index holds, well under the quota's 262,144
    for j in range(jobs):
        keys = [b"j%05d-%05d" % (j, i) for i in range(batch)]
        assert c.block_put_async("small", bb, keys, buf).wait()["stored"] == batch, j
    stats = c.stats()
    assert stats["index_bytes"] <= stats["index_max_bytes"]
    assert 12_000 < stats["blocks"] < 13_000
    assert stats["counters"]["blocks_quota_evicted"] == jobs * batch - stats["blocks"]
    assert stats["counters"].get("puts_refused_index", 0) == 0  # none was refused
    assert all(c.block_lookup("small", [b"j%05d-%05d" % (jobs - 1, i) for i in range(batch)]))
    assert not any(c.block_lookup("small", [b"j%05d-%05d" % (0, i) for i in range(batch)]))
    assert "the block index is full, so its" in d.log()
