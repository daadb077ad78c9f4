"""The micro-batch pipeline, per-head windows, the x0 mode and the decode timeline."""

import json
import logging
import time

import pytest
import torch

from kvdrive_client import attach
from kvdrive_client.device_cache import DeviceCache, EvictionPolicy
from kvdrive_client.engine import ModelShape, SparseKV
from kvdrive_client.errors import RequestError
from kvdrive_client.selectors import HierarchicalIndex, LowRankIndex, MeanKeyIndex, QuestIndex, Selector
from kvdrive.kernels import cpu
from kvdrive.kernels import reference as ref


def run_engine(store, steps=24, seed=0, B=4, **options):
    """Sparse decode of random K/V through the low-level API; returns every step's outputs and the stats."""
    g = torch.Generator().manual_seed(seed)
    H, HQ, D, T, L = 2, 4, 32, 640, 2
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :70] = False  # a left-padded row
    kv = SparseKV(store, ModelShape(L, H, HQ, D, torch.float32), batch=B,
                  budget=0.125, **options)
    for layer in range(L):
        kv.prefill(layer, torch.randn(B, HQ, T, D, generator=g), torch.randn(B, H, T, D, generator=g),
                   torch.randn(B, H, T, D, generator=g), valid)
    outs = []
    for _ in range(steps):
        for layer in range(L):
            q, k, v = (torch.randn(B, n, D, generator=g) for n in (HQ, H, H))
            outs.append(kv.decode(layer, q, k, v))
    stats = dict(kv.stats)
    session = kv.session
    kv.close()
    return (torch.stack(outs) if outs else None), stats, session


@pytest.mark.parametrize("micro_batch", [1, 2, 3])
def test_pipelined_decode_equals_serial_decode(daemon, micro_batch):
    with daemon.client() as store:
        serial, s_stats, _ = run_engine(store, pipeline=False)
        piped, p_stats, session = run_engine(store, pipeline=True, micro_batch=micro_batch)
    assert session.micro_batch == micro_batch
    torch.testing.assert_close(piped, serial, atol=1e-6, rtol=1e-6)
    # The same pages were selected, hit and fetched.
    for key in ("hits", "misses", "bytes_fetched"):
        assert p_stats[key] == s_stats[key], key
    assert s_stats["misses"] > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_attending_while_misses_are_fetched_equals_one_pass(daemon, pipeline, monkeypatch):
    calls = []
    kernel = cpu.sparse_attention
    monkeypatch.setattr(cpu, "sparse_attention", lambda *a, **k: calls.append(a[3]) or kernel(*a, **k))
    with daemon.client() as store:
        one, o_stats, _ = run_engine(store, pipeline=pipeline, micro_batch=2, overlap_fetch=False)
        n_one = len(calls)
        calls.clear()
        split, s_stats, _ = run_engine(store, pipeline=pipeline, micro_batch=2, overlap_fetch=True)
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-6)
    for key in ("hits", "misses", "bytes_fetched", "attended_tokens"):
        assert s_stats[key] == o_stats[key], key
    # A micro-batch with misses attends twice: its cached pages (misses -1), then only the fetched ones.
    assert n_one < len(calls) <= 2 * n_one
    assert all((a >= 0).any() for a in calls)
    assert o_stats["misses"] > 0


def test_one_get_per_fetch_across_rows(daemon):
    with daemon.client() as store:
        before = store.stats()["counters"].get("gets", 0)
        _, stats, _ = run_engine(store, pipeline=False)
        gets = store.stats()["counters"]["gets"] - before
    assert stats["misses"] > 0
    # B = 4 rows, one sequence each, one micro-batch: at most one get per layer and step.
    assert 0 < gets <= stats["steps"] * 2


def test_a_daemon_without_gets_across_sequences_is_refused(daemon):
    with daemon.client() as store:
        store.hello()["get_seqs"] = False  # as an older daemon would answer
        with pytest.raises(RequestError, match="does not take gets across sequences"):
            run_engine(store)


def _slowed(fn, seconds=0.01):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return slow


@pytest.mark.alone
def test_the_timeline_shows_stages_of_every_micro_batch_overlapping(daemon, tmp_path, monkeypatch):
    # Tiny tensors make every stage take microseconds, and on a busy 2-core host the
    # front thread may then finish all its work before the main thread computes once.
    # Stages as long as a real model's make the overlap a property of the schedule.
    for cls in {Selector, HierarchicalIndex, LowRankIndex, MeanKeyIndex, QuestIndex}:
        if "select_and_score" in vars(cls):
            monkeypatch.setattr(cls, "select_and_score", _slowed(vars(cls)["select_and_score"]))
    # Attention: the gathered path, and on the CPU the kernel that reads the cache slots.
    monkeypatch.setattr(ref, "decode_attention", _slowed(ref.decode_attention))
    monkeypatch.setattr(cpu, "sparse_attention", _slowed(cpu.sparse_attention))
    path = tmp_path / "trace.json"
    with daemon.client() as store:
        run_engine(store, steps=6, pipeline=True, micro_batch=1, trace=str(path))
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in events}
    assert {"select", "hit/miss", "fetch", "compute"} <= names
    assert {e["args"]["mb"] for e in events if e["name"] == "compute"} == {0, 1, 2, 3}
    lanes = {e["tid"] for e in events}
    assert len(lanes) == 3  # front thread, daemon, main thread
    # Somewhere a front-thread selection runs while the main thread computes.
    front = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "select"]
    main = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "compute"]
    assert any(a0 < b1 and b0 < a1 for a0, a1 in front for b0, b1 in main)
    assert sum(1 for e in trace["traceEvents"] if e["name"] == "step") == 6


