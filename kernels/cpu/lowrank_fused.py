"""Low-rank logits for the default code layout at head dim 64, by a fused pass written out
per chunk of query heads (the other layouts' passes are in :mod:`.lowrank_passes`)."""

from __future__ import annotations

import numba
import numpy as np

from kvdrive.kernels.cpu.common import _LOWRANK_FASTMATH, _fmax
from kvdrive.kernels.cpu.lowrank_mass import _page_sums
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says

# The default code layout at head dim 64 (rank 27: 1 int8 channel, 14 int4, 12 int2; 11
# rows) has a fused logit pass: each token's codes are widened once, in registers, and
# every query head of a chunk of up to 4 takes its logit from them in the same loop
# iteration, with the padding and the running max. No float tile is written and read
# back per head. Narrow codes are sign-extended by a shift left and an arithmetic shift
# right (two integer ops a channel, not four; the passes of lowrank_passes.py do the same). (At a
# 7K context, one layer of SmolLM2, 3 KV heads of 3 query heads each, selected its top 28
# pages in about 150 us here, against 195 with mask-and-xor unpacking and 220 for the
# rank-22 all-int4 layout, tiled.)
# The loop body has to be straight-line code for the vectorizer, so it is written out
# per chunk size from the template below.
_FUSED_RANK, _FUSED_WIDE, _FUSED_NARROW, _FUSED_CHUNK = 27, 1, 12, 4
def _fused_logits_source(hc: int) -> str:
    """Source of ``_fused_logits_<hc>(w, g0, c, ok, t_n, logits, top)``: query heads ``g0 .. g0 + hc - 1``."""
    heads, chans = range(hc), range(_FUSED_RANK)
    lines = [f"def _fused_logits_{hc}(w, g0, c, ok, t_n, logits, top):"]
    for j in heads:
        lines.append("    " + ", ".join(f"w{j}_{r}" for r in chans) + " = "
                     + ", ".join(f"w[g0 + {j}, {r}]" for r in chans))
        lines += [f"    l{j} = logits[g0 + {j}]", f"    m{j} = np.float32(-np.inf)"]
    n4 = _FUSED_RANK - _FUSED_WIDE - _FUSED_NARROW
    assert n4 % 2 == 0 and _FUSED_NARROW % 4 == 0, "the fused layout fills its rows"
    rows4 = _FUSED_WIDE + n4 // 2
    rows = rows4 + _FUSED_NARROW // 4
    lines.append("    " + ", ".join(f"c{i}" for i in range(rows)) + " = " + ", ".join(f"c[{i}]" for i in range(rows)))
    lines.append("    for t in range(t_n):")
    lines += [f"        x{r} = np.float32(c{r}[t])" for r in range(_FUSED_WIDE)]
    for i in range(_FUSED_WIDE, rows4):  # two int4 channels per row: low nibble, then high
        lo = _FUSED_WIDE + 2 * (i - _FUSED_WIDE)
        lines += [f"        y{i} = np.int32(c{i}[t])",
                  f"        x{lo} = np.float32(np.int32(y{i} << np.int32(28)) >> np.int32(28))",
                  f"        x{lo + 1} = np.float32(y{i} >> np.int32(4))"]
    for i in range(rows4, rows):  # four int2 channels per row, from the lowest bits up
        first = _FUSED_WIDE + n4 + 4 * (i - rows4)
        lines.append(f"        y{i} = np.int32(c{i}[t])")
        lines += [f"        x{first + j} = np.float32(np.int32(y{i} << np.int32({30 - 2 * j})) >> np.int32(30))"
                  for j in range(3)]
        lines.append(f"        x{first + 3} = np.float32(y{i} >> np.int32(6))")
    for j in heads:
        lines.append(f"        v{j} = " + " + ".join(f"w{j}_{r} * x{r}" for r in chans))
    lines.append("        if not ok[t]:")
    lines += [f"            v{j} = np.float32(-np.inf)" for j in heads]
    for j in heads:
        lines += [f"        l{j}[t] = v{j}", f"        m{j} = _fmax(m{j}, v{j})"]
    lines += [f"    top[g0 + {j}] = m{j}" for j in heads]
    return "\n".join(lines) + "\n"


def _compile_fused_logits(hc: int):
    scope = {"np": np, "_fmax": _fmax}
    exec(compile(_fused_logits_source(hc), f"<kvdrive fused logits x{hc}>", "exec"), scope)  # noqa: S102 - our own template
    return numba.njit(nogil=True, fastmath=_LOWRANK_FASTMATH, error_model="numpy")(scope[f"_fused_logits_{hc}"])


_fused_logits_1, _fused_logits_2, _fused_logits_3, _fused_logits_4 = (_compile_fused_logits(hc) for hc in range(1, 5))


def is_fused(rank: int, wide: int, narrow: int) -> bool:
    """Whether a layout of ``rank`` channels, the first ``wide`` int8 and the last ``narrow``
    int2, is the fused one (:func:`_fused_page_mass`); every other goes by the passes."""
    return rank == _FUSED_RANK and wide == _FUSED_WIDE and narrow == _FUSED_NARROW


@numba.njit(nogil=True, cache=True, fastmath=_LOWRANK_FASTMATH, error_model="numpy")
def _fused_page_mass(w, codes, valid, b, h, p_n, s_n, logits, top, out):  # pragma: no cover - compiled
    """Estimated mass of pages [0, p_n) of (row b, head h) into ``out`` (callers take the log),
    for the fused layout only (:func:`is_fused`).

    ``w`` ``[G, R]``: base-2 logit weights (:func:`.lowrank_mass._lowrank_weights`). ``codes``:
    rows as :func:`reference.pack_lowrank_codes` lays them out. Scratch: ``logits``
    ``[G, >= p_n*S]``, ``top`` ``[G]``.
    """
    g_n = w.shape[0]
    t_n = p_n * s_n
    c = codes[b, h]
    ok = valid[b]
    top[:] = -np.inf
    g0 = 0
    while g0 < g_n:
        hc = min(_FUSED_CHUNK, g_n - g0)
        if hc == 4:
            _fused_logits_4(w, g0, c, ok, t_n, logits, top)
        elif hc == 3:
            _fused_logits_3(w, g0, c, ok, t_n, logits, top)
        elif hc == 2:
            _fused_logits_2(w, g0, c, ok, t_n, logits, top)
        else:
            _fused_logits_1(w, g0, c, ok, t_n, logits, top)
        g0 += hc
    _page_sums(logits, top, g_n, p_n, s_n, out)
