"""Sparse decode attention straight from the device cache's slots and the local window,
optionally in two calls over disjoint parts of the token set (:class:`PartialAttention`)."""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvdrive.kernels.cpu.common import _ATTENTION_FASTMATH, BFLOAT16, FLOAT16, FLOAT32, _fmax, _widen
from kvdrive.kernels.cpu.threads import _cut, _in_parts
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says


@numba.njit(nogil=True, cache=True, inline="always")
def _block(j, b, h, slots, cache, local, kind, block):  # pragma: no cover - compiled
    """Widen block ``j`` of (row b, head h) into ``block``: selected page j, or (j == k) the local window.

    Returns (its first token's index among the attended tokens, its token count; 0 for an empty slot).
    """
    k_n, s_n, d_n = slots.shape[2], cache.shape[3], cache.shape[4]
    if j < k_n:
        slot = slots[b, h, j]
        if slot < 0:
            return j * s_n, 0
        _widen(cache[b, h, slot].reshape(s_n * d_n), kind, block[: s_n * d_n])
        return j * s_n, s_n
    l_n = local.shape[2]
    if l_n:
        _widen(local[b, h].reshape(l_n * d_n), kind, block[: l_n * d_n])
    return k_n * s_n, l_n


# Attention parts: (attended token, query head, dim) products, about 0.2 ms of kernel time
# here. One row of SmolLM2 at 7K tokens (3 KV heads) stays one call: split, it measured no faster.
_ATTENTION_PART_MIN_WORK = 1 << 18


@numba.njit(nogil=True, cache=True, fastmath=_ATTENTION_FASTMATH, error_model="numpy")
def _sparse_attention(query, kc, vc, slots, lk, lv, valid, kind, scaling, out, lse, merge):  # pragma: no cover - compiled
    b_n, h_n, g_n, d_n = query.shape
    k_n = slots.shape[2]
    s_n = kc.shape[3]
    l_n = lk.shape[2]
    block = np.empty(max(s_n, l_n) * d_n, np.float32)
    logits = np.empty((g_n, k_n * s_n + l_n), np.float32)  # the attended tokens' logits, packed
    acc = np.empty((g_n, d_n), np.float32)
    q = np.empty((g_n, d_n), np.float32)
    part_lse = np.empty(g_n, np.float32)  # this call's log-sum-exp per query head
    weight = np.empty(g_n, np.float32)  # the weight of this call's values in the result
    for b in range(b_n):
        for h in range(h_n):
            for g in range(g_n):
                for d in range(d_n):
                    q[g, d] = query[b, h, g, d] * scaling
            # Pass 1: the logits of every valid token, a page (or the local window) at a time.
            c = 0
            for j in range(k_n + 1):
                first, count = _block(j, b, h, slots, kc, lk, kind, block)
                for t in range(count):
                    if not valid[b, h, first + t]:
                        continue
                    base = t * d_n
                    for g in range(g_n):
                        dot = np.float32(0.0)
                        for d in range(d_n):
                            dot += q[g, d] * block[base + d]
                        logits[g, c] = dot
                    c += 1
            # Softmax per query head over the c valid tokens, in place.
            for g in range(g_n):
                top = np.float32(-np.inf)
                for n in range(c):
                    top = _fmax(top, logits[g, n])
                total = np.float32(0.0)
                for n in range(c):
                    e = np.exp(logits[g, n] - top)
                    logits[g, n] = e
                    total += e
                inv = np.float32(1.0) / total if c else np.float32(0.0)
                for n in range(c):
                    logits[g, n] *= inv
                part_lse[g] = top + np.log(total) if c else -np.inf
            for g in range(g_n):
                weight[g] = 1.0
                if not merge:
                    lse[b, h, g] = part_lse[g]
                    continue
                # Merge with the partial result already in out/lse: weights from the two log-sum-exps.
                before = lse[b, h, g]
                both = _fmax(before, part_lse[g])
                if both == -np.inf:
                    weight[g] = 0.0  # neither call attended anything: out stays zeros
                    continue
                w_before = np.exp(before - both)
                w_here = np.exp(part_lse[g] - both)
                total = w_before + w_here
                lse[b, h, g] = both + np.log(total)
                for d in range(d_n):
                    out[b, h, g, d] *= w_before / total
                weight[g] = w_here / total
            # Pass 2: the probability-weighted sum of the values, over the same tokens in the same order.
            acc[:, :] = 0.0
            c = 0
            for j in range(k_n + 1):
                first, count = _block(j, b, h, slots, vc, lv, kind, block)
                for t in range(count):
                    if not valid[b, h, first + t]:
                        continue
                    base = t * d_n
                    for g in range(g_n):
                        p = logits[g, c]
                        for d in range(d_n):
                            acc[g, d] += p * block[base + d]
                    c += 1
            for g in range(g_n):
                if merge:
                    for d in range(d_n):
                        out[b, h, g, d] += weight[g] * acc[g, d]
                else:
                    for d in range(d_n):
                        out[b, h, g, d] = acc[g, d]


