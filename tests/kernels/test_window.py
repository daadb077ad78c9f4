"""The local window's ring, the kernels that write it and read it, and adding a page to the low-rank index.

Each kernel set's :meth:`append` against plain indexing; Triton's attention over a ring
that wraps against the reference over the same tokens in order, with the context counted
in the kernel; Triton's page encoding against the torch one (under Triton's interpreter).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the interpreter is chosen at triton's first import

from kvdrive.kernels import for_device  # noqa: E402
from kvdrive.kernels import reference as ref  # noqa: E402
from kvdrive.kernels.window import LocalWindow, ring_capacity  # noqa: E402

from kernel_cases import BACKENDS  # noqa: E402

try:
    from kvdrive.kernels import triton_kernels as tk
    INTERPRETED = tk.INTERPRETED
except ImportError:
    tk, INTERPRETED = None, False
SETS = BACKENDS + (("triton",) if INTERPRETED else ())
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels run here only under Triton's interpreter")


def _window(seed: int, start: int, n: int, capacity: int, b: int = 2, h: int = 3, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    return keys, values, LocalWindow.of(keys, values, start, capacity)


@pytest.mark.parametrize("start, n", [(0, 5), (37, 20), (16, 24), (30, 0)])
def test_a_window_keeps_its_tokens_in_order_around_the_ring(start, n):
    keys, values, window = _window(start, start, n, capacity=24)
    lk, lv = window.linear()
    assert torch.equal(lk, keys) and torch.equal(lv, values)
    assert window.length == n and window.first == start % 24
    for p in range(start, start + n):  # each position at its slot
        assert torch.equal(window.k[:, :, p % 24], keys[:, :, p - start])


def test_a_page_of_the_window_is_contiguous_slots():
    s = 8
    cap = ring_capacity(20, s)
    assert cap % s == 0 and cap >= 20 + s
    keys, _, window = _window(1, 40, cap - 1, cap)
    for page in range(5 + 1, (40 + cap - 1) // s):
        k, _ = window.tokens(page * s, (page + 1) * s)
        assert torch.equal(k, keys[:, :, page * s - 40 : (page + 1) * s - 40])


@pytest.mark.parametrize("choice", SETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_append_writes_the_token_into_its_slot(choice, dtype):
    keys, values, window = _window(2, 29, 10, capacity=16)
    window = LocalWindow(window.k.to(dtype), window.v.to(dtype), window.start, window.end)
    expect_k, expect_v = window.k.clone(), window.v.clone()
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 3, 8, generator=g).to(dtype), torch.randn(2, 3, 1, 8, generator=g).to(dtype)
    for_device("cpu", choice).append(window, key, value)
    expect_k[:, :, window.end % 16], expect_v[:, :, window.end % 16] = key, value[:, :, 0]
    assert torch.equal(window.k, expect_k) and torch.equal(window.v, expect_v)


@interpreted
@pytest.mark.parametrize("start, n, splits", [(21, 13, None), (21, 13, 2), (8, 16, None), (5, 0, None)])
def test_triton_attention_reads_a_wrapping_ring_and_counts_the_context(start, n, splits):
    b, h, g, d, s, k, cap = 2, 2, 3, 8, 4, 3, 16
    gen = torch.Generator().manual_seed(start + n)
    keys, values, window = _window(start, start, n, cap, b, h, d)
    cache_k, cache_v = torch.randn(b, h, 5, s, d, generator=gen), torch.randn(b, h, 5, s, d, generator=gen)
    slots = torch.randint(0, 5, (b, h, k), generator=gen)
    pages = torch.randint(0, start // s, (b, h, k), generator=gen)
    tokens = torch.rand(b, start + n + 7, generator=gen) > 0.3
    query = torch.randn(b, h, g, d, generator=gen)
    counts = torch.zeros(3, dtype=torch.long)
    validity = tk.TokenValidity(tokens, pages, start, count=(counts, 1), context=(2, 5))
    out = tk.sparse_attention(query, cache_k, cache_v, slots, window.k, window.v, validity, 0.3, num_splits=splits,
                              ring=(window.first, window.length))
    attended = ref.attended_valid(tokens, pages, s, start, start + n)
    expect = ref.sparse_attention(query, cache_k, cache_v, slots, keys, values, attended, 0.3)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [0, int(attended.sum()), 5 * int(tokens[:, : start + n].sum())]


@interpreted
@pytest.mark.parametrize("layout, s, d", [(ref.SketchLayout(27, 1, 12), 16, 64), (ref.SketchLayout(13, 3, 5), 8, 24),
                                          (ref.SketchLayout(8, 8, 0), 16, 32)])
def test_triton_page_encoding_matches_the_torch_one(layout, s, d):
    b, h, n = 2, 3, 5
    gen = torch.Generator().manual_seed(layout.rank)

    def index():
        return SimpleNamespace(page_size=s, num_pages=n, layout=layout,
                               kproj=torch.randn(b, h, d, layout.rank, generator=torch.Generator().manual_seed(1)).half(),
                               scale=torch.rand(b, h, layout.rank, generator=torch.Generator().manual_seed(2)) + 0.05,
                               codes=torch.full((b, h, layout.rows, (n + 2) * s), 99, dtype=torch.int8),
                               valid=torch.zeros(b, (n + 2) * s, dtype=torch.bool))

    keys = torch.randn(b, h, s, d, generator=gen) * 2
    page_valid = torch.rand(b, s, generator=gen) > 0.3
    got, expect = index(), index()
    for_device("cpu", "triton").lowrank_add_page(got, keys, page_valid)
    for_device("cpu", "reference").lowrank_add_page(expect, keys, page_valid)
    assert torch.equal(got.valid, expect.valid)
    values = ref.unpack_lowrank_codes(got.codes, layout).int()
    expect_values = ref.unpack_lowrank_codes(expect.codes, layout).int()
    # The sketch's sums run in another order: a value on a rounding boundary may land one code over.
    assert (values - expect_values).abs().max() <= 1
    assert (values != expect_values).float().mean() < 0.01
    assert torch.equal(got.codes[..., : n * s], expect.codes[..., : n * s])  # nothing else written
    assert torch.equal(got.codes[..., (n + 1) * s :], expect.codes[..., (n + 1) * s :])


@pytest.mark.parametrize("choice", SETS)
@pytest.mark.parametrize("page_size, sink", [(4, 2), (5, 1), (16, 0)])
def test_step_pages_are_the_selectable_pages_and_each_rows_sink(choice, page_size, sink):
    b, num_pages, first_local = 3, 11, 9
    g = torch.Generator().manual_seed(page_size)
    valid = torch.rand(b, num_pages * page_size + 6, generator=g) > 0.2
    valid[1, : 3 * page_size] = False  # left padding: row 1's prompt starts at page 3
    valid[2, 4 * page_size : 5 * page_size] = False  # a page with no real token
    first_page = torch.tensor([0, 3, 0])
    sel, sinks = for_device("cpu", choice).step_pages(valid, first_page, num_pages, sink, first_local, page_size)
    for row in range(b):
        for j in range(sink):
            page = int(first_page[row]) + j
            assert sinks[row, j] == (page if page < first_local else -1)
        for page in range(num_pages):
            real = bool(valid[row, page * page_size : (page + 1) * page_size].any())
            assert sel[row, page] == (real and int(first_page[row]) + sink <= page < first_local), (row, page)
    none, again = for_device("cpu", choice).step_pages(valid, first_page, num_pages, sink, first_local, page_size,
                                                       selectable=False)
    assert none is None and torch.equal(again, sinks)
