"""Reopening a stored prompt: the second generate() skips prefill over it."""

import time

import pytest
import torch

from kvdrive_client import attach


def run(model, ids, new=12):
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def test_second_generate_reuses_stored_prompt_pages_across_a_restart(daemon_factory, make_tiny):
    model = make_tiny("llama", layers=2)
    ids = torch.randint(1, 512, (1, 1000), generator=torch.Generator().manual_seed(7))
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
    assert s1["prefill_tokens"] == 1000 and "restored_pages" not in s1
    # Pages end where the prompt does: 8 tokens of KVDrive's padding, then the 1000. The first
    # 62 of the 63 pages were stored; the last 32 tokens, whose queries seed the device cache,
    # run through the model again (at budget 1 the index's fit to the last 512 does not
    # count): 61 pages come from the store.
    assert s2["restored_pages"] == 61 and s2["prefill_tokens"] == 32
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


def test_a_reused_prompt_decodes_as_the_fresh_one(smollm2, license_ids, daemon):
    # At a low budget the chosen pages depend on the index's fit to the prompt's last
    # queries and on the cache's seed: a reused prompt must get the fresh prompt's.
    model, _ = smollm2
    ids = license_ids[None, 2000:3100]
    with daemon.client() as store:
        handle = attach(model, store, budget=0.125, reuse=True)
        fresh = run(model, ids, new=12)
        reused = run(model, ids, new=12)
        stats = handle.stats()
        handle.detach()
    assert torch.equal(reused.sequences, fresh.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(reused.logits, fresh.logits)) < 1e-3
    # 4 tokens of padding, then the 1100; the last 512 run through the model.
    assert stats["restored_pages"] == (1100 + 4 - 512) // 16


@pytest.mark.parametrize("budget", [0.5, 1.0])
def test_a_prompt_shorter_than_the_fit_runs_in_full_and_keeps_its_stored_pages(daemon, make_tiny, budget):
    model = make_tiny("qwen2")
    ids = torch.randint(1, 512, (1, 150), generator=torch.Generator().manual_seed(5))
    with daemon.client() as store:
        handle = attach(model, store, budget=budget, reuse=True)
        first = run(model, ids, new=4)
        kept = store.list("kvdrive")
        second = run(model, ids, new=4)
        stats = handle.stats()
        handle.detach()
        assert store.list("kvdrive") == kept and len(kept) == 1  # stored by the first, left as it was
    assert torch.equal(second.sequences, first.sequences)
    if budget < 1:
        # Its last 512 tokens' queries are all of it: nothing is loaded, the prompt runs again.
        assert "restored_pages" not in stats and stats["prefill_tokens"] == 300
    else:
        # Every page is attended, so the index's fit does not count: only the cache seed's
        # obs_window runs again. 8 pages of 16 are restored, 118 prompt tokens (page 0 starts
        # with the 10 tokens of padding that end the prompt on a page), and 32 run again.
        assert stats["restored_pages"] == 8 and stats["prefill_tokens"] == 150 + 32


def flip_a_stored_bit(d, stored) -> None:
    """Damage the first block of the first extent on ``d``'s SSD that ``stored(extent)`` picks."""
    from kvdrive.layout.format import DATA_FILE, META_DIR
    from kvstored.catalog import Catalog

    catalog = Catalog(d.ssd / META_DIR, 1 << 30, durable=False, readonly=True)
    try:
        ext = next(e for e in catalog.iter_extents() if stored(e))
    finally:
        catalog.close()
    with open(d.ssd / DATA_FILE, "r+b") as f:
        f.seek(ext.offset + 100)
        byte = f.read(1)[0]
        f.seek(ext.offset + 100)
        f.write(bytes([byte ^ 0x10]))


def stop_storing_after_layer_0(model, ids, monkeypatch) -> None:
    """A generate() of ``ids`` that fails after its prefill stored layer 0's pages (the model
    must be attached with ``reuse=True``): the prompt's stored pages are left incomplete."""
    from kvdrive_client.decode import fetch

    put_layer = fetch.StoreIO.put_layer

    def stop_after_layer_0(io, layer, *args, **kwargs):
        if layer == 1:
            raise RuntimeError("stopped while storing")
        return put_layer(io, layer, *args, **kwargs)

    monkeypatch.setattr(fetch.StoreIO, "put_layer", stop_after_layer_0)
    with pytest.raises(RuntimeError, match="stopped while storing"):
        run(model, ids, new=4)
    monkeypatch.setattr(fetch.StoreIO, "put_layer", put_layer)


