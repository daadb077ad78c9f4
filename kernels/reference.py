"""Torch reference kernels for page summaries, selection scores and decode attention.

Shapes: ``B`` batch, ``H`` KV heads, ``G`` query heads per KV head, ``P`` pages,
``S`` tokens per page, ``D`` head dim. Queries come as ``[B, H, G, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def page_summaries(keys: torch.Tensor, valid: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, min and max key of every page over its valid tokens.

    keys ``[B, H, P*S, D]``, valid ``[B, P*S]`` bool -> three ``[B, H, P, D]`` tensors.
    Pages with no valid token get zero mean and an empty (inverted) box.
    """
    b, h, t, d = keys.shape
    p = t // page_size
    k = keys[:, :, : p * page_size].reshape(b, h, p, page_size, d)
    m = valid[:, : p * page_size].reshape(b, 1, p, page_size, 1).to(keys.dtype)
    count = m.sum(dim=3).clamp_min(1.0)
    mean = (k * m).sum(dim=3) / count
    big = torch.finfo(keys.dtype).max
    kmin = torch.where(m.bool(), k, torch.full_like(k, big)).amin(dim=3)
    kmax = torch.where(m.bool(), k, torch.full_like(k, -big)).amax(dim=3)
    return mean, kmin, kmax


def score_mean(query: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Per page, the largest q.mean over the query heads of a KV head: ``[B, H, P]``."""
    return torch.matmul(query, means.transpose(-1, -2)).amax(dim=2)


def score_quest(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q.k over a page's key box, max over query heads: ``[B, H, P]``."""
    q = query.unsqueeze(3)  # [B, H, G, 1, D]
    bound = torch.maximum(q * kmin.unsqueeze(2), q * kmax.unsqueeze(2)).sum(dim=-1)
    return bound.amax(dim=2)


def project_lowrank_query(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, H, G, D]`` queries -> ``[B, H, G, R]`` float32 weights of the sketch channels."""
    return torch.matmul(query.float(), qproj.float()) * (scale[:, :, None, :] * scaling)


@dataclass(frozen=True)
class SketchLayout:
    """How a rank-``rank`` key sketch is stored, per token: its leading ``int8`` channels one
    int8 code row each, then int4 channels two to a row, then its trailing ``int2`` channels
    four to a row. Channels come in order of the share of ``q . k`` they carry, so the first
    ones get the most bits.

    Codes are integers: int8 in [-127, 127] (the value, rounded), int4 in [-8, 7] and int2 in
    [-2, 1] (the floor of the value: the channel's step sits between codes, so that all 16
    or 4 codes are used). The half step those floors drop adds the same amount to every
    token's estimated logit for a query, which the per-query normalisation of the page
    masses takes away, so no kernel adds it back.
    """

    rank: int
    int8: int = 0
    int2: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.int8 < 0 or self.int2 < 0 or self.int8 + self.int2 > self.rank:
            raise ValueError(f"a sketch layout needs rank >= 1 and 0 <= int8 + int2 <= rank, got rank {self.rank}, "
                             f"int8 {self.int8}, int2 {self.int2}")

    @property
    def int4(self) -> int:
        return self.rank - self.int8 - self.int2

    @property
    def int4_rows(self) -> int:
        return (self.int4 + 1) // 2

    @property
    def int2_rows(self) -> int:
        return (self.int2 + 3) // 4

    @property
    def rows(self) -> int:
        """Code rows, and bytes per token."""
        return self.int8 + self.int4_rows + self.int2_rows

    def levels(self) -> torch.Tensor:
        """``[rank]``: each channel's range in steps, the largest |value| a scale maps to (127,
        8, 2): int4 and int2 codes floor the value and run from -levels to levels - 1."""
        out = torch.full((self.rank,), 8.0)
        out[: self.int8] = 127.0
        out[self.rank - self.int2:] = 2.0
        return out


def quantize_lowrank(z: torch.Tensor, layout: SketchLayout) -> torch.Tensor:
    """Sketch values in steps ``[..., R, T]`` (the value over its channel's scale) -> integer
    codes as :class:`SketchLayout` says: int8 channels rounded, the others floored, each
    clamped to its range."""
    lv = layout.levels().to(z.device)[:, None]
    wide = layout.int8
    head = z[..., :wide, :].round().clamp(-127, 127)
    tail = torch.floor(z[..., wide:, :]).clamp(-lv[wide:], lv[wide:] - 1)
    return torch.cat([head, tail], dim=-2).to(torch.int8)


def pack_lowrank_codes(q: torch.Tensor, layout: SketchLayout) -> torch.Tensor:
    """Integer codes ``[..., R, T]`` (:func:`quantize_lowrank`) -> code rows ``[..., layout.rows, T]`` int8.

    Channels below ``layout.int8`` keep one int8 row each; the int4 ones are two per row
    (channel ``int8 + 2j`` in the low nibble of row ``int8 + j``, the next in its high
    nibble); the int2 ones four per row, from the lowest two bits up. Values outside a
    channel's range are clamped.
    """
    w, n4, n2 = layout.int8, layout.int4, layout.int2
    head = q[..., :w, :].clamp(-127, 127).to(torch.int8)
    mid = q[..., w: w + n4, :].clamp(-8, 7).to(torch.int16)
    if n4 % 2:
        mid = torch.cat([mid, torch.zeros_like(mid[..., :1, :])], dim=-2)
    nib = (mid[..., 0::2, :] & 0xF) | ((mid[..., 1::2, :] & 0xF) << 4)
    tail = q[..., w + n4:, :].clamp(-2, 1).to(torch.int16)
    if n2 % 4:
        tail = torch.cat([tail, torch.zeros_like(tail[..., : 4 - n2 % 4, :])], dim=-2)
    quad = sum((tail[..., j::4, :] & 0x3) << (2 * j) for j in range(4)) if n2 else tail[..., :0, :]
    return torch.cat([head, nib.to(torch.uint8).view(torch.int8), quad.to(torch.uint8).view(torch.int8)], dim=-2)


def unpack_lowrank_codes(codes: torch.Tensor, layout: SketchLayout) -> torch.Tensor:
    """Inverse of :func:`pack_lowrank_codes`: ``[..., rows, T]`` -> ``[..., rank, T]`` int8 values."""
    w, r4 = layout.int8, layout.int4_rows
    nib = codes[..., w: w + r4, :].to(torch.int16)
    low = ((nib & 0xF) ^ 8) - 8
    high = nib >> 4  # arithmetic: the sign of the byte is the high nibble's
    mid = torch.stack([low, high], dim=-2).flatten(-3, -2)[..., : layout.int4, :]
    quad = codes[..., w + r4:, :].to(torch.int16)
    parts = [(((quad >> (2 * j)) & 3) ^ 2) - 2 for j in range(3)] + [quad >> 6]
    tail = torch.stack(parts, dim=-2).flatten(-3, -2)[..., : layout.int2, :]
    return torch.cat([codes[..., :w, :], mid.to(torch.int8), tail.to(torch.int8)], dim=-2)


def score_lowrank(query: torch.Tensor, qproj: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                  valid: torch.Tensor, page_size: int, scaling: float) -> torch.Tensor:
    """Per page, the log of its estimated share of the attention mass, from rank-r key sketches.

    query ``[B, H, G, D]``, qproj ``[B, H, D, R]``, codes ``[B, H, R, P*S]`` int8 (channel-major), scale
    ``[B, H, R]`` (one per channel), valid ``[B, P*S]`` -> ``[B, H, P]``: for every query
    head the estimated logits ``scaling * (q @ qproj) . (codes * scale)`` are normalised
    over all indexed tokens, then summed (as probabilities) over the page's tokens and
    the query heads. Pages without a valid token score -inf.
    """
    b, h, g, _ = query.shape
    logits = torch.matmul(project_lowrank_query(query, qproj, scale, scaling), codes.float())  # [B, H, G, P*S]
    logits = logits.masked_fill(~valid[:, None, None, :], NEG_INF)
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True).nan_to_num(neginf=0.0)
    p = codes.shape[3] // page_size
    return torch.logsumexp(logits.reshape(b, h, g, p, page_size), dim=(2, 4))


def kmeans(points: torch.Tensor, num_clusters: int, iters: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched k-means by cosine-free L2 on ``[N, P, D]`` points.

    Initial centroids are evenly spaced pages, so neighbouring pages start together.
    Returns centroids ``[N, C, D]`` and assignment ``[N, P]``.
    """
    n, p, d = points.shape
    c = max(1, min(num_clusters, p))
    init = torch.linspace(0, p - 1, c, device=points.device).round().long()
    cent = points[:, init].clone()
    assign = torch.zeros(n, p, dtype=torch.long, device=points.device)
    for _ in range(iters):
        dist = torch.cdist(points, cent)
        assign = dist.argmin(dim=2)
        sums = torch.zeros_like(cent).scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, d), points)
        counts = torch.zeros(n, c, device=points.device, dtype=points.dtype).scatter_add_(1, assign, torch.ones_like(assign, dtype=points.dtype))
        cent = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1).unsqueeze(-1), cent)
    return cent, assign


