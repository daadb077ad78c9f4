"""``kvdrive-bench fidelity``: its measuring parts on a tiny model, then a short SmolLM2 run end to end."""

import json
import math
import subprocess

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvdrive.tools import bench
from kvdrive.tools.bench_common import InputError, PrefillSnapshot, TraceObserver, compare, teacher_force
from kvdrive.tools import corpus
from kvdrive.tools.bench_fidelity import (FidelityRow, RecallObserver, run_selectors, summarize_windows,
                                           window_offsets, window_plan, worst_target_lines)
from kvdrive_client import attach
from kvdrive_client.selectors import IndexKind

FIDELITY_KEYS = {"selector", "budget", "context", "text_window", "text_kind", "offset", "recall", "dloss", "kl", "top1",
                 "text_top1", "dense_text_top1", "index_bytes", "kv_bytes", "select_ms", "cache_bytes"}
CACHE_KEYS = {"selector", "budget", "context", "window", "capacity", "policy", "hits", "lookups", "hit_rate"}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 512, (1, 420), generator=torch.Generator().manual_seed(1))
    return model, ids[:, :400], ids[:, 400:412]


def test_replayed_prefill_decodes_exactly_like_a_real_one(tiny, daemon):
    model, ctx, fed = tiny
    with torch.no_grad(), daemon.client() as store:
        snapshot = PrefillSnapshot.capture(model, store, ctx)
        plain = DynamicCache(config=model.config)
        model(input_ids=ctx, cache=plain)
        assert torch.equal(teacher_force(model, plain, fed), teacher_force(model, snapshot.dense_cache(model.config), fed))
        outs = []
        for replay in (False, True):
            handle = attach(model, store, budget=0.0625, index="hierarchical")
            cache = handle.new_cache(1)
            if replay:
                snapshot.replay(cache)
            else:
                model(input_ids=ctx, cache=cache)
            outs.append(teacher_force(model, cache, fed))
            cache.close()
            handle.detach()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("budget", [1.0, 0.0625])
def test_recall_is_one_at_full_budget_and_the_trace_covers_every_stream(tiny, daemon, budget):
    model, ctx, fed = tiny
    with torch.no_grad(), daemon.client() as store:
        handle = attach(model, store, budget=budget, index="hierarchical")
        cache = handle.new_cache(1)
        recall, tracer = RecallObserver(cache.session), TraceObserver()
        cache.session.add_observer(recall)
        cache.session.add_observer(tracer)
        model(input_ids=ctx, cache=cache)
        teacher_force(model, cache, fed)
        cache.close()
        handle.detach()
    assert recall.count == 2 * 2 * fed.shape[1]  # layers x KV heads x steps
    if budget == 1.0:
        assert recall.recall == pytest.approx(1.0, abs=1e-6)
    else:
        assert 0 < recall.recall < 1
    trace = tracer.trace()
    assert (trace.num_streams, trace.num_steps) == (2 * 2, fed.shape[1])
    assert trace.scores.shape[2] >= trace.selected.max() + 1
    assert trace.max_selected >= 1


def test_selectors_side_by_side_decode_as_each_does_alone(tiny, daemon):
    model, ctx, fed = tiny
    kinds = [IndexKind.LOWRANK, IndexKind.HIERARCHICAL, IndexKind.QUEST]
    with torch.no_grad(), daemon.client() as store:
        snapshot = PrefillSnapshot.capture(model, store, ctx)
        together = run_selectors(model, store, snapshot, fed, kinds, 0.25, traced=IndexKind.LOWRANK)
        alone = {kind: run_selectors(model, store, snapshot, fed, [kind], 0.25)[kind] for kind in kinds}
    for kind in kinds:
        logits, info = together[kind]
        assert logits.shape == (fed.shape[1], model.config.vocab_size)
        assert torch.equal(logits, alone[kind][0]), kind
        assert info["recall"] == pytest.approx(alone[kind][1]["recall"], abs=1e-12)
        assert info["index_bytes"] == alone[kind][1]["index_bytes"] and info["select_ms"] > 0
        assert (info["trace"] is not None) == (kind is IndexKind.LOWRANK)
    assert together[IndexKind.LOWRANK][1]["trace"].num_steps == fed.shape[1]


