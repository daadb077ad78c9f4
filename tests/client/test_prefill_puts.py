"""Prefill puts run while the model computes the next layer: all of them are stored when the
prefill ends, and a put the daemon refuses still fails the generation."""

import pytest
import torch

from kvdrive_client import StoreFullError, attach


def test_every_prefill_page_of_every_layer_is_stored_when_decode_starts(daemon, make_tiny):
    layers, prompt, page = 4, 700, 16
    model = make_tiny("llama", layers=layers)
    ids = torch.randint(1, 500, (1, prompt), generator=torch.Generator().manual_seed(3))
    with daemon.client() as store:
        handle = attach(model, store, budget=0.0625, page_size=page, keep=True, cache_multiplier=0, namespace="pf")
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        stats = handle.stats()
        handle.detach()
        seqs = store.list("pf")
    heads = model.config.num_key_value_heads
    assert len(seqs) == 1
    # Prefill pages of every layer and KV head, plus none or one page completed while decoding.
    assert seqs[0]["num_blocks"] >= layers * heads * (prompt // page)
    # With no device cache every selected page is fetched, and each fetch found its page stored.
    assert stats["misses"] > 0 and stats["bytes_fetched"] > 0
    assert stats["prefill_put_ms"] > 0 and stats["bytes_put"] >= layers * heads * (prompt // page) * 2 * page * 2


def test_a_prefill_put_the_store_refuses_fails_the_generation_and_the_daemon_carries_on(daemon_factory, make_tiny):
    d = daemon_factory(ssd_max="1M").start()
    model = make_tiny("llama", layers=4)
    ids = torch.randint(1, 500, (1, 2000), generator=torch.Generator().manual_seed(4))
    with d.client() as store:
        handle = attach(model, store, budget=0.0625)
        with pytest.raises(StoreFullError), torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        handle.detach()
        assert store.ping()
    assert d.alive()