def _as_numpy(t: torch.Tensor) -> tuple[np.ndarray, int]:
    if t.dtype == torch.float32:
        return t.numpy(), FLOAT32
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy().view(np.uint16), FLOAT16 if t.dtype == torch.float16 else BFLOAT16
    raise TypeError(f"sparse_attention reads float32, float16 or bfloat16 K/V, got {t.dtype}")


def sparse_attention(query: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                     local_k: torch.Tensor, local_v: torch.Tensor, valid: torch.Tensor, scaling: float,
                     partial: "PartialAttention | None" = None) -> torch.Tensor:
    """Decode attention straight from cache slots: no gathered copy of K and V.

    query ``[B, H, G, D]``; ``cache_k``/``cache_v`` ``[B, H, C, S, D]`` slots;
    ``slots`` ``[B, H, k]`` (-1: no page); ``local_k``/``local_v`` ``[B, H, L, D]``;
    ``valid`` ``[B, H, >= k*S + L]`` for the tokens in that order (selected pages, then
    the local window). K/V may be float32, float16 or bfloat16 (read in float32).
    Returns float32 ``[B, H, G, D]``; equals ``reference.decode_attention`` over
    the gathered tokens. A large call runs in parts on up to :func:`kernel_threads`
    threads (:func:`_in_parts`).

    Attention over a token set can be taken in two calls over disjoint parts of it
    (the pages in the cache now, then the pages being fetched): pass the same
    :class:`PartialAttention` to both. The first call fills it; the second adds its
    tokens through the two parts' log-sum-exps, and its result is the attention
    over both parts.
    """
    kc, kind = _as_numpy(cache_k.contiguous())
    vc, _ = _as_numpy(cache_v.contiguous())
    lk, lkind = _as_numpy(local_k.contiguous())
    lv, _ = _as_numpy(local_v.contiguous())
    if lkind != kind:
        raise TypeError(f"cache ({cache_k.dtype}) and local window ({local_k.dtype}) differ in dtype")
    q = query.detach().to(torch.float32).contiguous().numpy()
    sl, ok = slots.contiguous().numpy(), valid.contiguous().numpy()
    b, h, g, d = q.shape
    if ok.shape[2] < sl.shape[2] * kc.shape[3] + lk.shape[2]:
        raise ValueError(f"valid covers {ok.shape[2]} tokens, the pages and local window {sl.shape[2] * kc.shape[3] + lk.shape[2]}")
    merge = partial is not None and partial.filled
    if partial is None:
        out, lse = np.empty(q.shape, np.float32), np.empty((b, h, g), np.float32)
    else:
        if partial.out is None:
            partial.out, partial.lse = np.empty(q.shape, np.float32), np.empty((b, h, g), np.float32)
        elif partial.out.shape != q.shape:
            raise ValueError(f"partial attention holds {partial.out.shape}, this query is {q.shape}")
        out, lse = partial.out, partial.lse
    scaling = np.float32(scaling)

    def part(bs, hs):
        q_, kc_, vc_, sl_, lk_, lv_, ok_, out_, lse_ = _cut((q, kc, vc, sl, lk, lv, ok, out, lse), bs, hs)
        _sparse_attention(q_, kc_, vc_, sl_, lk_, lv_, ok_, kind, scaling, out_, lse_, merge)

    _in_parts(b, h, ok.shape[2] * g * d, part, _ATTENTION_PART_MIN_WORK)
    if partial is not None:
        partial.filled = True
    return torch.from_numpy(out)


class PartialAttention:
    """Attention over part of a token set, to be completed by a second
    :func:`sparse_attention` call over the rest: the normalised output and each
    query head's log-sum-exp (-inf where nothing was attended)."""

    def __init__(self) -> None:
        self.out: np.ndarray | None = None
        self.lse: np.ndarray | None = None
        self.filled = False
