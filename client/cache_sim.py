"""Offline replay of a page-selection trace through a page cache: hit rates of eviction policies.

A :class:`Trace` holds, for every *stream* (the cache of one (sequence, layer, KV
head)) and decode step, the pages the selector picked and its score of every page
indexed at that step. :func:`simulate` replays the trace through a cache of
``capacity`` pages per stream, every stream starting empty, and counts hits:

- ``LOOKAHEAD`` and ``LRU`` follow :meth:`DeviceCache.place
  <kvdrive_client.device_cache.DeviceCache.place>` exactly, slot for slot: the
  pages a step selects are never evicted by that step; its misses, in selection
  order, take the slots ranked lowest — empty slots first, then cached pages the
  step did not select, by lowest current score (``LOOKAHEAD``) or least recent
  use (``LRU``), ties by slot number.
- ``BELADY``: a miss evicts the unselected cached page whose next use is
  farthest in the future (never used again = infinitely far): the clairvoyant
  optimum, an upper bound for any online policy on the same trace.

A lookup is one selected page; ``-1`` entries pad steps that select fewer pages.
Pure bookkeeping (numpy in, counts out): no tensors, no device.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass

import numpy as np


class CachePolicy(enum.Enum):
    LOOKAHEAD = "lookahead"
    LRU = "lru"
    BELADY = "belady"


@dataclass(frozen=True)
class Trace:
    """``selected`` ``[N, T, k]`` pages (-1 none) and ``scores`` ``[N, T, P]`` per stream and step.

    ``scores[n, t, p]`` is the selector's score of page ``p`` for step ``t``'s query
    (pages not indexed yet may hold anything); only ``LOOKAHEAD`` reads it.
    """

    selected: np.ndarray
    scores: np.ndarray | None = None
    # ``seeded`` ``[N, n]``: pages the cache held before the first step, most important
    # first (-1 padding); a cache of capacity c starts with the first c of them.
    seeded: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.selected.ndim != 3:
            raise ValueError(f"selected must be [streams, steps, k], got shape {self.selected.shape}")
        if self.seeded is not None and (self.seeded.ndim != 2 or self.seeded.shape[0] != self.selected.shape[0]):
            raise ValueError(f"seeded must be [streams, pages] with {self.selected.shape[0]} streams, "
                             f"got shape {self.seeded.shape}")
        if self.scores is not None:
            if self.scores.ndim != 3 or self.scores.shape[:2] != self.selected.shape[:2]:
                raise ValueError(f"scores must be [streams, steps, pages] matching selected {self.selected.shape[:2]}, "
                                 f"got {self.scores.shape}")
            if self.selected.size and self.selected.max() >= self.scores.shape[2]:
                raise ValueError(f"page {self.selected.max()} selected but scores cover {self.scores.shape[2]} pages")

    @property
    def num_streams(self) -> int:
        return self.selected.shape[0]

    @property
    def num_steps(self) -> int:
        return self.selected.shape[1]

    @property
    def max_selected(self) -> int:
        """The most pages any stream selects in one step (the paper's k)."""
        return int((self.selected >= 0).sum(axis=2).max()) if self.selected.size else 0


@dataclass(frozen=True)
class SimResult:
    policy: CachePolicy
    capacity: int
    hits: int
    lookups: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else math.nan


def simulate(trace: Trace, capacity: int, policy: CachePolicy) -> SimResult:
    """Hits of every stream of ``trace`` through a ``capacity``-page cache under ``policy``."""
    hits = lookups = 0
    for n in range(trace.num_streams):
        scores = None if trace.scores is None else trace.scores[n]
        seeded = None if trace.seeded is None else trace.seeded[n]
        per_step = stream_hits(trace.selected[n], scores, capacity, policy, seeded)
        hits += sum(per_step)
        lookups += int((trace.selected[n] >= 0).sum())
    return SimResult(policy, capacity, hits, lookups)


def stream_hits(selected: np.ndarray, scores: np.ndarray | None, capacity: int, policy: CachePolicy,
                seeded: np.ndarray | None = None) -> list[int]:
    """Hits per step of one stream: ``selected`` ``[T, k]``, ``scores`` ``[T, P]``.

    ``seeded``: pages in the cache before the first step, most important first: slot
    ``i`` holds ``seeded[i]`` for ``i < capacity`` (-1: the slot stays empty), as
    :meth:`DeviceCache.seed` fills them.
    """
    if capacity < 1:
        raise ValueError(f"cache capacity must be >= 1 page, got {capacity}")
    initial = [] if seeded is None else [int(p) for p in np.asarray(seeded)[:capacity]]
    steps = [[int(p) for p in row if p >= 0] for row in np.asarray(selected)]
    for t, pages in enumerate(steps):
        if len(pages) > capacity:
            raise ValueError(f"step {t} selects {len(pages)} pages but the cache holds {capacity}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"step {t} selects a page twice: {pages}")
    if policy is CachePolicy.BELADY:
        return _belady(steps, capacity, initial)
    if policy is CachePolicy.LOOKAHEAD and scores is None:
        raise ValueError("lookahead eviction needs the trace's scores")
    return _slotted(steps, scores, capacity, policy, initial)


def _slotted(steps: list[list[int]], scores: np.ndarray | None, capacity: int, policy: CachePolicy,
             initial: list[int]) -> list[int]:
    slot_page = initial + [-1] * (capacity - len(initial))
    last_used = [0] * capacity
    page_slot: dict[int, int] = {page: slot for slot, page in enumerate(initial) if page >= 0}
    out = []
    for t, pages in enumerate(steps):
        misses = [p for p in pages if p not in page_slot]
        out.append(len(pages) - len(misses))
        if misses:
            kept = {page_slot[p] for p in pages if p in page_slot}
            row = None if scores is None else scores[t]

            def rank(slot: int) -> tuple[float, int]:
                page = slot_page[slot]
                if page < 0:
                    return -math.inf, slot
                # float32, as DeviceCache compares them.
                value = float(np.float32(row[page])) if policy is CachePolicy.LOOKAHEAD else float(last_used[slot])
                return value, slot

            victims = sorted((s for s in range(capacity) if s not in kept), key=rank)
            for page, slot in zip(misses, victims):
                if slot_page[slot] >= 0:
                    del page_slot[slot_page[slot]]
                slot_page[slot] = page
                page_slot[page] = slot
        for p in pages:
            last_used[page_slot[p]] = t
    return out


def _belady(steps: list[list[int]], capacity: int, initial: list[int]) -> list[int]:
    uses: dict[int, list[int]] = {}
    for t, pages in enumerate(steps):
        for p in pages:
            uses.setdefault(p, []).append(t)

    def next_use(page: int, t: int) -> float:
        at = uses.get(page, [])  # a seeded page may never be selected
        i = bisect.bisect_right(at, t)
        return at[i] if i < len(at) else math.inf

    cached: set[int] = {p for p in initial if p >= 0}
    out = []
    for t, pages in enumerate(steps):
        misses = [p for p in pages if p not in cached]
        out.append(len(pages) - len(misses))
        over = len(cached) + len(misses) - capacity
        if over > 0:
            current = set(pages)
            candidates = sorted((p for p in cached if p not in current), key=lambda p: next_use(p, t), reverse=True)
            cached.difference_update(candidates[:over])
        cached.update(misses)
    return out
