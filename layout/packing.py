"""Semantic-contiguous extent packing: which slot each page of an extent takes."""

from __future__ import annotations

import numpy as np


def packing_order(pages: np.ndarray, cluster: np.ndarray | None = None, order: np.ndarray | None = None) -> np.ndarray:
    """Permutation of ``pages`` that puts one cluster's pages side by side.

    Pages sort by cluster id, then by the client's packing order within the cluster,
    then by page number, so pages that the index tends to select together are
    adjacent on disk and a sparse read of them becomes one large I/O. Without
    cluster ids the extent is laid out in token order.
    """
    pages = np.asarray(pages)
    keys = [pages]
    if order is not None:
        keys.append(np.asarray(order))
    if cluster is not None:
        keys.append(np.asarray(cluster))
    # lexsort sorts by the last key first.
    return np.lexsort(keys)
