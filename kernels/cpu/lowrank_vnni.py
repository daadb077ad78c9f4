"""The int4 and int2 channels of the low-rank logits by AVX-512 VNNI dot products, where
numba targets them (:func:`available`): four channels of a token, one byte each, times four
int8 weights in one 32-bit lane of ``vpdpbusd``, 64 multiply-adds an instruction.

The passes of :mod:`.lowrank_passes` widen each channel to an int16 lane and multiply and add
it apart for each query head. Here the 16 tokens of a group take two int4 rows at a time, put
into lanes of four codes by a byte permute (``vpermi2b``) and a per-byte bit select
(``vpmultishiftqb``), or one int2 row (a zero-extension and the bit select); each query head
then takes a lane of codes in one instruction, and no shift is left on the port that
multiplies. Each head keeps two chains of sums, the first half of the rows and the second,
so that the instruction's latency does not stall that port (one chain ran at 0.069 ms, two at
0.044). At Gemma 3's rank-108 layout (52 int4 and 52 int2 channels), 17K tokens and 4 query
heads, these channels took 0.044-0.049 ms here against 0.091-0.099 ms by the passes.

``vpdpbusd`` multiplies unsigned bytes by signed ones, so codes go in offset to unsigned
(int4 code + 8, int2 code + 2) and the weights as int8 over a step per head and half (the
half's largest weight over 127, rounded; :func:`_vnni_weights`); the offsets times the
rounded weights are taken back once per head. Rounding moves a weight by at most half its
step: on a recorded Gemma 3 call the page scores moved from the float reference's by 0.0044 on
average, 0.023 at most (the passes' int16 weights, whose step keeps a head's whole sum in int16:
0.0025 and 0.017), and one page of the 64 chosen changed, for one that the float reference
scores 0.0015 below it.

The kernel is LLVM IR written here (numba has no vector types): a loop over groups of 16
tokens, the last one masked (no read or write past the tokens asked for), and in it loops
over the code rows, whose sums stay in registers. It compiles only where numba targets
AVX-512 VNNI, VBMI, BW and VL and its LLVM verifies the intrinsics as declared here
(:func:`_pointer_kind`: checked with numba 0.59's LLVM 14, 0.65's LLVM 20 and 0.68's LLVM 22;
declared for LLVM 22 alone, they failed to compile on LLVM 20, the numba the engines pin);
elsewhere :mod:`.lowrank` takes the passes and logs so once.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says

_FEATURES = ("avx512vnni", "avx512vbmi", "avx512bw", "avx512vl")
_I1, _I8, _I32, _I64, _F32 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_LANES = 16
_V32, _V8, _VB, _VF, _VM, _VI = (ir.VectorType(_I32, _LANES), ir.VectorType(_I8, 4 * _LANES),
                                 ir.VectorType(_I8, _LANES), ir.VectorType(_F32, _LANES), ir.VectorType(_I1, _LANES),
                                 ir.VectorType(_I64, _LANES))


# Two int4 rows' codes of token t into lane t: byte 4t from the first row, 4t+1 from the second
# (vpermi2b; the lane's other two bytes are never read). Then, per 64-bit word of two lanes, the
# bit offset each byte is taken from (vpmultishiftqb): the rows' low nibbles, then their high.
_PAIR_BYTES = [t // 4 + (4 * _LANES if t % 4 == 1 else 0) for t in range(4 * _LANES)]
_PAIR_FIELDS = [0, 8, 4, 12, 32, 40, 36, 44] * (_LANES // 2)
_INT2_FIELDS = [0, 2, 4, 6, 32, 34, 36, 38] * (_LANES // 2)  # an int2 row's byte, zero-extended to its lane


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI, VBMI, BW and VL (the host's, unless
    ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name another: then only the features they name
    count) and its LLVM takes the kernel's intrinsics as they are written (:func:`_pointer_kind`)."""
    from llvmlite import binding as llvm  # noqa: PLC0415

    if numba.config.CPU_FEATURES:
        named = set(numba.config.CPU_FEATURES.split(","))
        features = all(f"+{f}" in named for f in _FEATURES)
    elif numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        features = False
    else:
        try:
            host = llvm.get_host_cpu_features()
        except RuntimeError:
            return False
        features = all(host.get(f) for f in _FEATURES)
    return features and _pointer_kind() is not None


