"""Crashes, damaged data, full tiers and shutdown: what a put's acknowledgement promises."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvdrive.layout.format import DATA_FILE, META_DIR
from kvdrive_client import (
    ChecksumError, Geometry, NotFoundError, RequestError, StoreClient, StoreFullError, StoreUnavailableError,
)
from kvstored.catalog import Catalog
from kvstored.protocol import ErrorCode

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes


def page_data(seed: int, first: int, count: int, geom: Geometry = GEOM) -> np.ndarray:
    """Deterministic bytes of pages [first, first + count), so a reader can regenerate them."""
    out = np.empty((geom.num_layers, geom.num_kv_heads, count, geom.block_bytes), dtype=np.uint8)
    for i in range(count):
        rng = np.random.default_rng([seed, first + i])
        out[:, :, i] = rng.integers(0, 256, (geom.num_layers, geom.num_kv_heads, geom.block_bytes), dtype=np.uint8)
    return out


def page_blocks(pages, geom: Geometry = GEOM) -> np.ndarray:
    return np.array([(l, h, p) for p in pages for l in range(geom.num_layers) for h in range(geom.num_kv_heads)])


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


# ---------------------------------------------------------------- kill -9


class Putter(threading.Thread):
    """Puts runs of pages one request at a time, recording which were acknowledged."""

    def __init__(self, address: str, seed: int, first_page: int) -> None:
        super().__init__(daemon=True)
        # Its own client, not one the fixture closes from another thread at kill time. The
        # short timeout ends the thread soon after the daemon is gone; should a put be that
        # slow with the daemon alive, the thread just stops early with that put in doubt.
        self.client = StoreClient(address, timeout=2.0)
        self.seq = self.client.open("crash", "s")
        self.seed = seed
        self.next_page = first_page
        self.acked: list[int] = []
        self.in_doubt: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = np.random.default_rng(self.seed)
        try:
            while True:
                count = int(rng.integers(1, 4))
                pages = list(range(self.next_page, self.next_page + count))
                self.in_doubt = pages
                try:
                    self.client.put(self.seq, range(GEOM.num_layers), pages, page_data(self.seed, pages[0], count))
                except StoreUnavailableError:
                    return  # the daemon died under this put (or stopped answering): in doubt
                self.in_doubt = []
                self.acked.extend(pages)
                self.next_page += count
        except BaseException as exc:  # reported by the test, not swallowed
            self.error = exc
        finally:
            self.client.close()  # talks to no daemon: it closes the session socket and frees the buffers


def read_back(client: StoreClient, seq, page: int, seed: int) -> str:
    """'stored' if the page reads back bit-exact, 'absent' if none of its blocks is stored.

    A put commits all its blocks in one transaction, so anything in between (some blocks
    stored, or other bytes) fails the test.
    """
    expect = page_data(seed, page, 1).reshape(-1, BB)
    blocks = page_blocks([page])
    try:
        got = client.get(seq, blocks)
    except NotFoundError:
        for b in blocks:
            with pytest.raises(NotFoundError):
                client.get(seq, [b])
        return "absent"
    np.testing.assert_array_equal(got, expect, err_msg=f"page {page} read back other bytes")
    return "stored"


@pytest.mark.slow
@pytest.mark.parametrize(("sync", "num_kills"), [("durable", 3), ("write-behind", 2)])
def test_kill9_during_puts_loses_no_acknowledged_block(daemon_factory, sync, num_kills):
    # write-behind only gives up acknowledged puts to a power loss, never to a daemon crash.
    rng = np.random.default_rng(7 if sync == "durable" else 8)
    d = daemon_factory(dram="4M", extra=["--sync", sync]).start()
    client = d.client()
    seq = client.create("crash", "s", GEOM)
    # The first put of a fresh daemon pays for loading its compiled copy kernels.
    client.put(seq, range(GEOM.num_layers), [0], page_data(1, 0, 1))
    acked: dict[int, int] = {0: 1}  # page -> seed of its bytes
    next_page = 1
    for round_no in range(num_kills):
        seed = 1000 * round_no + 17
        putter = Putter(d.address, seed, next_page)
        putter.start()
        target = int(rng.integers(3, 40))
        wait_for(lambda: len(putter.acked) >= target or not putter.is_alive(), 30, f"{target} acknowledged puts")
        # Land the kill at a random point of the next put (before, during or after its writes).
        time.sleep(rng.uniform(0, 0.03))
        d.kill9()
        putter.join(15)
        assert not putter.is_alive() and putter.error is None, putter.error
        assert putter.acked, "no put was acknowledged before the kill"
        for p in putter.acked:
            acked[p] = seed

        d.start()
        client = d.client()
        seq = client.open("crash", "s")
        # Every acknowledged block, from this crash and the ones before, reads back bit-exact.
        pages = sorted(acked)
        got = client.get(seq, page_blocks(pages))
        expect = np.concatenate([page_data(acked[p], p, 1).reshape(-1, BB) for p in pages])
        np.testing.assert_array_equal(got, expect)
        assert seq.complete_pages >= len(pages) == max(pages) + 1
        # The put in flight at the kill either landed whole or left nothing readable behind.
        outcome = {p: read_back(client, seq, p, seed) for p in putter.in_doubt}
        landed = [p for p, o in outcome.items() if o == "stored"]
        # Pages past the last one ever sent were never written.
        beyond = max(putter.in_doubt or pages) + 1
        with pytest.raises(NotFoundError):
            client.get(seq, page_blocks([beyond]))
        # Pages that did not land can be put again: their space and their slots are free.
        redo = [p for p in putter.in_doubt if p not in landed]
        for p in redo:
            client.put(seq, range(GEOM.num_layers), [p], page_data(seed, p, 1))
        if putter.in_doubt:
            np.testing.assert_array_equal(client.get(seq, page_blocks(putter.in_doubt)),
                                          page_data(seed, putter.in_doubt[0], len(putter.in_doubt)).transpose(2, 0, 1, 3).reshape(-1, BB))
        for p in putter.in_doubt:
            acked[p] = seed
        next_page = beyond


# ---------------------------------------------------------------- damaged data


def flip_bits(path: Path, pos: int, mask: int) -> None:
    """Damage the byte at ``pos`` of ``path`` on disk (xor ``mask``)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.damages_store
