"""A full disk under the data file and the catalog: writes are refused, deletes still commit and free space.

The disk fills either by the data file's own puts or by another file just after the catalog
outgrew the free pages LMDB can reuse; in both, the catalog commits deletes into the space
kept allocated in data.mdb, also after a restart on the full disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import lmdb
import numpy as np
import pytest

from kvdrive.protocol import Op
from kvdrive_client import Geometry, StoreFullError

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes
PAGES_PER_PUT = 8  # 256 KiB a put
NUM_SEQS = 3
NUM_PUTS = 48  # 12 MiB of blocks, half the disk
NUM_SMALL = 150  # about 50 such creates outgrow the free pages LMDB can reuse
LONG_NAME = "x" * 200  # so that a create takes about 600 bytes of the catalog


def pages_of(seq: int, first: int, count: int = PAGES_PER_PUT) -> np.ndarray:
    rng = np.random.default_rng([seq, first])
    return rng.integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, count, BB), dtype=np.uint8)


def blocks(pages) -> np.ndarray:
    return np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in pages])


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB filesystem of its own (a tmpfs), so that the test fills a disk, not the host's."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def ext4_disk(tmp_path):
    """A 32 MiB ext4 filesystem of its own (an image on a loop device): one that takes O_DIRECT,
    as a tmpfs does not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    for cmd in (["mkfs.ext4", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(mnt)]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip(f"no {cmd[0]} here")
        if done.returncode:
            pytest.skip(f"cannot make an ext4 disk here ({cmd[0]}): {done.stderr.strip() or done.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path) -> None:
    """Write ``path`` until the filesystem has no byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="No space left"):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)


def test_a_full_disk_refuses_writes_while_deletes_free_space(daemon_factory, small_disk):
    d = daemon_factory(dram="0")  # every get reads the data file
    d.ssd = small_disk / "ssd"
    d.start()
    c = d.client()
    seqs = [c.create("t", f"s{i}", GEOM) for i in range(NUM_SEQS)]
    stored = [0] * NUM_SEQS  # pages acknowledged per sequence
    with pytest.raises(StoreFullError, match=r"\[full\]"):
        for turn in range(1000):
            i = turn % NUM_SEQS
            c.put(seqs[i], range(GEOM.num_layers), range(stored[i], stored[i] + PAGES_PER_PUT), pages_of(i, stored[i]))
            stored[i] += PAGES_PER_PUT
    assert sum(stored) * 8 * BB > 8 << 20, "the disk filled before much was stored"
    # Whatever room the failed put left goes too, so the catalog has no page more to grow into.
    fill(small_disk / "filler")
    try:  # a create on a full disk is either still taken or refused as 'full', never an internal error
        c.create("t", "late", GEOM)
    except StoreFullError:
        pass

    # It starts on a full disk, and a delete commits from the catalog's reserve.
    d.stop()
    d.start()
    c = d.client()
    assert c.delete("t", "s0")["freed_bytes"] == stored[0] * 8 * BB
    d.stop()
    d.start()
    c = d.client()
    seq = c.open("t", "s1")
    c.put(seq, range(GEOM.num_layers), range(stored[1], stored[1] + PAGES_PER_PUT), pages_of(1, stored[1]))
    stored[1] += PAGES_PER_PUT
    for i in (1, 2):
        seq = c.open("t", f"s{i}")
        got = c.get(seq, blocks(range(stored[i])))
        expect = np.concatenate([pages_of(i, first) for first in range(0, stored[i], PAGES_PER_PUT)], axis=2)
        np.testing.assert_array_equal(got, expect.reshape(-1, BB))
    assert sorted(s["seq"] for s in c.list("t") if s["seq"].startswith("s")) == ["s1", "s2"]


@pytest.mark.parametrize("left", [0, 4096], ids=["no-byte-left", "one-page-left"])
def test_a_disk_filled_after_the_catalog_grew_still_deletes(daemon_factory, small_disk, left):
    """Another file takes the disk just after the catalog outgrew the free pages LMDB can reuse,
    so that what the catalog commits next lands past LMDB's last page. With one page left, a
    commit needing more is a short write, which LMDB reports as an I/O error."""
    d, c, seqs, stored, put_next = _interleaved(daemon_factory, small_disk)
    for k in range(NUM_SMALL):
        c.create("small", f"{k:04d}-{LONG_NAME}", GEOM)
    filler = small_disk / "filler"
    fill(filler)

    with pytest.raises(StoreFullError, match=r"\[full\]"):  # the data file cannot grow by a put
        put_next(c, seqs[3], 3)
    # With a page free again, a commit that needs more pages is cut short.
    os.truncate(filler, filler.stat().st_size - left)
    try:  # taken from the catalog's reserve, or refused as 'full', never an internal error
        c.create("t", "late", GEOM)
    except StoreFullError:
        pass
    assert c.delete("t", "s0")["freed_bytes"] == stored[0] * 8 * BB

    # Still full after a restart: a delete commits, and a put reuses the space deletes freed.
    d.stop()
    d.start()
    c = d.client()
    assert c.delete("t", "s1")["freed_bytes"] == stored[1] * 8 * BB
    put_next(c, c.open("t", "s2"), 2)
    d.stop()
    d.start()
    c = d.client()
    for i in (2, 3):
        got = c.get(c.open("t", f"s{i}"), blocks(range(stored[i])))
        expect = np.concatenate([pages_of(i, first) for first in range(0, stored[i], PAGES_PER_PUT)], axis=2)
        np.testing.assert_array_equal(got, expect.reshape(-1, BB))
    assert sorted(s["seq"] for s in c.list("t") if s["seq"].startswith("s")) == ["s2", "s3"]
    assert len(c.list("small")) == NUM_SMALL


def test_lmdb_keeps_a_preallocated_file(tmp_path):
    """The catalog's reserve relies on LMDB never truncating data.mdb."""
    env = lmdb.open(str(tmp_path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    fd = os.open(tmp_path / "data.mdb", os.O_RDWR)
    os.posix_fallocate(fd, 0, 4 << 20)
    os.close(fd)
    env = lmdb.open(str(tmp_path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for i in range(500):
            txn.put(b"%d" % i, os.urandom(200))
    env.close()
    st = os.stat(tmp_path / "data.mdb")
    assert st.st_size == 4 << 20 and st.st_blocks * 512 >= 4 << 20


def create_until_refused(c, batch: int = 500, limit: int = 20000) -> None:
    """Create sequences of long names, a batch in flight at a time, until one is refused."""
    for first in range(0, limit, batch):
        sent = [c._submit(Op.CREATE, {"ns": "small", "seq": f"{k:05d}-{LONG_NAME}", "geometry": GEOM.to_dict()})
                for k in range(first, first + batch)]
        for req_id in sent:
            c._wait(req_id)


def test_puts_work_again_after_a_delete_on_a_full_disk(daemon_factory, small_disk):
    """Holes punched out of the data file on a full disk need new filesystem blocks, ranges
    freed while the disk has room do not: a put that meets a punched hole first is written
    into backed free space, before and after a restart, and nothing stored is harmed."""
    d, c, seqs, stored, put_next = _interleaved(daemon_factory, small_disk)
    filler = small_disk / "filler"
    fill(filler)
    # Restarted on the full disk, the daemon keeps the catalog's reserve without its slack:
    # a few thousand creates outgrow it, and then the daemon is short of space.
    d.stop()
    d.start()
    c = d.client()
    with pytest.raises(StoreFullError):
        create_until_refused(c)
    assert "disk full under" in d.log()
    # Deleted while short, s0's extents (the first of the data file) are punched; once the
    # reserve has grown, s3's are freed with their blocks kept. Then the disk fills again.
    c.delete("t", "s0")
    c.delete("t", "s3")
    fill(filler)
    put_next(c, c.open("t", "s1"), 1)
    page_bytes = GEOM.num_layers * GEOM.num_kv_heads * BB
    assert c.stats()["ssd_used_bytes"] == (stored[1] + stored[2]) * page_bytes
    d.stop()
    d.start()
    c = d.client()
    put_next(c, c.open("t", "s2"), 2)
    used = c.stats()["ssd_used_bytes"]
    assert used == (stored[1] + stored[2]) * page_bytes
    d.stop()
    verify = subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", str(d.ssd), "--verify"],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    d.start()
    c = d.client()
    assert c.stats()["ssd_used_bytes"] == used
    for i in (1, 2):
        got = c.get(c.open("t", f"s{i}"), blocks(range(stored[i])))
        expect = np.concatenate([pages_of(i, first) for first in range(0, stored[i], PAGES_PER_PUT)], axis=2)
        np.testing.assert_array_equal(got, expect.reshape(-1, BB))


def _interleaved(daemon_factory, small_disk, num_seqs: int = 4, extra: list[str] | None = None):
    """A daemon on the small disk holding ``num_seqs`` sequences put into in turn (their
    extents interleave in the data file); with its client, the sequences, the pages stored
    in each and ``put_next(client, seq, i)``, which puts sequence i's next pages."""
    d = daemon_factory(dram="0", extra=extra)
    d.ssd = small_disk / "ssd"
    d.start()
    c = d.client()
    seqs = [c.create("t", f"s{i}", GEOM) for i in range(num_seqs)]
    stored = [0] * num_seqs

    def put_next(client, seq, i: int) -> None:
        client.put(seq, range(GEOM.num_layers), range(stored[i], stored[i] + PAGES_PER_PUT), pages_of(i, stored[i]))
        stored[i] += PAGES_PER_PUT

    for turn in range(NUM_PUTS):
        put_next(c, seqs[turn % num_seqs], turn % num_seqs)
    return d, c, seqs, stored, put_next


def test_write_behind_on_a_full_ext4_disk_refuses_puts_and_loses_none(daemon_factory, ext4_disk):
    """Write-behind writes the data file through the page cache: ext4 takes the room for a
    write's pages as it copies them, so a full disk refuses the put then (``full``), not at
    its writeback, where it would be lost after its acknowledgement. Puts work again after a
    delete, and every acknowledged page reads back after the flush and a restart."""
    d, c, seqs, stored, put_next = _interleaved(daemon_factory, ext4_disk, extra=["--sync", "write-behind"])
    hello = c.hello()
    assert hello["direct_io"] and not hello["direct_writes"]
    with pytest.raises(StoreFullError, match=r"\[full\]"):
        for turn in range(1000):
            put_next(c, seqs[turn % 4], turn % 4)
    assert sum(stored) * 8 * BB > 16 << 20, "the disk filled before much was stored"
    assert c.delete("t", "s0")["freed_bytes"] == stored[0] * 8 * BB
    put_next(c, seqs[1], 1)
    time.sleep(1.5)  # past the flush
    assert c.stats()["counters"].get("flushes_failed", 0) == 0
    d.stop()
    d.start()
    c = d.client()
    for i in (1, 2, 3):
        got = c.get(c.open("t", f"s{i}"), blocks(range(stored[i])))
        expect = np.concatenate([pages_of(i, first) for first in range(0, stored[i], PAGES_PER_PUT)], axis=2)
        np.testing.assert_array_equal(got, expect.reshape(-1, BB))
    d.stop()
    verify = subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", str(d.ssd), "--verify"],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
