"""Byte movers for the buffers a client shares with kvstored, used at both ends.

Numba intrinsics for a plain copy (``memcpy``) and a streamed one (non-temporal stores,
which write around the caches and skip reading each destination line before it is
overwritten), and the serial gather/scatter both ends copy blocks with: kvstored into and
out of its tiers (``kvstored/copy.py`` adds a parallel one, ``kvstored/checksum.py`` a
checked one), a client out of a shared buffer into an engine's memory (:func:`scatter_out`) and
into one from it (:func:`gather_in`). Imported only where bytes move: it loads numba.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.protocol")  # before the definitions below: they cache where it says

STREAM_VEC = 32  # bytes a non-temporal store writes: a streamed copy's destination is aligned to it


@intrinsic
def copy_bytes(typingctx, dst, d, src, s, n):  # pragma: no cover - compiled
    """``memcpy(&dst[d], &src[s], n)``: numba's slice assignment is an element loop, ~3x slower."""

    def codegen(context, builder, signature, args):
        dst_arr = context.make_array(signature.args[0])(context, builder, args[0])
        src_arr = context.make_array(signature.args[2])(context, builder, args[2])
        to = builder.gep(dst_arr.data, [args[1]])
        frm = builder.gep(src_arr.data, [args[3]])
        cgutils.raw_memcpy(builder, to, frm, args[4], 1)
        return context.get_dummy_value()

    return types.void(dst, d, src, s, n), codegen


@intrinsic
def stream_bytes(typingctx, dst, d, src, s, n):  # pragma: no cover - compiled
    """Copy ``n`` bytes with non-temporal vector stores; ``&dst[d]`` aligned to STREAM_VEC, ``n`` a multiple of it."""

    def codegen(context, builder, signature, args):
        dst_arr = context.make_array(signature.args[0])(context, builder, args[0])
        src_arr = context.make_array(signature.args[2])(context, builder, args[2])
        vec = ir.VectorType(ir.IntType(8), STREAM_VEC)
        to = builder.bitcast(builder.gep(dst_arr.data, [args[1]]), vec.as_pointer())
        frm = builder.bitcast(builder.gep(src_arr.data, [args[3]]), vec.as_pointer())
        count = builder.udiv(args[4], ir.Constant(ir.IntType(64), STREAM_VEC))
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, count) as loop:
            value = builder.load(builder.gep(frm, [loop.index]), align=1)
            store = builder.store(value, builder.gep(to, [loop.index]), align=STREAM_VEC)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(dst, d, src, s, n), codegen


@intrinsic
def store_fence(typingctx):  # pragma: no cover - compiled
    """Non-temporal stores are weakly ordered: make them visible before anyone is told the bytes are there."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(nogil=True, cache=True, inline="always")
def _stream_range(dst, d, src, s, n):  # pragma: no cover - compiled
    """``dst[d:d+n] = src[s:s+n]``, streamed from ``dst``'s first STREAM_VEC-aligned byte to its
    last whole vector, copied around them; whether anything was streamed (a fence is due)."""
    head = min(n, -(dst.ctypes.data + d) % STREAM_VEC)
    body = (n - head) // STREAM_VEC * STREAM_VEC
    if head:
        copy_bytes(dst, d, src, s, head)
    if body:
        stream_bytes(dst, d + head, src, s + head, body)
    if n > head + body:
        copy_bytes(dst, d + head + body, src, s + head + body, n - head - body)
    return body > 0


@numba.njit(nogil=True, cache=True)
def in_bounds(src_len, src_offs, dst_len, dst_offs, nbytes):  # pragma: no cover - compiled
    """Whether every block of ``nbytes`` at the offsets lies inside both arrays (and the lists match)."""
    if nbytes < 0 or len(src_offs) != len(dst_offs):
        return False
    for i in range(len(src_offs)):
        if src_offs[i] < 0 or src_offs[i] > src_len - nbytes or dst_offs[i] < 0 or dst_offs[i] > dst_len - nbytes:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def gather_scatter_serial(src, src_offs, dst, dst_offs, nbytes, stream=False):  # pragma: no cover - compiled
    """``dst[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` for every i on this thread, streamed
    (:func:`_stream_range`) with ``stream``; False, nothing copied, if a block lies outside."""
    if not in_bounds(len(src), src_offs, len(dst), dst_offs, nbytes):
        return False
    streamed = False
    for i in range(len(src_offs)):
        if stream:
            streamed |= _stream_range(dst, dst_offs[i], src, src_offs[i], nbytes)
        else:
            copy_bytes(dst, dst_offs[i], src, src_offs[i], nbytes)
    if streamed:
        store_fence()
    return True


def scatter_out(dst: np.ndarray, dst_offs: np.ndarray, src: np.ndarray, src_offs: np.ndarray, nbytes: int) -> None:
    """``dst[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` for every i with streaming stores
    (a plain copy of the bytes before each destination's first STREAM_VEC-aligned one and
    after its last), in one call without the GIL: blocks loaded into an engine's memory,
    which its copy to the device or another core reads next, not this thread, so their
    lines need not pass through this core's caches. Copies below a few hundred KiB gain
    nothing from it. Raises ValueError for arrays that are not 1-D contiguous uint8, a
    read-only ``dst``, or a block outside either array (then nothing is copied)."""
    _move("scatter_out", dst, dst_offs, src, src_offs, nbytes, True)


def gather_in(dst: np.ndarray, dst_offs: np.ndarray, src: np.ndarray, src_offs: np.ndarray, nbytes: int) -> None:
    """``dst[dst_offs[i]:+nbytes] = src[src_offs[i]:+nbytes]`` for every i, plain stores, in one
    call without the GIL: an engine's blocks gathered into a staging region (which kvstored
    reads next). Raises ValueError as :func:`scatter_out` does."""
    _move("gather_in", dst, dst_offs, src, src_offs, nbytes, False)


def _move(name: str, dst: np.ndarray, dst_offs, src: np.ndarray, src_offs, nbytes: int, stream: bool) -> None:
    for a in (dst, src):
        if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{name} needs 1-D contiguous uint8 arrays")
    if not dst.flags.writeable:
        raise ValueError(f"{name}: the destination is read-only")
    if not gather_scatter_serial(src, np.asarray(src_offs, np.int64), dst, np.asarray(dst_offs, np.int64), nbytes,
                                 stream):
        raise ValueError(f"{name}: a block of {nbytes} bytes lies outside the destination ({dst.nbytes} bytes) "
                         f"or the source ({src.nbytes} bytes), or the offset lists differ in length")


def copy_out(dst: np.ndarray, src: np.ndarray, at: int) -> None:
    """``dst[:] = src[at: at + dst.nbytes]``: one block of :func:`scatter_out`."""
    scatter_out(dst, [0], src, [at], dst.nbytes)
