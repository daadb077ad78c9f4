"""The put staging pool: mappings reused by size class, bounded, never two users at once."""

import pytest

from kvstored.staging import MIN_CLASS, StagingPool, size_class


def test_size_classes_are_powers_of_two_from_one_mib():
    assert size_class(1) == size_class(MIN_CLASS) == MIN_CLASS
    assert size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(3 << 20) == 4 << 20


def test_a_given_mapping_is_taken_again_and_the_pool_keeps_no_more_than_its_bound():
    pool = StagingPool(max_bytes=4 << 20)
    a, va = pool.take(2 << 20)
    b, vb = pool.take(2 << 20)
    assert a is not b and len(va) == len(vb) == 2 << 20
    va[:] = 7
    del va, vb
    pool.give(a)
    pool.give(b)
    assert pool.kept_bytes == 4 << 20
    c, _ = pool.take(1_500_000)  # the same class
    assert c in (a, b) and pool.reused == 1 and pool.kept_bytes == 2 << 20
    d, vd = pool.take(8 << 20)  # past the bound once given back: unmapped
    del vd
    pool.give(d)
    assert d.closed and pool.kept_bytes == 2 << 20
    pool.close()
    assert pool.kept_bytes == 0


def test_a_mapping_still_viewed_is_not_kept_quietly():
    pool = StagingPool(max_bytes=0)
    m, view = pool.take(MIN_CLASS)
    with pytest.raises(BufferError):
        pool.give(m)  # with no room it is unmapped, and a live view refuses that
    del view
    m.close()
