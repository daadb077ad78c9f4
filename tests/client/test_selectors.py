"""Selectors on planted keys: the pages that hold the query's answer are found."""

import pytest
import torch

from kvdrive.kernels.reference import SketchLayout
from kvdrive_client.config import AttachConfig
from kvdrive_client.selectors import (HierarchicalIndex, IndexKind, LowRankIndex, MeanKeyIndex, OracleSelector,
                                     QuestIndex, make_selector)

B, H, G, D, S, P = 2, 2, 3, 32, 16, 64


def planted(seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, P * S, D, generator=g) * 0.3
    query = torch.randn(B, H, G, D, generator=g)
    hot = torch.stack([torch.randperm(P - 4, generator=g)[:4] + 2 for _ in range(B * H)]).reshape(B, H, 4)
    for b in range(B):
        for h in range(H):
            for p in hot[b, h].tolist():
                # Every token of a hot page leans towards the query of its head group.
                keys[b, h, p * S : (p + 1) * S] += 2.0 * query[b, h].mean(dim=0) / query[b, h].mean(dim=0).norm()
    return keys, query, hot


@pytest.mark.parametrize("kind", list(IndexKind))
def test_selectors_find_planted_pages(kind):
    keys, query, hot = planted()
    valid = torch.ones(B, P * S, dtype=torch.bool)
    sel = make_selector(kind, S, D**-0.5, **({"pages_per_cluster": 4} if kind is IndexKind.HIERARCHICAL else {}))
    sel.build(keys, valid)
    selectable = torch.ones(B, P, dtype=torch.bool)
    pages, _ = sel.select(query, selectable, 8)
    for b in range(B):
        for h in range(H):
            assert set(hot[b, h].tolist()) <= set(pages[b, h].tolist()), kind


def test_selection_respects_selectable_mask():
    keys, query, hot = planted(1)
    sel = MeanKeyIndex(S)
    sel.build(keys, torch.ones(B, P * S, dtype=torch.bool))
    selectable = torch.ones(B, P, dtype=torch.bool)
    selectable[:, hot.flatten()] = False
    pages, _ = sel.select(query, selectable, 6)
    assert not selectable.gather(1, pages.reshape(B, -1)).logical_not().any()


def test_padding_tokens_do_not_enter_page_means():
    keys, _, _ = planted(2)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    valid[0, : 3 * S + 5] = False
    sel = MeanKeyIndex(S)
    sel.build(keys, valid)
    torch.testing.assert_close(sel.means[0, :, 3], keys[0, :, 3 * S + 5 : 4 * S].mean(dim=1))


def test_added_pages_match_a_full_build():
    keys, query, _ = planted(3)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    for kind in (IndexKind.MEAN_KEY, IndexKind.QUEST, IndexKind.ORACLE):
        full = make_selector(kind, S, D**-0.5)
        full.build(keys, valid)
        grown = make_selector(kind, S, D**-0.5)
        grown.build(keys[:, :, : 10 * S], valid[:, : 10 * S])
        for p in range(10, P):
            grown.add_page(keys[:, :, p * S : (p + 1) * S], valid[:, p * S : (p + 1) * S])
        torch.testing.assert_close(grown.scores(query), full.scores(query))


def test_hierarchical_index_is_small_and_scores_like_mean_keys():
    keys, query, _ = planted(4)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    hier, quest, flat = HierarchicalIndex(S), QuestIndex(S), MeanKeyIndex(S)
    for sel in (hier, quest, flat):
        sel.build(keys, valid)
    assert hier.index_bytes <= 0.5 * quest.index_bytes
    # int8 mean keys rank pages as the float ones do, up to quantisation error.
    torch.testing.assert_close(hier.scores(query), flat.scores(query), atol=0.05, rtol=0.05)
    pages = torch.randint(-1, P, (B, H, 5))
    torch.testing.assert_close(hier.page_scores(query, pages), hier.scores(query).gather(2, pages.clamp_min(0)).masked_fill(pages < 0, float("-inf")))


def test_oracle_scores_are_attention_mass():
    keys, query, _ = planted(5)
    oracle = OracleSelector(S, D**-0.5)
    oracle.build(keys, torch.ones(B, P * S, dtype=torch.bool))
    mass = oracle.scores(query)
    torch.testing.assert_close(mass.sum(dim=-1), torch.full((B, H), float(G)))


