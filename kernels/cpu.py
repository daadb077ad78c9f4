"""numba kernels for the CPU, each tested against its torch reference (``reference.py``, or
for the cache placement :meth:`kvdrive_client.device_cache.DeviceCache._place_torch`)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numba
from numba.core import types
from llvmlite import ir
from numba.extending import intrinsic, overload
import numpy as np
import torch

from kvdrive.kernels import jit
from kvdrive.kernels import reference as ref

# Before the first kernel below is compiled or loaded from the cache.
VECTOR_WIDTH = jit.configure()


@numba.njit(nogil=True, cache=True, inline="always", fastmath=True)
def _page_score(query, q8, scale, b, h, p):  # pragma: no cover - compiled
    """max over the query heads of q . mean(page), the mean stored as int8 x scale."""
    best = np.float32(-np.inf)
    for g in range(query.shape[2]):
        acc = np.float32(0.0)  # float32 throughout: a float64 sum halves the vector width
        for d in range(query.shape[3]):
            acc += query[b, h, g, d] * np.float32(q8[b, h, p, d])
        if acc > best:
            best = acc
    return best * scale[b, h, p]


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


@numba.njit(nogil=True, cache=True, fastmath=True)
def _hierarchical_select(query, centroids, assign, q8, scale, selectable, k, candidates, out_pages, out_scores,
                         cached, cached_scores, p_n):  # pragma: no cover - compiled
    b_n, h_n, g_n, d_n = query.shape
    c_n = centroids.shape[2]
    neg = -np.inf
    cand = np.empty(p_n, np.int64)
    cscores = np.empty(p_n, np.float32)
    for b in range(b_n):
        for h in range(h_n):
            sizes = np.zeros(c_n, np.int64)
            for p in range(p_n):
                if selectable[b, p]:
                    sizes[assign[b, h, p]] += 1
            cscore = np.empty(c_n, np.float32)
            for c in range(c_n):
                best = neg
                if sizes[c] > 0:
                    for g in range(g_n):
                        acc = np.float32(0.0)
                        for d in range(d_n):
                            acc += query[b, h, g, d] * centroids[b, h, c, d]
                        if acc > best:
                            best = acc
                cscore[c] = best
            order = np.argsort(-cscore)
            take = np.zeros(c_n, np.bool_)
            before = 0
            for i in range(c_n):
                c = order[i]
                if before >= candidates or sizes[c] == 0:
                    break
                take[c] = True
                before += sizes[c]
            # Score only the candidates, and sort only them: pages in page order, so ties
            # between equal scores go to the lower page as a full argsort would.
            n_c = 0
            for p in range(p_n):
                if selectable[b, p] and take[assign[b, h, p]]:
                    cand[n_c] = p
                    cscores[n_c] = -_page_score(query, q8, scale, b, h, p)
                    n_c += 1
            top = np.argsort(cscores[:n_c], kind="mergesort")
            for i in range(k):
                if i < n_c:
                    out_pages[b, h, i] = cand[top[i]]
                    out_scores[b, h, i] = -cscores[top[i]]
                else:  # fewer candidates than k: the rest are unselectable pages, scored -inf
                    out_pages[b, h, i] = _nth_unused(out_pages, b, h, i, p_n)
                    out_scores[b, h, i] = neg
            # Current scores of the cached pages, for lookahead eviction (-1: empty slot).
            for i in range(cached.shape[2]):
                p = cached[b, h, i]
                cached_scores[b, h, i] = neg if p < 0 or p >= p_n else _page_score(query, q8, scale, b, h, p)


def hierarchical_select(query: torch.Tensor, centroids: torch.Tensor, assign: torch.Tensor, q8: torch.Tensor,
                        scale: torch.Tensor, selectable: torch.Tensor, k: int, candidates: int,
                        cached: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fused two-level selection over int8 page means (one pass per (batch, head), no temporaries).

    Same contract as :func:`kvdrive.kernels.reference.hierarchical_select`, with the
    page means given as int8 ``q8`` times a per-page ``scale`` (float32). With
    ``cached`` (``[B, H, n]`` pages, -1 none) it also returns their current scores,
    so lookahead eviction costs no second call.
    """
    b, h = assign.shape[:2]
    # The index's arrays may have spare capacity past the pages in use: the selectable
    # mask's length says how many pages there are, so no slice needs a copy.
    num_pages = selectable.shape[1]
    k = min(k, num_pages)
    pages = np.empty((b, h, k), np.int64)
    scores = np.empty((b, h, k), np.float32)
    cached_np = np.full((b, h, 0), -1, np.int64) if cached is None else cached.numpy()
    cached_scores = np.empty(cached_np.shape, np.float32)
    _hierarchical_select(
        query.detach().float().numpy(), centroids.detach().float().numpy(), assign.numpy(), q8.numpy(),
        scale.numpy(), selectable.numpy(), k, candidates, pages, scores, cached_np, cached_scores, num_pages,
    )
    return torch.from_numpy(pages), torch.from_numpy(scores), None if cached is None else torch.from_numpy(cached_scores)