@pytest.fixture(scope="module")
def tiny_hybrid():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=48,
                           query_pre_attn_scalar=32, max_position_embeddings=2048,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(1, 512, (1, 420), generator=torch.Generator().manual_seed(1))
    return model, ids[:, :400], ids[:, 400:412]


@pytest.mark.parametrize("chunk", [None, 96])
def test_hybrid_snapshot_replays_global_and_sliding_layers(tiny_hybrid, daemon, chunk):
    """One-pass or chunked, a snapshot's dense replay decodes like a plain prefill, and a
    KVDrive session replayed at budget 1.0 decodes like the dense replay."""
    model, ctx, fed = tiny_hybrid
    with torch.no_grad(), daemon.client() as store:
        snapshot = PrefillSnapshot.capture(model, store, ctx, chunk=chunk)
        assert len(snapshot.layers) == 1 and sorted(snapshot.sliding) == [0, 2]
        plain = DynamicCache(config=model.config)
        model(input_ids=ctx, cache=plain)
        dense = teacher_force(model, snapshot.dense_cache(model.config), fed)
        assert (teacher_force(model, plain, fed) - dense).abs().max() < 1e-4
        handle = attach(model, store, budget=1.0)
        cache = handle.new_cache(1)
        snapshot.replay(cache)
        assert (teacher_force(model, cache, fed) - dense).abs().max() < 1e-4
        cache.close()
        handle.detach()


def test_compare_against_itself_and_against_another_distribution():
    a = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    targets = torch.arange(5)
    assert compare(a, a, targets) == (0.0, 0.0, 1.0)
    dloss, kl, top1 = compare(torch.zeros_like(a), a, targets)
    assert kl > 0 and top1 == 0.0
    assert dloss == pytest.approx(float(math.log(50) + torch.log_softmax(a, -1)[targets, targets].mean()))


