"""Client buffers the daemon maps once and moves bytes through.

A CPU client creates a file in /dev/shm, registers it by name, and may unlink it
once registered: the daemon keeps its own mapping. The message also carries the
fields of a CUDA IPC registration (kind, handle, device); this daemon does not
serve GPU buffers yet and refuses them with an UNSUPPORTED reply.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstored.protocol import BufferKind, ErrorCode, ProtocolError, Register

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAX_BUFFERS = 4096


@dataclass
class MappedBuffer:
    buf_id: int
    kind: BufferKind
    size: int
    array: np.ndarray
    owner: Any


class BufferRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._buffers: dict[int, MappedBuffer] = {}

    def register(self, req: Register) -> MappedBuffer:
        if len(self._buffers) >= MAX_BUFFERS:
            raise ProtocolError(ErrorCode.BUFFER, f"{MAX_BUFFERS} buffers already registered; unregister some")
        if req.kind is BufferKind.SHM:
            array, owner = self._map_shm(req.name, req.size)
        else:
            array, owner = self._open_cuda_ipc(req)
        with self._lock:
            buf_id = self._next
            self._next += 1
            mb = MappedBuffer(buf_id, req.kind, req.size, array, owner)
            self._buffers[buf_id] = mb
        log.info("registered %s buffer %d (%d bytes)", req.kind.value, buf_id, req.size)
        return mb

    def lookup(self, buf_id: int) -> MappedBuffer:
        mb = self._buffers.get(buf_id)
        if mb is None:
            raise ProtocolError(ErrorCode.BUFFER, f"buffer {buf_id} is not registered")
        return mb

    def unregister(self, buf_id: int) -> MappedBuffer:
        with self._lock:
            mb = self._buffers.pop(buf_id, None)
        if mb is None:
            raise ProtocolError(ErrorCode.BUFFER, f"buffer {buf_id} is not registered")
        return mb

    @staticmethod
    def close_mapping(mb: MappedBuffer) -> None:
        if isinstance(mb.owner, mmap.mmap):
            mb.array = np.zeros(0, dtype=np.uint8)
            try:
                mb.owner.close()
            except BufferError:
                log.debug("buffer %d still referenced; unmapped at exit", mb.buf_id)

    def close(self) -> None:
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
        for mb in buffers:
            self.close_mapping(mb)

    @staticmethod
    def _map_shm(name: str, size: int) -> tuple[np.ndarray, mmap.mmap]:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ProtocolError(ErrorCode.BUFFER, f"cannot open shared memory {name!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise ProtocolError(ErrorCode.BUFFER, f"shared memory {name!r} is {st.st_size} bytes, registered as {size}")
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return np.frombuffer(m, dtype=np.uint8), m

    @staticmethod
    def _open_cuda_ipc(req: Register) -> tuple[Any, Any]:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED,
            "CUDA IPC buffers are not served by this kvstored; register a shared-memory buffer",
        )