# ---------------------------------------------------------------- sparse decode attention

# Storage kinds of the cached K/V the attention kernel reads (half kinds are passed as uint16 bits).
FLOAT32, FLOAT16, BFLOAT16 = 0, 1, 2


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

# Fast-math without "no infinities": -inf marks masked logits.
_ATTENTION_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


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


# ---------------------------------------------------------------- low-rank page scores


@intrinsic
def _bits_to_float(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


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


_PAGE16 = 16  # the common page size, given a loop of constant length
_LOG2E = np.float32(1.4426950408889634)
# Logits here come from int8 codes and finite queries: never NaN (-inf marks padding), so
# "no NaNs" is safe and lets the max reductions vectorise.
_LOWRANK_FASTMATH = _ATTENTION_FASTMATH | {"nnan"}


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


# The default code layout at head dim 64 (rank 27: 1 int8 channel, 14 int4, 12 int2; 11
# rows) has a fused logit pass: each token's codes are widened once, in registers, and
# every query head of a chunk of up to 4 takes its logit from them in the same loop
# iteration, with the padding and the running max. No float tile is written and read
# back per head. Narrow codes are sign-extended by a shift left and an arithmetic shift
# right (two integer ops a channel, not four; the passes below do the same). (At a
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
# int16 ones.)
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
    ``t0 .. t1 - 1``: int8 rows in float32 to ``out[:, t0:t1]`` (the logits), int4 and int2
    rows in int16 to ``out[:, :t1 - t0]`` (:func:`_slot_weights`)."""
    chans, heads = _pass_channels(bits), range(hc)
    name = f"_pass{bits}_{hc}"
    lines = [f"def {name}(ws, g0, s0, c, r0, t0, t1, out):", "    last = c.shape[0] - 1"]
    lines += [f"    a{i} = c[min(r0 + {i}, last), t0:t1]" for i in range(_PASS_ROWS[bits])]
    for j in heads:
        lines.append(f"    l{j} = out[g0 + {j}, t0:t1]" if bits == 8 else f"    l{j} = out[g0 + {j}, : t1 - t0]")
        lines += [f"    w{j}_{k} = ws[g0 + {j}, s0 + {k}]" if bits == 8 else f"    w{j}_{k} = np.int32(ws[g0 + {j}, s0 + {k}])"
                  for k in range(len(chans))]
    lines.append("    for t in range(t1 - t0):")
    lines += [f"        y{i} = np.int32(a{i}[t])" for i in range(_PASS_ROWS[bits])]
    for k, (i, left, right) in enumerate(chans):
        widened = f"y{i}" if left == 24 and right == 24 else (
            f"(y{i} >> np.int32({right - 24}))" if left == 24 else f"(np.int32(y{i} << np.int32({left})) >> np.int32({right}))")
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
def _lowrank_page_mass(w, codes, wide, narrow, valid, b, h, p_n, s_n, logits, ws, top, out):  # pragma: no cover - compiled
    """Estimated mass of pages [0, p_n) of (row b, head h) into ``out`` (callers take the log).

    ``w`` ``[G, R]``: base-2 logit weights (:func:`_lowrank_weights`). ``codes``: rows as
    :func:`reference.pack_lowrank_codes` lays them out, the first ``wide`` channels int8,
    the last ``narrow`` int2, the others int4. Scratch: ``logits`` ``[G, >= p_n*S]``,
    ``ws`` ``[G, R + _SLOT_SPARE]``, ``top`` ``[G]``.
    """
    g_n, r_n = w.shape
    t_n = p_n * s_n
    c = codes[b, h]
    ok = valid[b]
    top[:] = -np.inf
    if r_n == _FUSED_RANK and wide == _FUSED_WIDE and narrow == _FUSED_NARROW:
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
        first_tile = t_n  # nothing left for the passes below
        rows4 = rows2 = s4 = s2 = 0
        wq = acc = np.empty((0, 0), np.int16)
        inv = top
    else:
        first_tile = 0
        rows4 = (r_n - wide - narrow + 1) // 2
        rows2 = (narrow + 3) // 4
        s4, s2, _ = _pass_slots(r_n, wide, narrow)
        wq = np.empty((g_n, r_n + _SLOT_SPARE), np.int16)
        acc = np.empty((g_n, _PASS_TILE), np.int16)
        inv = np.empty(g_n, np.float32)
        _slot_weights(w, wide, narrow, ws, wq, inv)
    # Other layouts: the logits a tile at a time, by passes over a few code rows each (see _PASS_ROWS).
    for t0 in range(first_tile, t_n, _PASS_TILE):
        t1 = min(t_n, t0 + _PASS_TILE)
        n = t1 - t0
        logits[:, t0:t1] = 0.0
        acc[:, :n] = 0
        g0 = 0
        while g0 < g_n:
            hc = min(4, g_n - g0)
            _passes(ws, wq, g0, hc, c, wide, rows4, rows2, s4, s2, t0, t1, logits, acc)
            g0 += hc
        okt = ok[t0:t1]
        for g in range(g_n):
            lg = logits[g, t0:t1]
            iq = acc[g]
            step = inv[g]
            m = top[g]
            for t in range(n):  # the int16 sums, padding to -inf and the running max, in one vectorised pass
                v = lg[t] + np.float32(iq[t]) * step if okt[t] else np.float32(-np.inf)
                lg[t] = v
                m = _fmax(m, v)
            top[g] = m
    # Each query head's softmax weights summed per page, in one pass over its logits
    # (the page sums overwrite the row's first p_n entries, whose tokens are read by
    # then), then the heads' page sums added with their normalisers. Validity is per
    # token, so either every head has a finite max or none.
    if t_n == 0 or top[0] == -np.inf:
        out[:p_n] = 0.0
        return
    for g in range(g_n):
        m = top[g]
        lg = logits[g]
        total = np.float32(0.0)
        if s_n == _PAGE16:  # a fixed-length inner loop: one vector sum per page
            for p in range(p_n):
                base = p * _PAGE16
                part = np.float32(0.0)
                for j in range(_PAGE16):
                    part += _exp2_nonpos(lg[base + j] - m)
                lg[p] = part
                total += part
        else:
            for p in range(p_n):
                part = np.float32(0.0)
                for t in range(p * s_n, (p + 1) * s_n):
                    part += _exp2_nonpos(lg[t] - m)
                lg[p] = part
                total += part
        top[g] = np.float32(1.0) / total  # top now holds each head's normaliser
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
def _lowrank_scores(query, qproj, scale, scaling, codes, wide, narrow, valid, p_n, s_n, out, w, logits, ws,
                    top):  # pragma: no cover - compiled
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            _lowrank_weights(query, qproj, scale, scaling, b, h, w)
            _lowrank_page_mass(w, codes, wide, narrow, valid, b, h, p_n, s_n, logits, ws, top, out[b, h])
            for p in range(p_n):
                out[b, h, p] = _log_mass(out[b, h, p])


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


@numba.njit(nogil=True, cache=True)
def _lowrank_select(query, qproj, scale, scaling, codes, wide, narrow, valid, selectable, k, p_n, s_n, sink, unscored,
                    out_pages, out_scores, cached, cached_scores, w, logits, ws, top, score, cand):  # pragma: no cover - compiled
    """Per (row, head): ``out_pages`` ``[B, H, s + k]`` is the row's ``sink`` pages ``[B, s]`` then its
    top ``k`` by mass (:func:`_lowrank_top`; their log masses in ``out_scores`` ``[B, H, k]``, the
    log taken for those only). With ``unscored`` a pick scored -inf, and each of the ``k`` a
    row with fewer selectable pages lacks, is -1; without, the lacking ones are unselectable
    pages scored -inf (``s`` must then be 0).
    Scratch (:func:`_lowrank_work`): ``w`` ``[G, R]``, ``logits`` ``[G, >= P*S]``, ``ws``
    ``[G, R + _SLOT_SPARE]``, ``top`` ``[G]``, ``score`` and ``cand`` ``[>= P]``."""
    s = sink.shape[1]
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            _lowrank_weights(query, qproj, scale, scaling, b, h, w)
            _lowrank_page_mass(w, codes, wide, narrow, valid, b, h, p_n, s_n, logits, ws, top, score)
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


_NO_CACHED = np.full((0, 0, 0), -1, np.int64)

# A low-rank call is split across threads only where each part has at least this much
# work: (token, query head) pairs scored, about 0.4 ms of kernel time here. On a host
# whose two CPUs are one core's hyperthreads a split only pays on long calls: SmolLM2
# at 7K tokens and batch 4 (2.6e5 pairs) took 0.45-0.65 ms on one thread and
# 0.75-0.81 ms in two parts; Llama-3-8B's shape at 32K and batch 4 (4.2e6 pairs),
# 5.6-7.0 ms on one and 4.5-4.8 ms in two.
_PART_MIN_WORK = 1 << 18
_pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvdrive-kernel")  # threads start on first use


_lent = threading.local()


def kernel_threads() -> int:
    """Threads a kernel call here may split across: the calling thread's torch intra-op
    threads, or the count it had before :func:`one_torch_thread`."""
    return getattr(_lent, "threads", None) or torch.get_num_threads()


@contextmanager
def one_torch_thread():
    """Run the calling thread's torch ops on one intra-op thread; the kernels here keep its threads.

    A decode step's bookkeeping is many small torch ops. Split across two intra-op
    threads on a 2-core host where the daemon or the pipeline's front thread holds
    the other core, each such op waits for its second thread to be scheduled (single
    ops of 0.2 ms took up to 14 ms). The compiled kernels split their own work
    (:func:`_in_parts`) and are not affected. torch's thread count is per thread.
    """
    threads = torch.get_num_threads()
    if threads == 1 or getattr(_lent, "threads", None):
        yield
        return
    _lent.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _lent.threads = None


def _in_parts(b_n: int, h_n: int, work_per_head: int, fn, min_work: int | None = None) -> None:
    """Run ``fn(rows, heads)`` on slices covering ``[b_n, h_n]``, on up to :func:`kernel_threads` threads.

    The calling thread runs the first part. Slices are whole rows (for a single row,
    whole heads), so every part's arrays stay C-contiguous. A thread held to one
    intra-op thread (the pipeline's front stage) runs the whole call itself. A call
    in one part gets ``fn(None, None)``: the whole arrays, no slices (:func:`_cut`).
    """
    by_rows = b_n > 1
    units = b_n if by_rows else h_n
    n = max(1, min(kernel_threads(), units, (b_n * h_n * work_per_head) // (min_work or _PART_MIN_WORK)))
    if n == 1:
        fn(None, None)
        return
    cuts = [units * i // n for i in range(n + 1)]
    parts = [(slice(cuts[i], cuts[i + 1]), slice(None)) if by_rows else (slice(None), slice(cuts[i], cuts[i + 1]))
             for i in range(n)]
    futures = [_pool.submit(fn, *p) for p in parts[1:]]
    try:
        fn(*parts[0])
    finally:
        for f in futures:
            f.result()


def _cut(arrays: tuple, rows, heads, rows_only: tuple[int, ...] = ()) -> tuple:
    """``arrays`` cut to a part of :func:`_in_parts`: ``[rows, heads]``, or ``[rows]`` for the
    positions in ``rows_only`` (per-row arrays); as they are for the whole call (``rows`` None)."""
    if rows is None:
        return arrays
    return tuple(x[rows] if i in rows_only else x[rows, heads] for i, x in enumerate(arrays))


_work = threading.local()


def _lowrank_work(g_n: int, r_n: int, p_n: int, s_n: int) -> tuple[np.ndarray, ...]:
    """The calling thread's scratch for the low-rank kernels (w, logits, ws, top, score, cand), kept between calls.

    Fresh scratch each call (about 100 KiB at a 7K context) page-faulted in on every
    call where the model's forward pass had handed freed memory back to the OS: tens
    of faults per layer. Grown by a quarter past the need, never shrunk.
    """
    bufs = getattr(_work, "lowrank", None)
    t_n = max(p_n * s_n, 1)
    if bufs is None or bufs[0].shape != (g_n, r_n) or bufs[1].shape[1] < t_n or bufs[4].shape[0] < p_n:
        t_cap, p_cap = t_n + t_n // 4, max(p_n + p_n // 4, 1)
        if bufs is not None and bufs[0].shape == (g_n, r_n):
            t_cap, p_cap = max(t_cap, bufs[1].shape[1]), max(p_cap, bufs[4].shape[0])
        bufs = (np.empty((g_n, r_n), np.float32), np.empty((g_n, t_cap), np.float32),
                np.empty((g_n, r_n + _SLOT_SPARE), np.float32), np.empty(g_n, np.float32), np.empty(p_cap, np.float32),
                np.empty(p_cap, np.float32))
        _work.lowrank = bufs
    return bufs


def _f32(t: torch.Tensor) -> np.ndarray:
    """A float32 numpy view of ``t`` (a copy only when its dtype differs)."""
    return t.detach().to(torch.float32).numpy()


def _projection(t: torch.Tensor) -> np.ndarray:
    """The query projection as the kernels take it: an fp16 one as its bits (uint16), widened
    in the kernel (a torch or numpy widening of its few KiB cost 20-30 us a call), others float32."""
    if t.dtype == torch.float16:
        return t.detach().view(torch.int16).numpy().view(np.uint16)
    return _f32(t)


def _layout(qproj: torch.Tensor, layout: ref.SketchLayout) -> tuple[int, int]:
    """(int8 channels, int2 channels) of ``layout``, which must be the projection's rank."""
    if layout.rank != qproj.shape[3]:
        raise ValueError(f"a sketch layout of rank {layout.rank} for a projection of rank {qproj.shape[3]}")
    return layout.int8, layout.int2


def lowrank_scores(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                   codes: torch.Tensor, valid: torch.Tensor, num_pages: int, page_size: int,
                   layout: ref.SketchLayout) -> torch.Tensor:
    """Fused :func:`kvdrive.kernels.reference.score_lowrank`, the query projection included.

    Same arguments, except that ``codes`` are packed as :func:`reference.pack_lowrank_codes`
    lays them out for ``layout``, and that they and ``valid``
    ``[B, >= P*S]`` may have spare capacity past ``num_pages`` pages (no copy is made).
    Returns float32 ``[B, H, P]``, within 1e-4 of the reference (the exponential is a polynomial)
    at the default layout of head dim 64; other layouts round their int4 and int2 weights to
    int16 (:func:`_slot_weights`), within 3e-3 at Gemma 3's rank 108 on random codes.
    A large call runs in parts on up to :func:`kernel_threads` threads (:func:`_in_parts`).
    """
    out = np.empty((query.shape[0], query.shape[1], num_pages), np.float32)
    q, qp, sc, cd, ok = _f32(query), _projection(qproj), scale.numpy(), codes.numpy(), valid.numpy()
    (wide, narrow), scaling = _layout(qproj, layout), np.float32(scaling)

    def part(bs, hs):
        q_, qp_, sc_, cd_, ok_, out_ = _cut((q, qp, sc, cd, ok, out), bs, hs, rows_only=(4,))
        _lowrank_scores(q_, qp_, sc_, scaling, cd_, wide, narrow, ok_, num_pages, page_size, out_,
                        *_lowrank_work(q.shape[2], qp.shape[3], num_pages, page_size)[:4])  # no top-k scratch

    _in_parts(q.shape[0], q.shape[1], num_pages * page_size * q.shape[2], part)
    return torch.from_numpy(out)


def lowrank_select(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                   codes: torch.Tensor, valid: torch.Tensor, selectable: torch.Tensor, k: int, page_size: int,
                   cached: torch.Tensor | None, layout: ref.SketchLayout,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``k`` selectable pages of highest :func:`lowrank_scores`, in one compiled call.

    ``selectable`` ``[B, P]`` says how many pages there are. With ``cached`` (``[B, H, n]``
    pages, -1 none) it also returns their scores, for lookahead eviction. Returns
    (pages ``[B, H, k]``, their scores, cached pages' scores or None); with fewer than
    ``k`` selectable pages the rest are unselectable ones scored -inf. Threads as
    :func:`lowrank_scores`.
    """
    arrays = (_projection(qproj), scale.numpy(), codes.numpy(), valid.numpy())
    sink = np.empty((query.shape[0], 0), np.int64)
    pages, scores, cached_scores = _select(query, arrays, scaling, selectable, k, page_size, sink, False, cached,
                                           layout)
    return torch.from_numpy(pages), torch.from_numpy(scores), cached_scores


def lowrank_choose(query: torch.Tensor, index, selectable: torch.Tensor, k: int, sink: torch.Tensor,
                   cached: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`kvdrive.kernels.backends.Kernels.lowrank_choose` in one compiled call: each row's
    ``sink`` pages, then :func:`lowrank_select`'s pages with -1 for those without a score.

    The kernel writes the sink and the -1s itself, where the reference concatenates and
    masks in torch, and the index's arrays are viewed once (:func:`_index_arrays`): a
    decode step calls this once per layer, after the model's forward pass has pushed
    torch's dispatch code and these arrays out of the caches, so each torch op left out
    saves several times its warm cost."""
    chosen, _, cached_scores = _select(query, _index_arrays(index), index.scaling, selectable, k, index.page_size,
                                       np.ascontiguousarray(sink.numpy(), np.int64), True, cached, index.layout)
    return torch.from_numpy(chosen), cached_scores


def _index_arrays(index) -> tuple[np.ndarray, ...]:
    """A low-rank index's (qproj, scale, codes, valid) as the kernels take them, kept on the index
    while its tensors are the same objects (pages added in place show through the views; an
    index that grew has new tensors, and a view of some rows, :meth:`Selector.rows`, its own)."""
    tensors = (index.qproj, index.scale, index.codes, index.valid)
    kept = getattr(index, "_cpu_arrays", None)
    if kept is None or any(a is not b for a, b in zip(kept[0], tensors)):
        kept = (tensors, (_projection(index.qproj), index.scale.numpy(), index.codes.numpy(), index.valid.numpy()))
        index._cpu_arrays = kept
    return kept[1]


def _select(query: torch.Tensor, arrays: tuple[np.ndarray, ...], scaling: float, selectable: torch.Tensor, k: int,
            page_size: int, sink: np.ndarray, unscored: bool, cached: torch.Tensor | None, layout: ref.SketchLayout,
            ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
    """:func:`_lowrank_select` over ``arrays`` (:func:`_index_arrays`): (pages ``[B, H, s + k]``, their
    scores ``[B, H, k]``, the cached pages' scores or None)."""
    num_pages = selectable.shape[1]
    k = min(k, num_pages)
    b, h = query.shape[:2]
    qp, sc, cd, ok = arrays
    pages = np.empty((b, h, sink.shape[1] + k), np.int64)
    scores = np.empty((b, h, k), np.float32)
    cached_np = _NO_CACHED if cached is None else cached.numpy()
    cached_scores = np.empty(cached_np.shape, np.float32)
    q, sel = _f32(query), selectable.numpy()
    (wide, narrow), scaling = _layout(qp, layout), np.float32(scaling)

    def part(bs, hs):  # without cached pages, the empty arrays slice to empty arrays
        q_, qp_, sc_, cd_, ok_, sel_, sink_, pages_, scores_, cached_, cached_scores_ = _cut(
            (q, qp, sc, cd, ok, sel, sink, pages, scores, cached_np, cached_scores), bs, hs, rows_only=(4, 5, 6))
        _lowrank_select(q_, qp_, sc_, scaling, cd_, wide, narrow, ok_, sel_, k, num_pages, page_size, sink_, unscored,
                        pages_, scores_, cached_, cached_scores_, *_lowrank_work(q.shape[2], qp.shape[3], num_pages, page_size))

    _in_parts(b, h, num_pages * page_size * q.shape[2], part)
    return pages, scores, None if cached is None else torch.from_numpy(cached_scores)


# ---------------------------------------------------------------- device-cache placement

@numba.njit(nogil=True, cache=True)
def _place(pages, page_slot, slot_page, last_used, prio_src, head_capacity, step, slots, miss):  # pragma: no cover - compiled
    """:meth:`kvdrive_client.device_cache.DeviceCache.place` for one batch of rows, in one pass.

    ``prio_src`` ``[B, H, C]``: each slot's victim priority before masking (the lookahead
    score or the last use); ``head_capacity`` ``[H]`` (empty: every head has all slots).
    Victims are the lowest-priority slots, ties to the lower slot, as a stable sort
    would give. Updates ``page_slot``, ``slot_page`` and ``last_used`` in place.
    """
    b_n, h_n, k_n = pages.shape
    c_n = slot_page.shape[2]
    prio = np.empty(c_n, np.float64)
    taken = np.empty(c_n, np.bool_)
    for b in range(b_n):
        for h in range(h_n):
            for c in range(c_n):
                if slot_page[b, h, c] < 0:
                    prio[c] = -np.inf
                else:
                    prio[c] = prio_src[b, h, c]
                if len(head_capacity) and c >= head_capacity[h]:
                    prio[c] = np.inf
                taken[c] = False
            m = 0
            for i in range(k_n):
                p = pages[b, h, i]
                s = page_slot[b, h, max(p, 0)]
                miss[b, h, i] = s < 0 and p >= 0
                if s < 0:
                    s = 0
                    m += p >= 0
                elif p >= 0:
                    prio[s] = np.inf  # a selected hit is never a victim
                slots[b, h, i] = s
            if m:
                # The m lowest-priority slots in (priority, slot) order: a linear pass per
                # victim while there are few (the common case), a stable sort otherwise.
                order = np.argsort(prio, kind="mergesort") if m > 8 else np.empty(0, np.int64)
                j = 0
                for i in range(k_n):
                    if not miss[b, h, i]:
                        continue
                    if m > 8:
                        v = order[j]
                    else:
                        v = -1
                        for c in range(c_n):
                            if not taken[c] and (v < 0 or prio[c] < prio[v]):
                                v = c
                        taken[v] = True
                    j += 1
                    slots[b, h, i] = v
                    old = slot_page[b, h, v]
                    if old >= 0:
                        page_slot[b, h, old] = -1
                for i in range(k_n):
                    if miss[b, h, i]:
                        page_slot[b, h, pages[b, h, i]] = slots[b, h, i]
            for i in range(k_n):
                if pages[b, h, i] >= 0:
                    s = slots[b, h, i]
                    slot_page[b, h, s] = pages[b, h, i]
                    last_used[b, h, s] = step


def place(pages: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor, last_used: torch.Tensor,
          prio_src: torch.Tensor, head_capacity: torch.Tensor | None, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused cache placement (see :func:`_place`): returns (slots, miss), both ``[B, H, k]``.

    ``page_slot``, ``slot_page`` and ``last_used`` (int64, C-contiguous per row; views of
    rows of a larger cache are fine) are updated in place.
    """
    slots = np.empty(pages.shape, np.int64)
    miss = np.empty(pages.shape, np.bool_)
    cap = np.empty(0, np.int64) if head_capacity is None else head_capacity.numpy()
    _place(pages.contiguous().numpy(), page_slot.numpy(), slot_page.numpy(), last_used.numpy(),
           prio_src.detach().to(torch.float64).contiguous().numpy(), cap, step, slots, miss)
    return torch.from_numpy(slots), torch.from_numpy(miss)


@numba.njit(nogil=True, cache=True)
def _attended_valid(valid, chosen, s_n, local_start, t, out):  # pragma: no cover - compiled
    b_n, h_n, k_n = chosen.shape
    for b in range(b_n):
        for h in range(h_n):
            for j in range(k_n):
                p = chosen[b, h, j]
                for i in range(s_n):
                    out[b, h, j * s_n + i] = p >= 0 and valid[b, p * s_n + i]
            for i in range(t - local_start):
                out[b, h, k_n * s_n + i] = valid[b, local_start + i]


def attended_valid(valid: torch.Tensor, chosen: torch.Tensor, page_size: int, local_start: int, t: int) -> torch.Tensor:
    """Which attended tokens are real: ``[B, H, k*S + (t - local_start)]`` bool.

    ``valid`` ``[B, >= t]``: the sequence's real tokens; ``chosen`` ``[B, H, k]``: the
    attended pages (-1: none), then the local window ``[local_start, t)``, in that order.
    """
    b, h, k = chosen.shape
    out = np.empty((b, h, k * page_size + t - local_start), np.bool_)
    _attended_valid(valid.contiguous().numpy(), chosen.contiguous().numpy(), page_size, local_start, t, out)
    return torch.from_numpy(out)
