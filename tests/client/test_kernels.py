"""The numba kernels against their torch references."""

import pytest
import torch

from kvdrive.kernels import cpu
from kvdrive.kernels import reference as ref


@pytest.mark.parametrize("seed", range(5))
def test_numba_hierarchical_select_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, G, D, P, C = 2, 3, 3, 16, 120, 15
    query = torch.randn(B, H, G, D, generator=g)
    centroids = torch.randn(B, H, C, D, generator=g)
    assign = torch.randint(0, C, (B, H, P), generator=g)
    q8 = torch.randint(-127, 128, (B, H, P, D), generator=g, dtype=torch.int8)
    scale = torch.rand(B, H, P, generator=g) * 0.01 + 1e-3
    selectable = torch.rand(B, P, generator=g) > 0.2
    means = q8.float() * scale[..., None]
    k, cand = 12, 40
    ref_pages, ref_scores = ref.hierarchical_select(query, centroids, assign, means, selectable, k, cand)
    cached = torch.randint(-1, P, (B, H, 20), generator=g)
    pages, scores, cached_scores = cpu.hierarchical_select(query, centroids, assign.to(torch.int32), q8, scale,
                                                           selectable, k, cand, cached)
    assert torch.equal(pages.sort(dim=-1).values, ref_pages.sort(dim=-1).values)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)
    expect = ref.score_mean(query, means).gather(2, cached.clamp_min(0)).masked_fill(cached < 0, float("-inf"))
    torch.testing.assert_close(cached_scores, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("local", [0, 5, 40])
def test_sparse_attention_from_cache_slots_matches_gathered_reference(dtype, local):
    g = torch.Generator().manual_seed(local)
    B, H, G, D, C, S, K = 3, 2, 4, 32, 24, 8, 10
    kc = torch.randn(B, H, C, S, D, generator=g).to(dtype)
    vc = torch.randn(B, H, C, S, D, generator=g).to(dtype)
    lk = torch.randn(B, H, local, D, generator=g).to(dtype)
    lv = torch.randn(B, H, local, D, generator=g).to(dtype)
    slots = torch.stack([torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(H)]) for _ in range(B)])
    query = torch.randn(B, H, G, D, generator=g) * 2
    valid = torch.rand(B, H, K * S + local, generator=g) > 0.2
    valid[0, 1] = False  # a head with nothing to attend gives zeros
    out = cpu.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)

    bi, hi = torch.arange(B)[:, None, None], torch.arange(H)[None, :, None]
    keys = torch.cat([kc[bi, hi, slots].reshape(B, H, K * S, D), lk], dim=2).float()
    values = torch.cat([vc[bi, hi, slots].reshape(B, H, K * S, D), lv], dim=2).float()
    expect = ref.decode_attention(query, keys, values, valid, 0.17)
    expect[0, 1] = 0
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_sparse_attention_in_two_parts_equals_one_call(dtype, seed):
    """Cached pages and local window first, then the fetched pages: merged through the
    log-sum-exps, the result is the attention over all of them."""
    g = torch.Generator().manual_seed(seed)
    B, H, G, D, C, S, K, L = 3, 2, 4, 32, 24, 8, 10, 5
    kc, vc = (torch.randn(B, H, C, S, D, generator=g).to(dtype) for _ in range(2))
    lk, lv = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(2))
    slots = torch.stack([torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(H)]) for _ in range(B)])
    query = torch.randn(B, H, G, D, generator=g) * 3
    valid = torch.rand(B, H, K * S + L, generator=g) > 0.2
    fetched = torch.rand(B, H, K, generator=g) < 0.3
    fetched[0, 0] = True  # every page fetched: the first part is the local window only
    fetched[0, 1] = False  # nothing fetched: the second part attends nothing
    valid[1, 0] = False  # nothing at all: zeros
    valid[1, 1, : K * S] = False  # pages all invalid: the local window alone
    whole = cpu.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    partial = cpu.PartialAttention()
    cpu.sparse_attention(query, kc, vc, slots.masked_fill(fetched, -1), lk, lv, valid, 0.17, partial)
    no_local = lk[:, :, :0]
    out = cpu.sparse_attention(query, kc, vc, slots.masked_fill(~fetched, -1), no_local, no_local, valid, 0.17, partial)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 0], torch.zeros(G, D))
    lse = torch.from_numpy(partial.lse)
    assert torch.isneginf(lse[1, 0]).all() and torch.isfinite(lse[0]).all()


