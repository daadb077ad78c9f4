"""Every backend's kernels against the plain torch references in ``kvdrive.kernels.reference``.

For the reference backend this checks the seam's wiring (which function, which argument
where); for the compiled CPU kernels it checks their numerics. Inputs are ragged the
ways a decode step's are: pages of -1, rows with fewer selectable pages than k or none,
empty selections, padded rows, heads with nothing valid. Tolerances: ``tolerances.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvdrive.kernels import cpu, for_device
from kvdrive.kernels import reference as ref

from kernel_cases import (BACKENDS, EMPTY_ROW, FEW_SELECTABLE_ROW, LOWRANK_SHAPES, NONE_SELECTABLE_ROW, PADDED_ROW,
                          lowrank_case, random_slots, widened)
from tolerances import assert_close, lowrank_kernel

NEG_INF = float("-inf")
HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *HALF)


def assert_distinct_pages(pages: torch.Tensor, num_pages: int) -> None:
    """Every (row, head) names distinct pages below ``num_pages``."""
    assert pages.dtype == torch.int64
    assert ((pages >= 0) & (pages < num_pages)).all()
    assert (pages.sort(dim=-1).values.diff(dim=-1) > 0).all()


def assert_top_k(pages, top, expect_top, scores, selectable, kernel):
    """``pages``/``top`` ``[B, H, k]`` a top k of the float32 reference ``scores`` ``[B, H, P]``
    over the ``selectable`` pages: the k best scores, best first (-inf where fewer pages
    score), and each page with a finite score selectable and scoring what it claims. Pages
    may differ from the reference's only where scores tie within the tolerance."""
    assert pages.shape == top.shape == expect_top.shape
    assert_close(top, expect_top, kernel)
    assert_distinct_pages(pages, scores.shape[2])
    finite = torch.isfinite(top)
    assert selectable[:, None, :].expand_as(scores).gather(2, pages)[finite].all()
    assert_close(top[finite], scores.gather(2, pages)[finite], kernel)


# ---------------------------------------------------------------- low-rank selection


@pytest.mark.parametrize("seed", range(len(LOWRANK_SHAPES)))
def test_lowrank_codes_round_trip(seed):
    case = lowrank_case(seed)
    assert case.layout.rank == case.qproj.shape[3]
    assert case.codes.shape[2] == case.layout.rows
    assert torch.equal(ref.unpack_lowrank_codes(case.codes, case.layout), case.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(len(LOWRANK_SHAPES)))
def test_lowrank_scores_match_reference(kernels, seed, dtype):
    case = lowrank_case(seed, dtype)
    expect = case.reference_scores()
    got = kernels.lowrank_scores(case.query, case.qproj, case.scale, case.scaling, case.codes, case.valid,
                                 case.num_pages, case.page_size, case.layout)  # spare capacity past num_pages
    assert got.shape == expect.shape and got.dtype == torch.float32
    assert_close(got, expect, lowrank_kernel(kernels, case.layout, "lowrank_scores"))  # -inf where the reference has it
    assert torch.isneginf(got[PADDED_ROW, :, :3]).all() and torch.isneginf(got[EMPTY_ROW]).all()
    # Scores are logs of mass shares: over a head's pages they sum to one per query head.
    some = case.valid[:, : case.num_pages * case.page_size].any(dim=1)
    mass = got[some].exp().sum(dim=-1)
    assert_close(mass, torch.full_like(mass, float(case.query.shape[2])), "lowrank_mass")


def test_lowrank_scores_of_no_pages_are_empty(kernels):
    case = lowrank_case(0)
    got = kernels.lowrank_scores(case.query, case.qproj, case.scale, case.scaling, case.codes, case.valid, 0,
                                 case.page_size, case.layout)
    assert got.shape == (*case.query.shape[:2], 0)


def _selectable(case, seed):
    g = torch.Generator().manual_seed(100 + seed)
    selectable = torch.rand(case.codes.shape[0], case.num_pages, generator=g) > 0.3
    selectable[FEW_SELECTABLE_ROW] = False
    selectable[FEW_SELECTABLE_ROW, [5, 17, 30]] = True
    selectable[NONE_SELECTABLE_ROW] = False
    return selectable, g


