"""attach() on tiny random-weight models, against a real kvstored."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from kvdrive_client import UnsupportedModelError, attach


def generate(model, ids, mask=None, new=16):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def left_padded(lengths, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, t - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, t - n :] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_full_budget_is_token_identical(kind, daemon, make_tiny):
    model = make_tiny(kind)
    ids, mask = left_padded([300])
    ref = generate(model, ids, mask, new=24)
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0)
        out = generate(model, ids, mask, new=24)
        handle.detach()
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-4


def test_full_budget_batch_with_padding_is_token_identical(daemon, make_tiny):
    model = make_tiny("qwen2")
    ids, mask = left_padded([300, 170, 233])
    ref = generate(model, ids, mask, new=20)
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0)
        out = generate(model, ids, mask, new=20)
        stats = handle.stats()
        handle.detach()
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-4
    assert stats["attended_fraction"] == pytest.approx(1.0)


def test_sparse_budget_fetches_from_ssd_when_dram_is_small(daemon_factory, make_tiny):
    d = daemon_factory(dram="64K").start()
    model = make_tiny("qwen2", layers=3)
    ids, mask = left_padded([900, 700])
    with d.client() as store:
        handle = attach(model, store, budget=0.0625, cache_multiplier=1)
        out = generate(model, ids, mask, new=24)
        stats = handle.stats()
        handle.detach()
    assert out.sequences.shape == (2, 900 + 24)
    assert stats["misses"] > 0 and 0 < stats["hit_rate"] < 1
    assert stats["bytes_from_ssd"] > 0
    assert stats["attended_fraction"] < 0.5


def test_pages_completed_during_decode_are_stored_and_selectable(daemon, make_tiny):
    model = make_tiny("llama")
    ids, mask = left_padded([130])
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0, local_tokens=16, keep=True, namespace="flush")
        out = generate(model, ids, mask, new=70)
        stats = handle.stats()
        seqs = store.list("flush")
        handle.detach()
        assert len(seqs) == 1
        # 14 tokens of KVDrive's padding, 130 + 69 decoded: pages 0..12 complete (page 13 still
        # open), every layer of each stored; pages 0..8 at prefill.
        assert seqs[0]["complete_pages"] == (14 + 130 + 70 - 1) // 16
        assert stats["pages_flushed"] == seqs[0]["complete_pages"] - (14 + 130) // 16
    ref = generate(model, ids, mask, new=70)
    assert torch.equal(out.sequences, ref.sequences)


def test_detach_restores_the_model(daemon, tiny_qwen2):
    ids, mask = left_padded([100])
    before = tiny_qwen2.config._attn_implementation
    config = tiny_qwen2.config.to_dict()
    attrs = set(tiny_qwen2.__dict__)
    module_attrs = [set(m.__dict__) for m in tiny_qwen2.modules()]
    ref = generate(tiny_qwen2, ids, mask, new=8)
    with daemon.client() as store:
        handle = attach(tiny_qwen2, store, budget=0.5)
        assert tiny_qwen2.config._attn_implementation == "kvdrive"
        generate(tiny_qwen2, ids, mask, new=8)
        handle.detach()
    assert tiny_qwen2.config._attn_implementation == before
    assert tiny_qwen2.config.to_dict() == config
    assert set(tiny_qwen2.__dict__) == attrs and [set(m.__dict__) for m in tiny_qwen2.modules()] == module_attrs
    assert "generate" not in tiny_qwen2.__dict__
    again = generate(tiny_qwen2, ids, mask, new=8)
    assert torch.equal(again.sequences, ref.sequences)


def test_caches_of_two_handles_on_one_model_decode_in_turn_as_each_alone(daemon, make_tiny):
    model = make_tiny("llama")
    ids, _ = left_padded([500])
    fed = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    options = [dict(budget=0.25, index="lowrank"), dict(budget=0.125, index="quest")]

    def decode(store, which, in_turn):
        handles = [attach(model, store, **options[i]) for i in which]
        caches = [h.new_cache(1) for h in handles]
        logits = [[] for _ in caches]
        with torch.no_grad():
            for c in caches:
                model(input_ids=ids, cache=c)
            # in turn: every step in each cache before the next step; else one cache after the other
            order = [(i, j) for i in range(fed.shape[1]) for j in range(len(caches))] if in_turn else \
                [(i, j) for j in range(len(caches)) for i in range(fed.shape[1])]
            for i, j in order:
                logits[j].append(model(input_ids=fed[:, i : i + 1], cache=caches[j]).logits[0, -1])
        stats = [h.stats() for h in handles]
        for c in caches:
            c.close()
        for h in reversed(handles):
            h.detach()
        return [torch.stack(x) for x in logits], stats

    with daemon.client() as store:
        together, stats = decode(store, [0, 1], in_turn=True)
        alone = [decode(store, [i], in_turn=False)[0][0] for i in (0, 1)]
    for i in (0, 1):
        assert torch.equal(together[i], alone[i])
        assert stats[i]["steps"] == 8 * 1 and stats[i]["select_ms"] > 0  # each session decoded sparsely, none densely
    assert model.config._attn_implementation != "kvdrive"


@pytest.mark.parametrize("budget_tokens, pages", [(16, 1), (17, 2), (64, 4), (10_000, 14)])
def test_budget_tokens_selects_a_fixed_count_of_pages(daemon, make_tiny, budget_tokens, pages):
    """The decode step's 301 tokens after KVDrive's 4 of padding (pages end where the prompt
    does): the local window from page 15 on (65 tokens), 1 sink page (its 12 real tokens),
    14 selectable pages between them."""
    model = make_tiny("llama")
    ids, mask = left_padded([300])
    with daemon.client() as store:
        handle = attach(model, store, budget_tokens=budget_tokens, cache_multiplier=1)
        generate(model, ids, mask, new=2)
        stats = handle.stats()
        handle.detach()
    per_step = stats["attended_tokens"] / (stats["steps"] * model.config.num_hidden_layers * model.config.num_key_value_heads)
    assert per_step == 12 + pages * 16 + 65


def test_unsupported_model_is_refused_with_a_reason():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        attach(model)


def test_a_full_attention_qwen2_with_a_window_size_set_is_still_accepted(daemon):
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False, sliding_window=64)
    handle = attach(Qwen2ForCausalLM(config).eval(), store=daemon.address)
    handle.detach()


@pytest.mark.parametrize("options, message", [
    ({"budget": 0}, "budget"),
    ({"budget": 1.5}, "fraction in \\(0, 1\\], got 1.5; for a count of 1.5 tokens"),
    ({"budget": "0.1"}, "budget must be a number, a fraction in \\(0, 1\\]; got str '0.1'"),
    ({"budget": 2}, "budget_tokens=2"),
    ({"budget_tokens": 16.5}, "budget_tokens must be a whole number of tokens, got float 16.5"),
    ({"budget_tokens": 0}, "budget_tokens must be >= 1"),
    ({"budget": 0.1, "budget_tokens": 64}, "both given: budget_tokens replaces budget; give one of them"),
    ({"index": "kmeans"}, "hierarchical"),
    ({"eviction": "fifo"}, "lookahead"),
    ({"cache_multiplier": 0.5}, "cache_multiplier"),
    ({"sink_tokens": 10}, "multiple of page_size"),
    ({"local_tokens": 4}, "local_tokens"),
    ({"rank": 0}, "rank must be a whole number in 1..4096"),
    ({"int8_channels": -1}, "int8_channels must be a whole number in 0..4096 or None \\(the default layout\\), got -1"),
    ({"int8_channels": 2.5}, "int8_channels must be a whole number"),
    ({"int2_channels": -2}, "int2_channels must be a whole number in 0..4096 or None"),
    ({"rank": 8, "int8_channels": 4, "int2_channels": 5}, "exceed rank 8"),
    ({"nonsense": 1}, "nonsense"),
])
def test_bad_options_are_refused(options, message, tiny_qwen2):
    with pytest.raises((ValueError, TypeError), match=message):
        attach(tiny_qwen2, store="ipc:///nonexistent/kvstored.sock", **options)


@pytest.mark.parametrize("order", ["first detached first", "last detached first"])
def test_two_handles_detach_in_any_order(daemon, make_tiny, order):
    model = make_tiny("llama")
    ids, mask = left_padded([40])
    plain = generate(model, ids, mask, new=6).sequences
    a = attach(model, daemon.address, budget=1.0)
    b = attach(model, daemon.address, budget=1.0)
    first, second = (a, b) if order == "first detached first" else (b, a)
    first.detach()
    # the other handle still decodes through KVDrive, exactly
    assert model.config._attn_implementation == "kvdrive"
    before = second.stats().get("steps", 0)
    assert torch.equal(generate(model, ids, mask, new=6).sequences, plain)
    assert second.stats()["steps"] > before
    second.detach()
    assert model.config._attn_implementation != "kvdrive" and "generate" not in model.__dict__
    assert torch.equal(generate(model, ids, mask, new=6).sequences, plain)


def test_stats_after_detach_of_an_owned_store_keeps_its_last_counters(make_tiny):
    model = make_tiny("llama")
    ids, mask = left_padded([40])
    handle = attach(model, dram="16M", budget=1.0)
    generate(model, ids, mask, new=4)
    handle.detach()
    stats = handle.stats()
    assert stats["steps"] > 0 and stats["store"].get("puts", 0) > 0


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_beam_search_and_several_sequences_are_refused_with_a_reason(daemon, tiny_llama, kwargs):
    handle = attach(tiny_llama, daemon.address)
    ids, mask = left_padded([40])
    with pytest.raises(NotImplementedError, match="batch expansion"):
        tiny_llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kwargs)
    handle.detach()


def test_the_sketch_layout_reaches_every_layers_index(daemon, make_tiny):
    model = make_tiny("llama")  # head dim 32: the default sketch is rank 13: 1 int8, 6 int4, 6 int2 channels
    ids, mask = left_padded([300])
    with daemon.client() as store:
        sketches = {}
        for options in ({}, {"rank": 12, "int8_channels": 4}, {"rank": 12, "int8_channels": 4, "int2_channels": 4}):
            handle = attach(model, store, budget=0.25, **options)
            cache = handle.new_cache(1)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, cache=cache)
            selectors = [ls.selector for ls in cache.session.ctx.layers]
            sketches[tuple(options.values())] = {(s.layout.rank, s.layout.int8, s.layout.int2, s.codes.shape[2])
                                                 for s in selectors}
            assert cache.session.index_bytes() == sum(s.index_bytes for s in selectors) > 0
            cache.close()
            handle.detach()
    # int8 channels a row each, int4 two to a row, int2 four (a given rank has no int2 unless asked)
    assert sketches == {(): {(13, 1, 6, 6)}, (12, 4): {(12, 4, 0, 8)}, (12, 4, 4): {(12, 4, 4, 7)}}
