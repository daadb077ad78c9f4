"""Where a host pool's pages lie, without asking it page by page.

SGLang gives a call's pages as host indices; the pool's ``get_page_buffer_meta`` turns them
into the pointer and size of each page's regions, a Python loop over the pages (128 pages of
an MHA pool: about 40 us, doubled inside a load whose copies have just flushed the caches;
a tenth of a 64 KiB-page load call). In the pools SGLang builds, region ``r`` of a page
whose first host index is ``t`` lies at ``t * stride + offset[r]`` of the pool's buffer.
:class:`PageStrides` learns ``stride`` and ``offset`` from the pool's own answers, checks
them against its full answer on the first :data:`CHECKED_CALLS` calls, and from then on
computes a call's regions with one numpy expression, still checking the last page of
every call against the pool. A pool whose regions do not follow (a page table in
between, say) is asked page by page from its first disagreement on, with a log line.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CHECKED_CALLS = 16  # calls whose every page is checked before the regions are computed


class PageStrides:
    """One host pool's page regions as ``first host index * stride + offset[region]``
    (bytes into its buffer), learned from its ``get_page_buffer_meta`` (any thread: a race
    only repeats a check)."""

    def __init__(self, pool: Any, page_tokens: int) -> None:
        self.pool, self.page_tokens = pool, page_tokens
        self.stride: int | None = None
        self.offset: np.ndarray | None = None
        self.span = 0  # each region's bytes
        self.buffer: tuple[Any, np.ndarray] | None = None  # the pool's buffer tensor and its bytes, once looked at
        self.checked = 0  # calls whose full answer matched
        self.off = False  # the pool's regions do not follow a stride: always asked

    @property
    def ready(self) -> bool:
        return not self.off and self.checked >= CHECKED_CALLS

    def firsts(self, host_indices: Any) -> np.ndarray | None:
        """The first host index of each page of ``host_indices`` (a CPU tensor), where each is
        a whole number of pages (as SGLang's host allocator hands them out: the pools' own
        arithmetic may round an index down to its page); None for any other."""
        try:
            firsts = host_indices.numpy()[:: self.page_tokens].astype(np.int64, copy=False)
        except (TypeError, RuntimeError, AttributeError):  # a device tensor, or not a tensor
            return None
        return None if (firsts % self.page_tokens).any() else firsts

    def predict(self, firsts: np.ndarray) -> np.ndarray:
        """Each page's region offsets (pages x regions) in the pool's buffer."""
        return firsts[:, None] * self.stride + self.offset[None, :]

    def learn(self, firsts: np.ndarray | None, offsets: np.ndarray, span: int) -> None:
        """Check (or, first, fit) the strides against ``offsets``, the pool's own answer
        (pages x regions of ``span`` bytes, offsets into its buffer) for pages starting at ``firsts``."""
        if self.off or firsts is None or len(firsts) != len(offsets):
            return
        if self.span != span and self.stride is not None:
            self._refuse(f"its regions were {self.span} bytes, now {span}")
            return
        self.span = span
        if self.stride is None:
            far = np.flatnonzero(firsts != firsts[0])
            if not len(far):
                return  # one page, or one page repeated: nothing to fit a stride on yet
            j = far[0]
            step, rest = divmod(int(offsets[j, 0] - offsets[0, 0]), int(firsts[j] - firsts[0]))
            if rest:
                self._refuse("a page's offset is not a whole multiple of its host index")
                return
            self.stride, self.offset = step, offsets[0] - firsts[0] * step
        if np.array_equal(self.predict(firsts), offsets):
            self.checked += 1
        else:
            self._refuse(f"its regions do not lie at host index x {self.stride} bytes")

    def spot_check(self, host_indices: Any, predicted: np.ndarray, base: int) -> bool:
        """Whether the last page of ``predicted`` (offsets from the buffer's address ``base``)
        is where the pool says (one page: about 5 us); on a disagreement the strides are
        off for good."""
        ptrs, _ = self.pool.get_page_buffer_meta(host_indices[len(host_indices) - self.page_tokens:])
        if np.array_equal(np.asarray(ptrs, np.int64) - base, predicted[-1]):
            return True
        self._refuse("the last page of a call disagreed with its strides")
        return False

    def _refuse(self, why: str) -> None:
        self.off = True
        log.info("KVDrive storage: host pool %s: %s; its pages' regions are asked of it page by page",
                 type(self.pool).__name__, why)
