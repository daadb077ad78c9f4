"""kvstored.pools.PoolBuffer on its own: blocks moved through the daemon's mapping of an
unsealed shared-memory file, the SIGBUS guard when the client shrinks it, and the
registry's checks of the descriptor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstored.buffers import BufferRegistry, MappedBudget
from kvstored.checksum import block_crcs
from kvstored.limits import BufferLimits
from kvstored.protocol import ErrorCode, ProtocolError
from kvstored.sigbus import SLOTS

NB = 8192 + 3  # not a multiple of 4 KiB: nothing here needs alignment
SIZE = 64 * NB


@pytest.fixture
def memfd():
    fd = os.memfd_create("pool-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    yield fd
    os.close(fd)


@pytest.fixture
def registry():
    budget = MappedBudget(1 << 30)
    reg = BufferRegistry(BufferLimits(max_buffers=4, max_bytes=1 << 28), budget, os.getuid())
    yield reg, budget
    for buf_id in list(reg._buffers):
        reg.close_mapping(reg.unregister(buf_id))


def test_blocks_move_through_the_mapping_byte_exact(memfd, registry):
    reg, budget = registry
    pool = reg.register_pool(memfd, SIZE)
    assert pool.kind == "pool" and budget.used == SIZE and budget.fds == 1
    src = np.random.default_rng(0).integers(0, 256, 6 * NB, dtype=np.uint8)
    dst = np.array([11, 10, 12, 30, 31, 50]) * NB
    pool.write_blocks(src, np.arange(6) * NB, dst, NB)
    raw = os.pread(memfd, SIZE, 0)  # in the client's file, not a copy of it
    for i, d in enumerate(dst.tolist()):
        assert raw[d: d + NB] == src[i * NB: (i + 1) * NB].tobytes()
    back = np.zeros(6 * NB, np.uint8)
    pool.read_blocks(dst, back, np.arange(6)[::-1] * NB, NB)
    assert (back.reshape(6, NB)[::-1] == src.reshape(6, NB)).all()
    reg.close_mapping(reg.unregister(pool.buf_id))
    assert budget.used == 0 and budget.fds == 0 and pool.row == -1


def test_write_verified_writes_only_blocks_that_check(memfd, registry):
    pool = registry[0].register_pool(memfd, SIZE)
    src = np.random.default_rng(1).integers(0, 256, 3 * NB, dtype=np.uint8)
    offs = np.arange(3) * NB
    tags = np.array([5, 6, 7], np.uint32)
    expect = block_crcs(src, offs, NB) ^ tags
    expect[1] ^= 1  # block 1 is damaged
    os.pwrite(memfd, b"\xee" * (3 * NB), 0)
    assert pool.write_verified(src, offs, offs, NB, tags, expect).tolist() == [True, False, True]
    raw = os.pread(memfd, 3 * NB, 0)
    assert raw[NB: 2 * NB] == b"\xee" * NB
    assert raw[:NB] == src[:NB].tobytes() and raw[2 * NB:] == src[2 * NB:].tobytes()


@pytest.mark.parametrize("first", ["write", "read", "write_verified"])
def test_a_shrunk_pool_fails_that_copy_and_every_later_one_and_the_process_lives(memfd, registry, first):
    pool = registry[0].register_pool(memfd, SIZE)
    os.ftruncate(memfd, 10 * NB)
    block = np.full(NB, 9, np.uint8)
    with pytest.raises(ProtocolError) as exc:
        if first == "write":
            pool.write_blocks(block, np.array([0]), np.array([20 * NB]), NB)
        elif first == "read":
            pool.read_blocks(np.array([20 * NB]), block, np.array([0]), NB)
        else:
            pool.write_verified(block, np.array([0]), np.array([20 * NB]), NB, np.zeros(1, np.uint32),
                                block_crcs(block, np.array([0]), NB))
    assert exc.value.code is ErrorCode.BUFFER and "shrank" in str(exc.value)
    assert os.fstat(memfd).st_size == 10 * NB, "the daemon grew the client's file"
    with pytest.raises(ProtocolError, match="register the pool again"):
        pool.read_blocks(np.array([0]), block, np.array([0]), NB)  # within what is left: still refused
    # A new registration of what the file holds now works.
    again = registry[0].register_pool(memfd, 10 * NB)
    again.write_blocks(np.full(NB, 4, np.uint8), np.array([0]), np.array([NB]), NB)
    assert os.pread(memfd, NB, NB) == b"\x04" * NB


def test_a_fault_outside_every_pool_still_ends_the_process():
    """The guard handles its own ranges only: any other SIGBUS goes to what was there before
    (here faulthandler, which prints the stack, then the default: the process dies)."""
    child = textwrap.dedent("""
        import faulthandler, mmap, os
        import numpy as np
        faulthandler.enable()
        from kvstored.sigbus import guard
        fd = os.memfd_create("mine"); os.ftruncate(fd, 1 << 16)
        g = guard()
        row = g.add(np.frombuffer(mmap.mmap(fd, 1 << 16), np.uint8).ctypes.data, 1 << 16)
        os.ftruncate(fd, 0)
        print("guarded", row, flush=True)
        other = os.memfd_create("other"); os.ftruncate(other, 8192)
        a = np.frombuffer(mmap.mmap(other, 8192), np.uint8)
        os.ftruncate(other, 0)
        a[100] = 1
        print("survived", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert "guarded 0" in r.stdout and "survived" not in r.stdout
    assert r.returncode == -signal.SIGBUS and "Bus error" in r.stderr


def test_a_pool_must_be_a_shared_memory_file(registry):
    reg, budget = registry
    r, w = os.pipe()
    with pytest.raises(ProtocolError, match="a pipe"):
        reg.register_pool(r, 1)
    assert budget.used == 0 and budget.fds == 0
    os.close(r), os.close(w)


def memfds(n: int) -> list[int]:
    fds = [os.memfd_create(f"pool-test-{i}", os.MFD_CLOEXEC) for i in range(n)]
    for fd in fds:
        os.ftruncate(fd, SIZE)
    return fds


def test_pools_hold_at_most_their_share_of_descriptors(memfd):
    budget = MappedBudget(1 << 30, max_fds=8)  # a quarter per user: 2
    reg = BufferRegistry(BufferLimits(max_buffers=16, max_bytes=1 << 28), budget, 1000)
    files = memfds(3)
    held = [reg.register_pool(fd, SIZE) for fd in files[:2]]
    with pytest.raises(ProtocolError, match="pools are registered") as exc:
        reg.register_pool(files[2], SIZE)
    assert exc.value.code is ErrorCode.BUFFER and budget.fds == 2 and budget.used == 2 * SIZE
    other = BufferRegistry(BufferLimits(), budget, 1001)
    other.close_mapping(other.unregister(other.register_pool(memfd, SIZE).buf_id))  # another user has room
    r, w = os.pipe()
    with pytest.raises(ProtocolError, match="a pipe"):
        other.register_pool(r, 1)  # a refusal gives the descriptor back
    os.close(r), os.close(w)
    for mb in held:
        reg.close_mapping(reg.unregister(mb.buf_id))
    assert budget.fds == 0 and budget.used == 0
    assert MappedBudget(1 << 30).max_fds >= 4
    for fd in files:
        os.close(fd)


def test_one_users_registrations_of_one_pool_count_once(memfd):
    """An engine registers its host pool on each of its connections, and the daemon maps it
    once: a user's share and the descriptors count it once, however many sessions hold it."""
    budget = MappedBudget(8 * SIZE, max_fds=8)  # a user's share: 2 pools' bytes
    sessions = [BufferRegistry(BufferLimits(max_buffers=4, max_bytes=1 << 28), budget, 1000) for _ in range(3)]
    held = [(reg, reg.register_pool(memfd, SIZE)) for reg in sessions for _ in range(2)]
    assert budget.used == SIZE and budget.fds == 1
    other = memfds(2)
    second = sessions[0].register_pool(other[0], SIZE)
    with pytest.raises(ProtocolError, match="a user's share"):
        sessions[1].register_pool(other[1], SIZE)
    assert budget.used == 2 * SIZE and budget.fds == 2
    for reg, mb in held[:-1]:
        reg.close_mapping(reg.unregister(mb.buf_id))
    assert budget.used == 2 * SIZE and budget.fds == 2  # one registration of the first file is left
    reg, mb = held[-1]
    reg.close_mapping(reg.unregister(mb.buf_id))
    sessions[0].close_mapping(sessions[0].unregister(second.buf_id))
    assert budget.used == 0 and budget.fds == 0
    for fd in other:
        os.close(fd)


def test_no_user_can_take_every_row_of_the_guard(memfd):
    budget = MappedBudget(1 << 40, max_fds=None)
    assert budget.max_fds <= SLOTS
    small = MappedBudget(1 << 40, max_fds=min(budget.max_fds, 16))  # the same share rule, fewer rows to fill
    reg = BufferRegistry(BufferLimits(max_buffers=64, max_bytes=1 << 30), small, 1000)
    files = memfds(small.max_fds // 4 + 1)
    held = [reg.register_pool(fd, SIZE) for fd in files[:-1]]
    with pytest.raises(ProtocolError, match="pools are registered"):
        reg.register_pool(files[-1], SIZE)
    for mb in held:
        reg.close_mapping(reg.unregister(mb.buf_id))
    for fd in files:
        os.close(fd)


def test_pools_on_one_file_share_one_mapping_until_it_faults(memfd, registry):
    reg, _ = registry
    a, b = reg.register_pool(memfd, SIZE), reg.register_pool(memfd, SIZE)
    assert a.array.ctypes.data == b.array.ctypes.data and a.row == b.row  # one mapping, one guard row
    reg.close_mapping(reg.unregister(a.buf_id))
    b.write_blocks(np.full(NB, 3, np.uint8), np.array([0]), np.array([NB]), NB)  # the other still maps it
    assert os.pread(memfd, NB, NB) == b"\x03" * NB
    os.ftruncate(memfd, NB)
    with pytest.raises(ProtocolError, match="shrank"):
        b.write_blocks(np.full(NB, 3, np.uint8), np.array([0]), np.array([4 * NB]), NB)
    os.ftruncate(memfd, SIZE)  # grown back: a new registration maps it anew, not the faulted mapping
    c = reg.register_pool(memfd, SIZE)
    assert c.row != b.row
    c.write_blocks(np.full(NB, 5, np.uint8), np.array([0]), np.array([4 * NB]), NB)
    assert os.pread(memfd, NB, 4 * NB) == b"\x05" * NB


def test_faults_far_apart_put_one_mapping_over_the_pool_not_one_a_page(memfd, registry):
    """A page at a time, a client that makes the daemon fault pages far apart would split its
    mappings past the kernel's limit on them (the daemon's next fault then kills it): the
    guard puts anonymous memory over the whole pool at the first fault, one mapping."""
    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    pool = registry[0].register_pool(memfd, SIZE)
    os.ftruncate(memfd, 0)
    before = maps()
    spread = np.arange(0, 64, 2) * NB  # every other block: apart, in 32 places
    with pytest.raises(ProtocolError, match="shrank"):
        pool.read_blocks(spread, np.zeros(32 * NB, np.uint8), np.arange(32) * NB, NB)
    assert maps() <= before + 2, "a mapping per fault"


def test_a_pool_mapping_loses_its_guard_row_even_when_a_view_of_it_outlives_it(memfd, registry):
    """A row must not outlive its mapping, whose addresses another mapping may take: a view
    left alive (an exception's traceback, say) keeps the mapping until it goes, but the
    row is freed when the last pool on it is unregistered."""
    from kvstored.sigbus import guard

    reg, _ = registry
    pool = reg.register_pool(memfd, SIZE)
    row, view = pool.row, pool.array[:NB]
    assert guard().table[row, 1] != 0
    reg.close_mapping(reg.unregister(pool.buf_id))  # the mapping cannot close: a view is alive
    assert guard().table[row, 1] == 0 and guard().table[row, 0] == 0
    assert view.sum() >= 0  # still mapped, readable, unguarded and unused by the daemon
    del view


def test_a_faulted_pool_is_not_populated_ahead(memfd, registry, monkeypatch):
    """A faulted pool's mapping is anonymous memory: faulting its pages in ahead would take
    the daemon's own memory, as much as the client registered, for a file it shrank."""
    from kvstored import pools

    pool = registry[0].register_pool(memfd, SIZE)
    os.ftruncate(memfd, 0)
    with pytest.raises(ProtocolError, match="shrank"):
        pool.read_blocks(np.array([0]), np.zeros(NB, np.uint8), np.array([0]), NB)
    calls = []
    monkeypatch.setattr(pools._libc, "madvise", lambda *a: calls.append(a) or 0)
    pool.owner.populate()
    assert calls == []
