"""Page selectors: which pages of a layer's context each decode step attends to.

One interface, :class:`Selector` (:mod:`.selector_base`), six implementations side by side:

- :class:`HierarchicalIndex` (KVDrive): page mean keys grouped under k-means
  centroids; a step scores the centroids, then only the pages under the best ones.
- :class:`QuestIndex`: per-page min/max keys, an upper bound of q.k per page.
- :class:`MeanKeyIndex`: one mean key per page, every page scored (ShadowKV-style
  landmarks).
- :class:`LowRankIndex`: every key as a low-rank sketch fitted to the prefill queries
  (int4 codes by default); a page scores its estimated share of the attention mass.
- :class:`KeyCodeIndex`: every key in rotated 4-bit codes, scored as the low-rank index (3x its bytes).
- :class:`OracleSelector`: exact attention mass per page from all keys; for
  measurement only (it keeps every key).

All work on a whole batch at once: state is ``[B, H, pages, ...]`` in the padded
token frame; ``selectable`` masks the pages a step may choose from.
"""

from __future__ import annotations

import math

import torch

from kvdrive.kernels import Kernels
from kvdrive.kernels import reference as ref
from kvdrive_client.index_kind import IndexKind
from kvdrive_client.selector_base import Selector, _grow


class MeanKeyIndex(Selector):
    kind = IndexKind.MEAN_KEY

    def build(self, keys, valid, query=None):
        self.means, _, _ = ref.page_summaries(keys, valid, self.page_size)
        self.num_pages = self.means.shape[2]
        return None

    def add_page(self, keys, valid):
        mean, _, _ = ref.page_summaries(keys, valid, self.page_size)
        self.means = _grow(self.means, self.num_pages + 1)
        self.means[:, :, self.num_pages] = mean[:, :, 0]
        self.num_pages += 1

    def scores(self, query):
        return ref.score_mean(query, self.means[:, :, : self.num_pages])

    def page_scores(self, query, pages):
        return self._gathered_mean_scores(query, self.means, pages)

    @property
    def index_bytes(self):
        m = self.means[:, :, : self.num_pages]
        return m.numel() * m.element_size()


class QuestIndex(Selector):
    kind = IndexKind.QUEST

    def build(self, keys, valid, query=None):
        _, self.kmin, self.kmax = ref.page_summaries(keys, valid, self.page_size)
        self.num_pages = self.kmin.shape[2]
        return None

    def add_page(self, keys, valid):
        _, kmin, kmax = ref.page_summaries(keys, valid, self.page_size)
        self.kmin = _grow(self.kmin, self.num_pages + 1)
        self.kmax = _grow(self.kmax, self.num_pages + 1)
        self.kmin[:, :, self.num_pages] = kmin[:, :, 0]
        self.kmax[:, :, self.num_pages] = kmax[:, :, 0]
        self.num_pages += 1

    def scores(self, query):
        n = self.num_pages
        return ref.score_quest(query, self.kmin[:, :, :n], self.kmax[:, :, :n])

    @property
    def index_bytes(self):
        n = self.num_pages
        return 2 * self.kmin[:, :, :n].numel() * self.kmin.element_size()


