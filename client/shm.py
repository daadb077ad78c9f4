"""Buffers a client registers with kvstored: shared memory (a sealed memfd) on a CPU
host, an engine's own unsealed shared memory (a pool: a memfd or a file in /dev/shm,
which the daemon maps under a guard against the file shrinking), or a range of a CUDA
allocation named by its IPC handle on a GPU host.

Either kind is named by its ``buf_id`` in puts and gets; ``register_message`` is what
the session socket carries to register it (see docs/protocol.md).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Any

import numpy as np

from kvdrive.protocol import (
    BUFFER_KIND_CUDA_IPC, BUFFER_KIND_MEMFD, BUFFER_KIND_POOL, CUDA_IPC_HANDLE_BYTES, MAX_BUFFER_BYTES,
)
from kvdrive_client.errors import CudaUnavailableError

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _FileBuffer:
    """What a registered file buffer of this process is (a memfd of its own, or an engine's
    pool): ``size`` bytes of file ``fd`` (this object's descriptor, kept open to register
    the buffer again with a restarted daemon), seen here as ``array``."""

    kind = ""
    fd: int
    size: int
    array: np.ndarray
    _map: mmap.mmap | None
    buf_id: int | None

    def register_message(self) -> tuple[dict, list[int]]:
        """The session socket's register message, and the descriptor it carries."""
        return {"op": "register", "kind": self.kind, "size": self.size}, [self.fd]

    def view(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        end = self.size if nbytes is None else offset + nbytes
        if offset < 0 or end > self.size:
            raise ValueError(f"view [{offset}, {end}) outside {self.kind} buffer of {self.size} bytes")
        return self.array[offset:end]

    def close(self) -> None:
        self.array = np.zeros(0, dtype=np.uint8)
        self.buf_id = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with it
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fd={self.fd}, size={self.size}, buf_id={self.buf_id})"