def test_stored_pages_another_session_left_incomplete_are_neither_used_nor_written(daemon, make_tiny, monkeypatch,
                                                                                   caplog):
    # A process that stopped while storing a prompt (here: its prefill failed after layer 0's
    # puts) leaves that prompt's pages incomplete; a process storing it right now looks the same.
    model = make_tiny("llama", layers=2)
    ids = torch.randint(1, 512, (1, 1000), generator=torch.Generator().manual_seed(11))
    ref = run(model, ids, new=4)
    with daemon.client() as store:
        handle = attach(model, store, budget=0.5, reuse=True)
        stop_storing_after_layer_0(model, ids, monkeypatch)
        left = store.list("kvdrive")
        assert len(left) == 1 and left[0]["complete_pages"] == 0
        with caplog.at_level("INFO", logger="kvdrive_client.decode.prefix"):
            outs = [run(model, ids, new=4) for _ in range(2)]  # an `exists` error, before
        stats = handle.stats()
        handle.detach()
        assert store.list("kvdrive") == left  # not written to, not deleted
    assert all(torch.equal(o.sequences, ref.sequences) for o in outs)
    assert "restored_pages" not in stats and "incomplete: another process is storing them" in caplog.text


def test_stored_pages_a_stopped_process_left_incomplete_are_deleted_and_stored_anew(daemon, make_tiny, monkeypatch,
                                                                                    caplog):
    # Its session is gone, so nobody will finish them: the next session deletes them (by uid,
    # so never another's made since), stores the prompt again, and the one after reuses it.
    model = make_tiny("llama", layers=2)
    ids = torch.randint(1, 512, (1, 1000), generator=torch.Generator().manual_seed(11))
    ref = run(model, ids, new=4)
    with daemon.client() as stopped:
        handle = attach(model, stopped, budget=0.5, reuse=True)
        stop_storing_after_layer_0(model, ids, monkeypatch)
        handle.detach()
    with daemon.client() as store:
        deadline = time.monotonic() + 10
        while (left := store.list("kvdrive"))[0]["writing"]:  # its session ends with its connection
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(left) == 1 and left[0]["complete_pages"] == 0
        outs, stats = [], []
        for _ in range(2):
            handle = attach(model, store, budget=0.5, reuse=True)
            with caplog.at_level("INFO", logger="kvdrive_client.decode.prefix"):
                outs.append(run(model, ids, new=4))
            stats.append(handle.stats())
            handle.detach()
        [now] = store.list("kvdrive")
    assert all(torch.equal(o.sequences, ref.sequences) for o in outs)
    assert now["uid"] != left[0]["uid"] and now["complete_pages"] > 0
    assert "left incomplete when it stopped" in caplog.text
    assert "restored_pages" not in stats[0] and stats[1]["restored_pages"] > 0


def test_a_prompt_another_process_starts_storing_first_is_left_to_it(daemon, make_tiny, monkeypatch):
    from kvdrive_client.decode import prefix

    model = make_tiny("llama", layers=2)
    ids = torch.randint(1, 512, (1, 1000), generator=torch.Generator().manual_seed(11))
    ref = run(model, ids, new=4)
    open_prefix = prefix.open_prefix
    with daemon.client() as store, daemon.client() as other:

        def racing(io, names, *args):
            found = open_prefix(io, names, *args)
            for name in names:  # between this session's look and its prefill, another creates the names
                other.create("kvdrive", name, io.geometry)
            return found

        monkeypatch.setattr(prefix, "open_prefix", racing)
        handle = attach(model, store, budget=0.5, reuse=True)
        out = run(model, ids, new=4)  # an `exists` error at its first put, before
        handle.detach()
        left = store.list("kvdrive")
        assert len(left) == 1 and left[0]["complete_pages"] == 0  # the other's, as it made it
    assert torch.equal(out.sequences, ref.sequences)


def _gemma3_with_window(window: int):
    from test_hybrid import hybrid

    model = hybrid("gemma3", ["sliding_attention", "full_attention", "sliding_attention"])
    model.config.sliding_window = window
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = window
    return model


