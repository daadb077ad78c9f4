"""CRC-32C block checksums, computed in compiled loops without the GIL.

Every stored block carries a CRC-32C (Castagnoli) of its bytes. On x86-64 hosts
with SSE4.2 the kernel uses the ``crc32`` instruction and runs four blocks'
checksums side by side, so the instruction's three-cycle latency is hidden; other
hosts use a slicing-by-8 table loop that gives the same values. One call covers
every block of a read, so a get pays no Python work per block.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvdrive.protocol import jit_cache
from kvdrive.protocol.copy import copy_bytes as _copy_bytes

jit_cache.use("kvstored")  # before the definitions below: they cache where it says

_POLY = 0x82F63B78  # CRC-32C, reflected


def _host_has_sse42() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return bool(llvm.get_host_cpu_features().get("sse4.2", False))
    except RuntimeError:  # features unknown on this host
        return False


HARDWARE = _host_has_sse42()


def _tables() -> np.ndarray:
    t = np.zeros((8, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        t[0, i] = c
    for k in range(1, 8):
        for i in range(256):
            t[k, i] = (t[k - 1, i] >> 8) ^ t[0, t[k - 1, i] & 0xFF]
    return t


_TABLES = _tables()


@intrinsic
def _load_u64(typingctx, arr, at):  # pragma: no cover - compiled
    """The little-endian 8 bytes at ``&arr[at]``, any alignment."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(ptr, align=1)

    return types.uint64(arr, at), codegen


