"""Device-cache placement of every backend against :func:`kvdrive.kernels.reference.place`, step after step.

The victim priority is built as :meth:`kvdrive_client.device_cache.DeviceCache.place`
builds it: the slots' last use for LRU (and for a cache without reuse, whose maps are
cleared before every step), the current scores of the cached pages for lookahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import os
import sys

import pytest
import torch

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the interpreter is chosen at triton's first import

from kvdrive.kernels import for_device  # noqa: E402
from kvdrive.kernels import reference as ref  # noqa: E402

from kernel_cases import BACKENDS, random_slots  # noqa: E402


def _triton_missing() -> str | None:
    try:
        from kvdrive.kernels import triton_kernels as tk  # noqa: PLC0415
    except ImportError as e:
        return f"the Triton kernels do not load: {e}"
    return None if tk.INTERPRETED else "the Triton kernels need Triton's interpreter here (TRITON_INTERPRET=1)"


@pytest.fixture(params=[*BACKENDS, "triton"])
def kernels(request):
    """Each backend that places on CPU tensors: the CPU's, the references, Triton's under its interpreter."""
    if request.param == "triton" and (why := _triton_missing()):
        pytest.skip(why)
    return for_device("cpu", request.param)

B, H, CAPACITY = 2, 3, 12


@dataclass
class Maps:
    """The three maps a device cache keeps per (row, head), as DeviceCache allocates them."""

    page_slot: torch.Tensor
    slot_page: torch.Tensor
    last_used: torch.Tensor

    @classmethod
    def empty(cls, num_pages: int) -> "Maps":
        return cls(torch.full((B, H, num_pages + 5), -1, dtype=torch.long),  # spare pages past the largest
                   torch.full((B, H, CAPACITY), -1, dtype=torch.long), torch.zeros(B, H, CAPACITY, dtype=torch.long))

    def differ(self, other: "Maps") -> list[str]:
        names = ("page_slot", "slot_page", "last_used")
        return [n for n in names if not torch.equal(getattr(self, n), getattr(other, n))]


def place(fn, maps: Maps, pages, step, scores, policy, reuse, head_capacity):
    if not reuse:
        maps.page_slot.fill_(-1)
        maps.slot_page.fill_(-1)
    prio = scores if policy == "lookahead" and reuse else maps.last_used
    return fn(pages, maps.page_slot, maps.slot_page, maps.last_used, prio, head_capacity, step)


def assert_placed(maps: Maps, before: torch.Tensor, pages, slots, miss, step, head_capacity) -> None:
    """What any placement must give: hits stay where they were, misses are the unmapped
    pages and land in a slot of their head's window, the selection is mapped both ways and
    marked used at ``step``, and the two maps stay each other's inverse."""
    sel = pages >= 0
    was = before.gather(2, pages.clamp_min(0))
    assert torch.equal(miss, sel & (was < 0))
    assert torch.equal(slots[sel & ~miss], was[sel & ~miss])
    window = torch.full((H,), CAPACITY) if head_capacity is None else head_capacity
    assert ((slots >= 0) & (slots < window[None, :, None])).all()
    bi, hi, ki = torch.nonzero(sel, as_tuple=True)
    assert torch.equal(maps.page_slot[bi, hi, pages[bi, hi, ki]], slots[bi, hi, ki])
    assert torch.equal(maps.slot_page[bi, hi, slots[bi, hi, ki]], pages[bi, hi, ki])
    assert (maps.last_used[bi, hi, slots[bi, hi, ki]] == step).all()
    for b in range(B):
        for h in range(H):
            mapped = maps.slot_page[b, h]
            filled = torch.nonzero(mapped >= 0).flatten()
            assert torch.equal(maps.page_slot[b, h, mapped[filled]], filled)
            assert int((maps.page_slot[b, h] >= 0).sum()) == len(filled)


def _selection(g, k, num_pages, none_share=0.1):
    sel = random_slots(g, B, H, k, num_pages)
    return sel.masked_fill(torch.rand(B, H, k, generator=g) < none_share, -1)


