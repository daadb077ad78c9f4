"""The offline cache simulator: Belady against exhaustive search, LOOKAHEAD/LRU against DeviceCache."""

import functools
import itertools

import numpy as np
import pytest
import torch

from kvdrive_client.cache_sim import CachePolicy, Trace, simulate, stream_hits
from kvdrive_client.device_cache import DeviceCache, EvictionPolicy


def random_selected(rng, steps, pool, k, pad=True):
    """``[steps, k]`` distinct pages from ``range(pool)`` per step; some steps padded with -1."""
    out = np.full((steps, k), -1, dtype=np.int64)
    for t in range(steps):
        n = int(rng.integers(1, k + 1)) if pad else k
        out[t, :n] = rng.choice(pool, size=n, replace=False)
    return out


def brute_force_hits(selected, capacity):
    """Most hits over every eviction choice (any victims, at any miss, free slots or not)."""
    steps = [tuple(int(p) for p in row if p >= 0) for row in selected]

    @functools.lru_cache(maxsize=None)
    def best(t, cached):
        if t == len(steps):
            return 0
        pages = steps[t]
        hits = sum(p in cached for p in pages)
        misses = [p for p in pages if p not in cached]
        evictable = sorted(cached - set(pages))
        must = len(cached) + len(misses) - capacity
        options = []
        for n in range(max(0, must), len(evictable) + 1):
            for victims in itertools.combinations(evictable, n):
                options.append(best(t + 1, frozenset((cached - set(victims)) | set(misses))))
        return hits + max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_belady_matches_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    capacity = int(rng.integers(k, k + 3))
    selected = random_selected(rng, steps=int(rng.integers(4, 9)), pool=int(rng.integers(k + 1, 8)), k=k)
    assert sum(stream_hits(selected, None, capacity, CachePolicy.BELADY)) == brute_force_hits(selected, capacity)


def device_cache_hits(selected, scores, capacity, policy, seeded=None):
    """Hits per step and head of DeviceCache.place driven by ``selected`` ``[H, T, k]``."""
    h, steps, _ = selected.shape
    cache = DeviceCache((1, h, capacity, 1, 1), torch.float32, "cpu", policy)
    if seeded is not None:  # as the session seeds: each head's first ``capacity`` pages, -1 leaves a slot empty
        pages = torch.from_numpy(seeded[None, :, :capacity])
        cache.seed(pages, torch.zeros(*pages.shape, 1, 1), torch.zeros(*pages.shape, 1, 1))
    out = np.zeros((h, steps), dtype=np.int64)
    for t in range(steps):
        pages = torch.from_numpy(selected[None, :, t])
        slot_scores = None
        if policy is EvictionPolicy.LOOKAHEAD:
            # What Selector.page_scores gives: the current score of each cached page, -inf for empty slots.
            s = torch.from_numpy(scores[None, :, t])
            slot_scores = s.gather(2, cache.slot_page.clamp_min(0)).masked_fill(cache.slot_page < 0, float("-inf"))
        placement = cache.place(pages, t, slot_scores)
        out[:, t] = ((~placement.miss) & (pages >= 0))[0].sum(dim=1).numpy()
    return out


@pytest.mark.parametrize("policy", [CachePolicy.LOOKAHEAD, CachePolicy.LRU])
@pytest.mark.parametrize("seed", range(12))
def test_lookahead_and_lru_match_device_cache(policy, seed):
    rng = np.random.default_rng(seed)
    heads, steps, pool = 3, 40, 24
    k = int(rng.integers(2, 6))
    capacity = int(rng.integers(k, 3 * k + 1))
    selected = np.stack([random_selected(rng, steps, pool, k) for _ in range(heads)])
    # Few distinct score values, so that ties (broken by slot number) happen often.
    scores = rng.integers(0, 4, size=(heads, steps, pool)).astype(np.float32)
    expected = device_cache_hits(selected, scores, capacity, EvictionPolicy(policy.value))
    for head in range(heads):
        assert stream_hits(selected[head], scores[head], capacity, policy) == expected[head].tolist()
    result = simulate(Trace(selected, scores), capacity, policy)
    assert result.hits == expected.sum()
    assert result.lookups == (selected >= 0).sum()


