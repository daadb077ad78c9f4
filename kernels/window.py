"""A layer's local window as a ring of preallocated slots: appending a token is one write.

The window holds the K and V of tokens ``[start, end)`` (the last ``local_tokens`` of the
context, from a page boundary on, and the tokens of the page being filled). Position ``p``
sits in slot ``p % capacity``; the capacity is a whole number of pages, so a page's
tokens are contiguous slots and never wrap. Nothing is allocated per step: a decode step
writes its token into the slot of its position, and a completed page leaves the window by
moving ``start`` on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def ring_capacity(local_tokens: int, page_size: int) -> int:
    """Slots of a window that holds ``local_tokens`` tokens after the one a step appends: the
    longest window (``local_tokens + page_size - 1`` tokens) plus that token, in whole pages."""
    return (math.ceil(local_tokens / page_size) + 1) * page_size


@dataclass
class LocalWindow:
    """Tokens ``[start, end)`` of a layer: K and V ``[B, H, capacity, D]``, position ``p`` in slot ``p % capacity``."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    end: int

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, start: int, capacity: int) -> "LocalWindow":
        """A window of ``capacity`` slots holding ``keys``/``values`` ``[B, H, L, D]``, tokens ``[start, start + L)``."""
        b, h, n, d = keys.shape
        if n > capacity:
            raise ValueError(f"a local window of {n} tokens in a ring of {capacity} slots")
        window = cls(keys.new_zeros(b, h, capacity, d), values.new_zeros(b, h, capacity, d), start, start + n)
        first = start % capacity
        head = min(n, capacity - first)
        window.k[:, :, first : first + head] = keys[:, :, :head]
        window.v[:, :, first : first + head] = values[:, :, :head]
        window.k[:, :, : n - head] = keys[:, :, head:]
        window.v[:, :, : n - head] = values[:, :, head:]
        return window

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def first(self) -> int:
        """The slot of the window's first token."""
        return self.start % self.capacity

    def slot(self, position: int) -> int:
        return position % self.capacity

    def rows(self, lo: int, hi: int) -> "LocalWindow":
        """Batch rows ``[lo, hi)``, sharing the ring's storage."""
        return LocalWindow(self.k[lo:hi], self.v[lo:hi], self.start, self.end)

    def tokens(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[lo, hi)`` inside one page of the window (contiguous slots): views."""
        a = self.slot(lo)
        assert self.start <= lo <= hi <= self.end and a + hi - lo <= self.capacity, (lo, hi, self.start, self.end)
        return self.k[:, :, a : a + hi - lo], self.v[:, :, a : a + hi - lo]

    def linear(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's K and V ``[B, H, length, D]`` in order: views where it does not wrap, else copies."""
        first, n = self.first, self.length
        if first + n <= self.capacity:
            return self.k[:, :, first : first + n], self.v[:, :, first : first + n]
        head = self.capacity - first
        return (torch.cat([self.k[:, :, first:], self.k[:, :, : n - head]], dim=2),
                torch.cat([self.v[:, :, first:], self.v[:, :, : n - head]], dim=2))
