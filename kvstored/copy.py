"""Byte movers and block checksums used on the daemon's data path."""

from __future__ import annotations

import numba
import numpy as np

from kvdrive.protocol.copy import copy_bytes as _copy_bytes
from kvdrive.protocol.copy import gather_scatter_serial as _gather_scatter
from kvdrive.protocol.copy import in_bounds as _in_bounds

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


@numba.njit(nogil=True, cache=True, parallel=True)
def _gather_scatter_parallel(src, src_offs, dst, dst_offs, nbytes):  # pragma: no cover - compiled
    if not _in_bounds(len(src), src_offs, len(dst), dst_offs, nbytes):
        return False
    for i in numba.prange(len(src_offs)):
        _copy_bytes(dst, dst_offs[i], src, src_offs[i], nbytes)
    return True


def gather_scatter(src: np.ndarray, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
    """``dst[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` for every i, one pass, no GIL.

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
    else:
        ok = _gather_scatter(src, src_offs, dst, dst_offs, nbytes, total >= STREAM_MIN_BYTES)
    if not ok:
        raise ValueError(f"gather_scatter: a {nbytes} B block lies outside the source ({len(src)} B) "
                         f"or the destination ({len(dst)} B), or the offset lists differ in length")


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