@functools.cache
def _pointer_kind() -> bool | None:
    """How numba's LLVM names the masked load and store intrinsics: False where its pointers
    are opaque (LLVM 15 on: ``.p0``), True where typed (LLVM 14: ``.p0v16i8``), None where a
    module calling every intrinsic of the kernel either way fails to verify (then no VNNI)."""
    from llvmlite import binding as llvm  # noqa: PLC0415

    for typed in (False, True):
        mod = ir.Module()
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.PointerType(_I8)]), "probe")
        b = ir.IRBuilder(fn.append_basic_block())
        calls = _Intrinsics(mod, typed)
        mask = ir.Constant(_VM, [1] * _LANES)
        codes = _widen(b, calls.load8(b, fn.args[0], mask))
        lanes = b.bitcast(b.call(calls.multishift, [b.call(calls.permute, [codes, codes, codes]), codes]), _V32)
        sums = b.call(calls.dp, [lanes, lanes, lanes])
        calls.storef(b, b.fadd(calls.loadf(b, fn.args[0], mask), b.sitofp(sums, _VF)), fn.args[0], mask)
        b.ret_void()
        try:
            llvm.parse_assembly(str(mod)).verify()
        except RuntimeError:
            continue
        return typed
    return None


class _Intrinsics:
    """The kernel's intrinsics, declared in ``mod``; the masked loads and stores named for
    ``typed`` pointers or opaque ones, and taking an ``i8*`` either way."""

    def __init__(self, mod, typed: bool):
        def declare(name, ret, *args):
            return cgutils.get_or_insert_function(mod, ir.FunctionType(ret, list(args)), name)

        def ptr(vtype):  # the pointer argument of a masked load or store of vtype, and its name's suffix
            return (ir.PointerType(vtype), f"p0v{_LANES}{'i8' if vtype == _VB else 'f32'}") if typed else (
                ir.PointerType(_I8), "p0")

        (p8, n8), (pf, nf) = ptr(_VB), ptr(_VF)
        self._p8, self._pf = p8, pf
        self._load8 = declare(f"llvm.masked.load.v16i8.{n8}", _VB, p8, _I32, _VM, _VB)
        self._loadf = declare(f"llvm.masked.load.v16f32.{nf}", _VF, pf, _I32, _VM, _VF)
        self._storef = declare(f"llvm.masked.store.v16f32.{nf}", ir.VoidType(), _VF, pf, _I32, _VM)
        # Declared with 32-bit lanes, as LLVM up to 20 (numba 0.65, which the engines pin) has
        # it; LLVM 21 on takes bytes, and reads this form as that.
        self.dp = declare("llvm.x86.avx512.vpdpbusd.512", _V32, _V32, _V32, _V32)
        self.permute = declare("llvm.x86.avx512.vpermi2var.qi.512", _V8, _V8, _V8, _V8)
        self.multishift = declare("llvm.x86.avx512.pmultishift.qb.512", _V8, _V8, _V8)

    def load8(self, b, p, mask):
        return b.call(self._load8, [b.bitcast(p, self._p8), ir.Constant(_I32, 1), mask, ir.Constant(_VB, None)])

    def loadf(self, b, p, mask):
        return b.call(self._loadf, [b.bitcast(p, self._pf), ir.Constant(_I32, 4), mask, ir.Constant(_VF, None)])

    def storef(self, b, value, p, mask):
        b.call(self._storef, [value, b.bitcast(p, self._pf), ir.Constant(_I32, 4), mask])


def _splat(builder, value, vtype):
    one = builder.insert_element(ir.Constant(vtype, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, vtype.count), [0] * vtype.count))


def _widen(builder, v):
    """16 bytes in the low bytes of a 512-bit vector, the rest zero."""
    picks = ir.Constant(ir.VectorType(_I32, 4 * _LANES), [min(i, _LANES) for i in range(4 * _LANES)])
    return builder.shuffle_vector(v, ir.Constant(_VB, None), picks)


