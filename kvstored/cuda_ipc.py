"""CUDA IPC buffers: a GPU client's device memory, written and read by the daemon.

A GPU client registers a range of one of its CUDA allocations on the session socket:
the allocation's ``cudaIpcMemHandle_t`` (64 bytes), the device ordinal, and the
``offset`` and ``size`` of the range (a handle names a whole allocation; a tensor may
start inside it). The daemon opens the handle once (``cudaIpcOpenMemHandle``), checks
that the range lies inside the allocation (``cuMemGetAddressRange``), and from then on
copies a get's blocks host-to-device into ``base + offset + dst`` and a put's blocks
device-to-host, through pinned staging memory on a stream of its own, synchronized
before the reply leaves: when the client reads the reply, the bytes are in its memory.
The handle is closed at unregister, or when the client's session ends (after any copy
still using it, see ReclaimGate).

One allocation opened twice in this process (two tensors of one caching-allocator
segment, or two sessions of one client) is opened once and counted: CUDA maps an
allocation once per context.

Whether CUDA IPC is usable is probed once, at start-up (:func:`probe`): cupy must
import, the CUDA driver must load, and the runtime must answer with at least one
device. The daemon logs the outcome and its reason, and hello's ``cuda_ipc`` says it.
Where the probe failed, a ``cuda_ipc`` register is refused with ``cuda_unavailable``
and a message that says "no CUDA device" and why.

A CUDA IPC handle is a capability: the daemon cannot tell which process allocated
the memory it names, only that the client sent the handle. Device ordinals are the
daemon's (the client and the daemon must see the same devices, e.g. the same
``CUDA_VISIBLE_DEVICES``).

This path is tested against fake device runtimes on every CPU host
(tests/kvstored/test_cuda_ipc_path.py); on a GPU it has run once, on one H200, where a
CUDA client's puts and gets through its device memory (from the DRAM tier and from the
SSD) came back exact (tests/kvstored/test_cuda_ipc.py, marked ``gpu``). It has not been
measured or loaded there.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Protocol

import numpy as np

from kvdrive.protocol import CUDA_IPC_HANDLE_BYTES
from kvstored.buffers import MappedBuffer
from kvstored.checksum import block_crcs
from kvstored.copy import gather_scatter
from kvstored.protocol import ErrorCode, ProtocolError, RegisterCudaIpc

log = logging.getLogger(__name__)

# Bytes moved through a thread's pinned staging buffer per synchronized batch (a larger
# block gets a staging buffer of its own size).
STAGING_BYTES = 16 << 20


class DeviceRuntime(Protocol):
    """What the daemon needs of CUDA: cupy's in :class:`CupyRuntime`; tests give a fake.

    Copies are queued on the calling thread's stream of ``device`` and finished by
    :meth:`synchronize`; :meth:`staging` is the calling thread's pinned buffer.
    """

    def device_count(self) -> int: ...

    def open_handle(self, device: int, handle: bytes) -> int: ...

    def close_handle(self, device: int, ptr: int) -> None: ...

    def allocation_bytes(self, device: int, ptr: int) -> int: ...

    def to_device(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int) -> None: ...

    def to_host(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int) -> None: ...

    def synchronize(self, device: int) -> None: ...

    def staging(self, device: int, nbytes: int) -> np.ndarray: ...


class CudaIpc:
    """The daemon's CUDA IPC side: ``runtime`` where the probe found CUDA usable, else
    None and ``reason`` says why."""

    def __init__(self, runtime: DeviceRuntime | None, reason: str) -> None:
        self.runtime = runtime
        self.reason = reason
        self.devices = runtime.device_count() if runtime is not None else 0
        self._lock = threading.Lock()
        self._opened: dict[tuple[int, bytes], list[int]] = {}  # (device, handle) -> [base pointer, opens]

    @property
    def available(self) -> bool:
        return self.runtime is not None

    def open(self, spec: RegisterCudaIpc) -> "CudaIpcBuffer":
        """Open ``spec``'s handle (or count another use of it) and check its range."""
        rt = self.runtime
        if rt is None:
            raise ProtocolError(
                ErrorCode.CUDA_UNAVAILABLE,
                f"this kvstored cannot open CUDA IPC buffers: no CUDA device ({self.reason}); register a memfd instead",
            )
        if spec.device >= self.devices:
            raise ProtocolError(
                ErrorCode.OUT_OF_RANGE,
                f"field 'device' = {spec.device}: this kvstored sees {self.devices} CUDA device(s), 0..{self.devices - 1}",
            )
        key = (spec.device, spec.handle)
        with self._lock:
            held = self._opened.get(key)
            if held is None:
                try:
                    base = rt.open_handle(spec.device, spec.handle)
                except Exception as exc:  # cupy's CUDARuntimeError; any failure is the handle's
                    raise ProtocolError(
                        ErrorCode.BUFFER, f"cannot open the CUDA IPC handle on device {spec.device}: {exc}"[:500],
                    ) from None
                held = self._opened[key] = [base, 0]
            held[1] += 1
        base = held[0]
        try:
            try:
                alloc = rt.allocation_bytes(spec.device, base)
            except Exception as exc:
                raise ProtocolError(ErrorCode.BUFFER, f"cannot size the CUDA allocation: {exc}"[:500]) from None
            if spec.offset + spec.size > alloc:
                raise ProtocolError(
                    ErrorCode.BUFFER,
                    f"the CUDA allocation is {alloc} bytes; offset {spec.offset} + size {spec.size} = "
                    f"{spec.offset + spec.size} lies past its end",
                )
        except BaseException:
            self._release(key)
            raise
        log.debug("opened a CUDA IPC buffer on device %d (%d bytes at offset %d)", spec.device, spec.size, spec.offset)
        return CudaIpcBuffer(0, spec.size, self, spec.device, spec.handle, base, spec.offset)

    def _release(self, key: tuple[int, bytes]) -> None:
        with self._lock:
            held = self._opened.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1]:
                return
            del self._opened[key]
        try:
            self.runtime.close_handle(key[0], held[0])  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - a client's dead context must not stop the daemon
            log.warning("closing a CUDA IPC handle on device %d failed", key[0], exc_info=True)

    @property
    def open_handles(self) -> int:
        with self._lock:
            return len(self._opened)