def test_lowrank_at_full_rank_scores_the_exact_attention_mass():
    keys, query, _ = planted(5)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    valid[1, : 2 * S + 3] = False
    lowrank, oracle = LowRankIndex(S, D**-0.5, SketchLayout(D, D, 0)), OracleSelector(S, D**-0.5)
    lowrank.build(keys, valid, query[:, :, :, None])
    oracle.build(keys, valid)
    # int8 codes: the log mass is off by the rounding of each logit only.
    est, exact = lowrank.scores(query).exp(), oracle.scores(query)
    torch.testing.assert_close(est, exact, atol=0.02, rtol=0.05)


def test_a_sketch_layout_refuses_bad_counts_and_narrows_to_the_head_dim():
    for bad in ((0, 0, 0), (8, -1, 0), (8, 0, -1), (8, 4, 5)):
        with pytest.raises(ValueError, match="0 <= int8 \\+ int2 <= rank"):
            SketchLayout(*bad)
    # A rank past the head dim narrows the sketch from its int2 end.
    sel = LowRankIndex(S, D**-0.5, SketchLayout(D + 8, 4, 12))
    keys, query, _ = planted(1)
    sel.build(keys, torch.ones(B, P * S, dtype=torch.bool), query[:, :, :, None])
    assert (sel.layout.rank, sel.layout.int8, sel.layout.int2) == (D, 4, 4)
    sel = LowRankIndex(S, D**-0.5, SketchLayout(D + 8, 4, 4))  # past the int2 channels, int4 ones go
    sel.build(keys, torch.ones(B, P * S, dtype=torch.bool), query[:, :, :, None])
    assert (sel.layout.rank, sel.layout.int8, sel.layout.int4, sel.layout.int2) == (D, 4, D - 4, 0)


@pytest.mark.parametrize("head_dim, layout, kv_heads", [(64, SketchLayout(27, 1, 12), 3), (128, SketchLayout(54, 2, 24), 8),
                                                        (256, SketchLayout(108, 4, 52), 1)],
                         ids=["SmolLM2", "Llama 3", "Gemma 3"])
def test_the_default_sketch_stays_within_a_twentieth_of_an_fp16_kv_at_16k(head_dim, layout, kv_heads):
    """Codes, one validity byte a token per row and the two fp16 projections per KV head:
    at 16K tokens at most 0.05 of the fp16 K+V (with 12/64 int2 channels Gemma 3's 256 took 0.0506)."""
    assert AttachConfig().lowrank_layout(head_dim) == layout
    t = 16384
    index = kv_heads * (layout.rows * t + 2 * head_dim * layout.rank * 2 + layout.rank * 4) + t
    assert index <= 0.05 * kv_heads * t * 2 * head_dim * 2


@pytest.mark.parametrize("int2", [0, 4], ids=["int4 tail", "int4 then int2 tail"])
def test_lowrank_narrow_tail_keeps_the_ranking_of_all_int8_codes(int2):
    # The trailing channels carry little of q.k: int4 or int2 codes there barely move a page's mass.
    keys, query, _ = planted(5)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    mixed = LowRankIndex(S, D**-0.5, SketchLayout(16, 8, int2))
    wide = LowRankIndex(S, D**-0.5, SketchLayout(16, 16, 0))
    for sel in (mixed, wide):
        sel.build(keys, valid, query[:, :, :, None])
    assert mixed.codes.shape[2] == 8 + (8 - int2) // 2 + int2 // 4 and wide.codes.shape[2] == 16
    torch.testing.assert_close(mixed.scores(query).exp(), wide.scores(query).exp(), atol=0.02, rtol=0.1)
    selectable = torch.ones(B, P, dtype=torch.bool)
    agree = (mixed.select(query, selectable, 4)[0].sort(dim=-1).values == wide.select(query, selectable, 4)[0].sort(dim=-1).values)
    assert agree.float().mean() >= 0.9


