"""Pool buffers through a real kvstored: an engine's unsealed shared memory, mapped by the
daemon under its SIGBUS guard, read and written at scattered block offsets; a client that
shrinks it gets errors for its own requests on it and the daemon serves on."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvdrive.protocol import ErrorCode
from kvdrive_client.errors import StoreError
from kvdrive_client.shm import PoolBuffer
from test_block_namespace import damage_block

BB = 64 << 10  # one part
POOL = 4 << 20
# Where 6 blocks lie in the pool for the put, and where the get puts them: scattered, not
# 4 KiB-aligned, not in key order, two of them adjacent.
SRC = [17, 3 * BB + 5, 3 * BB + 5 + BB, 40 * BB + 1, 9 * BB + 333, 20 * BB + 4095]
DST = [50 * BB + 7, 30 * BB + 1, 44 * BB, 44 * BB + BB, 13, 33 * BB + 12345]


def key(i: int) -> bytes:
    return b"p" + i.to_bytes(8, "little")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, BB, dtype=np.uint8)


def memfd_pool(size: int = POOL) -> tuple[int, np.ndarray]:
    """An unsealed memfd (as SGLang's host pool makes it) and the engine's own mapping of it."""
    fd = os.memfd_create("engine-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    import mmap  # noqa: PLC0415

    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    return fd, np.frombuffer(m, dtype=np.uint8)


def fill(arr: np.ndarray, offsets, ids) -> None:
    for off, i in zip(offsets, ids):
        arr[off: off + BB] = block(i)


def code_of(exc: pytest.ExceptionInfo) -> ErrorCode:
    assert isinstance(exc.value, StoreError)
    return exc.value.code


def all_refused(cases, engine: np.ndarray) -> None:
    """Each of ``cases`` ((request maker, error code)) fails with its code, and none writes
    into the pool's bytes from ``2 * BB`` on."""
    engine[2 * BB:] = 0x11
    for make, code in cases:
        with pytest.raises(StoreError) as exc:
            make().wait()
        assert code_of(exc) is code, str(exc.value)
    assert (engine[2 * BB:] == 0x11).all(), "a refused get wrote into the pool"


def started_pool(daemon_factory, dram: str):
    """A daemon with a DRAM tier of ``dram``, a client of it, and a memfd pool it registered
    (its descriptor, the engine's mapping, the pool), the pool's bytes 0xEE."""
    d = daemon_factory(dram=dram).start()
    c = d.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    engine[:] = 0xEE
    return d, c, fd, engine, pool


@pytest.mark.parametrize("dram", ["64M", "0"])
def test_pool_put_and_get_at_scattered_offsets_are_byte_exact(daemon_factory, dram):
    d, c, fd, engine, pool = started_pool(daemon_factory, dram)
    assert pool.kind == "pool" and pool.buf_id is not None
    fill(engine, SRC, range(6))
    r = c.block_put_async("eng", BB, [key(i) for i in range(6)], pool, offsets=SRC).wait()
    assert (r["stored"], r["present"]) == (6, 0)
    engine[:] = 0xEE
    before = c.stats()["counters"]
    r = c.block_get_async("eng", [key(i) for i in range(6)], pool, offsets=DST).wait()
    assert r["found"] == [True] * 6 and r["damaged"] == []
    after = c.stats()["counters"]
    tier = "blocks_dram" if dram != "0" else "blocks_ssd"
    assert after.get(tier, 0) - before.get(tier, 0) == 6
    expect = np.full(POOL, 0xEE, np.uint8)
    fill(expect, DST, range(6))
    np.testing.assert_array_equal(engine, expect)  # every block in place, no other byte touched
    # The daemon wrote into the file: a mapping made afterwards sees the same bytes.
    assert os.pread(fd, BB, DST[2]) == block(2).tobytes()
    os.close(fd)
    assert d.stop() == 0


def test_offsets_work_for_a_memfd_buffer_too(daemon):
    c = daemon.client()
    buf = c.register(POOL)
    fill(buf.array, SRC, range(6))
    c.block_put_async("eng", BB, [key(i) for i in range(6)], buf, offsets=SRC).wait()
    buf.array[:] = 0
    r = c.block_get_async("eng", [key(i) for i in range(6)], buf, offset=3, offsets=DST[::-1]).wait()
    assert r["found"] == [True] * 6
    for i, off in enumerate(DST[::-1]):
        assert (buf.array[3 + off: 3 + off + BB] == block(i)).all()


@pytest.mark.parametrize("dram", ["64M", "0"])
def test_a_shrunk_pool_fails_its_own_requests_and_the_daemon_serves_on(daemon_factory, dram):
    d = daemon_factory(dram=dram).start()
    c, other = d.client(), d.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL)  # mapped by the client object itself
    pool.array[: 4 * BB] = np.concatenate([block(i) for i in range(4)])
    c.block_put_async("eng", BB, [key(i) for i in range(4)], pool).wait()
    os.ftruncate(fd, POOL // 4)  # the engine shrinks its file under the registration
    lost = POOL // 2
    with pytest.raises(StoreError) as exc:
        c.block_get_async("eng", [key(0), key(1)], pool, offsets=[0, lost]).wait()
    assert code_of(exc) is ErrorCode.BUFFER and "shrank" in str(exc.value)
    assert os.fstat(fd).st_size == POOL // 4, "the daemon grew the client's file"
    # The guard put zeros where the file was: the pool no longer shows the client's memory,
    # so every later request on it fails, a put before it stores anything.
    for lost_or_not in (lost, 0):
        with pytest.raises(StoreError) as exc:
            c.block_put_async("eng", BB, [key(9)], pool, offset=lost_or_not).wait()
        assert code_of(exc) is ErrorCode.BUFFER and "register the pool again" in str(exc.value)
    assert c.block_lookup("eng", [key(9)]) == [False]
    with pytest.raises(StoreError) as exc:
        c.block_get_async("eng", [key(2)], pool, offset=BB).wait()
    assert code_of(exc) is ErrorCode.BUFFER
    # Registered again at the size it has now, it works.
    again = c.register_pool(fd, POOL // 4)
    r = c.block_get_async("eng", [key(2)], again, offset=BB).wait()
    assert r["found"] == [True] and os.pread(fd, BB, BB) == block(2).tobytes()
    buf = other.register(4 * BB)
    other.block_put_async("eng", BB, [key(5)], buf).wait()
    assert other.block_get_async("eng", [key(5)], buf).wait()["found"] == [True]
    assert d.alive()
    os.close(fd)
    del engine
    assert d.stop() == 0


def test_the_guard_is_ready_before_the_first_pool_is_registered(daemon):
    """kvstored compiles and installs its SIGBUS guard as it starts, on a thread of its own:
    an engine's first pool registration after a (re)start does not wait for the compiler."""
    deadline = time.monotonic() + 30
    while "SIGBUS guard installed" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    fd, _ = memfd_pool()
    with daemon.client() as c:
        c.register_pool(fd, POOL)
    os.close(fd)
    assert daemon.log().count("SIGBUS guard installed") == 1


def test_a_pool_must_be_shared_memory_of_its_size(daemon, tmp_path):
    c = daemon.client()
    stand_in = np.zeros(POOL, np.uint8)  # the client object maps nothing: the daemon decides
    r, w = os.pipe()
    with pytest.raises(StoreError, match="not a regular file .a pipe") as exc:
        c.register_pool(PoolBuffer.from_fd(w, POOL, stand_in))
    assert code_of(exc) is ErrorCode.BUFFER
    disk = tmp_path / "pool.bin"
    with open(disk, "wb") as f:
        f.truncate(POOL)
    dfd = os.open(disk, os.O_RDWR)
    if _on_tmpfs(tmp_path):
        pytest.skip("the test's temp directory is on tmpfs")
    with pytest.raises(StoreError, match="not shared memory") as exc:
        c.register_pool(PoolBuffer.from_fd(dfd, POOL, stand_in))
    assert code_of(exc) is ErrorCode.BUFFER
    fd, _ = memfd_pool(POOL)
    with pytest.raises(StoreError, match=f"is {POOL} bytes, registered as {POOL + 1}") as exc:
        c.register_pool(PoolBuffer.from_fd(fd, POOL + 1, np.zeros(POOL + 1, np.uint8)))
    assert code_of(exc) is ErrorCode.BUFFER
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    with pytest.raises(StoreError, match="reading and writing"):
        c.register_pool(PoolBuffer.from_fd(ro, POOL, stand_in))
    assert c.register_pool(fd, POOL).buf_id is not None  # the same memfd, at its size
    assert daemon.alive()
    for x in (r, w, dfd, fd, ro):
        os.close(x)


def _on_tmpfs(path) -> bool:
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if str(path).startswith(m[4])), key=lambda m: len(m[4]))
    return best[best.index("-") + 1] == "tmpfs"


