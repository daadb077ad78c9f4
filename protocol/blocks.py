"""How an engine block of a given size is laid out in kvstored, shared by the daemon and its clients.

An engine block is an opaque run of ``block_bytes`` bytes. kvstored stores it as
``parts`` kvstored blocks of one page each (float16 K and V of ``page_size`` x
``head_dim``, one head): one part up to 64 MiB, equal layers past that (a 1 GiB block is
16 parts of 64 MiB). Part ``l`` of a block is its bytes ``[l * part_bytes, (l + 1) *
part_bytes)``.
"""

from __future__ import annotations

from kvdrive.layout.geometry import MAX_HEAD_DIM, MAX_LAYERS, MAX_PAGE_SIZE, Geometry

MAX_PART_BYTES = 4 * MAX_PAGE_SIZE * MAX_HEAD_DIM  # the largest kvstored block: 64 MiB
MAX_BLOCK_BYTES = MAX_PART_BYTES * 32  # 2 GiB: one put, well within kvstored's 4 GiB per put


def block_geometry(block_bytes: int, regions: int = 1) -> Geometry:
    """The geometry holding a block of ``block_bytes`` as one page: float16 K and V of
    ``page_size`` x ``head_dim``, one head, in as few layers (parts) as keep each part
    within kvstored's largest block and, for a block that lies in ``regions`` equal
    regions (its K and V, say), each part within one region; ValueError for a size no
    such geometry has."""
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0 or block_bytes % 4:
        raise ValueError(f"an engine block must be a positive multiple of 4 bytes, got {block_bytes!r}")
    if block_bytes > MAX_BLOCK_BYTES:
        raise ValueError(f"an engine block of {block_bytes} bytes is over the {MAX_BLOCK_BYTES >> 30} GiB "
                         f"a block store takes (one put of kvstored)")
    check_regions(block_bytes, regions)
    first = -(-block_bytes // MAX_PART_BYTES)
    for parts in range(-(-first // regions) * regions, min(MAX_LAYERS, block_bytes // 4) + 1, regions):
        if block_bytes % (4 * parts):
            continue
        elems = block_bytes // (4 * parts)  # page_size x head_dim of each part
        for head_dim in range(min(MAX_HEAD_DIM, elems), 0, -1):
            if elems % head_dim == 0:
                page_size = elems // head_dim
                if page_size > MAX_PAGE_SIZE:
                    break
                return Geometry(num_layers=parts, num_kv_heads=1, head_dim=head_dim, dtype="float16",
                                page_size=page_size)
    raise ValueError(
        f"an engine block of {block_bytes} bytes does not split into kvstored blocks (at most "
        f"{MAX_PART_BYTES} bytes each, 4 x page_size x head_dim, page_size and head_dim at most "
        f"{MAX_PAGE_SIZE}{'' if regions == 1 else f', a whole number of them in each of {regions} regions'}); "
        f"a size with more factors of two fits"
    )


def check_regions(block_bytes: int, regions: int) -> None:
    """ValueError unless a block of ``block_bytes`` splits into ``regions`` equal regions of
    a multiple of 4 bytes each, at most ``MAX_LAYERS`` of them."""
    if not isinstance(regions, int) or isinstance(regions, bool) or not 1 <= regions <= MAX_LAYERS:
        raise ValueError(f"a block's regions must be 1..{MAX_LAYERS}, got {regions!r}")
    if block_bytes % (4 * regions):
        raise ValueError(f"a block of {block_bytes} bytes does not split into {regions} equal regions of a "
                         f"multiple of 4 bytes")