@intrinsic
def _crc_step(typingctx, crc, word):  # pragma: no cover - compiled, SSE4.2 only
    """One ``crc32 r64, r64`` instruction: fold 8 bytes into a running CRC-32C."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]),
                                            "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, [args[0], args[1]])

    return types.uint64(types.uint64, types.uint64), codegen


@numba.njit(nogil=True, cache=True)
def _crc_table(buf, start, n, tables):  # pragma: no cover - compiled
    crc = np.uint32(0xFFFFFFFF)
    i = start
    end = start + n
    while i + 8 <= end:
        lo = crc ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8) | (np.uint32(buf[i + 2]) << 16)
                    | (np.uint32(buf[i + 3]) << 24))
        crc = (tables[7, lo & 0xFF] ^ tables[6, (lo >> 8) & 0xFF] ^ tables[5, (lo >> 16) & 0xFF]
               ^ tables[4, lo >> 24] ^ tables[3, buf[i + 4]] ^ tables[2, buf[i + 5]]
               ^ tables[1, buf[i + 6]] ^ tables[0, buf[i + 7]])
        i += 8
    while i < end:
        crc = (crc >> 8) ^ tables[0, (crc ^ buf[i]) & 0xFF]
        i += 1
    return crc ^ np.uint32(0xFFFFFFFF)


@numba.njit(nogil=True, cache=True)
def _crc_tail_hw(crc, buf, i, end, tables):  # pragma: no cover - compiled
    c = np.uint32(crc)
    while i < end:
        c = (c >> 8) ^ tables[0, (c ^ buf[i]) & 0xFF]
        i += 1
    return c


@numba.njit(nogil=True, cache=True)
def _crcs_hw(buf, offs, nbytes, out, tables):  # pragma: no cover - compiled, SSE4.2 only
    n = len(offs)
    words = nbytes // 8
    tail = words * 8
    mask = np.uint64(0xFFFFFFFF)
    b = 0
    while b + 4 <= n:  # four independent chains keep the crc32 unit busy
        o0, o1, o2, o3 = offs[b], offs[b + 1], offs[b + 2], offs[b + 3]
        c0 = c1 = c2 = c3 = mask
        for w in range(words):
            k = w * 8
            c0 = _crc_step(c0, _load_u64(buf, o0 + k))
            c1 = _crc_step(c1, _load_u64(buf, o1 + k))
            c2 = _crc_step(c2, _load_u64(buf, o2 + k))
            c3 = _crc_step(c3, _load_u64(buf, o3 + k))
        out[b] = _crc_tail_hw(c0, buf, o0 + tail, o0 + nbytes, tables) ^ np.uint32(0xFFFFFFFF)
        out[b + 1] = _crc_tail_hw(c1, buf, o1 + tail, o1 + nbytes, tables) ^ np.uint32(0xFFFFFFFF)
        out[b + 2] = _crc_tail_hw(c2, buf, o2 + tail, o2 + nbytes, tables) ^ np.uint32(0xFFFFFFFF)
        out[b + 3] = _crc_tail_hw(c3, buf, o3 + tail, o3 + nbytes, tables) ^ np.uint32(0xFFFFFFFF)
        b += 4
    while b < n:
        c = mask
        o = offs[b]
        for w in range(words):
            c = _crc_step(c, _load_u64(buf, o + w * 8))
        out[b] = _crc_tail_hw(c, buf, o + tail, o + nbytes, tables) ^ np.uint32(0xFFFFFFFF)
        b += 1


@numba.njit(nogil=True, cache=True)
def _crcs_table(buf, offs, nbytes, out, tables):  # pragma: no cover - compiled
    for b in range(len(offs)):
        out[b] = _crc_table(buf, offs[b], nbytes, tables)


_crcs = _crcs_hw if HARDWARE else _crcs_table


@numba.njit(nogil=True, cache=True)
def _check_and_scatter(src, src_offs, dst, dst_offs, nbytes, crcs, tags, expect, ok):  # pragma: no cover
    good = 0
    for i in range(len(src_offs)):
        ok[i] = (crcs[i] ^ tags[i]) == expect[i]
        if ok[i]:
            _copy_bytes(dst, dst_offs[i], src, src_offs[i], nbytes)
            good += 1
    return good


def _check_offsets(buf: np.ndarray, offsets: np.ndarray, nbytes: int) -> np.ndarray:
    if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
        raise ValueError("block checksums need a contiguous uint8 array")
    offs = np.ascontiguousarray(offsets, dtype=np.int64)
    if len(offs) and (nbytes < 0 or offs.min() < 0 or offs.max() > len(buf) - nbytes):
        raise ValueError(f"a {nbytes} B block lies outside the {len(buf)} B buffer")
    return offs


def block_crcs(buf: np.ndarray, offsets: np.ndarray, nbytes: int) -> np.ndarray:
    """CRC-32C of ``nbytes`` at each offset of ``buf``."""
    offs = _check_offsets(buf, offsets, nbytes)
    out = np.empty(len(offs), dtype=np.uint32)
    if len(offs):
        _crcs(buf, offs, nbytes, out, _TABLES)
    return out


def crc32c(data) -> int:
    """CRC-32C of a whole bytes-like object."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    return int(block_crcs(buf, np.zeros(1, dtype=np.int64), len(buf))[0])


def verify_scatter(src: np.ndarray, src_offs: np.ndarray, dst: np.ndarray, dst_offs: np.ndarray, nbytes: int,
                   tags: np.ndarray, expect: np.ndarray) -> np.ndarray:
    """Check each block's CRC-32C (xor its address tag) and copy only the good ones.

    Returns the per-block ``ok`` mask; a damaged block's destination is left as it was.
    """
    src_offs = _check_offsets(src, src_offs, nbytes)
    dst_offs = _check_offsets(dst, dst_offs, nbytes)
    if not dst.flags.writeable or len(src_offs) != len(dst_offs):
        raise ValueError("verify_scatter needs a writable destination and one destination per block")
    ok = np.zeros(len(src_offs), dtype=np.bool_)
    if len(src_offs):
        crcs = np.empty(len(src_offs), dtype=np.uint32)
        _crcs(src, src_offs, nbytes, crcs, _TABLES)
        _check_and_scatter(src, src_offs, dst, dst_offs, nbytes, crcs,
                           np.ascontiguousarray(tags, dtype=np.uint32), np.ascontiguousarray(expect, dtype=np.uint32), ok)
    return ok
