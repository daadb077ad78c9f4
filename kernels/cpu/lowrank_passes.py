"""Low-rank logits for every code layout but the fused one (:mod:`.lowrank_fused`): generated
passes over a tile of tokens, each over a few code rows of one kind (int8, int4 or int2)."""

from __future__ import annotations

import numba
import numpy as np

from kvdrive.kernels.cpu.common import _LOWRANK_FASTMATH, _fmax
from kvdrive.kernels.cpu.lowrank_mass import _weight_sums
from kvdrive.kernels.cpu.lowrank_vnni import _vnni_dot, _vnni_weights
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says

# Other layouts: passes over a tile of tokens, each over a few code rows of one kind (4 int8
# rows, 4 int4 rows or 2 int2 rows: 4, 8 or 8 channels) for up to 4 query heads at once.
# Each pass widens its codes in registers by shifts of constant length and adds its
# channels' share to the heads' sums in the tile, which stay in L1 between passes: the
# int8 rows' in float32, the int4 and int2 rows' in int16 (:func:`_slot_weights`), 32
# tokens a 512-bit instruction. A pass's weights come from slots: its kind's channels,
# then zeros where the kind has no more rows (rows past the last are read again, times
# zero). (At Gemma 3's rank-108 layout, 16K tokens and 4 query heads, a call chose its
# pages in about 0.2 ms here, against 0.43 ms when a tile's codes were first widened to
# floats in memory, 108 KiB a tile of 256 tokens, more than L1, then read back once per
# head; with float32 passes throughout the logits took about 1.7 times as long as with
# int16 ones.) Where the host has AVX-512 VNNI, the int4 and int2 channels go by its dot
# products instead (:mod:`.lowrank_vnni`), and only the int8 passes run here.
_PASS_ROWS = {8: 4, 4: 4, 2: 2}  # code rows per pass, by bits per channel
_PASS_ROWS8, _PASS_ROWS4, _PASS_ROWS2 = _PASS_ROWS[8], _PASS_ROWS[4], _PASS_ROWS[2]
_PASS_TILE = 1024  # tokens per tile: 4 heads' logits (16 KiB) and int16 sums (8 KiB)
_SLOT_SPARE = 18  # slots past the rank a layout may need: 3 + 7 + 7, and one


def _pass_channels(bits: int) -> list[tuple[int, int, int]]:
    """(row in the pass, left shift, arithmetic right shift) that widen each channel of a pass, in slot order."""
    rows = range(_PASS_ROWS[bits])
    if bits == 8:
        return [(i, 24, 24) for i in rows]
    per = 8 // bits  # channels a row holds, from its lowest bits up
    return [(i, 32 - bits * (j + 1), 32 - bits) for i in rows for j in range(per)]


def _pass_source(bits: int, hc: int) -> str:
    """Source of ``_pass<bits>_<hc>(ws, g0, s0, c, r0, t0, t1, out)``: query heads ``g0 .. g0 + hc - 1``
    add the channels of code rows ``r0 ..``, weights in slots ``s0 ..`` of ``ws``, for tokens
    ``t0 .. t1 - 1``, to ``out[:, :t1 - t0]``: int8 rows in float32 (the tile's logits), int4 and
    int2 rows in int16 (:func:`_slot_weights`)."""
    chans, heads = _pass_channels(bits), range(hc)
    name = f"_pass{bits}_{hc}"
    lines = [f"def {name}(ws, g0, s0, c, r0, t0, t1, out):", "    last = c.shape[0] - 1"]
    lines += [f"    a{i} = c[min(r0 + {i}, last), t0:t1]" for i in range(_PASS_ROWS[bits])]
    for j in heads:
        lines.append(f"    l{j} = out[g0 + {j}, : t1 - t0]")
        lines += [f"    w{j}_{k} = ws[g0 + {j}, s0 + {k}]" if bits == 8 else f"    w{j}_{k} = np.int32(ws[g0 + {j}, s0 + {k}])"
                  for k in range(len(chans))]
    lines.append("    for t in range(t1 - t0):")
    lines += [f"        y{i} = np.int32(a{i}[t])" for i in range(_PASS_ROWS[bits])]
    for k, (i, left, right) in enumerate(chans):
        if left == 24:
            widened = f"y{i}" if right == 24 else f"(y{i} >> np.int32({right - 24}))"
        else:  # within the byte: its channel to the top, then down, so LLVM keeps the shifts in 16-bit lanes
            widened = f"(np.int32(np.int8(y{i} << np.int32({left - 24}))) >> np.int32({right - 24}))"
        lines.append(f"        x{k} = np.float32({widened})" if bits == 8 else f"        x{k} = np.int16({widened})")
    for j in heads:
        if bits == 8:
            lines.append(f"        l{j}[t] += " + " + ".join(f"w{j}_{k} * x{k}" for k in range(len(chans))))
        else:  # every partial sum fits in int16 (_slot_weights): the truncations wrap nothing
            lines.append(f"        l{j}[t] = np.int16(l{j}[t] + " + " + ".join(f"np.int16(w{j}_{k} * x{k})" for k in range(len(chans))) + ")")
    return "\n".join(lines) + "\n"