def _k(value):
    return ir.Constant(_V32, [value] * _LANES)


class _Emit:
    """IR for one call of :func:`_dot`: ``hc`` query heads from ``g0``, tokens ``t0 .. t1 - 1``."""

    def __init__(self, context, builder, sig, args, hc):
        self.b, self.hc = builder, hc
        c, self.r4, self.pairs, self.r2, self.rows2, w4, w2, sc, self.g0, self.t0, self.t1, out = args
        self.c, self.c_rows, self.c_stride = self._array(context, sig.args[0], c)
        self.w4, _, self.w4_stride = self._array(context, sig.args[5], w4)
        self.w2, _, self.w2_stride = self._array(context, sig.args[6], w2)
        self.sc, _, self.sc_stride = self._array(context, sig.args[7], sc)
        self.out, _, self.out_stride = self._array(context, sig.args[11], out)
        self.calls = _Intrinsics(builder.module, _pointer_kind())
        # Each head's int4 and int2 sums, two sets of each (:meth:`_in_twos`).
        self.acc4 = [[cgutils.alloca_once(builder, _V32) for _ in range(hc)] for _ in range(2)]
        self.acc2 = [[cgutils.alloca_once(builder, _V32) for _ in range(hc)] for _ in range(2)]

    def _array(self, context, ty, value):
        a = context.make_array(ty)(context, self.b, value)
        rows, _ = cgutils.unpack_tuple(self.b, a.shape, 2)
        stride, _ = cgutils.unpack_tuple(self.b, a.strides, 2)
        return self.b.bitcast(a.data, ir.PointerType(_I8)), rows, stride

    def _at(self, base, stride, row, byte):
        return self.b.gep(base, [self.b.add(self.b.mul(row, stride), byte)])

    def _weight(self, base, stride, j, col):
        """Head ``g0 + j``'s four int8 weights of code group ``col``, in every lane."""
        b = self.b
        p = self._at(base, stride, b.add(self.g0, ir.Constant(_I64, j)), b.mul(col, ir.Constant(_I64, 4)))
        return _splat(b, b.load(b.bitcast(p, ir.PointerType(_I32))), _V32)

    def _row(self, row, t, mask):
        return self.calls.load8(self.b, self._at(self.c, self.c_stride, row, t), mask)

    def _wide(self, row, t, mask):
        """A row's 16 codes in the low bytes of a 512-bit vector (the rest zero)."""
        return _widen(self.b, self._row(row, t, mask))

    def _codes(self, data, fields, mask, offset):
        """Each lane's four code fields, chosen from its bytes (``vpmultishiftqb``), masked, offset."""
        b = self.b
        picked = b.bitcast(b.call(self.calls.multishift, [ir.Constant(_V8, fields), data]), _V32)
        return b.xor(b.and_(picked, _k(mask)), _k(offset))

    def _add(self, accs, lanes, base, stride, col):
        """Each head's weights of code group ``col`` times ``lanes``, into its sum in ``accs``."""
        b = self.b
        for j, a in enumerate(accs):
            b.store(b.call(self.calls.dp, [b.load(a), lanes, self._weight(base, stride, j, col)]), a)

    def _in_twos(self, count, step):
        """``step(i, k)`` for i in range(count): the first half (rounded up) into the first set of
        sums (k = 0), the rest into the second, in turns: two chains of dependent ``vpdpbusd`` per
        head, so that its latency does not stall the port, and a weight step per half."""
        b = self.b
        first = b.ashr(b.add(count, ir.Constant(_I64, 1)), ir.Constant(_I64, 1))
        with cgutils.for_range(b, b.sub(count, first)) as loop:
            step(loop.index, 0)
            step(b.add(loop.index, first), 1)
        with b.if_then(b.trunc(count, _I1)):
            step(b.sub(first, ir.Constant(_I64, 1)), 0)

    def group(self, index):
        """The 16 tokens from ``t0 + 16 * index``: their logits' int4 and int2 shares added to ``out``."""
        b = self.b
        off = b.mul(index, ir.Constant(_I64, _LANES))
        t = b.add(self.t0, off)
        mask = b.icmp_signed("<", ir.Constant(_VI, list(range(_LANES))), _splat(b, b.sub(self.t1, t), _VI))
        for sums in self.acc4 + self.acc2:
            for a in sums:
                b.store(ir.Constant(_V32, None), a)
        last = b.sub(self.c_rows, ir.Constant(_I64, 1))

        def pair(p, k):  # rows 2p and 2p+1: lanes [2p lo, 2p+1 lo, 2p hi, 2p+1 hi]
            ra = b.add(self.r4, b.mul(p, ir.Constant(_I64, 2)))
            rb = b.add(ra, ir.Constant(_I64, 1))
            rb = b.select(b.icmp_signed("<", rb, last), rb, last)  # an odd row count: any row, times zero weights
            pair_bytes = b.call(self.calls.permute, [self._wide(ra, t, mask), ir.Constant(_V8, _PAIR_BYTES),
                                               self._wide(rb, t, mask)])
            lanes = self._codes(pair_bytes, _PAIR_FIELDS, 0x0F0F0F0F, 0x08080808)  # codes + 8
            self._add(self.acc4[k], lanes, self.w4, self.w4_stride, p)

        def int2(r, k):  # one int2 row: its four channels, lowest bits first
            byte = b.bitcast(b.zext(self._row(b.add(self.r2, r), t, mask), _V32), _V8)
            lanes = self._codes(byte, _INT2_FIELDS, 0x03030303, 0x02020202)  # codes + 2
            self._add(self.acc2[k], lanes, self.w2, self.w2_stride, r)

        self._in_twos(self.pairs, pair)
        self._in_twos(self.rows2, int2)
        self._store(off, mask)

    def _store(self, off, mask):
        b = self.b
        for j in range(self.hc):
            g = b.add(self.g0, ir.Constant(_I64, j))

            def scale(k, g=g):
                p = self._at(self.sc, self.sc_stride, g, ir.Constant(_I64, 4 * k))
                return _splat(b, b.load(b.bitcast(p, ir.PointerType(_F32))), _VF)

            share = scale(4)
            for k, sums in enumerate((self.acc4[0], self.acc4[1], self.acc2[0], self.acc2[1])):
                share = b.fadd(share, b.fmul(b.sitofp(b.load(sums[j]), _VF), scale(k)))
            p = self._at(self.out, self.out_stride, g, b.mul(off, ir.Constant(_I64, 4)))
            self.calls.storef(b, b.fadd(self.calls.loadf(b, p, mask), share), p, mask)