def test_flipped_byte_is_a_checksum_error_naming_the_block(daemon_factory):
    d = daemon_factory(dram="0").start()
    client = d.client()
    seq = client.create("t", "damaged", GEOM)
    data = page_data(3, 0, 8)
    client.put(seq, range(4), range(8), data)
    assert client.stats()["dram_bytes"] == 0

    catalog = Catalog(d.ssd / META_DIR, 1 << 30, durable=False, readonly=True)
    try:
        ext = next(e for e in catalog.iter_extents() if (e.layer, e.head) == (2, 1))
    finally:
        catalog.close()
    slot = 3
    page = int(ext.pages[slot])
    flip_bits(d.ssd / DATA_FILE, ext.offset + slot * BB + 100, 0x40)

    with pytest.raises(ChecksumError, match=rf"\[checksum\].*\(layer 2, head 1, page {page}\)"):
        client.get(seq, [(0, 0, 0), (2, 1, page), (3, 0, 7)])
    assert d.alive()
    assert client.stats()["counters"]["checksum_errors"] >= 1
    # Every other block, including the damaged block's neighbours in the same read, is fine.
    others = [b for b in page_blocks(range(8)) if tuple(b) != (2, 1, page)]
    got = client.get(seq, others)
    np.testing.assert_array_equal(got, np.array([data[l, h, p] for l, h, p in others]))
    with pytest.raises(ChecksumError):
        client.get(seq, [(2, 1, page)])
    assert d.alive() and "checksum mismatch" in d.log()


