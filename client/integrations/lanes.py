"""Connections and staging regions, by kind of call, so that one kind never waits for another.

A :class:`Lane` is what one kind of call of a
:class:`~kvdrive_client.integrations.blocks.BlockStore` moves bytes through (loads have
one, stores another): up to ``width`` :class:`Channel` s, each a connection to kvstored
(a session of its own) and a staging region registered on it. A call takes a channel
for its whole length and gives it back; calls of one lane beyond ``width`` wait for a
channel of that lane only. So a load never waits for a store's copy, its durable write
or its connection's replies, and two loads run side by side.

Life cycle: a channel connects, and registers its region, on its first use (a lane
nobody calls costs nothing); after kvstored restarts, its client opens a new session
and registers the region again on the next call (:class:`~kvdrive_client.store.StoreClient`).
:meth:`Lane.close` waits for the channels in use, then frees them all.

The threading contract: a channel is used by one thread at a time (the one that took
it); the lane's free list is a thread-safe queue.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from kvdrive_client.errors import BusyError, KVDriveError
from kvdrive_client.integrations.pool import SharedFile
from kvdrive_client.shm import PoolBuffer, SharedBuffer
from kvdrive_client.store import StoreClient

log = logging.getLogger(__name__)


class Channel:
    """One connection and one staging region of ``region_bytes``, both made on first use;
    and, where the engine's memory is a shared file (:mod:`.pool`), that file registered
    on the same session on its first use.

    ``shared``: a client given by the caller, used (not closed) instead of a connection of
    the channel's own; the region is still the channel's."""

    def __init__(self, region_bytes: int, connect: Callable[[], StoreClient], shared: StoreClient | None) -> None:
        self.region_bytes = region_bytes
        self._connect = connect
        self._shared = shared
        self._client: StoreClient | None = shared
        self._region: SharedBuffer | None = None
        self._pool: PoolBuffer | None = None

    def pool(self, shared: SharedFile) -> PoolBuffer:
        """``shared`` registered on this channel's session (once; again where a restarted
        daemon refused it when the session opened anew)."""
        if self._pool is None or self._pool.buf_id is None:
            self._pool = shared.registered(self.client)
        return self._pool

    def drop_pool(self) -> None:
        """Unregister the engine's file from this channel's session, where it is registered
        (kvstored refused it on another channel, or it broke: rows move through staging)."""
        pool, self._pool = self._pool, None
        if pool is None or self._client is None:
            return
        try:
            self._client.unregister(pool)
        except (KVDriveError, zmq.ZMQError) as exc:  # the daemon dropped it with the session, or the store closed
            log.debug("the engine's file was not unregistered (%s)", exc)

    @property
    def client(self) -> StoreClient:
        if self._client is None:
            self._client = self._connect()
        return self._client

    @property
    def region(self) -> SharedBuffer:
        """The staging region, registered on first use (and again where a restarted daemon
        refused it when the session opened anew)."""
        if self._region is None or self._region.buf_id is None:
            if self._region is not None:
                self._region.close()
            self._region = self.client.register(self.region_bytes)
        return self._region

    @property
    def opened(self) -> bool:
        """Whether the region is registered (so the next call pays no connect or register)."""
        return self._region is not None

    def discard(self) -> None:
        """Give up this channel's connection and region after a request whose fate is unknown
        (a timeout, a daemon gone): the daemon may still read or write that region, so it is
        never used again; the next use makes new ones. The daemon drops the region with the
        session (or at the unregister) only once no put or get of it still runs."""
        log.info("a %d-byte staging region is given up: a request that uses it may still be running",
                 self.region_bytes)
        self.close()

    def close(self) -> None:
        if self._client is None:
            return
        if self._shared is None:
            self._client.close()  # frees the region with the session
        else:
            for buf in (self._region, self._pool):
                if buf is None:
                    continue
                try:
                    self._client.unregister(buf)
                except KVDriveError as exc:  # the daemon is gone: it freed the buffer with the session
                    log.info("buffer not unregistered (%s); the daemon dropped it with the session", exc)
        self._client = self._shared
        self._region = self._pool = None


class Lane:
    """Up to ``width`` channels of ``region_bytes`` each, for one kind of call (see the module)."""

    def __init__(self, name: str, width: int, region_bytes: int, connect: Callable[[], StoreClient],
                 shared: StoreClient | None = None) -> None:
        if width < 1:
            raise ValueError(f"the {name} lane needs at least one channel, got {width}")
        self.name, self.width = name, width
        self._channels = [Channel(region_bytes, connect, shared) for _ in range(width)]
        self._free: queue.LifoQueue[Channel] = queue.LifoQueue()  # the warmest channel first
        for ch in reversed(self._channels):
            self._free.put(ch)
        self._no_pool = False  # drop_pools() was called: no channel keeps the engine's file

    def drop_pools(self) -> None:
        """Unregister the engine's file from every channel: the free ones now, those in calls
        as the calls give them back."""
        self._no_pool = True
        taken = []
        while True:
            try:
                taken.append(self._free.get_nowait())
            except queue.Empty:
                break
        for ch in taken:
            self._release(ch)

    def _release(self, ch: Channel) -> None:
        if self._no_pool:
            ch.drop_pool()
        self._free.put(ch)

    @contextmanager
    def channel(self, timeout: float) -> Iterator[Channel]:
        """A free channel of this lane, for the ``with`` block; BusyError if none is free
        within ``timeout`` seconds (every one held by a call of this lane)."""
        try:
            ch = self._free.get(timeout=timeout)
        except queue.Empty:
            raise BusyError(f"every one of the {self.width} {self.name} channels stayed in use for {timeout:.1f} s") \
                from None
        try:
            yield ch
        finally:
            self._release(ch)

    def open(self, timeout: float, shared: SharedFile | None = None) -> int:
        """Connect and register the region of every channel not yet open, and ``shared`` where
        given (the engine's file, :mod:`.pool`); how many it opened.
        It holds each channel it takes until all are open (a call meanwhile waits as it would
        for a busy lane; it would have paid the same opening its own). KVDriveError or
        OSError if the daemon cannot be reached: the channels not yet open stay so."""
        held: list[Channel] = []
        opened = 0
        try:
            for _ in range(self.width):
                try:
                    held.append(self._free.get(timeout=timeout))
                except queue.Empty:
                    break  # the rest are in calls, which open them
                if not held[-1].opened:
                    held[-1].region  # noqa: B018 - connects, then registers
                    opened += 1
                if shared is not None and not self._no_pool:
                    held[-1].pool(shared)
            return opened
        finally:
            for ch in held:
                self._release(ch)

    def busy(self) -> int:
        """How many channels calls hold now."""
        return self.width - self._free.qsize()

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the channels in use, then free every channel."""
        deadline = time.monotonic() + timeout
        held = []
        for _ in range(self.width):
            try:
                held.append(self._free.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                log.warning("%d %s channel(s) still in use after %.1f s; closing them anyway",
                            self.width - len(held), self.name, timeout)
                break
        for ch in self._channels:
            ch.close()
        for ch in held:
            self._free.put(ch)
