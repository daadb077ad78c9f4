"""Byte movers and block checksums used on the daemon's data path."""

from __future__ import annotations

import zlib

import numba
import numpy as np


@numba.njit(nogil=True, cache=True, parallel=True)
def _gather_scatter(src, src_offs, dst, dst_offs, nbytes):  # pragma: no cover - compiled
    for i in numba.prange(len(src_offs)):
        s = src_offs[i]
        d = dst_offs[i]
        dst[d : d + nbytes] = src[s : s + nbytes]


def gather_scatter(src: np.ndarray, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int) -> None:
    """``dst[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` for every i, one pass, no GIL.

    Callers check bounds; the kernel does not.
    """
    if len(src_offs):
        _gather_scatter(src, src_offs.astype(np.int64, copy=False), dst, dst_offs.astype(np.int64, copy=False), nbytes)


def address_tags(uid: int, layers: np.ndarray, heads: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """A 32-bit tag per block address, folded into its stored checksum.

    A block read back from the wrong place (a stale extent, a misdirected write)
    then fails verification even when its bytes are a valid block of another page.
    """
    x = np.uint64(uid & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
    x = x ^ (layers.astype(np.uint64) << np.uint64(40)) ^ (heads.astype(np.uint64) << np.uint64(24)) ^ pages.astype(np.uint64)
    x = (x ^ (x >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(32))
    return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def block_crcs(buf: np.ndarray, offsets: np.ndarray, nbytes: int) -> np.ndarray:
    """CRC-32 of ``nbytes`` at each offset of ``buf`` (zlib releases the GIL per block)."""
    view = memoryview(buf)
    return np.fromiter((zlib.crc32(view[o : o + nbytes]) for o in offsets.tolist()), dtype=np.uint32, count=len(offsets))
