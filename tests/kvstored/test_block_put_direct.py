"""Engine blocks written straight from the client's buffer: no staging copy where the
data file can take them as they lie, a staging copy where it cannot, and bytes changed
under the write reported damaged, never returned."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvdrive_client.shm import SharedBuffer
from kvstored.config import DaemonConfig
from kvstored.protocol import BlockGet, BlockPut, ProtocolError
from kvstored.sessions import SessionLimits, SessionTable
from kvstored.store import Store

BB = 64 << 10
N = 8


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(8, "little")


def blocks_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (N, BB), dtype=np.uint8)


@pytest.fixture
def rig(tmp_path):
    made: list = []

    def make(dram: int):
        store = Store(DaemonConfig(ssd_dir=tmp_path / f"ssd{len(made)}", dram_bytes=dram, ssd_max_bytes=1 << 30))
        session = SessionTable(SessionLimits(), 1 << 40, store.gate.retire).open(1, 1000, 1000)
        src, dst = SharedBuffer(N * BB + 4096), SharedBuffer(N * BB)
        made.append((store, src, dst))
        return store, session, src, dst, session.buffers.register_fd(src.fd, src.size).buf_id, \
            session.buffers.register_fd(dst.fd, dst.size).buf_id

    yield make
    for store, src, dst in made:
        store.close()
        src.close()
        dst.close()


def put(store, session, buf: int, offset: int = 0):
    p = store.blocks.prepare_put(BlockPut("eng", BB, tuple(key(i) for i in range(N)), buf, offset), session)
    assert not store.commit_puts([p])
    return p


def get(store, session, buf: int) -> dict:
    return store.blocks.get(BlockGet("eng", tuple(key(i) for i in range(N)), buf, 0), session)


@pytest.mark.parametrize("dram", [0, 64 << 20], ids=["ssd", "dram"])
def test_aligned_blocks_are_written_from_the_clients_buffer(rig, dram):
    store, session, src, dst, src_id, dst_id = rig(dram)
    data = blocks_of(1)
    src.array[: N * BB] = data.ravel()
    p = put(store, session, src_id)
    assert p.staging_map is None and store.puts.staging.mapped == 0  # no staging copy
    assert len(p.dram_slots) == (N if dram else 0)  # copied into DRAM beside the write
    src.array[:] = 0  # the reply came: the client may reuse its buffer
    r = get(store, session, dst_id)
    assert r["found"] == [True] * N and not r["damaged"]
    assert (dst.array[: N * BB].reshape(N, BB) == data).all()
    assert store.counters["blocks_dram" if dram else "blocks_ssd"] == N


def test_unaligned_blocks_go_through_staging(rig):
    store, session, src, dst, src_id, dst_id = rig(0)
    data = blocks_of(2)
    src.array[512: 512 + N * BB] = data.ravel()
    p = put(store, session, src_id, offset=512)  # O_DIRECT could not write from here
    assert p.staging_map is not None and store.puts.staging.mapped == 1
    r = get(store, session, dst_id)
    assert r["found"] == [True] * N and (dst.array[: N * BB].reshape(N, BB) == data).all()


@pytest.mark.parametrize("dram", [0, 64 << 20], ids=["ssd", "dram"])
def test_bytes_the_client_changes_under_the_write_are_damaged_not_returned(rig, dram, monkeypatch):
    store, session, src, dst, src_id, dst_id = rig(dram)
    data = blocks_of(3)
    src.array[: N * BB] = data.ravel()
    summed, copy_and_sum, write = threading.Event(), store.puts._copy_and_sum, store.ssd.write

    def sum_then_signal(*args):
        out = copy_and_sum(*args)
        summed.set()
        return out

    def write_changed(offset, data):  # the client writes its buffer after the checksums, before the write
        assert summed.wait(10)
        src.array[BB: 2 * BB] ^= 0xFF
        write(offset, data)

    monkeypatch.setattr(store.puts, "_copy_and_sum", sum_then_signal)
    monkeypatch.setattr(store.ssd, "write", write_changed)
    put(store, session, src_id)
    dst.array[:] = 7
    r = get(store, session, dst_id)
    if dram:  # the DRAM copies and their checksums are of the bytes before the change
        assert r["found"] == [True] * N and (dst.array[: N * BB].reshape(N, BB) == data).all()
        with store.index.lock:  # as if evicted: SSD reads
            store.residency.forget(store.blocks.tables[(session.uid, "eng")].entry)
        dst.array[:] = 7
        r = get(store, session, dst_id)
    assert r["damaged"] == [1] and r["found"] == [True] + [False] + [True] * (N - 2)
    assert (dst.array[BB: 2 * BB] == 7).all()  # a damaged block's destination is left as it was


def test_a_failed_commit_gives_back_the_dram_slots_and_extents_it_took(rig, monkeypatch):
    store, session, src, dst, src_id, dst_id = rig(64 << 20)
    src.array[: N * BB] = blocks_of(4).ravel()

    def failing_sync():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.ssd, "sync", failing_sync)
    p = store.blocks.prepare_put(BlockPut("eng", BB, tuple(key(i) for i in range(N)), src_id, 0), session)
    assert store.dram.num_blocks == N and store.ssd.used_bytes == N * BB  # reserved and written
    with pytest.raises(ProtocolError):
        store.commit_puts([p])
    assert store.dram.num_blocks == 0 and store.ssd.used_bytes == 0
    monkeypatch.undo()
    put(store, session, src_id)  # the keys were not taken
    assert get(store, session, dst_id)["found"] == [True] * N