def _dot_intrinsic(hc: int):
    @intrinsic
    def dot(typingctx, c, r4, pairs, r2, rows2, w4, w2, sc, g0, t0, t1, out):
        wanted = ((c, types.int8), (w4, types.int8), (w2, types.int8), (sc, types.float32), (out, types.float32))
        if any(not isinstance(a, types.Array) or a.ndim != 2 or a.dtype != d for a, d in wanted):
            raise TypingError("the VNNI logits take 2-d int8 codes and weights and float32 scales and logits")
        sig = types.void(c, types.int64, types.int64, types.int64, types.int64, w4, w2, sc, types.int64, types.int64,
                         types.int64, out)

        def codegen(context, builder, signature, args):
            if not available():  # never called on such a host (lowrank passes vnni=False); trap, not wrong logits
                builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                            "llvm.trap"), [])
                return context.get_dummy_value()
            emit = _Emit(context, builder, signature, args, hc)
            n = builder.sub(emit.t1, emit.t0)
            groups = builder.sdiv(builder.add(n, ir.Constant(_I64, _LANES - 1)), ir.Constant(_I64, _LANES))
            with cgutils.for_range(builder, groups) as loop:
                emit.group(loop.index)
            return context.get_dummy_value()
        return sig, codegen
    return dot


_dot1, _dot2, _dot3, _dot4 = (_dot_intrinsic(hc) for hc in range(1, 5))


