"""Selectors on planted keys: the pages that hold the query's answer are found."""

import pytest
import torch

from kvdrive_client.selectors import HierarchicalIndex, IndexKind, MeanKeyIndex, OracleSelector, QuestIndex, make_selector

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
