"""The daemon's CUDA IPC path, in process, over a fake device runtime.

"Device memory" here is host arrays the fake hands out by handle; every copy the
daemon asks of it is checked to lie inside one allocation. What this checks: a
registration opens its handle once (once per allocation, however many ranges of it
are registered) and checks its range against the allocation; puts read from the
buffer and gets write into it at ``base + offset + dst`` through the store's own
bookkeeping, from the DRAM tier and from the SSD; a damaged SSD block is never
written; unregister and a session's end close the handle. It says nothing about
real CUDA: test_cuda_ipc.py's ``gpu`` test does, on a host with a device.
"""

from __future__ import annotations

import ctypes
import secrets
import threading

import numpy as np
import pytest

from kvdrive.layout.geometry import Geometry
from kvdrive_client.shm import SharedBuffer
from kvstored import cuda_ipc
from kvstored.config import DaemonConfig
from kvstored.cuda_ipc import CudaIpc, CudaIpcBuffer
from kvstored.protocol import Create, ErrorCode, Get, ProtocolError, Put, RegisterCudaIpc
from kvstored.sessions import SessionLimits, SessionTable
from kvstored.store import Store

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=8)
BB = GEOM.block_bytes
PAGES = 6


class FakeDevice:
    """A DeviceRuntime over host memory: allocations by handle, bounds-checked copies."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.allocs: dict[bytes, np.ndarray] = {}
        self.opened: dict[int, bytes] = {}
        self.opens = self.closes = self.copies = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> tuple[bytes, np.ndarray]:
        handle = secrets.token_bytes(64)
        self.allocs[handle] = np.zeros(nbytes, dtype=np.uint8)
        return handle, self.allocs[handle]

    def device_count(self) -> int:
        return self.devices

    def open_handle(self, device: int, handle: bytes) -> int:
        if handle not in self.allocs:
            raise RuntimeError("cudaErrorInvalidValue: invalid argument")
        ptr = self.allocs[handle].ctypes.data
        assert ptr not in self.opened, "an allocation opened twice in one context"
        with self._lock:
            self.opened[ptr] = handle
            self.opens += 1
        return ptr

    def close_handle(self, device: int, ptr: int) -> None:
        with self._lock:
            del self.opened[ptr]
            self.closes += 1

    def allocation_bytes(self, device: int, ptr: int) -> int:
        a = self.allocs[self.opened[ptr]]
        return a.ctypes.data + a.nbytes - ptr

    def _inside(self, ptr: int, nbytes: int) -> None:
        for base in self.opened:
            a = self.allocs[self.opened[base]]
            if base <= ptr and ptr + nbytes <= base + a.nbytes:
                return
        raise AssertionError(f"a device copy of {nbytes} bytes at {ptr:#x} lies outside every open allocation")

    def to_device(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._inside(dst_ptr, nbytes)
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
        self.copies += 1

    def to_host(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._inside(src_ptr, nbytes)
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
        self.copies += 1

    def synchronize(self, device: int) -> None:
        pass

    def staging(self, device: int, nbytes: int) -> np.ndarray:
        held = getattr(self._local, "buf", None)
        if held is None or len(held) < nbytes:
            held = self._local.buf = np.empty(nbytes, dtype=np.uint8)
        return held[:nbytes]


@pytest.fixture
def rig(tmp_path):
    def make(dram: int = 64 << 20):
        fake = FakeDevice()
        cuda = CudaIpc(fake, "a fake device runtime")
        store = Store(DaemonConfig(ssd_dir=tmp_path / f"ssd{len(made)}", dram_bytes=dram, ssd_max_bytes=1 << 30,
                                   direct_io=False))
        table = SessionTable(SessionLimits(), 1 << 40, store.gate.retire, cuda)
        session = table.open(1, 1000, 1000)
        uid = store.create(Create("t", "s", GEOM, False), session.uid)["uid"]
        made.append(store)
        return fake, cuda, store, table, session, uid

    made: list[Store] = []
    yield make
    for s in made:
        s.close()


def data_of(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, PAGES, BB), dtype=np.uint8)


def put(store, session, uid, buf_id, offset=0) -> None:
    req = Put(uid, np.arange(GEOM.num_layers), np.arange(PAGES), buf_id, offset, None, None, None)
    refused = store.commit_puts([store.prepare_put(req, session)])
    assert not refused


def get(store, session, uid, buf_id, blocks, offset=0, dst=None) -> dict:
    return store.get(Get(uid, buf_id, offset, np.asarray(blocks, np.int32).reshape(-1, 3), dst), session)


def all_blocks() -> np.ndarray:
    return np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in range(PAGES)])


@pytest.mark.parametrize("dram", [64 << 20, 0], ids=["dram-hits", "ssd-reads"])
def test_puts_read_and_gets_write_device_memory_at_base_offset_dst(rig, dram):
    fake, cuda, store, table, session, uid = rig(dram)
    data = data_of(1)
    handle, mem = fake.allocate(1 << 20)
    offset = 4096 + 256  # the tensor starts inside its allocation
    size = 64 * BB
    mb = session.buffers.register_cuda(RegisterCudaIpc(handle, 1, offset, size), cuda)
    assert isinstance(mb, CudaIpcBuffer) and mb.kind == "cuda_ipc" and mb.device == 1
    # A put reads the device range (device-to-host through staging).
    mem[offset: offset + data.nbytes] = data.reshape(-1)
    put(store, session, uid, mb.buf_id)
    mem[:] = 0
    # A get writes at base + offset + request offset + dst[i], in any order.
    blocks = all_blocks()[[5, 0, 17, 3, 4, 23]]
    dst = np.array([7, 0, 1, 2, 30, 9], dtype=np.int64) * BB
    r = get(store, session, uid, mb.buf_id, blocks, offset=BB, dst=dst)
    assert r["n"] == 6 and (r["dram"], r["ssd"]) == ((6, 0) if dram else (0, 6))
    for (l, h, p), d in zip(blocks, dst):
        at = offset + BB + d
        np.testing.assert_array_equal(mem[at: at + BB], data[l, h, p])
    # Nothing else was touched: only the six blocks are non-zero.
    written = np.zeros(mem.nbytes, bool)
    for d in dst:
        written[offset + BB + d: offset + 2 * BB + d] = True
    assert not mem[~written].any()
    # The default dst (block i at i * block_bytes), the whole sequence, after the first get
    # admitted SSD reads into DRAM (where there is a DRAM tier).
    r = get(store, session, uid, mb.buf_id, all_blocks())
    np.testing.assert_array_equal(mem[offset: offset + data.nbytes], data.reshape(-1))
    if dram:
        assert r["dram"] == len(all_blocks())


def test_a_get_past_the_registered_size_is_refused_before_any_copy(rig):
    fake, cuda, store, table, session, uid = rig()
    src = SharedBuffer(PAGES * 4 * BB)
    src.array[:] = data_of(2).reshape(-1)
    put(store, session, uid, session.buffers.register_fd(src.fd, src.size).buf_id)
    handle, mem = fake.allocate(1 << 20)
    mb = session.buffers.register_cuda(RegisterCudaIpc(handle, 0, 0, 4 * BB), cuda)
    copies = fake.copies
    for offset, dst in ((3 * BB + 1, None), (0, np.array([4 * BB], np.int64))):
        with pytest.raises(ProtocolError, match="destination buffer .* too small") as err:
            get(store, session, uid, mb.buf_id, [(0, 0, 0)], offset=offset, dst=dst)
        assert err.value.code is ErrorCode.BUFFER
    assert fake.copies == copies and not mem.any()
    # A put whose source passes the registered size, too.
    with pytest.raises(ProtocolError, match="source buffer .* too small"):
        store.prepare_put(Put(uid, np.arange(2), np.array([PAGES, PAGES + 1]), mb.buf_id, 0, None, None, None), session)
    src.close()


def test_a_damaged_ssd_block_is_never_written_to_device_memory(rig):
    fake, cuda, store, table, session, uid = rig(dram=0)
    data = data_of(3)
    src = SharedBuffer(data.nbytes)
    src.array[:] = data.reshape(-1)
    put(store, session, uid, session.buffers.register_fd(src.fd, src.size).buf_id)
    entry = store.index.get(uid)
    with store.index.lock:
        entry.crc[0, 0, entry.columns(np.array([2]))[0]] ^= 1  # the stored CRC no longer matches
    handle, mem = fake.allocate(1 << 20)
    mb = session.buffers.register_cuda(RegisterCudaIpc(handle, 0, 0, 1 << 20), cuda)
    with pytest.raises(ProtocolError, match="checksum mismatch in 1 block") as err:
        get(store, session, uid, mb.buf_id, [(0, 0, 1), (0, 0, 2)], dst=np.array([0, BB], np.int64))
    assert err.value.code is ErrorCode.CHECKSUM
    assert not mem[BB: 2 * BB].any()  # the damaged block's destination is left as it was
    src.close()


def test_one_allocation_is_opened_once_and_closed_with_its_last_range(rig):
    fake, cuda, store, table, session, uid = rig()
    handle, _ = fake.allocate(1 << 20)
    a = session.buffers.register_cuda(RegisterCudaIpc(handle, 0, 0, 4096), cuda)
    b = session.buffers.register_cuda(RegisterCudaIpc(handle, 0, 8192, 4096), cuda)
    assert a.buf_id != b.buf_id and fake.opens == 1 and cuda.open_handles == 1
    table.retire_buffer(session, session.buffers.unregister(a.buf_id))
    assert fake.closes == 0
    table.retire_buffer(session, session.buffers.unregister(b.buf_id))
    assert fake.closes == 1 and cuda.open_handles == 0 and not fake.opened
    # Unregistered twice: the second time it is not found, and nothing is closed again.
    with pytest.raises(ProtocolError, match=f"buffer {b.buf_id} is not registered") as err:
        session.buffers.unregister(b.buf_id)
    assert err.value.code is ErrorCode.BUFFER
    b.close()
    assert fake.closes == 1


def test_a_sessions_end_closes_its_handles_and_gives_its_bytes_back(rig):
    fake, cuda, store, table, session, uid = rig()
    for _ in range(3):
        handle, _ = fake.allocate(1 << 16)
        session.buffers.register_cuda(RegisterCudaIpc(handle, 0, 0, 1 << 16), cuda)
    assert table.budget.used == 3 << 16 and fake.opens == 3
    table.close(session)
    assert fake.closes == 3 and not fake.opened and table.budget.used == 0


def test_ranges_past_the_allocation_bad_handles_and_devices_are_refused_with_nothing_held(rig):
    fake, cuda, store, table, session, uid = rig()
    handle, _ = fake.allocate(1 << 16)
    cases = [
        (RegisterCudaIpc(handle, 0, 1, 1 << 16), ErrorCode.BUFFER, "allocation is 65536 bytes; offset 1 \\+ size 65536"),
        (RegisterCudaIpc(handle, 0, 1 << 16, 1), ErrorCode.BUFFER, "lies past its end"),
        (RegisterCudaIpc(secrets.token_bytes(64), 0, 0, 4096), ErrorCode.BUFFER, "cannot open the CUDA IPC handle on device 0"),
        (RegisterCudaIpc(handle, 2, 0, 4096), ErrorCode.OUT_OF_RANGE, "sees 2 CUDA device"),
    ]
    for spec, code, pattern in cases:
        with pytest.raises(ProtocolError, match=pattern) as err:
            session.buffers.register_cuda(spec, cuda)
        assert err.value.code is code
    assert cuda.open_handles == 0 and not fake.opened and fake.closes == fake.opens
    assert table.budget.used == 0 and len(session.buffers) == 0
    # The whole allocation still registers.
    session.buffers.register_cuda(RegisterCudaIpc(handle, 0, 0, 1 << 16), cuda)


def test_an_unavailable_probe_refuses_after_the_limits_with_its_reason(rig):
    _, _, _, table, session, _ = rig()
    none = cuda_ipc.unavailable("cupy is not importable: No module named 'cupy'")
    with pytest.raises(ProtocolError, match=r"no CUDA device \(cupy is not importable: No module named 'cupy'\)") as err:
        session.buffers.register_cuda(RegisterCudaIpc(b"\0" * 64, 0, 0, 4096), none)
    assert err.value.code is ErrorCode.CUDA_UNAVAILABLE
    with pytest.raises(ProtocolError, match="per session") as err:
        session.buffers.register_cuda(RegisterCudaIpc(b"\0" * 64, 0, 0, 1 << 40), none)
    assert err.value.code is ErrorCode.BUFFER
    assert table.budget.used == 0


def test_the_probe_on_this_host_names_its_reason():
    cuda = cuda_ipc._probe()
    assert isinstance(cuda.reason, str) and cuda.reason
    if not cuda.available:
        assert cuda.devices == 0 and cuda.open_handles == 0


def test_copies_coalesce_runs_of_adjacent_blocks():
    assert cuda_ipc._runs(np.array([0, 10, 20, 50, 60, 0], np.int64), 10) == [(0, 0, 30), (50, 30, 20), (0, 50, 10)]
    assert cuda_ipc._runs(np.array([], np.int64), 10) == []


class FakeCupyRuntime:
    """The calls CupyRuntime makes of ``cupy.cuda.runtime``, by name and signature,
    over host memory: checks the glue (streams per thread, pinned staging, sizes), not CUDA."""

    memcpyHostToDevice, memcpyDeviceToHost = 1, 2
    cudaIpcMemLazyEnablePeerAccess = streamNonBlocking = hostAllocPortable = 1

    def __init__(self, alloc: np.ndarray) -> None:
        self.alloc = alloc
        self.calls: list[tuple] = []
        self._pinned: dict[int, ctypes.Array] = {}
        self.current = 0

    def getDeviceCount(self) -> int:
        return 1

    def setDevice(self, device: int) -> None:
        self.current = device

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        self.calls.append(("open", len(handle), flags))
        return self.alloc.ctypes.data

    def ipcCloseMemHandle(self, ptr: int) -> None:
        self.calls.append(("close", ptr))

    def streamCreateWithFlags(self, flags: int) -> int:
        self.calls.append(("stream", threading.get_ident()))
        return 1000 + len(self.calls)

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self.calls.append(("memcpy", kind, size, stream))
        ctypes.memmove(dst, src, size)

    def streamSynchronize(self, stream: int) -> None:
        self.calls.append(("sync", stream))

    def hostAlloc(self, size: int, flags: int) -> int:
        buf = (ctypes.c_uint8 * size)()
        self._pinned[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def freeHost(self, ptr: int) -> None:
        del self._pinned[ptr]


class FakeLibcuda:
    def __init__(self, alloc: np.ndarray) -> None:
        def get_range(base, size, ptr):
            base._obj.value, size._obj.value = alloc.ctypes.data, alloc.nbytes
            return 0 if alloc.ctypes.data <= ptr.value < alloc.ctypes.data + alloc.nbytes else 1

        self.cuMemGetAddressRange_v2 = get_range


def test_the_cupy_glue_copies_through_pinned_staging_on_a_stream_per_thread():
    alloc = np.zeros(1 << 16, dtype=np.uint8)
    fake = FakeCupyRuntime(alloc)
    cuda = CudaIpc(cuda_ipc.CupyRuntime(fake, FakeLibcuda(alloc)), "a fake cupy")
    assert cuda.devices == 1
    mb = cuda.open(RegisterCudaIpc(b"\1" * 64, 0, 1024, 8192))
    assert fake.calls[0] == ("open", 64, 1)
    host = np.random.default_rng(4).integers(0, 256, 4 * 512, dtype=np.uint8)
    # Blocks 0, 1 land side by side (one copy), block 2 elsewhere, block 3 first.
    mb.write_blocks(host, np.arange(4, dtype=np.int64) * 512, np.array([512, 1024, 4096, 0], np.int64), 512)
    copies = [c for c in fake.calls if c[0] == "memcpy"]
    assert [(kind, size) for _, kind, size, _ in copies] == [(1, 1024), (1, 512), (1, 512)]
    assert fake.calls[-1][0] == "sync"
    view = alloc[1024:]
    np.testing.assert_array_equal(view[512:1536], host[:1024])
    np.testing.assert_array_equal(view[4096:4608], host[1024:1536])
    np.testing.assert_array_equal(view[:512], host[1536:])
    out = np.zeros(1024, dtype=np.uint8)
    mb.read_blocks(np.array([4096, 0], np.int64), out, np.array([0, 512], np.int64), 512)
    np.testing.assert_array_equal(out, np.concatenate([host[1024:1536], host[1536:]]))
    # Another thread gets a stream of its own.
    t = threading.Thread(target=mb.write_blocks, args=(host, np.zeros(1, np.int64), np.zeros(1, np.int64), 512))
    t.start()
    t.join()
    assert len({c[1] for c in fake.calls if c[0] == "stream"}) == 2
    # A range past the allocation is refused by the driver's size of it.
    with pytest.raises(ProtocolError, match="allocation is 65536 bytes"):
        cuda.open(RegisterCudaIpc(b"\1" * 64, 0, 1 << 15, (1 << 15) + 1))
    mb.close()
    assert fake.calls[-1] == ("close", alloc.ctypes.data) and cuda.open_handles == 0
    with pytest.raises(ValueError, match="is closed"):
        mb.write_blocks(host, np.zeros(1, np.int64), np.zeros(1, np.int64), 512)