class HierarchicalIndex(Selector):
    """Mean keys (int8, one scale per page) under k-means centroids.

    ``pages_per_cluster`` sets the number of centroids; a step looks at the pages of
    the best centroids until it has ``candidate_factor`` x k candidates.
    """

    kind = IndexKind.HIERARCHICAL

    def __init__(self, page_size: int, pages_per_cluster: int = 8, candidate_factor: float = 4.0,
                 kernels: Kernels | None = None) -> None:
        super().__init__(page_size, kernels)
        self.pages_per_cluster = pages_per_cluster
        self.candidate_factor = candidate_factor

    def _quantize(self, means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = means.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        return (means / scale).round().to(torch.int8), scale.squeeze(-1).float()

    def _means(self) -> torch.Tensor:
        n = self.num_pages
        return self.q8[:, :, :n].float() * self.scale[:, :, :n, None]

    def build(self, keys, valid, query=None):
        means, _, _ = ref.page_summaries(keys, valid, self.page_size)
        b, h, p, d = means.shape
        self.num_pages = p
        self.q8, self.scale = self._quantize(means)
        if p == 0:  # a prompt shorter than a page: one empty centroid, which decode pages join
            self.centroids = means.new_zeros(b, h, 1, d)
            self.assign = torch.zeros(b, h, 0, dtype=torch.int32, device=means.device)
            return self.assign
        c = max(1, math.ceil(p / self.pages_per_cluster))
        cent, assign = ref.kmeans(means.reshape(b * h, p, d).float(), c)
        self.centroids = cent.reshape(b, h, -1, d).to(keys.dtype)
        self.assign = assign.reshape(b, h, p).to(torch.int32)
        return self.assign

    def add_page(self, keys, valid):
        mean, _, _ = ref.page_summaries(keys, valid, self.page_size)
        q8, scale = self._quantize(mean)
        n = self.num_pages
        self.q8 = _grow(self.q8, n + 1)
        self.scale = _grow(self.scale, n + 1)
        self.assign = _grow(self.assign, n + 1)
        self.q8[:, :, n] = q8[:, :, 0]
        self.scale[:, :, n] = scale[:, :, 0]
        # A new page joins its nearest centroid.
        dist = torch.cdist(mean.float(), self.centroids.float())  # [B, H, 1, C]
        self.assign[:, :, n] = dist[:, :, 0].argmin(dim=-1)
        self.num_pages += 1

    def scores(self, query):
        return ref.score_mean(query, self._means().to(query.dtype))

    def page_scores(self, query, pages):
        idx = pages.clamp_min(0)
        q8 = self.q8.gather(2, idx[..., None].expand(-1, -1, -1, self.q8.shape[-1]))
        scale = self.scale.gather(2, idx)
        return (ref.score_mean(query, q8.to(query.dtype)) * scale).masked_fill(pages < 0, ref.NEG_INF)

    def select_and_score(self, query, selectable, k, cached):
        return self.kernels(query).hierarchical_select(
            query, self.centroids, self.assign, self.q8, self.scale, selectable[:, : self.num_pages], k,
            max(k, int(self.candidate_factor * k)), cached)

    def select(self, query, selectable, k):
        pages, scores, _ = self.select_and_score(query, selectable, k, None)
        return pages, scores

    @property
    def index_bytes(self):
        n = self.num_pages
        return sum(t.numel() * t.element_size() for t in (self.q8[:, :, :n], self.scale[:, :, :n], self.assign[:, :, :n], self.centroids))


class OracleSelector(Selector):
    """Exact attention mass per page; keeps every key, for measurement only."""

    kind = IndexKind.ORACLE

    def __init__(self, page_size: int, scaling: float, kernels: Kernels | None = None) -> None:
        super().__init__(page_size, kernels)
        self.scaling = scaling

    def build(self, keys, valid, query=None):
        p = keys.shape[2] // self.page_size
        self.keys = keys[:, :, : p * self.page_size].clone()
        self.valid = valid[:, : p * self.page_size].clone()
        self.num_pages = p
        return None

    def add_page(self, keys, valid):
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.num_pages += 1

    def scores(self, query):
        logits = torch.matmul(query, self.keys.transpose(-1, -2)) * self.scaling
        logits = logits.masked_fill(~self.valid[:, None, None, :], ref.NEG_INF)
        probs = torch.softmax(logits.float(), dim=-1)
        b, h, g, t = probs.shape
        return probs.reshape(b, h, g, t // self.page_size, self.page_size).sum(dim=(2, 4))

    @property
    def index_bytes(self):
        return self.keys.numel() * self.keys.element_size()


from kvdrive_client.lowrank import LowRankIndex  # noqa: E402 - it builds on Selector, defined above


def make_selector(kind: IndexKind, page_size: int, scaling: float, kernels: Kernels | None = None,
                  **options) -> Selector:
    """A selector of ``kind``; ``kernels`` (default: those of the first query's device) run its selection."""
    if kind is IndexKind.HIERARCHICAL:
        return HierarchicalIndex(page_size, kernels=kernels, **options)
    if kind is IndexKind.QUEST:
        return QuestIndex(page_size, kernels)
    if kind is IndexKind.MEAN_KEY:
        return MeanKeyIndex(page_size, kernels)
    if kind is IndexKind.LOWRANK:
        return LowRankIndex(page_size, scaling, kernels=kernels, **options)
    if kind is IndexKind.KEYCODES:
        from kvdrive_client.keycodes import KeyCodeIndex  # noqa: PLC0415 - an option; it imports this module
        return KeyCodeIndex(page_size, scaling, kernels=kernels, **options)
    if kind is IndexKind.ORACLE:
        return OracleSelector(page_size, scaling, kernels)
    raise ValueError(f"unknown index kind {kind!r}")
