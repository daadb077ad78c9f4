"""``kvdrive-bench tier`` end to end, with a few blocks through both adapters."""

import json
import subprocess
import sys

import pytest

from kvdrive.tools.engines import install_engine


@pytest.fixture(scope="module")
def engines():
    return [install_engine(name) for name in ("vllm", "sglang")]


def test_a_short_run_moves_blocks_through_both_adapters_and_both_tiers(tmp_path, engines):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "tier", "--blocks", "8", "--modes", "rate", "--dir",
           str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["adapter"], r["tier"], r["op"]) for r in rows} == {
        (a, t, op) for a in ("vllm", "sglang") for t in ("dram", "ssd")
        for op in ("store", "load", "disk seq read", "disk seq write")}
    for r in rows:
        assert r["blocks"] == 8 and r["gbps"] > 0 and r["seconds"] > 0
        assert r["vs_memcpy"] == pytest.approx(r["gbps"] / data["memcpy_gbps"], rel=0.01)
        # Stores are set against the disk's sequential write too; loads against its read only.
        assert (r["vs_disk_write"] is None) == (r["op"] in ("load", "disk seq read"))
    write = {(r["adapter"], r["tier"]): r["gbps"] for r in rows if r["op"] == "disk seq write"}
    for r in rows:
        if r["op"] == "store":
            assert r["vs_disk_write"] == pytest.approx(r["gbps"] / write[r["adapter"], r["tier"]], rel=0.01)
    assert "vs disk seq read" in proc.stdout and "vs disk seq write" in proc.stdout and "memcpy here" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]  # every daemon's directory is gone


def test_loads_during_stores_and_a_fill_print_their_ratios(tmp_path, engines):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "tier", "--modes", "contention,fill", "--rounds", "1",
           "--loads", "3", "--fill-dram", "16M", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["adapter"] for r in data["contention"]] == [r["adapter"] for r in data["fill"]] == ["vllm", "sglang"]
    for r in data["contention"]:
        assert r["loads"] == 3 and 0 < r["p50_alone_ms"] <= r["p99_alone_ms"] and 0 < r["p50_during_ms"]
        assert r["p99_ratio"] == pytest.approx(r["p99_during_ms"] / r["p99_alone_ms"], rel=1e-6)
        assert r["store_gbps_during"] > 0  # stores did run meanwhile
    for r in data["fill"]:
        assert r["dram_bytes"] == 16 << 20 and r["stored_bytes"] >= 10 * r["dram_bytes"]
        assert r["ratio"] == pytest.approx(r["last_tenth_gbps"] / r["first_tenth_gbps"], rel=1e-6)
    assert "p99 during / alone" in proc.stdout and "last / first" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


def test_an_unknown_adapter_or_mode_is_refused():
    for flag, value in (("--adapters", "trt"), ("--modes", "speed")):
        proc = subprocess.run([sys.executable, "-m", "kvdrive.tools.bench", "tier", flag, value],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"unknown adapter, tier or mode ['{value}']" in proc.stderr
