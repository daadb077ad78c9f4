"""numba kernels for the CPU, each tested against its torch reference in ``reference.py``."""

from __future__ import annotations

import numba
import numpy as np
import torch


@numba.njit(nogil=True, cache=True, inline="always")
def _page_score(query, q8, scale, b, h, p):  # pragma: no cover - compiled
    """max over the query heads of q . mean(page), the mean stored as int8 x scale."""
    best = -np.inf
    for g in range(query.shape[2]):
        acc = 0.0
        for d in range(query.shape[3]):
            acc += query[b, h, g, d] * q8[b, h, p, d]
        if acc > best:
            best = acc
    return best * scale[b, h, p]


@numba.njit(nogil=True, cache=True)
def _hierarchical_select(query, centroids, assign, q8, scale, selectable, k, candidates, out_pages, out_scores,
                         cached, cached_scores, p_n):  # pragma: no cover - compiled
    b_n, h_n, g_n, d_n = query.shape
    c_n = centroids.shape[2]
    neg = -np.inf
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
                        acc = 0.0
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
            pscore = np.full(p_n, neg, np.float32)
            for p in range(p_n):
                if selectable[b, p] and take[assign[b, h, p]]:
                    pscore[p] = _page_score(query, q8, scale, b, h, p)
            top = np.argsort(-pscore)[:k]
            for i in range(k):
                out_pages[b, h, i] = top[i]
                out_scores[b, h, i] = pscore[top[i]]
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