def _compile_pass(bits: int, hc: int):
    scope = {"np": np}
    exec(compile(_pass_source(bits, hc), f"<kvdrive logit pass int{bits} x{hc}>", "exec"), scope)  # noqa: S102 - our own template
    return numba.njit(nogil=True, fastmath=_LOWRANK_FASTMATH, error_model="numpy")(scope[f"_pass{bits}_{hc}"])


_pass8_1, _pass8_2, _pass8_3, _pass8_4 = (_compile_pass(8, hc) for hc in range(1, 5))
_pass4_1, _pass4_2, _pass4_3, _pass4_4 = (_compile_pass(4, hc) for hc in range(1, 5))
_pass2_1, _pass2_2, _pass2_3, _pass2_4 = (_compile_pass(2, hc) for hc in range(1, 5))


@numba.njit(nogil=True, cache=True, inline="always")
def _pass_slots(r_n, wide, narrow):  # pragma: no cover - compiled
    """(first int4 slot, first int2 slot, slots) of a layout: each kind's channels rounded up to whole passes."""
    rows4 = (r_n - wide - narrow + 1) // 2
    rows2 = (narrow + 3) // 4
    s4 = -(-wide // _PASS_ROWS8) * _PASS_ROWS8
    s2 = s4 + -(-rows4 // _PASS_ROWS4) * _PASS_ROWS4 * 2
    return s4, s2, s2 + -(-rows2 // _PASS_ROWS2) * _PASS_ROWS2 * 4


@numba.njit(nogil=True, cache=True)
def _slot_weights(w, wide, narrow, ws, wq, inv):  # pragma: no cover - compiled
    """``w`` ``[G, R]`` into the passes' slots (``[G, >= R + _SLOT_SPARE]``, zero where a pass has
    no channel): the int8 channels' into ``ws`` as they are, the int4 and int2 ones' into ``wq``
    as integers, ``w`` over ``inv[g]``, rounded.

    ``inv[g]`` is set so that no sum of a head's int4 and int2 terms can leave int16 (int4
    codes reach -8 and int2 ones -2; the rounding adds at most half a unit per channel): the
    int16 passes (:func:`_pass_source`) then compute those sums exactly, on twice as many
    tokens per vector instruction as float32. Rounding moves each weight by at most
    ``inv[g] / 2``, 1/64000 of the largest int4 and int2 sum the head can reach at Gemma 3's
    layout, so a logit by at most that times its codes' absolute sum; the rounding errors of
    many weights mostly cancel (on random codes at rank 108 the page scores moved by 3e-4
    on average). On Gemma 3 at 16K tokens the pages chosen were those of float32 weights
    but for rare near-ties (recall of the attention mass 0.56807 against 0.56813).
    """
    g_n, r_n = w.shape
    s4, s2, n = _pass_slots(r_n, wide, narrow)
    end4 = r_n - narrow
    room = np.float32(32767 - 8 * (end4 - wide) - 2 * narrow)  # int16's range less the roundings' worst case
    for g in range(g_n):
        ws[g, :n] = 0.0
        wq[g, :n] = 0
        for r in range(wide):
            ws[g, r] = w[g, r]
        bound = np.float32(0.0)
        for r in range(wide, r_n):
            bound += abs(w[g, r]) * (np.float32(8.0) if r < end4 else np.float32(2.0))
        if bound == 0 or room <= 0:  # no int4 or int2 weight (room runs out past 3000 channels: never)
            inv[g] = 0.0
            continue
        step = bound / room
        inv[g] = step
        for r in range(wide, end4):
            wq[g, s4 + r - wide] = np.int16(np.round(w[g, r] / step))
        for r in range(end4, r_n):
            wq[g, s2 + r - end4] = np.int16(np.round(w[g, r] / step))


@numba.njit(nogil=True, cache=True, inline="always")
def _passes(ws, wq, g0, hc, c, wide, rows4, rows2, s4, s2, t0, t1, logits, acc):  # pragma: no cover - compiled
    """Every pass of one tile for query heads ``g0 .. g0 + hc - 1`` (``hc`` <= 4): the int8 rows'
    terms added to ``logits``, the int4 and int2 rows' to ``acc`` (:func:`_slot_weights`)."""
    for r in range(0, wide, _PASS_ROWS8):
        if hc == 4:
            _pass8_4(ws, g0, r, c, r, t0, t1, logits)
        elif hc == 3:
            _pass8_3(ws, g0, r, c, r, t0, t1, logits)
        elif hc == 2:
            _pass8_2(ws, g0, r, c, r, t0, t1, logits)
        else:
            _pass8_1(ws, g0, r, c, r, t0, t1, logits)
    for i in range(0, rows4, _PASS_ROWS4):
        s, r = s4 + 2 * i, wide + i
        if hc == 4:
            _pass4_4(wq, g0, s, c, r, t0, t1, acc)
        elif hc == 3:
            _pass4_3(wq, g0, s, c, r, t0, t1, acc)
        elif hc == 2:
            _pass4_2(wq, g0, s, c, r, t0, t1, acc)
        else:
            _pass4_1(wq, g0, s, c, r, t0, t1, acc)
    for i in range(0, rows2, _PASS_ROWS2):
        s, r = s2 + 4 * i, wide + rows4 + i
        if hc == 4:
            _pass2_4(wq, g0, s, c, r, t0, t1, acc)
        elif hc == 3:
            _pass2_3(wq, g0, s, c, r, t0, t1, acc)
        elif hc == 2:
            _pass2_2(wq, g0, s, c, r, t0, t1, acc)
        else:
            _pass2_1(wq, g0, s, c, r, t0, t1, acc)


@numba.njit(nogil=True, cache=True, fastmath=_LOWRANK_FASTMATH, error_model="numpy")
def _passes_page_mass(w, codes, wide, narrow, vnni, valid, b, h, p_n, s_n, logits, ws, top, out):  # pragma: no cover - compiled
    """Estimated mass of pages [0, p_n) of (row b, head h) into ``out`` (callers take the log).
    With ``vnni`` (:func:`.lowrank_vnni.available` only) the int4 and int2 channels go by
    :func:`.lowrank_vnni._vnni_dot` instead of their passes.

    ``w`` ``[G, R]``: base-2 logit weights (:func:`.lowrank_mass._lowrank_weights`). ``codes``:
    rows as :func:`reference.pack_lowrank_codes` lays them out, the first ``wide`` channels
    int8, the last ``narrow`` int2, the others int4. Scratch: ``logits`` ``[G, >= p_n*S]``
    (a tile's worth is used), ``ws`` ``[G, R + _SLOT_SPARE]``; ``top`` is the fused layout's
    scratch, unused here.

    A tile of whole pages at a time: its logits by the passes (see _PASS_ROWS), then, while
    they are still in L1, each page's softmax weights summed against the tile's own max.
    The tiles' sums are brought to each head's overall max once all are done
    (:func:`_tile_sums_to_mass`). Summing after all the logits were written, as the fused
    layout does, wrote and read back 4 bytes a token and query head: 256 KiB a call at
    Gemma 3's 16K tokens, which the model's layers have pushed out of the caches by the
    next call.
    """
    g_n, r_n = w.shape
    t_n = p_n * s_n
    c = codes[b, h]
    ok = valid[b]
    rows4 = (r_n - wide - narrow + 1) // 2
    rows2 = (narrow + 3) // 4
    s4, s2, _ = _pass_slots(r_n, wide, narrow)
    tile = max(1, _PASS_TILE // s_n) * s_n  # whole pages
    n_tiles = -(-t_n // tile)
    wq = np.empty((g_n, r_n + _SLOT_SPARE), np.int16)
    acc = np.empty((g_n, tile), np.int16)
    inv = np.empty(g_n, np.float32)
    tmax = np.empty((g_n, n_tiles), np.float32)  # each tile's max logit per head
    tsum = np.empty((g_n, n_tiles), np.float32)  # its page sums' total
    psum = np.empty((g_n, p_n), np.float32)  # each page's sum against its tile's max
    _slot_weights(w, wide, narrow, ws, wq, inv)  # ws: the int8 passes' weights, whichever way the rest go
    v4, v2 = (4 * ((rows4 + 1) // 2), 4 * rows2) if vnni else (0, 0)  # the VNNI weights: none without it
    w4, w2 = np.empty((g_n, v4), np.int8), np.empty((g_n, v2), np.int8)
    sc = np.empty((g_n, 5 if vnni else 0), np.float32)
    if vnni:  # the int8 passes only, and no int16 sums to add
        if c.strides[1] != 1:
            raise ValueError("the VNNI logits read contiguous code rows")
        _vnni_weights(w, wide, narrow, w4, w2, sc)
        inv[:] = 0.0
        acc[:] = 0
    for i in range(n_tiles):
        t0 = i * tile
        t1 = min(t_n, t0 + tile)
        n = t1 - t0
        logits[:, :n] = 0.0
        if not vnni:
            acc[:, :n] = 0
        g0 = 0
        while g0 < g_n:
            hc = min(4, g_n - g0)
            if vnni:
                _passes(ws, wq, g0, hc, c, wide, 0, 0, s4, s2, t0, t1, logits, acc)
                _vnni_dot(hc, c, wide, rows4, rows2, w4, w2, sc, g0, t0, t1, logits)
            else:
                _passes(ws, wq, g0, hc, c, wide, rows4, rows2, s4, s2, t0, t1, logits, acc)
            g0 += hc
        okt = ok[t0:t1]
        for g in range(g_n):
            lg = logits[g, :n]
            iq = acc[g]
            step = inv[g]
            m = np.float32(-np.inf)
            for t in range(n):  # the int16 sums, padding to -inf and the tile's max, in one vectorised pass
                v = lg[t] + np.float32(iq[t]) * step if okt[t] else np.float32(-np.inf)
                lg[t] = v
                m = _fmax(m, v)
            tmax[g, i] = m
            if m == -np.inf:  # a tile of padding
                psum[g, t0 // s_n : t1 // s_n] = 0.0
                tsum[g, i] = 0.0
            else:
                tsum[g, i] = _weight_sums(lg, m, n // s_n, s_n, psum[g, t0 // s_n :])
    _tile_sums_to_mass(psum, tmax, tsum, tile // s_n, p_n, out)


@numba.njit(nogil=True, cache=True, fastmath=_LOWRANK_FASTMATH, error_model="numpy")
def _tile_sums_to_mass(psum, tmax, tsum, per_tile, p_n, out):  # pragma: no cover - compiled
    """Pages' masses summed over the query heads into ``out``, from their sums against their
    tile's max (``psum`` ``[G, P]``, ``tmax`` and ``tsum`` ``[G, tiles]``): each tile's sums
    scaled by 2**(its max - the head's max), over the head's total. Validity is per token, so
    either every head has a finite max or none.

    A page whose share would fall below float32's smallest normal number counts as none, as
    a token does in a single pass (:func:`.common._exp2_nonpos`): nothing here computes with
    subnormals, which cost a microcode assist each (a call of wide logits took 2.5 times as long).
    """
    g_n, n_tiles = tmax.shape
    out[:p_n] = 0.0
    tiny = np.float32(1.1754944e-38)
    for g in range(g_n):
        m = np.float32(-np.inf)
        for i in range(n_tiles):
            m = _fmax(m, tmax[g, i])
        if m == -np.inf:
            continue
        total = np.float32(0.0)
        for i in range(n_tiles):  # a tile of padding, or one 2**126 below the max, counts 0
            d = tmax[g, i] - m
            tmax[g, i] = np.exp2(d) if d >= -126 else np.float32(0.0)
            total += tmax[g, i] * tsum[g, i]
        for i in range(n_tiles):
            f = tmax[g, i] / total
            if f < tiny:
                continue
            floor = tiny / f  # a page's sum below it would give a subnormal share
            for p in range(i * per_tile, min(p_n, (i + 1) * per_tile)):
                v = psum[g, p]
                if v >= floor:
                    out[p] += v * f
