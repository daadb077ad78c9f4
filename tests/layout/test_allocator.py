import numpy as np
import pytest

from kvdrive.layout import ALIGN, ExtentAllocator, SpaceError


def check_invariants(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    """Holes are sorted, aligned, disjoint, not adjacent, below ``end``, and never overlap a live range."""
    holes = alloc.holes
    for (s0, n0), (s1, _) in zip(holes, holes[1:]):
        assert s0 + n0 < s1, f"holes {holes} overlap or touch (they should have merged)"
    for s, n in holes:
        assert s % alloc.align == 0 and n % alloc.align == 0 and n > 0
        assert s + n < alloc.end, "a hole reaching end should have gone back to the tail"
    spans = sorted([(s, n) for s, n in holes] + [(s, n) for s, n in live.items()])
    pos = 0
    for s, n in spans:
        assert s == pos, f"space [{pos}, {s}) is neither free nor in use"
        pos = s + n
    assert pos == alloc.end
    assert alloc.used_bytes == sum(live.values())
    assert alloc.end <= alloc.capacity


def test_allocations_are_aligned_and_grow_from_the_tail():
    alloc = ExtentAllocator(1 << 20)
    a = alloc.allocate(1)
    b = alloc.allocate(ALIGN + 1)
    c = alloc.allocate(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert alloc.end == 4 * ALIGN and alloc.used_bytes == 4 * ALIGN


def test_capacity_is_rounded_down_to_alignment():
    assert ExtentAllocator(3 * ALIGN + 17).capacity == 3 * ALIGN


def test_best_fit_picks_the_smallest_hole_that_fits():
    alloc = ExtentAllocator(1 << 20)
    offs = [alloc.allocate(n * ALIGN) for n in (4, 1, 2, 1, 3, 1)]
    # Holes of 4, 2 and 3 pages, separated by live single pages.
    alloc.free(offs[0], 4 * ALIGN)
    alloc.free(offs[2], 2 * ALIGN)
    alloc.free(offs[4], 3 * ALIGN)
    assert alloc.allocate(2 * ALIGN) == offs[2]  # the exact fit
    assert alloc.allocate(3 * ALIGN - 100) == offs[4]  # 3 fits better than 4
    assert alloc.allocate(ALIGN) == offs[0]  # only the 4-page hole is left; its front is taken
    assert alloc.holes == [(offs[0] + ALIGN, 3 * ALIGN)]


def test_freed_neighbours_coalesce_in_any_order():
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1]):
        alloc = ExtentAllocator(1 << 20)
        offs = [alloc.allocate(ALIGN) for _ in range(4)]  # the 4th keeps the tail busy
        for i in order:
            alloc.free(offs[i], ALIGN)
        assert alloc.holes == [(0, 3 * ALIGN)], order
        assert alloc.allocate(3 * ALIGN) == 0


def test_a_hole_at_the_tail_shrinks_end():
    alloc = ExtentAllocator(1 << 20)
    a = alloc.allocate(ALIGN)
    b = alloc.allocate(2 * ALIGN)
    alloc.free(b, 2 * ALIGN)
    assert alloc.end == ALIGN and alloc.holes == []
    alloc.free(a, ALIGN)
    assert alloc.end == 0 and alloc.used_bytes == 0


def test_freed_space_is_reused_before_growing():
    alloc = ExtentAllocator(1 << 20)
    offs = [alloc.allocate(2 * ALIGN) for _ in range(5)]
    end = alloc.end
    alloc.free(offs[1], 2 * ALIGN)
    alloc.free(offs[3], 2 * ALIGN)
    assert sorted([alloc.allocate(2 * ALIGN), alloc.allocate(ALIGN), alloc.allocate(ALIGN)]) == [
        offs[1], offs[3], offs[3] + ALIGN,
    ]
    assert alloc.end == end


def test_full_capacity_raises_space_error_with_numbers():
    alloc = ExtentAllocator(4 * ALIGN)
    a = alloc.allocate(ALIGN)
    alloc.allocate(ALIGN)
    alloc.allocate(2 * ALIGN)
    assert not alloc.can_allocate(1)
    with pytest.raises(SpaceError, match=r"need 4096 bytes.*0 free of 16384"):
        alloc.allocate(1)
    alloc.free(a, ALIGN)
    assert alloc.can_allocate(ALIGN) and not alloc.can_allocate(ALIGN + 1)
    with pytest.raises(SpaceError, match="largest hole 4096"):
        alloc.allocate(2 * ALIGN)
    assert alloc.allocate(ALIGN) == a


def test_fragmented_free_space_does_not_satisfy_a_large_request():
    alloc = ExtentAllocator(6 * ALIGN)
    offs = [alloc.allocate(ALIGN) for _ in range(6)]
    for o in offs[::2]:
        alloc.free(o, ALIGN)
    assert alloc.free_bytes == 3 * ALIGN
    with pytest.raises(SpaceError):
        alloc.allocate(2 * ALIGN)


