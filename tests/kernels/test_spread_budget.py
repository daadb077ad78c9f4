"""spread_budget: a row's pages shared among its heads by score, each head keeping a floor."""

import torch

from kvdrive.kernels.reference import NEG_INF, spread_budget


def test_the_best_pages_over_all_heads_win_beyond_each_heads_floor():
    # 2 heads, k = 2 per head, offered 4 each; floor 1.
    pages = torch.tensor([[[10, 11, 12, 13], [20, 21, 22, 23]]])
    scores = torch.tensor([[[9.0, 8.0, 7.0, 6.0], [1.0, 0.5, 0.2, 0.1]]])
    out = spread_budget(pages, scores, k=2, floor=1)
    assert out.tolist() == [[[10, 11, 12, -1], [20, -1, -1, -1]]]  # 4 pages in all; head 1 keeps its best
    assert int((out >= 0).sum()) == 2 * 2


def test_scores_in_any_order_and_missing_pages_are_never_chosen():
    pages = torch.tensor([[[13, 10, 12, 11], [23, -1, 20, 21]]])
    scores = torch.tensor([[[6.0, 9.0, 7.0, 8.0], [0.1, NEG_INF, 5.0, 0.5]]])
    out = spread_budget(pages, scores, k=2, floor=1)
    assert sorted(out[0, 0][out[0, 0] >= 0].tolist()) == [10, 11, 12]
    assert out[0, 1][out[0, 1] >= 0].tolist() == [20]


def test_no_room_to_spread_leaves_the_pages_as_they_are():
    pages = torch.randint(0, 50, (3, 2, 4))
    scores = torch.rand(3, 2, 4)
    assert torch.equal(spread_budget(pages, scores, k=4, floor=2), pages)