def hierarchical_select(
    query: torch.Tensor,
    centroids: torch.Tensor,
    assign: torch.Tensor,
    means: torch.Tensor,
    selectable: torch.Tensor,
    k: int,
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level selection: best centroids first, then the best pages under them.

    centroids ``[B, H, C, D]``, assign ``[B, H, P]`` (cluster of each page), means
    ``[B, H, P, D]``, selectable ``[B, P]``. Centroids are taken in score order until
    their selectable pages reach ``candidates``; those pages are scored by mean key
    and the top ``k`` kept. Returns (pages ``[B, H, k]``, their scores).
    """
    b, h, c, _ = centroids.shape
    cscore = torch.matmul(query, centroids.transpose(-1, -2)).amax(dim=2)  # [B, H, C]
    sel = selectable.unsqueeze(1).expand(b, h, -1)
    sizes = torch.zeros(b, h, c, device=assign.device, dtype=torch.long).scatter_add_(2, assign, sel.long())
    cscore = cscore.masked_fill(sizes == 0, NEG_INF)
    order = cscore.argsort(dim=2, descending=True)
    csum = sizes.gather(2, order).cumsum(dim=2)
    # Take a centroid while the pages before it are still short of the target.
    take_sorted = (csum - sizes.gather(2, order)) < candidates
    take = torch.zeros_like(take_sorted).scatter_(2, order, take_sorted)
    cand = take.gather(2, assign) & sel
    pscore = score_mean(query, means).masked_fill(~cand, NEG_INF)
    return topk_pages(pscore, k)


def topk_pages(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = min(k, scores.shape[-1])
    vals, idx = scores.topk(k, dim=-1)
    return idx, vals


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scaling: float,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact softmax attention of one query token over gathered keys.

    query ``[B, H, G, D]``, keys/values ``[B, H, N, D]``, valid ``[B, H, N]`` bool
    -> ``[B, H, G, D]`` computed and returned in ``dtype`` (default: the values';
    :meth:`kvdrive.kernels.Kernels.attention_dtype` says which a device wants). A
    (row, head) with no valid token gets zeros.
    """
    if dtype is not None:
        query, keys, values = query.to(dtype), keys.to(dtype), values.to(dtype)
    logits = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~valid.unsqueeze(2), NEG_INF)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(values.dtype)
    return torch.matmul(probs, values)