@pytest.mark.parametrize("policy", [CachePolicy.LOOKAHEAD, CachePolicy.LRU])
@pytest.mark.parametrize("seed", range(8))
def test_a_seeded_replay_matches_a_seeded_device_cache(policy, seed):
    rng = np.random.default_rng(100 + seed)
    heads, steps, pool = 3, 30, 24
    k = int(rng.integers(2, 6))
    capacity = int(rng.integers(k, 3 * k + 1))
    selected = np.stack([random_selected(rng, steps, pool, k) for _ in range(heads)])
    scores = rng.integers(0, 4, size=(heads, steps, pool)).astype(np.float32)
    seeded = np.stack([rng.permutation(pool) for _ in range(heads)])
    seeded[0, 1] = -1  # a head seeded with one slot left empty
    expected = device_cache_hits(selected, scores, capacity, EvictionPolicy(policy.value), seeded)
    cold = device_cache_hits(selected, scores, capacity, EvictionPolicy(policy.value))
    trace = Trace(selected, scores, seeded[:, :capacity])
    for head in range(heads):
        assert stream_hits(selected[head], scores[head], capacity, policy, trace.seeded[head]) == expected[head].tolist()
    assert simulate(trace, capacity, policy).hits == expected.sum()
    assert expected[:, 0].sum() >= cold[:, 0].sum()  # the first step finds the seeded pages


def test_belady_bounds_the_online_policies_and_more_room_helps():
    rng = np.random.default_rng(7)
    selected = np.stack([random_selected(rng, 60, 40, 6, pad=False) for _ in range(4)])
    scores = rng.standard_normal((4, 60, 40)).astype(np.float32)
    trace = Trace(selected, scores)
    assert trace.max_selected == 6
    for capacity in (6, 12, 24):
        best = simulate(trace, capacity, CachePolicy.BELADY)
        for policy in (CachePolicy.LOOKAHEAD, CachePolicy.LRU):
            assert simulate(trace, capacity, policy).hits <= best.hits
    rates = [simulate(trace, c, CachePolicy.BELADY).hit_rate for c in (6, 12, 24, 40)]
    assert rates == sorted(rates)
    # Room for every page: only the first use of each page misses.
    assert simulate(trace, 40, CachePolicy.LRU).hits == simulate(trace, 40, CachePolicy.BELADY).hits


def test_belady_from_a_seeding_evicts_pages_never_selected_first():
    selected = np.array([[0, 1], [2, 3], [0, 1]])
    # Seeded with 0, 1 and two pages no step selects: those go first, so 0 and 1 stay for step 2.
    hits = stream_hits(selected, None, 4, CachePolicy.BELADY, seeded=np.array([0, 1, 8, 9]))
    assert hits == [2, 0, 2]
    lru = stream_hits(selected, None, 4, CachePolicy.LRU, seeded=np.array([0, 1, 8, 9]))
    assert lru[0] == 2 and sum(lru) <= sum(hits)


def test_bad_traces_are_refused():
    with pytest.raises(ValueError, match="selects 3 pages but the cache holds 2"):
        stream_hits(np.array([[0, 1, 2]]), None, 2, CachePolicy.LRU)
    with pytest.raises(ValueError, match="twice"):
        stream_hits(np.array([[1, 1]]), None, 2, CachePolicy.BELADY)
    with pytest.raises(ValueError, match="needs the trace's scores"):
        stream_hits(np.array([[1]]), None, 2, CachePolicy.LOOKAHEAD)
    with pytest.raises(ValueError, match="scores must be"):
        Trace(np.zeros((2, 3, 1), dtype=np.int64), np.zeros((2, 4, 5), dtype=np.float32))