def test_sparse_attention_refuses_a_short_valid_mask():
    kc = torch.zeros(1, 1, 4, 8, 16)
    with pytest.raises(ValueError, match="valid covers"):
        cpu.sparse_attention(torch.zeros(1, 1, 2, 16), kc, kc, torch.zeros(1, 1, 3, dtype=torch.long), kc[:, :, 0, :2],
                             kc[:, :, 0, :2], torch.ones(1, 1, 20, dtype=torch.bool), 1.0)


@pytest.mark.parametrize("local_start", [40, 64])
def test_attended_valid_matches_reference(local_start):
    """Validity of sink + selected pages + local window, padding and -1 pages included."""
    g = torch.Generator().manual_seed(local_start)
    B, H, K, S, T = 3, 2, 5, 8, 70
    valid = torch.rand(B, T + 6, generator=g) > 0.3  # spare columns past t are never read
    chosen = torch.stack([torch.stack([torch.randperm(local_start // S, generator=g)[:K] for _ in range(H)])
                          for _ in range(B)])
    chosen[1, 0, 2] = -1
    out = cpu.attended_valid(valid, chosen, S, local_start, T)
    assert out.shape == (B, H, K * S + T - local_start) and out.dtype == torch.bool
    assert torch.equal(out, ref.attended_valid(valid, chosen, S, local_start, T))
    assert not out[1, 0, 2 * S : 3 * S].any()


@pytest.mark.parametrize("rows", [3, 1])
def test_sparse_attention_split_across_threads_matches_one_call(monkeypatch, rows):
    """Rows (or, for one row, heads) attended on several threads give exactly the one-thread result."""
    g = torch.Generator().manual_seed(rows)
    B, H, G, D, C, S, K, L = rows, 2, 4, 32, 24, 8, 10, 5
    kc, vc = (torch.randn(B, H, C, S, D, generator=g).half() for _ in range(2))
    lk, lv = (torch.randn(B, H, L, D, generator=g).half() for _ in range(2))
    slots = torch.stack([torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(H)]) for _ in range(B)])
    slots[0, 0, 3] = -1
    query = torch.randn(B, H, G, D, generator=g)
    valid = torch.rand(B, H, K * S + L, generator=g) > 0.2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)
        torch.set_num_threads(2)
        parts = []
        kernel = cpu._sparse_attention
        monkeypatch.setattr(cpu, "_sparse_attention", lambda *a: parts.append(a[0].shape[:2]) or kernel(*a))
        monkeypatch.setattr(cpu, "_ATTENTION_PART_MIN_WORK", 1)
        split = cpu.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    finally:
        torch.set_num_threads(threads)
    assert len(parts) == 2 and all(p != query.shape[:2] for p in parts)
    assert torch.equal(one, split)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_widening_is_exact_for_every_finite_value_class(dtype):
    # One valid token gets probability one, so the output is its value row widened to float32.
    values = torch.tensor([1.0, -2.5, 6e-8, -6e-8, 0.0, -0.0, 60000.0, 1e-4, 3.14159, -1e-5], dtype=dtype)
    D = values.numel()
    kc = torch.randn(1, 1, 1, 2, D).to(dtype)
    vc = torch.stack([values, torch.zeros_like(values)]).reshape(1, 1, 1, 2, D)
    valid = torch.tensor([[[True, False]]])
    empty = kc[:, :, 0, :0]
    out = cpu.sparse_attention(torch.randn(1, 1, 1, D), kc, vc, torch.zeros(1, 1, 1, dtype=torch.long), empty, empty,
                               valid, 1.0)
    assert torch.equal(out.reshape(D), values.float())


