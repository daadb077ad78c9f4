"""What the device cache reserves: never more than the context's K and V, whatever the multiplier."""

import pytest
import torch

from kvdrive_client import attach

from test_attach_tiny import generate, left_padded

PAGE, LOCAL = 16, 64


def decode(model, store, lengths, new, **options):
    ids, mask = left_padded(lengths)
    handle = attach(model, store, page_size=PAGE, local_tokens=LOCAL, **options)
    try:
        out = generate(model, ids, mask, new=new)
        stats = handle.stats()
    finally:
        handle.detach()
    return out, stats


def test_at_budget_1_the_cache_reserves_the_pages_before_the_local_window_not_a_multiple(daemon, make_tiny):
    model = make_tiny("qwen2", layers=2)
    lengths, new = [300, 170, 233], 20
    ref = generate(model, *left_padded(lengths), new=new)
    with daemon.client() as store:
        out, stats = decode(model, store, lengths, new, budget=1.0, cache_multiplier=4)
    assert torch.equal(out.sequences, ref.sequences)
    # The K and V of the last step's context: 300 prompt tokens and new - 1 decoded ones, per row,
    # layer and KV head (the last token's K and V are never computed).
    tokens = max(lengths) + new - 1
    per_token = 2 * 2 * (128 // 4) * 4  # K and V, 2 KV heads of dim 32, float32
    rows_layers = len(lengths) * 2
    assert stats["kv_bytes"] == tokens * per_token * rows_layers
    # x4 would be four times the pages: the cache holds every page before the local window, once
    # (pages end where the prompt does: KVDrive's own padding before it counts in the pages).
    shift = -max(lengths) % PAGE
    before_local = (tokens + shift - LOCAL) // PAGE * PAGE
    assert stats["device_cache_bytes"] == before_local * per_token * rows_layers
    assert stats["device_cache_bytes"] <= stats["kv_bytes"]


@pytest.mark.parametrize("options", [dict(budget=0.5, cache_multiplier=16),
                                     dict(budget=0.25, cache_bytes=1 << 30),
                                     dict(budget=0.25, head_multipliers=((16.0, 1.0), (8.0, 16.0)))])
def test_no_cache_size_reserves_more_than_the_kv(daemon, make_tiny, options):
    model = make_tiny("qwen2", layers=2)
    with daemon.client() as store:
        _, stats = decode(model, store, [400], 8, **options)
    assert 0 < stats["device_cache_bytes"] <= stats["kv_bytes"]


def test_a_sparse_budget_reserves_its_multiple_of_the_selection(daemon, make_tiny):
    model = make_tiny("qwen2", layers=2)
    with daemon.client() as store:
        _, stats = decode(model, store, [1200], 4, budget=0.0625, cache_multiplier=2)
    tokens = 1200 + 4 - 1
    first_local = (tokens - LOCAL) // PAGE
    k = -(-(first_local - 1) // 16)  # ceil(6.25% of the selectable pages: those after the one sink page)
    per_page = 2 * 2 * 32 * 4 * PAGE
    assert stats["device_cache_bytes"] == (2 * k + 1) * per_page * 2
    assert stats["device_cache_bytes"] < stats["kv_bytes"] / 4
