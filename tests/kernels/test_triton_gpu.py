"""The Triton kernels compiled and run on a CUDA device, against their torch references.

Under the ``gpu`` marker: skipped without a CUDA device. The shapes are a 32K-token
decode's (2048 pages of 16, 128 selected, 2048 cache slots), where the interpreter tests
(``test_triton.py``, ``test_placement.py``) use small ones. Also checks that a decode's
per-step changes (pages selected, local window length) compile no new kernel variant.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvdrive.kernels import reference as ref  # noqa: E402
from kvdrive.kernels import triton_kernels as tk  # noqa: E402
from kvdrive.kernels.backends import with_sink  # noqa: E402
from kvdrive.kernels.triton_placement import PagePriority, place  # noqa: E402
from kvdrive.kernels.triton_topk import choose_pages  # noqa: E402

DEV = torch.device("cuda")
B, H, P, K, C = 2, 8, 2048, 128, 2048


def _maps(gen):
    page_slot = torch.full((B, H, P + 64), -1, dtype=torch.long)
    slot_page = torch.full((B, H, C), -1, dtype=torch.long)
    return page_slot, slot_page, torch.zeros(B, H, C, dtype=torch.long)


@pytest.mark.parametrize("by_page", [False, True], ids=["lru", "lookahead"])
def test_placement_matches_reference_on_cuda(by_page):
    gen = torch.Generator().manual_seed(0)
    host = _maps(gen)
    dev = [t.to(DEV) for t in host]
    cap = torch.tensor([C - 7 * h for h in range(H)])
    for step in range(6):
        pages = torch.stack([torch.randperm(P // 4, generator=gen)[:K] for _ in range(B * H)]).reshape(B, H, K)
        pages[0, 1, :5] = -1
        scores = torch.randn(B, H, P, generator=gen).round(decimals=1)
        prio = ref.gather_scores(scores, host[1]) if by_page else host[2]
        expect = ref.place(pages, *host, prio, cap, step)
        got = place(pages.to(DEV), *dev, PagePriority(scores.to(DEV)) if by_page else dev[2], cap.to(DEV), step)
        assert torch.equal(got[0].cpu(), expect[0]) and torch.equal(got[1].cpu(), expect[1]), step
        assert all(torch.equal(d.cpu(), h) for d, h in zip(dev, host)), step


def test_choose_pages_matches_torch_on_cuda():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(B, H, P, generator=gen)
    selectable = torch.rand(B, P, generator=gen) > 0.2
    sink = torch.arange(B * 4).reshape(B, 4)
    pages, top = ref.topk_pages(scores.masked_fill(~selectable[:, None, :], ref.NEG_INF), K)
    expect = with_sink(sink, pages.masked_fill(top == ref.NEG_INF, -1))
    got = choose_pages(scores.to(DEV), selectable.to(DEV), K, sink.to(DEV))
    assert torch.equal(got.cpu(), expect)


def test_attention_by_token_validity_matches_reference_on_cuda():
    gen = torch.Generator().manual_seed(2)
    g, d, s, local = 4, 128, 16, 70
    kc, vc = (torch.randn(B, H, C, s, d, generator=gen).half() for _ in range(2))
    lk, lv = (torch.randn(B, H, local, d, generator=gen).half() for _ in range(2))
    query = torch.randn(B, H, g, d, generator=gen).half()
    pages = torch.stack([torch.randperm(P, generator=gen)[:K] for _ in range(B * H)]).reshape(B, H, K)
    pages[1, 2, 3:9] = -1
    slots = torch.randint(0, C, (B, H, K), generator=gen)
    tokens = torch.rand(B, P * s + local, generator=gen) > 0.1
    attended = ref.attended_valid(tokens, pages, s, P * s, P * s + local)
    counts = torch.zeros(2, dtype=torch.long, device=DEV)
    validity = tk.TokenValidity(tokens.to(DEV), pages.to(DEV), P * s, count=(counts, 0))
    out = tk.sparse_attention(*(t.to(DEV) for t in (query, kc, vc, slots, lk, lv)), validity, 0.088)
    expect = ref.sparse_attention(query.float(), kc.float(), vc.float(), slots, lk.float(), lv.float(), attended, 0.088)
    torch.testing.assert_close(out.cpu(), expect, atol=3e-3, rtol=3e-3)
    assert counts.tolist() == [int(attended.sum()), 0]


def test_lowrank_scores_match_reference_on_cuda():
    gen = torch.Generator().manual_seed(3)
    layout, g, d, s = ref.SketchLayout(54, 2, 24), 4, 128, 16
    query = torch.randn(B, H, g, d, generator=gen)
    qproj = torch.randn(B, H, d, layout.rank, generator=gen).half()
    scale = torch.rand(B, H, layout.rank, generator=gen) + 0.1
    codes = torch.randint(-2, 2, (B, H, layout.rank, P * s), generator=gen, dtype=torch.int8)
    packed = ref.pack_lowrank_codes(codes, layout)
    valid = torch.rand(B, P * s, generator=gen) > 0.1
    expect = ref.score_lowrank(query, qproj, ref.unpack_lowrank_codes(packed, layout), scale, valid, s, 0.088)
    got = tk.lowrank_scores(*(t.to(DEV) for t in (query, qproj, scale)), 0.088, packed.to(DEV), valid.to(DEV), P, s,
                            layout)
    torch.testing.assert_close(got.cpu(), expect, atol=1e-3, rtol=1e-3)


def _variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_attention_compiles_once_for_a_decode():
    """Pages selected, window length, chunk and splits change from step to step: one variant."""
    gen = torch.Generator().manual_seed(4)
    g, d, s = 4, 128, 16
    kc, vc = (torch.randn(B, H, C, s, d, generator=gen).half().to(DEV) for _ in range(2))
    query = torch.randn(B, H, g, d, generator=gen).half().to(DEV)
    tokens = torch.ones(B, P * s + 200, dtype=torch.bool, device=DEV)
    seen = []
    for step in range(20):
        k, local = K + step // 3, 64 + step % 17
        slots = torch.randint(0, C, (B, H, k), device=DEV)
        pages = torch.randint(0, P, (B, H, k), device=DEV)
        lk, lv = (torch.randn(B, H, local, d, device=DEV).half() for _ in range(2))
        tk.sparse_attention(query, kc, vc, slots, lk, lv, tk.TokenValidity(tokens, pages, P * s), 0.088)
        seen.append(_variants(tk._sparse_attention_kernel))
    torch.cuda.synchronize()
    assert seen[-1] == seen[0], seen