# (rank, int8 channels): whole eight-channel passes and passes plus single channels; int4
# channels in odd and even numbers (an odd one leaves a spare nibble), none, or all.
_LOWRANK_SHAPES = [(8, 5), (13, 8), (8, 8), (13, 0), (16, 8), (16, 8), (16, 8), (16, 8)]  # (16, 8): the fused logit pass


def _lowrank_case(seed, spare=3):
    """Packed codes and int8 channel count for the kernels, and the unpacked codes for the reference."""
    g = torch.Generator().manual_seed(seed)
    R, wide = _LOWRANK_SHAPES[seed % len(_LOWRANK_SHAPES)]
    G = (3, 3, 3, 3, 3, 5, 4, 6)[seed % len(_LOWRANK_SHAPES)]  # fused chunks: 3; 4 + 1; 4; 4 + 2 query heads
    B, H, D, S, P = 2, 3, 32, 16, 40
    query = torch.randn(B, H, G, D, generator=g)
    qproj = torch.randn(B, H, D, R, generator=g) * 0.3
    scale = torch.rand(B, H, R, generator=g) * 0.05 + 1e-3
    values = torch.randint(-127, 128, (B, H, R, (P + spare) * S), generator=g, dtype=torch.int8)
    values[:, :, wide:] = torch.randint(-7, 8, values[:, :, wide:].shape, generator=g, dtype=torch.int8)
    codes = ref.pack_lowrank_codes(values, wide)
    assert codes.shape[2] == ref.lowrank_code_rows(R, wide)
    assert torch.equal(ref.unpack_lowrank_codes(codes, R, wide), values)
    valid = torch.rand(B, (P + spare) * S, generator=g) > 0.1
    valid[1, : 3 * S] = False  # left padding: three pages with no valid token
    return query, qproj, scale, codes, wide, values, valid, S, P


@pytest.mark.parametrize("seed", range(8))
def test_numba_lowrank_scores_match_reference(seed):
    query, qproj, scale, codes, wide, values, valid, S, P = _lowrank_case(seed)
    expect = ref.score_lowrank(query, qproj, values[..., : P * S], scale, valid[:, : P * S], S, 0.2)
    got = cpu.lowrank_scores(query, qproj, scale, 0.2, codes, valid, P, S, wide)  # spare capacity past P pages
    assert torch.equal(torch.isfinite(got), torch.isfinite(expect))
    assert torch.isinf(got[1, :, :3]).all()
    fin = torch.isfinite(expect)
    torch.testing.assert_close(got[fin], expect[fin], rtol=1e-4, atol=1e-4)
    # Scores are logs of mass shares: over every page of a (row, head) they sum to one per query head.
    torch.testing.assert_close(got.exp().sum(dim=-1), torch.full(got.shape[:2], float(query.shape[2])), rtol=1e-3,
                               atol=1e-3)


@pytest.mark.parametrize("seed", range(8))
def test_numba_lowrank_select_matches_reference(seed):
    query, qproj, scale, codes, wide, values, valid, S, P = _lowrank_case(seed)
    g = torch.Generator().manual_seed(100 + seed)
    selectable = torch.rand(codes.shape[0], P, generator=g) > 0.3
    cached = torch.randint(-1, P, (codes.shape[0], codes.shape[1], 9), generator=g)
    scores = ref.score_lowrank(query, qproj, values[..., : P * S], scale, valid[:, : P * S], S, 0.2)
    expect_pages, expect_top = ref.topk_pages(scores.masked_fill(~selectable[:, None], float("-inf")), 7)
    pages, top, cached_scores = cpu.lowrank_select(query, qproj, scale, 0.2, codes, valid, selectable, 7, S, cached,
                                                   wide)
    torch.testing.assert_close(top, expect_top, rtol=1e-4, atol=1e-4)
    # Pages may differ only where scores tie within the kernel's error; each chosen one scores what it claims.
    torch.testing.assert_close(scores.gather(2, pages), top, rtol=1e-4, atol=1e-4)
    assert selectable.gather(1, pages.reshape(pages.shape[0], -1)).all()
    expect_cached = scores.gather(2, cached.clamp_min(0)).masked_fill(cached < 0, float("-inf"))
    fin = torch.isfinite(expect_cached)
    assert torch.equal(torch.isfinite(cached_scores), fin)
    torch.testing.assert_close(cached_scores[fin], expect_cached[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 1])
