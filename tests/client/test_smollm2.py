"""SmolLM2-135M on real text through a real kvstored."""

import pytest
import torch

from kvdrive_client import attach

NEW = 32
# Greedy tokens must match exactly; logits may differ by float summation order.
LOGIT_TOL = 1e-3


def batch_from(ids, lengths, starts):
    t = max(lengths)
    out = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, (n, s) in enumerate(zip(lengths, starts)):
        out[i, t - n :] = ids[s : s + n]
        mask[i, t - n :] = 1
    return out, mask


def run(model, ids, mask):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


# The padded batch at half batch 1's length: what it adds is the rows' left padding.
@pytest.mark.parametrize("lengths", [[2048], [1024, 765, 895]], ids=["batch1", "batch3-padded"])
def test_full_budget_matches_transformers(smollm2, license_ids, daemon, lengths):
    model, _ = smollm2
    ids, mask = batch_from(license_ids, lengths, [3000, 9000, 15000][: len(lengths)])
    ref = run(model, ids, mask)
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0)
        try:
            out = run(model, ids, mask)
        finally:
            handle.detach()
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < LOGIT_TOL


# Batch 3 against a DRAM tier that holds everything; batch 1 against one too small
# for the sequence, so most fetched blocks come from the SSD tier.
@pytest.mark.parametrize("dram, lengths", [("64M", [2048, 1530, 1790]), ("256K", [2048])], ids=["dram", "dram-capped"])
def test_sparse_budget_runs_through_the_store(smollm2, license_ids, daemon_factory, dram, lengths):
    model, _ = smollm2
    ids, mask = batch_from(license_ids, lengths, [3000, 9000, 15000][: len(lengths)])
    d = daemon_factory(dram=dram).start()
    with d.client() as store:
        handle = attach(model, store, budget=0.0625)
        try:
            out = run(model, ids, mask)
            stats = handle.stats()
        finally:
            handle.detach()
    assert out.sequences.shape == (len(lengths), 2048 + NEW)
    assert stats["steps"] == NEW - 1
    assert 0 < stats["hit_rate"] <= 1 and stats["misses"] > 0
    assert stats["attended_fraction"] < 0.25
    if dram == "256K":
        assert stats["bytes_from_ssd"] > 0
    else:
        assert stats["bytes_from_dram"] > 0
