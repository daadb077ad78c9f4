"""Device cache bookkeeping: slots, hits, eviction order."""

import torch

from kvdrive_client.device_cache import DeviceCache, EvictionPolicy


def cache(policy, capacity=4):
    return DeviceCache((1, 1, capacity, 2, 2), torch.float32, "cpu", policy)


def pages(*p):
    return torch.tensor([[list(p)]])


def consistent(c):
    for slot, page in enumerate(c.slot_page[0, 0].tolist()):
        if page >= 0:
            assert c.page_slot[0, 0, page] == slot
    mapped = (c.page_slot[0, 0] >= 0).sum().item()
    assert mapped == (c.slot_page[0, 0] >= 0).sum().item()


def test_misses_fill_empty_slots_then_hit():
    c = cache(EvictionPolicy.LRU)
    p = c.place(pages(5, 7), step=0)
    assert p.num_misses == 2 and p.num_hits == 0
    p = c.place(pages(7, 5), step=1)
    assert p.num_hits == 2
    consistent(c)


def test_lru_evicts_least_recently_used_unselected_page():
    c = cache(EvictionPolicy.LRU, capacity=3)
    c.place(pages(1, 2, 3), step=0)
    c.place(pages(1), step=1)
    c.place(pages(3), step=2)
    c.place(pages(9), step=3)  # page 2 was used longest ago
    assert c.lookup(pages(2)).item() == -1 and c.lookup(pages(1)).item() >= 0
    consistent(c)


def test_lookahead_evicts_lowest_current_score_and_never_the_selection():
    c = cache(EvictionPolicy.LOOKAHEAD, capacity=3)
    c.place(pages(1, 2, 3), step=0, slot_scores=torch.zeros(1, 1, 3))
    slot_of = {p: c.lookup(pages(p)).item() for p in (1, 2, 3)}
    scores = torch.zeros(1, 1, 3)
    scores[0, 0, slot_of[1]] = 5.0
    scores[0, 0, slot_of[2]] = 9.0
    scores[0, 0, slot_of[3]] = -9.0  # lowest, but selected this step: must stay
    c.place(pages(3, 8), step=1, slot_scores=scores)
    assert c.lookup(pages(1)).item() == -1
    assert c.lookup(pages(2)).item() >= 0 and c.lookup(pages(3)).item() >= 0
    consistent(c)


def test_fill_and_gather_move_the_right_bytes():
    c = cache(EvictionPolicy.LRU)
    placement = c.place(pages(4, 6), step=0)
    data = torch.arange(2 * 2 * 2, dtype=torch.float32).reshape(2, 2, 2)
    c.fill(placement, data, -data)
    k, v = c.gather(placement.slots)
    torch.testing.assert_close(k.reshape(2, 2, 2), data)
    torch.testing.assert_close(v.reshape(2, 2, 2), -data)


def test_none_entries_are_neither_hits_nor_misses_and_grow_keeps_contents():
    c = cache(EvictionPolicy.LRU, capacity=2)
    p = c.place(pages(3, -1), step=0)
    assert p.num_misses == 1
    c.grow(5)
    assert c.capacity == 5 and c.lookup(pages(3)).item() >= 0
    p = c.place(pages(3, 4, 5, 6), step=1)
    assert p.num_hits == 1 and p.num_misses == 3
    consistent(c)



def test_entries_that_select_no_page_are_neither_hits_nor_misses():
    from kvdrive_client.device_cache import Placement  # noqa: PLC0415

    pages = torch.tensor([[[3, -1, 5, -1]]])
    miss = torch.tensor([[[False, False, True, False]]])
    placement = Placement(torch.zeros_like(pages), miss, pages)
    host, _ = placement.to_host()
    assert (placement.num_hits, placement.num_misses) == (1, 1)
    assert (host.num_hits, host.num_misses) == (1, 1)