@pytest.mark.parametrize("window", [48, 1000])  # wider than the 32 tokens a reused prompt runs again at budget 1
def test_a_hybrid_models_reused_prompt_starts_its_sliding_layers_with_their_windows(daemon, window):
    # Their windows live in transformers' own cache layers: stored beside the prompt's pages and
    # loaded into them, the reused prompt decodes as the fresh one (before, it started them
    # empty and other tokens came out).
    model = _gemma3_with_window(window)
    ids = torch.randint(1, 500, (1, 1200), generator=torch.Generator().manual_seed(1))
    ref = run(model, ids, new=8)
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0, reuse=True)
        fresh, reused = run(model, ids, new=8), run(model, ids, new=8)
        stats = handle.stats()
        handle.detach()
        names = sorted(s["seq"] for s in store.list("kvdrive"))
    assert len(names) == 2 and names[1] == names[0] + "-w73"  # the prompt's pages, its windows at page 73
    assert stats["restored_pages"] == 73
    for out in (fresh, reused):
        assert torch.equal(out.sequences, ref.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-4


def test_a_hybrid_prompt_stored_without_its_windows_is_prefilled_and_they_are_stored(daemon, caplog):
    model = _gemma3_with_window(1000)
    ids = torch.randint(1, 500, (1, 1200), generator=torch.Generator().manual_seed(2))
    ref = run(model, ids, new=4)
    with daemon.client() as store:
        handle = attach(model, store, budget=1.0, reuse=True)
        run(model, ids, new=4)
        windows = next(s["seq"] for s in store.list("kvdrive") if "-w" in s["seq"])
        store.delete("kvdrive", windows)  # as a store written before windows were kept
        with caplog.at_level("INFO", logger="kvdrive_client.decode.prefix"):
            again = run(model, ids, new=4)
        first = handle.stats().get("restored_pages", 0)
        reused = run(model, ids, new=4)
        stats = handle.stats()
        handle.detach()
        assert windows in [s["seq"] for s in store.list("kvdrive")]  # stored again by the second run
    assert "stored without the sliding-window layers' windows" in caplog.text and first == 0
    assert stats["restored_pages"] == 73
    assert torch.equal(again.sequences, ref.sequences) and torch.equal(reused.sequences, ref.sequences)


@pytest.mark.parametrize("damaged", ["pages", "windows"])
def test_a_damaged_stored_prompt_is_dropped_and_prefilled_again(daemon_factory, damaged):
    # A reused prompt's stored pages (and a hybrid model's windows) are what the prompt
    # computes: one that fails its checksum must not fail that prompt for good.
    from kvdrive_client import ChecksumError

    model = _gemma3_with_window(1000)
    ids = torch.randint(1, 500, (1, 1200), generator=torch.Generator().manual_seed(4))
    ref = run(model, ids, new=4)
    d = daemon_factory(dram="0").start()  # every page on the SSD
    with d.client() as store:
        handle = attach(model, store, budget=1.0, reuse=True)
        run(model, ids, new=4)
        windows = next(store.open("kvdrive", s["seq"]) for s in store.list("kvdrive") if "-w" in s["seq"])
        flip_a_stored_bit(d, lambda e: (e.uid == windows.uid) == (damaged == "windows"))
        with pytest.raises(ChecksumError, match="stored pages were deleted: the next generate"):
            run(model, ids, new=4)
        assert store.list("kvdrive") == []  # the prompt's pages and its windows
        again = run(model, ids, new=4)  # prefilled in full, and stored again
        handle.detach()
        assert len(store.list("kvdrive")) == 2
    assert torch.equal(again.sequences, ref.sequences)
    assert d.alive()


def test_a_stored_prompt_a_decode_fetch_finds_damaged_is_dropped_too(daemon_factory, make_tiny):
    # The prefill loads every stored page of the prompt and checks it; a page damaged after
    # that (here: every block of the prompt's, once the prefill is done) is met by a decode
    # step's fetch.
    from kvdrive.layout.format import DATA_FILE, META_DIR
    from kvdrive_client import ChecksumError
    from kvstored.catalog import Catalog

    model = make_tiny("llama", layers=2)
    ids = torch.randint(1, 512, (1, 1000), generator=torch.Generator().manual_seed(12))
    d = daemon_factory(dram="0").start()  # every fetch reads the SSD
    with d.client() as store:
        handle = attach(model, store, budget=0.25, cache_multiplier=1, reuse=True)
        first = run(model, ids, new=16)
        (prompt,) = [store.open("kvdrive", s["seq"]) for s in store.list("kvdrive")]

        def damage_after_the_prefill(module, args, kwargs, out):
            if kwargs["input_ids"].shape[1] > 1:  # the prefill's forward
                catalog = Catalog(d.ssd / META_DIR, 1 << 30, durable=False, readonly=True)
                try:
                    extents = [e for e in catalog.iter_extents() if e.uid == prompt.uid]
                finally:
                    catalog.close()
                bb = prompt.geometry.block_bytes
                with open(d.ssd / DATA_FILE, "r+b") as f:
                    for e in extents:
                        for i in range(len(e.pages)):
                            f.seek(e.offset + i * bb + 7)
                            byte = f.read(1)[0]
                            f.seek(e.offset + i * bb + 7)
                            f.write(bytes([byte ^ 0x01]))

        hook = model.register_forward_hook(damage_after_the_prefill, with_kwargs=True)
        with pytest.raises(ChecksumError, match="stored pages were deleted: the next generate"):
            run(model, ids, new=16)
        hook.remove()
        assert store.list("kvdrive") == []
        again = run(model, ids, new=16)  # prefilled in full, and stored again
        handle.detach()
        assert len(store.list("kvdrive")) == 1
    assert torch.equal(again.sequences, first.sequences)
    assert d.alive()