@pytest.mark.parametrize("k", [7, 0, 45])  # 45: more than the 40 pages
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(len(LOWRANK_SHAPES)))
def test_lowrank_select_matches_reference(kernels, seed, dtype, k):
    case = lowrank_case(seed, dtype)
    selectable, g = _selectable(case, seed)
    cached = torch.randint(-1, case.num_pages, (*case.codes.shape[:2], 9), generator=g)
    args = (case.qproj, case.scale, case.scaling, case.codes, case.valid, selectable, k, case.page_size, cached,
            case.layout)
    _, expect_top, expect_cached = ref.lowrank_select(case.query.float(), *args)
    pages, top, cached_scores = kernels.lowrank_select(case.query, *args)
    assert pages.shape == (*case.codes.shape[:2], min(k, case.num_pages))
    kernel = lowrank_kernel(kernels, case.layout, "lowrank_select")
    assert_top_k(pages, top, expect_top, case.reference_scores(), selectable, kernel)
    assert_close(cached_scores, expect_cached, kernel)
    if k:
        few = top[FEW_SELECTABLE_ROW]  # three selectable pages score, the rest of the k do not
        assert torch.isfinite(few[:, :3]).all() and torch.isneginf(few[:, 3:]).all()
        assert torch.isneginf(top[NONE_SELECTABLE_ROW]).all() and torch.isneginf(top[EMPTY_ROW]).all()


def test_lowrank_select_pads_with_unselectable_pages(kernels):
    case = lowrank_case(9)
    selectable = torch.zeros(case.codes.shape[0], case.num_pages, dtype=torch.bool)
    selectable[:, 10:13] = True
    pages, top, none = kernels.lowrank_select(case.query, case.qproj, case.scale, case.scaling, case.codes, case.valid,
                                              selectable, 5, case.page_size, None, case.layout)
    assert none is None
    assert_distinct_pages(pages, case.num_pages)
    scored = [r for r in range(pages.shape[0]) if r != EMPTY_ROW]  # there every page scores -inf: any will do
    assert (pages[scored, :, :3].sort(dim=-1).values == torch.tensor([10, 11, 12])).all()
    assert torch.isfinite(top[scored, :, :3]).all() and torch.isneginf(top[..., 3:]).all()


def test_lowrank_select_of_no_pages_still_scores_the_cached_ones(kernels):
    case = lowrank_case(10)
    b, h = case.codes.shape[:2]
    selectable = torch.ones(b, case.num_pages, dtype=torch.bool)
    cached = torch.tensor([[[3, -1]] * h] * b)
    pages, top, cached_scores = kernels.lowrank_select(case.query, case.qproj, case.scale, case.scaling, case.codes,
                                                       case.valid, selectable, 0, case.page_size, cached, case.layout)
    assert pages.shape == top.shape == (b, h, 0)
    assert_close(cached_scores, case.reference_scores()[..., [3, 3]].masked_fill(cached < 0, NEG_INF),
                 lowrank_kernel(kernels, case.layout, "lowrank_select"))
    assert torch.isneginf(cached_scores[..., 1]).all() and torch.isneginf(cached_scores[EMPTY_ROW]).all()


# ---------------------------------------------------------------- hierarchical selection


def _hierarchical_case(seed, spare=7):
    """int8 page means under centroids, with ``spare`` pages of capacity past the P in use."""
    g = torch.Generator().manual_seed(seed)
    B, H, G, D, P, C = 4, 3, 3, 16, 120, 15
    query = torch.randn(B, H, G, D, generator=g)
    centroids = torch.randn(B, H, C, D, generator=g)
    assign = torch.randint(0, C, (B, H, P + spare), generator=g, dtype=torch.int32)
    q8 = torch.randint(-127, 128, (B, H, P + spare, D), generator=g, dtype=torch.int8)
    scale = torch.rand(B, H, P + spare, generator=g) * 0.01 + 1e-3
    selectable = torch.rand(B, P, generator=g) > 0.2
    selectable[FEW_SELECTABLE_ROW] = False
    selectable[FEW_SELECTABLE_ROW, [4, 50, 99]] = True
    selectable[NONE_SELECTABLE_ROW] = False
    cached = torch.randint(-1, P, (B, H, 20), generator=g)
    return query, centroids, assign, q8, scale, selectable, cached