def attended_valid(valid: torch.Tensor, chosen: torch.Tensor | None, page_size: int, local_start: int,
                   t: int, heads: int | None = None) -> torch.Tensor:
    """Which attended tokens are real: ``[B, H, k*S + (t - local_start)]`` bool.

    ``valid`` ``[B, >= t]``: the sequence's real tokens; ``chosen`` ``[B, H, k]``: the
    attended pages (-1: none; None: no pages, ``heads`` gives ``H``), then the local
    window ``[local_start, t)``, in that order.
    """
    b = valid.shape[0]
    pos = torch.arange(local_start, t, device=valid.device).expand(b, heads if chosen is None else chosen.shape[1], -1)
    if chosen is not None:
        page_pos = chosen[..., None] * page_size + torch.arange(page_size, device=valid.device)
        page_pos = page_pos.masked_fill(chosen[..., None] < 0, -1).reshape(b, chosen.shape[1], -1)
        pos = torch.cat([page_pos, pos], dim=2)
    return valid.gather(1, pos.clamp_min(0).reshape(b, -1)).reshape(pos.shape) & (pos >= 0)


def lowrank_select(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                   codes: torch.Tensor, valid: torch.Tensor, selectable: torch.Tensor, k: int, page_size: int,
                   cached: torch.Tensor | None, layout: SketchLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``k`` selectable pages of highest :func:`score_lowrank` from packed codes
    (:func:`pack_lowrank_codes`; ``codes`` and ``valid`` may have spare capacity past the
    ``selectable.shape[1]`` pages), and the scores of ``cached`` pages ``[B, H, n]``
    (-1 none) when given: (pages ``[B, H, k]``, their scores, cached pages' scores or None)."""
    t = selectable.shape[1] * page_size
    unpacked = unpack_lowrank_codes(codes[..., :t], layout)
    scores = score_lowrank(query, qproj, unpacked, scale, valid[:, :t], page_size, scaling)
    pages, top = topk_pages(scores.masked_fill(~selectable[:, None, :], NEG_INF), k)
    return pages, top, None if cached is None else gather_scores(scores, cached)


def gather_scores(scores: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``scores`` ``[B, H, P]`` of ``pages`` ``[B, H, n]``, -inf where a page is -1 (all of them when P is 0)."""
    if scores.shape[2] == 0:
        return torch.full(pages.shape, NEG_INF, dtype=scores.dtype, device=scores.device)
    return scores.gather(2, pages.clamp_min(0)).masked_fill(pages < 0, NEG_INF)


def hierarchical_select_int8(query: torch.Tensor, centroids: torch.Tensor, assign: torch.Tensor, q8: torch.Tensor,
                             scale: torch.Tensor, selectable: torch.Tensor, k: int, candidates: int,
                             cached: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`hierarchical_select` over int8 page means ``q8`` ``[B, H, >= P, D]`` with one
    ``scale`` per page, ``P = selectable.shape[1]``; plus the scores of ``cached`` pages
    (-1 none) when given, as :func:`score_mean` of their int8 means times their scale."""
    n = selectable.shape[1]
    means = (q8[:, :, :n].float() * scale[:, :, :n, None]).to(query.dtype)
    pages, top = hierarchical_select(query, centroids, assign[:, :, :n].long(), means, selectable, k, candidates)
    if cached is None:
        return pages, top, None
    idx = cached.clamp_min(0)
    q8c = q8.gather(2, idx[..., None].expand(-1, -1, -1, q8.shape[-1]))
    cached_scores = (score_mean(query, q8c.to(query.dtype)) * scale.gather(2, idx)).masked_fill(cached < 0, NEG_INF)
    return pages, top, cached_scores


def place(pages: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor, last_used: torch.Tensor,
          prio: torch.Tensor, head_capacity: torch.Tensor | None, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-cache placement in tensor ops, none of which waits for the device: (slots, miss), both ``[B, H, k]``.

    ``pages`` ``[B, H, k]`` (-1: nothing selected there; such entries are never misses and
    get the slot of page 0 if it is cached, else slot 0: attention masks them); ``page_slot`` ``[B, H, >= max page + 1]`` (slot of each page, -1),
    ``slot_page`` and ``last_used`` ``[B, H, C]`` are updated in place; ``prio`` ``[B, H, C]``
    ranks the slots as victims (lowest first, ties to the lower slot); empty slots go
    first, slots past ``head_capacity[h]`` and slots of selected hits never.
    """
    b, h, k = pages.shape
    capacity = slot_page.shape[2]
    none = pages < 0
    pages = pages.clamp_min(0)
    slots = page_slot.gather(2, pages)
    miss = (slots < 0) & ~none
    slots = slots.masked_fill(none & (slots < 0), 0)
    prio = prio.float().masked_fill(slot_page < 0, float("-inf"))
    if head_capacity is not None:
        beyond = torch.arange(capacity, device=prio.device) >= head_capacity[:, None]
        prio = prio.masked_fill(beyond[None], float("inf"))
    # Every write below is a scatter of all k entries; the entries that must not write
    # go to a spare last column, so no step asks the host which entries those are.
    hit = ~miss & ~none
    keep = torch.zeros(b, h, capacity + 1, dtype=torch.bool, device=pages.device)
    keep.scatter_(2, slots.masked_fill(~hit, capacity), True)
    prio = prio.masked_fill(keep[:, :, :capacity], float("inf"))
    victims = prio.argsort(dim=2, stable=True)
    rank = miss.long().cumsum(dim=2) - 1
    slots = torch.where(miss, victims.gather(2, rank.clamp_min(0)), slots)
    # Unmap the evicted pages, map the new ones (disjoint: a missed page was not cached).
    old = slot_page.gather(2, slots)
    n = page_slot.shape[2]
    ext = torch.cat([page_slot, page_slot.new_empty(b, h, 1)], dim=2)
    ext.scatter_(2, old.masked_fill(~(miss & (old >= 0)), n), -1)
    ext.scatter_(2, pages.masked_fill(~miss, n), slots)
    page_slot.copy_(ext[:, :, :n])
    at = slots.masked_fill(none, capacity)
    for dst, value in ((slot_page, pages), (last_used, torch.full_like(pages, step))):
        ext = torch.cat([dst, dst.new_empty(b, h, 1)], dim=2)
        ext.scatter_(2, at, value)
        dst.copy_(ext[:, :, :capacity])
    return slots, miss


def sparse_attention(query: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                     local_k: torch.Tensor, local_v: torch.Tensor, valid: torch.Tensor, scaling: float,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode attention over cache slots, then the local window: the slots' pages gathered,
    then :func:`decode_attention`. Same arguments as
    :func:`kvdrive.kernels.cpu.sparse_attention` (``slots`` -1: no page, masked by ``valid``);
    returns ``[B, H, G, D]`` computed and returned in ``dtype`` (default: the cache's)."""
    b, h, k = slots.shape
    s, d = cache_k.shape[3], cache_k.shape[4]
    bi = torch.arange(b, device=slots.device)[:, None, None]
    hi = torch.arange(h, device=slots.device)[None, :, None]
    at = slots.clamp_min(0)
    keys = torch.cat([cache_k[bi, hi, at].reshape(b, h, k * s, d), local_k.to(cache_k.dtype)], dim=2)
    values = torch.cat([cache_v[bi, hi, at].reshape(b, h, k * s, d), local_v.to(cache_v.dtype)], dim=2)
    n = keys.shape[2]
    return decode_attention(query.to(keys.dtype), keys, values, valid[:, :, :n], scaling, dtype)
