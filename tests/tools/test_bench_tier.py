"""``kvdrive-bench tier`` end to end, with a few small blocks through both adapters.

Every mode runs once, in one run shared by the tests below (each daemon's start, the
engines' imports and the blocks' making are what cost on a small machine); each test
checks its own part of that run's JSON and printout.
"""

import json
import subprocess
import sys

import pytest

from kvdrive.tools.bench import main
from kvdrive.tools.bench_tier import ENGINE_OWN
from kvdrive.tools.engines import install_engine

ADAPTERS, TIERS, SYNCS = ("vllm", "sglang"), ("dram", "ssd"), ("durable", "write-behind")
DISK_OPS = ("disk seq read", "disk seq write")


@pytest.fixture(scope="module")
def engines():
    return [install_engine(name) for name in ADAPTERS]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory, engines):
    """Every mode at once: 8 blocks of 64 KiB for the rates, 1 round of 3 loads a side for
    the contention, a fill of 10 x a 2 MiB DRAM tier; its JSON, its printout and its
    directory."""
    where = tmp_path_factory.mktemp("tier")
    out = where / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "tier", "--blocks", "8", "--layers", "1", "--modes",
           "rate,contention,fill", "--rounds", "1", "--loads", "3", "--fill-dram", "2M", "--dir", str(where),
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout, where


def test_every_daemon_and_every_engines_own_backend_is_gone_after_the_run(one_run):
    _, _, where = one_run
    assert sorted(p.name for p in where.iterdir()) == ["rows.json"]


def test_rates_through_both_adapters_both_tiers_both_sync_policies_and_the_engines_own(one_run):
    data, stdout, _ = one_run
    rows = data["rows"]
    kvdrive = {(a, t, s, op) for a in ADAPTERS for t in TIERS for s in SYNCS for op in ("store", "load", *DISK_OPS)}
    own = {(a, "fs", "none", op) for a in ADAPTERS for op in ("store", "load")}
    assert {(r["adapter"], r["tier"], r["sync"], r["op"]) for r in rows} == kvdrive | own
    assert len(rows) == len(kvdrive | own)
    for r in rows:
        assert r["blocks"] == 8 and r["gbps"] > 0 and r["seconds"] > 0
        assert r["backend"] == ("kvdrive" if r["tier"] != "fs" else ENGINE_OWN[r["adapter"]])
        # A load against the memcpys timed beside its passes, the rest against the one before the run.
        memcpy = r["memcpy_gbps"] if r["op"] == "load" else data["memcpy_gbps"]
        assert (r["memcpy_gbps"] is None) == (r["op"] != "load") and memcpy > 0
        assert r["vs_memcpy"] == pytest.approx(r["gbps"] / memcpy, rel=0.01)
        # KVDrive's stores are set against the disk's sequential write too; loads against its read only; the
        # engines' own backends against neither (they have no one data file), but KVDrive against them.
        assert (r["vs_disk_write"] is None) == (r["op"] in ("load", "disk seq read") or r["tier"] == "fs")
        assert (r["vs_disk_seq"] is None) == (r["tier"] == "fs")
        assert (r["vs_engine"] is None) == (r["tier"] == "fs" or r["op"] in DISK_OPS)
    assert "vs disk seq read" in stdout and "vs disk seq write" in stdout and "memcpy here" in stdout


def test_the_disk_write_and_the_loads_are_medians_with_their_ranges_and_stores_are_set_against_the_write(one_run):
    data, stdout, _ = one_run
    rows = data["rows"]
    write = {(r["adapter"], r["tier"], r["sync"]): r for r in rows if r["op"] == "disk seq write"}
    assert len(write) == len(ADAPTERS) * len(TIERS) * len(SYNCS)
    for w in write.values():
        assert 0 < w["gbps_min"] <= w["gbps"] <= w["gbps_max"]
        assert f"{w['gbps_min']:.2f}-{w['gbps_max']:.2f}" in stdout  # the range is printed beside the median
    for r in rows:
        if r["op"] == "store" and r["backend"] == "kvdrive":
            assert r["vs_disk_write"] == pytest.approx(r["gbps"] / write[r["adapter"], r["tier"], r["sync"]]["gbps"],
                                                       rel=0.01)
        if r["op"] == "load":  # LOAD_PASSES of them, ours and the engines' own
            assert 0 < r["gbps_min"] <= r["gbps"] <= r["gbps_max"]
            assert f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}" in stdout
        elif r["op"] != "disk seq write":
            assert r["gbps_min"] is None and r["gbps_max"] is None


