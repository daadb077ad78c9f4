"""Byte movers and block checksums used on the daemon's data path."""

from __future__ import annotations

import queue
import threading

import numba
import numpy as np

from kvdrive.protocol import jit_cache
from kvdrive.protocol.copy import copy_bytes as _copy_bytes
from kvdrive.protocol.copy import gather_scatter_serial as _gather_scatter
from kvdrive.protocol.copy import in_bounds as _in_bounds

jit_cache.use("kvstored")  # before the definitions below: they cache where it says

# Copies at least this large are split over numba's thread pool, on hosts with at
# least PARALLEL_MIN_THREADS threads; others run on the calling thread. Waking the
# pool costs more than it saves for a few blocks (measured: ~2.5 ms per launch on a
# busy 2-core host, against ~4 us for a one-block copy), the SSD path already copies
# from several I/O threads at once, and on two cores the pool's spinning workers only
# compete with the daemon's other threads (measured: 128 MiB DRAM gets at 1.4 GB/s
# parallel against 1.9 GB/s serial).
PARALLEL_MIN_BYTES = 64 << 20
PARALLEL_MIN_THREADS = 4
# Copies at least this large (more than a core's share of a last-level cache) write
# with non-temporal stores: a block copy cannot use memcpy's own streaming path (glibc
# streams only copies of several MiB each), and skipping the read of every
# destination line before it is overwritten cut a 256 MiB DRAM get's time by ~20%.
# A load's 16 MiB gets, whose client copies each slot out while the next is filled,
# went from 0.52-0.55x a memcpy to 0.61-0.62x (medians of 5, two runs each) when they
# streamed too: the two copies share the memory bandwidth. Smaller gets (a decode
# step's fetch) stay in the cache for the reader that follows.
STREAM_MIN_BYTES = 8 << 20
# Copies at least this large made on the daemon's main thread (the DRAM gets it serves
# inline, while their clients wait), and too small for the thread pool above, share their
# blocks with one helper thread where it is idle: both take chunks of SPLIT_CHUNK_BYTES
# until none is left, so a helper that wakes late (its core busy) takes fewer, and the
# caller waits only for the chunk the helper is copying. A get of 128 blocks of 64 KiB
# (8 MiB) copied in 0.52 ms against 0.81 ms alone on a 2-core host; the helper's wake-up
# is tens of us. Copies on other threads (I/O threads, the writer) run beside other work:
# split too, a cache-hit load's p99 during stores rose from 1.17-1.42x its p99 alone to
# 1.32-1.51x, and the stores meanwhile slowed by 5-10% (2 runs each, alternated).
SPLIT_MIN_BYTES = 4 << 20
SPLIT_CHUNK_BYTES = 1 << 20


@numba.njit(nogil=True, cache=True, parallel=True)
def _gather_scatter_parallel(src, src_offs, dst, dst_offs, nbytes):  # pragma: no cover - compiled
    if not _in_bounds(len(src), src_offs, len(dst), dst_offs, nbytes):
        return False
    for i in numba.prange(len(src_offs)):
        _copy_bytes(dst, dst_offs[i], src, src_offs[i], nbytes)
    return True


