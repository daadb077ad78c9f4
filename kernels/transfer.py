"""How fetched pages reach the compute device from the store's staging buffers.

The daemon writes a fetch's blocks into a staging buffer (shared memory) the client
registered; the decode step then reads them on the compute device. On the CPU that
is the buffer itself (:class:`HostTransfer`). On a CUDA device (:class:`CudaTransfer`)
the buffer is page-locked once (``cudaHostRegister`` of the shared mapping), the copy
to the device runs ``non_blocking`` on a copy stream, the compute stream waits on the
copy's event instead of the host, and a staging buffer is handed back to the daemon
only after the copy out of it has finished. :class:`CudaTransfer` has run on one H200, in its ``gpu`` test (a copy from a registered
shared buffer, exact); not yet timed inside a decode there.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


class HostTransfer:
    """Pages already where the compute runs (the CPU): the staging buffer is read in place."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def register(self, array: np.ndarray) -> None:
        """A new staging buffer (its mapping as a numpy array)."""

    def unregister(self, array: np.ndarray) -> None:
        """A staging buffer about to be unmapped."""

    def before_reuse(self, slot: int) -> None:
        """Called before the daemon writes staging buffer ``slot`` again."""

    def to_device(self, host: torch.Tensor, slot: int) -> torch.Tensor:
        """``host`` (a view of staging buffer ``slot``) on the compute device."""
        return host.to(self.device)


class CudaTransfer(HostTransfer):
    """Pinned staging, copies on their own stream, events instead of host waits."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._stream = None  # made at the first copy: choosing the kernels needs no CUDA context
        self._events: dict = {}
        self._pinned: set[int] = set()

    @property
    def stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def register(self, array: np.ndarray) -> None:
        ptr = array.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, array.nbytes, 0)
        if int(err) != 0:  # the copy still works from pageable memory, only slower and blocking
            log.warning("cudaHostRegister of a %d-byte staging buffer failed (%s): its copies to %s are "
                        "pageable and wait for the host", array.nbytes, err, self.device)
            return
        self._pinned.add(ptr)

    def unregister(self, array: np.ndarray) -> None:
        ptr = array.ctypes.data
        if ptr in self._pinned:
            self.before_reuse_all()
            torch.cuda.cudart().cudaHostUnregister(ptr)
            self._pinned.discard(ptr)

    def before_reuse(self, slot: int) -> None:
        event = self._events.pop(slot, None)
        if event is not None:
            event.synchronize()  # normally long done: the copy was queued a micro-batch ago

    def before_reuse_all(self) -> None:
        for slot in list(self._events):
            self.before_reuse(slot)

    def to_device(self, host: torch.Tensor, slot: int) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)
        out.record_stream(compute)  # the allocator keeps it until the compute stream is done with it
        self._events[slot] = event
        return out