def test_lowrank_fits_the_directions_the_queries_use():
    # Keys vary most in the first half of the dims; the queries read only the second half,
    # where the relevant pages stand out. Fitted to the queries, rank 4 finds those pages;
    # the keys' own principal directions (no queries) miss them.
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(B, H, P * S, D, generator=g) * 0.2
    keys[..., : D // 2] *= 20.0
    query = torch.zeros(B, H, G, 8, D)
    query[..., D // 2 :] = torch.randn(B, H, G, 8, D // 2, generator=g)
    direction = query[..., D // 2 :].mean(dim=(2, 3))
    hot = torch.randperm(P - 2, generator=g)[:4] + 1
    for p in hot.tolist():
        keys[:, :, p * S : (p + 1) * S, D // 2 :] += 1.5 * (direction / direction.norm(dim=-1, keepdim=True))[:, :, None]
    valid = torch.ones(B, P * S, dtype=torch.bool)
    selectable = torch.ones(B, P, dtype=torch.bool)
    fitted, unfitted = (LowRankIndex(S, D**-0.5, SketchLayout(4, 0, 0)) for _ in range(2))
    fitted.build(keys, valid, query)
    unfitted.build(keys, valid)
    step = query[:, :, :, -1]
    found = lambda sel: sum(len(set(hot.tolist()) & set(r.tolist())) for r in sel.select(step, selectable, 4)[0].reshape(-1, 4))
    assert found(fitted) == 4 * B * H
    assert found(unfitted) < found(fitted)


def test_lowrank_fits_the_prompts_last_queries():
    # The prompt's early queries read the first half of the dims, its last FIT_QUERIES (and
    # the decode's) the second half, where the relevant pages stand out: the fit whitens by
    # the last ones only, so it finds those pages, and the early queries change nothing.
    g = torch.Generator().manual_seed(8)
    t, last = P * S, LowRankIndex.FIT_QUERIES
    assert last < t
    keys = torch.randn(B, H, t, D, generator=g) * 0.2
    keys[..., : D // 2] *= 20.0
    query = torch.randn(B, H, G, t, D, generator=g)
    query[..., : t - last, D // 2 :] = 0.0
    query[..., : t - last, : D // 2] *= 10.0
    query[..., t - last :, : D // 2] = 0.0
    direction = torch.randn(B, H, D // 2, generator=g)
    direction /= direction.norm(dim=-1, keepdim=True)
    query[..., t - last :, D // 2 :] += 3.0 * direction[:, :, None, None]
    hot = torch.randperm(P - 2, generator=g)[:4] + 1
    for p in hot.tolist():
        keys[:, :, p * S : (p + 1) * S, D // 2 :] += 1.5 * direction[:, :, None]
    valid = torch.ones(B, t, dtype=torch.bool)
    selectable = torch.ones(B, P, dtype=torch.bool)
    fitted, other = (LowRankIndex(S, D**-0.5, SketchLayout(4, 0, 0)) for _ in range(2))
    fitted.build(keys, valid, query)
    early = query.clone()
    early[..., : t - last, :] = torch.randn(B, H, G, t - last, D, generator=g) * 100.0
    other.build(keys, valid, early)
    assert torch.equal(fitted.kproj, other.kproj) and torch.equal(fitted.qproj, other.qproj)
    step = query[:, :, :, -1]
    chosen = fitted.select(step, selectable, 4)[0].reshape(-1, 4)
    assert sum(len(set(hot.tolist()) & set(r.tolist())) for r in chosen) == 4 * B * H


def test_lowrank_added_pages_are_encoded_like_built_ones():
    keys, query, _ = planted(7)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    full = LowRankIndex(S, D**-0.5)
    full.build(keys, valid, query[:, :, :, None])
    grown = LowRankIndex(S, D**-0.5)
    grown.build(keys, valid, query[:, :, :, None])
    grown.codes, grown.valid, grown.num_pages = grown.codes[..., : 10 * S].clone(), grown.valid[:, : 10 * S].clone(), 10
    for p in range(10, P):
        grown.add_page(keys[:, :, p * S : (p + 1) * S], valid[:, p * S : (p + 1) * S])
    assert torch.equal(grown.codes[..., : P * S], full.codes[..., : P * S])  # full: with room for decoded pages
    torch.testing.assert_close(grown.scores(query), full.scores(query))


def test_lowrank_index_is_a_small_fraction_of_the_kv():
    keys, query, _ = planted(8)
    sel = LowRankIndex(S, D**-0.5)
    sel.build(keys.half(), torch.ones(B, P * S, dtype=torch.bool), query[:, :, :, None].half())
    assert (sel.layout.rank, sel.layout.int8, sel.layout.int2, sel.codes.shape[2]) == (27, 1, 12, 11)
    # 1 int8 + 14 int4 + 12 int2 channels = 11 bytes per token and head + one validity byte
    # per token, against 2 x D fp16 values; on top, the fp16 key and query projections and
    # the fp32 scales.
    assert sel.index_bytes == (11 * H + 1) * B * P * S + B * H * D * 27 * (2 + 2) + B * H * 27 * 4