@pytest.mark.damages_store
def test_a_get_larger_than_one_read_chunk_is_checked_in_every_chunk(daemon_factory):
    """A get's SSD reads land in a scratch buffer a chunk at a time; every chunk is checked and delivered."""
    from kvstored.store import READ_CHUNK_BYTES

    geom = Geometry(num_layers=1, num_kv_heads=1, head_dim=128, dtype="float16", page_size=64)  # 32 KiB blocks
    bb = geom.block_bytes
    pages = (READ_CHUNK_BYTES + READ_CHUNK_BYTES // 2) // bb
    d = daemon_factory(dram="0", extra=["--max-io", "1M"]).start()
    client = d.client()
    seq = client.create("t", "chunks", geom)
    data = page_data(11, 0, pages, geom)
    client.put(seq, [0], range(pages), data)
    blocks = page_blocks(range(pages), geom)
    np.testing.assert_array_equal(client.get(seq, blocks), data[0, 0])
    assert client.stats()["counters"]["ssd_reads"] == -(-pages * bb // (1 << 20))  # --max-io 1M: many reads, two chunks

    catalog = Catalog(d.ssd / META_DIR, 1 << 30, durable=False, readonly=True)
    try:
        (ext,) = list(catalog.iter_extents())
    finally:
        catalog.close()
    slot = pages - 3  # past the first chunk: reads are issued in file order
    assert slot * bb > READ_CHUNK_BYTES
    page = int(ext.pages[slot])
    flip_bits(d.ssd / DATA_FILE, ext.offset + slot * bb + 7, 0x01)
    with pytest.raises(ChecksumError, match=rf"1 block\(s\), first \(layer 0, head 0, page {page}\)"):
        client.get(seq, blocks)
    others = blocks[blocks[:, 2] != page]
    np.testing.assert_array_equal(client.get(seq, others), data[0, 0][others[:, 2]])


# ---------------------------------------------------------------- full tiers


@pytest.mark.parametrize("dram", ["1M", "0"])
def test_ssd_full_is_refused_cleanly_and_delete_makes_room(daemon_factory, dram):
    d = daemon_factory(dram=dram, ssd_max="2M").start()
    client = d.client()
    seq = client.create("t", "filler", GEOM)
    page = 0
    with pytest.raises(StoreFullError, match=r"\[full\] SSD tier full: .*--ssd-max"):
        for page in range(1000):
            client.put(seq, range(4), [page], page_data(5, page, 1))
    assert 0 < page < 1000
    assert d.alive()
    stats = client.stats()
    assert stats["ssd_used_bytes"] <= stats["ssd_max_bytes"] == 2 << 20
    assert stats["counters"]["puts_refused_full"] == 1
    # A refused put leaves no space behind, and what was stored still reads back.
    used = stats["ssd_used_bytes"]
    other = client.create("t", "other", GEOM)
    with pytest.raises(StoreFullError):
        client.put(other, range(4), range(4), page_data(6, 0, 4))
    assert client.stats()["ssd_used_bytes"] == used
    np.testing.assert_array_equal(client.get(seq, page_blocks(range(page))),
                                  page_data(5, 0, page).transpose(2, 0, 1, 3).reshape(-1, BB))
    # A sequence of another block size that never stored anything deletes cleanly too.
    client.create("t", "empty", Geometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4))
    assert client.delete("t", "empty")["freed_bytes"] == 0
    assert client.delete("t", "filler")["freed_bytes"] == page * 8 * BB
    assert client.put(other, range(4), range(4), page_data(6, 0, 4)) == 32
    np.testing.assert_array_equal(client.get(other, page_blocks([3])), page_data(6, 3, 1).reshape(-1, BB))
    assert client.stats()["ssd_used_bytes"] < used


def test_failed_write_is_an_io_error_and_leaks_no_space(daemon_factory):
    # The daemon inherits a file size limit: writes past it fail with EFBIG, like a disk
    # that cannot take more (Python ignores SIGXFSZ, so the write just returns the error).
    limit = 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    d = daemon_factory(dram="0")
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        d.start()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    client = d.client()
    seq = client.create("t", "s", GEOM)
    with pytest.raises(RequestError, match=r"\[io\] writing blocks failed: .*File too large") as refused:
        for page in range(1000):
            client.put(seq, range(4), [page], page_data(8, page, 1))
    assert refused.value.code is ErrorCode.IO
    assert d.alive()
    stats = client.stats()
    assert stats["ssd_used_bytes"] == page * 8 * 4096 <= limit
    np.testing.assert_array_equal(client.get(seq, page_blocks([page - 1])), page_data(8, page - 1, 1).reshape(-1, BB))
    # Space freed below the limit is written again.
    client.delete("t", "s")
    seq = client.create("t", "again", GEOM)
    client.put(seq, range(4), [0], page_data(9, 0, 1))
    np.testing.assert_array_equal(client.get(seq, page_blocks([0])), page_data(9, 0, 1).reshape(-1, BB))


def test_overlapping_destinations_do_not_poison_the_dram_tier(daemon_factory):
    d = daemon_factory(dram="4M").start()
    client = d.client()
    seq = client.create("t", "s", GEOM)
    data = page_data(11, 0, 2)
    client.put(seq, range(4), range(2), data)
    d.stop()
    d.start()  # an empty DRAM tier: the next get reads from the SSD and admits what it read
    client = d.client()
    buf = client.register(1 << 20)
    # Both blocks land on the same bytes of the client's buffer; only the second survives there.
    reply = client.get_into(seq, [(0, 0, 0), (0, 0, 1)], buf, dst=[0, 0])
    assert reply["ssd"] == 2
    np.testing.assert_array_equal(buf.array[:BB], data[0, 0, 1])
    for _ in range(2):  # from DRAM (or the SSD), never the other block's bytes
        got = client.get(seq, [(0, 0, 0), (0, 0, 1)])
        np.testing.assert_array_equal(got, [data[0, 0, 0], data[0, 0, 1]])
    counters = client.stats()["counters"]
    assert counters["dram_admit_refused"] == 1 and counters["blocks_dram"] >= 2


def test_dram_tier_stays_within_its_cap(daemon_factory):
    d = daemon_factory(dram="1M").start()
    client = d.client()
    seq = client.create("t", "big", GEOM)
    pages_per_put = 8
    num_puts = 10  # 640 blocks of 4 KiB into a 1 MiB tier
    for i in range(num_puts):
        first = i * pages_per_put
        client.put(seq, range(4), range(first, first + pages_per_put), page_data(9, first, pages_per_put))
        stats = client.stats()
        assert 0 < stats["dram_used_bytes"] <= stats["dram_bytes"] == 1 << 20
    num_pages = num_puts * pages_per_put
    blocks = page_blocks(range(num_pages))
    got = client.get(seq, blocks)
    np.testing.assert_array_equal(got, page_data(9, 0, num_pages).transpose(2, 0, 1, 3).reshape(-1, BB))
    stats = client.stats()
    assert stats["counters"]["blocks_ssd"] > 0 and stats["counters"]["blocks_dram"] > 0
    assert stats["counters"]["blocks_ssd"] + stats["counters"]["blocks_dram"] == len(blocks)
    assert stats["dram_used_bytes"] <= stats["dram_bytes"]


def test_important_blocks_keep_their_dram_slots(daemon_factory):
    d = daemon_factory(dram="1M").start()  # 256 blocks of 4 KiB
    client = d.client()
    low_a = client.create("t", "low-a", GEOM)
    high = client.create("t", "high", GEOM)
    low_b = client.create("t", "low-b", GEOM)
    buf = client.register(1 << 20)

    def get_counts(seq, pages) -> dict:
        return client.get_into(seq, page_blocks(pages), buf)

    # Low-importance blocks fill the tier first...
    client.put(low_a, range(4), range(32), page_data(1, 0, 32), importance=np.zeros((4, 2, 32)))
    assert client.stats()["dram_used_bytes"] == 1 << 20
    # ...then important ones displace them...
    client.put(high, range(4), range(16), page_data(2, 0, 16), importance=np.full((4, 2, 16), 5.0))
    resident = {s["seq"]: s["dram_blocks"] for s in client.list("t")}
    assert resident == {"low-a": 256 - 128, "high": 128, "low-b": 0}
    # ...and later low-importance puts and reads cannot push the important ones out.
    client.put(low_b, range(4), range(32), page_data(3, 0, 32), importance=np.zeros((4, 2, 32)))
    get_counts(low_a, range(32))
    get_counts(low_b, range(32))
    reply = get_counts(high, range(16))
    assert reply["n"] == 128 and reply["dram"] == 128 and reply["ssd"] == 0
    np.testing.assert_array_equal(buf.array[: 128 * BB].reshape(128, BB),
                                  page_data(2, 0, 16).transpose(2, 0, 1, 3).reshape(-1, BB))
    assert client.open("t", "high").num_blocks == 128
    assert client.stats()["dram_used_bytes"] <= 1 << 20


def test_equally_important_blocks_leave_dram_least_recently_used_first(daemon_factory):
    d = daemon_factory(dram="1M").start()  # 256 blocks of 4 KiB
    client = d.client()
    seqs = {name: client.create("t", name, GEOM) for name in ("old", "read", "vip", "mixed", "new")}
    buf = client.register(1 << 20)
    ones = lambda pages: np.ones((4, 2, pages))  # noqa: E731
    # 64 blocks each; the tier is full after the fourth put.
    client.put(seqs["old"], range(4), range(8), page_data(1, 0, 8), importance=ones(8))
    client.put(seqs["read"], range(4), range(8), page_data(2, 0, 8), importance=ones(8))
    client.put(seqs["vip"], range(4), range(8), page_data(3, 0, 8), importance=3 * ones(8))
    imp = ones(8)
    imp[:, :, 4:] = 0.5  # half of them matter less than everything else
    client.put(seqs["mixed"], range(4), range(8), page_data(4, 0, 8), importance=imp)
    client.get_into(seqs["read"], page_blocks(range(8)), buf)  # "read" is now used more recently than "old"
    # 96 new blocks: the 32 less important go first, then the 64 least recently used.
    client.put(seqs["new"], range(4), range(12), page_data(5, 0, 12), importance=ones(12))
    resident = {s["seq"]: s["dram_blocks"] for s in client.list("t")}
    assert resident == {"old": 0, "read": 64, "vip": 64, "mixed": 32, "new": 96}
    assert client.stats()["counters"]["dram_evicted"] == 96
    reply = client.get_into(seqs["mixed"], page_blocks(range(4)), buf)  # the important half stayed
    assert reply["dram"] == reply["n"] == 32


# ---------------------------------------------------------------- shutdown


def test_sigterm_exits_cleanly_and_removes_the_socket(daemon):
    client = daemon.client()
    seq = client.create("t", "s", GEOM)
    client.put(seq, range(4), range(2), page_data(4, 0, 2))
    sock = Path(daemon.address[len("ipc://"):])
    assert sock.exists()
    assert daemon.stop() == 0
    assert not sock.exists()
    assert "stopped cleanly" in daemon.log()
    # The directory lock is released: a new daemon serves the same store.
    daemon.start()
    seq = daemon.client().open("t", "s")
    np.testing.assert_array_equal(daemon.client().get(seq, page_blocks([1])), page_data(4, 1, 1).reshape(-1, BB))
