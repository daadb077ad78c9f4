"""SsdTier.place: a free range the filesystem cannot back (ENOSPC) is set aside and the
extents are written elsewhere; new space past the file's end is never retried."""

import errno
import os
import threading
import time

import numpy as np
import pytest

from kvstored.ssd import DiskFullError, SsdTier

EXT = 4096


def open_tier(path, capacity: int, num_used: int) -> SsdTier:
    """A tier whose data file holds ``num_used`` extents, all in use."""
    t = SsdTier(path, capacity, direct=False)
    os.truncate(t.fd, num_used * EXT)
    t.load(np.zeros(1, np.int64), np.array([num_used * EXT]))
    return t


@pytest.fixture
def tier(tmp_path):
    t = open_tier(tmp_path / "blocks.kvd", 1 << 20, 8)
    yield t
    t.close()


def refusing(tier, bad: set[int], monkeypatch) -> list[int]:
    """Make writes that start at an offset in ``bad`` fail as on a full disk; the offsets tried."""
    tried, write = [], tier.write

    def write_or_enospc(offset, data):
        tried.append(offset)
        if offset in bad:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(offset, data)

    monkeypatch.setattr(tier, "write", write_or_enospc)
    return tried


def test_a_range_that_cannot_be_backed_is_set_aside_and_another_written(tier, monkeypatch):
    tier.allocator.free(EXT, EXT)  # holes at 1 and 5: best fit takes 1 first
    tier.allocator.free(5 * EXT, EXT)
    tried = refusing(tier, {EXT}, monkeypatch)
    staging = np.full(EXT, 7, np.uint8)
    assert tier.place(staging, 1, EXT) == [5 * EXT]
    assert tried == [EXT, 5 * EXT]
    assert tier.used_bytes == 7 * EXT  # the range set aside is free space
    assert tier.place(staging, 1, EXT) == [8 * EXT]  # not tried again until a delete
    tier.unpark()
    assert tier.allocator.holes == [(EXT, EXT)] and tier.used_bytes == 8 * EXT


def test_new_space_that_cannot_be_written_is_a_full_disk_at_once(tier, monkeypatch):
    tier.allocator.free(EXT, EXT)
    tried = refusing(tier, {EXT, 8 * EXT, 9 * EXT}, monkeypatch)
    with pytest.raises(OSError) as info:
        tier.place(np.zeros(2 * EXT, np.uint8), 2, EXT)
    assert info.value.errno == errno.ENOSPC
    assert tried == [EXT, 8 * EXT]  # the hole and new space, each once (a put's runs are all tried): no more
    assert tier.allocator.end == 8 * EXT and tier.used_bytes == 7 * EXT


def test_every_free_range_refused_is_a_disk_full_error(tmp_path, monkeypatch):
    t = open_tier(tmp_path / "blocks.kvd", 4 * EXT, 4)
    try:
        t.allocator.free(EXT, EXT)
        refusing(t, {EXT}, monkeypatch)
        with pytest.raises(DiskFullError):
            t.place(np.zeros(EXT, np.uint8), 1, EXT)
        assert t.used_bytes == 3 * EXT
    finally:
        t.close()


def test_a_put_over_scattered_holes_writes_them_at_once_and_sets_refused_ones_aside(tmp_path, monkeypatch):
    t = open_tier(tmp_path / "blocks.kvd", 1 << 20, 32)
    try:
        for k in range(1, 32, 2):  # 16 holes of one extent, as deletes leave them
            t.allocator.free(k * EXT, EXT)
        tried = refusing(t, {3 * EXT, 11 * EXT}, monkeypatch)
        threads, write = set(), t.write
        monkeypatch.setattr(t, "write", lambda off, data: (threads.add(threading.current_thread().name), write(off, data)))
        src = np.random.default_rng(0).integers(0, 256, 12 * EXT, dtype=np.uint8)
        offs = t.place(src, 12, EXT)
        assert len(set(offs)) == 12 and not {3 * EXT, 11 * EXT} & set(offs)
        assert {3 * EXT, 11 * EXT} < set(tried) and len(tried) == 14  # each refused range tried once
        assert any(n.startswith("kvstored-ssd-write") for n in threads)  # on the writers' pool (the retries of two: here)
        for i, off in enumerate(offs):
            assert os.pread(t.fd, EXT, off) == src[i * EXT: (i + 1) * EXT].tobytes()
    finally:
        t.close()


def test_a_scattered_put_that_fails_waits_for_its_other_writes_before_freeing_their_space(tmp_path, monkeypatch):
    t = open_tier(tmp_path / "blocks.kvd", 1 << 20, 16)
    try:
        for k in range(1, 16, 2):
            t.allocator.free(k * EXT, EXT)
        ended = []

        def write(offset, data):
            if offset == EXT:
                raise RuntimeError("a write that fails at once")
            time.sleep(0.2)
            ended.append(time.monotonic())

        monkeypatch.setattr(t, "write", write)
        with pytest.raises(RuntimeError):
            t.place(np.zeros(8 * EXT, np.uint8), 8, EXT)
        raised = time.monotonic()
        assert len(ended) == 7 and max(ended) <= raised
        assert t.used_bytes == 8 * EXT  # the put's extents given back
    finally:
        t.close()
