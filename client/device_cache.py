"""The device-side page cache of one layer: which pages sit in which slots.

Per (batch row, KV head) a fixed number of slots holds pages of K and V on the
compute device. A step's selection is looked up; misses take the slots of the
pages the eviction policy ranks lowest:

- ``LOOKAHEAD``: cached pages that this step did not select, lowest *current*
  score first (the score the selector gives them for this step's query).
- ``LRU``: cached pages that this step did not select, least recently used first.

Pages this step selected are never evicted by it. The bookkeeping is vectorised
over (batch, head); the bytes live in ``k`` / ``v``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from kvdrive.kernels import Kernels, for_device


class EvictionPolicy(enum.Enum):
    LOOKAHEAD = "lookahead"
    LRU = "lru"


@dataclass
class Placement:
    slots: torch.Tensor  # [B, H, k] slot of every selected page
    miss: torch.Tensor  # [B, H, k] bool: the page must be fetched into its slot
    pages: torch.Tensor | None = None  # [B, H, k] the selected pages (-1: none)

    @property
    def num_hits(self) -> int:
        """Selected pages found in the cache (entries with no page, -1, are neither)."""
        hit = ~self.miss if self.pages is None else ~self.miss & (self.pages >= 0)
        return int(hit.sum())

    @property
    def num_misses(self) -> int:
        return int(self.miss.sum())

    def to_host(self, extra: torch.Tensor | None = None) -> tuple["HostPlacement", np.ndarray | None]:
        """The placement on the host in one device-to-host copy, with ``extra`` (1-D int64,
        returned as numpy int64) in the same copy: on a GPU, the one point where a layer's
        decode step waits for the device."""
        packed = torch.stack([self.pages, self.slots, self.miss]).view(-1)  # int64: the miss flags promoted
        flat = (packed if extra is None else torch.cat([packed, extra])).cpu().numpy()
        n = 3 * self.pages.numel()
        placed = flat[:n].reshape(3, *self.pages.shape)
        return HostPlacement(placed[0], placed[1], placed[2].astype(bool)), (None if extra is None else flat[n:])


@dataclass
class HostPlacement:
    """:class:`Placement` as numpy arrays ``[B, H, k]``, for the fetch and the figures."""

    pages: np.ndarray
    slots: np.ndarray
    miss: np.ndarray

    def __post_init__(self) -> None:
        self.rows, self.heads, at = np.nonzero(self.miss)  # row-major: the order fetched pages land in
        self.missed_pages = self.pages[self.rows, self.heads, at]
        self.missed_slots = self.slots[self.rows, self.heads, at]

    @property
    def num_hits(self) -> int:
        """Selected pages found in the cache (entries with no page, -1, are neither)."""
        return int((self.pages >= 0).sum()) - len(self.rows)

    @property
    def num_misses(self) -> int:
        return len(self.rows)


class DeviceCache:
    def __init__(self, slots: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device | str,
                 policy: EvictionPolicy, reuse: bool = True, kernels: Kernels | None = None) -> None:
        """``slots``: (batch rows, KV heads, slots per head, page size, head dim)."""
        batch, heads, capacity, page_size, head_dim = slots
        if capacity < 1:
            raise ValueError(f"device cache capacity must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.kernels = kernels if kernels is not None else for_device(device)
        # reuse=False: a staging area, not a cache; every step fetches all it selects (the x0 baseline).
        self.reuse = reuse
        # Slots each KV head may use (None: all); set_head_capacity() limits them per head.
        self.head_capacity: torch.Tensor | None = None
        self.k = torch.zeros(batch, heads, capacity, page_size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slot_page = torch.full((batch, heads, capacity), -1, dtype=torch.long, device=device)
        self.last_used = torch.zeros(batch, heads, capacity, dtype=torch.long, device=device)
        self.page_slot = torch.full((batch, heads, 64), -1, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def grow(self, capacity: int) -> None:
        """More slots per head (decode lengthens the context, so the selection grows)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        b, h, _, s, d = self.k.shape
        self.k = torch.cat([self.k, self.k.new_zeros(b, h, extra, s, d)], dim=2)
        self.v = torch.cat([self.v, self.v.new_zeros(b, h, extra, s, d)], dim=2)
        self.slot_page = torch.cat([self.slot_page, self.slot_page.new_full((b, h, extra), -1)], dim=2)
        self.last_used = torch.cat([self.last_used, self.last_used.new_zeros(b, h, extra)], dim=2)
        self.capacity = capacity

    def set_head_capacity(self, per_head) -> None:
        """Limit each KV head to ``per_head[h]`` slots (a sequence of ints, or None for all);
        grows the cache to the largest."""
        if per_head is None:
            self.head_capacity = None
            return
        per_head = [int(n) for n in per_head]  # host values: checking them never waits for the device
        self.grow(max(per_head))
        self._head_min = min(per_head)
        self.head_capacity = torch.tensor(per_head, dtype=torch.long, device=self.slot_page.device)

    def rows(self, lo: int, hi: int) -> "DeviceCache":
        """A view of batch rows ``[lo, hi)`` sharing this cache's storage.

        Rows are independent (every slot belongs to one (row, head)), so views of
        disjoint rows can be placed, filled and read from different threads. Grow the
        cache and size ``page_slot`` (:meth:`reserve_pages`) before taking views.
        """
        view = object.__new__(DeviceCache)
        view.__dict__.update(self.__dict__)
        for name in ("k", "v", "slot_page", "last_used", "page_slot"):
            setattr(view, name, getattr(self, name)[lo:hi])
        return view

    def reserve_pages(self, n: int) -> None:
        self._ensure_pages(n)

    def _ensure_pages(self, n: int) -> None:
        cur = self.page_slot.shape[2]
        if n > cur:
            extra = torch.full((*self.page_slot.shape[:2], max(n, 2 * cur) - cur), -1, dtype=torch.long, device=self.page_slot.device)
            self.page_slot = torch.cat([self.page_slot, extra], dim=2)

    def lookup(self, pages: torch.Tensor) -> torch.Tensor:
        """Slot of each page ``[B, H, k]``, -1 where it is not cached."""
        self._ensure_pages(int(pages.max()) + 1 if pages.numel() else 1)
        return self.page_slot.gather(2, pages)

    def place(self, pages: torch.Tensor, step: int, slot_scores: torch.Tensor | None = None,
              num_pages: int | None = None) -> Placement:
        """Give every selected page a slot, evicting by policy; returns where each goes.

        ``pages`` may hold -1 (nothing selected there: a row with fewer selectable
        pages than others); such entries get an arbitrary slot and are never misses.
        ``slot_scores`` ``[B, H, capacity]``: current scores of the cached pages
        (needed by LOOKAHEAD). ``num_pages``: pages in the context, when the caller knows
        (else read from ``pages``, which waits for the device).
        """
        b, h, k = pages.shape
        if k > self.capacity:
            raise ValueError(f"{k} pages selected but the device cache holds {self.capacity} per head")
        if self.head_capacity is not None and self._head_min < k:
            raise ValueError(f"{k} pages selected but a head's window holds {self._head_min}")
        if not self.reuse:
            self.page_slot.fill_(-1)
            self.slot_page.fill_(-1)
        # Priority of each slot as a victim: empty first, then by policy; selected hits never.
        if self.policy is EvictionPolicy.LOOKAHEAD and self.reuse:
            if slot_scores is None:
                raise ValueError("lookahead eviction needs the current scores of the cached pages")
            prio = slot_scores
        else:
            prio = self.last_used
        self._ensure_pages(num_pages if num_pages is not None else int(pages.max()) + 1 if pages.numel() else 1)
        slots, miss = self.kernels.place(pages, self.page_slot, self.slot_page, self.last_used, prio,
                                         self.head_capacity, step)
        return Placement(slots, miss, pages)

    def _flat_slots(self, bi: torch.Tensor, hi: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row of each (batch row, head, slot) in ``k``/``v`` viewed as ``[B*H*capacity, S, D]``."""
        return (bi * self.k.shape[1] + hi) * self.capacity + slots

    def fill(self, placement: Placement, k_pages: torch.Tensor, v_pages: torch.Tensor,
             host: HostPlacement | None = None) -> None:
        """Write fetched pages (``[num_misses, S, D]`` in ``nonzero(miss)`` order) into their slots;
        with ``host`` (the placement on the host) without asking the device where they go."""
        self.fill_kv(placement, torch.stack([k_pages, v_pages], dim=1), host)

    def fill_kv(self, placement: Placement, kv: torch.Tensor, host: HostPlacement | None = None) -> None:
        """:meth:`fill` with each page's K and V together, ``kv`` ``[num_misses, 2, S, D]`` (as fetched)."""
        if host is not None:
            flat = (host.rows * self.k.shape[1] + host.heads) * self.capacity + host.missed_slots
            rows = torch.from_numpy(flat).to(self.k.device, non_blocking=True)
        else:
            bi, hi, ki = torch.nonzero(placement.miss, as_tuple=True)
            rows = self._flat_slots(bi, hi, placement.slots[bi, hi, ki])
        self.kernels.land(self.k, self.v, rows, kv)

    def seed(self, pages: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
        """Fill an empty cache with ``pages`` ``[B, H, n]`` (n <= capacity) and their data ``[B, H, n, S, D]``.

        A page of -1 leaves its slot empty (a head whose window holds fewer than n).
        """
        n = pages.shape[2]
        self._ensure_pages(int(pages.max()) + 1 if pages.numel() else 1)
        self.k[:, :, :n] = k_pages
        self.v[:, :, :n] = v_pages
        self.slot_page[:, :, :n] = pages.clamp_min(-1)
        bi, hi, ki = torch.nonzero(pages >= 0, as_tuple=True)
        self.page_slot[bi, hi, pages[bi, hi, ki]] = ki

    def gather_into(self, slots: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor, staging: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the given slots' K and V into ``out_k``/``out_v`` ``[B, H, k*S, D]`` (any dtype, any strides).

        ``staging`` (``[>= B*H*k, S, D]`` in the cache's dtype, contiguous) is reused for the
        intermediate copy when large enough; the buffer used is returned for next time.
        Writing into buffers the caller keeps saves allocating (and page-faulting) fresh
        tensors of a few MiB every layer.
        """
        b, h, k = slots.shape
        bi = torch.arange(b, device=slots.device)[:, None, None]
        hi = torch.arange(h, device=slots.device)[None, :, None]
        rows = self._flat_slots(bi, hi, slots).reshape(-1)
        n = len(rows)
        if staging is None or staging.shape[0] < n or staging.dtype != self.k.dtype:
            staging = torch.empty(max(n, 1), *self.k.shape[3:], dtype=self.k.dtype, device=self.k.device)
        d = self.k.shape[-1]
        for src, out in ((self.k, out_k), (self.v, out_v)):
            torch.index_select(src.view(-1, *src.shape[3:]), 0, rows, out=staging[:n])
            out.copy_(staging[:n].view(b, h, -1, d))
        return staging

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots: new ``[B, H, k*S, D]`` tensors (see :meth:`gather_into`)."""
        b, h, k = slots.shape
        shape = (b, h, k * self.k.shape[3], self.k.shape[4])
        kk, vv = self.k.new_empty(shape), self.v.new_empty(shape)
        self.gather_into(slots, kk, vv)
        return kk, vv