class CudaIpcBuffer(MappedBuffer):
    """``size`` bytes of device memory at ``base + offset``; offsets are from there."""

    kind = "cuda_ipc"

    def __init__(self, buf_id: int, size: int, cuda: CudaIpc, device: int, handle: bytes, base: int,
                 offset: int) -> None:
        self.buf_id = buf_id
        self.size = size
        self.array = np.zeros(0, dtype=np.uint8)  # no host view of device memory
        self.owner = None
        self.device = device
        self.ptr = base + offset
        self._cuda = cuda
        self._rt: DeviceRuntime = cuda.runtime  # type: ignore[assignment]
        self._key: tuple[int, bytes] | None = (device, handle)

    def _check(self, host_len: int, host_offs: np.ndarray, dev_offs: np.ndarray, nbytes: int) -> None:
        if self._key is None:
            raise ValueError(f"CUDA IPC buffer {self.buf_id} is closed")
        if nbytes <= 0 or len(host_offs) != len(dev_offs):
            raise ValueError("block copies need a positive size and one destination per block")
        if len(host_offs) and (host_offs.min() < 0 or host_offs.max() > host_len - nbytes
                               or dev_offs.min() < 0 or dev_offs.max() > self.size - nbytes):
            raise ValueError(f"a {nbytes} B block lies outside the host array ({host_len} B) "
                             f"or the CUDA IPC buffer ({self.size} B)")

    def write_blocks(self, src: np.ndarray, src_offs: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
        src_offs, dst_offs = _offsets(src_offs), _offsets(dst_offs)
        self._check(len(src), src_offs, dst_offs, nbytes)
        rt, dev = self._rt, self.device
        per = max(1, STAGING_BYTES // nbytes)
        for start in range(0, len(src_offs), per):
            dst = dst_offs[start:start + per]
            k = len(dst)
            stage = rt.staging(dev, k * nbytes)
            gather_scatter(src, src_offs[start:start + per], stage, np.arange(k, dtype=np.int64) * nbytes, nbytes)
            base = stage.ctypes.data
            for at, first, length in _runs(dst, nbytes):
                rt.to_device(dev, self.ptr + at, base + first, length)
            rt.synchronize(dev)  # the staging buffer is reused next; the reply says the bytes are there

    def write_verified(self, src: np.ndarray, src_offs: np.ndarray, dst_offs: np.ndarray, nbytes: int,
                       tags: np.ndarray, expect: np.ndarray) -> np.ndarray:
        src_offs, dst_offs = _offsets(src_offs), _offsets(dst_offs)
        self._check(len(src), src_offs, dst_offs, nbytes)
        ok = (block_crcs(src, src_offs, nbytes) ^ np.asarray(tags, np.uint32)) == np.asarray(expect, np.uint32)
        if ok.any():
            self.write_blocks(src, src_offs[ok], dst_offs[ok], nbytes)
        return ok

    def read_blocks(self, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
        src_offs, dst_offs = _offsets(src_offs), _offsets(dst_offs)
        self._check(len(dst), dst_offs, src_offs, nbytes)
        rt, dev = self._rt, self.device
        per = max(1, STAGING_BYTES // nbytes)
        for start in range(0, len(src_offs), per):
            src = src_offs[start:start + per]
            k = len(src)
            stage = rt.staging(dev, k * nbytes)
            base = stage.ctypes.data
            for at, first, length in _runs(src, nbytes):
                rt.to_host(dev, base + first, self.ptr + at, length)
            rt.synchronize(dev)
            gather_scatter(stage, np.arange(k, dtype=np.int64) * nbytes, dst, dst_offs[start:start + per], nbytes)

    def close(self) -> None:
        key, self._key = self._key, None
        if key is not None:
            self._cuda._release(key)


def _offsets(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _runs(offs: np.ndarray, nbytes: int) -> list[tuple[int, int, int]]:
    """Blocks i..j-1 whose device offsets follow each other, as (device offset, staging
    offset, bytes): one copy each instead of one per block."""
    if not len(offs):
        return []
    starts = np.flatnonzero(np.concatenate(([True], np.diff(offs) != nbytes)))
    ends = np.append(starts[1:], len(offs))
    return [(int(offs[s]), int(s) * nbytes, int(e - s) * nbytes) for s, e in zip(starts.tolist(), ends.tolist())]


class CupyRuntime:
    """CUDA through cupy's runtime bindings, and the driver's ``cuMemGetAddressRange``."""

    def __init__(self, runtime, libcuda: ctypes.CDLL) -> None:
        self._rt = runtime
        self._range = libcuda.cuMemGetAddressRange_v2
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self._range.restype = ctypes.c_int
        self._count = int(runtime.getDeviceCount())
        self._local = threading.local()

    def device_count(self) -> int:
        return self._count

    def open_handle(self, device: int, handle: bytes) -> int:
        self._rt.setDevice(device)
        return int(self._rt.ipcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess))

    def close_handle(self, device: int, ptr: int) -> None:
        self._rt.setDevice(device)
        self._rt.ipcCloseMemHandle(ptr)

    def allocation_bytes(self, device: int, ptr: int) -> int:
        self._rt.setDevice(device)  # makes the device's primary context current for the driver call
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc:
            raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {rc}")
        return base.value + size.value - ptr

    def _stream(self, device: int) -> int:
        streams = self._local.__dict__.setdefault("streams", {})
        s = streams.get(device)
        if s is None:
            s = streams[device] = self._rt.streamCreateWithFlags(self._rt.streamNonBlocking)
        return s

    def to_device(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._rt.setDevice(device)
        self._rt.memcpyAsync(dst_ptr, src_ptr, nbytes, self._rt.memcpyHostToDevice, self._stream(device))

    def to_host(self, device: int, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._rt.setDevice(device)
        self._rt.memcpyAsync(dst_ptr, src_ptr, nbytes, self._rt.memcpyDeviceToHost, self._stream(device))

    def synchronize(self, device: int) -> None:
        self._rt.streamSynchronize(self._stream(device))

    def staging(self, device: int, nbytes: int) -> np.ndarray:
        """This thread's pinned buffer, at least ``nbytes`` (kept for the thread's life)."""
        held = getattr(self._local, "pinned", None)
        if held is None or len(held[1]) < nbytes:
            if held is not None:
                self._rt.freeHost(held[0])
            size = max(nbytes, STAGING_BYTES)
            ptr = self._rt.hostAlloc(size, self._rt.hostAllocPortable)
            array = np.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=np.uint8)
            held = self._local.pinned = (ptr, array)
        return held[1][:nbytes]


def unavailable(reason: str) -> CudaIpc:
    return CudaIpc(None, reason)


def probe() -> CudaIpc:
    """Whether this daemon can open CUDA IPC handles: cupy importable, the CUDA driver
    loadable, and the runtime answering with at least one device. Logs which and why."""
    cuda = _probe()
    if cuda.available:
        log.info("CUDA IPC buffers: served (%s)", cuda.reason)
    else:
        log.info("CUDA IPC buffers: not served, no CUDA device (%s)", cuda.reason)
    return cuda


def _probe() -> CudaIpc:
    try:
        from cupy.cuda import runtime  # noqa: PLC0415 - optional dependency (the 'gpu' extra)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
        return unavailable(f"cupy is not importable: {exc}; install the 'gpu' extra")
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return unavailable("no CUDA driver: libcuda.so.1 not found")
    try:
        rt = CupyRuntime(runtime, libcuda)
    except AttributeError as exc:
        return unavailable(f"the CUDA driver lacks cuMemGetAddressRange_v2 ({exc})")
    except Exception as exc:  # noqa: BLE001 - cupy's CUDARuntimeError: no driver, too old, no device
        return unavailable(f"the CUDA runtime does not answer: {exc}")
    if rt.device_count() < 1:
        return unavailable("the CUDA runtime reports no device")
    try:
        version = runtime.driverGetVersion()
    except Exception as exc:  # noqa: BLE001
        return unavailable(f"the CUDA runtime does not answer: {exc}")
    return CudaIpc(rt, f"{rt.device_count()} CUDA device(s), driver version {version}")


__all__ = ["CUDA_IPC_HANDLE_BYTES", "CudaIpc", "CudaIpcBuffer", "CupyRuntime", "DeviceRuntime", "probe", "unavailable"]