@pytest.fixture
def bench_fidelity(capsys):
    """``kvdrive-bench fidelity ARGV`` in this process (a child would import torch and transformers
    again): its exit status, stdout and stderr. The bench sets torch's thread count (``--threads``,
    default 1); the process's own is restored after it."""
    threads = torch.get_num_threads()

    def run(*argv: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            rc = bench.main(["fidelity", *argv])
        finally:
            torch.set_num_threads(threads)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(["kvdrive-bench", "fidelity", *argv], rc, captured.out, captured.err)

    return run


def test_quick_run_end_to_end(tmp_path, bench_fidelity):
    out = tmp_path / "rows.json"
    proc = bench_fidelity("--quick", "--context", "512", "--tokens", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    rows = doc["fidelity"]
    assert [(r["selector"], r["budget"], r["context"], r["text_window"], r["offset"]) for r in rows] == [
        (s, 0.0625, 512, 0, 0) for s in ("oracle", "lowrank", "hierarchical", "meankey", "quest")]
    for r in rows:
        assert set(r) == FIDELITY_KEYS
        assert r["text_kind"] == "licences"
        for key in FIDELITY_KEYS - {"selector", "text_kind"}:
            assert math.isfinite(r[key]), (r["selector"], key)
        assert 0 < r["recall"] <= 1 + 1e-6 and 0 <= r["top1"] <= 1 and r["kl"] >= -1e-9
        assert 0 <= r["text_top1"] <= 1 and 0 <= r["dense_text_top1"] <= 1
        assert r["index_bytes"] > 0 and r["select_ms"] > 0 and 0 < r["cache_bytes"] < r["kv_bytes"]
        assert r["kv_bytes"] == 2 * 30 * 3 * 64 * 4 * 512  # SmolLM2's K+V in float32 at the context
    by = {r["selector"]: r for r in rows}
    # The oracle picks by exact mass, so no selector recalls more at the same budget.
    assert all(by["oracle"]["recall"] >= r["recall"] - 1e-6 for r in rows)
    assert by["hierarchical"]["index_bytes"] < by["quest"]["index_bytes"]
    assert by["lowrank"]["index_bytes"] < 0.1 * by["lowrank"]["kv_bytes"]
    cache = doc["cache"]
    assert [(r["window"], r["policy"]) for r in cache] == [
        (w, p) for w in (1, 2, 4) for p in ("lookahead", "lru", "belady")]
    for r in cache:
        assert set(r) == CACHE_KEYS and r["selector"] == "lowrank" and r["budget"] == 0.0625  # attach()'s default
        assert 0 <= r["hits"] <= r["lookups"] and r["hit_rate"] == pytest.approx(r["hits"] / r["lookups"])
    for w in (1, 2, 4):
        rates = {r["policy"]: r["hits"] for r in cache if r["window"] == w}
        assert rates["belady"] >= max(rates["lookahead"], rates["lru"])
    assert "selector" in proc.stdout and "hit_rate" in proc.stdout
    # hierarchical vs meankey / quest (3), lookahead vs belady (1), lowrank vs dense / kv / hierarchical / oracle (4)
    assert proc.stdout.count("target: ") == 8 and ("PASS" in proc.stdout or "MISS" in proc.stdout)
    assert "lowrank recall >= 0.93 x oracle's" in proc.stdout


def test_subcommand_is_registered_and_bad_options_are_refused(capsys):
    assert "fidelity" in bench.BENCHMARKS
    assert bench.main(["fidelity", "--context", "100"]) == 2
    assert "--context must be at least" in capsys.readouterr().err
    assert bench.main(["fidelity", "--budget", "1.5"]) == 2
    assert "--budget takes fractions" in capsys.readouterr().err
    assert bench.main(["fidelity", "--threads", "-1"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err
    assert bench.main(["fidelity", "--windows", "0"]) == 2
    assert "--windows must be >= 1" in capsys.readouterr().err
    assert bench.main(["fidelity", "--tokens", "0"]) == 2
    assert "--tokens must be >= 1" in capsys.readouterr().err
    assert bench.main(["fidelity", "--rank", "0"]) == 2
    assert "--rank must be a whole number in 1..4096" in capsys.readouterr().err
    assert bench.main(["fidelity", "--int8-channels", "-2"]) == 2
    assert "--int8-channels must be a whole number in 0..4096 or None (the default layout), got -2" in capsys.readouterr().err
    assert bench.main(["fidelity", "--int2-channels", "-1"]) == 2
    assert "--int2-channels must be a whole number in 0..4096" in capsys.readouterr().err


def test_text_windows_start_at_the_text_and_end_with_it_without_overlap():
    assert window_offsets(1000, 300, 1) == [0]
    assert window_offsets(1000, 300, 3) == [0, 350, 700]
    assert window_offsets(900, 300, 3) == [0, 300, 600]
    with pytest.raises(InputError, match="at most 2"):
        window_offsets(899, 300, 3)
    with pytest.raises(InputError, match="needs 300"):
        window_offsets(299, 300, 1)


def test_a_corpus_gives_each_kind_its_windows_and_leaves_out_a_text_too_short():
    sources = {"long": torch.zeros(1, 1000), "short": torch.zeros(1, 450), "tiny": torch.zeros(1, 100)}
    skipped = {}
    plan = window_plan(sources, need=300, windows=3, strict=False, skipped=skipped)
    assert plan == [("long", 0), ("long", 350), ("long", 700), ("short", 0)]
    assert set(skipped) == {"short", "tiny"} and "1 of 3 windows" in skipped["short"]
    with pytest.raises(InputError, match="at most 1"):
        window_plan({"short": torch.zeros(1, 450)}, need=300, windows=3, strict=True, skipped={})


def test_the_built_in_corpus_holds_at_least_four_kinds_of_text_and_a_directory_its_own(tmp_path):
    texts, missing = corpus.default_corpus()
    assert len(texts) >= 4, missing
    assert "licences" not in texts and all(len(t) >= corpus.MIN_CHARS for t in texts.values())
    (tmp_path / "notes.txt").write_text("a" * 100)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "b.log").write_text("second\n")
    (tmp_path / "logs" / "a.log").write_text("first\n")
    assert corpus.corpus_from_dir(tmp_path) == {"logs": "first\n\n\nsecond\n", "notes": "a" * 100}
    with pytest.raises(ValueError, match="not a directory"):
        corpus.corpus_from_dir(tmp_path / "notes.txt")


def row(selector, window, dloss, recall, kind="k", kl=0.01, top1=0.9, budget=0.0625):
    return FidelityRow(selector, budget, 7168, window, kind, 0, recall, dloss, kl, top1, 0.8, 0.85, 1, 10, 1.0, 1)


def test_the_worst_window_is_named_beside_the_mean_with_the_oracle_there():
    rows = [row("oracle", 0, 0.01, 0.8), row("oracle", 1, 0.07, 0.6, "code"),
            row("lowrank", 0, 0.03, 0.76), row("lowrank", 1, 0.31, 0.5, "code", kl=0.12)]
    by = {w.selector: w for w in summarize_windows(rows)}
    lr = by["lowrank"]
    assert lr.windows == 2 and lr.mean_dloss == pytest.approx(0.17)
    assert (lr.worst.text_window, lr.worst.text_kind) == (1, "code") and lr.oracle_on_worst.dloss == 0.07
    assert lr.worst_kl == 0.12 and lr.min_recall_vs_oracle == pytest.approx(0.5 / 0.6)
    assert lr.least_top1.top1 == 0.9


def test_a_corpus_run_judges_the_largest_index_and_the_median_selection_time():
    def timed(selector, window, index_bytes, select_ms):
        return FidelityRow(selector, 0.0625, 7168, window, "k", 0, 0.8, 0.01, 0.01, 0.9, 0.9, 0.9, index_bytes, 1000,
                           select_ms, 1)

    rows = [timed("hierarchical", w, 5, 4.0) for w in range(3)]
    # One window slowed by a burst on the machine does not decide the selection-time target.
    rows += [timed("lowrank", 0, 20, 5.6), timed("lowrank", 1, 24, 24.0), timed("lowrank", 2, 20, 5.2)]
    lines = worst_target_lines(rows, itemsize=4)
    index = next(x for x in lines if "index_bytes" in x)
    assert "24 / 1000" in index and "0.0480x of an fp16 K+V: PASS" in index  # the largest of the three, at fp16
    select = next(x for x in lines if "select_ms" in x)
    assert "median 1.40x (windows 1.30x to 6.00x): MISS" in select  # at most 1.25x
    rows[3:] = [timed("lowrank", 0, 20, 4.8), timed("lowrank", 1, 28, 6.4), timed("lowrank", 2, 20, 4.4)]
    lines = worst_target_lines(rows, itemsize=4)
    assert any("0.0560x of an fp16 K+V: MISS" in x for x in lines)
    assert any("median 1.20x (windows 1.10x to 1.60x): PASS" in x for x in lines)


def test_a_corpus_run_end_to_end(tmp_path, bench_fidelity):
    texts, _ = corpus.default_corpus()
    kinds = sorted(texts)[:2]
    for k in kinds:
        (tmp_path / f"{k}.txt").write_text(texts[k][:20000])
    out = tmp_path / "rows.json"
    proc = bench_fidelity("--corpus", str(tmp_path), "--context", "512", "--tokens", "4", "--windows", "1",
                          "--budget", "0.0625", "--selectors", "oracle", "lowrank", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [(r["text_kind"], r["text_window"], r["selector"]) for r in doc["fidelity"]] == [
        (k, w, s) for w, k in enumerate(kinds) for s in ("oracle", "lowrank")]
    worst = {w["selector"]: w for w in doc["windows"]}
    assert worst["lowrank"]["windows"] == 2
    assert worst["lowrank"]["worst"]["dloss"] == max(r["dloss"] for r in doc["fidelity"] if r["selector"] == "lowrank")
    assert "worst window:" in proc.stdout and "lowrank worst-window dloss <= 0.1 and" in proc.stdout
    assert "(tuning)" not in proc.stdout
