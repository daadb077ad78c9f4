"""Gemma 3 270M, a real hybrid model (five sliding-window layers for every global one), through KVDrive."""

import torch

from kvdrive_client import attach
from kvdrive_client.models import license_text


def test_real_gemma3_at_full_budget_is_token_identical_on_a_2k_prompt(gemma3, daemon):
    model, tok = gemma3
    # Four times the sliding layers' 512-token window: the global layers attend far past it.
    ids = tok(license_text(), return_tensors="pt").input_ids[:, :2048]
    mask = torch.ones_like(ids)

    def greedy():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)

    plain = greedy()
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0, keep=True, namespace="gemma3")
        out = greedy()
        stats = handle.stats()
        seqs = store.list("gemma3")
        handle.detach()
    assert torch.equal(out.sequences, plain.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, plain.logits)) < 1e-4
    # only the 3 global layers are stored; the 15 sliding layers keep their 512-token window on the device
    assert [s["geometry"]["num_layers"] for s in seqs] == [3]
    assert stats["steps"] == 31 and stats["attended_fraction"] == 1.0
