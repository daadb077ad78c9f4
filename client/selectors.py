"""Page selectors: which pages of a layer's context each decode step attends to.

One interface, :class:`Selector`, six implementations side by side:

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

import copy
import math
from abc import ABC, abstractmethod

import torch

from kvdrive.kernels import Kernels, for_device
from kvdrive.kernels import reference as ref
from kvdrive.kernels.backends import with_sink
from kvdrive_client.index_kind import IndexKind


class Selector(ABC):
    """Index of one layer's pages. ``query`` is always ``[B, H, G, D]``."""

    kind: IndexKind
    FIT_QUERIES = 0  # the prompt's last queries :meth:`build` fits itself to (0: it reads none)

    def __init__(self, page_size: int, kernels: Kernels | None = None) -> None:
        self.page_size = page_size
        self.num_pages = 0
        self._kernels = kernels

    def kernels(self, query: torch.Tensor) -> Kernels:
        """The kernels given at construction, else those for the query's device (chosen once)."""
        if self._kernels is None:
            self._kernels = for_device(query.device)
        return self._kernels

    @abstractmethod
    def build(self, keys: torch.Tensor, valid: torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor | None:
        """Index the complete pages of prefill keys ``[B, H, T, D]``; return cluster ids ``[B, H, P]`` or None.

        ``query``: the prefill's queries ``[B, H, G, Q, D]`` (the last ``Q`` positions), for
        selectors that fit themselves to the queries; others ignore it.
        """

    @abstractmethod
    def add_page(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Index one more page: keys ``[B, H, S, D]``, valid ``[B, S]``."""

    @abstractmethod
    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """Estimated relevance of every indexed page: ``[B, H, P]``."""

    def select(self, query: torch.Tensor, selectable: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best selectable pages per (batch, head): (pages ``[B, H, k]``, scores)."""
        return self._top(self.scores(query), selectable, k)

    def _top(self, scores: torch.Tensor, selectable: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.topk_pages(scores.masked_fill(~selectable[:, None, : self.num_pages], ref.NEG_INF), k)

    def select_and_score(self, query: torch.Tensor, selectable: torch.Tensor, k: int,
                         cached: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`select`, plus :meth:`page_scores` of ``cached`` when given (one pass where it can)."""
        pages, scores = self.select(query, selectable, k)
        return pages, scores, None if cached is None else self.page_scores(query, cached)

    def choose(self, query: torch.Tensor, selectable: torch.Tensor, k: int, sink: torch.Tensor,
               cached: torch.Tensor | None) -> tuple[torch.Tensor, object]:
        """A step's pages: each row's ``sink`` pages ``[B, s]`` then the ``k`` best selectable ones
        (-1 where a row has fewer), ``[B, H, s + k]``; and :meth:`select_and_score`'s scores of
        ``cached``, in the form the kernels' placement takes as its priority."""
        picked, scores, slot_scores = self.select_and_score(query, selectable, k, cached)
        return with_sink(sink, picked.masked_fill(scores == ref.NEG_INF, -1)), slot_scores

    def page_scores(self, query: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Scores of given pages ``[B, H, n]`` (-1 = none), for lookahead eviction."""
        return ref.gather_scores(self.scores(query), pages)

    def rows(self, lo: int, hi: int) -> "Selector":
        """A read-only view of batch rows ``[lo, hi)`` for selection (every index tensor is batch-first)."""
        view = copy.copy(self)
        for name, value in self.__dict__.items():
            if isinstance(value, torch.Tensor) and value.dim():
                setattr(view, name, value[lo:hi])
        return view

    @staticmethod
    def _gathered_mean_scores(query: torch.Tensor, means: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        idx = pages.clamp_min(0)[..., None].expand(-1, -1, -1, means.shape[-1])
        return ref.score_mean(query, means.gather(2, idx).to(query.dtype)).masked_fill(pages < 0, ref.NEG_INF)

    @property
    @abstractmethod
    def index_bytes(self) -> int:
        """Bytes the index keeps on the device."""


def _grow(t: torch.Tensor, n: int, dim: int = 2, fill: float = 0.0) -> torch.Tensor:
    if t.shape[dim] >= n:
        return t
    new = max(n, 2 * t.shape[dim])
    shape = list(t.shape)
    shape[dim] = new - t.shape[dim]
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)


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