class SharedBuffer(_FileBuffer):
    """A pre-faulted memfd mapped here and, once registered, in the daemon.

    The memfd has no name in any file system, so nothing is left behind if either
    process dies, and no other user can open it. It is sealed at its size before
    the daemon sees it: it can never shrink under the daemon's mapping. The
    descriptor stays open so the buffer can be registered again with a restarted
    daemon.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        self.size = size
        self.fd = os.memfd_create("kvdrive-buffer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self.fd, size, flags=flags)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[::4096] = 0  # fault every page in now, not on the first get
        self.buf_id: int | None = None

    kind = BUFFER_KIND_MEMFD


class PoolBuffer(_FileBuffer):
    """``size`` bytes of shared memory the caller already has (a serving engine's CPU KV
    pool): a memfd or a file in /dev/shm, unsealed, open for reading and writing.

    The daemon maps it too, so gets land in the caller's memory and puts leave from it
    with one copy, the daemon's. Made by
    :meth:`from_fd`, which keeps a duplicate of the descriptor (for registering again
    with a restarted daemon; the caller's own stays the caller's). ``array`` is the
    caller's mapping where one is given, else this object maps the file itself. A file
    shrunk below ``size`` while the daemon uses it makes that request and every later one
    on the registration fail (register it again).
    """

    kind = BUFFER_KIND_POOL

    def __init__(self, fd: int, size: int, array: np.ndarray | None = None) -> None:
        if not 0 < size <= MAX_BUFFER_BYTES:
            raise ValueError(f"pool size must be in 1..2^44, got {size}")
        self.fd, self.size = fd, int(size)
        self._map: mmap.mmap | None = None
        if array is None:
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            array = np.frombuffer(self._map, dtype=np.uint8)
        else:
            array = np.asarray(array)
            if not array.flags.c_contiguous or array.nbytes < size:
                raise ValueError(f"the pool's array must be a contiguous view of at least {size} bytes")
            array = array.reshape(-1).view(np.uint8)[:size]
        self.array = array
        self.buf_id: int | None = None

    @classmethod
    def from_fd(cls, fd: int, size: int, array: np.ndarray | None = None) -> "PoolBuffer":
        """A pool of the first ``size`` bytes of the file open as ``fd`` (duplicated here)."""
        dup = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
        try:
            return cls(dup, size, array)
        except BaseException:
            os.close(dup)
            raise


class CudaIpcBuffer:
    """``size`` bytes at ``offset`` in the CUDA allocation that ``handle`` names (the 64
    bytes of a ``cudaIpcMemHandle_t``), on device ``device``, for kvstored to write gets
    into and read puts from.

    ``owner`` (the tensor, say) is held until :meth:`close`, so the memory outlives the
    registration. :meth:`from_tensor` makes one from a CUDA torch tensor. The daemon
    opens the handle with its own device numbering: both must see the same devices.
    On a GPU this path has run once, exact, untimed (see docs/protocol.md).
    """

    kind = BUFFER_KIND_CUDA_IPC

    def __init__(self, handle: bytes, device: int, offset: int, size: int, owner: Any = None) -> None:
        if not isinstance(handle, bytes) or len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {CUDA_IPC_HANDLE_BYTES} bytes")
        if device < 0 or offset < 0 or not 0 < size <= MAX_BUFFER_BYTES or offset + size > MAX_BUFFER_BYTES:
            raise ValueError(f"device {device}, offset {offset}, size {size}: out of range")
        self.handle, self.device, self.offset, self.size = handle, int(device), int(offset), int(size)
        self.owner = owner
        self.buf_id: int | None = None

    @classmethod
    def from_tensor(cls, tensor) -> "CudaIpcBuffer":
        """The bytes of a contiguous CUDA torch tensor: the IPC handle of the allocation
        holding it (taken at the allocation's base) and the tensor's offset inside it."""
        if not getattr(tensor, "is_cuda", False):
            raise ValueError("register_cuda needs a CUDA tensor; a CPU client registers a shared buffer")
        if not tensor.is_contiguous():
            raise ValueError("register_cuda needs a contiguous tensor (its bytes are one range)")
        size = tensor.numel() * tensor.element_size()
        if size <= 0:
            raise ValueError("register_cuda needs a non-empty tensor")
        device = tensor.device.index if tensor.device.index is not None else 0
        handle, offset = cuda_ipc_handle(tensor.data_ptr(), device)
        return cls(handle, device, offset, size, owner=tensor)

    def register_message(self) -> tuple[dict, list[int]]:
        return {"op": "register", "kind": BUFFER_KIND_CUDA_IPC, "handle": self.handle, "device": self.device,
                "offset": self.offset, "size": self.size}, []

    def close(self) -> None:
        self.buf_id = None
        self.owner = None

    def __repr__(self) -> str:
        return f"CudaIpcBuffer(device={self.device}, offset={self.offset}, size={self.size}, buf_id={self.buf_id})"


def cuda_ipc_handle(ptr: int, device: int) -> tuple[bytes, int]:
    """The IPC handle of the CUDA allocation holding device pointer ``ptr``, and ``ptr``'s
    offset from that allocation's base (cupy's runtime, the driver's cuMemGetAddressRange).

    Memory of torch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``)
    has no such handle: CUDA refuses it, and this raises.
    """
    try:
        from cupy.cuda import runtime  # noqa: PLC0415 - optional dependency (the 'gpu' extra)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
        raise CudaUnavailableError(f"CUDA IPC buffers need cupy (the 'gpu' extra): {exc}") from None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise CudaUnavailableError("CUDA IPC buffers need the CUDA driver (libcuda.so.1 not found)") from None
    get_range = libcuda.cuMemGetAddressRange_v2
    get_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    get_range.restype = ctypes.c_int
    previous = runtime.getDevice()  # torch's current device too: given back as it was
    runtime.setDevice(device)  # the device's primary context, current for the driver call
    try:
        base, nbytes = ctypes.c_uint64(), ctypes.c_size_t()
        rc = get_range(ctypes.byref(base), ctypes.byref(nbytes), ctypes.c_uint64(ptr))
        if rc:
            raise ValueError(f"pointer {ptr:#x} is not in a CUDA allocation of device {device} (CUDA error {rc})")
        handle = bytes(runtime.ipcGetMemHandle(base.value))
    finally:
        runtime.setDevice(previous)
    return handle, ptr - base.value