@pytest.mark.parametrize("policy, reuse, per_head, num_pages, k", [
    ("lookahead", True, None, 40, 6),
    ("lru", True, None, 200, 12),  # many misses: more than eight a head
    ("lookahead", True, (6, 9, 12), 30, 6),  # per-head windows
    ("lru", True, (6, 9, 12), 30, 6),
    ("lookahead", True, None, 200, 12),
    ("lru", False, None, 40, 6),  # no reuse: every step fetches all it selects
    ("lookahead", False, None, 40, 6),  # no reuse: prioritised by last use, as LRU
])
def test_placement_matches_reference_step_after_step(kernels, policy, reuse, per_head, num_pages, k):
    """Same slots, misses and maps as the reference after every step: both policies, per-head
    windows, -1 entries, a head with nothing selected, few and many misses, tied priorities."""
    g = torch.Generator().manual_seed(0)
    head_capacity = None if per_head is None else torch.tensor(per_head)
    mine, theirs = Maps.empty(num_pages), Maps.empty(num_pages)
    saw_misses = set()
    for step in range(25):
        pages = _selection(g, k, num_pages)
        if step % 6 == 5:
            pages[1, 2] = -1  # a head with nothing selected this step
        scores = torch.randn(B, H, CAPACITY, generator=g).round(decimals=1)  # ties happen
        before = mine.page_slot.clone() if reuse else torch.full_like(mine.page_slot, -1)
        slots, miss = place(kernels.place, mine, pages, step, scores, policy, reuse, head_capacity)
        expect_slots, expect_miss = place(ref.place, theirs, pages, step, scores, policy, reuse, head_capacity)
        assert torch.equal(slots, expect_slots) and torch.equal(miss, expect_miss), step
        assert not mine.differ(theirs), (step, mine.differ(theirs))
        assert_placed(mine, before, pages, slots, miss, step, head_capacity)
        saw_misses.update(miss.sum(dim=-1).flatten().tolist())
    assert min(saw_misses) <= 2 and (max(saw_misses) > 8 if k > 8 else max(saw_misses) >= 4)


def test_triton_placement_reads_priorities_by_page():
    """The lookahead priority as the cached pages' scores read in the kernel (PagePriority) places
    as the reference does with reference.gather_scores of them."""
    if why := _triton_missing():
        pytest.skip(why)
    from kvdrive.kernels.triton_placement import PagePriority, place as triton_place

    g = torch.Generator().manual_seed(2)
    num_pages = 40
    mine, theirs = Maps.empty(num_pages), Maps.empty(num_pages)
    for step in range(12):
        pages = _selection(g, 6, num_pages)
        scores = torch.randn(B, H, num_pages, generator=g).round(decimals=1)
        slots, miss = triton_place(pages, mine.page_slot, mine.slot_page, mine.last_used, PagePriority(scores),
                                   None, step)
        prio = ref.gather_scores(scores, theirs.slot_page)
        expect = ref.place(pages, theirs.page_slot, theirs.slot_page, theirs.last_used, prio, None, step)
        assert torch.equal(slots, expect[0]) and torch.equal(miss, expect[1]), step
        assert not mine.differ(theirs), step


def test_placement_of_nothing_changes_nothing(kernels):
    g = torch.Generator().manual_seed(1)
    maps = Maps.empty(40)
    place(kernels.place, maps, _selection(g, 6, 40, 0.0), 0, None, "lru", True, None)
    kept = Maps(maps.page_slot.clone(), maps.slot_page.clone(), maps.last_used.clone())
    for pages in (torch.zeros(B, H, 0, dtype=torch.long), torch.full((B, H, 4), -1)):
        slots, miss = place(kernels.place, maps, pages, 1, None, "lru", True, None)
        assert slots.shape == miss.shape == pages.shape and not miss.any()
        assert not maps.differ(kept)
