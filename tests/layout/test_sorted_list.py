"""The allocator's sorted lists (layout/sorted_list.py) against a plain sorted list, with
sublists small enough that every operation crosses, splits and empties them."""

from bisect import bisect_left

import numpy as np
import pytest

from kvdrive.layout import sorted_list
from kvdrive.layout.sorted_list import SortedList


@pytest.mark.parametrize("load", [1, 2, 5, 512])
@pytest.mark.parametrize("seed", range(4))
def test_a_sorted_list_answers_as_a_plain_sorted_list_would(load, seed, monkeypatch):
    monkeypatch.setattr(sorted_list, "LOAD", load)
    rng = np.random.default_rng(seed)
    start = sorted(set(rng.integers(0, 400, 30).tolist()))
    got, want = SortedList(start), list(start)
    for _ in range(1500):
        x = int(rng.integers(0, 400))
        if x in want and rng.random() < 0.6:
            got.remove(x)
            want.remove(x)
        elif x not in want:
            got.add(x)
            want.insert(bisect_left(want, x), x)
        else:
            with pytest.raises(ValueError, match="not in the list"):
                got.remove(x + 1000)
        q = int(rng.integers(-5, 405))
        i = bisect_left(want, q)
        assert got.ceiling(q) == (want[i] if i < len(want) else None)
        assert got.below(q) == (want[i - 1] if i else None)
        assert got.last() == (want[-1] if want else None)
        assert list(got.irange(q)) == want[i:]
        assert len(got) == len(want)
    assert list(got) == want and list(reversed(got)) == want[::-1]
    for x in list(want):
        got.remove(x)
    assert len(got) == 0 and got.last() is None and got.ceiling(0) is None and got.below(10 ** 6) is None