def test_offsets_are_checked(daemon):
    c = daemon.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    fill(engine, [0, BB], [0, 1])
    c.block_put_async("eng", BB, [key(0), key(1)], pool).wait()
    keys = [key(0), key(1)]
    cases = [
        (lambda: c.block_get_async("eng", keys, pool, offsets=[0, POOL - BB + 1]), ErrorCode.BUFFER),
        (lambda: c.block_put_async("eng", BB, keys, pool, offsets=[POOL, 0]), ErrorCode.BUFFER),
        (lambda: c.block_get_async("eng", keys, pool, offsets=[0]), ErrorCode.BAD_FIELD),
        (lambda: c.block_put_async("eng", BB, keys, pool, offsets=[0, 1, 2]), ErrorCode.BAD_FIELD),
        (lambda: c.block_get_async("eng", keys, pool, offsets=[-1, BB]), ErrorCode.OUT_OF_RANGE),
        (lambda: c.block_get_async("eng", keys, pool, offsets=[BB, BB + BB - 1]), ErrorCode.BAD_FIELD),
        (lambda: c.block_get_async("eng", keys, pool, offsets=[5, 5]), ErrorCode.BAD_FIELD),
        (lambda: c.block_get_async("eng", keys, pool, offset=POOL - BB, offsets=[0, BB]), ErrorCode.BUFFER),
    ]
    all_refused(cases, engine)
    # Adjacent destinations are not overlapping, and a put may read one source twice.
    assert c.block_get_async("eng", keys, pool, offsets=[3 * BB, 2 * BB]).wait()["found"] == [True, True]
    assert (engine[3 * BB: 4 * BB] == block(0)).all() and (engine[2 * BB: 3 * BB] == block(1)).all()
    assert c.block_put_async("eng", BB, [key(7), key(8)], pool, offsets=[0, 0]).wait()["stored"] == 2


