"""Reopening a stored prompt: the second generate() skips prefill over it."""

import torch

from kvdrive_client import attach


def run(model, ids, new=12):
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def test_second_generate_reuses_stored_prompt_pages_across_a_restart(daemon_factory, make_tiny):
    model = make_tiny("llama", layers=2)
    ids = torch.randint(1, 512, (1, 203), generator=torch.Generator().manual_seed(7))
    ref = run(model, ids)
    d = daemon_factory().start()
    with d.client() as store:
        handle = attach(model, store, budget=1.0, reuse=True)
        first = run(model, ids)
        s1 = handle.stats()
        handle.detach()
        names = [s["seq"] for s in store.list("kvdrive")]
    # Only the kept prompt prefix remains; the session's own sequence was deleted.
    assert len(names) == 1 and names[0].startswith("prefix-")
    assert d.stop() == 0
    d.start()
    with d.client() as store:
        handle = attach(model, store, budget=1.0, reuse=True)
        second = run(model, ids)
        s2 = handle.stats()
        handle.detach()
    assert torch.equal(first.sequences, ref.sequences) and torch.equal(second.sequences, ref.sequences)
    assert s1["prefill_tokens"] == 203 and "restored_pages" not in s1
    # Pages end where the prompt does: 5 tokens of KVDrive's padding, then the 203. All but the
    # last of the 13 pages come from the store (187 tokens); the last page runs through the model.
    assert s2["restored_pages"] == 12 and s2["prefill_tokens"] == 16
    assert max((a - b).abs().max().item() for a, b in zip(second.logits, ref.logits)) < 1e-4


def test_a_different_prompt_does_not_reuse(daemon, make_tiny):
    model = make_tiny("qwen2")
    g = torch.Generator().manual_seed(3)
    a = torch.randint(1, 512, (1, 150), generator=g)
    b = a.clone()
    b[0, 5] = (b[0, 5] + 1) % 512
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0, reuse=True)
        run(model, a, new=4)
        out = run(model, b, new=4)
        stats = handle.stats()
        handle.detach()
        assert len(store.list("kvdrive")) == 2
    assert "restored_pages" not in stats
    assert torch.equal(out.sequences, run(model, b, new=4).sequences)