def gather_scatter(src: np.ndarray, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
    """``dst[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` for every i, without the GIL:
    on this thread, on the thread pool for the largest, or, on the main thread, shared
    with the helper thread (SPLIT_MIN_BYTES).

    Callers check bounds; the kernel checks them again (it copies raw memory) and
    copies nothing if any block falls outside either array.
    """
    if not len(src_offs):
        return
    if src.dtype != np.uint8 or dst.dtype != np.uint8 or not (src.flags.c_contiguous and dst.flags.c_contiguous
                                                              and dst.flags.writeable):
        raise ValueError("gather_scatter needs contiguous uint8 arrays and a writable destination")
    total = len(src_offs) * nbytes
    src_offs, dst_offs = src_offs.astype(np.int64, copy=False), dst_offs.astype(np.int64, copy=False)
    if total >= PARALLEL_MIN_BYTES and numba.config.NUMBA_NUM_THREADS >= PARALLEL_MIN_THREADS:
        ok = _gather_scatter_parallel(src, src_offs, dst, dst_offs, nbytes)
    elif total >= SPLIT_MIN_BYTES and len(src_offs) > 1 and threading.current_thread() is threading.main_thread():
        ok = _split(src, src_offs, dst, dst_offs, nbytes, total >= STREAM_MIN_BYTES)
    else:
        ok = _gather_scatter(src, src_offs, dst, dst_offs, nbytes, total >= STREAM_MIN_BYTES)
    if not ok:
        raise ValueError(f"gather_scatter: a {nbytes} B block lies outside the source ({len(src)} B) "
                         f"or the destination ({len(dst)} B), or the offset lists differ in length")


class _Chunks:
    """One copy cut into chunks of blocks, taken one at a time by whichever thread asks next."""

    def __init__(self, src, src_offs, dst, dst_offs, nbytes: int, stream: bool) -> None:
        self.args = (src, src_offs, dst, dst_offs)
        self.nbytes, self.stream = nbytes, stream
        self.per = max(1, SPLIT_CHUNK_BYTES // max(nbytes, 1))
        self.count = -(-len(src_offs) // self.per)
        self.taken, self.left = 0, self.count
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        """Copy chunks until none is left to take; the last one finished sets ``done``."""
        src, src_offs, dst, dst_offs = self.args
        while True:
            with self.lock:
                c = self.taken
                if c >= self.count:
                    return
                self.taken += 1
            at = slice(c * self.per, (c + 1) * self.per)
            try:
                _gather_scatter(src, src_offs[at], dst, dst_offs[at], self.nbytes, self.stream)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                self.error = exc
            with self.lock:
                self.left -= 1
                if not self.left:
                    self.done.set()


class _Helper:
    """The process's one copy helper: a thread started on first use, taking one copy's
    chunks at a time beside its caller; a copy that finds it busy runs on its caller alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = False
        self._thread: threading.Thread | None = None

    def offer(self, job: _Chunks) -> bool:
        with self._lock:
            if self._busy:
                return False
            self._busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstored-copy", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            job.work()
            job = None  # hold no arrays while idle
            with self._lock:
                self._busy = False


_HELPER = _Helper()


def _split(src, src_offs, dst, dst_offs, nbytes: int, stream: bool) -> bool:
    """:func:`gather_scatter` on this thread and the helper (where it is idle); False, nothing
    copied, where a block lies outside either array."""
    if not _in_bounds(len(src), src_offs, len(dst), dst_offs, nbytes):
        return False
    job = _Chunks(src, src_offs, dst, dst_offs, nbytes, stream)
    if not _HELPER.offer(job):
        return _gather_scatter(src, src_offs, dst, dst_offs, nbytes, stream)
    job.work()
    job.done.wait()
    if job.error is not None:
        raise job.error
    return True


def address_tags(uid: int, layers: np.ndarray, heads: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """A 32-bit tag per block address, folded into its stored checksum.

    A block read back from the wrong place (a stale extent, a misdirected write)
    then fails verification even when its bytes are a valid block of another page.
    """
    # Both halves of the uid (random, up to 62 bits: catalog.py) fold into 32 bits, which leaves
    # a uid below 2^32 (a store's uids before they were random) as it was. The uid term wraps
    # modulo 2^64 on purpose; Python ints do it without numpy's overflow warning.
    x = np.uint64((((uid ^ (uid >> 32)) & 0xFFFFFFFF) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    x = x ^ (layers.astype(np.uint64) << np.uint64(40)) ^ (heads.astype(np.uint64) << np.uint64(24)) ^ pages.astype(np.uint64)
    x = (x ^ (x >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(32))
    return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)
