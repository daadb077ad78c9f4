"""BlockStore.share: an engine's rows in a shared-memory file moved in place by a real
kvstored (no staging copy on the engine's side), and every other kind of memory moved
through staging as before, with the reason logged."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import signal
import threading
import time

import numpy as np
import pytest

from kvdrive_client import connect
from kvdrive_client.errors import StoreUnavailableError
from kvdrive_client.integrations.blocks import BlockStore
from kvdrive_client.integrations.pool import find_shared_file
from kvdrive_client.integrations.rows import Spans

BB = 64 << 10
ROWS = 16


def mapped_rows(fd: int, flags: int = mmap.MAP_SHARED) -> np.ndarray:
    os.ftruncate(fd, ROWS * BB)
    return np.frombuffer(mmap.mmap(fd, ROWS * BB, flags=flags), dtype=np.uint8).reshape(ROWS, BB)


def keys(n: int) -> list[bytes]:
    return [b"row" + i.to_bytes(4, "little") for i in range(n)]


def fill(rows: np.ndarray) -> None:
    rows[:] = np.random.default_rng(7).integers(0, 256, rows.shape, dtype=np.uint8)


def store_then_load(daemon, rows: np.ndarray, shared: bool) -> BlockStore:
    """Store rows 0-7, clear rows 8-15, load the blocks back there; the store, for its counters."""
    store = BlockStore(BB, engine="test", model="m", address=daemon.address, staging_bytes=8 * BB)
    assert store.share(rows) is shared
    fill(rows)
    assert store.store_rows(keys(8), rows, range(8)) == [True] * 8
    rows[8:] = 0
    assert store.load_rows(keys(8) + [b"never"], rows, [8, 9, 10, 11, 12, 13, 14, 15, 0]) == [True] * 8 + [False]
    np.testing.assert_array_equal(rows[8:], rows[:8])
    return store


def test_rows_of_a_memfd_are_moved_in_place(daemon):
    fd = os.memfd_create("engine-tier", os.MFD_CLOEXEC)
    rows = mapped_rows(fd)
    store = store_then_load(daemon, rows, shared=True)
    s = store.stats()
    assert s["blocks_in_place"] == 16 and s["blocks_stored"] == 8 and s["blocks_loaded"] == 8
    assert s.get("staging_us", 0) == 0, "a staging copy ran"
    # Stored again: write-once, nothing written, every key stored.
    assert store.store_rows(keys(8) + keys(1), rows, list(range(8)) + [3]) == [True] * 9
    assert store.stats()["blocks_stored"] == 8
    rows[8:10] = 0  # a key given twice lands in both its rows
    assert store.load_rows(keys(1) * 2, rows, [8, 9]) == [True, True]
    np.testing.assert_array_equal(rows[8:10], rows[[0, 0]])
    with pytest.raises(ValueError, match="once per store"):
        store.share(rows)
    store.close()
    os.close(fd)


def libc_mapped_rows(fd: int) -> np.ndarray:
    """Rows of ``fd`` mapped by libc itself: unlike Python's mmap, no descriptor is kept."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    os.ftruncate(fd, ROWS * BB)
    addr = libc.mmap(None, ROWS * BB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    return np.ctypeslib.as_array((ctypes.c_uint8 * (ROWS * BB)).from_address(addr)).reshape(ROWS, BB)


def test_blocks_given_as_regions_move_in_place_in_requests_that_fit_a_header(daemon):
    """Blocks of 4 KiB in 8 regions of 512 bytes, scattered over a memfd, more of them than one
    request may name with their offsets: several requests, byte-exact."""
    n, r, span = 1024, 8, 512
    fd = os.memfd_create("engine-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * n * r * span)
    pool = np.frombuffer(mmap.mmap(fd, 2 * n * r * span), dtype=np.uint8)
    store = BlockStore(r * span, engine="test", model="m", address=daemon.address, regions=r)
    assert store.share(pool) and store.geometry.num_layers == r
    order = np.random.default_rng(3).permutation(2 * n * r)  # region slots, shuffled

    src, dst = (Spans(pool, order[first * r: (first + n) * r].reshape(n, r) * span, span) for first in (0, n))
    pool[:] = np.random.default_rng(4).integers(0, 256, pool.size, dtype=np.uint8)
    before = daemon.client().stats()["counters"]
    want = [np.concatenate(src[i]) for i in range(n)]
    assert store.store(keys(n), src) == [True] * n
    pool[dst.offsets.reshape(-1)[:, None] + np.arange(span)] = 0
    assert store.load(keys(n), dst) == [True] * n
    assert all((np.concatenate(dst[i]) == w).all() for i, w in enumerate(want))
    s = store.stats()
    assert s["blocks_in_place"] == 2 * n and s.get("staging_us", 0) == 0
    after = daemon.client().stats()["counters"]
    # 128 keys a request: with 8 offsets each, 1,024 keys' would not fit a header of 64 KiB
    # where offsets pass 4 GiB (9 bytes each).
    assert after["block_gets"] - before.get("block_gets", 0) == n // 128
    assert after["block_puts"] - before.get("block_puts", 0) == n // 128
    store.close()


@pytest.mark.parametrize("shared", [True, False], ids=["memfd", "private"])
def test_blocks_given_as_spans_of_one_array_move_by_one_copy_or_in_place(daemon, shared):
    """Spans: 3 regions of 2 KiB per block, scattered over one array; stored and loaded
    through staging by one compiled copy a request (private memory), or in place (a memfd)."""
    n, r, span = 50, 3, 2 << 10
    size = 2 * n * r * span
    if shared:
        fd = os.memfd_create("engine-pool", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        array = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    else:
        array = np.zeros(size, np.uint8)
    store = BlockStore(r * span, engine="test", model="m", address=daemon.address, regions=r)
    assert store.share(array) is shared
    order = np.random.default_rng(8).permutation(2 * n * r).reshape(2 * n, r) * span
    src, dst = Spans(array, order[:n], span), Spans(array, order[n:], span)
    array[:] = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    want = [np.concatenate(src[i]) for i in range(n)]
    assert store.store(keys(n), src) == [True] * n
    array[order[n:].reshape(-1)[:, None] + np.arange(span)] = 0
    assert store.load(keys(n) + [b"never"], Spans(array, np.vstack([order[n:], order[:1]]), span)) == [True] * n + [False]
    assert all((np.concatenate(dst[i]) == w).all() for i, w in enumerate(want))
    s = store.stats()
    assert s.get("blocks_in_place", 0) == (2 * n if shared else 0)
    assert (s.get("staging_us", 0) == 0) is shared
    with pytest.raises(ValueError, match="spans of 2048 bytes"):
        store.load(keys(1), Spans(array, order[:1, :2], span))  # 2 spans: not this store's blocks
    with pytest.raises(ValueError, match="outside"):
        Spans(array, [[size - span + 1]], span)
    store.close()


def test_a_large_load_alone_is_split_over_two_gets(daemon):
    """32 MiB or more loaded in place, with no other load running: two gets, which kvstored
    copies on two threads; a smaller load stays one get."""
    bb, n = 1 << 20, 40
    fd = os.memfd_create("engine-tier", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * n * bb)
    rows = np.frombuffer(mmap.mmap(fd, 2 * n * bb), dtype=np.uint8).reshape(2 * n, bb)
    store = BlockStore(bb, engine="test", model="m", address=daemon.address)
    assert store.share(rows)
    rows[:n] = np.random.default_rng(5).integers(0, 256, (n, bb), dtype=np.uint8)
    assert store.store_rows(keys(n), rows, range(n)) == [True] * n
    gets = lambda: daemon.client().stats()["counters"].get("block_gets", 0)  # noqa: E731
    for count, expect in ((n, 2), (16, 1)):
        before = gets()
        assert store.load_rows(keys(count), rows, range(n, n + count)) == [True] * count
        assert gets() - before == expect
        np.testing.assert_array_equal(rows[n: n + count], rows[:count])
    store.close()


def test_a_file_in_dev_shm_is_found_by_its_path_until_it_is_unlinked(daemon, tmp_path):
    path = f"/dev/shm/kvdrive-test-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        rows = libc_mapped_rows(fd)
        os.close(fd)  # no descriptor of this process is open on it: the path finds the file
        found, why = find_shared_file(rows[2:5])
        assert found is not None and why == "" and (found.base, found.size) == (2 * BB, 5 * BB)
        found.close()
        store_then_load(daemon, rows, shared=True).close()
    finally:
        os.unlink(path)
    found, why = find_shared_file(rows)
    assert found is None and "unlinked" in why


def test_a_closed_shared_files_descriptor_number_is_never_registered(daemon, tmp_path):
    """A store closed while its opener thread still registers the engine's file: the file's
    descriptor number, reused by the process for another file, is not sent to kvstored."""
    fd = os.memfd_create("engine-tier", os.MFD_CLOEXEC)
    rows = mapped_rows(fd)
    found, _ = find_shared_file(rows)
    number = found.fd
    client = connect(daemon.address)
    try:
        pool = found.registered(client)  # open: registered, on a descriptor of its own
        assert pool.buf_id is not None and pool.fd != number
        found.close()
        other = os.open(tmp_path / "other", os.O_CREAT | os.O_RDWR, 0o600)  # the lowest free number: the same
        assert other == number
        with pytest.raises(OSError) as exc:
            found.registered(client)
        assert exc.value.errno == errno.EBADF and not found.whole()
        found.close()  # twice: nothing more is closed
        assert os.fstat(other).st_size == 0
        os.close(other)
    finally:
        client.close()
        os.close(fd)


def test_memory_kvstored_cannot_share_moves_through_staging(daemon, tmp_path, caplog):
    on_disk = os.open(tmp_path / "tier", os.O_CREAT | os.O_RDWR, 0o600)
    memfd = os.memfd_create("private", os.MFD_CLOEXEC)
    kinds = {
        "anonymous": (np.zeros((ROWS, BB), np.uint8), "anonymous memory"),
        "private mapping": (mapped_rows(memfd, mmap.MAP_PRIVATE), "not shared"),
        "file on disk": (mapped_rows(on_disk), "not shared memory"),
    }
    for name, (rows, why) in kinds.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvdrive_client.integrations.pool"):
            store = store_then_load(daemon, rows, shared=False)
        assert why in caplog.text, name
        assert store.stats().get("blocks_in_place", 0) == 0 and store.stats()["staging_us"] > 0, name
        store.delete_all()
        store.close()
    os.close(on_disk)
    os.close(memfd)


def test_rows_kvstored_refuses_to_map_move_through_staging(daemon_factory, caplog):
    d = daemon_factory(extra=["--max-client-buffers", "768K"]).start()  # staging fits, the rows (1 MiB) do not
    fd = os.memfd_create("big-tier", os.MFD_CLOEXEC)
    rows = mapped_rows(fd)
    with caplog.at_level(logging.WARNING, logger="kvdrive_client.integrations.pool"):
        store = store_then_load(d, rows, shared=True)
    assert "refuses the engine's shared rows" in caplog.text
    assert store.stats().get("blocks_in_place", 0) == 0 and store.stats()["blocks_loaded"] == 8
    store.close()
    os.close(fd)


def test_a_move_in_place_is_waited_for_past_its_timeout(daemon, caplog):
    """Rows go back to the engine only once kvstored has said what became of their request: a
    daemon that answers late (stopped here for 1.5 s) is waited for, where a plain wait gives
    up at its timeout. (Its answer here: the request's deadline passed before it could
    start, so it did not run, and the rows are as they were.)"""
    fd = os.memfd_create("engine-tier", os.MFD_CLOEXEC)
    rows = mapped_rows(fd)
    store = BlockStore(BB, engine="test", model="m", address=daemon.address, staging_bytes=8 * BB, timeout=0.5)
    assert store.share(rows)
    fill(rows)
    assert store.store_rows(keys(4), rows, range(4)) == [True] * 4
    assert store.load_rows(keys(1), rows, [15]) == [True]  # the load channel is open: a request goes out
    rows[8:12] = 0
    pid = daemon.proc.pid
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(1.5, os.kill, (pid, signal.SIGCONT)).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvdrive_client.store"):
        got = store.load_rows(keys(4), rows, range(8, 12))
    assert got == [False] * 4 and time.monotonic() - t0 >= 1.4
    assert "has not answered request" in caplog.text and "it did not run" in caplog.text
    assert not rows[8:12].any()
    assert store.load_rows(keys(4), rows, range(8, 12)) == [True] * 4
    np.testing.assert_array_equal(rows[8:12], rows[:4])
    # The same late answer ends a plain wait with an error, as before.
    client = daemon.client(timeout=0.5)
    buf = client.register(BB)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailableError):
            client.block_get_async(store.ns, keys(1), buf).wait()
    finally:
        os.kill(pid, signal.SIGCONT)
    store.close()
    os.close(fd)


def test_rows_a_restarted_daemon_refuses_move_through_staging_and_the_rest_works(daemon_factory, caplog):
    """A daemon restarted with limits that no longer take the engine's file: the store's
    session opens without it (its staging region registered again), and rows move
    through staging from then on, byte-exact."""
    d = daemon_factory().start()
    fd = os.memfd_create("engine-tier", os.MFD_CLOEXEC)
    rows = mapped_rows(fd)
    store = store_then_load(d, rows, shared=True)
    d.stop()
    d.extra = ["--max-client-buffers", "768K"]  # staging fits, the rows (1 MiB) do not
    d.start()
    rows[8:] = 0
    with caplog.at_level(logging.WARNING):
        assert store.load_rows(keys(8), rows, range(8, 16)) == [True] * 8
        np.testing.assert_array_equal(rows[8:], rows[:8])
        fill(rows)
        assert store.store_rows([b"new" + k for k in keys(4)], rows, range(4)) == [True] * 4
        assert store.load([b"new" + k for k in keys(1)], [target := np.zeros(BB, np.uint8)]) == [True]
    np.testing.assert_array_equal(target, rows[0])
    assert "moves through staging" in caplog.text or "move through staging" in caplog.text
    assert store.stats().get("load_failed", 0) == 0 and store.stats().get("store_failed", 0) == 0
    store.close()
    os.close(fd)


def test_rows_of_a_file_shrunk_under_kvstored_move_through_staging_from_then_on(daemon, caplog):
    """The engine shrinks its file while kvstored copies into it: that load fails (and touches
    nothing of the engine's itself), and later calls move the rows through staging (kvstored
    no longer takes the file) rather than fail."""
    fd = os.memfd_create("engine-tier", os.MFD_CLOEXEC)
    rows = mapped_rows(fd)
    store = BlockStore(BB, engine="test", model="m", address=daemon.address, staging_bytes=8 * BB, load_channels=1)
    assert store.share(rows)
    store.open_early()  # every channel registers the file now, while it is whole
    assert store.wait_open(30)
    fill(rows)
    assert store.store_rows(keys(8), rows, range(8)) == [True] * 8
    saved = rows.copy()
    os.ftruncate(fd, 0)  # the daemon's next copy into the file faults
    with caplog.at_level(logging.WARNING):
        assert store.load_rows(keys(2), rows, [8, 9]) == [False, False]
        os.ftruncate(fd, ROWS * BB)
        rows[:] = saved
        rows[8:] = 0
        for _ in range(2):
            assert store.load_rows(keys(8), rows, range(8, 16)) == [True] * 8
            np.testing.assert_array_equal(rows[8:], saved[:8])
    assert "move through staging from now on" in caplog.text
    with daemon.client() as probe:  # no channel keeps the file: the user maps its staging regions alone
        assert probe.stats()["mapped_bytes"] == 2 * store.depth * store.slot_bytes
    store.close()
    os.close(fd)
