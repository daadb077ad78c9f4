"""Two-level page selection over int8 page means (the hierarchical index), one compiled call."""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvdrive.kernels.cpu.common import _nth_unused
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says


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
