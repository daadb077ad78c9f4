"""The interface every page selector implements (:mod:`kvdrive_client.selectors` lists them).

Apart from :mod:`.selectors` so that an index in a module of its own (:mod:`.lowrank`,
:mod:`.keycodes`) builds on it without importing the module that imports it back.
"""

from __future__ import annotations

import copy
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