@pytest.mark.parametrize("k", [12, 0, 130])  # 130: more than the 120 pages
@pytest.mark.parametrize("seed", range(5))
def test_hierarchical_select_matches_reference(kernels, seed, k):
    query, centroids, assign, q8, scale, selectable, cached = _hierarchical_case(seed)
    args = (query, centroids, assign, q8, scale, selectable, k, max(k, 40), cached)
    expect_pages, expect_top, expect_cached = ref.hierarchical_select_int8(*args)
    pages, top, cached_scores = kernels.hierarchical_select(*args)
    n = selectable.shape[1]
    assert pages.shape == (*query.shape[:2], min(k, n))
    assert_close(top, expect_top, "hierarchical_select")
    # The same pages wherever they score; scores are distinct, so even in the same order.
    finite = torch.isfinite(expect_top)
    assert torch.equal(pages.masked_fill(~finite, -1), expect_pages.masked_fill(~finite, -1))
    assert_distinct_pages(pages, n)
    assert_close(cached_scores, expect_cached, "hierarchical_select")
    if k:
        few = top[FEW_SELECTABLE_ROW]  # three selectable pages score, the rest of the k do not
        assert torch.isfinite(few[:, :3]).all() and torch.isneginf(few[:, 3:]).all()
        assert torch.isneginf(top[NONE_SELECTABLE_ROW]).all()


def test_hierarchical_int8_reference_is_the_float_one_over_dequantised_means():
    """The int8 reference (what the backends are held to) is :func:`reference.hierarchical_select`
    over the dequantised means, and its cached-page scores are :func:`reference.score_mean`'s."""
    query, centroids, assign, q8, scale, selectable, cached = _hierarchical_case(0)
    n = selectable.shape[1]
    means = q8[:, :, :n].float() * scale[:, :, :n, None]
    pages, top, cached_scores = ref.hierarchical_select_int8(query, centroids, assign, q8, scale, selectable, 12, 40,
                                                             cached)
    expect_pages, expect_top = ref.hierarchical_select(query, centroids, assign[:, :, :n].long(), means, selectable,
                                                       12, 40)
    assert torch.equal(pages, expect_pages)
    assert_close(top, expect_top, "hierarchical_select")
    expect_cached = ref.score_mean(query, means).gather(2, cached.clamp_min(0)).masked_fill(cached < 0, NEG_INF)
    assert_close(cached_scores, expect_cached, "hierarchical_select")


# ---------------------------------------------------------------- attended tokens


