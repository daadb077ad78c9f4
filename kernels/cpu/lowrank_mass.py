"""The compiled parts of low-rank page scoring that every code layout shares: the query's
logit weights, the page sums of the softmax over a head's logits, and the top-k pick.

How a layout's logits are computed is in :mod:`.lowrank_fused` (the default layout at head
dim 64) and :mod:`.lowrank_passes` (every other layout); :mod:`.lowrank` holds the compiled
entry points, one per kind of layout, and their Python wrappers.
"""

from __future__ import annotations

import numba
import numpy as np

from kvdrive.kernels.cpu.common import _LOWRANK_FASTMATH, _exp2_nonpos, _nth_unused, _to_float
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says

_PAGE16 = 16  # the common page size, given a loop of constant length
_LOG2E = np.float32(1.4426950408889634)


@numba.njit(nogil=True, cache=True, fastmath=_LOWRANK_FASTMATH)
def _lowrank_weights(query, qproj, scale, scaling, b, h, w):  # pragma: no cover - compiled
    """w[g, r] = (query[b, h, g] @ qproj[b, h])[r] * scale[b, h, r] * scaling * log2(e): base-2 logit weights.

    ``qproj``: float32, or fp16 bits (uint16), widened here."""
    g_n, d_n = query.shape[2], query.shape[3]
    r_n = qproj.shape[3]
    for g in range(g_n):
        for r in range(r_n):
            w[g, r] = 0.0
        for d in range(d_n):
            qd = query[b, h, g, d]
            for r in range(r_n):
                w[g, r] += qd * _to_float(qproj[b, h, d, r])
        for r in range(r_n):
            w[g, r] *= scale[b, h, r] * scaling * _LOG2E


@numba.njit(nogil=True, cache=True, inline="always", fastmath=_LOWRANK_FASTMATH, error_model="numpy")
def _weight_sums(lg, m, pages, s_n, sums):  # pragma: no cover - compiled
    """Each of ``pages`` pages' softmax weights summed against a finite ``m``, from base-2 logits
    ``lg`` (-inf: padding) into ``sums`` (which may be ``lg``: page p's sum is written after its
    tokens, from token p * s_n on, are read); returns their total."""
    total = np.float32(0.0)
    if s_n == _PAGE16:  # a fixed-length inner loop: one vector sum per page
        for p in range(pages):
            base = p * _PAGE16
            part = np.float32(0.0)
            for j in range(_PAGE16):
                part += _exp2_nonpos(lg[base + j] - m)
            sums[p] = part
            total += part
    else:
        for p in range(pages):
            part = np.float32(0.0)
            for t in range(p * s_n, (p + 1) * s_n):
                part += _exp2_nonpos(lg[t] - m)
            sums[p] = part
            total += part
    return total


@numba.njit(nogil=True, cache=True, inline="always", fastmath=_LOWRANK_FASTMATH, error_model="numpy")
def _page_sums(logits, top, g_n, p_n, s_n, out):  # pragma: no cover - compiled
    """Estimated mass of pages [0, p_n) into ``out`` (callers take the log), from each query
    head's base-2 logits ``logits[g, :p_n*S]`` (-inf: padding) and their maxima ``top[g]``.

    Each query head's softmax weights summed per page, in one pass over its logits (the
    page sums overwrite the row's first p_n entries, whose tokens are read by then), then
    the heads' page sums added with their normalisers. Validity is per token, so either
    every head has a finite max or none.
    """
    if p_n * s_n == 0 or top[0] == -np.inf:
        out[:p_n] = 0.0
        return
    for g in range(g_n):
        lg = logits[g]
        top[g] = np.float32(1.0) / _weight_sums(lg, top[g], p_n, s_n, lg)  # top now holds each head's normaliser
    inv0 = top[0]
    first = logits[0]
    for p in range(p_n):
        out[p] = first[p] * inv0
    for g in range(1, g_n):
        lg = logits[g]
        inv = top[g]
        for p in range(p_n):
            out[p] += lg[p] * inv


@numba.njit(nogil=True, cache=True, inline="always")
def _log_mass(m):  # pragma: no cover - compiled
    """A page's score: the log of its estimated mass, -inf for none."""
    return np.log(m) if m > 0 else np.float32(-np.inf)


@numba.njit(nogil=True, cache=True)
def _lowrank_top(score, sel, k, p_n, pages, mass, cand):  # pragma: no cover - compiled
    """The ``k`` pages of ``sel`` with the highest ``score`` (their masses), best first, into
    ``pages`` and ``mass``; returns how many there are (fewer where fewer are selectable).

    The k-th largest by partition, then the pages above it and as many equal to it as fit,
    in page order, then a stable sort of those k: equal scores keep the lower page first.
    (An insertion into a sorted list costs up to k moves a page where scores rise with
    position, as they often do.) ``cand``: scratch ``[>= p_n]``.
    """
    m = 0
    for p in range(p_n):
        if sel[p]:
            cand[m] = score[p]
            m += 1
    n = 0
    if m > 0 and k > 0:
        cut = max(m - k, 0)
        kth = np.partition(cand[:m], cut)[cut]
        for p in range(p_n):
            if sel[p] and score[p] > kth:
                pages[n] = p
                n += 1
        for p in range(p_n):
            if n == k or n == m:
                break
            if sel[p] and score[p] == kth:
                pages[n] = p
                n += 1
        for i in range(n):  # insertion sort of the k, stable
            p = pages[i]
            v = score[p]
            j = i
            while j > 0 and v > mass[j - 1]:
                mass[j] = mass[j - 1]
                pages[j] = pages[j - 1]
                j -= 1
            mass[j] = v
            pages[j] = p
    return n


@numba.njit(nogil=True, cache=True, inline="always")
def _choose(score, b, h, selectable, k, p_n, sink, unscored, out_pages, out_scores, cached,
            cached_scores, cand):  # pragma: no cover - compiled
    """(row b, head h)'s picks from its page masses ``score``: ``out_pages[b, h]`` is the row's
    ``sink`` pages then its top ``k`` (their log masses in ``out_scores[b, h]``), and the
    cached pages' log masses into ``cached_scores[b, h]`` (see ``_lowrank_select_*`` in :mod:`.lowrank`)."""
    s = sink.shape[1]
    row = out_pages[b, h]
    for i in range(s):
        row[i] = sink[b, i]
    picks, picked = row[s:], out_scores[b, h]
    n = _lowrank_top(score, selectable[b], k, p_n, picks, picked, cand)
    for i in range(n):
        picked[i] = _log_mass(picked[i])
        if unscored and picked[i] == -np.inf:
            picks[i] = -1
    for i in range(n, k):  # fewer selectable pages than k
        picks[i] = -1 if unscored else _nth_unused(out_pages, b, h, i, p_n)
        picked[i] = -np.inf
    for i in range(cached.shape[2]):
        p = cached[b, h, i]
        cached_scores[b, h, i] = -np.inf if p < 0 or p >= p_n else _log_mass(score[p])
