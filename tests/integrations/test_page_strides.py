"""The regions of a call's host pages, computed from the pool's strides once its own
``get_page_buffer_meta`` has agreed with them on CHECKED_CALLS calls: the same spans as the
pool's answer on every call, for pools of each layout, for a pool whose pages sit behind a
page table (never computed), for one whose layout changes under the backend (caught by the
check of each call's last page) and for host indices that are not whole pages; and pages
that load back byte for byte through a real kvstored once the strides are in use."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvdrive.tools.engines import MHAHostPool, MLAHostPool, PageFirstHostPool, ShmHostAllocator
from kvdrive_client.integrations.page_strides import CHECKED_CALLS
from test_sglang import PAGE, POOL_PAGES, backend, host_indices, keys, page_bytes, sgl  # noqa: F401 - sgl: a fixture


class Counting:
    """A host pool's ``get_page_buffer_meta``, counting the pages it is asked for."""

    def __init__(self, pool, page_tokens: int) -> None:
        self.pool, self.page_tokens, self.pages = pool, page_tokens, []
        self.real = pool.get_page_buffer_meta
        pool.get_page_buffer_meta = self

    def __call__(self, indices):
        self.pages.append(len(indices) // self.page_tokens)
        return self.real(indices)


def pools(sgl):
    bf16 = sgl.torch.bfloat16
    made = [MHAHostPool(POOL_PAGES, PAGE, 2, 2, 16, bf16, layout=layout)
            for layout in ("page_first", "page_first_direct", "page_head", "layer_first")]
    made += [MLAHostPool(POOL_PAGES, PAGE, 3, 64, 32, bf16, layout=layout)
             for layout in ("page_first", "page_first_direct", "layer_first")]
    return made


def answer(sgl, pool, pages):
    """What the pool itself says: the spans of its own ``get_page_buffer_meta``."""
    ptrs, sizes = pool.get_page_buffer_meta.real(host_indices(sgl, pages))
    return (np.asarray(ptrs, np.int64) - pool.kv_buffer.data_ptr()).reshape(len(pages), -1), sizes[0]


def regions(sgl, pool, pages, page_bytes_):
    return sgl.adapter._regions(pool, page_bytes_, len(pages), host_indices(sgl, pages))


@pytest.mark.parametrize("which", range(7))
def test_computed_regions_are_the_pools_own_for_each_layout(sgl, which):
    pool = pools(sgl)[which]
    counting = Counting(pool, PAGE)
    rng = random.Random(which)
    size = pool.get_size_per_token() * PAGE
    for call in range(CHECKED_CALLS + 12):
        pages = rng.sample(range(POOL_PAGES), rng.randint(1, 9))
        got = regions(sgl, pool, pages, size)
        want, span = answer(sgl, pool, pages)
        assert np.array_equal(got.offsets, want) and got.span == span, (pool.layout, call)
    strides = sgl.adapter._STRIDES[pool]
    assert strides.ready and not strides.off
    # Once ready, the pool is asked for one page a call: the check of the last.
    assert counting.pages[-10:] == [1] * 10


def test_a_pool_behind_a_page_table_is_always_asked(sgl, caplog):
    pool = PageFirstHostPool(POOL_PAGES, PAGE, 2, 2, 16, sgl.torch.bfloat16)
    table = list(range(POOL_PAGES))
    random.Random(1).shuffle(table)
    real = type(pool).get_page_buffer_meta

    def shuffled(indices):  # host page p lies in the pool's page table[p]
        moved = sgl.torch.tensor([table[int(i) // PAGE] * PAGE + int(i) % PAGE for i in indices.tolist()])
        return real(pool, moved)

    pool.get_page_buffer_meta = shuffled
    counting = Counting(pool, PAGE)
    size = pool.get_size_per_token() * PAGE
    with caplog.at_level("INFO", logger="kvdrive_client.integrations.page_strides"):
        for call in range(CHECKED_CALLS + 4):
            pages = random.Random(call).sample(range(POOL_PAGES), 6)
            want, _ = answer(sgl, pool, pages)
            assert np.array_equal(regions(sgl, pool, pages, size).offsets, want)
    assert sgl.adapter._STRIDES[pool].off and "asked of it page by page" in caplog.text
    assert counting.pages[-4:] == [6] * 4


def test_a_layout_that_changes_is_caught_by_the_last_page_check(sgl):
    pool = PageFirstHostPool(POOL_PAGES, PAGE, 2, 2, 16, sgl.torch.bfloat16)
    Counting(pool, PAGE)
    size = pool.get_size_per_token() * PAGE
    for call in range(CHECKED_CALLS):
        regions(sgl, pool, [call % POOL_PAGES, (call + 5) % POOL_PAGES], size)
    assert sgl.adapter._STRIDES[pool].ready
    real = pool.get_page_buffer_meta.real

    def reversed_pages(indices):
        flipped = sgl.torch.tensor([(POOL_PAGES - 1 - int(i) // PAGE) * PAGE + int(i) % PAGE for i in indices.tolist()])
        return real(flipped)

    pool.get_page_buffer_meta.real = reversed_pages
    want, _ = answer(sgl, pool, [2, 9, 4])
    assert np.array_equal(regions(sgl, pool, [2, 9, 4], size).offsets, want)
    assert sgl.adapter._STRIDES[pool].off


def test_host_indices_that_are_not_whole_pages_are_asked_of_the_pool(sgl):
    pool = PageFirstHostPool(POOL_PAGES, PAGE, 2, 2, 16, sgl.torch.bfloat16)
    counting = Counting(pool, PAGE)
    size = pool.get_size_per_token() * PAGE
    for call in range(CHECKED_CALLS):
        regions(sgl, pool, [call % POOL_PAGES, (call + 3) % POOL_PAGES], size)
    shifted = host_indices(sgl, [3, 7]) + 1  # each page's first index one past a page's start
    got = sgl.adapter._regions(pool, size, 2, shifted)
    ptrs, _ = pool.get_page_buffer_meta.real(shifted)
    assert np.array_equal(got.offsets.reshape(-1), np.asarray(ptrs, np.int64) - pool.kv_buffer.data_ptr())
    assert counting.pages[-1] == 2 and not sgl.adapter._STRIDES[pool].off


def test_pages_move_in_place_byte_for_byte_once_computed(sgl, daemon):
    torch = sgl.torch
    pool = PageFirstHostPool(POOL_PAGES, PAGE, 2, 2, 16, torch.bfloat16, ShmHostAllocator())
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    b = backend(sgl, daemon, pool, extra={"allocator": "shm"})
    counting = Counting(pool, PAGE)
    rng = random.Random(4)
    ks = keys(2 * CHECKED_CALLS + 8, "strided")
    sources = [rng.randrange(POOL_PAGES) for _ in ks]
    stored = {k: page_bytes(sgl, pool, p).clone() for k, p in zip(ks, sources)}
    for i in range(0, len(ks), 2):  # two pages a call (a stride is fitted on two): checked, or computed
        assert b.batch_set_v1(ks[i: i + 2], host_indices(sgl, sources[i: i + 2])) == [True, True]
    assert sgl.adapter._STRIDES[pool].ready
    for start in range(0, len(ks), 6):
        batch = ks[start: start + 6]
        targets = rng.sample(range(POOL_PAGES), len(batch))
        raw.zero_()
        assert b.batch_get_v1(batch, host_indices(sgl, targets)) == [True] * len(batch)
        for k, p in zip(batch, targets):
            assert torch.equal(page_bytes(sgl, pool, p), stored[k])
        assert counting.pages[-1] == 1  # the last page's check alone
    assert b.stats()["blocks_in_place"] > 0
    b.close()