@pytest.mark.parametrize("local_start", [40, 64, 70])  # 70: t itself, an empty local window
def test_attended_valid_matches_reference(kernels, local_start):
    """Validity of the selected pages then the local window: padding, -1 pages, spare columns."""
    g = torch.Generator().manual_seed(local_start)
    B, H, K, S, T = 3, 2, 5, 8, 70
    valid = torch.rand(B, T + 6, generator=g) > 0.3  # spare columns past t are never read
    valid[2, :16] = False  # left padding
    chosen = random_slots(g, B, H, K, local_start // S)
    chosen[1, 0, 2] = -1
    chosen[2, 1] = -1  # a head with nothing chosen
    out = kernels.attended_valid(valid, chosen, S, local_start, T, H)
    assert out.shape == (B, H, K * S + T - local_start) and out.dtype == torch.bool
    assert torch.equal(out, ref.attended_valid(valid, chosen, S, local_start, T))
    assert not out[1, 0, 2 * S : 3 * S].any() and not out[2, 1, : K * S].any()
    assert torch.equal(out[:, :, K * S :], valid[:, None, local_start:T].expand(B, H, -1))


@pytest.mark.parametrize("chosen", ["none", "empty"])
def test_attended_valid_of_no_pages_is_the_local_window(kernels, chosen):
    g = torch.Generator().manual_seed(1)
    B, H, S, T, local_start = 3, 2, 8, 70, 48
    valid = torch.rand(B, T + 2, generator=g) > 0.3
    pages = None if chosen == "none" else torch.zeros(B, H, 0, dtype=torch.long)
    out = kernels.attended_valid(valid, pages, S, local_start, T, H)
    assert torch.equal(out, ref.attended_valid(valid, pages, S, local_start, T, H))
    assert torch.equal(out, valid[:, None, local_start:T].expand(B, H, -1))


# ---------------------------------------------------------------- attention


def _attention_case(seed, dtype, local, k=10, spare=3):
    """Cache slots and a local window; ``valid`` masks the tokens of -1 slots (as
    :func:`reference.attended_valid` does) and has ``spare`` columns past the attended tokens."""
    g = torch.Generator().manual_seed(seed)
    B, H, G, D, C, S = 3, 2, 4, 32, 24, 8
    kc, vc = (torch.randn(B, H, C, S, D, generator=g).to(dtype) for _ in range(2))
    lk, lv = (torch.randn(B, H, local, D, generator=g).to(dtype) for _ in range(2))
    slots = random_slots(g, B, H, k, C)
    query = (torch.randn(B, H, G, D, generator=g) * 2).to(dtype)
    valid = torch.rand(B, H, k * S + local + spare, generator=g) > 0.2
    if k > 3:
        slots[2, 0, 3] = -1
        valid[2, 0, 3 * S : 4 * S] = False
    valid[0, 1] = False  # a head with nothing to attend
    valid[1, 1, : k * S] = False  # pages all invalid: the local window alone (with none, nothing either)
    return query, kc, vc, slots, lk, lv, valid


@pytest.mark.parametrize("local, k", [(0, 10), (5, 10), (40, 10), (5, 0), (40, 0)])  # k = 0: the local window only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_matches_reference(kernels, dtype, local, k):
    query, kc, vc, slots, lk, lv, valid = _attention_case(local + k, dtype, local, k)
    out = kernels.attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    expect = ref.sparse_attention(*widened(query, kc, vc), slots, *widened(lk, lv), valid, 0.17)
    assert out.shape == query.shape and out.dtype in (dtype, torch.float32)
    some = valid[:, :, : k * kc.shape[3] + local].any(dim=-1)  # heads with something to attend
    assert_close(out[some], expect[some], "attention")


def test_reference_sparse_attention_is_decode_attention_over_the_gathered_pages():
    query, kc, vc, slots, lk, lv, valid = _attention_case(5, torch.float32, 5)
    B, H, K = slots.shape
    S, D = kc.shape[3:]
    bi, hi = torch.arange(B)[:, None, None], torch.arange(H)[None, :, None]
    keys = torch.cat([kc[bi, hi, slots.clamp_min(0)].reshape(B, H, K * S, D), lk], dim=2)
    values = torch.cat([vc[bi, hi, slots.clamp_min(0)].reshape(B, H, K * S, D), lv], dim=2)
    expect = ref.decode_attention(query, keys, values, valid[:, :, : K * S + lk.shape[2]], 0.17)
    got = ref.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_result_is_in_the_attention_dtype(kernels, dtype):
    query, kc, vc, slots, lk, lv, valid = _attention_case(0, dtype, 5)
    assert kernels.attention(query, kc, vc, slots, lk, lv, valid, 0.17).dtype == kernels.attention_dtype(dtype)


def test_attention_of_a_head_with_nothing_valid_is_zeros(kernels):
    query, kc, vc, slots, lk, lv, valid = _attention_case(0, torch.float32, 5)
    out = kernels.attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_widening_is_exact_for_every_finite_value_class(kernels, dtype):
    """One valid token gets probability one, so the output is its value row, exactly."""
    values = torch.tensor([1.0, -2.5, 6e-8, -6e-8, 0.0, -0.0, 60000.0, 1e-4, 3.14159, -1e-5], dtype=dtype)
    D = values.numel()
    kc = torch.randn(1, 1, 1, 2, D).to(dtype)
    vc = torch.stack([values, torch.zeros_like(values)]).reshape(1, 1, 1, 2, D)
    valid = torch.tensor([[[True, False]]])
    empty = kc[:, :, 0, :0]
    out = kernels.attention(torch.randn(1, 1, 1, D).to(dtype), kc, vc, torch.zeros(1, 1, 1, dtype=torch.long), empty,
                            empty, valid, 1.0)
    assert torch.equal(out.reshape(D).float(), values.float())


PARTS = [c for c in BACKENDS if for_device("cpu", c).attends_in_parts]
ONE_PASS = [c for c in BACKENDS if c not in PARTS]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("choice", PARTS)
def test_attention_in_two_parts_equals_one_call(choice, seed, dtype):
    """Cached pages and local window first, then the fetched pages: merged through the
    log-sum-exps, the result is the attention over all of them."""
    kernels = for_device("cpu", choice)
    g = torch.Generator().manual_seed(seed)
    query, kc, vc, slots, lk, lv, valid = _attention_case(seed, dtype, 5)
    B, H, G, D = query.shape
    K = slots.shape[2]
    fetched = torch.rand(B, H, K, generator=g) < 0.3
    fetched[0, 0] = True  # every page fetched: the first part is the local window only
    fetched[2, 1] = False  # nothing fetched: the second part attends nothing
    valid[0, 1] = True
    valid[1, 0] = False  # nothing at all: zeros
    whole = kernels.attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    partial = kernels.partial()
    # Poison what the first part must overwrite.
    partial.out = torch.full(query.shape, float("nan")).numpy()
    partial.lse = torch.full((B, H, G), float("nan")).numpy()
    kernels.attention(query, kc, vc, slots.masked_fill(fetched, -1), lk, lv, valid, 0.17, partial)
    no_local = lk[:, :, :0]
    out = kernels.attention(query, kc, vc, slots.masked_fill(~fetched, -1), no_local, no_local, valid, 0.17, partial)
    assert_close(out, whole, "attention_in_parts")
    expect = ref.sparse_attention(*widened(query, kc, vc), slots, *widened(lk, lv), valid, 0.17)
    some = valid[:, :, : K * kc.shape[3] + lk.shape[2]].any(dim=-1)
    assert_close(out[some], expect[some], "attention")
    assert torch.equal(out[1, 0], torch.zeros(G, D))
    lse = torch.from_numpy(partial.lse)
    assert torch.isneginf(lse[1, 0]).all() and torch.isfinite(lse[0]).all() and torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("choice", ONE_PASS)
def test_one_pass_backends_refuse_two_parts(choice):
    kernels = for_device("cpu", choice)
    query, kc, vc, slots, lk, lv, valid = _attention_case(0, torch.float32, 5)
    with pytest.raises(NotImplementedError):
        kernels.partial()
    with pytest.raises(NotImplementedError):
        kernels.attention(query, kc, vc, slots, lk, lv, valid, 0.17, object())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_attention_matches_reference(kernels, dtype):
    g = torch.Generator().manual_seed(3)
    B, H, G, N, D = 3, 2, 4, 37, 32
    query = torch.randn(B, H, G, D, generator=g).to(dtype)
    keys, values = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(2))
    valid = torch.rand(B, H, N, generator=g) > 0.2
    valid[1, 0, :30] = False  # left padding
    out = kernels.dense_attention(query, keys, values, valid, 0.17)
    assert out.dtype == kernels.attention_dtype(dtype)
    assert_close(out, ref.decode_attention(*widened(query, keys, values), valid, 0.17), "dense_attention")


# ---------------------------------------------------------------- the rest of the seam


def test_attention_dtype_widens_half_precision_on_the_cpu(kernels):
    assert kernels.device == torch.device("cpu")
    for dtype in DTYPES:
        assert kernels.attention_dtype(dtype) == torch.float32
    assert kernels.attention_dtype(torch.float64) == torch.float64


def test_threads_runs_torch_on_one_thread_and_keeps_the_kernels_threads(kernels):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with kernels.threads():
            assert torch.get_num_threads() == 1 and cpu.kernel_threads() == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)