@pytest.mark.damages_store
def test_a_damaged_block_never_reaches_the_pool(daemon_factory):
    d = daemon_factory(dram="0").start()
    c = d.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    fill(engine, SRC[:4], range(4))
    c.block_put_async("eng", BB, [key(i) for i in range(4)], pool, offsets=SRC[:4]).wait()
    assert d.stop() == 0
    damage_block(d, key(2))
    d.start()
    c = d.client()
    pool = c.register_pool(fd, POOL, array=engine)
    engine[:] = 0xEE
    r = c.block_get_async("eng", [key(i) for i in range(4)], pool, offsets=DST[:4]).wait()
    assert r["found"] == [True, True, False, True] and r["damaged"] == [2]
    assert (engine[DST[2]: DST[2] + BB] == 0xEE).all(), "the damaged block's destination was written"
    for i in (0, 1, 3):
        assert (engine[DST[i]: DST[i] + BB] == block(i)).all()
    os.close(fd)
    assert d.stop() == 0


def test_a_pool_is_registered_again_with_a_restarted_daemon(daemon):
    c = daemon.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    os.close(fd)  # the client object keeps its own descriptor
    fill(engine, [0], [0])
    c.block_put_async("eng", BB, [key(0)], pool).wait()
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.wait(30)
    daemon.start()
    engine[:] = 0
    assert c.block_get_async("eng", [key(0)], pool, offsets=[5 * BB + 1]).wait()["found"] == [True]
    assert c.restarts_seen == 1 and (engine[5 * BB + 1: 6 * BB + 1] == block(0)).all()


