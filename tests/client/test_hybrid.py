"""Hybrid models: sliding-window layers keep their window on the device, global layers decode
through KVDrive. At budget 1.0 the output must equal plain transformers for any order of kinds."""

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from kvdrive_client import UnsupportedModelError, attach
from test_attach_tiny import generate, left_padded

S, F = "sliding_attention", "full_attention"
WINDOW = 48  # shorter than every prompt below, and than the decode


def _common(layers: int) -> dict:
    return dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096)


def hybrid(family: str, layer_types: list[str] | None, seed: int = 0):
    torch.manual_seed(seed)
    n = len(layer_types) if layer_types else 2
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_common(n), use_sliding_window=True, sliding_window=WINDOW,
                                            max_window_layers=0, layer_types=layer_types)).eval()
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**_common(n), head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                                            max_window_layers=0, layer_types=layer_types)).eval()
    if family == "gemma3":
        config = Gemma3TextConfig(**{**_common(n), "num_key_value_heads": 1}, head_dim=32, sliding_window=WINDOW,
                                  query_pre_attn_scalar=32, layer_types=layer_types)
        return Gemma3ForCausalLM(config).eval()
    assert family == "mistral" and layer_types is None
    return MistralForCausalLM(MistralConfig(**_common(n), sliding_window=WINDOW)).eval()


def assert_equals_plain(daemon, model, lengths, new, **options):
    """Generate through KVDrive at budget 1.0: token-identical to plain transformers, logits within 1e-4.
    Returns the handle's stats and the sequences ``options['namespace']`` kept (if any)."""
    ids, mask = left_padded(lengths)
    ref = generate(model, ids, mask, new=new)
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0, **options)
        out = generate(model, ids, mask, new=new)
        stats = handle.stats()
        seqs = store.list(options["namespace"]) if "namespace" in options else []
        handle.detach()
    assert torch.equal(out.sequences, ref.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(out.logits, ref.logits)) < 1e-4
    return stats, seqs


CASES = [
    ("qwen2", [S, F]),
    ("qwen2", [F, S, F]),
    ("qwen3", [S, F]),
    ("gemma3", [S] * 5 + [F]),
    ("gemma3", [S, F]),
    ("gemma3", [F, S, S]),
]


@pytest.mark.parametrize("family, layer_types", CASES, ids=lambda v: "-".join(k[0] for k in v) if isinstance(v, list) else v)
def test_hybrid_at_full_budget_equals_plain_transformers(daemon, family, layer_types):
    ns = f"hybrid-{family}-{'-'.join(k[0] for k in layer_types)}"
    stats, seqs = assert_equals_plain(daemon, hybrid(family, layer_types), [300], 24, keep=True, namespace=ns)
    # only the global layers went to the store, and they decoded through KVDrive
    assert [s["geometry"]["num_layers"] for s in seqs] == [layer_types.count(F)]
    assert stats["steps"] == 24 - 1 and stats["attended_fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize("family, layer_types", [("qwen2", [S, F]), ("gemma3", [S, S, F])])
def test_hybrid_batch_of_different_lengths_equals_plain_transformers(daemon, family, layer_types):
    stats, _ = assert_equals_plain(daemon, hybrid(family, layer_types, seed=3), [260, 170], 20)
    assert stats["steps"] == 20 - 1


def test_hybrid_sparse_decode_stores_only_global_layers(daemon):
    model = hybrid("gemma3", [S, S, F], seed=1)
    ids, mask = left_padded([640])
    with daemon.client() as store:
        handle = attach(model, store, budget=0.125, keep=True, namespace="hybrid")
        out = generate(model, ids, mask, new=12)
        stats = handle.stats()
        seqs = store.list("hybrid")
        handle.detach()
    assert out.sequences.shape == (1, 640 + 12)
    assert len(seqs) == 1 and seqs[0]["geometry"]["num_layers"] == 1
    assert stats["attended_fraction"] < 0.5  # the global layer decoded sparsely


def test_mistral_with_a_window_shorter_than_the_prompt_equals_plain_transformers(daemon, caplog):
    with caplog.at_level("WARNING", logger="kvdrive_client.hooks"):
        assert_equals_plain(daemon, hybrid("mistral", None), [300, 200], 24)
    assert "every layer of this model attends over a sliding window" in caplog.text


def test_other_layer_kinds_are_refused_by_name():
    torch.manual_seed(0)
    config = Qwen2Config(**_common(2), use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=["chunked_attention", F])
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        attach(Qwen2ForCausalLM(config).eval(), store="ipc:///nonexistent/kvstored.sock")


def test_attention_logit_softcapping_is_refused_with_a_reason():
    model = hybrid("gemma3", [S, F])
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedModelError, match="caps attention logits"):
        attach(model, store="ipc:///nonexistent/kvstored.sock")


def test_reuse_is_refused_where_every_layer_attends_over_a_sliding_window():
    with pytest.raises(ValueError, match="every layer of this model attends over a sliding window"):
        attach(hybrid("mistral", None), store="ipc:///nonexistent/kvstored.sock", reuse=True)
