import numpy as np
import pytest

from kvdrive.layout import packing_order


def test_without_clusters_pages_stay_in_token_order():
    pages = np.array([7, 3, 5, 1])
    perm = packing_order(pages)
    np.testing.assert_array_equal(pages[perm], [1, 3, 5, 7])


def test_pages_of_one_cluster_sit_side_by_side():
    pages = np.arange(8)
    cluster = np.array([2, 0, 1, 0, 2, 1, 0, 2])
    perm = packing_order(pages, cluster)
    np.testing.assert_array_equal(cluster[perm], [0, 0, 0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(pages[perm], [1, 3, 6, 2, 5, 0, 4, 7])


def test_client_order_ranks_pages_within_a_cluster():
    pages = np.array([10, 11, 12, 13, 14])
    cluster = np.array([1, 1, 0, 1, 0])
    order = np.array([5, 2, 9, 2, 1])
    perm = packing_order(pages, cluster, order)
    # Cluster 0: order 1 (page 14) then 9 (page 12); cluster 1: order 2 ties break by page (11, 13), then 10.
    np.testing.assert_array_equal(pages[perm], [14, 12, 11, 13, 10])


def test_order_without_clusters_is_the_only_key_before_pages():
    pages = np.array([0, 1, 2, 3])
    order = np.array([3, 0, 3, 1])
    np.testing.assert_array_equal(pages[packing_order(pages, None, order)], [1, 3, 0, 2])


@pytest.mark.parametrize("seed", range(10))
def test_random_inputs_give_a_sorted_permutation(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    pages = rng.permutation(1000)[:n]
    cluster = rng.integers(0, 6, n).astype(np.int32)
    order = rng.integers(-50, 50, n).astype(np.int32)
    perm = packing_order(pages, cluster, order)
    assert sorted(perm.tolist()) == list(range(n))
    keys = list(zip(cluster[perm].tolist(), order[perm].tolist(), pages[perm].tolist()))
    assert keys == sorted(keys)
    # Each cluster is one contiguous run of slots.
    c = cluster[perm]
    assert len(np.unique(c)) == int((np.diff(c) != 0).sum()) + 1