@pytest.mark.parametrize("offset", [POOL // 2, POOL // 2 + 5], ids=["written-from-the-pool", "through-staging"])
def test_a_put_from_a_pool_shrunk_under_it_stores_nothing(daemon_factory, offset):
    d = daemon_factory(dram="64M").start()
    c = d.client()
    fd, engine = memfd_pool()
    pool = c.register_pool(fd, POOL, array=engine)
    os.ftruncate(fd, POOL // 4)
    with pytest.raises(StoreError) as exc:
        c.block_put_async("eng", BB, [key(1)], pool, offset=offset).wait()
    assert code_of(exc) is ErrorCode.BUFFER and "shrank" in str(exc.value)
    assert c.block_lookup("eng", [key(1)]) == [False]
    buf = c.register(BB)
    buf.array[:] = block(1)
    c.block_put_async("eng", BB, [key(1)], buf).wait()  # the key was left free, and the daemon serves on
    buf.array[:] = 0
    assert c.block_get_async("eng", [key(1)], buf).wait()["found"] == [True] and (buf.array == block(1)).all()
    os.close(fd)
    del engine
    assert d.stop() == 0


def test_pools_shrunk_mid_copy_fail_alone_while_another_client_loads(daemon_factory):
    """A client shrinks its pool while the daemon copies into it, again and again; another
    client loads all the while: its blocks come back byte-exact and the daemon lives."""
    d = daemon_factory(dram="256M").start()
    n, bb = 32, 256 << 10
    stop, seen = threading.Event(), {"failed": 0, "honest": 0, "wrong": 0}

    def hostile():
        try:
            c = d.client()
            fd, _ = memfd_pool(n * bb)
            c.block_put_async("h", bb, [key(i) for i in range(n)], c.register_pool(fd, n * bb)).wait()
            for i in range(30):
                os.ftruncate(fd, n * bb)
                pool = c.register_pool(fd, n * bb)
                shrink = threading.Timer(0.0002 * (i % 8), os.ftruncate, (fd, bb))
                shrink.start()
                try:
                    c.block_get_async("h", [key(j) for j in range(n)], pool).wait()
                except StoreError as exc:
                    seen["failed"] += exc.code is ErrorCode.BUFFER
                shrink.join()
                c.unregister(pool)
        finally:
            stop.set()

    def honest():
        c = d.client()
        buf = c.register(n * bb)
        data = np.random.default_rng(3).integers(0, 256, n * bb, dtype=np.uint8)
        buf.array[:] = data
        c.block_put_async("b", bb, [key(i) for i in range(n)], buf).wait()
        while not stop.is_set():
            buf.array[:] = 0
            r = c.block_get_async("b", [key(i) for i in range(n)], buf).wait()
            seen["honest" if all(r["found"]) and (buf.array == data).all() else "wrong"] += 1

    threads = [threading.Thread(target=hostile), threading.Thread(target=honest)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen["failed"] > 0, "no shrink landed during a copy"
    assert seen["honest"] > 0 and seen["wrong"] == 0 and d.alive()
    assert d.stop() == 0


def test_after_a_restart_a_request_names_its_buffer_by_the_new_sessions_id(daemon):
    """Buffers get new ids when a restarted daemon's session registers them again; a request
    built before the client noticed the restart must name its buffer by the new id, not by
    the old one, which the new session may have given to another buffer."""
    c = daemon.client()
    first, mine, other = c.register(BB), c.register(BB), c.register(BB)
    mine.array[:] = block(1)
    c.block_put_async("eng", BB, [key(1)], mine).wait()
    c.unregister(first)  # the others' ids now differ from what a new session gives them
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.wait(30)
    daemon.start()
    mine.array[:] = 0
    other.array[:] = 7
    assert c.block_get_async("eng", [key(1)], mine).wait()["found"] == [True]
    assert c.restarts_seen == 1
    assert (mine.array == block(1)).all() and (other.array == 7).all()