@pytest.mark.parametrize("nbytes", [0, -ALIGN])
def test_non_positive_sizes_are_refused(nbytes):
    with pytest.raises(ValueError, match="must be > 0"):
        ExtentAllocator(1 << 20).allocate(nbytes)


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        ExtentAllocator(-1)


def test_double_free_and_foreign_ranges_are_refused():
    alloc = ExtentAllocator(1 << 20)
    offs = [alloc.allocate(2 * ALIGN) for _ in range(3)]
    alloc.free(offs[1], 2 * ALIGN)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(offs[1], 2 * ALIGN)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(offs[1] + ALIGN, ALIGN)  # inside the hole
    with pytest.raises(ValueError, match="double free"):
        alloc.free(offs[0] + ALIGN, 2 * ALIGN)  # overlaps the hole's front
    with pytest.raises(ValueError, match="never allocated"):
        alloc.free(offs[2] + 2 * ALIGN, ALIGN)  # past end
    with pytest.raises(ValueError, match="never allocated"):
        alloc.free(offs[0] + 1, ALIGN)  # unaligned
    assert alloc.holes == [(offs[1], 2 * ALIGN)]


def test_from_used_rebuilds_holes_and_refuses_overlaps():
    alloc = ExtentAllocator.from_used(1 << 20, [(8 * ALIGN, ALIGN), (0, ALIGN + 5), (3 * ALIGN, ALIGN)])
    assert alloc.holes == [(2 * ALIGN, ALIGN), (4 * ALIGN, 4 * ALIGN)]
    assert alloc.end == 9 * ALIGN and alloc.used_bytes == 4 * ALIGN
    assert alloc.allocate(4 * ALIGN) == 4 * ALIGN
    with pytest.raises(ValueError, match="overlap"):
        ExtentAllocator.from_used(1 << 20, [(0, 2 * ALIGN), (ALIGN, ALIGN)])


@pytest.mark.parametrize("seed", range(8))
def test_random_allocate_free_keeps_the_space_consistent(seed):
    rng = np.random.default_rng(seed)
    capacity = 256 * ALIGN
    alloc = ExtentAllocator(capacity)
    live: dict[int, int] = {}
    for _ in range(400):
        if live and rng.random() < 0.45:
            start = int(rng.choice(list(live)))
            alloc.free(start, live.pop(start))
        else:
            size = int(rng.integers(1, 9 * ALIGN))
            fits = alloc.can_allocate(size)
            try:
                start = alloc.allocate(size)
            except SpaceError:
                assert not fits
                continue
            assert fits
            size = -(-size // ALIGN) * ALIGN
            assert all(start + size <= s or s + n <= start for s, n in live.items()), "overlapping allocation"
            live[start] = size
        check_invariants(alloc, live)
    # Everything rebuilt from the live ranges matches the allocator's own view.
    rebuilt = ExtentAllocator.from_used(capacity, live.items())
    assert rebuilt.holes == alloc.holes and rebuilt.end == alloc.end
    assert list(alloc.largest_holes()) == sorted(alloc.holes, key=lambda h: (h[1], h[0]), reverse=True)
    for start, size in list(live.items()):
        alloc.free(start, size)
    assert alloc.end == 0 and alloc.holes == []


def best_fit(holes: list[tuple[int, int]], size: int) -> int | None:
    """The hole a best fit takes, by a scan: the smallest that fits, the lowest of those."""
    fits = [(n, s) for s, n in holes if n >= size]
    return min(fits)[1] if fits else None


@pytest.mark.parametrize("load", [None, 2], ids=["sublists of 512", "sublists of 2"])
@pytest.mark.parametrize("seed", range(6))
def test_each_allocation_takes_the_smallest_hole_that_fits_the_lowest_of_equals(seed, load, monkeypatch):
    """The allocator finds its best fit by a search of the holes ordered by size, not a scan of
    them all: every allocation takes the hole a scan would (or the tail where none fits), and
    a rebuilt allocator chooses as the one it was rebuilt from. (With sublists of 2, the
    holes' orders span many: layout/sorted_list.py.)"""
    if load:
        from kvdrive.layout import sorted_list

        monkeypatch.setattr(sorted_list, "LOAD", load)
    rng = np.random.default_rng(100 + seed)
    alloc = ExtentAllocator(4096 * ALIGN)
    live: dict[int, int] = {}
    for step in range(600):
        if live and rng.random() < 0.5:
            start = int(rng.choice(list(live)))
            alloc.free(start, live.pop(start))
            continue
        size = int(rng.choice([1, 2, 3, 8, 16])) * ALIGN
        want, end = best_fit(alloc.holes, size), alloc.end
        try:
            start = alloc.allocate(size)
        except SpaceError:
            assert want is None and end + size > alloc.capacity
            continue
        assert start == (end if want is None else want), step
        live[start] = size
        check_invariants(alloc, live)
        if step % 100 == 99:
            rebuilt = ExtentAllocator.from_used(alloc.capacity, live.items())
            want, got = best_fit(alloc.holes, ALIGN), alloc.allocate(ALIGN)
            assert rebuilt.allocate(ALIGN) == got == (alloc.end - ALIGN if want is None else want)
            live[got] = ALIGN