def test_micro_batch_size_is_calibrated_and_logged(daemon, caplog):
    with caplog.at_level(logging.INFO, logger="kvdrive_client.session"), daemon.client() as store:
        _, _, session = run_engine(store, steps=8, pipeline=True)
    assert session.micro_batch in (1, 2, 4)
    assert session.calibration.startswith(f"micro-batch {session.micro_batch} of 4 rows (step ms by size: 1: ")
    assert any(r.getMessage() == f"calibrated {session.calibration}" for r in caplog.records)


def test_window_calibration_grows_the_cache_and_logs_it(daemon, caplog):
    with caplog.at_level(logging.INFO, logger="kvdrive_client.session"), daemon.client() as store:
        _, _, session = run_engine(store, steps=10, cache_multiplier=None, pipeline=False)
    assert any("calibrated cache multiplier" in r.message for r in caplog.records)
    assert session.cache_multiplier >= 1.0


def test_window_zero_fetches_every_selected_page_every_step(daemon):
    with daemon.client() as store:
        _, none, _ = run_engine(store, steps=8, cache_multiplier=0, pipeline=False)
        _, cached, _ = run_engine(store, steps=8, cache_multiplier=4, pipeline=False)
    assert none["hits"] == 0
    assert none["misses"] > cached["misses"] > 0


def test_per_head_windows_cap_each_heads_slots(daemon):
    windows = ((1.0, 3.0), (2.0, 1.5))
    with daemon.client() as store:
        _, stats, session = run_engine(store, steps=8, head_multipliers=windows, pipeline=False)
        for layer, ws in enumerate(windows):
            cache = session.cache(layer)
            used = (cache.slot_page >= 0).sum(dim=2).max(dim=0).values  # per head, over rows
            assert (used <= cache.head_capacity).all()
            assert cache.head_capacity[0] != cache.head_capacity[1]
    assert stats["misses"] > 0


def test_prefill_seeds_every_head_up_to_its_own_window(daemon):
    windows = ((1.0, 3.0), (2.0, 1.5))
    with daemon.client() as store:
        _, _, session = run_engine(store, steps=0, head_multipliers=windows, pipeline=False)
    for layer in range(len(windows)):
        cache = session.cache(layer)
        seeded = (cache.slot_page >= 0).sum(dim=2)  # [rows, heads]
        assert (seeded == cache.head_capacity[None, :]).all(), (layer, seeded, cache.head_capacity)
        # Every seeded page maps back to its slot.
        b, h, slot = torch.nonzero(cache.slot_page >= 0, as_tuple=True)
        assert torch.equal(cache.page_slot[b, h, cache.slot_page[b, h, slot]], slot)


def test_a_head_limit_below_the_selection_is_refused():
    cache = DeviceCache((1, 2, 4, 16, 8), torch.float32, "cpu", EvictionPolicy.LRU)
    cache.set_head_capacity(torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="window holds 2"):
        cache.place(torch.tensor([[[0, 1, 2], [0, 1, 2]]]), 0)


def test_bad_pipeline_options_are_refused():
    from kvdrive_client.config import AttachConfig

    with pytest.raises(ValueError, match="micro_batch"):
        AttachConfig(micro_batch=0)
    with pytest.raises(ValueError, match="cache_multiplier must be 0"):
        AttachConfig(cache_multiplier=0.5)
    with pytest.raises(ValueError, match="per-head cache multiplier"):
        AttachConfig(head_multipliers=((1.0, 0.5),))


def test_the_old_window_option_names_still_work_with_a_warning():
    from dataclasses import replace

    from kvdrive_client.config import AttachConfig

    with pytest.warns(DeprecationWarning, match=r"window=\.\.\.\) is deprecated; use cache_multiplier"):
        cfg = AttachConfig(window=None)
    assert cfg.cache_multiplier is None  # None still calibrates
    with pytest.warns(DeprecationWarning, match="use head_multipliers"):
        cfg = AttachConfig(windows=((2, 3),))
    assert cfg.head_multipliers == ((2.0, 3.0),)
    # The alias is consumed: replacing another field keeps the values and warns no more.
    assert replace(cfg, cache_multiplier=2.0).head_multipliers == ((2.0, 3.0),)
    with pytest.raises(ValueError, match="cache_multiplier must be 0"), pytest.warns(DeprecationWarning):
        AttachConfig(window=0.5)


def test_pipelined_generate_is_token_identical_to_serial(daemon, make_tiny):
    model = make_tiny("qwen2", layers=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 512, (4, 400), generator=g)
    outs = {}
    with daemon.client() as store:
        for pipeline in (False, True):
            handle = attach(model, store, budget=0.1, pipeline=pipeline, micro_batch=2)
            with torch.no_grad():
                outs[pipeline] = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
            handle.detach()
    assert torch.equal(outs[True], outs[False])


def test_pipeline_runs_with_grad_mode_on_and_an_index_built_from_tensors_that_require_grad(daemon):
    g = torch.Generator().manual_seed(5)
    B, H, HQ, D, T = 2, 2, 4, 32, 400
    with daemon.client() as store, torch.enable_grad():
        kv = SparseKV(store, ModelShape(1, H, HQ, D, torch.float32), batch=B,
                      budget=0.125, micro_batch=1)
        keys = torch.randn(B, H, T, D, generator=g).requires_grad_()
        kv.prefill(0, torch.randn(B, HQ, T, D, generator=g), keys, torch.randn(B, H, T, D, generator=g))
        for _ in range(3):
            q, k, v = (torch.randn(B, n, D, generator=g) for n in (HQ, H, H))
            assert torch.isfinite(kv.decode(0, q, k, v)).all()
        kv.close()
