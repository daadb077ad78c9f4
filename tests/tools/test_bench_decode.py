"""kvdrive-bench decode: the --quick path end to end (shrunk further), and its input checks."""

import json

import pytest

from kvdrive.tools import bench_decode
from kvdrive.tools.bench import main

JSON_KEYS = {"workload", "config", "tier", "batch", "tokens_per_s", "bytes_per_step_dram", "bytes_per_step_ssd",
             "hit_rate", "select_ms", "fetch_ms", "compute_ms", "step_ms"}


def test_quick_run_prints_every_configuration_and_writes_json(tmp_path, capsys):
    out = tmp_path / "decode.json"
    png = tmp_path / "decode.png"
    rc = main(["decode", "--quick", "--batches-a", "1", "--context-a", "512", "--steps-a", "4", "--layers-b", "1",
               "--context-b", "2048", "--steps-b", "2", "--json", str(out), "--png", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert all(JSON_KEYS <= set(r) for r in rows)
    configs = {c.name for c in bench_decode.configurations(pipeline_variants=False)}
    for workload in ("a", "b"):
        assert {r["config"] for r in rows if r["workload"] == workload} == configs
        tiers = {r["tier"] for r in rows if r["workload"] == workload and r["config"] != "dense"}
        assert tiers == {"dram", "dram+ssd"}
    assert [r["config"] for r in rows if r["workload"] == "c"] == ["kvdrive+pipe"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
        if r["config"] != "dense":
            assert r["bytes_per_step_dram"] + r["bytes_per_step_ssd"] > 0, r
    ssd = [r for r in rows if r["tier"] == "dram+ssd" and r["config"] == "whole-layer"]
    assert all(r["bytes_per_step_ssd"] > 0 for r in ssd)
    # Fidelity figures where the real model runs; the dense row is the reference.
    assert all(r["kl"] is not None for r in rows if r["workload"] == "a" and r["config"] != "dense")
    for needle in ("target 1:", "target 2:", "target 3:", "target 4:", "target 5:", "locality:", "system costs only"):
        assert needle in text, needle
    # Target 1's tokens/s ratio comes from (b)'s side-by-side run; the one-after-the-other rows are information.
    lines = text.splitlines()
    side = [l for l in lines if l.startswith("target 1: (b) dram, side by side: kvdrive (kvdrive")]
    assert len(side) == 1
    mine, shadow = float(side[0].split(") ")[2].split()[0]), float(side[0].split("/ shadowkv ")[1].split()[0])
    printed = float(side[0].split(" = ")[1].split("x")[0])
    assert mine > 0 and shadow > 0 and printed == pytest.approx(mine / shadow, abs=0.011)  # from rounded figures
    assert sum(l.startswith("info: (b) dram: kvdrive") and "one after the other" in l for l in lines) == 1
    assert png.stat().st_size > 0


def test_the_default_and_hierarchical_index_and_the_two_sketches_also_decode_side_by_side(capsys):
    rc = main(["decode", "--quick", "--workloads", "a", "--configs",
               "kvdrive+pipe,kvdrive-hierarchical+pipe,kvdrive-rank16+pipe",
               "--batches-a", "2", "--context-a", "512", "--steps-a", "4"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    side = [l for l in lines if l.startswith("target index: (a) batch 2") and "side by side" in l]
    assert [l.split(",")[0].split(" batch 2 ")[1] for l in side] == ["dram", "dram+ssd"]
    for line in side:
        head, tail = line.split(" tok/s vs the hierarchical index ")
        mine, hier = float(head.split()[-1]), float(tail.split()[0])
        printed = float(tail.split("(")[1].split("x)")[0])
        # The line's ratio is of the unrounded figures (each printed to 0.005): 17.17 / 14.25 as 1.21x.
        assert mine > 0 and hier > 0
        assert (mine - 0.005) / (hier + 0.005) - 0.005 <= printed <= (mine + 0.005) / (hier - 0.005) + 0.005
        assert "PASS" in tail or "MISS" in tail
    # The one-after-the-other rows are still printed, as information.
    assert sum(l.startswith("info: (a) batch 2") and "one after the other" in l for l in lines) == 2
    sketch = [l for l in lines if l.startswith("target sketch: (a) batch 2") and "side by side" in l]
    assert [l.split(",")[0].split(" batch 2 ")[1] for l in sketch] == ["dram", "dram+ssd"]
    for line in sketch:
        head, tail = line.split(" tok/s vs the rank-16 int8/int4 sketch ")
        assert float(head.split()[-1]) > 0 and float(tail.split()[0]) > 0
        assert "PASS" in tail or "MISS" in tail


@pytest.mark.parametrize("argv, message", [
    (["--context-a", "100"], "multiple of 16"),
    (["--workloads", "a,x"], "takes a, b and c"),
    (["--text", "/nonexistent/text.txt"], "no such file"),
    (["--quick", "--steps-a", "2"], "warm-up"),
    (["--batches-a", "0"], "batch sizes"),
    (["--configs", "kvdrive+pipe,nope"], "unknown nope"),
    (["--device", "cuda"], "add --workloads b,c"),
])
def test_bad_options_are_refused_before_anything_runs(argv, message, capsys):
    assert main(["decode", *argv]) == 2
    assert message in capsys.readouterr().err


def test_knobs_and_defaults():
    cfg = bench_decode.BenchConfig()
    assert (cfg.context_a, cfg.context_b, cfg.layers_b, cfg.batch_b) == (7168, 32768, 8, 4)
    names = [c.name for c in bench_decode.configurations()]
    assert names[:4] == list(bench_decode.BASELINES)
    assert {"kvdrive+pipe", "kvdrive-pipe", "kvdrive-profile+pipe", "kvdrive-profile-pipe"} <= set(names)
    by = {c.name: c for c in bench_decode.configurations()}
    # KVDrive rows run attach()'s default index; one row runs the hierarchical one beside it.
    assert "index" not in by["kvdrive+pipe"].options
    assert by["kvdrive-hierarchical+pipe"].options["index"].value == "hierarchical"
    assert "kvdrive-hierarchical+pipe" not in {c.name for c in bench_decode.configurations(pipeline_variants=False)}
    # ... and one the earlier sketch, in (a) only (its rank is SmolLM2's quarter head dim).
    old = by["kvdrive-rank16+pipe"]
    assert (old.options["rank"], old.options["int8_channels"], old.a_only) == (16, 8, True)
    assert set(bench_decode.SIDE_BY_SIDE_A.values()) == {("kvdrive+pipe", "kvdrive-hierarchical+pipe"),
                                                         ("kvdrive+pipe", "kvdrive-rank16+pipe")}


def test_overlap_observer_averages_consecutive_selections_per_layer():
    import torch

    obs = bench_decode.OverlapObserver()
    steps = [torch.tensor([[[1, 2, 3, 4]]]), torch.tensor([[[1, 2, 5, 6]]]), torch.tensor([[[1, 2, 5, -1]]])]
    for step, chosen in enumerate(steps):
        for layer in (0, 1):
            obs.on_select(layer, step, None, chosen, None, None)
    steps[0][0, 0, 0] = 9  # the observer keeps copies
    # per layer: 2/4 then 3/3 (the -1 is no page)
    assert obs.overlap == pytest.approx((0.5 + 1.0) / 2)
