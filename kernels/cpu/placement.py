"""Device-cache placement (victim choice for missed pages) and the mask of attended tokens."""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says


@numba.njit(nogil=True, cache=True)
def _place(pages, page_slot, slot_page, last_used, prio_src, head_capacity, step, slots, miss):  # pragma: no cover - compiled
    """:meth:`kvdrive_client.device_cache.DeviceCache.place` for one batch of rows, in one pass.

    ``prio_src`` ``[B, H, C]``: each slot's victim priority before masking (the lookahead
    score or the last use); ``head_capacity`` ``[H]`` (empty: every head has all slots).
    Victims are the lowest-priority slots, ties to the lower slot, as a stable sort
    would give. Updates ``page_slot``, ``slot_page`` and ``last_used`` in place.
    """
    b_n, h_n, k_n = pages.shape
    c_n = slot_page.shape[2]
    prio = np.empty(c_n, np.float64)
    taken = np.empty(c_n, np.bool_)
    for b in range(b_n):
        for h in range(h_n):
            for c in range(c_n):
                if slot_page[b, h, c] < 0:
                    prio[c] = -np.inf
                else:
                    prio[c] = prio_src[b, h, c]
                if len(head_capacity) and c >= head_capacity[h]:
                    prio[c] = np.inf
                taken[c] = False
            m = 0
            for i in range(k_n):
                p = pages[b, h, i]
                s = page_slot[b, h, max(p, 0)]
                miss[b, h, i] = s < 0 and p >= 0
                if s < 0:
                    s = 0
                    m += p >= 0
                elif p >= 0:
                    prio[s] = np.inf  # a selected hit is never a victim
                slots[b, h, i] = s
            if m:
                # The m lowest-priority slots in (priority, slot) order: a linear pass per
                # victim while there are few (the common case), a stable sort otherwise.
                order = np.argsort(prio, kind="mergesort") if m > 8 else np.empty(0, np.int64)
                j = 0
                for i in range(k_n):
                    if not miss[b, h, i]:
                        continue
                    if m > 8:
                        v = order[j]
                    else:
                        v = -1
                        for c in range(c_n):
                            if not taken[c] and (v < 0 or prio[c] < prio[v]):
                                v = c
                        taken[v] = True
                    j += 1
                    slots[b, h, i] = v
                    old = slot_page[b, h, v]
                    if old >= 0:
                        page_slot[b, h, old] = -1
                for i in range(k_n):
                    if miss[b, h, i]:
                        page_slot[b, h, pages[b, h, i]] = slots[b, h, i]
            for i in range(k_n):
                if pages[b, h, i] >= 0:
                    s = slots[b, h, i]
                    slot_page[b, h, s] = pages[b, h, i]
                    last_used[b, h, s] = step


def place(pages: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor, last_used: torch.Tensor,
          prio_src: torch.Tensor, head_capacity: torch.Tensor | None, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused cache placement (see :func:`_place`): returns (slots, miss), both ``[B, H, k]``.

    ``page_slot``, ``slot_page`` and ``last_used`` (int64, C-contiguous per row; views of
    rows of a larger cache are fine) are updated in place.
    """
    slots = np.empty(pages.shape, np.int64)
    miss = np.empty(pages.shape, np.bool_)
    cap = np.empty(0, np.int64) if head_capacity is None else head_capacity.numpy()
    _place(pages.contiguous().numpy(), page_slot.numpy(), slot_page.numpy(), last_used.numpy(),
           prio_src.detach().to(torch.float64).contiguous().numpy(), cap, step, slots, miss)
    return torch.from_numpy(slots), torch.from_numpy(miss)


@numba.njit(nogil=True, cache=True)
def _attended_valid(valid, chosen, s_n, local_start, t, out):  # pragma: no cover - compiled
    b_n, h_n, k_n = chosen.shape
    for b in range(b_n):
        for h in range(h_n):
            for j in range(k_n):
                p = chosen[b, h, j]
                for i in range(s_n):
                    out[b, h, j * s_n + i] = p >= 0 and valid[b, p * s_n + i]
            for i in range(t - local_start):
                out[b, h, k_n * s_n + i] = valid[b, local_start + i]


def attended_valid(valid: torch.Tensor, chosen: torch.Tensor, page_size: int, local_start: int, t: int) -> torch.Tensor:
    """Which attended tokens are real: ``[B, H, k*S + (t - local_start)]`` bool.

    ``valid`` ``[B, >= t]``: the sequence's real tokens; ``chosen`` ``[B, H, k]``: the
    attended pages (-1: none), then the local window ``[local_start, t)``, in that order.
    """
    b, h, k = chosen.shape
    out = np.empty((b, h, k * page_size + t - local_start), np.bool_)
    _attended_valid(valid.contiguous().numpy(), chosen.contiguous().numpy(), page_size, local_start, t, out)
    return torch.from_numpy(out)
