"""The numba selection kernel against its torch reference."""

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
