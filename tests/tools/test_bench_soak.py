"""``kvdrive-bench soak`` end to end, on a quota small enough for a test run."""

import json
import subprocess
import sys

import pytest

from kvdrive.tools import bench


def test_a_quick_soak_fills_the_quota_evicts_and_loads_the_bytes_it_stored(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "soak", "--quick", "--minutes", "0.2", "--interval", "3",
           "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]  # the daemon's directory is gone
    doc = json.loads(out.read_text())
    rows, info = doc["rows"], doc["info"]
    assert info["in_place"] is True and info["daemon_exit"] is None and info["error"] is None
    assert len(rows) == 4 and [r["seconds"] for r in rows] == sorted(r["seconds"] for r in rows)
    assert rows[-1]["stored_bytes"] > 64 << 20 and rows[-1]["evicted"] > 0  # past the quota: evicting
    for r in rows:
        assert r["wrong_blocks"] == 0 and r["failed_stores"] == 0, r
        assert r["loads"] > 0 and 0 < r["load_p50_ms"] <= r["load_p99_ms"], r
        assert 0 < r["store_p50_ms"] <= r["store_p99_ms"] and r["store_gbps"] > 0, r
        assert r["rss_mib"] > 0 and r["maps"] > 0 and r["fds"] > 0 and r["threads"] > 0 and r["data_mib"] > 0, r
    # Recent jobs are held (half the loads pick one): some loads hit; old ones were evicted: some miss.
    assert 0 < sum(r["hit_rate"] for r in rows) / len(rows) < 1
    assert "wrong blocks loaded: 0" in proc.stdout and "steady state" in proc.stdout


@pytest.mark.parametrize("options, message", [
    (["--minutes", "0"], "--minutes must be above 0"),
    (["--block-kib", "6"], "multiple of 4 KiB"),
    (["--quota", "lots"], "lots"),
])
def test_bad_options_are_refused(capsys, options, message):
    assert bench.main(["soak", *options]) == 2
    assert message in capsys.readouterr().err