@numba.njit(nogil=True, cache=True, inline="always")
def _vnni_dot(hc, c, r4, rows4, rows2, w4, w2, sc, g0, t0, t1, out):  # pragma: no cover - compiled
    """Query heads ``g0 .. g0 + hc - 1`` (``hc`` <= 4): the int4 and int2 channels of code rows ``r4 ..``
    (``rows4`` int4 rows, then ``rows2`` int2 ones) for tokens ``t0 .. t1 - 1``, added to
    ``out[:, :t1 - t0]``, with :func:`_vnni_weights`' ``w4``, ``w2`` and ``sc``. The codes' rows
    must be contiguous."""
    pairs, r2 = (rows4 + 1) // 2, r4 + rows4
    if hc == 4:
        _dot4(c, r4, pairs, r2, rows2, w4, w2, sc, g0, t0, t1, out)
    elif hc == 3:
        _dot3(c, r4, pairs, r2, rows2, w4, w2, sc, g0, t0, t1, out)
    elif hc == 2:
        _dot2(c, r4, pairs, r2, rows2, w4, w2, sc, g0, t0, t1, out)
    else:
        _dot1(c, r4, pairs, r2, rows2, w4, w2, sc, g0, t0, t1, out)


@numba.njit(nogil=True, cache=True)
def _quantise(w, first, n, out, at, half, sc, k):  # pragma: no cover - compiled
    """Channels ``first .. first + n - 1`` of ``w`` ``[G, R]`` as int8 over their step: channel
    ``first + i`` to ``out[:, at[i]]``, over the step of its half (``half[i]``, 0 or 1), each
    head's two steps in ``sc[:, k]`` and ``sc[:, k + 1]``. Returns each head's sum of the
    rounded weights times their steps."""
    g_n = w.shape[0]
    total = np.zeros(g_n, np.float32)
    for g in range(g_n):
        for part in range(2):
            m = np.float32(0.0)
            for i in range(n):
                if half[i] == part:
                    m = max(m, abs(w[g, first + i]))
            step = m / np.float32(127.0)
            sc[g, k + part] = step
            for i in range(n):
                if half[i] == part and step > 0:
                    q = np.round(w[g, first + i] / step)
                    out[g, at[i]] = np.int8(q)
                    total[g] += q * step
    return total


@numba.njit(nogil=True, cache=True)
def _vnni_weights(w, wide, narrow, w4, w2, sc):  # pragma: no cover - compiled
    """``w`` ``[G, R]``'s int4 and int2 channels as :func:`_vnni_dot` takes them: int8 weights in
    ``w4`` ``[G, 4 * int4 row pairs]`` and ``w2`` ``[G, 4 * int2 rows]`` (zero where a lane has
    no channel), and per head ``sc`` ``[G, 5]``: the steps of the first and second half of the
    int4 lanes (:meth:`_Emit._in_twos`: each half sums apart, so each has its own step, and the
    leading channels, which carry the most, do not set the trailing ones' step), the same of
    the int2 lanes, and what the codes' offsets add to a logit, negated."""
    r_n = w.shape[1]
    n4 = r_n - wide - narrow
    w4[:] = 0
    w2[:] = 0
    at4, half4 = np.empty(n4, np.int64), np.empty(n4, np.int64)
    first4 = (w4.shape[1] // 4 + 1) // 2  # lanes in the first half
    for i in range(n4):  # channel i: row i // 2, its low nibble (even i) or high; rows 2p, 2p+1 share a lane
        row, high = i // 2, i % 2
        at4[i] = 4 * (row // 2) + 2 * high + row % 2
        half4[i] = row // 2 >= first4
    first2 = (w2.shape[1] // 4 + 1) // 2
    half2 = np.arange(narrow) // 4 >= first2
    sum4 = _quantise(w, wide, n4, w4, at4, half4, sc, 0)
    sum2 = _quantise(w, r_n - narrow, narrow, w2, np.arange(narrow), half2.astype(np.int64), sc, 2)
    for g in range(w.shape[0]):
        sc[g, 4] = -(np.float32(8.0) * sum4[g] + np.float32(2.0) * sum2[g])