def test_numba_lowrank_split_across_threads_matches_one_call(monkeypatch, rows):
    """Rows (or, for one row, heads) scored on several threads give exactly the one-thread result."""
    query, qproj, scale, codes, wide, _, valid, S, P = _lowrank_case(1)
    query, qproj, scale, codes, valid = (x[:rows].contiguous() for x in (query, qproj, scale, codes, valid))
    g = torch.Generator().manual_seed(7)
    selectable = torch.rand(rows, P, generator=g) > 0.3
    cached = torch.randint(-1, P, (rows, codes.shape[1], 5), generator=g)

    def both():
        return (cpu.lowrank_scores(query, qproj, scale, 0.2, codes, valid, P, S, wide),
                *cpu.lowrank_select(query, qproj, scale, 0.2, codes, valid, selectable, 6, S, cached, wide))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = both()
        torch.set_num_threads(3)
        monkeypatch.setattr(cpu, "_PART_MIN_WORK", 1)  # split however small the call
        parts = []
        for name in ("_lowrank_scores", "_lowrank_select"):
            kernel = getattr(cpu, name)
            monkeypatch.setattr(cpu, name, lambda *a, kernel=kernel: parts.append(a[0].shape[:2]) or kernel(*a))
        split = both()
    finally:
        torch.set_num_threads(threads)
    # Two calls, each in as many parts as threads (at most one per row, or per head of a single row).
    n = min(3, rows if rows > 1 else codes.shape[1])
    assert len(parts) == 2 * n and all(p != query.shape[:2] for p in parts)
    for a, b in zip(one, split):
        assert torch.equal(a, b)


def test_numba_lowrank_select_pads_with_unselectable_pages():
    query, qproj, scale, codes, wide, _, valid, S, P = _lowrank_case(9)
    selectable = torch.zeros(codes.shape[0], P, dtype=torch.bool)
    selectable[:, 10:13] = True
    pages, top, _ = cpu.lowrank_select(query, qproj, scale, 0.2, codes, valid, selectable, 5, S, None, wide)
    for row in pages.reshape(-1, 5):
        assert set(row[:3].tolist()) == {10, 11, 12} and len(set(row.tolist())) == 5
    assert torch.isinf(top[..., 3:]).all() and torch.isfinite(top[0, :, :3]).all()


def test_numba_lowrank_select_of_no_pages_returns_empty_rows():
    query, qproj, scale, codes, wide, _, valid, S, P = _lowrank_case(10)
    selectable = torch.ones(codes.shape[0], P, dtype=torch.bool)
    pages, top, cached_scores = cpu.lowrank_select(query, qproj, scale, 0.2, codes, valid, selectable, 0, S,
                                                   torch.tensor([[[3, -1]] * codes.shape[1]] * codes.shape[0]), wide)
    assert pages.shape == top.shape == (codes.shape[0], codes.shape[1], 0)
    assert torch.isfinite(cached_scores[..., 0]).all() and torch.isinf(cached_scores[..., 1]).all()


def test_one_torch_thread_keeps_the_kernels_threads():
    """Inside, torch ops run on one thread while the kernels still split across the caller's threads; after, both are restored."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with cpu.one_torch_thread():
            assert torch.get_num_threads() == 1
            assert cpu.kernel_threads() == 3
            with cpu.one_torch_thread():  # nested: no change
                assert torch.get_num_threads() == 1 and cpu.kernel_threads() == 3
            assert cpu.kernel_threads() == 3
        assert torch.get_num_threads() == 3 and cpu.kernel_threads() == 3
        torch.set_num_threads(1)
        with cpu.one_torch_thread():
            assert torch.get_num_threads() == 1 and cpu.kernel_threads() == 1
    finally:
        torch.set_num_threads(threads)