def test_kvdrive_is_set_against_the_engines_own_backend_and_the_targets_are_printed(one_run):
    data, stdout, _ = one_run
    rows = data["rows"]
    own = {(r["adapter"], r["op"]): r["gbps"] for r in rows if r["tier"] == "fs"}
    for r in rows:
        if r["vs_engine"] is not None:
            assert r["vs_engine"] == pytest.approx(r["gbps"] / own[r["adapter"], r["op"]], rel=0.01)
    targets = {(t["adapter"], t["tier"], t["sync"], t["op"]): t for t in data["targets"]}
    assert set(targets) == ({(a, t, s, "store") for a in ADAPTERS for t in TIERS for s in SYNCS}
                            | {(a, "dram", s, "load") for a in ADAPTERS for s in SYNCS})
    moved = {(r["adapter"], r["tier"], r["sync"], r["op"]): r for r in rows if r["tier"] != "fs"}
    for key, t in targets.items():
        if t["op"] == "load":
            assert (t["against"], t["target"], t["ratio"]) == ("memcpy", 0.5, moved[key]["vs_memcpy"])
        elif t["sync"] == "write-behind":
            assert (t["against"], t["target"], t["ratio"]) == (ENGINE_OWN[t["adapter"]], 1.0, moved[key]["vs_engine"])
        else:
            assert (t["against"], t["target"], t["ratio"]) == ("disk seq write", 0.8, moved[key]["vs_disk_write"])
        assert t["met"] == (t["ratio"] >= t["target"])
        assert f"{t['what']}: {t['ratio']:.3f}x (target >= {t['target']:.1f}: {'met' if t['met'] else 'missed'})" \
            in stdout
    assert "vllm dram write-behind store / vllm fs tier store: " in stdout
    assert "sglang ssd durable store / disk seq write (median " in stdout
    assert "vllm dram load (durable) / memcpy: " in stdout


def test_loads_during_stores_and_a_fill_print_their_ratios(one_run):
    data, stdout, _ = one_run
    assert [r["adapter"] for r in data["contention"]] == [r["adapter"] for r in data["fill"]] == list(ADAPTERS)
    for r in data["contention"]:
        assert r["loads"] == 3 and 0 < r["p50_alone_ms"] <= r["p99_alone_ms"] and 0 < r["p50_during_ms"]
        assert r["p99_ratio"] == pytest.approx(r["p99_during_ms"] / r["p99_alone_ms"], rel=1e-6)
        assert r["store_gbps_during"] > 0  # stores did run meanwhile
    for r in data["fill"]:
        assert r["dram_bytes"] == 2 << 20 and r["stored_bytes"] >= 10 * r["dram_bytes"]
        assert r["ratio"] == pytest.approx(r["last_tenth_gbps"] / r["first_tenth_gbps"], rel=1e-6)
    assert "p99 during / alone" in stdout and "last / first" in stdout


def test_a_chosen_sync_policy_without_the_baselines_runs_only_those_rows(tmp_path, engines):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "tier", "--blocks", "2", "--layers", "1", "--modes", "rate",
           "--adapters", "sglang-staging,vllm-staging", "--tiers", "ssd", "--sync", "write-behind", "--no-baselines", "--dir",
           str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert sorted(r["op"] for r in data["rows"]) == sorted(["store", "load", *DISK_OPS] * 2)
    assert {(r["adapter"], r["tier"], r["sync"], r["backend"]) for r in data["rows"]} == {
        ("sglang-staging", "ssd", "write-behind", "kvdrive"), ("vllm-staging", "ssd", "write-behind", "kvdrive")}
    # No engine's own backend ran: nothing to set the write-behind store against, and no durable store.
    assert data["targets"] == [] and all(r["vs_engine"] is None for r in data["rows"])


def test_an_unknown_adapter_sync_or_mode_is_refused(capsys):
    for flag, value in (("--adapters", "trt"), ("--sync", "lazy"), ("--modes", "speed")):
        assert main(["tier", flag, value]) == 2
        assert f"unknown adapter, tier, sync or mode ['{value}']" in capsys.readouterr().err
