"""What the CPU kernels share: numba's code generation, set before any of them compiles, and
the compiled helpers several kernels inline (half-precision widening, a max that vectorises,
a polynomial 2**x, the padding of a short top-k)."""

from __future__ import annotations

import numba
from numba.core import types
from llvmlite import ir
from numba.extending import intrinsic, overload
import numpy as np

from kvdrive.kernels import jit
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says

# Before the first kernel is compiled or loaded from the cache (every kernel module imports this one first).
VECTOR_WIDTH = jit.configure()

# Storage kinds of the cached K/V the attention kernel reads (half kinds are passed as uint16 bits).
FLOAT32, FLOAT16, BFLOAT16 = 0, 1, 2

# Fast-math without "no infinities": -inf marks masked logits.
_ATTENTION_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# Low-rank logits come from int8 codes and finite queries: never NaN (-inf marks padding), so
# "no NaNs" is safe and lets the max reductions vectorise.
_LOWRANK_FASTMATH = _ATTENTION_FASTMATH | {"nnan"}


@intrinsic
def _half_to_float(typingctx, bits):
    """fp16 bits (uint16) -> float32; LLVM lowers a loop of these to F16C vcvtph2ps where the CPU has it."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _bfloat_to_float(typingctx, bits):
    """bf16 bits (uint16) -> float32: the bits are the float's upper half."""
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _bits_to_float(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _fmax(typingctx, a, b):
    """The larger of two float32s, as LLVM's ``maxnum``.

    numba's ``max`` checks for NaN around its compare, which keeps a max-reduction loop
    scalar (about 1 ns per element here); a loop of ``maxnum`` vectorises (``vmaxps``).
    Either argument NaN gives the other; callers never pass NaN.
    """
    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32), codegen


def _widen(src, kind, dst):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError("_widen exists only inside numba-compiled kernels (see its overload)")


@overload(_widen, inline="always")
def _widen_impl(src, kind, dst):
    """Row ``src`` (float32, or fp16/bf16 bits as uint16) into the float32 row ``dst``."""
    if isinstance(src.dtype, types.Float):
        def copy(src, kind, dst):
            for d in range(src.shape[0]):
                dst[d] = src[d]
        return copy

    def from_half(src, kind, dst):
        if kind == BFLOAT16:
            for d in range(src.shape[0]):
                dst[d] = _bfloat_to_float(src[d])
        else:
            for d in range(src.shape[0]):
                dst[d] = _half_to_float(src[d])
    return from_half


def _to_float(x):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError("_to_float exists only inside numba-compiled kernels (see its overload)")


@overload(_to_float, inline="always")
def _to_float_impl(x):
    """One float32 from a float, or from fp16 bits (uint16)."""
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return lambda x: _half_to_float(x)


@numba.njit(nogil=True, cache=True, inline="always", fastmath=_ATTENTION_FASTMATH)
def _exp2_nonpos(x):  # pragma: no cover - compiled
    """2**x for x <= 0 (relative error below 1e-4; 0 below -126, -inf included).

    2^n from the exponent bits, 2^f by a degree-5 polynomial: no libm call, so a loop
    of these vectorises (libm's exp2f does not). Below -126 the exponent bits are
    those of 0.0: zero without a branch or a select.
    """
    t = _fmax(x, np.float32(-127.0))
    n = np.floor(t)
    f = t - n
    p = np.float32(1.0) + f * (np.float32(0.6931472) + f * (np.float32(0.2402265) + f * (
        np.float32(0.05550411) + f * (np.float32(0.009618129) + f * np.float32(0.001333355)))))
    return _bits_to_float((np.int32(n) + np.int32(127)) << np.int32(23)) * p


@numba.njit(nogil=True, cache=True)
def _nth_unused(out_pages, b, h, i, p_n):  # pragma: no cover - compiled
    """The lowest page not among ``out_pages[b, h, :i]`` (padding of a row with too few candidates)."""
    for p in range(p_n):
        used = False
        for j in range(i):
            if out_pages[b, h, j] == p:
                used = True
                break
        if not used:
            return p
    return 0
