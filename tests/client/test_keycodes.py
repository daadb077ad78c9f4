"""The per-key code index: codes, their bytes, and pages scored close to the exact mass."""

import pytest
import torch

from kvdrive_client.keycodes import KeyCodeIndex, decode, encode, rotation
from kvdrive_client.selectors import IndexKind, OracleSelector, make_selector

B, H, G, D, S, P = 2, 2, 3, 64, 16, 40


def keys_and_query(seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, P * S, D, generator=g)
    keys[..., :4] *= 4.0  # a few loud channels, as real keys have: the rotation spreads them
    return keys, torch.randn(B, H, G, D, generator=g)


def test_the_rotation_is_orthogonal_and_fixed():
    r = rotation(D)
    torch.testing.assert_close(r @ r.T, torch.eye(D), atol=1e-5, rtol=0)
    assert torch.equal(r, rotation(D)) and not torch.equal(r[:32, :32], rotation(32))


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_decode_within_half_a_step_of_each_value(bits):
    u = torch.randn(3, 50, D)
    codes, scale = encode(u, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 50, D * bits // 8) and scale.dtype == torch.float16
    err = (decode(codes, scale, bits) - u).abs()
    # Half a step, and the clamp of the largest value (at most one step) on the positive side.
    assert (err <= scale.float()[..., None] * 1.0 + 1e-6).all()
    assert err.mean() <= 0.3 * scale.float().mean()


def test_four_bit_scores_rank_pages_as_the_exact_mass_does_and_grow_page_by_page():
    keys, query = keys_and_query()
    valid = torch.ones(B, P * S, dtype=torch.bool)
    codes = make_selector(IndexKind.KEYCODES, S, D**-0.5)
    exact = OracleSelector(S, D**-0.5)
    for sel in (codes, exact):
        sel.build(keys, valid)
    approx, truth = codes.scores(query).exp(), exact.scores(query)
    assert approx.shape == truth.shape == (B, H, P)
    torch.testing.assert_close(approx.sum(-1), torch.full((B, H), float(G)), rtol=1e-4, atol=1e-4)
    # The 4 pages of most estimated mass hold nearly all the mass of the 4 best pages.
    top = approx.topk(4, dim=-1).indices
    assert (truth.gather(2, top).sum(-1) / truth.topk(4, dim=-1).values.sum(-1)).min() > 0.9
    grown = KeyCodeIndex(S, D**-0.5)
    grown.build(keys[:, :, : 10 * S], valid[:, : 10 * S])
    for p in range(10, P):
        grown.add_page(keys[:, :, p * S : (p + 1) * S], valid[:, p * S : (p + 1) * S])
    torch.testing.assert_close(grown.scores(query), codes.scores(query))
    # 32 bytes of codes, 2 of scale and 1 of validity a token and head, and the rotation once.
    assert codes.index_bytes == B * H * P * S * (32 + 2) + B * P * S + D * D * 4


def test_padding_is_never_scored_and_bad_settings_are_refused():
    keys, query = keys_and_query(1)
    valid = torch.ones(B, P * S, dtype=torch.bool)
    valid[0, : 3 * S] = False
    sel = KeyCodeIndex(S, D**-0.5)
    sel.build(keys, valid)
    assert torch.isneginf(sel.scores(query)[0, :, :3]).all() and sel.scores(query)[1].isfinite().all()
    with pytest.raises(ValueError, match="2 or 4 bits"):
        KeyCodeIndex(S, 1.0, bits=3)
    with pytest.raises(ValueError, match="whole bytes"):
        KeyCodeIndex(S, 1.0, bits=2).build(torch.zeros(1, 1, S, 6), torch.ones(1, S, dtype=torch.bool))
